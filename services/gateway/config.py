"""Gateway configuration: one frozen dataclass built from flags (env fallbacks `TTS_GATEWAY_*`)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

from qtts import request_limits
from qtts.errors import InvalidArgument
from qtts.service_config import (
    DEFAULT_GIL_SWITCH_INTERVAL_MS,
    add_server_flags,
    check_server_fields,
    env_lookup,
)
from qtts.tls import TlsConfig, add_tls_flags, tls_from_args

_env = env_lookup("gateway")

# What --unsupported-instructions accepts (services/gateway/instructions.py applies it; listed here
# so that parsing flags imports nothing of the gateway).
UNSUPPORTED_INSTRUCTIONS = ("reject", "ignore")

# "pool": re-resolve --talker every --talker-refresh-s and send each new stream to the ready talker
# with the fewest of this gateway's streams (services/gateway/talker_pool.py); "channel": one gRPC
# channel round-robining over the addresses resolved when it connected.
TALKER_BALANCING = ("pool", "channel")


@dataclass(frozen=True)
class GatewayConfig:
    """Everything the gateway needs at start-up; validated once by `validate()`."""

    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 50051
    metrics_port: int = 9100
    talker: str = "127.0.0.1:50052"
    speaker_cache: str = "127.0.0.1:50054"
    # How new streams reach talkers (TALKER_BALANCING) and how often the pool re-resolves --talker.
    talker_balancing: str = "pool"
    talker_refresh_s: float = 5.0
    # The talker's Prometheus page (http://host:port/metrics) for GET /v1/status; empty = not shown.
    talker_metrics_url: str = ""
    # Empty: the name the talker reports through GetModelInfo.
    served_model_name: str = ""
    max_streams: int = 256
    max_input_chars: int = 4096
    # Upper bound on max_new_tokens a client may ask for (12.5 frames per second of audio).
    max_new_frames_limit: int = 4096
    max_ref_audio_bytes: int = 20 * 1024 * 1024
    # Decoded reference clips kept by content (LRU), MiB; 0 = decode every request's clip.
    ref_audio_cache_mb: int = 256
    # Output sample rate when a request does not ask for one (resampled from 24 kHz with soxr).
    sample_rate: int = 24000
    drain_seconds: float = 30.0
    # sys.setswitchinterval for this process (see qtts/service_config.py for what was measured).
    gil_switch_interval_ms: float = DEFAULT_GIL_SWITCH_INTERVAL_MS
    # Idle keep-alive of HTTP connections; above a load balancer's idle timeout (60 s is common),
    # so the proxy, not the gateway, closes idle connections (no close racing a new request).
    http_keepalive_s: float = 75.0
    # A connection whose request headers are not complete this long after it opened (or after the
    # previous response) is closed (slowloris); a body that stalls this long between pieces is a 408.
    http_header_timeout_s: float = 10.0
    http_body_timeout_s: float = 30.0
    # Request bodies above this are a 413 (before they are read); 0 = room for a base64
    # --max-ref-audio-bytes clip and the other fields.
    max_body_bytes: int = 0
    # A stream (HTTP response, WebSocket, gRPC Synthesize/StreamingSynthesize) whose client takes
    # no bytes for this long loses its stream (and its slot); 0 = never.
    http_write_timeout_s: float = 30.0
    # Concurrent streams one client (API key, else address) may hold; 0 = only --max-streams.
    max_streams_per_client: int = 0
    # Requests a second one client may send to the public API (HTTP /v1/, tts.v1), after a burst
    # of --rate-limit-burst (0: twice the rate, at least 1); 0 = no rate limit.
    rate_limit_per_s: float = 0.0
    rate_limit_burst: int = 0
    # Reference clips (requests and voice uploads) longer than this are a 400 naming the field;
    # decoding stops there, so a small compressed file cannot expand into hours of audio.
    max_ref_audio_seconds: float = 60.0
    # API keys, one a line (services/gateway/auth.py), next to TTS_GATEWAY_API_KEYS; none: no auth.
    api_keys_file: str = ""
    # Shared secret of the services (qtts/internal_auth.py); empty: off.
    internal_token: str = ""
    # TLS / mutual TLS to talker and speaker_cache (qtts/tls.py: --tls-*), and TLS on the public
    # HTTP and gRPC ports (--public-tls-*); both off by default.
    tls: TlsConfig = TlsConfig()
    public_tls: TlsConfig = TlsConfig(flag="public-tls")
    log_level: str = "INFO"
    # `instructions` sent to a variant that has no instruct block (Base, 0.6B CustomVoice):
    # "reject" (400 / INVALID_ARGUMENT naming the field) or "ignore" (dropped, reported in the
    # x-tts-ignored-fields header / metadata), for clients that always send one.
    unsupported_instructions: str = "reject"

    def validate(self) -> GatewayConfig:
        """Raise `InvalidArgument` with a clear message for an unusable configuration."""
        check_server_fields(self, ports=("http_port", "grpc_port"))
        self.tls.validate(serves=False)
        self.public_tls.validate()
        if self.http_port == 0 or self.grpc_port == 0:
            raise InvalidArgument("--http-port and --grpc-port must be set (non-zero)")
        for name in ("talker", "speaker_cache"):
            addr = getattr(self, name)
            if ":" not in addr:
                raise InvalidArgument(f"--{name.replace('_', '-')} must be host:port, got {addr!r}")
        if self.talker_metrics_url and not self.talker_metrics_url.startswith(("http://", "https://")):
            raise InvalidArgument(
                f"--talker-metrics-url must be an http(s) URL, got {self.talker_metrics_url!r}"
            )
        if self.talker_balancing not in TALKER_BALANCING:
            raise InvalidArgument(
                f"--talker-balancing must be one of {', '.join(TALKER_BALANCING)}, got {self.talker_balancing!r}"
            )
        if self.talker_refresh_s <= 0:
            raise InvalidArgument(f"--talker-refresh-s must be > 0, got {self.talker_refresh_s}")
        if self.max_streams < 1:
            raise InvalidArgument(f"--max-streams must be >= 1, got {self.max_streams}")
        if not 1 <= self.max_input_chars <= request_limits.TEXT_MAX_CHARS:
            raise InvalidArgument(f"--max-input-chars must be in 1..{request_limits.TEXT_MAX_CHARS}")
        if not 1 <= self.max_new_frames_limit <= request_limits.MAX_FRAMES:
            raise InvalidArgument(f"--max-new-frames-limit must be in 1..{request_limits.MAX_FRAMES}")
        if self.ref_audio_cache_mb < 0:
            raise InvalidArgument(f"--ref-audio-cache-mb must be >= 0, got {self.ref_audio_cache_mb}")
        if self.http_keepalive_s <= 0:
            raise InvalidArgument(f"--http-keepalive-s must be > 0, got {self.http_keepalive_s}")
        if self.unsupported_instructions not in UNSUPPORTED_INSTRUCTIONS:
            raise InvalidArgument(
                f"--unsupported-instructions must be one of {', '.join(UNSUPPORTED_INSTRUCTIONS)}, "
                f"got {self.unsupported_instructions!r}"
            )
        if min(self.http_header_timeout_s, self.http_body_timeout_s, self.http_write_timeout_s) < 0:
            raise InvalidArgument("--http-{header,body,write}-timeout-s must be >= 0")
        if self.max_body_bytes < 0 or self.max_streams_per_client < 0:
            raise InvalidArgument("--max-body-bytes and --max-streams-per-client must be >= 0")
        if self.rate_limit_per_s < 0 or self.rate_limit_burst < 0:
            raise InvalidArgument("--rate-limit-per-s and --rate-limit-burst must be >= 0")
        if self.max_ref_audio_seconds <= 0:
            raise InvalidArgument(f"--max-ref-audio-seconds must be > 0, got {self.max_ref_audio_seconds}")
        if not 8000 <= self.sample_rate <= 48000:
            raise InvalidArgument(f"--sample-rate must be in 8000..48000 Hz, got {self.sample_rate}")
        return self

    @property
    def rate_limit_burst_size(self) -> int:
        """--rate-limit-burst, or twice the rate (at least 1)."""
        return self.rate_limit_burst or max(1, int(2 * self.rate_limit_per_s))

    @property
    def body_limit_bytes(self) -> int:
        """--max-body-bytes, or a base64 clip of --max-ref-audio-bytes (4/3 of it) plus 1 MiB."""
        return self.max_body_bytes or self.max_ref_audio_bytes * 4 // 3 + (1 << 20)


def build_parser() -> argparse.ArgumentParser:
    d = GatewayConfig()
    p = argparse.ArgumentParser(prog="python -m services.gateway", description=__doc__)
    add_server_flags(p, _env, d, ports=("http_port", "grpc_port"))
    p.add_argument("--talker", default=_env("TALKER", d.talker), help="talker host:port")
    p.add_argument(
        "--talker-balancing",
        default=_env("TALKER_BALANCING", d.talker_balancing),
        help="pool: re-resolve --talker and spread new streams over every ready talker (fewest "
        "streams first); channel: one channel, round robin over the first resolution",
    )
    p.add_argument(
        "--talker-refresh-s",
        type=float,
        default=float(_env("TALKER_REFRESH_S", str(d.talker_refresh_s))),
        help="how often the pool re-resolves --talker and health-checks each talker, seconds",
    )
    p.add_argument(
        "--speaker-cache", default=_env("SPEAKER_CACHE", d.speaker_cache), help="speaker_cache host:port"
    )
    p.add_argument(
        "--talker-metrics-url",
        default=_env("TALKER_METRICS_URL", d.talker_metrics_url),
        help="the talker's /metrics URL, for the queue and step time in GET /v1/status (default: not shown)",
    )
    p.add_argument(
        "--served-model-name",
        default=_env("SERVED_MODEL_NAME", d.served_model_name),
        help="model name clients use (default: the talker's model name)",
    )
    p.add_argument(
        "--max-streams",
        type=int,
        default=int(_env("MAX_STREAMS", str(d.max_streams))),
        help="concurrent synthesis streams; more are rejected with 429 / RESOURCE_EXHAUSTED",
    )
    p.add_argument(
        "--max-input-chars", type=int, default=int(_env("MAX_INPUT_CHARS", str(d.max_input_chars)))
    )
    p.add_argument(
        "--max-new-frames-limit",
        type=int,
        default=int(_env("MAX_NEW_FRAMES_LIMIT", str(d.max_new_frames_limit))),
    )
    p.add_argument(
        "--ref-audio-cache-mb",
        type=int,
        default=int(_env("REF_AUDIO_CACHE_MB", str(d.ref_audio_cache_mb))),
        help="decoded reference clips kept by content for reuse, MiB (0 = off)",
    )
    p.add_argument(
        "--http-keepalive-s",
        type=float,
        default=float(_env("HTTP_KEEPALIVE_S", str(d.http_keepalive_s))),
        help="idle HTTP keep-alive, seconds (keep it above the load balancer's idle timeout)",
    )
    p.add_argument(
        "--sample-rate",
        type=int,
        default=int(_env("SAMPLE_RATE", str(d.sample_rate))),
        help="output sample rate when a request does not set one (native: 24000)",
    )
    p.add_argument(
        "--max-ref-audio-bytes",
        type=int,
        default=int(_env("MAX_REF_AUDIO_BYTES", str(d.max_ref_audio_bytes))),
    )
    for flag, help_text in (
        (
            "http_header_timeout_s",
            "close a connection whose request headers take longer, seconds (0 = never)",
        ),
        ("http_body_timeout_s", "408 for a request body that stalls this long, seconds (0 = never)"),
        (
            "http_write_timeout_s",
            "end a stream (HTTP, WebSocket, gRPC) whose client reads nothing this long, seconds (0 = never)",
        ),
    ):
        p.add_argument(
            "--" + flag.replace("_", "-"),
            type=float,
            default=float(_env(flag.upper(), str(getattr(d, flag)))),
            help=help_text,
        )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=int(_env("MAX_BODY_BYTES", str(d.max_body_bytes))),
        help="413 above this request body size (0 = room for a base64 --max-ref-audio-bytes clip)",
    )
    p.add_argument(
        "--max-streams-per-client",
        type=int,
        default=int(_env("MAX_STREAMS_PER_CLIENT", str(d.max_streams_per_client))),
        help="concurrent streams per API key (or client address); more are a 429 (0 = no such limit)",
    )
    p.add_argument(
        "--rate-limit-per-s",
        type=float,
        default=float(_env("RATE_LIMIT_PER_S", str(d.rate_limit_per_s))),
        help="requests a second per API key (or client address) to /v1/ and tts.v1, beyond a burst; "
        "more are a 429 with Retry-After / RESOURCE_EXHAUSTED (0 = no such limit)",
    )
    p.add_argument(
        "--rate-limit-burst",
        type=int,
        default=int(_env("RATE_LIMIT_BURST", str(d.rate_limit_burst))),
        help="requests one client may send at once before --rate-limit-per-s applies (0 = twice the rate)",
    )
    p.add_argument(
        "--max-ref-audio-seconds",
        type=float,
        default=float(_env("MAX_REF_AUDIO_SECONDS", str(d.max_ref_audio_seconds))),
        help="longest reference clip (requests and voice uploads), seconds; longer ones are a 400",
    )
    p.add_argument(
        "--api-keys-file",
        default=_env("API_KEYS_FILE", d.api_keys_file),
        help="file of API keys, one a line; with it (or TTS_GATEWAY_API_KEYS) every /v1/ route and "
        "tts.v1 RPC needs Authorization: Bearer <key> (default: no authentication)",
    )
    p.add_argument(
        "--internal-token",
        default=_env("INTERNAL_TOKEN", d.internal_token),
        help="shared secret of the services (qtts/internal_auth.py): sent on calls to the other "
        "services and required from callers; prefer the env var to the flag (default: off)",
    )
    add_tls_flags(p, _env, what="the gateway's calls to talker and speaker_cache")
    add_tls_flags(p, _env, prefix="public-tls", what="the public HTTP and gRPC ports", server_name=False)
    p.add_argument(
        "--unsupported-instructions",
        default=_env("UNSUPPORTED_INSTRUCTIONS", d.unsupported_instructions),
        help="instructions on a variant without an instruct block (Base, 0.6B CustomVoice): reject "
        "(400 naming the field) or ignore (drop them, report them in the x-tts-ignored-fields header)",
    )
    return p


def config_from_args(argv: Sequence[str] | None = None) -> GatewayConfig:
    """Parse flags (falling back to env vars) into a validated `GatewayConfig`."""
    ns = build_parser().parse_args(argv)
    return GatewayConfig(
        host=ns.host,
        http_port=ns.http_port,
        grpc_port=ns.grpc_port,
        metrics_port=ns.metrics_port,
        talker=ns.talker,
        speaker_cache=ns.speaker_cache,
        talker_balancing=ns.talker_balancing,
        talker_refresh_s=ns.talker_refresh_s,
        talker_metrics_url=ns.talker_metrics_url,
        served_model_name=ns.served_model_name,
        max_streams=ns.max_streams,
        http_keepalive_s=ns.http_keepalive_s,
        ref_audio_cache_mb=ns.ref_audio_cache_mb,
        max_input_chars=ns.max_input_chars,
        max_new_frames_limit=ns.max_new_frames_limit,
        max_ref_audio_bytes=ns.max_ref_audio_bytes,
        sample_rate=ns.sample_rate,
        drain_seconds=ns.drain_seconds,
        gil_switch_interval_ms=ns.gil_switch_interval_ms,
        log_level=ns.log_level,
        unsupported_instructions=ns.unsupported_instructions,
        http_header_timeout_s=ns.http_header_timeout_s,
        http_body_timeout_s=ns.http_body_timeout_s,
        http_write_timeout_s=ns.http_write_timeout_s,
        max_body_bytes=ns.max_body_bytes,
        max_streams_per_client=ns.max_streams_per_client,
        rate_limit_per_s=ns.rate_limit_per_s,
        rate_limit_burst=ns.rate_limit_burst,
        max_ref_audio_seconds=ns.max_ref_audio_seconds,
        api_keys_file=ns.api_keys_file,
        internal_token=ns.internal_token,
        tls=tls_from_args(ns),
        public_tls=tls_from_args(ns, "public-tls"),
    ).validate()
