"""Settings and checks every service's config shares: listen address, ports, drain, logging, GIL
switch interval, connection aging, the internal token.

Each service keeps its own frozen config dataclass (qtts/serving/settings.py makes its flags and
`TTS_<SERVICE>_<FLAG>` env fallbacks); these factories declare the common fields there, with the
service's own defaults, and the checks validate them once.

`--gil-switch-interval-ms` (default 5, CPython's own): a thread that releases the GIL (a CUDA graph
replay, a device-to-host copy, a socket read) waits up to `sys.getswitchinterval()` to take it
back from a busy thread. Shorter is not better everywhere (a short interval in every service did
worse in the stack; BENCHMARKS.md has the runs), so each service sets its own.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

from qtts.request.errors import InvalidArgument
from qtts.serving.settings import setting

DEFAULT_GIL_SWITCH_INTERVAL_MS = 5.0  # CPython's default (sys.getswitchinterval() = 0.005)

EnvLookup = Callable[[str, str], str]


def env_lookup(service: str) -> EnvLookup:
    """`env(NAME, default)` reading `TTS_<SERVICE>_<NAME>`."""
    prefix = f"TTS_{service.upper()}_"
    return lambda name, default: os.environ.get(prefix + name, default)


def host(default: str = "127.0.0.1") -> Any:
    return setting(default, "listen address")


def port(default: int, help: str = "gRPC port") -> Any:
    return setting(default, help)


def metrics_port(default: int) -> Any:
    return setting(default, "Prometheus metrics port (0 = off)")


def drain_seconds(default: float) -> Any:
    return setting(default, "on SIGTERM, how long in-flight streams may run before they are cancelled")


def log_level() -> Any:
    return setting("INFO", "log level: DEBUG, INFO, WARNING or ERROR")


def gil_switch_interval_ms(default: float = DEFAULT_GIL_SWITCH_INTERVAL_MS) -> Any:
    return setting(default, "how long a thread may hold the GIL while another waits (sys.setswitchinterval)")


def internal_token(*, dials: bool = True) -> Any:
    """`dials`: the service also calls the others, so it sends the token too."""
    sent = "sent on calls to the other services and " if dials else ""
    return setting(
        "",
        f"shared secret of the services (qtts/serving/internal_auth.py): {sent}required from callers; "
        "prefer the env var to the flag (default: off)",
    )


def check_server_fields(config: Any, *, ports: Sequence[str] = ("port",)) -> None:
    """Raise `InvalidArgument` for a port outside 0..65535 or a negative drain."""
    for field in (*ports, "metrics_port"):
        value = getattr(config, field)
        if not 0 <= value <= 65535:
            raise InvalidArgument(f"--{field.replace('_', '-')} must be in 0..65535, got {value}")
    if config.drain_seconds < 0:
        raise InvalidArgument(f"--drain-seconds must be >= 0, got {config.drain_seconds}")
    if not 0 < config.gil_switch_interval_ms <= 1000:
        raise InvalidArgument(
            f"--gil-switch-interval-ms must be in (0, 1000], got {config.gil_switch_interval_ms}"
        )


# Connection aging for the GPU stages' gRPC servers (see qtts.serving.grpc_server.connection_age_options).
DEFAULT_MAX_CONNECTION_AGE_S = 120.0
# Streams on an aged connection may run this long: a stream of the longest text lasts minutes, and
# cutting it would fail a listener mid-sentence.
DEFAULT_MAX_CONNECTION_AGE_GRACE_S = 900.0


def max_connection_age_s() -> Any:
    return setting(
        DEFAULT_MAX_CONNECTION_AGE_S,
        "close client connections after this long (GOAWAY) so clients re-resolve and reach "
        "new replicas (0 = never)",
    )


def max_connection_age_grace_s() -> Any:
    return setting(
        DEFAULT_MAX_CONNECTION_AGE_GRACE_S,
        "how long streams on an aged connection may still run (0 = --drain-seconds)",
    )


def check_connection_age(config: Any) -> None:
    """Raise `InvalidArgument` for a negative connection age or grace."""
    if config.max_connection_age_s < 0 or config.max_connection_age_grace_s < 0:
        raise InvalidArgument("--max-connection-age-s and --max-connection-age-grace-s must be >= 0")


# A stage that loads a checkpoint: how, and in which precision (the flag values).
LOAD_FORMATS = ("auto", "safetensors", "dummy")
DTYPES = ("float32", "bfloat16", "float16")


def check_model_fields(config: Any) -> None:
    """Raise `InvalidArgument` for an unknown `--load-format` or `--dtype`."""
    if config.load_format not in LOAD_FORMATS:
        raise InvalidArgument(f"--load-format must be auto, safetensors or dummy, got {config.load_format!r}")
    if config.dtype not in DTYPES:
        raise InvalidArgument(f"--dtype must be one of {', '.join(DTYPES)}, got {config.dtype!r}")
