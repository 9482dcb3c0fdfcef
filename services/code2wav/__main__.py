"""`python -m services.code2wav`: run one code2wav replica until SIGTERM/SIGINT (then drain)."""

from __future__ import annotations

import sys

from qtts.serving.grpc_server import run_service_main
from services.code2wav.config import config_from_args
from services.code2wav.server import Code2WavServer


def main(argv: list[str] | None = None) -> int:
    return run_service_main("code2wav", config_from_args, Code2WavServer, argv)


if __name__ == "__main__":
    sys.exit(main())
