"""The assembled gateway process core against a fake talker (gRPC) and a real speaker_cache server."""

from __future__ import annotations

import asyncio

import grpc
import httpx
import numpy as np
import pytest
from gateway_fakes import FRAME, fake_decode, frame_pcm, free_port, wav_bytes

from qtts.pb import talker_pb2, talker_pb2_grpc, tts_pb2, tts_pb2_grpc
from qtts.request.errors import InvalidArgument
from qtts.request.vocabulary import unknown_voice
from qtts.serving.grpc_server import GrpcServiceHost, service_full_name
from services.gateway.config import GatewayConfig
from services.gateway.server import GatewayServer
from services.speaker_cache.config import SpeakerCacheConfig
from services.speaker_cache.server import SpeakerCacheServer


class FakeTalkerServicer(talker_pb2_grpc.TalkerServiceServicer):
    """Generates `max_new_frames` frames, one per chunk, slowly when asked; records requests."""

    def __init__(self):
        self.requests: list[talker_pb2.GenerateRequest] = []
        self.cancelled = 0
        self.delay_s = 0.0

    async def GetModelInfo(self, request, context):
        return talker_pb2.GetModelInfoResponse(
            name="fake-base",
            model_type="base",
            model_size="tiny",
            languages=["english"],
            sample_rate_hz=24000,
            samples_per_frame=FRAME,
            num_codebooks=16,
        )

    async def Generate(self, request, context):
        self.requests.append(request)
        n = request.max_new_frames or 3
        try:
            for i in range(n):
                await asyncio.sleep(self.delay_s)
                yield talker_pb2.GenerateResponse(
                    request_id=request.request_id,
                    sequence_number=i,
                    audio=tts_pb2.AudioChunk(
                        audio=frame_pcm(i), num_samples=FRAME, first_frame_index=i, num_frames=1
                    ),
                )
            yield talker_pb2.GenerateResponse(
                request_id=request.request_id,
                sequence_number=n,
                summary=talker_pb2.GenerateSummary(
                    finish_reason=tts_pb2.FINISH_REASON_LENGTH,
                    num_frames=n,
                    num_samples=n * FRAME,
                    code2wav_replica="c2w-a",
                ),
            )
        except asyncio.CancelledError:
            self.cancelled += 1
            raise


async def _start_talker(servicer: FakeTalkerServicer) -> GrpcServiceHost:
    host = GrpcServiceHost(service_names=[service_full_name(talker_pb2, "TalkerService")], port=0)
    talker_pb2_grpc.add_TalkerServiceServicer_to_server(servicer, host.server)
    await host.start()
    await host.set_serving()
    return host


async def test_gateway_end_to_end_with_fake_talker_and_real_speaker_cache():
    talker = FakeTalkerServicer()
    talker_host = await _start_talker(talker)
    cache = SpeakerCacheServer(SpeakerCacheConfig(port=0, metrics_port=0), health_interval_s=0.1)
    cache_port = await cache.start()
    await cache.wait_serving()
    config = GatewayConfig(
        http_port=free_port(),
        grpc_port=free_port(),
        metrics_port=0,
        talker=f"127.0.0.1:{talker_host.bound_port}",
        speaker_cache=f"127.0.0.1:{cache_port}",
        drain_seconds=1.0,
    ).validate()
    gateway = GatewayServer(config, catalog_retry_s=0.05, decode=fake_decode)
    await gateway.start()
    url = f"http://127.0.0.1:{config.http_port}"
    try:
        async with httpx.AsyncClient(base_url=url, timeout=10) as c:
            for _ in range(100):
                if gateway.catalog is not None:
                    break
                await asyncio.sleep(0.05)
            assert (await c.get("/v1/models")).json()["data"][0]["id"] == "fake-base"
            assert (await c.get("/health")).status_code == 200

            ref = wav_bytes()
            r = await c.post(
                "/v1/audio/voices",
                files={"audio": ("r.wav", ref, "audio/wav")},
                data={"name": "alice", "ref_text": "hello"},
            )
            assert r.status_code == 201, r.text
            assert [v["name"] for v in (await c.get("/v1/audio/voices")).json()["voices"]] == ["alice"]
            one = (await c.get("/v1/audio/voices/alice")).json()
            assert (one["id"], one["object"], one["duration_s"]) == ("alice", "audio.voice", 1.0)
            assert (await c.get("/v1/audio/voices")).json()["voices"][0]["duration_s"] == 1.0

            r = await c.post(
                "/v1/audio/speech",
                json={
                    "input": "Hi.",
                    "voice": "alice",
                    "max_new_tokens": 4,
                    "seed": 9,
                    "top_k": 5,
                    "response_format": "pcm",
                    "stream": False,
                },
            )
            assert r.status_code == 200 and r.content == frame_pcm(0, 4)
            assert r.headers["x-tts-code2wav-replica"] == "c2w-a"
            req = talker.requests[-1]
            assert (req.text, req.voice, req.task_type, req.max_new_frames) == (
                "Hi.",
                "alice",
                tts_pb2.TASK_TYPE_VOICE_CLONE,
                4,
            )
            assert req.sampling.seed == 9 and req.sampling.top_k == 5 and not req.sampling.HasField("top_p")
            assert req.request_id.startswith("req-") and not req.reference_pcm_f32

            r = await c.post(
                "/v1/audio/speech",
                json={
                    "input": "Hi.",
                    "voice": "x",
                    "ref_audio": "UklGRgAAAAA=",
                    "x_vector_only_mode": True,
                    "response_format": "wav",
                },
            )
            assert r.status_code == 200
            pcm = np.frombuffer(talker.requests[-1].reference_pcm_f32, "<f4")
            assert pcm.size == 24000 and talker.requests[-1].x_vector_only

            # Client disconnect mid-stream cancels the talker's Generate call.
            talker.delay_s = 0.05
            async with c.stream(
                "POST",
                "/v1/audio/speech",
                json={
                    "input": "Hi.",
                    "voice": "alice",
                    "stream": True,
                    "max_new_tokens": 500,
                    "response_format": "pcm",
                },
            ) as s:
                await s.aiter_raw().__anext__()
            for _ in range(100):
                if talker.cancelled:
                    break
                await asyncio.sleep(0.05)
            assert talker.cancelled == 1 and gateway.synthesizer.admission.active == 0
            talker.delay_s = 0.0

        async with grpc.aio.insecure_channel(f"127.0.0.1:{config.grpc_port}") as ch:
            stub = tts_pb2_grpc.TextToSpeechServiceStub(ch)
            msgs = [
                m
                async for m in stub.Synthesize(
                    tts_pb2.SynthesizeRequest(
                        text="Hi.",
                        voice="alice",
                        max_new_frames=2,
                        streaming=tts_pb2.StreamingOptions(first_chunk_frames=1, chunk_frames_ramp=[2, 4]),
                    )
                )
            ]
            assert msgs[-1].summary.num_frames == 2
            assert list(talker.requests[-1].streaming.chunk_frames_ramp) == [2, 4]
            voices = await stub.ListVoices(tts_pb2.ListVoicesRequest())
            assert [v.name for v in voices.voices] == ["alice"]

        await talker_host.set_not_serving()
        async with httpx.AsyncClient(base_url=url, timeout=10) as c:
            r = await c.get("/health")
            assert r.status_code == 503 and r.json()["stages"]["talker"] == "NOT_SERVING"
    finally:
        await gateway.stop()
        await cache.stop(0)
        await talker_host.stop(0)


async def test_http_keepalive_setting_reaches_uvicorn():
    """--http-keepalive-s (default 75 s, above common load-balancer idle timeouts) sets uvicorn's
    keep-alive; zero or negative is rejected with the flag's name."""
    from services.gateway.config import config_from_args

    assert config_from_args([]).http_keepalive_s == 75.0
    config = GatewayConfig(
        http_port=free_port(), grpc_port=free_port(), metrics_port=0, http_keepalive_s=42
    ).validate()
    gateway = GatewayServer(config, catalog_retry_s=0.05, decode=fake_decode)
    assert gateway.http.config.timeout_keep_alive == 42
    with pytest.raises(InvalidArgument, match="--http-keepalive-s"):
        GatewayConfig(http_keepalive_s=0).validate()


class UnknownVoiceTalker(FakeTalkerServicer):
    """A talker with no stored voices: every named voice is unknown (as speaker_cache says)."""

    async def Generate(self, request, context):
        error = unknown_voice(request.voice)
        await context.abort(grpc.StatusCode.NOT_FOUND, error.message)
        yield  # pragma: no cover - an async generator that aborts


async def test_an_unknown_stored_voice_names_param_voice_and_where_voices_are():
    talker_host = await _start_talker(UnknownVoiceTalker())
    config = GatewayConfig(
        http_port=free_port(),
        grpc_port=free_port(),
        metrics_port=0,
        talker=f"127.0.0.1:{talker_host.bound_port}",
        speaker_cache=f"127.0.0.1:{free_port()}",
        drain_seconds=0.5,
    ).validate()
    gateway = GatewayServer(config, catalog_retry_s=0.05, decode=fake_decode)
    await gateway.start()
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{config.http_port}", timeout=10) as c:
            for _ in range(200):
                if (await c.get("/readyz")).status_code == 200:
                    break
                await asyncio.sleep(0.05)
            for stream in (False, True):
                r = await c.post(
                    "/v1/audio/speech", json={"input": "Hi.", "voice": "alloy", "stream": stream}
                )
                assert r.status_code == 404, r.text
                error = r.json()["error"]
                assert error["param"] == "voice" and error["code"] == "not_found", error
                assert error["message"].startswith("no voice is stored under the name 'alloy': "), error
                assert "GET /v1/audio/voices" in error["message"], error
                assert "OpenAI's preset names (alloy, ash," in error["message"], error
        async with grpc.aio.insecure_channel(f"127.0.0.1:{config.grpc_port}") as ch:
            stub = tts_pb2_grpc.TextToSpeechServiceStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in stub.Synthesize(tts_pb2.SynthesizeRequest(text="Hi.", voice="alloy")):
                    pass
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
            assert "ListVoices" in err.value.details(), err.value.details()
    finally:
        await gateway.stop()
        await talker_host.stop(0)
