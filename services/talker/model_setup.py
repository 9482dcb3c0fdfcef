"""What the talker builds from its config before it serves: the model bundle, the generator
(`--engine`: the eager reference or the graph engine) and the deadline scheduler with its
admission. The front process (server.py, engine in-process) and the engine process
(engine_process.py) both build from here."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from qtts.tiny_model import ensure_tiny_snapshot

from .admission import Admission, AdmissionConfig
from .config import TalkerConfig
from .deadline import DeadlinePolicy, DeadlineScheduler

log = logging.getLogger(__name__)


def load_bundle(config: TalkerConfig) -> Any:
    """Load the configured model (building the tiny default snapshot on first use)."""
    import torch

    from qtts.model import load_talker_bundle

    path = config.model_path
    if not config.model:
        ensure_tiny_snapshot(Path(path))
    return load_talker_bundle(
        path, device=config.device, dtype=getattr(torch, config.dtype), load_format=config.load_format
    )


def generator_factory_for(config: TalkerConfig) -> Callable[[Any, int], Any]:
    """Builds the engine `--engine` names: the eager reference generator or the graph engine."""

    def eager(bundle: Any, max_batch: int) -> Any:
        from qtts.model import EagerGenerator

        return EagerGenerator(bundle, max_batch=max_batch)

    def graph(bundle: Any, max_batch: int) -> Any:
        from qtts.engine import GraphEngine, GraphEngineConfig, RunnerConfig

        runner = RunnerConfig(
            max_batch=max_batch,
            max_len=config.max_len,
            context_step=config.context_step,
            prefix_cache_bytes=config.prefix_cache_mb << 20,
            others_bytes=config.gpu_others_bytes,
            prefill_buckets=config.prefill_buckets,
            decode_kernels=config.decode_kernels,
            sample_kernel=config.sample_kernel,
            weight_dtype=config.weight_dtype,
            kv_cache_dtype=config.kv_cache_dtype,
        )
        return GraphEngine(
            bundle,
            max_batch=max_batch,
            config=GraphEngineConfig(runner=runner, max_prefill_tokens=config.max_prefill_tokens),
        )

    return {"eager": eager, "graph": graph}[config.engine]


def scheduler_for(config: TalkerConfig, generator: Any = None) -> DeadlineScheduler:
    """The playback-deadline scheduler and admission the flags describe, starting at most as many
    streams as `generator` has slots (its `max_batch`: the GraphEngine's KV slots, fewer than
    `--max-batch` when GPU memory holds fewer), so every stream it starts finds a slot."""
    c = config
    max_batch = c.max_batch
    slots = getattr(generator, "max_batch", None)
    if isinstance(slots, int) and slots < max_batch:
        log.warning(
            "the generator holds %d streams (--max-batch %d): starting at most %d", slots, max_batch, slots
        )
        max_batch = slots
    admission = Admission(
        AdmissionConfig(
            max_duty=c.admission_max_duty,
            max_load=c.admission_max_load,
            first_audio_budget_s=c.first_audio_budget_ms / 1e3,
            queue_budget_share=c.queue_budget_share,
            decoder_frame_s=c.decoder_frame_us / 1e6,
            decoder_shares_gpu=c.decoder_shares_gpu,
            step_fit=c.admission_step_fit,
            engine_costs=c.admission_engine_costs,
        )
    )
    policy = DeadlinePolicy(
        urgent_lead_s=c.urgent_lead_ms / 1e3,
        max_lead_s=c.max_lead_ms / 1e3,
        backlog_lead_s=c.backlog_lead_ms / 1e3 if c.backlog_lead_ms else None,
        first_chunk_step_s=c.first_chunk_step_ms / 1e3,
        coalesce_s=c.prefill_coalesce_ms / 1e3,
        coalesce_from_load=c.prefill_coalesce_from_load,
        coalesce_full_load=c.prefill_coalesce_full_load,
        min_step_interval_s=c.min_step_interval_ms / 1e3,
        min_prefill_positions=min(DeadlinePolicy.min_prefill_positions, c.max_prefill_tokens),
        max_prefill_positions=c.max_prefill_tokens,
    )
    return DeadlineScheduler(max_batch, c.max_queue, admission=admission, policy=policy)


def admission_trace_for(config: TalkerConfig) -> Any:
    """The admission trace `--admission-trace` asks for (None: off), opened for appending."""
    if not config.admission_trace:
        return None
    from .admission_trace import AdmissionTrace

    trace = AdmissionTrace(config.admission_trace)
    log.info("admission trace: writing every admission decision to %s", trace.path)
    return trace
