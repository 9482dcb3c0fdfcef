"""speaker_cache configuration: a frozen dataclass from flags (env fallbacks `TTS_SPEAKER_CACHE_*`).

`--redis-url` also falls back to the conventional `REDIS_URL`; without it the in-process LRU is used.
Redis credentials go in the URL (`redis://user:password@host:6379/0`) or, kept out of it, in
`--redis-username` and `--redis-password` / `--redis-password-file` (env fallbacks also
`REDIS_USERNAME` / `REDIS_PASSWORD`); `rediss://` is Redis over TLS, checked against
`--redis-ca` (default: the system's roots). No message prints a password: URLs are redacted.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit, urlunsplit

from qtts.errors import InvalidArgument
from qtts.service_config import (
    DEFAULT_GIL_SWITCH_INTERVAL_MS,
    add_server_flags,
    check_server_fields,
    env_lookup,
)
from qtts.tls import TlsConfig, add_tls_flags, tls_from_args

_env = env_lookup("speaker_cache")


@dataclass(frozen=True)
class SpeakerCacheConfig:
    """Everything speaker_cache needs at start-up; validated once by `validate()`."""

    host: str = "127.0.0.1"
    port: int = 50054
    metrics_port: int = 9104
    # Empty: the in-process LRU store. May hold credentials: not in repr, redacted in messages.
    redis_url: str = field(default="", repr=False)
    # Credentials kept out of the URL (user empty: Redis's default user); each given one way only.
    redis_username: str = ""
    redis_password: str = field(default="", repr=False)
    redis_password_file: str = ""
    # CA bundle for a rediss:// server's certificate (empty: the system's roots).
    redis_ca: str = ""
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
    # TLS / mutual TLS on the gRPC port (qtts/tls.py); off by default.
    tls: TlsConfig = TlsConfig()

    def validate(self) -> SpeakerCacheConfig:
        """Raise `InvalidArgument` with a clear message for an unusable configuration."""
        check_server_fields(self)
        self.tls.validate()
        self._validate_redis()
        for name in ("lru_entries", "lru_bytes", "max_voices", "max_audio_bytes"):
            if getattr(self, name) < 1:
                raise InvalidArgument(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.prompt_ttl_s < 0 or self.drain_seconds < 0:
            raise InvalidArgument("--prompt-ttl-s and --drain-seconds must be >= 0")
        return self

    def _validate_redis(self) -> None:
        url = self.redis_url
        if not url:
            if self.redis_username or self.redis_password or self.redis_password_file or self.redis_ca:
                raise InvalidArgument("--redis-username/-password/-password-file/-ca need --redis-url")
            return
        if not url.startswith(("redis://", "rediss://", "unix://")):
            raise InvalidArgument(
                f"--redis-url must start with redis://, rediss:// or unix://, got {redacted_url(url)!r}"
            )
        if self.redis_password and self.redis_password_file:
            raise InvalidArgument("give --redis-password or --redis-password-file, not both")
        in_url = urlsplit(url)
        if (self.redis_password or self.redis_password_file) and in_url.password is not None:
            raise InvalidArgument(
                "the Redis password is in --redis-url and in --redis-password(-file): give it one way"
            )
        if self.redis_username and in_url.username:
            raise InvalidArgument("the Redis user is in --redis-url and in --redis-username: give it one way")
        if self.redis_ca:
            if not url.startswith("rediss://"):
                raise InvalidArgument("--redis-ca needs a rediss:// (TLS) --redis-url")
            TlsConfig(ca=self.redis_ca, flag="redis").validate(serves=False)
        if self.redis_password_file:
            self.redis_credentials()

    def redis_credentials(self) -> tuple[str | None, str | None]:
        """(username, password) to send besides the URL; None where not given. Reads the file."""
        password = self.redis_password or None
        if self.redis_password_file:
            try:
                with open(self.redis_password_file, encoding="utf-8") as fh:
                    password = fh.read().strip()
            except (OSError, UnicodeDecodeError) as exc:
                reason = getattr(exc, "strerror", None) or "not UTF-8 text"
                raise InvalidArgument(
                    f"--redis-password-file {self.redis_password_file}: cannot read it ({reason})"
                ) from None
            if not password:
                raise InvalidArgument(f"--redis-password-file {self.redis_password_file} is empty")
        return self.redis_username or None, password


def redacted_url(url: str) -> str:
    """`url` with its password replaced by `***`, for messages and logs."""
    try:
        parts = urlsplit(url)
        if parts.password is None:
            return url
        user = unquote(parts.username or "")
        host = parts.hostname or ""
        if ":" in host:
            host = f"[{host}]"
        netloc = f"{user}:***@{host}" + (f":{parts.port}" if parts.port else "")
        return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
    except ValueError:  # a port that is no number: say nothing of what follows the scheme
        return url.split("://", 1)[0] + "://<redacted>"


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
    add_tls_flags(p, _env, server_name=False)
    p.add_argument(
        "--redis-url",
        default=_env("REDIS_URL", os.environ.get("REDIS_URL", d.redis_url)),
        help="Redis URL (env REDIS_URL): redis://[user:password@]host:port/db, rediss:// for TLS, "
        "or unix://; empty = in-process LRU",
    )
    p.add_argument(
        "--redis-username",
        default=_env("REDIS_USERNAME", os.environ.get("REDIS_USERNAME", d.redis_username)),
        help="Redis ACL user (env REDIS_USERNAME; default: the URL's, else Redis's default user)",
    )
    p.add_argument(
        "--redis-password",
        default=_env("REDIS_PASSWORD", os.environ.get("REDIS_PASSWORD", d.redis_password)),
        help="Redis password (env REDIS_PASSWORD; prefer the env var or --redis-password-file "
        "to the flag, which other users can see in the process list)",
    )
    p.add_argument(
        "--redis-password-file",
        default=_env("REDIS_PASSWORD_FILE", d.redis_password_file),
        help="file holding the Redis password (e.g. mounted from a Secret)",
    )
    p.add_argument(
        "--redis-ca",
        default=_env("REDIS_CA", d.redis_ca),
        help="PEM CA bundle for a rediss:// server's certificate (default: the system's roots)",
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
        redis_username=ns.redis_username,
        redis_password=ns.redis_password,
        redis_password_file=ns.redis_password_file,
        redis_ca=ns.redis_ca,
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
        tls=tls_from_args(ns),
    ).validate()
