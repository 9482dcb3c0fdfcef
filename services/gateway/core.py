"""The transport-agnostic synthesis core shared by the HTTP and the gRPC front ends.

`GatewayCore.open()` validates, admits and starts a talker call, and waits for its first event, so
errors that happen before any audio (unknown voice, bad reference, no capacity) still reach the
client as a proper status. The returned `SynthesisStream` must be closed; closing it cancels the
talker call when it is still running and records the request's metrics.

`GatewayCore.cut_all()` ends the streams still running when a drain's grace is over: each raises
the given error where it waits for its next event, so every front end ends it the way it ends a
failed stream (an SSE or WebSocket error event, a gRPC status), not with a silent cut.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextvars import ContextVar
from dataclasses import replace
from typing import Protocol

from qtts.request.errors import (
    GenerationFailed,
    InvalidArgument,
    ResourceExhausted,
    TTSError,
    Unavailable,
    mapping_for,
)
from qtts.request.vocabulary import AudioPiece, SynthesisSummary
from qtts.serving.metrics import GatewayMetrics

from .auth import current_owner
from .client_identity import current_client
from .job import ModelCatalog, SpeechFields, SynthesisJob
from .stream_limits import StreamLimits
from .validation import RequestLimits, build_job, named_field

Event = AudioPiece | SynthesisSummary


class _Place:
    """A stream-limit slot held for the request the current task serves (`early_admission`)."""

    admitted = False


_current_place: ContextVar[_Place | None] = ContextVar("gateway_held_place", default=None)


class TalkerAPI(Protocol):
    def generate(
        self, job: SynthesisJob, text: AsyncIterator[tuple[str, bool]] | None = None
    ) -> AsyncIterator[Event]: ...


def status_label(exc: BaseException | None) -> str:
    """The `status` label of `tts_gateway_requests_total`: "ok" or the lower-case gRPC code name."""
    if exc is None:
        return "ok"
    if isinstance(exc, asyncio.CancelledError | GeneratorExit):
        return "cancelled"
    return mapping_for(exc).grpc_code.name.lower()


def decode_reference(data: bytes, max_seconds: float | None = None):
    """Reference clip -> float32 mono 24 kHz (PyAV + soxr); undecodable audio, or a clip longer
    than `max_seconds` (None: qtts.audio's default), is InvalidArgument."""
    from qtts.audio import load_reference_audio

    if max_seconds is None:
        return load_reference_audio(data)
    return load_reference_audio(data, max_seconds=max_seconds)


class SynthesisStream:
    """One admitted request in flight: its events, first-byte and end bookkeeping."""

    def __init__(
        self,
        synth: GatewayCore,
        job: SynthesisJob,
        protocol: str,
        events: AsyncIterator[Event],
        first: Event,
        started: float,
        client: str = "",
        first_hops: dict[str, float] | None = None,
    ):
        self.job = job
        self._client = client
        self._synth = synth
        self._protocol = protocol
        self._events = events
        self._first: Event | None = first
        self._started = started
        self._first_byte_seen = False
        # The first chunk's hops so far (admit, talker) and when it arrived; None without audio.
        self._first_hops = first_hops
        self._first_at = time.perf_counter()
        self._closed = False
        self.summary: SynthesisSummary | None = None
        self._reader: asyncio.Task | None = None  # the task iterating the stream
        self._waiting = False  # whether it waits for the talker's next event
        self._cut: Exception | None = None
        synth._live.add(self)

    async def __aiter__(self) -> AsyncIterator[Event]:
        if self._first is not None:
            first, self._first = self._first, None
            if isinstance(first, SynthesisSummary):
                self.summary = first
            yield first
        self._reader = asyncio.current_task()
        try:
            while self._cut is None:
                self._waiting = True
                try:
                    event = await self._events.__anext__()
                except StopAsyncIteration:
                    break
                finally:
                    self._waiting = False
                if isinstance(event, SynthesisSummary):
                    self.summary = event
                yield event
            if self._cut is not None and self.summary is None:  # cut while the reader was writing
                raise self._cut
        except asyncio.CancelledError:
            # Our own cancel (cut) becomes the cut's error; any other cancel stays a cancel.
            if self._cut is None or asyncio.current_task().uncancel() > 0:
                raise
            raise self._cut from None
        finally:
            self._reader = None
        if self.summary is None:
            raise GenerationFailed("the talker ended the stream without a summary")

    def cut(self, error: Exception) -> None:
        """End the stream with `error` where its reader waits for the next event (a drain's end)."""
        if self._closed or self._cut is not None:
            return
        self._cut = error
        # Only a wait for the talker is interrupted; a reader that is writing to its client (the
        # write may be what the drain waits for) sees the cut when it comes back for more.
        if self._reader is not None and self._waiting:
            self._reader.cancel()

    def first_byte_sent(self) -> None:
        """Record time to first audio once, when the first audio byte went out."""
        if not self._first_byte_seen:
            self._first_byte_seen = True
            now = time.perf_counter()
            metrics = self._synth.metrics
            metrics.ttfa_seconds.observe(now - self._started)
            if self._first_hops is not None:
                for hop, seconds in (*self._first_hops.items(), ("to_client", now - self._first_at)):
                    metrics.first_chunk_hop_seconds.labels(hop).observe(max(seconds, 0.0))

    async def close(self, error: BaseException | None = None) -> None:
        """Cancel the talker call if still running, release the slot, record the outcome."""
        if self._closed:
            return
        self._closed = True
        self._synth._live.discard(self)
        try:
            await self._events.aclose()
        finally:
            self._synth._finish(self._protocol, self._started, error, self._client)


class GatewayCore:
    """Validation, admission, reference decoding and the talker call, with the gateway metrics."""

    def __init__(
        self,
        talker: TalkerAPI,
        catalog: Callable[[], ModelCatalog | None],
        limits: RequestLimits,
        admission: StreamLimits,
        metrics: GatewayMetrics,
        decode: Callable[[bytes], object] = decode_reference,
        unsupported_instructions: str = "reject",
    ):
        self.talker = talker
        self._catalog = catalog
        self.limits = limits
        self.admission = admission
        self.metrics = metrics
        self._decode = decode
        self._unsupported_instructions = unsupported_instructions
        self._live: set[SynthesisStream] = set()
        self._refusal: Exception | None = None  # set once a drain is over: no new streams

    @property
    def ready(self) -> bool:
        """Whether the served model is known (the talker answered GetModelInfo)."""
        return self._catalog() is not None

    def catalog(self) -> ModelCatalog:
        catalog = self._catalog()
        if catalog is None:
            raise Unavailable("the gateway has not reached the talker yet")
        return catalog

    def validate(self, fields: SpeechFields) -> SynthesisJob:
        """The job for `fields`, checked in one pass (validation.build_job); every transport hands
        its request over here the same way. Raises the TTSError of the first field at fault."""
        return build_job(fields, self.catalog(), self.limits, self._unsupported_instructions, current_owner())

    def early_refusal(self) -> ResourceExhausted | None:
        """The refusal `open()` would give the current client at the stream limit or while no
        talker has room, known from the request's headers alone, so a front end can answer it
        before reading (and parsing) the body. A peek: it takes no slot, and `open()` still admits
        (a slot taken in between is refused there). None while draining: `open()` gives that
        refusal, after the usual checks."""
        if self._refusal is not None:
            return None
        # Then the talkers' published room (services/gateway/talker_pool.py): none has any.
        talkers = getattr(self.talker, "refusal", None)
        return self.admission.refusal(current_client()) or (talkers() if talkers is not None else None)

    @contextlib.contextmanager
    def early_admission(self) -> Iterator[ResourceExhausted | None]:
        """`early_refusal()`; when it lets the request in, its place is held while the body is read
        and checked: a stream-limit slot until `open()` admits it, talker room until its talker
        call picks a talker (both in this task), each let go on leaving the block if not taken.
        A burst past the limits is then refused on its headers, all but the places there are;
        a peek alone let the whole burst in to be refused after its bodies."""
        refused = self.early_refusal()
        if refused is not None or self._refusal is not None:
            yield refused
            return
        place = _Place()
        self.admission.hold()
        token = _current_place.set(place)
        hold = getattr(self.talker, "hold", None)
        talker_hold = hold() if hold is not None else None
        try:
            yield None
        finally:
            _current_place.reset(token)
            if not place.admitted:
                self.admission.unhold()
            if talker_hold is not None:
                talker_hold.release()

    async def open(
        self, job: SynthesisJob, protocol: str, text: AsyncIterator[tuple[str, bool]] | None = None
    ) -> SynthesisStream:
        """Admit `job`, decode its reference clip, start the talker call and await its first event.

        With `text`, more text follows `job.text` while the request runs: (piece, final) pairs,
        appended to the one talker request as they come (text_stream.py)."""
        started = time.perf_counter()
        client = current_client()
        try:
            if self._refusal is not None:
                raise self._refusal
            place = _current_place.get()
            if place is not None and not place.admitted:
                place.admitted = True  # the held slot is spent, admitted or not
                self.admission.admit(client, held=True)
            else:
                self.admission.admit(client)
        except TTSError as exc:  # refused before admission: counted like a request that failed checks
            self.reject(protocol, exc)
            raise
        self.metrics.active_streams.inc()
        events: AsyncIterator[Event] | None = None
        asked = None
        try:
            if job.reference_audio is not None and job.reference_pcm is None:
                with self.metrics.stage_timer("decode_reference"):
                    # A clip seen before comes from the cache on the loop; only new ones are
                    # decoded in a worker thread (a thread hop is dear under load).
                    cached = getattr(self._decode, "cached", None)
                    pcm = cached(job.reference_audio) if cached is not None else None
                    if pcm is None:
                        pcm = await _decode_field(self._decode, job.reference_audio, "ref_audio")
                job = _with_pcm(job, pcm)
            events = self.talker.generate(job) if text is None else self.talker.generate(job, text)
            asked = time.perf_counter()
            try:
                first = await events.__anext__()
            except StopAsyncIteration:
                raise GenerationFailed("the talker ended the stream without audio or summary") from None
            hops = None
            if isinstance(first, AudioPiece):
                hops = {"admit": asked - started, "talker": time.perf_counter() - asked}
        except BaseException as exc:
            if events is not None:
                await events.aclose()
            if isinstance(exc, ResourceExhausted):  # where a talker's refusal spent its time
                now = time.perf_counter()
                self.metrics.refusal_hop_seconds.labels("admit").observe(max((asked or now) - started, 0.0))
                if asked is not None:
                    self.metrics.refusal_hop_seconds.labels("talker").observe(max(now - asked, 0.0))
            self._finish(protocol, started, exc, client)
            raise
        return SynthesisStream(self, job, protocol, events, first, started, client, hops)

    def cut_all(self, error: Exception) -> int:
        """End every running stream with `error`, and refuse new ones with it; returns how many."""
        self._refusal = error
        live = list(self._live)
        for stream in live:
            stream.cut(error)
        return len(live)

    def reject(self, protocol: str, exc: BaseException) -> None:
        """Count a request that failed before it was admitted (validation, parsing). Errors by code
        (`tts_errors_total`) are counted by the front end: the gRPC interceptor, or the HTTP app."""
        self.metrics.requests_total.labels(protocol, status_label(exc)).inc()

    def _finish(self, protocol: str, started: float, error: BaseException | None, client: str = "") -> None:
        self.admission.release(client)
        self.metrics.active_streams.dec()
        self.metrics.request_duration_seconds.observe(time.perf_counter() - started)
        self.metrics.requests_total.labels(protocol, status_label(error)).inc()


async def _decode_field(decode: Callable[[bytes], object], data: bytes, field: str):
    """Decode a reference clip in a worker thread; an undecodable clip names `field`."""
    try:
        return await asyncio.to_thread(decode, data)
    except InvalidArgument as exc:
        raise named_field(exc, field) from None


def _with_pcm(job: SynthesisJob, pcm) -> SynthesisJob:
    return replace(job, reference_pcm=pcm)
