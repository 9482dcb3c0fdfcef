"""speaker_cache configuration: a frozen dataclass from flags (env fallbacks `TTS_SPEAKER_CACHE_*`).

`--redis-url` also falls back to the conventional `REDIS_URL`; without it the in-process LRU is used.
Redis credentials go in the URL (`redis://user:password@host:6379/0`) or, kept out of it, in
`--redis-username` and `--redis-password` / `--redis-password-file` (env fallbacks also
`REDIS_USERNAME` / `REDIS_PASSWORD`); `rediss://` is Redis over TLS, checked against
`--redis-ca` (default: the system's roots). No message prints a password: URLs are redacted.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit, urlunsplit

from qtts.request.errors import InvalidArgument
from qtts.serving import service_config as common
from qtts.serving.service_config import check_server_fields
from qtts.serving.settings import ServiceSettings, group, setting
from qtts.serving.tls import TlsConfig


@dataclass(frozen=True)
class SpeakerCacheConfig:
    """Everything speaker_cache needs at start-up; validated once by `validate()`."""

    host: str = common.host()
    port: int = common.port(50054)
    metrics_port: int = common.metrics_port(9104)
    # Empty: the in-process LRU store. May hold credentials: not in repr, redacted in messages.
    redis_url: str = setting(
        "",
        "Redis URL: redis://[user:password@]host:port/db, rediss:// for TLS, or unix://; "
        "empty = in-process LRU",
        env=("REDIS_URL",),
        repr=False,
    )
    # Credentials kept out of the URL (user empty: Redis's default user); each given one way only.
    redis_username: str = setting(
        "", "Redis ACL user (default: the URL's, else Redis's default user)", env=("REDIS_USERNAME",)
    )
    redis_password: str = setting(
        "",
        "Redis password (prefer the env var or --redis-password-file to the flag, which other "
        "users can see in the process list)",
        env=("REDIS_PASSWORD",),
        repr=False,
    )
    redis_password_file: str = setting("", "file holding the Redis password (e.g. mounted from a Secret)")
    redis_ca: str = setting(
        "", "PEM CA bundle for a rediss:// server's certificate (default: the system's roots)"
    )
    redis_namespace: str = setting("tts:", "prefix of every Redis key")
    prompt_ttl_s: int = setting(
        7 * 24 * 3600, "seconds a voice prompt lives in Redis (0 = until Redis evicts it by its own policy)"
    )
    lru_entries: int = setting(1024, "voice prompts kept by the in-process LRU")
    lru_bytes: int = setting(512 * 1024 * 1024, "bytes of voice prompts kept by the in-process LRU")
    max_voices: int = setting(10_000, "named voices kept at most")
    max_audio_bytes: int = setting(20 * 1024 * 1024, "largest reference clip of a voice, bytes")
    drain_seconds: float = common.drain_seconds(10.0)
    # sys.setswitchinterval for this process (see qtts/serving/service_config.py for what was measured).
    gil_switch_interval_ms: float = common.gil_switch_interval_ms()
    log_level: str = common.log_level()
    # Shared secret of the services (qtts/serving/internal_auth.py); empty: off.
    internal_token: str = common.internal_token()
    # TLS / mutual TLS on the gRPC port (qtts/serving/tls.py); off by default.
    tls: TlsConfig = group(TlsConfig(), "tls", omit=("server_name",), what="gRPC between the services")

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


SETTINGS = ServiceSettings(SpeakerCacheConfig, "speaker_cache", "python -m services.speaker_cache", __doc__)


def build_parser() -> argparse.ArgumentParser:
    return SETTINGS.parser()


def config_from_args(argv: Sequence[str] | None = None) -> SpeakerCacheConfig:
    """Parse flags (falling back to env vars) into a validated `SpeakerCacheConfig`."""
    return SETTINGS.parse(argv).validate()
