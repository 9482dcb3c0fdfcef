"""Builds and runs the gateway: the FastAPI app (uvicorn) and the tts.v1 gRPC server on one loop."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import signal
import ssl
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import numpy as np
import uvicorn
from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from qtts.pb import tts_pb2, tts_pb2_grpc
from qtts.request.errors import TTSError, Unavailable
from qtts.serving.grpc_server import RECONNECT_OPTIONS, GrpcServiceHost, service_full_name
from qtts.serving.internal_auth import client_interceptors
from qtts.serving.metrics import GatewayMetrics
from qtts.serving.tls import TlsConfig, aio_channel
from qtts.serving.tracing import TracingMiddleware

from .aligner_client import AlignerClient
from .auth import ApiKeyInterceptor, ApiKeys, load_api_keys
from .config import GatewayConfig
from .consents import ConsentStore
from .core import GatewayCore, decode_reference
from .grpc_servicer import TextToSpeechServicer
from .http_app import HttpDeps, create_app
from .http_body import size_decoded_cache
from .http_limits import header_timeout_protocol
from .http_metrics import HttpMetricsMiddleware
from .job import ModelCatalog
from .rate_limit import RateLimiter, RateLimitInterceptor
from .reference_cache import DecodedReferenceCache
from .request_id import RequestIdMiddleware
from .stage_health import StageHealth
from .status import StatusReporter
from .stream_limits import StreamLimits
from .talker_client import TalkerClient
from .talker_pool import DnsResolver, TalkerPool
from .talker_session import SESSION
from .validation import RequestLimits
from .voice_client import SpeakerCacheConsents, VoiceClient
from .voices import VoiceService

log = logging.getLogger(__name__)

SERVICE_NAME = service_full_name(tts_pb2, "TextToSpeechService")


# After the drain's grace, how long the streams still running have to send their error event.
END_EVENT_GRACE_S = 1.0


class _UvicornServer(uvicorn.Server):
    """uvicorn without its own signal handling: the gateway drains HTTP and gRPC together."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _uvicorn_tls(tls: TlsConfig) -> dict[str, Any]:
    """uvicorn's TLS settings for the public HTTP port (none: plaintext)."""
    if not tls.cert:
        return {}
    extra: dict[str, Any] = {"ssl_certfile": tls.cert, "ssl_keyfile": tls.key}
    if tls.ca:
        extra["ssl_ca_certs"] = tls.ca
        extra["ssl_cert_reqs"] = ssl.CERT_REQUIRED if tls.mutual else ssl.CERT_NONE
    return extra


class GatewayServer:
    """The gateway process: HTTP + gRPC front ends over one synthesis core.

    Health (gRPC) turns SERVING once the talker told which model it serves; `GET /health` also
    checks the talker and speaker_cache on every call.
    """

    def __init__(
        self,
        config: GatewayConfig,
        catalog_retry_s: float = 0.5,
        decode: Callable[[bytes], np.ndarray] | None = None,
    ):
        self.config = config
        if decode is None:
            decode = functools.partial(decode_reference, max_seconds=config.max_ref_audio_seconds)
        self.metrics = GatewayMetrics(CollectorRegistry())
        self._connect_stages(config)
        self.catalog: ModelCatalog | None = None
        self._catalog_retry_s = catalog_retry_s
        self._build_core(config, decode)
        self.api_keys = ApiKeys(load_api_keys(config.api_keys_file))
        # One bucket per client for HTTP and gRPC together: a client cannot double its rate.
        self.rate_limiter = (
            RateLimiter(config.rate_limit_per_s, config.rate_limit_burst_size)
            if config.rate_limit_per_s > 0
            else None
        )
        self.host = self._grpc_host(config)
        self.app = self._http_app(config)
        self.http = self._http_server(config)
        self._http_task: asyncio.Task | None = None
        self._catalog_task: asyncio.Task | None = None

    def _connect_stages(self, config: GatewayConfig) -> None:
        """Clients of the talker (a pool of replicas, or one balanced channel) and speaker_cache."""
        self.talker_pool = (
            TalkerPool(
                DnsResolver(config.talker),
                refresh_s=config.talker_refresh_s,
                room_wait_s=config.talker_room_wait_ms / 1e3,
                on_room_wait=lambda got, seconds: self.metrics.room_wait_seconds.labels(
                    "room" if got else "refused"
                ).observe(seconds),
                connect=lambda addr: aio_channel(
                    addr,
                    config.tls,
                    options=RECONNECT_OPTIONS,
                    interceptors=client_interceptors(config.internal_token),
                ),
            )
            if config.talker_balancing == "pool"
            else None
        )
        self.talker = TalkerClient(
            config.talker,
            pool=self.talker_pool,
            token=config.internal_token,
            tls=config.tls,
            sessions=config.talker_sessions,
            on_session_written=functools.partial(self.metrics.session_written, SESSION),
        )
        self.voice_client = VoiceClient(config.speaker_cache, token=config.internal_token, tls=config.tls)
        # Optional: without it word_timestamps is refused.
        self.aligner = (
            AlignerClient(config.aligner, token=config.internal_token, tls=config.tls)
            if config.aligner
            else None
        )

    def _build_core(self, config: GatewayConfig, decode: Callable[[bytes], np.ndarray]) -> None:
        """What both front ends share: the synthesis core, voices, consents and stage health."""
        limits = RequestLimits(
            config.max_input_chars,
            config.max_new_frames_limit,
            config.max_ref_audio_bytes,
            config.sample_rate,
            config.max_text_piece_chars,
            config.max_utterance_chars,
        )
        # The clips' base64 decodes (services/gateway/http_body.py) are kept within a quarter of
        # the same flag: the one bound on the clips this process keeps.
        size_decoded_cache((config.ref_audio_cache_mb << 20) // 4)
        self.reference_cache = (
            DecodedReferenceCache(
                decode,
                config.ref_audio_cache_mb << 20,
                self.metrics.reference_cache_hits.inc,
                self.metrics.reference_cache_misses.inc,
            )
            if config.ref_audio_cache_mb > 0
            else None
        )
        self.synthesizer = GatewayCore(
            self.talker,
            lambda: self.catalog,
            limits,
            StreamLimits(config.max_streams, config.max_streams_per_client),
            self.metrics,
            decode=self.reference_cache if self.reference_cache is not None else decode,
            unsupported_instructions=config.unsupported_instructions,
        )
        self.voices = VoiceService(
            self.voice_client, decode, lambda: self.catalog, config.max_ref_audio_bytes
        )
        # In speaker_cache: every gateway replica knows every consent.
        self.consents = ConsentStore(SpeakerCacheConsents(self.voice_client))
        # Readiness follows what a new stream would do: with a pool, the pool's view of its talkers
        # (a check over the shared channel could say SERVING while every new stream got 503).
        stages = {"speaker_cache": self.voice_client.channel}
        serving = {}
        if self.talker_pool is not None:
            serving["talker"] = self.talker_pool.serving
        else:
            stages["talker"] = self.talker.channel
        if self.aligner is not None:
            stages["aligner"] = self.aligner.channel
        self.stage_health = StageHealth(stages, serving=serving)

    def _grpc_host(self, config: GatewayConfig) -> GrpcServiceHost:
        """The public tts.v1 gRPC server, with API keys and the rate limit in front."""
        host = GrpcServiceHost(
            service_names=[SERVICE_NAME],
            metrics=self.metrics,
            host=config.host,
            port=config.grpc_port,
            metrics_port=config.metrics_port,
            drain_seconds=config.drain_seconds,
            interceptors=[ApiKeyInterceptor(self.api_keys, [SERVICE_NAME]), *self._rate_interceptors()],
            redact_errors=True,
            credentials=config.public_tls.server_credentials(),
        )
        tts_pb2_grpc.add_TextToSpeechServiceServicer_to_server(
            TextToSpeechServicer(
                self.synthesizer,
                self.voices,
                self.api_keys,
                write_timeout_s=config.http_write_timeout_s,
                consents=self.consents,
                aligner=self.aligner,
                idle_timeout_s=config.stream_idle_timeout_s,
            ),
            host.server,
        )
        return host

    def _http_app(self, config: GatewayConfig) -> FastAPI:
        """The OpenAI-compatible HTTP app, with metrics, tracing and request ids around it."""
        app = create_app(
            HttpDeps(
                self.synthesizer,
                self.voices,
                self.metrics,
                self.stage_health.check,
                StatusReporter(self.synthesizer, config.talker_metrics_url),
                max_body_bytes=config.body_limit_bytes,
                rate_limiter=self.rate_limiter,
                body_timeout_s=config.http_body_timeout_s,
                body_deadline_s=config.http_body_deadline_s,
                write_timeout_s=config.http_write_timeout_s,
                ws_max_message_bytes=config.ws_message_limit_bytes,
                stream_idle_timeout_s=config.stream_idle_timeout_s,
                api_keys=self.api_keys,
                consents=self.consents,
                aligner=self.aligner,
            )
        )
        app.add_middleware(HttpMetricsMiddleware, metrics=self.metrics)
        app.add_middleware(TracingMiddleware)
        app.add_middleware(RequestIdMiddleware)
        return app

    def _http_server(self, config: GatewayConfig) -> _UvicornServer:
        """uvicorn serving `self.app`; its graceful shutdown outlasts the drain by END_EVENT_GRACE_S."""
        return _UvicornServer(
            uvicorn.Config(
                self.app,
                host=config.host,
                port=config.http_port,
                log_level="warning",
                lifespan="off",
                timeout_graceful_shutdown=max(1.0, config.drain_seconds + END_EVENT_GRACE_S),
                access_log=False,
                timeout_keep_alive=int(max(1, config.http_keepalive_s)),
                ws_max_size=config.ws_message_limit_bytes,
                proxy_headers=bool(config.forwarded_allow_ips),
                forwarded_allow_ips=config.forwarded_allow_ips or None,
                http=header_timeout_protocol(config.http_header_timeout_s),
                **_uvicorn_tls(config.public_tls),
            )
        )

    def _rate_interceptors(self) -> list[RateLimitInterceptor]:
        if self.rate_limiter is None:
            return []
        return [RateLimitInterceptor(self.rate_limiter, [SERVICE_NAME], self.api_keys.enabled)]

    async def start(self) -> None:
        """Bind both ports; model info is fetched from the talker in the background."""
        await self.host.start()
        if self.talker_pool is not None:
            self.talker_pool.start()
        self._http_task = asyncio.create_task(self.http.serve())
        while not self.http.started:
            if self._http_task.done():
                self._http_task.result()
                raise OSError(f"HTTP server did not start on {self.config.host}:{self.config.http_port}")
            await asyncio.sleep(0.02)
        scheme = "https" if self.config.public_tls.cert else "http"
        log.info("HTTP on %s://%s:%d", scheme, self.config.host, self.config.http_port)
        self._catalog_task = asyncio.create_task(self._fetch_catalog())

    async def _fetch_catalog(self) -> None:
        attempts = 0
        while True:
            try:
                catalog = await self.talker.model_info()
                break
            except TTSError as exc:
                attempts += 1
                if attempts % 20 == 1:
                    log.warning("waiting for the talker: %s", exc.message)
                await asyncio.sleep(self._catalog_retry_s)
        if self.config.served_model_name:
            catalog = replace(catalog, name=self.config.served_model_name)
        self.catalog = catalog
        if self.talker_pool is not None:
            await self.talker_pool.wait_usable()
        log.info("serving model %s (%s)", catalog.name, catalog.model_type)
        await self.host.set_serving()
        await self._follow_talker()

    async def _follow_talker(self) -> None:
        """The gateway's gRPC health follows the talker's (every --talker-refresh-s): a gateway
        whose talker is down must not draw gRPC clients. speaker_cache does not count: without
        it only the voice API fails."""
        serving = True
        while True:
            await asyncio.sleep(self.config.talker_refresh_s)
            talker_ok = (await self.stage_health.check()).get("talker") == "SERVING"
            if talker_ok != serving:
                serving = talker_ok
                log.warning(
                    "talker %s: gRPC health %s",
                    "back" if serving else "not serving",
                    "SERVING" if serving else "NOT_SERVING",
                )
                await (self.host.set_serving() if serving else self.host.set_not_serving())

    async def stop(self) -> None:
        """Drain: health NOT_SERVING, no new requests, in-flight streams get drain_seconds; those
        still running then end with an error event or status (END_EVENT_GRACE_S to send it)."""
        if self._catalog_task is not None:
            self._catalog_task.cancel()
        cut = asyncio.create_task(self._cut_streams_after(self.config.drain_seconds))
        self.http.should_exit = True
        await self.host.stop(self.config.drain_seconds + END_EVENT_GRACE_S)
        if self._http_task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._http_task
        cut.cancel()
        await self.talker.close()
        await self.voice_client.close()
        if self.aligner is not None:
            await self.aligner.close()

    async def _cut_streams_after(self, seconds: float) -> None:
        await asyncio.sleep(seconds)
        cut = self.synthesizer.cut_all(Unavailable("the gateway is shutting down; retry the request"))
        if cut:
            log.warning("drain over: %d streams still running end with an error", cut)

    async def run(self) -> None:
        """Serve until SIGTERM/SIGINT, then drain both front ends."""
        await self.start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        log.info("draining for up to %.1f s", self.config.drain_seconds)
        await self.stop()
