"""`python -m services.speaker_cache`: run the speaker_cache service until SIGTERM/SIGINT (then drain)."""

from __future__ import annotations

import sys

from qtts.serving.grpc_server import run_service_main
from services.speaker_cache.config import config_from_args
from services.speaker_cache.server import SpeakerCacheServer


def main(argv: list[str] | None = None) -> int:
    return run_service_main("speaker_cache", config_from_args, SpeakerCacheServer, argv)


if __name__ == "__main__":
    sys.exit(main())
