"""The code2wav core: opens/frees decoder states and decodes ready chunks of all streams in batches.

All torch work runs in one dedicated worker thread, so the asyncio loop (gRPC I/O, credit) never
blocks on a decode. One batch is in flight at a time; while it runs, frames keep arriving and the
next batch takes the ready streams earliest playback deadline first (`DecodeStream.deadline`).

First chunks have a lane of their own: while any stream waiting for its first audio has a chunk
ready, the next call decodes only such streams, and their audio goes out when that call ends,
not after a wide call of steady-state chunks (whose listeners have audio buffered). A first chunk
is usually shorter than the steady-state chunks ready beside it, so the decoder would have run it
as a step of its own inside the wide call anyway: the lane costs a call's overhead, not a step
(one more step only where a first chunk is as long as chunks ready beside it). The lane is never
taken twice in a row while playing streams have chunks ready: in a burst of opens a new batch of
first chunks is ready before every call, and the lane alone would hold playing streams back until
the burst ends.

A call decodes at most `max_call_frames` frames (the earliest deadlines first; always one chunk):
a first chunk that arrives while a call runs waits at most that call. Uncapped, chunks that came
together (streams opened together have aligned chunk boundaries) made calls of 200 streams and
3,400 frames, 92 ms of an H200's decode time at 27 us a frame, and first chunks waited them out.

New streams' states are made in batches between decode calls (`starts.StateStarter`), so a decode
call waits behind at most one batch of starts.

A decode call costs a fixed launch floor plus a share per frame, so narrow calls waste the GPU. When
no ready stream is starting and the nearest deadline is far enough away, the loop waits a short,
bounded interval (`coalesce_max_s`, never closer than `deadline_safety_s` to that deadline) for
more streams to become ready, and decodes them in one wider call.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import numpy as np
import torch

from qtts.audio import pcm_s16le_batch
from qtts.request.errors import GenerationFailed, InvalidArgument, Unavailable
from qtts.serving.metrics import Code2WavMetrics
from qtts.streams.chunk_plan import ChunkPlan
from qtts.streams.decode_events import DecodedAudio
from services.code2wav.credit import CreditPolicy
from services.code2wav.decode_cost import (
    CALIBRATION_REPEATS,
    DecodeCost,
    DecodeCostEstimate,
    calibration_calls,
)
from services.code2wav.registry import StreamRegistry
from services.code2wav.starts import StateStarter
from services.code2wav.stream import CodecShape, DecodeStream

log = logging.getLogger(__name__)


class IncrementalDecoderLike(Protocol):
    """What the engine needs of `qtts.model.IncrementalDecoder` (`decode_batch` and `start_many`
    are used where the decoder has them; `starts.make_states` falls back to one `start` each)."""

    def start(self, prefix_codes: torch.Tensor | None = None) -> Any: ...

    def decode(self, state: Any, codes: torch.Tensor) -> torch.Tensor: ...

    def free(self, state: Any) -> None: ...


class Code2WavCore:
    """Owns the decoder, the worker thread and the stream registry of one code2wav replica."""

    def __init__(
        self,
        decoder: IncrementalDecoderLike,
        metrics: Code2WavMetrics,
        *,
        max_states: int = 256,
        max_batch: int = 64,
        max_call_frames: int = 0,
        plan: ChunkPlan | None = None,
        policy: CreditPolicy | None = None,
        codec_shape: CodecShape | None = None,
        max_prefix_frames: int = 2048,
        device: torch.device | str = "cpu",
        replica: str = "",
        coalesce_max_s: float = 0.0,
        deadline_safety_s: float = 0.1,
        decode_cost_ceiling: float = DecodeCost.CONTENTION_CEILING,
        clock: Callable[[], float] = time.monotonic,
        device_failure: Callable[[BaseException], bool] | None = None,
    ):
        self.decoder = decoder
        # Reports a fatal device error (qtts.serving.device_failure) and says whether it was one.
        self._device_failure = device_failure
        self.metrics = metrics
        self.registry = StreamRegistry(max_states, metrics)
        self.max_batch = max_batch
        self.max_call_frames = max_call_frames  # 0: no bound but max_batch
        self.plan = plan or ChunkPlan()
        self.policy = policy or CreditPolicy()
        self.codec_shape = codec_shape or CodecShape()
        self.max_prefix_frames = max_prefix_frames
        # Where codes go before decoding: the slot engine copies a whole step's codes at once.
        self.device = torch.device("cpu" if getattr(decoder, "accepts_host_codes", False) else device)
        self.replica = replica
        self.coalesce_max_s = coalesce_max_s
        self.deadline_safety_s = deadline_safety_s
        self.clock = clock
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="code2wav-decode")
        # New streams' states, made in batches between decode calls (starts.py).
        self._starter = StateStarter(decoder, self.device, metrics, self._executor, self._state_made)
        # What a decode call costs on this GPU, published on the credit grants (decode_cost.py).
        self.cost = DecodeCost(contention_ceiling=decode_cost_ceiling)
        self._published_cost: DecodeCostEstimate | None = None  # the estimate the metrics last showed
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        # Streams that became ready during a coalescing wait (None while no wait is on).
        self._arrived: set[DecodeStream] | None = None
        self._rescan = False
        # The last call was a first-chunk lane call that passed over ready playing streams.
        self._lane_passed_over = False

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        self._loop_task = asyncio.create_task(self._decode_loop(), name="code2wav-decode-loop")

    async def close(self) -> None:
        for stream in self.registry:
            stream.fail(GenerationFailed("code2wav is shutting down"))
            self.release(stream)
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        await self._starter.close()
        await asyncio.get_running_loop().run_in_executor(None, self._executor.shutdown)

    async def warm_up(self, frames: int = 2) -> None:
        """One decode of a few frames, so the first real stream does not pay for lazy init; then
        `calibrate` measures what a call costs before any stream comes."""

        def run() -> None:
            with torch.inference_mode():
                state = self.decoder.start(None)
                try:
                    codes = torch.zeros(
                        frames, self.codec_shape.num_codebooks, dtype=torch.long, device=self.device
                    )
                    self.decoder.decode(state, codes)
                finally:
                    self.decoder.free(state)

        await asyncio.get_running_loop().run_in_executor(self._executor, run)
        await self.calibrate()

    def calibration_calls(self) -> list[tuple[int, int]]:
        """(streams, frames each) of the calls `calibrate` times (decode_cost.calibration_calls)."""
        chunk = max(self.plan.ramp) if self.plan.ramp else 16
        wide = min(self.max_batch, self.registry.max_states)
        if self.max_call_frames:
            wide = min(wide, self.max_call_frames // chunk)
        return calibration_calls(chunk, wide)

    async def calibrate(self) -> None:
        """Time decode calls of the sizes `calibration_calls` names on fresh states (freed after)
        and seed the published cost with them, so a talker sharing this GPU admits its first
        burst at the decoder's real per-frame cost rather than at what an idle replica's few
        small calls suggest."""
        sizes = self.calibration_calls()
        num_states = max(streams for streams, _ in sizes)

        def run() -> list[tuple[int, float]]:
            states = []
            timed = []
            try:
                with torch.inference_mode():
                    for _ in range(num_states):
                        states.append(self.decoder.start(None))
                for _ in range(CALIBRATION_REPEATS):
                    for streams, frames in sizes:
                        codes = [np.zeros((frames, self.codec_shape.num_codebooks), np.int64)] * streams
                        _, elapsed_ns, _ = _decode_chunks(self.decoder, self.device, states[:streams], codes)
                        timed.append((streams * frames, elapsed_ns / 1e9))
            finally:
                for state in states:
                    self.decoder.free(state)
            return timed

        for frames, seconds in await asyncio.get_running_loop().run_in_executor(self._executor, run):
            self.cost.calibrate(frames, seconds)
        if (est := self.cost.estimate()) is not None:
            log.info(
                "decode cost calibrated: %.2f ms a call + %.1f us a frame",
                est.call_s * 1e3,
                est.frame_s * 1e6,
            )

    # ---------------------------------------------------------------- streams

    async def open_stream(
        self,
        request_id: str,
        num_codebooks: int,
        prefix_codes: np.ndarray | None = None,
        first_chunk_frames: int = 0,
        chunk_frames_ramp: Sequence[int] = (),
    ) -> DecodeStream:
        """Reserve a state slot (RESOURCE_EXHAUSTED when full), grant the first credit, and queue
        the decoder state for the worker (`StateStarter`: in batches, between decode calls).

        The grant does not wait for the state (an ICL reference prefix is decoded into it): the
        talker's first frames come while it is made and wait in the stream, which decodes nothing
        before its state exists. A state that cannot be made fails the stream."""
        if num_codebooks != self.codec_shape.num_codebooks:
            raise InvalidArgument(
                f"num_codebooks is {num_codebooks}, this decoder takes {self.codec_shape.num_codebooks}"
            )
        if prefix_codes is not None:
            if prefix_codes.shape[0] > self.max_prefix_frames:
                raise InvalidArgument(
                    f"{prefix_codes.shape[0]} prefix frames, at most {self.max_prefix_frames} are accepted"
                )
            if len(prefix_codes) and (
                prefix_codes.min() < 0 or prefix_codes.max() >= self.codec_shape.codebook_size
            ):
                raise InvalidArgument(f"prefix codes must lie in [0, {self.codec_shape.codebook_size})")
        try:
            plan = ChunkPlan.from_request(first_chunk_frames, chunk_frames_ramp, self.plan)
        except ValueError as exc:
            raise InvalidArgument(f"bad chunk plan: {exc}") from None
        stream = DecodeStream(
            request_id, plan, self.policy, self.codec_shape, self.metrics, self.replica, clock=self.clock
        )
        self.registry.add(stream)
        prefix = None if prefix_codes is None or not len(prefix_codes) else prefix_codes
        self._starter.add(stream, prefix)
        stream.start_credit()
        return stream

    def _state_made(self, stream: DecodeStream, began: float, fut: asyncio.Future) -> None:
        """The worker made (or failed to make) `stream`'s decoder state: frames waiting for it can
        be decoded now; a stream released meanwhile frees it."""
        self.metrics.observe_stage("open_stream", time.perf_counter() - began)
        if fut.cancelled():
            self._forget(stream)
            stream.fail(Unavailable("code2wav is shutting down"))
            return
        exc = fut.exception()
        if exc is not None:
            self._forget(stream)
            if self._device_failure is not None and self._device_failure(exc):
                exc = Unavailable("code2wav's GPU failed; retry the request")
            stream.fail(exc)
            return
        if stream.closed:  # released while its state was being created
            self._free_later(fut.result())
            return
        stream.decoder_state = fut.result()
        self.notify(stream)

    def release(self, stream: DecodeStream) -> None:
        """Free a stream's state (end, error or cancel). Idempotent; never blocks the loop."""
        if stream.closed:
            return
        stream.closed = True
        stream.release_backlog()
        self.registry.remove(stream.stream_id)
        if stream.decoder_state is not None:
            self._free_later(stream.decoder_state)

    def notify(self, stream: DecodeStream | None = None) -> None:
        """Frames arrived or a stream ended (`stream`, when the caller knows it): look for ready
        chunks."""
        if self._arrived is not None:  # a coalescing wait is on
            if stream is None:
                self._rescan = True
            elif stream.ready_frames():
                self._arrived.add(stream)
        self._wake.set()

    def _forget(self, stream: DecodeStream) -> None:
        stream.closed = True
        stream.release_backlog()
        self.registry.remove(stream.stream_id)

    def _free_later(self, state: Any) -> None:
        try:
            # Queued behind any batch that still uses the state (one worker thread, FIFO).
            self._executor.submit(self.decoder.free, state)
        except RuntimeError:  # the worker is shut down: nothing else can touch the state
            self.decoder.free(state)

    # ---------------------------------------------------------------- decoding

    async def _decode_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                await self._decode_ready()
            except Exception:  # noqa: BLE001 - the loop must outlive any single bad batch
                log.exception("decode loop iteration failed")

    async def _decode_ready(self) -> None:
        """Decode batches until no stream has a ready chunk."""
        loop = asyncio.get_running_loop()
        while True:
            await self._coalesce()
            if not (batch := self._collect()):
                return
            streams = [s for s, _, _ in batch]
            states = [s.decoder_state for s in streams]
            codes = [c for _, _, c in batch]
            try:
                outputs, elapsed_ns, steps = await loop.run_in_executor(
                    self._executor, _decode_chunks, self.decoder, self.device, states, codes
                )
            except Exception as exc:  # noqa: BLE001 - a failed batch fails its streams, not the server
                if self._device_failure is not None and self._device_failure(exc):
                    # The device is gone: every stream here fails, and the process is exiting.
                    for stream in list(self.registry):
                        stream.in_flight = False
                        stream.fail(Unavailable("code2wav's GPU failed; retry the request"))
                    return
                log.exception("decode of a batch of %d streams failed", len(batch))
                for stream in streams:
                    stream.in_flight = False
                    stream.fail(GenerationFailed(f"decode failed: {exc}"))
                continue
            self.metrics.decode_seconds.observe(elapsed_ns / 1e9)
            self.metrics.decode_batch_streams.observe(len(batch))
            frames = sum(len(c) for c in codes)
            self.metrics.decode_batch_frames.observe(frames)
            self.cost.observe(frames, elapsed_ns / 1e9, self.clock())
            if (est := self.cost.estimate()) is not self._published_cost:  # refitted (<= 20 a second)
                self._published_cost = est
                self.metrics.decode_cost_seconds.labels("call").set(est.call_s)
                self.metrics.decode_cost_seconds.labels("frame").set(est.frame_s)
            if steps is not None:
                self.metrics.decode_model_steps.observe(steps)
            for (stream, first, chunk_codes), (pcm, num_samples) in zip(batch, outputs, strict=True):
                if not stream.closed:
                    held_ns = stream.held_ns()
                    stream.deliver(
                        DecodedAudio(pcm, num_samples, first, len(chunk_codes), elapsed_ns, held_ns)
                    )

    async def _coalesce(self) -> None:
        """Wait for more ready streams while every ready one can afford it (see the module docstring).

        One scan of the streams at the start; after that each arrival is looked at alone (the
        servicer names the stream in `notify`), so a wait costs O(1) per message at any number of
        streams. A first chunk or a nearer deadline ends the wait early, and so do a full batch,
        no other stream that could become ready, or a wait with no arrival.
        """
        if self.coalesce_max_s <= 0:
            return
        ready, nearest, others = self._scan()
        until = self.clock() + self.coalesce_max_s
        self._arrived = set()
        try:
            while True:
                if self._rescan:  # woken without a stream named: look at all of them again
                    self._rescan = False
                    ready, nearest, others = self._scan()
                    self._arrived.clear()
                for stream in self._arrived:
                    if stream.ready_frames():
                        nearest = min(nearest, stream.deadline)
                until = min(until, nearest - self.deadline_safety_s)
                wait = until - self.clock()
                if not ready or ready + len(self._arrived) >= self.max_batch or not others or wait <= 0:
                    return
                self._wake.clear()
                try:  # asyncio.timeout: wait_for can swallow a cancel
                    async with asyncio.timeout(wait):
                        await self._wake.wait()
                except TimeoutError:
                    return
        finally:
            self._arrived = None

    def _scan(self) -> tuple[int, float, bool]:
        """(ready streams, their nearest deadline, whether any other stream could become ready)."""
        ready, nearest, others = 0, math.inf, False
        for stream in self.registry:
            if stream.ready_frames():
                ready += 1
                nearest = min(nearest, stream.deadline)
            elif not stream.closed and stream.total_frames is None:
                others = True
        return ready, nearest, others

    def _collect(self) -> list[tuple[DecodeStream, int, np.ndarray]]:
        ready = [s for s in self.registry if s.ready_frames() > 0]
        ready.sort(key=lambda s: s.deadline)  # earliest deadline first; streams not yet playing lead
        lane = bool(ready) and ready[0].first_audio_at is None and not self._lane_passed_over
        if lane:  # the first-chunk lane (module docstring), never twice in a row over playing streams
            starting = [s for s in ready if s.first_audio_at is None]
            self._lane_passed_over, ready = len(starting) < len(ready), starting
        else:
            self._lane_passed_over = False
        batch = []
        frames, cap = 0, self.max_call_frames or math.inf
        for stream in ready[: self.max_batch]:
            if batch and frames + stream.ready_frames() > cap:
                break  # the rest wait for the next call (later deadlines)
            first, codes = stream.take_chunk()
            frames += len(codes)
            batch.append((stream, first, codes))
        return batch


def _decode_chunks(
    decoder: IncrementalDecoderLike, device: torch.device, states: list[Any], codes: list[np.ndarray]
) -> tuple[list[tuple[bytes, int]], int, int | None]:
    """(PCM and sample count per stream, nanoseconds, decoder runs or None when the decoder does
    not count them). Runs in the worker thread, the only one that touches the decoder."""
    start = time.perf_counter_ns()
    steps_before = getattr(decoder, "steps_total", None)
    with torch.inference_mode():
        tensors = [torch.from_numpy(c.astype(np.int64)).to(device) for c in codes]
        decode_batch = getattr(decoder, "decode_batch", None)
        if decode_batch is not None and len(states) > 1:
            audio = decode_batch(states, tensors)
        else:
            audio = [decoder.decode(s, t) for s, t in zip(states, tensors, strict=True)]
        out = list(zip(pcm_s16le_batch(audio), (int(a.numel()) for a in audio), strict=True))
    steps = None if steps_before is None else decoder.steps_total - steps_before
    return out, time.perf_counter_ns() - start, steps
