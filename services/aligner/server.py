"""Builds and runs the aligner: model, core, servicer, health (SERVING after warm-up), metrics, drain."""

from __future__ import annotations

import asyncio
import logging

import torch
from prometheus_client import CollectorRegistry

from qtts.model.aligner import ForcedAligner, load_aligner
from qtts.model.aligner.batched import BucketedAligner
from qtts.pb import aligner_pb2, aligner_pb2_grpc
from qtts.serving.grpc_server import GrpcServiceHost, service_full_name
from qtts.serving.metrics import AlignerMetrics
from services.aligner.config import AlignerConfig
from services.aligner.core import AlignerCore
from services.aligner.servicer import AlignerServicer

log = logging.getLogger(__name__)

SERVICE_NAME = service_full_name(aligner_pb2, "AlignerService")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_model(config: AlignerConfig) -> ForcedAligner:
    """The configured aligner, or the tiny random one when no --model is given."""
    if config.model:
        path = config.model
    else:
        from qtts.tiny_model.aligner import ensure_tiny_aligner

        path = str(ensure_tiny_aligner())
    return load_aligner(
        path, load_format=config.load_format, device=config.device, dtype=DTYPES[config.dtype]
    )


class AlignerServer:
    """The aligner process. RPCs are accepted from `start()`; health is SERVING after warm-up."""

    def __init__(self, config: AlignerConfig, aligner: ForcedAligner | None = None):
        self.config = config
        self.metrics = AlignerMetrics(CollectorRegistry())
        self._aligner = aligner
        self.core: AlignerCore | None = None
        self.host = GrpcServiceHost.internal(config, SERVICE_NAME, self.metrics)
        self.host.add_shutdown_callback(self._close_core)

    async def start(self) -> int:
        """Load the model (unless injected), warm it up, serve; returns the bound port."""
        cfg = self.config
        startup = self.metrics.startup
        if self._aligner is None:
            with startup.phase("load the model"):
                self._aligner = await asyncio.to_thread(load_model, cfg)
        runner = BucketedAligner(
            self._aligner,
            cuda_graphs=cfg.cuda_graphs,
            max_graphs=cfg.max_graphs,
            graph_max_length=cfg.graph_max_length,
        )
        self.core = AlignerCore(
            runner,
            self.metrics,
            max_batch=cfg.max_batch,
            gather_s=cfg.gather_ms / 1e3,
            max_audio_s=cfg.max_audio_s,
            max_text_chars=cfg.max_text_chars,
            gpu_share=cfg.gpu_share,
            share_max_wait_s=cfg.share_max_wait_ms / 1e3,
        )
        await self.core.start()
        aligner_pb2_grpc.add_AlignerServiceServicer_to_server(AlignerServicer(self.core), self.host.server)
        port = await self.host.start()
        with startup.phase("warm up (graph capture)"):
            graphs = await self.core.warm_up(cfg.warmup_seconds())
        await self.host.set_serving()
        log.info(
            "aligner %s warm: SERVING (batches of up to %d, CUDA graphs %s)",
            self._aligner.name,
            cfg.max_batch,
            f"on, {graphs} captured" if runner.graphs_on else "off",
        )
        return port

    async def _close_core(self) -> None:
        if self.core is not None:
            await self.core.close()

    async def stop(self, grace: float | None = None) -> None:
        await self.host.stop(grace)

    async def run(self) -> None:
        await self.start()
        await self.host.serve_until_signal()
