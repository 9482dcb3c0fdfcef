"""One decode stream's bookkeeping: frames received, chunks planned, credit, and its outbox.

Everything here runs on the asyncio loop; the decoder state itself is only touched by the decode
worker thread (see `core`).

Playback clock: the listener is assumed to start playing when the first decoded chunk is handed on,
with no pre-roll (the underrun definition of DESIGN.md section 5). From then on the stream runs dry
at `first_audio_at + emitted_samples / SAMPLE_RATE`, its `deadline`, by which the decode loop
orders streams.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from qtts.audio import SAMPLE_RATE
from qtts.request.errors import FailedPrecondition, InvalidArgument
from qtts.serving.metrics import Code2WavMetrics
from qtts.streams.chunk_plan import ChunkPlan
from qtts.streams.decode_events import Credit, DecodedAudio, DecodeEvent, Done
from services.code2wav.credit import CreditPolicy


@dataclass(frozen=True)
class CodecShape:
    """The codec facts every stream of this server is checked against: codebooks, their size, and
    samples a frame."""

    num_codebooks: int = 16
    codebook_size: int = 2048
    samples_per_frame: int = 1920


class DecodeStream:
    """A stream keyed by this server's own `stream_id`, from StreamStart to Done (or an error)."""

    def __init__(
        self,
        request_id: str,
        plan: ChunkPlan,
        policy: CreditPolicy,
        codec_shape: CodecShape,
        metrics: Code2WavMetrics,
        replica: str = "",
        clock: Callable[[], float] = time.monotonic,
    ):
        self.stream_id = uuid.uuid4().hex
        self.request_id = request_id
        self.plan = plan.capped(policy.max_chunk_frames())
        self.policy = policy
        self.codec_shape = codec_shape
        self.metrics = metrics
        self.replica = replica
        # When the decoder state was made (clock seconds; None before): a first chunk's wait for
        # it is counted apart from its wait for a decode call.
        self.state_at: float | None = None
        self._decoder_state: Any = None
        self.received_frames = 0
        self.decoded_frames = 0
        self.emitted_samples = 0
        self.acked_samples = 0
        self.total_frames: int | None = None
        self.granted = 0
        self.chunk_index = 0
        self.in_flight = False
        self.closed = False
        self.finished = False
        self.clock = clock
        self.first_audio_at: float | None = None
        self._ready_at: float | None = None  # since when the next chunk could be decoded
        self._taken_ready_at: float | None = None  # since when the chunk taken last was ready
        # Frames below this index are decoded without waiting for their chunk to fill (a flush).
        self._flush_at = 0
        self._pending = np.zeros((0, codec_shape.num_codebooks), dtype=np.int16)
        self._outbox: asyncio.Queue[DecodeEvent | BaseException] = asyncio.Queue()

    # ---------------------------------------------------------------- client events

    @property
    def decoder_state(self) -> Any:
        return self._decoder_state

    @decoder_state.setter
    def decoder_state(self, state: Any) -> None:
        self._decoder_state = state
        if state is not None and self.state_at is None:
            self.state_at = self.clock()

    @property
    def started(self) -> bool:
        return self._decoder_state is not None

    def add_frames(self, first_frame_index: int, codes: np.ndarray, flush: bool = False) -> None:
        """Queue frames [first_frame_index, +n); raises on a protocol violation. Frames may come
        before the decoder state exists (the first grant does not wait for it): they wait.
        `flush`: every frame received so far is decoded without waiting for its chunk to fill
        (the frames since the last boundary make a chunk of their own; FrameDelta.flush)."""
        if self.total_frames is not None:
            raise FailedPrecondition("frames after StreamEnd")
        n = codes.shape[0]
        if n == 0:
            raise InvalidArgument("a frame delta must carry at least one frame")
        if codes.shape[1] != self.codec_shape.num_codebooks:
            raise InvalidArgument(
                f"frames have {codes.shape[1]} codebooks, expected {self.codec_shape.num_codebooks}"
            )
        if first_frame_index != self.received_frames:
            raise InvalidArgument(
                f"non-contiguous frames: delta starts at frame {first_frame_index}, expected {self.received_frames}"
            )
        if first_frame_index + n > self.granted:
            raise FailedPrecondition(
                f"frames up to {first_frame_index + n} sent, credit allows only up to {self.granted}"
            )
        if codes.min() < 0 or codes.max() >= self.codec_shape.codebook_size:
            raise InvalidArgument(f"codes must lie in [0, {self.codec_shape.codebook_size})")
        self._pending = np.concatenate([self._pending, codes]) if len(self._pending) else codes
        self.received_frames += n
        if flush:
            self._flush_at = self.received_frames
        self.metrics.decode_backlog_frames.inc(n)
        self._mark_ready()

    def _chunk_size(self) -> int:
        """Frames in the next chunk: the plan's size, or fewer where a flush cuts it."""
        size = self.plan.size(self.chunk_index)
        head = self.received_frames - len(self._pending)  # index of the first pending frame
        if self._flush_at > head:
            size = min(size, self._flush_at - head)
        return size

    def _mark_ready(self) -> None:
        if (
            self._ready_at is None
            and len(self._pending)
            and (len(self._pending) >= self._chunk_size() or self.total_frames is not None)
        ):
            self._ready_at = self.clock()

    def end(self, total_frames: int) -> None:
        if self.total_frames is not None:
            raise FailedPrecondition("second StreamEnd")
        if total_frames != self.received_frames:
            raise InvalidArgument(f"StreamEnd says {total_frames} frames, {self.received_frames} were sent")
        self.total_frames = total_frames
        self._mark_ready()
        self._maybe_done()

    def ack(self, samples_delivered: int) -> None:
        if samples_delivered > self.emitted_samples:
            raise InvalidArgument(
                f"ack of {samples_delivered} samples, only {self.emitted_samples} were sent"
            )
        if samples_delivered > self.acked_samples:
            self.acked_samples = samples_delivered
            self._grant()

    # ---------------------------------------------------------------- decode side

    @property
    def pending_frames(self) -> int:
        return len(self._pending)

    def ready_frames(self) -> int:
        """Frames of the next chunk if it can be decoded now, else 0."""
        if self.closed or self.in_flight or not self.started or not len(self._pending):
            return 0
        size = self._chunk_size()
        if len(self._pending) >= size:
            return size
        return len(self._pending) if self.total_frames is not None else 0

    @property
    def deadline(self) -> float:
        """When the listener runs out of audio (clock seconds); -inf before the first audio, since
        nothing is more urgent than starting a stream."""
        if self.first_audio_at is None:
            return -math.inf
        return self.first_audio_at + self.emitted_samples / SAMPLE_RATE

    def take_chunk(self) -> tuple[int, np.ndarray]:
        """Remove the next chunk's frames for decoding; returns (first frame index, codes)."""
        n = self.ready_frames()
        assert n > 0, "take_chunk without a ready chunk"
        codes, self._pending = self._pending[:n], self._pending[n:]
        self.in_flight = True
        self.chunk_index += 1
        self._taken_ready_at = self._ready_at
        if self._ready_at is not None:
            waited = max(self.clock() - self._ready_at, 0.0)
            self.metrics.chunk_wait_seconds.observe(waited)
            if self.chunk_index == 1:
                self.metrics.first_chunk_wait_seconds.observe(waited)
                # A chunk is taken only once its state exists, so `state_at` is set and <= now.
                self.metrics.first_chunk_state_wait_seconds.observe(max(self.state_at - self._ready_at, 0.0))
        self._ready_at = None
        self._mark_ready()
        return self.decoded_frames, codes

    def held_ns(self) -> int:
        """Nanoseconds from the chunk taken last being ready (all its frames here) to now: its
        wait for a decode call and the call (AudioOut.held_ns; 0 where not known)."""
        if self._taken_ready_at is None:
            return 0
        return max(round((self.clock() - self._taken_ready_at) * 1e9), 0)

    def deliver(self, chunk: DecodedAudio) -> None:
        """The decoded audio of the chunk taken last."""
        self.in_flight = False
        now = self.clock()
        if self.first_audio_at is None:
            self.first_audio_at = now
        else:
            slack = self.deadline - now
            self.metrics.deadline_slack_seconds.observe(slack)
            if slack < 0:
                self.metrics.underruns_total.inc()
        self.decoded_frames += chunk.num_frames
        self.emitted_samples += chunk.num_samples
        self.metrics.decode_backlog_frames.dec(chunk.num_frames)
        self.metrics.frames_total.inc(chunk.num_frames)
        self._outbox.put_nowait(chunk)
        self._grant()
        self._maybe_done()

    def start_credit(self) -> None:
        """Send the first grant (after the decoder state exists), with the chunk plan."""
        self._grant(with_plan=True)

    def fail(self, exc: BaseException) -> None:
        """End the stream with `exc` (raised from `events()`)."""
        if not self.finished:
            self.finished = True
            self._outbox.put_nowait(exc)

    def release_backlog(self) -> None:
        """Drop the backlog metric of frames that will never be decoded (stream freed early)."""
        self.metrics.decode_backlog_frames.dec(self.received_frames - self.decoded_frames)
        self.received_frames = self.decoded_frames
        self._pending = self._pending[:0]

    async def events(self) -> AsyncIterator[DecodeEvent]:
        """Credit grants and audio chunks in order, then Done; raises the error that ended the stream."""
        while True:
            item = await self._outbox.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if isinstance(item, Done):
                return

    # ---------------------------------------------------------------- internals

    def _grant(self, with_plan: bool = False) -> None:
        if self.total_frames is not None:
            return  # nothing more to send
        allowed = self.policy.frames_allowed_until(
            self.decoded_frames, self.acked_samples // self.codec_shape.samples_per_frame
        )
        if allowed > self.granted or with_plan:
            self.granted = max(self.granted, allowed)
            self._outbox.put_nowait(
                Credit(self.granted, self.plan if with_plan else None, cuts_at_flush=with_plan)
            )

    def _maybe_done(self) -> None:
        if self.total_frames is not None and self.decoded_frames == self.total_frames and not self.finished:
            self.finished = True
            self._outbox.put_nowait(Done(self.decoded_frames, self.emitted_samples, self.replica))
