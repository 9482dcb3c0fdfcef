"""Builds and runs code2wav: decoder, engine, servicer, health (SERVING after warm-up), metrics, drain."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable

from prometheus_client import CollectorRegistry

from qtts.pb import code2wav_pb2, code2wav_pb2_grpc
from qtts.serving.device_failure import DeviceFailure
from qtts.serving.grpc_server import GrpcServiceHost, service_full_name
from qtts.serving.metrics import Code2WavMetrics
from services.code2wav.config import Code2WavConfig
from services.code2wav.core import Code2WavCore, IncrementalDecoderLike
from services.code2wav.model_loader import load_decoder
from services.code2wav.servicer import Code2WavServicer
from services.code2wav.stream import CodecShape

log = logging.getLogger(__name__)

SERVICE_NAME = service_full_name(code2wav_pb2, "Code2WavService")


class Code2WavServer:
    """One code2wav replica. RPCs are accepted from `start()`; health is SERVING after warm-up.

    A fatal device error turns health NOT_SERVING and ends the process (qtts.serving.device_failure);
    `exit_process` replaces the exit in tests."""

    def __init__(
        self,
        config: Code2WavConfig,
        decoder: IncrementalDecoderLike | None = None,
        codec_shape: CodecShape | None = None,
        exit_process: Callable[[int], object] = os._exit,
    ):
        self.config = config
        self._exit_process = exit_process
        self.device_failure: DeviceFailure | None = None
        self.metrics = Code2WavMetrics(CollectorRegistry())
        self._decoder = decoder
        self._codec_shape = codec_shape
        self.engine: Code2WavCore | None = None
        self.host = GrpcServiceHost.internal(config, SERVICE_NAME, self.metrics)
        self.host.add_shutdown_callback(self._close_engine)

    async def start(self) -> int:
        """Load the decoder (unless injected), warm it up, serve; returns the bound port."""
        cfg = self.config
        self.device_failure = DeviceFailure(self.host, exit=self._exit_process)
        self.host.on_unexpected_error(self.device_failure.check)
        startup = self.metrics.startup
        if self._decoder is None:
            with startup.phase("load the decoder and capture its graphs"):
                self._decoder, self._codec_shape = await asyncio.to_thread(load_decoder, cfg)
        self.engine = Code2WavCore(
            self._decoder,
            self.metrics,
            max_states=cfg.max_states,
            max_batch=cfg.batch_limit,
            max_call_frames=cfg.max_call_frames,
            plan=cfg.chunk_plan,
            policy=cfg.credit_policy,
            codec_shape=self._codec_shape or CodecShape(),
            max_prefix_frames=cfg.max_prefix_frames,
            device=cfg.device,
            replica=cfg.replica_name,
            coalesce_max_s=cfg.coalesce_max_ms / 1e3,
            deadline_safety_s=cfg.deadline_safety_ms / 1e3,
            decode_cost_ceiling=cfg.decode_cost_ceiling,
            device_failure=self.device_failure.check,
        )
        await self.engine.start()
        code2wav_pb2_grpc.add_Code2WavServiceServicer_to_server(
            Code2WavServicer(self.engine, metrics=self.metrics), self.host.server
        )
        port = await self.host.start()
        with startup.phase("warm up"):
            await self.engine.warm_up()
        await self.host.set_serving()
        log.info("decoder warm: SERVING (max %d states)", cfg.max_states)
        return port

    async def _close_engine(self) -> None:
        if self.engine is not None:
            await self.engine.close()

    async def stop(self, grace: float | None = None) -> None:
        await self.host.stop(grace)

    async def run(self) -> None:
        await self.start()
        await self.host.serve_until_signal()
