"""gRPC client of the talker: protobuf <-> gateway types, gRPC status -> domain errors."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import AsyncIterator, Callable

import grpc
import numpy as np

from qtts.lru import BoundedLru
from qtts.pb import talker_pb2, talker_pb2_grpc
from qtts.request.errors import FailedPrecondition, NotFound, ResourceExhausted, Unavailable, from_grpc
from qtts.request.sampling_pb import overrides_to_pb
from qtts.request.tts_enums import FINISH_FROM_PB, TASK_TO_PB
from qtts.request.vocabulary import (
    NATIVE_SAMPLE_RATE,
    SAMPLES_PER_FRAME,
    UNKNOWN_VOICE,
    AudioPiece,
    SynthesisSummary,
)
from qtts.serving import tracing
from qtts.serving.grpc_server import RECONNECT_OPTIONS
from qtts.serving.internal_auth import client_interceptors
from qtts.serving.log_context import outgoing_metadata
from qtts.serving.tls import TlsConfig, aio_channel
from qtts.streams.voice_key import REFERENCE_NOT_CACHED, reference_digest

from .job import ModelCatalog, SynthesisJob
from .talker_pool import Hold, TalkerPool
from .talker_session import TalkerSession


def generate_request(
    job: SynthesisJob, reference: tuple[bytes, str] | None = None, *, clip: bool = True
) -> talker_pb2.GenerateRequest:
    """The talker request of a validated job (reference audio already decoded to 24 kHz).

    `reference`: the clip's float32 bytes and its reference digest, when already computed; with
    `clip` False only the digest is sent (a clip the talkers were sent before)."""
    sampling = overrides_to_pb(job.sampling)
    req = talker_pb2.GenerateRequest(
        request_id=job.request_id,
        text=job.text,
        task_type=TASK_TO_PB[job.task],
        voice=job.voice,
        language=job.language,
        instructions=job.instructions,
        reference_text=job.reference_text,
        x_vector_only=job.x_vector_only,
        sampling=sampling,
        max_new_frames=job.max_new_frames,
    )
    if job.first_chunk_frames or job.chunk_frames_ramp:
        req.streaming.first_chunk_frames = job.first_chunk_frames
        req.streaming.chunk_frames_ramp.extend(job.chunk_frames_ramp)
    if job.streaming_text is not None:
        req.streaming_text = job.streaming_text
    if reference is not None:
        pcm, req.reference_digest = reference
        if clip:
            req.reference_pcm_f32 = pcm
    elif job.reference_pcm is not None:
        req.reference_pcm_f32 = reference_bytes(job)
    return req


def reference_bytes(job: SynthesisJob) -> bytes:
    return np.ascontiguousarray(job.reference_pcm, dtype="<f4").tobytes()


class ClipDigests:
    """The reference digest of each decoded clip the gateway holds (its reference cache hands every
    request with one clip the same read-only array), so a repeated clip is not copied and hashed
    again for each request (~0.2 ms of the event loop for a 3 s clip). Keyed by the array's
    identity (checked through a weak reference, so a reused id never matches), the transcript and
    the mode; an LRU of `max_entries`."""

    def __init__(self, max_entries: int = 1024):
        self._lru: BoundedLru = BoundedLru(max_entries)  # key -> (weak reference to the array, digest)

    @staticmethod
    def _key(job: SynthesisJob) -> tuple[int, str, bool]:
        return id(job.reference_pcm), job.reference_text or "", bool(job.x_vector_only)

    def get(self, job: SynthesisJob) -> str | None:
        entry = self._lru.get(self._key(job))
        return entry[1] if entry is not None and entry[0]() is job.reference_pcm else None

    def put(self, job: SynthesisJob, digest: str) -> None:
        try:
            ref = weakref.ref(job.reference_pcm)
        except TypeError:  # not an object that takes weak references: not kept
            return
        self._lru.put(self._key(job), (ref, digest))


class SentReferences:
    """Digests of the clips this gateway sent to the talkers and saw accepted (an LRU of
    `max_entries`): the next request with one sends only its digest (qtts.streams.voice_key)."""

    def __init__(self, max_entries: int = 4096):
        self._lru: BoundedLru[str, bool] = BoundedLru(max_entries)

    def __contains__(self, digest: str) -> bool:
        return self._lru.get(digest) is not None

    def add(self, digest: str) -> None:
        self._lru.put(digest, True)

    def discard(self, digest: str) -> None:
        self._lru.pop(digest)


async def _stream_requests(
    start: talker_pb2.GenerateRequest, text: AsyncIterator[tuple[str, bool]]
) -> AsyncIterator[talker_pb2.GenerateStreamRequest]:
    yield talker_pb2.GenerateStreamRequest(start=start)
    async for piece, final in text:
        yield talker_pb2.GenerateStreamRequest(append=talker_pb2.TextAppend(text=piece, final=final))
        if final:
            return


def summary_from_pb(s: talker_pb2.GenerateSummary) -> SynthesisSummary:
    return SynthesisSummary(
        finish_reason=FINISH_FROM_PB.get(s.finish_reason, "stop"),
        num_frames=s.num_frames,
        num_samples=s.num_samples,
        code2wav_replica=s.code2wav_replica,
        queue_ns=s.timings.queue_ns,
        prefill_ns=s.timings.prefill_ns,
        first_audio_ns=s.timings.first_audio_ns,
        total_ns=s.timings.total_ns,
        num_input_tokens=s.num_input_tokens,
    )


def summary_span_attributes(s: SynthesisSummary, lease: object | None) -> dict[str, object]:
    """The stage timings the talker reports, as attributes of the request's span."""
    attrs: dict[str, object] = {
        "qtts.finish_reason": s.finish_reason,
        "qtts.num_frames": s.num_frames,
        "qtts.code2wav_replica": s.code2wav_replica,
        "qtts.queue_ns": s.queue_ns,
        "qtts.prefill_ns": s.prefill_ns,
        "qtts.first_audio_ns": s.first_audio_ns,
        "qtts.total_ns": s.total_ns,
    }
    if lease is not None:
        attrs["qtts.talker"] = lease.address
    return attrs


class TalkerClient:
    """Calls `talker.v1.TalkerService`.

    With a `pool`, each Generate call goes to the talker the pool picks (every ready pod behind the
    re-resolved name, fewest streams first) and stays there. Without one, calls share one channel
    that round-robins over the addresses the name resolved to when it connected. GetModelInfo and
    the gateway's health check use that shared channel either way.

    With `sessions` (the default), a request goes as an open on the channel's Session call
    (talker_session.py) instead of a Generate (or GenerateStream) call of its own, once that call
    has answered; a talker without Session gets calls of their own.
    """

    def __init__(
        self,
        address: str,
        pool: TalkerPool | None = None,
        token: str = "",
        tls: TlsConfig | None = None,
        sessions: bool = True,
        on_session_written: Callable[[float], None] | None = None,
    ):
        self.address = address
        self.pool = pool
        self.sessions = sessions
        self._on_session_written = on_session_written  # each Session message's write time
        # One TalkerSession per channel; a pool drops a talker's channel, and its ended session
        # goes when the next one is made.
        self._sessions: dict[grpc.aio.Channel, TalkerSession] = {}
        self._channel = aio_channel(
            address,
            tls,
            options=[("grpc.lb_policy_name", "round_robin"), *RECONNECT_OPTIONS],
            interceptors=client_interceptors(token),
        )
        self._stub = talker_pb2_grpc.TalkerServiceStub(self._channel)
        self.sent_references = SentReferences()
        self.clip_digests = ClipDigests()

    @property
    def channel(self) -> grpc.aio.Channel:
        return self._channel

    def refusal(self) -> ResourceExhausted | None:
        """The refusal a new stream would get now from the talkers' published room, without a
        call (None: some talker has room, or there is no pool to know it)."""
        return self.pool.refusal() if self.pool is not None else None

    def hold(self) -> Hold | None:
        """Keep room for the request the current task serves until its call picks a talker
        (talker_pool.Hold); None without a pool."""
        return self.pool.hold() if self.pool is not None else None

    async def model_info(self, timeout: float = 5.0) -> ModelCatalog:
        try:
            info = await self._stub.GetModelInfo(talker_pb2.GetModelInfoRequest(), timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            raise Unavailable(f"talker at {self.address}: {exc.details() or exc.code().name}") from None
        return ModelCatalog(
            name=info.name,
            model_type=info.model_type,
            model_size=info.model_size,
            speakers=tuple(s.lower() for s in info.speakers),
            languages=tuple(lang.lower() for lang in info.languages),
            sample_rate=info.sample_rate_hz or NATIVE_SAMPLE_RATE,
            samples_per_frame=info.samples_per_frame or SAMPLES_PER_FRAME,
        )

    async def generate(
        self, job: SynthesisJob, text: AsyncIterator[tuple[str, bool]] | None = None
    ) -> AsyncIterator[AudioPiece | SynthesisSummary]:
        """Stream the job's audio pieces, then its summary. Closing the iterator cancels the call,
        which makes the talker free the request's KV slot and decoder state.

        With `text`, the job's text is the first piece of one utterance and the (piece, final)
        pairs of `text` are appended to the running request (GenerateStream).

        A reference clip the talkers accepted before goes as its digest alone (a unary Generate
        only); a talker that holds no prompt for it fails the call before any audio and the call is
        made again with the clip."""
        request, accepted, digest = self._first_request(job, text)
        while True:
            yielded = False
            try:
                # aclosing: closing this iterator (the client went away) closes the call's, whose
                # `finally` cancels the talker call at once; left to the garbage collector, a
                # reference cycle could keep the call, and the talker's slot, for seconds.
                async with contextlib.aclosing(self._generate(job, request, text, accepted)) as items:
                    async for item in items:
                        yielded = True
                        yield item
                return
            except FailedPrecondition as exc:
                if digest is None or yielded or not exc.message.startswith(REFERENCE_NOT_CACHED):
                    raise
                # Evicted there: send the clip once more.
                self.sent_references.discard(digest)
                request, accepted, digest = (
                    generate_request(job, (reference_bytes(job), digest)),
                    digest,
                    None,
                )

    def _first_request(
        self, job: SynthesisJob, text: AsyncIterator[tuple[str, bool]] | None
    ) -> tuple[talker_pb2.GenerateRequest, str | None, str | None]:
        """(the first call's request, the clip digest to remember once it yields, the digest it
        sends alone: a FailedPrecondition for it makes the call again with the clip)."""
        if text is not None or job.reference_pcm is None:
            return generate_request(job), None, None
        pcm: bytes | None = None
        digest = self.clip_digests.get(job)
        if digest is None:
            pcm = reference_bytes(job)
            digest = reference_digest(pcm, job.reference_text or None, job.x_vector_only)
            self.clip_digests.put(job, digest)
        if digest in self.sent_references:
            return generate_request(job, (b"", digest), clip=False), None, digest
        return generate_request(job, (pcm if pcm is not None else reference_bytes(job), digest)), digest, None

    async def _generate(
        self,
        job: SynthesisJob,
        request: talker_pb2.GenerateRequest,
        text: AsyncIterator[tuple[str, bool]] | None = None,
        accepted: str | None = None,
    ) -> AsyncIterator[AudioPiece | SynthesisSummary]:
        """One talker call of `request`; `accepted`: a digest to remember once the call yields
        (the talker resolved its clip)."""
        lease = await self.pool.acquire() if self.pool is not None else None
        channel = self._channel if lease is None else lease.channel
        stub = self._stub if lease is None else talker_pb2_grpc.TalkerServiceStub(channel)
        metadata = outgoing_metadata(job.request_id) + (lease.metadata if lease is not None else ())
        session = self._session(channel)
        on_session = session.open(request, metadata, text) if session is not None else None
        try:
            if on_session is not None:
                call = on_session
            elif text is None:
                call = stub.Generate(request, metadata=metadata)
            else:
                call = stub.GenerateStream(_stream_requests(request, text), metadata=metadata)
        except BaseException:
            if lease is not None:
                lease.unsent()
                lease.release()
            raise
        try:
            async for msg in call:
                if accepted is not None:  # the talker resolved the clip: next time, its digest
                    self.sent_references.add(accepted)
                    accepted = None
                kind = msg.WhichOneof("event")
                if kind == "audio":
                    a = msg.audio
                    yield AudioPiece(a.audio, a.first_frame_index, a.num_frames)
                elif kind == "summary":
                    summary = summary_from_pb(msg.summary)
                    tracing.set_attributes(summary_span_attributes(summary, lease))
                    yield summary
        except grpc.aio.AioRpcError as exc:
            if lease is not None and exc.code() == grpc.StatusCode.UNAVAILABLE:
                lease.mark_unavailable()
            error = from_grpc(exc.code(), exc.details(), exc.trailing_metadata())
            if lease is not None and isinstance(error, ResourceExhausted):
                lease.mark_full(error.retry_after_s)  # refused at capacity: no room until it says
            if isinstance(error, NotFound) and error.message.startswith(UNKNOWN_VOICE):
                error.param = "voice"  # the talker found no stored voice of that name
            raise error from None
        finally:
            # No-op when the call already finished; cancels it when the consumer went away.
            if on_session is not None:
                await call.aclose()
            else:
                call.cancel()
            if lease is not None:
                lease.release()

    def _session(self, channel: grpc.aio.Channel) -> TalkerSession | None:
        """The channel's Session, or None when sessions are off or its talker has none."""
        if not self.sessions:
            return None
        session = self._sessions.get(channel)
        if session is None:
            for other, ended in list(self._sessions.items()):
                if ended.idle and not ended.unimplemented:
                    del self._sessions[other]
            session = self._sessions[channel] = TalkerSession(channel, on_written=self._on_session_written)
        return None if session.unimplemented else session

    async def close(self) -> None:
        for session in list(self._sessions.values()):
            await session.close()
        if self.pool is not None:
            await self.pool.close()
        await self._channel.close()
