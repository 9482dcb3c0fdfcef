"""speaker_cache configuration: a frozen dataclass from flags (env fallbacks `TTS_SPEAKER_CACHE_*`).

`--redis-url` also falls back to the conventional `REDIS_URL`; without it the in-process LRU is used.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import dataclass

from qtts.errors import InvalidArgument
from qtts.service_config import (
    DEFAULT_GIL_SWITCH_INTERVAL_MS,
    add_server_flags,
    check_server_fields,
    env_lookup,
)

_env = env_lookup("speaker_cache")


@dataclass(frozen=True)
class SpeakerCacheConfig:
    """Everything speaker_cache needs at start-up; validated once by `validate()`."""

    host: str = "127.0.0.1"
    port: int = 50054
    metrics_port: int = 9104
    # Empty: the in-process LRU store.
    redis_url: str = ""
    redis_namespace: str = "tts:"
    # Seconds a voice prompt lives in Redis (0 = until Redis evicts it by its own policy).
    prompt_ttl_s: int = 7 * 24 * 3600
    lru_entries: int = 1024
    lru_bytes: int = 512 * 1024 * 1024
    max_voices: int = 10_000
    max_audio_bytes: int = 20 * 1024 * 1024
    drain_seconds: float = 10.0
    # sys.setswitchinterval for this process (see qtts/service_config.py for what was measured).
    gil_switch_interval_ms: float = DEFAULT_GIL_SWITCH_INTERVAL_MS
    log_level: str = "INFO"
    # Shared secret of the services (qtts/internal_auth.py); empty: off.
    internal_token: str = ""

    def validate(self) -> SpeakerCacheConfig:
        """Raise `InvalidArgument` with a clear message for an unusable configuration."""
        check_server_fields(self)
        if self.redis_url and not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise InvalidArgument(
                f"--redis-url must start with redis://, rediss:// or unix://, got {self.redis_url!r}"
            )
        for name in ("lru_entries", "lru_bytes", "max_voices", "max_audio_bytes"):
            if getattr(self, name) < 1:
                raise InvalidArgument(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.prompt_ttl_s < 0 or self.drain_seconds < 0:
            raise InvalidArgument("--prompt-ttl-s and --drain-seconds must be >= 0")
        return self


def build_parser() -> argparse.ArgumentParser:
    d = SpeakerCacheConfig()
    p = argparse.ArgumentParser(prog="python -m services.speaker_cache", description=__doc__)
    add_server_flags(p, _env, d)
    p.add_argument(
        "--internal-token",
        default=_env("INTERNAL_TOKEN", d.internal_token),
        help="shared secret of the services (qtts/internal_auth.py): sent on calls to the other "
        "services and required from callers; prefer the env var to the flag (default: off)",
    )
    p.add_argument(
        "--redis-url",
        default=_env("REDIS_URL", os.environ.get("REDIS_URL", d.redis_url)),
        help="Redis URL (env REDIS_URL); empty = in-process LRU",
    )
    p.add_argument("--redis-namespace", default=_env("REDIS_NAMESPACE", d.redis_namespace))
    p.add_argument("--prompt-ttl-s", type=int, default=int(_env("PROMPT_TTL_S", str(d.prompt_ttl_s))))
    p.add_argument(
        "--lru-entries",
        type=int,
        default=int(_env("LRU_ENTRIES", str(d.lru_entries))),
        help="voice prompts kept by the in-process LRU",
    )
    p.add_argument(
        "--lru-bytes",
        type=int,
        default=int(_env("LRU_BYTES", str(d.lru_bytes))),
        help="bytes of voice prompts kept by the in-process LRU",
    )
    p.add_argument("--max-voices", type=int, default=int(_env("MAX_VOICES", str(d.max_voices))))
    p.add_argument(
        "--max-audio-bytes", type=int, default=int(_env("MAX_AUDIO_BYTES", str(d.max_audio_bytes)))
    )
    return p


def config_from_args(argv: Sequence[str] | None = None) -> SpeakerCacheConfig:
    """Parse flags (falling back to env vars) into a validated `SpeakerCacheConfig`."""
    ns = build_parser().parse_args(argv)
    return SpeakerCacheConfig(
        host=ns.host,
        port=ns.port,
        metrics_port=ns.metrics_port,
        redis_url=ns.redis_url,
        redis_namespace=ns.redis_namespace,
        prompt_ttl_s=ns.prompt_ttl_s,
        lru_entries=ns.lru_entries,
        lru_bytes=ns.lru_bytes,
        max_voices=ns.max_voices,
        max_audio_bytes=ns.max_audio_bytes,
        drain_seconds=ns.drain_seconds,
        gil_switch_interval_ms=ns.gil_switch_interval_ms,
        log_level=ns.log_level,
        internal_token=ns.internal_token,
    ).validate()
