"""`python -m services.gateway`: run the gateway (HTTP + tts.v1 gRPC) until SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import sys

from qtts.errors import TTSError
from qtts.grpc_server import configure_logging
from services.gateway.config import GatewayConfig, config_from_args
from services.gateway.server import GatewayServer


async def _serve(config: GatewayConfig) -> None:
    # Built inside the running loop: grpc.aio binds its server to the loop current at creation.
    await GatewayServer(config).run()


def main(argv: list[str] | None = None) -> int:
    try:
        config = config_from_args(argv)
    except TTSError as exc:
        print(f"gateway: {exc.message}", file=sys.stderr)
        return 2
    configure_logging(config.log_level)
    asyncio.run(_serve(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
