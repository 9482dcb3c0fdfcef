"""The gateway's talker client sends a voice-clone clip once: later requests with the same clip
carry only its reference digest, and a talker that holds no prompt for it gets the clip again."""

from __future__ import annotations

import contextlib
import dataclasses

import grpc
import numpy as np

from qtts.pb import talker_pb2, talker_pb2_grpc, tts_pb2
from qtts.request.vocabulary import SynthesisSummary
from qtts.serving.grpc_server import GrpcServiceHost, service_full_name
from qtts.streams.voice_key import REFERENCE_NOT_CACHED, reference_digest
from services.gateway.job import SynthesisJob
from services.gateway.talker_client import ClipDigests, SentReferences, TalkerClient
from tests.synthesis_jobs import talker_job

PCM = (np.sin(np.arange(4800) / 9) * 0.3).astype(np.float32)


class DigestTalker(talker_pb2_grpc.TalkerServiceServicer):
    """Remembers the digests of the clips it was sent (as a talker's prompt cache does) and fails a
    digest-only request it does not know, as services/talker/voices.py does."""

    def __init__(self):
        self.known: set[str] = set()
        self.requests: list[talker_pb2.GenerateRequest] = []

    async def Generate(self, request, context):
        self.requests.append(request)
        if request.reference_pcm_f32:
            pcm = request.reference_pcm_f32
            digest = reference_digest(pcm, request.reference_text or None, request.x_vector_only)
            assert digest == request.reference_digest  # the gateway's digest is the talker's
            self.known.add(digest)
        elif request.reference_digest and request.reference_digest not in self.known:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, f"{REFERENCE_NOT_CACHED}: send reference_pcm_f32"
            )
        yield talker_pb2.GenerateResponse(
            request_id=request.request_id,
            audio=tts_pb2.AudioChunk(audio=b"\0" * 3840, num_samples=1920, first_frame_index=0, num_frames=1),
        )
        yield talker_pb2.GenerateResponse(
            request_id=request.request_id,
            sequence_number=1,
            summary=talker_pb2.GenerateSummary(finish_reason=tts_pb2.FINISH_REASON_STOP, num_frames=1),
        )


@contextlib.asynccontextmanager
async def digest_talker():
    """(a DigestTalker served on a free port, a TalkerClient of it)."""
    talker = DigestTalker()
    host = GrpcServiceHost(service_names=[service_full_name(talker_pb2, "TalkerService")], port=0)
    talker_pb2_grpc.add_TalkerServiceServicer_to_server(talker, host.server)
    await host.start()
    await host.set_serving()
    client = TalkerClient(f"127.0.0.1:{host.bound_port}")
    try:
        yield talker, client
    finally:
        await client.close()
        await host.stop(0)


def clone_job(i: int, text: str = "the reference words", pcm: np.ndarray = PCM) -> SynthesisJob:
    return talker_job(
        f"req-{i}",
        text="Hello there.",
        task="voice_clone",
        voice="",
        reference_audio=b"RIFF...",
        reference_text=text,
        reference_pcm=pcm,
    )


async def run(client: TalkerClient, job: SynthesisJob) -> int:
    pieces = 0
    async for event in client.generate(job):
        if isinstance(event, SynthesisSummary):
            return pieces
        pieces += 1
    raise AssertionError("no summary")


async def test_a_clip_is_sent_once_then_by_digest_and_again_when_the_talker_lost_it():
    async with digest_talker() as (talker, client):
        assert await run(client, clone_job(0)) == 1
        assert await run(client, clone_job(1)) == 1
        first, second = talker.requests
        assert len(first.reference_pcm_f32) == 4 * PCM.size and first.reference_digest
        assert not second.reference_pcm_f32 and second.reference_digest == first.reference_digest

        # Another transcript is another voice prompt: its clip goes again.
        assert await run(client, clone_job(2, text="other words")) == 1
        assert talker.requests[-1].reference_pcm_f32

        # The talker lost the prompt (evicted, or another replica): one refused digest-only call,
        # then the clip; the caller sees one stream with its audio, no error.
        talker.known.clear()
        assert await run(client, clone_job(3)) == 1
        lost, resent = talker.requests[-2:]
        assert not lost.reference_pcm_f32 and resent.reference_pcm_f32
        assert await run(client, clone_job(4)) == 1 and not talker.requests[-1].reference_pcm_f32
        assert len(talker.requests) == 6


async def test_a_request_without_a_clip_sends_no_digest():
    async with digest_talker() as (talker, client):
        preset = dataclasses.replace(clone_job(0), task="custom_voice", voice="vivian", reference_pcm=None)
        assert await run(client, preset) == 1
        assert not talker.requests[-1].reference_digest and not talker.requests[-1].reference_pcm_f32


def test_sent_references_is_a_bounded_lru():
    sent = SentReferences(max_entries=2)
    sent.add("a")
    sent.add("b")
    assert "a" in sent  # touches a: b is now the oldest
    sent.add("c")
    assert "b" not in sent and "a" in sent and "c" in sent
    sent.discard("a")
    assert "a" not in sent


def test_a_decoded_clip_is_hashed_once_by_identity_text_and_mode():
    digests = ClipDigests(max_entries=2)
    job = clone_job(0)
    assert digests.get(job) is None
    digests.put(job, "d0")
    assert digests.get(clone_job(1)) == "d0"  # the same array object, the same transcript
    assert digests.get(clone_job(2, pcm=PCM.copy())) is None  # equal samples, another object
    assert digests.get(clone_job(3, text="other words")) is None
    assert digests.get(dataclasses.replace(job, x_vector_only=True)) is None
    gone = clone_job(4, pcm=PCM.copy())
    digests.put(gone, "d1")
    key_job = dataclasses.replace(gone)
    del gone
    assert digests.get(key_job) == "d1"  # alive through key_job
    digests.put(clone_job(5, pcm=np.zeros(3, np.float32)), "d2")  # LRU of 2: evicts the oldest
    assert digests.get(job) is None


async def test_a_repeated_clip_is_neither_copied_nor_hashed_again(monkeypatch):
    import services.gateway.talker_client as tc

    async with digest_talker() as (talker, client):
        calls = {"bytes": 0, "digest": 0}
        real_bytes, real_digest = tc.reference_bytes, tc.reference_digest

        def counted_bytes(job):
            calls["bytes"] += 1
            return real_bytes(job)

        def counted_digest(*args):
            calls["digest"] += 1
            return real_digest(*args)

        monkeypatch.setattr(tc, "reference_bytes", counted_bytes)
        monkeypatch.setattr(tc, "reference_digest", counted_digest)
        for i in range(3):
            assert await run(client, clone_job(i)) == 1
        assert calls == {"bytes": 1, "digest": 1}
        assert [bool(r.reference_pcm_f32) for r in talker.requests] == [True, False, False]
        talker.known.clear()  # lost there: the clip is copied (not hashed) once more
        assert await run(client, clone_job(9)) == 1
        assert calls == {"bytes": 2, "digest": 1} and talker.requests[-1].reference_pcm_f32
