"""`python -m services.talker`: run the talker service until SIGTERM/SIGINT (then drain)."""

from __future__ import annotations

import asyncio
import sys

from qtts.errors import TTSError
from qtts.grpc_server import configure_logging
from services.talker.config import TalkerConfig, config_from_args
from services.talker.server import TalkerServer


async def serve(config: TalkerConfig) -> None:
    # The grpc.aio server must be created inside the running event loop.
    await TalkerServer(config).run()


def main(argv: list[str] | None = None) -> int:
    try:
        config = config_from_args(argv)
    except TTSError as exc:
        print(f"talker: {exc.message}", file=sys.stderr)
        return 2
    configure_logging(config.log_level)
    asyncio.run(serve(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
