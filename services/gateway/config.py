"""Gateway configuration: one frozen dataclass built from flags (env fallbacks `TTS_GATEWAY_*`)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

from qtts.request import request_limits
from qtts.request.errors import InvalidArgument
from qtts.serving import service_config as common
from qtts.serving.service_config import check_server_fields
from qtts.serving.settings import ServiceSettings, group, setting
from qtts.serving.tls import TlsConfig

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

    host: str = common.host()
    http_port: int = common.port(8000, "HTTP port (OpenAI API, playground)")
    grpc_port: int = common.port(50051, "gRPC port (tts.v1)")
    metrics_port: int = common.metrics_port(9100)
    talker: str = setting("127.0.0.1:50052", "talker host:port")
    speaker_cache: str = setting("127.0.0.1:50054", "speaker_cache host:port")
    aligner: str = setting(
        "", "aligner host:port (services.aligner) for word_timestamps; empty: word_timestamps is refused"
    )
    talker_balancing: str = setting(
        "pool",
        "pool: re-resolve --talker and spread new streams over every ready talker (fewest "
        "streams first); channel: one channel, round robin over the first resolution",
        choices=TALKER_BALANCING,
    )
    talker_sessions: bool = setting(
        True,
        "send each request as an open on one long-lived Session call per talker instead of a "
        "Generate call of its own (a busy talker starts a burst of calls late); a talker "
        "without Session gets Generate calls",
    )
    talker_refresh_s: float = setting(
        5.0, "how often the pool re-resolves --talker and health-checks each talker, seconds"
    )
    talker_room_wait_ms: float = setting(
        40.0,
        "a request finding this gateway's share of the talkers' published room spent by its own "
        "calls waits up to this long for the next published room before it is refused (the talker "
        "splits its room among the gateways; 0 = refused at once). Where the talkers published no "
        "room at all the refusal is at once either way",
    )
    talker_metrics_url: str = setting(
        "", "the talker's /metrics URL, for the queue and step time in GET /v1/status (default: not shown)"
    )
    served_model_name: str = setting("", "model name clients use (default: the talker's model name)")
    max_streams: int = setting(
        256, "concurrent synthesis streams; more are rejected with 429 / RESOURCE_EXHAUSTED"
    )
    max_input_chars: int = setting(4096, "longest input text, characters")
    # Streamed text (WebSocket input.text, gRPC StreamingSynthesize input.text): checked before
    # any work, each refusal an error event (the session goes on) / INVALID_ARGUMENT.
    max_text_piece_chars: int = setting(
        65536, "longest streamed text piece (WebSocket or gRPC input.text), characters"
    )
    max_utterance_chars: int = setting(
        262144,
        "most streamed text one utterance (up to input.done / flush / the end of input) takes, characters",
    )
    # 12.5 frames per second of audio.
    max_new_frames_limit: int = setting(4096, "upper bound on the max_new_tokens a client may ask for")
    max_ref_audio_bytes: int = setting(20 * 1024 * 1024, "largest reference clip, bytes")
    ref_audio_cache_mb: int = setting(
        256,
        "decoded reference clips kept by content for reuse, MiB, and a quarter of it again for their "
        "base64 decodes (0 = off)",
    )
    # Resampled from 24 kHz with soxr.
    sample_rate: int = setting(24000, "output sample rate when a request does not set one (native: 24000)")
    drain_seconds: float = common.drain_seconds(30.0)
    # sys.setswitchinterval for this process (see qtts/serving/service_config.py for what was measured).
    gil_switch_interval_ms: float = common.gil_switch_interval_ms()
    # Above a load balancer's idle timeout (60 s is common), so the proxy, not the gateway, closes
    # idle connections (no close racing a new request).
    http_keepalive_s: float = setting(
        75.0, "idle HTTP keep-alive, seconds (keep it above the load balancer's idle timeout)"
    )
    # Slowloris: the timer runs from the connection's opening (or the previous response).
    http_header_timeout_s: float = setting(
        10.0, "close a connection whose request headers take longer, seconds (0 = never)"
    )
    http_body_timeout_s: float = setting(
        30.0, "408 for a request body that stalls this long, seconds (0 = never)"
    )
    # A trickle (one byte every 20 s) never stalls: this bounds the whole body.
    http_body_deadline_s: float = setting(
        120.0, "408 for a request body not complete this long after its request began, seconds (0 = never)"
    )
    # Checked before the body is read.
    max_body_bytes: int = setting(
        0, "413 above this request body size (0 = room for a base64 --max-ref-audio-bytes clip)"
    )
    # The idle clock runs only while nothing is being synthesised (or the synthesis waits for text).
    stream_idle_timeout_s: float = setting(
        30.0,
        "close a WebSocket session or gRPC StreamingSynthesize call whose client sends nothing this "
        "long while nothing is being synthesised, seconds (0 = never)",
    )
    # uvicorn's own limit (a larger message closes the WebSocket with 1009, message too big).
    ws_max_message_bytes: int = setting(
        0, "largest WebSocket message, bytes (0 = as the HTTP body limit: a session.config with a clip)"
    )
    # The stream's slot goes with it.
    http_write_timeout_s: float = setting(
        30.0, "end a stream (HTTP, WebSocket, gRPC) whose client reads nothing this long, seconds (0 = never)"
    )
    # uvicorn's own default trusted 127.0.0.1: a client on the same host could name any address.
    forwarded_allow_ips: str = setting(
        "",
        "proxies (comma-separated addresses, or *) whose X-Forwarded-For names the client an "
        "HTTP request counts against per-client limits (default: none; the peer address counts)",
    )
    max_streams_per_client: int = setting(
        0, "concurrent streams per API key (or client address); more are a 429 (0 = no such limit)"
    )
    rate_limit_per_s: float = setting(
        0.0,
        "requests a second per API key (or client address) to /v1/ and tts.v1, beyond a burst; "
        "more are a 429 with Retry-After / RESOURCE_EXHAUSTED (0 = no such limit)",
    )
    rate_limit_burst: int = setting(
        0, "requests one client may send at once before --rate-limit-per-s applies (0 = twice the rate)"
    )
    # Decoding stops there, so a small compressed file cannot expand into hours of audio.
    max_ref_audio_seconds: float = setting(
        60.0, "longest reference clip (requests and voice uploads), seconds; longer ones are a 400"
    )
    # One key a line (services/gateway/auth.py), next to TTS_GATEWAY_API_KEYS.
    api_keys_file: str = setting(
        "",
        "file of API keys, one a line; with it (or TTS_GATEWAY_API_KEYS) every /v1/ route and "
        "tts.v1 RPC needs Authorization: Bearer <key> (default: no authentication)",
    )
    # Shared secret of the services (qtts/serving/internal_auth.py); empty: off.
    internal_token: str = common.internal_token()
    # TLS / mutual TLS to talker and speaker_cache (qtts/serving/tls.py: --tls-*), and TLS on the public
    # HTTP and gRPC ports (--public-tls-*); both off by default.
    tls: TlsConfig = group(TlsConfig(), "tls", what="the gateway's calls to talker and speaker_cache")
    public_tls: TlsConfig = group(
        TlsConfig(flag="public-tls"),
        "public-tls",
        omit=("server_name",),
        what="the public HTTP and gRPC ports",
    )
    log_level: str = common.log_level()
    # For clients that always send `instructions`, also to a variant with no instruct block.
    unsupported_instructions: str = setting(
        "reject",
        "instructions on a variant without an instruct block (Base, 0.6B CustomVoice): reject "
        "(400 naming the field) or ignore (drop them, report them in the x-tts-ignored-fields header)",
        choices=UNSUPPORTED_INSTRUCTIONS,
    )

    def validate(self) -> GatewayConfig:
        """Raise `InvalidArgument` with a clear message for an unusable configuration."""
        check_server_fields(self, ports=("http_port", "grpc_port"))
        self.tls.validate(serves=False)
        self.public_tls.validate()
        if self.http_port == 0 or self.grpc_port == 0:
            raise InvalidArgument("--http-port and --grpc-port must be set (non-zero)")
        for name in ("talker", "speaker_cache", *(("aligner",) if self.aligner else ())):
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
        if not 0 <= self.talker_room_wait_ms <= 1000:
            raise InvalidArgument(
                f"--talker-room-wait-ms must be between 0 and 1000, got {self.talker_room_wait_ms:g}"
            )
        if self.max_streams < 1:
            raise InvalidArgument(f"--max-streams must be >= 1, got {self.max_streams}")
        if not 1 <= self.max_input_chars <= request_limits.TEXT_MAX_CHARS:
            raise InvalidArgument(f"--max-input-chars must be in 1..{request_limits.TEXT_MAX_CHARS}")
        if not 1 <= self.max_text_piece_chars <= self.max_utterance_chars:
            raise InvalidArgument("--max-text-piece-chars must be in 1..--max-utterance-chars")
        if self.stream_idle_timeout_s < 0:
            raise InvalidArgument(f"--stream-idle-timeout-s must be >= 0, got {self.stream_idle_timeout_s}")
        if self.ws_max_message_bytes < 0:
            raise InvalidArgument(f"--ws-max-message-bytes must be >= 0, got {self.ws_max_message_bytes}")
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
        if self.http_body_deadline_s < 0:
            raise InvalidArgument(f"--http-body-deadline-s must be >= 0, got {self.http_body_deadline_s}")
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
    def ws_message_limit_bytes(self) -> int:
        """--ws-max-message-bytes, or the HTTP body limit."""
        return self.ws_max_message_bytes or self.body_limit_bytes

    @property
    def body_limit_bytes(self) -> int:
        """--max-body-bytes, or a base64 clip of --max-ref-audio-bytes (4/3 of it) plus 1 MiB."""
        return self.max_body_bytes or self.max_ref_audio_bytes * 4 // 3 + (1 << 20)


SETTINGS = ServiceSettings(GatewayConfig, "gateway", "python -m services.gateway", __doc__)


def build_parser() -> argparse.ArgumentParser:
    return SETTINGS.parser()


def config_from_args(argv: Sequence[str] | None = None) -> GatewayConfig:
    """Parse flags (falling back to env vars) into a validated `GatewayConfig`."""
    return SETTINGS.parse(argv).validate()
