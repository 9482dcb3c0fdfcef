"""`python -m services.speaker_cache`: run the speaker_cache service until SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import sys

from qtts.errors import TTSError
from qtts.grpc_server import configure_logging
from services.speaker_cache.config import config_from_args
from services.speaker_cache.server import SpeakerCacheServer


async def _serve(config) -> None:
    # Built inside the loop: grpc.aio servers bind to the loop they are created on.
    await SpeakerCacheServer(config).run()


def main(argv: list[str] | None = None) -> int:
    try:
        config = config_from_args(argv)
    except TTSError as exc:
        print(f"speaker_cache: {exc.message}", file=sys.stderr)
        return 2
    configure_logging(config.log_level)
    asyncio.run(_serve(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
