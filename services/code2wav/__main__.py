"""`python -m services.code2wav`: run one code2wav replica until SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import sys

from qtts.errors import TTSError
from qtts.grpc_server import configure_logging
from services.code2wav.config import config_from_args
from services.code2wav.server import Code2WavServer


async def _serve(config) -> None:
    # Built inside the loop: grpc.aio servers bind to the loop they are created on.
    await Code2WavServer(config).run()


def main(argv: list[str] | None = None) -> int:
    try:
        config = config_from_args(argv)
    except TTSError as exc:
        print(f"code2wav: {exc.message}", file=sys.stderr)
        return 2
    configure_logging(config.log_level)
    asyncio.run(_serve(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
