"""`python -m services.aligner`: run the aligner service until SIGTERM/SIGINT (then drain)."""

from __future__ import annotations

import sys

from qtts.serving.grpc_server import run_service_main
from services.aligner.config import config_from_args
from services.aligner.server import AlignerServer


def main(argv: list[str] | None = None) -> int:
    return run_service_main("aligner", config_from_args, AlignerServer, argv)


if __name__ == "__main__":
    sys.exit(main())
