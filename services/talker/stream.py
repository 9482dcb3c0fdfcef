"""One request's stream on the asyncio side: engine frames -> code2wav within credit -> audio out.

Events from the engine thread (frames, end of generation) and from the Decode call (credit, audio,
done) meet in one queue and are handled by one task, so writes to the Decode call never overlap.
Frames wait in `buffer` until code2wav's credit allows them and, once the replica announced its
chunk plan, until they complete a chunk (the replica cannot decode part of one, so one message per
chunk instead of one per frame); the engine stops generating for this stream once it is `window`
frames ahead of the credit, which bounds the buffer.

While the stream waits on its replica (frames buffered for lack of credit, or StreamEnd sent and
the rest of the audio due) and nothing has passed either way on the call for `stall_timeout_s`,
the replica is taken to be hung: the stream fails (or moves, when nothing of it reached the
replica) and the replica is held off the ring. Keepalive alone cannot see this: a hung process
still answers pings. While the caller has not taken an audio chunk, the stream waits on its
listener, not on the replica, and is not checked.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import numpy as np

from qtts.audio import SAMPLE_RATE, SAMPLES_PER_FRAME
from qtts.request.errors import GenerationFailed, TTSError, Unavailable
from qtts.request.vocabulary import AudioPiece, SynthesisSummary
from qtts.streams.chunk_plan import ChunkPlan, StartPlanner

from . import code2wav_client as c2w
from .chunk_hops import ChunkHops
from .deadline import ScheduledRequest, StreamCredit
from .generation_loop import Admitted, Failed, Finished, Frame, GenerationLoop
from .replica_link import STALL_CHECK, ReplicaLink
from .replicas import Code2WavReplicas

log = logging.getLogger(__name__)

# Audio handed on is acknowledged to code2wav once this much is unacknowledged, or at once when
# frames wait for credit. code2wav lets a stream be `--max-ahead-frames` (100) ahead of its acks,
# and the scheduler keeps it at most 4 s (50 frames) ahead of its listener, so acks that lag by up
# to 16 frames never hold a stream back; an ack per chunk was a write per chunk on the talker's
# event loop and a read and a grant per chunk on code2wav's.
ACK_EVERY_SAMPLES = 16 * SAMPLES_PER_FRAME

FRAME_CAP_MESSAGE = "generation hit the frame cap without end of speech"
# qtts.model.generator.SAMPLING_FAILED: this stream's sampling broke (its batch went on).
SAMPLING_FAILED = "sampling_failed"


class _Abort:
    """Queued by `fail`: end the stream with `error` (generation still runs and is cancelled)."""

    def __init__(self, error: Exception):
        self.error = error


class StreamSession:
    """Runs one request from engine submission to the last audio chunk and the summary."""

    def __init__(
        self,
        *,
        request_id: str,
        prompt: Any,
        sampling: Any,
        max_new_frames: int | None,
        ref_codes: np.ndarray | None,
        num_codebooks: int,
        first_chunk_frames: int,
        chunk_frames_ramp: Sequence[int],
        engine: GenerationLoop,
        replicas: Code2WavReplicas,
        window: int,
        started_at: float,
        stall_timeout_s: float = 0.0,
        metrics: Any = None,
        start_planner: StartPlanner | None = None,
        start_counts: Callable[[], tuple[int, int, int]] | None = None,
    ):
        self.request_id = request_id
        # Shared by the talker's streams: it learns from every stream's steps and hops.
        self._planner = start_planner if start_planner is not None else StartPlanner()
        # The counts the planner chooses by (default: the engine's alone; TalkerCore's add the
        # requests still waiting for their prompts).
        self._start_counts = start_counts if start_counts is not None else engine.start_counts
        self._engine = engine
        self._first_chunk_frames = first_chunk_frames
        self._ramp = tuple(chunk_frames_ramp)
        self._started_at = started_at
        self._events: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        self._request = ScheduledRequest(
            request_id=request_id,
            prompt=prompt,
            sampling=sampling,
            max_new_frames=max_new_frames,
            credit=StreamCredit(window=window),
            sink=self._events.put_nowait,
            loop=loop,
            text=getattr(prompt, "text_feed", None),
        )
        self._buffer: list[np.ndarray] = []
        self._sent = 0
        # Frames below this index go to code2wav as soon as the credit allows, decoded though
        # their chunk is not complete: the stream waits for text (Frame.text_waiting).
        self._flush_at = 0
        # The replica's chunk plan (from its first grant): frames are sent a chunk at a time,
        # since the replica decodes a chunk only once all its frames are there. None: per frame.
        self._plan: ChunkPlan | None = None
        self._gen_end: Finished | None = None
        self._end_sent = False
        self._delivered = 0  # samples handed on to the caller
        self._acked = 0  # of those, acknowledged to the replica
        self._link = ReplicaLink(
            request_id, replicas, self._events.put_nowait, num_codebooks, ref_codes, stall_timeout_s
        )
        self._hops = ChunkHops(
            request_id,
            metrics,
            on_code2wav_hop=self._planner.observe_hop,
            early_chunks=self._planner.trip_chunks,
        )
        self._metrics = metrics

    def fail(self, error: Exception) -> None:
        """End the stream with `error` (from outside its events: e.g. appended text refused)."""
        self._events.put_nowait(_Abort(error))

    async def run(self) -> AsyncIterator[AudioPiece | SynthesisSummary]:
        """Audio pieces as code2wav decodes them, then the summary; the events are handled in turn."""
        generating = submitted = done = False
        try:
            self._choose_plan()
            # Generation starts before the Decode call is opened (the replica's answer is a round
            # trip of the event loop): frames made meanwhile wait in the event queue.
            submitted = True
            self._hops.submitted()
            self._engine.submit(self._request)
            generating = True
            await self._link.open(self._first_chunk_frames, self._ramp)
            queue_ns = prefill_ns = first_audio_ns = 0
            samples = 0
            while True:
                ev = await self._events.get()
                if isinstance(ev, Admitted):
                    queue_ns = int(ev.queue_s * 1e9)
                elif isinstance(ev, Frame):
                    if ev.index == 0:
                        prefill_ns = int(ev.step_s * 1e9)
                    self._take_frames(ev)
                    await self._flush()
                elif isinstance(ev, Finished):
                    generating = False
                    self._end_generation(ev)
                    await self._flush()
                elif isinstance(ev, Failed):
                    generating = False
                    raise ev.error
                elif isinstance(ev, c2w.Credit):
                    self._take_credit(ev)
                    await self._flush()
                elif isinstance(ev, c2w.DecodedAudio):
                    self._link.heard = True
                    if not first_audio_ns:
                        first_audio_ns = int((time.perf_counter() - self._started_at) * 1e9)
                    samples += ev.num_samples
                    arrived = time.perf_counter()
                    yield AudioPiece(ev.pcm_s16le, ev.first_frame_index, ev.num_frames)
                    # Handed on: the playback clock the scheduler paces this stream by.
                    self._hand_on(
                        samples / SAMPLE_RATE,
                        ev.first_frame_index + ev.num_frames,
                        arrived,
                        ev.held_ns / 1e9,
                        ev.received_at,
                    )
                    # The caller took the chunk: code2wav learns how far the listener is.
                    self._delivered = samples
                    await self._ack()
                    self._link.touch()
                elif isinstance(ev, c2w.Done):
                    done = True
                    replica = self._stream_done(ev)
                    break
                elif isinstance(ev, _Abort):
                    raise ev.error
                elif ev is STALL_CHECK:
                    await self._check_stall()
                elif isinstance(ev, c2w.DecodeFailed):
                    await self._on_decode_failed(ev)
                elif isinstance(ev, c2w.DecodeClosed):
                    raise Unavailable(
                        f"code2wav replica {self._link.replica} closed the stream before the end"
                    )
            yield self._summary(samples, queue_ns, prefill_ns, first_audio_ns, replica)
        finally:
            self._release_engine(generating, submitted)
            await self._link.close(cancel=not done)

    def _choose_plan(self) -> None:
        """A request without a chunk plan of its own starts with the replica's default (one frame)
        on a light talker, with a larger start on a busy one (chunk_plan.StartPlanner)."""
        if self._first_chunk_frames or self._ramp:
            self._count_plan(str(self._first_chunk_frames or "default"), "request")
            return
        plan = self._planner.plan(*self._start_counts())
        self._count_plan("default" if plan is None else str(plan.first), self._planner.why)
        if self._metrics is not None:
            for first, bound in self._planner.misfits:
                self._metrics.start_plan_misfits_total.labels(str(first), bound).inc()
        if plan is not None:
            self._first_chunk_frames, self._ramp = plan.first, plan.ramp

    def _count_plan(self, first: str, why: str) -> None:
        if self._metrics is not None:
            self._metrics.start_plans_total.labels(first, why).inc()

    def _take_frames(self, ev: Frame) -> None:
        """Buffer the engine's frames until the credit and the chunk plan let them go."""
        if ev.clock_restart:
            self._request.clock_restart = True
        self._hops.made(ev.index + len(ev.codes), ev.made_at)
        self._planner.observe_step(ev.step_s)
        self._buffer.extend(ev.codes)
        if ev.text_waiting:
            self._flush_at = ev.index + len(ev.codes)

    def _end_generation(self, ev: Finished) -> None:
        """Keep the end of generation (GenerationFailed for an end that is not speech's)."""
        if ev.reason == "frame_cap":
            raise GenerationFailed(FRAME_CAP_MESSAGE)
        if ev.reason == SAMPLING_FAILED:
            raise GenerationFailed("sampling failed: the model's scores were not finite")
        self._gen_end = ev

    def _take_credit(self, ev: c2w.Credit) -> None:
        """The replica's grant (with its chunk plan, the first time) passed on to the engine."""
        self._link.heard = True
        if ev.plan is not None:
            self._plan = ev.plan
            self._request.chunk_plan = ev.plan
            self._request.cuts_at_flush = ev.cuts_at_flush  # else no flush: an older replica
        self._engine.grant(self._request, ev.frames_allowed_until)

    def _stream_done(self, ev: c2w.Done) -> str:
        """The replica decoded the whole stream: count it, and return the replica that did."""
        self._link.replicas.stream_completed(self._link.replica)
        return ev.replica or self._link.replica

    def _summary(
        self, samples: int, queue_ns: int, prefill_ns: int, first_audio_ns: int, replica: str
    ) -> SynthesisSummary:
        """The stream's summary, once the replica is done (TTSError if it ended before generation)."""
        end = self._gen_end
        if end is None:
            raise TTSError(f"code2wav replica {self._link.replica} ended the stream before generation did")
        return SynthesisSummary(
            finish_reason=end.reason,
            num_frames=end.num_frames,
            num_samples=samples,
            queue_ns=queue_ns,
            prefill_ns=prefill_ns,
            first_audio_ns=first_audio_ns,
            total_ns=int((time.perf_counter() - self._started_at) * 1e9),
            code2wav_replica=replica,
            num_input_tokens=self._num_input_tokens(),
        )

    def _release_engine(self, generating: bool, submitted: bool) -> None:
        """On the way out: stop the stall timer, and cancel the generation or free the prompt."""
        self._link.stop_stall_timer()
        if generating:
            self._engine.cancel(self.request_id)
        elif not submitted:
            self._engine.release_prompt(self._request.prompt)

    def _num_input_tokens(self) -> int:
        feed = self._request.text
        if feed is not None and feed.closed:
            return feed.num_text_tokens
        return int(getattr(self._request.prompt, "num_text_tokens", 0) or 0)

    def _hand_on(
        self,
        delivered_s: float,
        end_frame: int = 0,
        arrived: float = 0.0,
        held_s: float = 0.0,
        received_at: float = 0.0,
    ) -> None:
        """Advance the playback clock; a chunk handed on after the listener ran dry is an underrun.
        `held_s`: how long code2wav held the chunk (AudioOut.held_ns; 0: not said); `received_at`:
        when its audio was read off the code2wav call (0: not stamped)."""
        req = self._request
        now = time.perf_counter()
        restarted = False
        if req.first_audio_at is None:
            req.first_audio_at = now
            self._hops.first_chunk(end_frame, arrived, now, held_s, received_at)
        elif req.clock_restart:
            # The listener ran dry waiting for text, not for us: its clock resumes with this chunk
            # (first_audio_at before the flag: the engine thread reads both).
            req.first_audio_at = now - req.delivered_s
            req.clock_restart = False
            restarted = True
            self._hops.restarted(now)
        else:
            self._hops.chunk(end_frame, arrived, now, req.slack_s(now), held_s, received_at)
        req.delivered_s = delivered_s
        self._engine.clock_changed(req, restarted)

    def _nothing_on_replica(self) -> bool:
        """The replica never answered and got no frames: the stream may still open elsewhere."""
        return not self._link.heard and self._sent == 0

    async def _on_decode_failed(self, ev: c2w.DecodeFailed) -> None:
        replica = self._link.replica
        if ev.replica_down:
            self._link.replicas.mark_down(replica, ev.error.message)
        if ev.replica_down and self._nothing_on_replica():
            # The replica never answered: nothing of this stream lives there yet, so open it on
            # the next replica of the ring instead of failing the request.
            log.info("request %s: code2wav replica %s unreachable, trying another", self.request_id, replica)
            await self._link.reopen_elsewhere()
            await self._flush()
            return
        raise ev.error

    async def _ack(self) -> None:
        """Acknowledge the audio handed on once `ACK_EVERY_SAMPLES` are unacknowledged, or while
        frames wait for credit (which may wait on this ack)."""
        unacked = self._delivered - self._acked
        if unacked > 0 and (unacked >= ACK_EVERY_SAMPLES or self._held_by_credit()):
            self._acked = self._delivered
            await self._link.call.ack(self._delivered)

    def _held_by_credit(self) -> bool:
        """Frames held back by the credit (not by the chunk boundary)."""
        return bool(self._buffer) and self._sent >= self._request.credit.granted_until

    def _waiting_on_replica(self) -> bool:
        """Frames held back by the credit, or the end sent."""
        return self._held_by_credit() or self._end_sent

    def _watch_stall(self) -> None:
        self._link.watch_stall(self._waiting_on_replica())

    async def _check_stall(self) -> None:
        silent_s = self._link.stall_fired()
        if silent_s < self._link.stall_timeout_s or not self._waiting_on_replica():
            self._watch_stall()
            return
        replica = self._link.replica
        waiting = (
            f"{len(self._buffer)} frames wait for credit" if self._buffer else "the end of the stream is due"
        )
        error = Unavailable(
            f"code2wav replica {replica} stalled: no credit or audio from it for {silent_s:.1f} s "
            f"while {waiting} (--code2wav-stall-timeout-s {self._link.stall_timeout_s:g})"
        )
        log.warning("request %s: %s", self.request_id, error.message)
        self._link.replicas.mark_stalled(replica, error.message)
        if not self._nothing_on_replica():
            raise error
        # Hung before it answered at all: nothing of this stream lives there yet.
        try:
            await self._link.reopen_elsewhere()
        except Unavailable as exc:
            raise error from exc
        await self._flush()

    async def _flush(self) -> None:
        """Send buffered frames the credit allows, once they complete the replica's next chunk (or
        fill the credit, or generation ended, or the stream waits for text); StreamEnd once
        generation ended and all are sent."""
        allowed = self._request.credit.granted_until
        n = min(len(self._buffer), allowed - self._sent)
        flush = False
        if n > 0 and self._gen_end is None and self._plan is not None:
            # Up to the last chunk boundary within reach: frames past it could not be decoded yet
            # and go with the rest of their chunk. Short of the next boundary: wait, unless the
            # credit ends first (then send what it allows). Waiting for text, the frames up to
            # the flush point are a chunk of their own (FrameDelta.flush), where the replica
            # said it cuts its chunks there (CreditGrant.cuts_at_flush).
            end = self._sent + n
            boundary = self._plan.end_at_or_below(end)
            flushes = self._request.cuts_at_flush
            if flushes and self._sent < self._flush_at <= end and self._flush_at > boundary:
                boundary = self._flush_at
                flush = True
            if boundary > self._sent:
                n = boundary - self._sent
            elif end < allowed:
                n = 0
        if n > 0:
            codes = np.stack(self._buffer[:n])
            del self._buffer[:n]
            try:
                await self._link.call.send_frames(self._sent, codes, flush)
            except Unavailable as exc:
                self._link.replicas.mark_down(self._link.replica, exc.message)
                raise
            self._sent += n
            if flush:  # code2wav cut its chunks there: so do we
                self._plan = self._plan.flushed(self._sent)
            self._hops.sent(self._sent)
            self._link.touch()
        if self._gen_end is not None and not self._buffer and not self._end_sent:
            self._end_sent = True
            await self._link.call.end(self._gen_end.num_frames)
            self._link.touch()
        await self._ack()  # frames held back by the credit: it may wait on this ack
        self._watch_stall()
