"""`python -m services.gateway`: run the gateway (HTTP + tts.v1 gRPC) until SIGTERM/SIGINT (then drain)."""

from __future__ import annotations

import sys

from qtts.serving.grpc_server import run_service_main
from services.gateway.config import config_from_args
from services.gateway.server import GatewayServer


def main(argv: list[str] | None = None) -> int:
    return run_service_main("gateway", config_from_args, GatewayServer, argv)


if __name__ == "__main__":
    sys.exit(main())
