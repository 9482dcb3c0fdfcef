"""The gateway's talker client sends a voice-clone clip once: later requests with the same clip
carry only its reference digest, and a talker that holds no prompt for it gets the clip again."""

from __future__ import annotations

import dataclasses

import grpc
import numpy as np

from qtts.pb import talker_pb2, talker_pb2_grpc, tts_pb2
from qtts.request.vocabulary import SynthesisSummary
from qtts.serving.grpc_server import GrpcServiceHost, service_full_name
from qtts.streams.voice_key import REFERENCE_NOT_CACHED, reference_digest
from services.gateway.job import SamplingOptions, SynthesisJob
from services.gateway.talker_client import SentReferences, TalkerClient

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


def clone_job(i: int, text: str = "the reference words", pcm: np.ndarray = PCM) -> SynthesisJob:
    return SynthesisJob(
        request_id=f"req-{i}",
        text="Hello there.",
        task="voice_clone",
        voice="",
        language="english",
        instructions="",
        reference_audio=b"RIFF...",
        reference_text=text,
        x_vector_only=False,
        max_new_frames=4,
        sampling=SamplingOptions(),
        sample_rate=24000,
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
    talker = DigestTalker()
    host = GrpcServiceHost(service_names=[service_full_name(talker_pb2, "TalkerService")], port=0)
    talker_pb2_grpc.add_TalkerServiceServicer_to_server(talker, host.server)
    await host.start()
    await host.set_serving()
    client = TalkerClient(f"127.0.0.1:{host.bound_port}")
    try:
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
    finally:
        await client.close()
        await host.stop(0)


async def test_a_request_without_a_clip_sends_no_digest():
    talker = DigestTalker()
    host = GrpcServiceHost(service_names=[service_full_name(talker_pb2, "TalkerService")], port=0)
    talker_pb2_grpc.add_TalkerServiceServicer_to_server(talker, host.server)
    await host.start()
    await host.set_serving()
    client = TalkerClient(f"127.0.0.1:{host.bound_port}")
    try:
        preset = dataclasses.replace(clone_job(0), task="custom_voice", voice="vivian", reference_pcm=None)
        assert await run(client, preset) == 1
        assert not talker.requests[-1].reference_digest and not talker.requests[-1].reference_pcm_f32
    finally:
        await client.close()
        await host.stop(0)


def test_sent_references_is_a_bounded_lru():
    sent = SentReferences(max_entries=2)
    sent.add("a")
    sent.add("b")
    assert "a" in sent  # touches a: b is now the oldest
    sent.add("c")
    assert "b" not in sent and "a" in sent and "c" in sent
    sent.discard("a")
    assert "a" not in sent
