"""Builds and runs the speaker_cache server: store, core, servicer, health, metrics, drain."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from prometheus_client import CollectorRegistry

from qtts.pb import speaker_cache_pb2, speaker_cache_pb2_grpc
from qtts.serving.grpc_server import GrpcServiceHost, service_full_name
from qtts.serving.metrics import SpeakerCacheMetrics
from services.speaker_cache.config import SpeakerCacheConfig, redacted_url
from services.speaker_cache.core import SpeakerCacheCore
from services.speaker_cache.lru_store import LruStore
from services.speaker_cache.redis_store import RedisStore
from services.speaker_cache.servicer import SpeakerCacheServicer
from services.speaker_cache.store import SpeakerStore

log = logging.getLogger(__name__)

SERVICE_NAME = service_full_name(speaker_cache_pb2, "SpeakerCacheService")


def build_store(config: SpeakerCacheConfig) -> SpeakerStore:
    if config.redis_url:
        username, password = config.redis_credentials()
        log.info("voice store: Redis at %s", redacted_url(config.redis_url))
        return RedisStore(
            config.redis_url,
            namespace=config.redis_namespace,
            prompt_ttl_s=config.prompt_ttl_s,
            max_voices=config.max_voices,
            username=username,
            password=password,
            ssl_ca_certs=config.redis_ca or None,
        )
    return LruStore(config.lru_entries, config.lru_bytes, config.max_voices)


class SpeakerCacheServer:
    """The speaker_cache process: SERVING while its store answers a ping, NOT_SERVING otherwise."""

    def __init__(
        self, config: SpeakerCacheConfig, store: SpeakerStore | None = None, health_interval_s: float = 5.0
    ):
        self.config = config
        self.metrics = SpeakerCacheMetrics(CollectorRegistry())
        self.store = store if store is not None else build_store(config)
        self.cache = SpeakerCacheCore(self.store, self.metrics, max_audio_bytes=config.max_audio_bytes)
        self.host = GrpcServiceHost.internal(config, SERVICE_NAME, self.metrics)
        speaker_cache_pb2_grpc.add_SpeakerCacheServiceServicer_to_server(
            SpeakerCacheServicer(self.cache), self.host.server
        )
        self.host.add_shutdown_callback(self._shutdown)
        self.health_interval_s = health_interval_s
        self._health_task: asyncio.Task | None = None
        self._serving = False

    async def start(self) -> int:
        """Start serving RPCs; health turns SERVING once the store answers (in the background)."""
        port = await self.host.start()
        self._health_task = asyncio.create_task(self._watch_store())
        return port

    async def wait_serving(self, timeout: float = 30.0) -> None:
        async with asyncio.timeout(timeout):
            while not self._serving:
                await asyncio.sleep(0.01)

    async def _watch_store(self) -> None:
        while True:
            try:
                await self.store.ping()
                if not self._serving:
                    await self.cache.refresh_voice_count()
                    await self.host.set_serving()
                    self._serving = True
                    log.info("store answers: SERVING")
            except Exception as exc:  # noqa: BLE001 - any failure means the store does not answer
                if self._serving:
                    await self.host.set_not_serving()
                    self._serving = False
                log.warning("store not answering: %s", exc)
            await asyncio.sleep(self.health_interval_s if self._serving else min(1.0, self.health_interval_s))

    async def _shutdown(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        await self.store.close()

    async def stop(self, grace: float | None = None) -> None:
        await self.host.stop(grace)

    async def run(self) -> None:
        await self.start()
        await self.host.serve_until_signal()
