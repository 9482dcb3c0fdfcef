"""`python -m services.launcher` (what `make run` runs): start the stack, say where it listens,
supervise it until Ctrl-C/SIGTERM, then stop it."""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Sequence

from services.launcher.processes import StartupError, StartupInterrupted
from services.launcher.settings import config_from_args
from services.launcher.stack import start_stack
from services.launcher.welcome import demo_request, describe
from services.supervisor import RestartPolicy, Supervisor


def main(argv: Sequence[str] | None = None) -> int:
    config = config_from_args(argv)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"starting services (logs in {config.log_dir}/) ...", flush=True)
    try:
        stack = start_stack(config, stop=stop)
    except StartupInterrupted:
        print("stopped during start-up", flush=True)
        return 0
    except StartupError as exc:
        print(f"startup failed: {exc}", file=sys.stderr)
        return 1
    try:
        try:
            body = demo_request(stack)
        except (OSError, KeyError, ValueError) as exc:
            body = {"input": "Hello.", "voice": "VOICE", "response_format": "wav"}
            print(f"(could not prepare the demo request: {exc})", file=sys.stderr)
        print(describe(stack, body), flush=True)
        supervisor = Supervisor(stack, RestartPolicy(max_restarts=config.max_restarts))
        while not stop.wait(0.5):
            if supervisor.check() is not None:
                return 1
        print("stopping ...", flush=True)
        return 0
    finally:
        stack.stop(grace=config.drain_seconds + 5.0)


if __name__ == "__main__":
    sys.exit(main())
