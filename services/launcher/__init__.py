"""`python -m services.launcher` (what `make run` runs): start the whole stack on one machine.

Starts speaker_cache, the aligner (with `--aligner`), N code2wav replicas, the talker and the
gateway as separate processes (`python -m services.<name> ...`), waits until every one reports SERVING through grpc.health.v1,
prints where everything listens and a `curl` line that produces a wav, and on Ctrl-C/SIGTERM stops
them all (SIGTERM, then SIGKILL after a grace period). Logs go to `run/logs/<service>.log`.

Every service runs tethered to the process that started it (services/tether.py): a launcher that
dies, SIGKILL included, takes the services with it. A start on ports that something already holds
(an earlier stack still running) fails at once, naming the ports, instead of mistaking the old
stack's health answers for the new one's.

Layout, in the order a start walks it: `settings.py` (flags -> `StackConfig`), `config.py`
(`StackConfig` and its ports), `ports.py` (free ports, ports already held), `specs.py` (each
service's command line), `processes.py` (one service process: start, wait until SERVING, stop),
`stack.py` (`start_stack`, `Stack`), `welcome.py` (what is printed once it is up), and
`__main__.py` (start, supervise until Ctrl-C, stop).

The names below (`StackConfig`, `start_stack`, `Stack.stop`, `start_service`, ...) are also what
the end-to-end tests use to run the stack on free ports.
"""

from services.launcher.config import DEFAULT_LOG_DIR, SERVICE_NAMES, StackConfig, default_code2wav_ports
from services.launcher.ports import free_port, ports_in_use
from services.launcher.processes import (
    ROOT,
    ServiceProcess,
    ServiceSpec,
    StartupError,
    StartupInterrupted,
    health_status,
    start_service,
    stop_services,
    wait_serving,
)
from services.launcher.settings import SETTINGS, LauncherSettings, config_from_args
from services.launcher.specs import (
    aligner_spec,
    code2wav_specs,
    gateway_spec,
    model_flags,
    speaker_cache_spec,
    stack_specs,
    talker_spec,
)
from services.launcher.stack import Stack, start_stack
from services.launcher.welcome import access_note, demo_request, describe

__all__ = [
    "DEFAULT_LOG_DIR",
    "ROOT",
    "SERVICE_NAMES",
    "SETTINGS",
    "LauncherSettings",
    "ServiceProcess",
    "ServiceSpec",
    "Stack",
    "StackConfig",
    "StartupError",
    "StartupInterrupted",
    "access_note",
    "aligner_spec",
    "code2wav_specs",
    "config_from_args",
    "default_code2wav_ports",
    "demo_request",
    "describe",
    "free_port",
    "gateway_spec",
    "health_status",
    "model_flags",
    "ports_in_use",
    "speaker_cache_spec",
    "stack_specs",
    "start_service",
    "start_stack",
    "stop_services",
    "talker_spec",
    "wait_serving",
]
