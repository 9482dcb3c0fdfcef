"""`python -m services.code2wav`: run one code2wav replica until SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import sys

from qtts.errors import TTSError
from qtts.grpc_server import configure_logging
from services.code2wav.config import config_from_args
from services.code2wav.server import Code2WavServer


def main(argv: list[str] | None = None) -> int:
    try:
        config = config_from_args(argv)
    except TTSError as exc:
        print(f"code2wav: {exc.message}", file=sys.stderr)
        return 2
    configure_logging(config.log_level)
    asyncio.run(Code2WavServer(config).run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
