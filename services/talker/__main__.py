"""`python -m services.talker`: run the talker service until SIGTERM/SIGINT (then drain)."""

from __future__ import annotations

import sys

from qtts.serving.grpc_server import run_service_main
from services.talker.config import config_from_args
from services.talker.server import TalkerServer


def main(argv: list[str] | None = None) -> int:
    return run_service_main("talker", config_from_args, TalkerServer, argv)


if __name__ == "__main__":
    sys.exit(main())
