"""Builds and runs the talker: model bundle, generator engine thread, code2wav ring, servicer, drain."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry

from qtts.pb import talker_pb2, talker_pb2_grpc
from qtts.serving.device_failure import DEVICE_FAILURE_EXIT_CODE, DeviceFailure
from qtts.serving.grpc_server import GrpcServiceHost, service_full_name
from qtts.serving.metrics import TalkerMetrics

from .code2wav_client import DecoderCosts
from .config import TalkerConfig
from .core import TalkerCore
from .decode_session import DECODE_SESSION
from .engine_client import EngineClient, RemoteBundle, engine_process_on
from .generation_loop import GenerationLoop
from .metrics_merge import MergedRegistry
from .model_setup import admission_trace_for, generator_factory_for, load_bundle, scheduler_for
from .replicas import Code2WavReplicas
from .servicer import TalkerServicer
from .speaker_cache_client import SpeakerCacheClient
from .voice_worker import VoiceWorker, VoiceWorkerSpec
from .voices import VoiceResolver
from .warmup import warm_up

log = logging.getLogger(__name__)

SERVICE_NAME = service_full_name(talker_pb2, "TalkerService")


class TalkerServer:
    """The talker process; `bundle`, `generator_factory` and `exit_process` may be injected (tests).

    Health is SERVING while it can serve: after warm-up, and while at least one code2wav replica
    is on the ring (without one every request would fail). An empty ring turns it NOT_SERVING at
    once when every replica is known dead (its connection refused), else after two health rounds
    (one round timed out under load is no outage). A fatal device error turns it NOT_SERVING for
    good and ends the process (qtts.serving.device_failure).
    """

    def __init__(
        self,
        config: TalkerConfig,
        *,
        bundle: Any = None,
        generator_factory: Callable[[Any, int], Any] | None = None,
        spec_factory: Callable[..., Any] | None = None,
        run_warm_up: bool = True,
        exit_process: Callable[[int], object] = os._exit,
    ):
        self.config = config
        self.metrics = TalkerMetrics(CollectorRegistry())
        self.bundle = bundle
        # The engine in a process of its own, unless a test hands in the model or the generator.
        self.engine_client: EngineClient | None = None
        if bundle is None and generator_factory is None and engine_process_on(config):
            self.engine_client = EngineClient(config, run_warm_up=run_warm_up, on_lost=self._engine_lost)
            self.metrics.registry = MergedRegistry(self.metrics.registry, self.engine_client.metrics_snapshot)
        self._generator_factory = generator_factory or generator_factory_for(config)
        self._spec_factory = spec_factory
        self._run_warm_up = run_warm_up
        self.host = GrpcServiceHost.internal(config, SERVICE_NAME, self.metrics)
        self.servicer = TalkerServicer(room_share_floor=config.room_share_floor)
        talker_pb2_grpc.add_TalkerServiceServicer_to_server(self.servicer, self.host.server)
        self.host.add_shutdown_callback(self._shutdown)
        self.host.add_drain_callback(self.servicer.drain)  # ends WatchCapacity and idle Session calls
        self.servicer.sessions.metrics = self.metrics
        self.engine: GenerationLoop | EngineClient | None = None
        self.admission: Any = None  # the in-process engine's (services/talker/admission.py)
        self.replicas: Code2WavReplicas | None = None
        self.core: TalkerCore | None = None
        self._cache: SpeakerCacheClient | None = None
        self._voices: VoiceResolver | None = None
        self._voice_worker: VoiceWorker | None = None
        self._exit_process = exit_process
        self.device_failure: DeviceFailure | None = None
        self._started = False
        self._health_sync: asyncio.Future | None = None
        self._unready_timer: asyncio.TimerHandle | None = None

    async def start(self) -> int:
        """Serve (NOT_SERVING), load the model, start the engine, then report SERVING (once a code2wav
        replica answers)."""
        port = await self.host.start()
        self.device_failure = DeviceFailure(self.host, exit=self._exit_process)
        self.host.on_unexpected_error(self.device_failure.check)
        self.servicer.sessions.on_unexpected = self.device_failure.check
        if self.engine_client is not None:
            # The voice encoders get a process of their own too (voice_worker.py); it loads meanwhile.
            self._voice_worker = VoiceWorker(VoiceWorkerSpec.from_config(self.config))
            self._voice_worker.launch()
            # Model load, graph capture and warm-up happen there; health keeps answering here.
            with self.metrics.startup.phase("start the engine process"):
                facts = await asyncio.to_thread(self.engine_client.start)
            self.metrics.startup.record_all(facts.startup, prefix="engine: ")
            self.bundle = RemoteBundle(self.engine_client, facts)
            self.engine = self.engine_client
            log.info(
                "loaded %s (%s, %s) in engine process %d",
                facts.info.name,
                facts.info.model_type,
                facts.info.model_size,
                facts.pid,
            )
        else:
            await self._start_engine_here()
        info = self.bundle.info
        if self._voice_worker is not None and info.model_type != "base":  # no voice to clone
            await asyncio.to_thread(self._voice_worker.stop)
            self._voice_worker = None
        self.replicas = Code2WavReplicas(
            self.config.code2wav,
            vnodes=self.config.ring_vnodes,
            health_interval_s=self.config.health_interval_s,
            stall_hold_s=self.config.code2wav_stall_timeout_s,
            token=self.config.internal_token,
            tls=self.config.tls,
            on_availability=self._replicas_changed,
            sessions=self.config.code2wav_sessions,
            on_session_written=functools.partial(self.metrics.session_written, DECODE_SESSION),
        )
        if self.config.decoder_shares_gpu:  # code2wav's measured cost reaches admission
            # In this process a few floats the engine thread reads: no lock (see Admission).
            sink = (
                self.engine_client.observe_decoder_cost
                if self.engine_client
                else self.admission.observe_decoder
            )
            self.replicas.on_decoder_cost = DecoderCosts(sink).observe
        self.replicas.start()
        self._cache = SpeakerCacheClient(
            self.config.speaker_cache or None,
            self.config.speaker_cache_timeout_s,
            token=self.config.internal_token,
            tls=self.config.tls,
        )
        # Voice prompts are keyed by the encoders' weights, not the served name: two snapshots
        # served under one name share prompts only when their encoders are equal.
        fingerprint = getattr(self.bundle, "voice_encoder_fingerprint", None)
        digest = await asyncio.to_thread(fingerprint) if fingerprint is not None else ""
        model_id = f"{info.name}@{digest[:16]}" if digest else info.name
        if self._voice_worker is not None and await asyncio.to_thread(self._voice_worker.start) != digest:
            raise RuntimeError("the voice worker's encoder weights differ from the engine's")
        self._voices = VoiceResolver(
            self.bundle, self._cache, model_id=model_id, metrics=self.metrics, worker=self._voice_worker
        )
        self.core = TalkerCore(
            bundle=self.bundle,
            engine=self.engine,
            replicas=self.replicas,
            voices=self._voices,
            metrics=self.metrics,
            credit_window_frames=self.config.credit_window_frames,
            stall_timeout_s=self.config.code2wav_stall_timeout_s,
            spec_factory=self._spec_factory,
            first_audio_budget_s=self.config.first_audio_budget_ms / 1e3,
            start_planner=self.config.start_planner(),
        )
        self.servicer.core = self.core
        await self.replicas.check_all()
        self._started = True
        await self._apply_health()
        return port

    async def _start_engine_here(self) -> None:
        startup = self.metrics.startup
        if self.bundle is None:
            with startup.phase("load the model"):
                self.bundle = await asyncio.to_thread(load_bundle, self.config)
        info = self.bundle.info
        log.info("loaded %s (%s, %s)", info.name, info.model_type, info.model_size)
        # Graph capture takes a while on a GPU: off the loop, so health keeps answering.
        with startup.phase("build the engine (graph capture)"):
            generator = await asyncio.to_thread(self._generator_factory, self.bundle, self.config.max_batch)
        if self._run_warm_up:
            # Before the engine thread exists: the generator is only ever driven by one thread.
            with startup.phase("warm up"):
                await asyncio.to_thread(warm_up, self.bundle, generator)
        scheduler = scheduler_for(self.config, generator)
        self.admission = scheduler.admission  # code2wav's decode cost goes here (see start)
        self.engine = GenerationLoop(
            generator,
            scheduler,
            self.metrics,
            device_failure=self.device_failure.check,
            trace=admission_trace_for(self.config),
        )
        self.engine.start()

    def _engine_lost(self, message: str) -> None:
        """The engine process failed its device or ended: NOT_SERVING and exit, as on a device
        failure here (its streams already failed with UNAVAILABLE)."""
        if self.device_failure is not None:
            self.device_failure.report(RuntimeError(message))
        else:
            self._exit_process(DEVICE_FAILURE_EXIT_CODE)

    def _replicas_changed(self, available: bool) -> None:
        if self._unready_timer is not None:
            self._unready_timer.cancel()
            self._unready_timer = None
        if available or self.replicas.all_lost:
            self._sync_health_soon()
        else:
            delay = 2 * self.config.health_interval_s
            self._unready_timer = asyncio.get_running_loop().call_later(delay, self._sync_health_soon)

    def _sync_health_soon(self) -> None:
        self._health_sync = asyncio.ensure_future(self._apply_health())

    async def _apply_health(self) -> None:
        """Health from the current state, whatever changed last (so calls may run in any order)."""
        if not self._started or self.device_failure.failed or self.replicas is None:
            return
        if self.replicas.healthy:
            await self.host.set_serving()
        else:
            log.warning("no code2wav replica is reachable: NOT_SERVING until one is")
            await self.host.set_not_serving()

    async def stop(self, grace: float | None = None) -> None:
        """Drain: stop admitting, let in-flight streams finish up to the grace, then free everything."""
        if self.engine is not None:
            self.engine.stop_admitting()
        await self.host.stop(grace)

    async def _shutdown(self) -> None:
        if self._unready_timer is not None:
            self._unready_timer.cancel()
        if self.engine is not None:
            await asyncio.to_thread(self.engine.stop)
        if self._voices is not None:
            await self._voices.close()  # stops the voice worker
        elif self._voice_worker is not None:
            await asyncio.to_thread(self._voice_worker.stop)
        if self._cache is not None:
            await self._cache.close()
        if self.replicas is not None:
            await self.replicas.close()

    async def run(self) -> None:
        await self.start()
        await self.host.serve_until_signal()
