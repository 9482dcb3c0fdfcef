"""The optional shared secret between the services: a stage with a token refuses callers without
it (health excepted), and the clients of the stages send it."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from qtts.pb import (
    code2wav_pb2,
    code2wav_pb2_grpc,
    speaker_cache_pb2,
    speaker_cache_pb2_grpc,
    talker_pb2,
    talker_pb2_grpc,
)
from qtts.request.vocabulary import AudioPiece, SynthesisSummary
from qtts.serving.internal_auth import client_interceptors
from services.code2wav.config import config_from_args as c2w_config_from_args
from services.gateway.talker_client import TalkerClient
from services.gateway.voice_client import VoiceClient
from services.talker.speaker_cache_client import SpeakerCacheClient
from tests.qtts.serving.stage_servers import (
    code2wav_server,
    fake_talker,
    speaker_cache_server,
    voice_clone_job,
)
from tests.services.talker.fakes import FakeCode2Wav

TOKEN = "s3cret"


async def test_speaker_cache_refuses_callers_without_the_token():
    async with speaker_cache_server(internal_token=TOKEN) as address:
        for interceptors in (None, client_interceptors("wrong")):
            async with grpc.aio.insecure_channel(address, interceptors=interceptors) as channel:
                stub = speaker_cache_pb2_grpc.SpeakerCacheServiceStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.PutVoicePrompt(speaker_cache_pb2.PutVoicePromptRequest(key="k"))
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.ListVoices(speaker_cache_pb2.ListVoicesRequest())
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
                health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
                assert health.status == health_pb2.HealthCheckResponse.SERVING  # probes carry no token
                # Reflection would list the services and their schemas: refused too.
                reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
                calls = reflection.ServerReflectionInfo(
                    iter([reflection_pb2.ServerReflectionRequest(list_services="")])
                )
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    async for _ in calls:
                        pass
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # The gateway's and the talker's clients send it.
        voices = VoiceClient(address, token=TOKEN)
        assert await voices.list() == []
        await voices.close()
        cache = SpeakerCacheClient(address, token=TOKEN)
        assert await cache.get_prompt("k" * 16) is None
        await cache.close()


async def test_talker_refuses_callers_without_the_token():
    async with fake_talker([FakeCode2Wav("c2w-a")], internal_token=TOKEN) as s:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await s.stub.GetModelInfo(talker_pb2.GetModelInfoRequest())
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        port = s.talker.host.bound_port
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = talker_pb2_grpc.TalkerServiceStub(channel).Generate(
                talker_pb2.GenerateRequest(text="frames=2")
            )
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for _ in call:
                    pass
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        client = TalkerClient(f"127.0.0.1:{port}", token=TOKEN)
        try:
            assert (await client.model_info()).model_type == "base"
        finally:
            await client.close()


async def test_a_stream_through_the_token_interceptor_is_whole():
    async with fake_talker([FakeCode2Wav("c2w-a")], internal_token=TOKEN) as s:
        client = TalkerClient(f"127.0.0.1:{s.talker.host.bound_port}", token=TOKEN)
        try:
            events = [e async for e in client.generate(voice_clone_job("tok"))]
        finally:
            await client.close()
    assert sum(e.num_frames for e in events if isinstance(e, AudioPiece)) == 3
    assert isinstance(events[-1], SynthesisSummary) and events[-1].num_frames == 3


async def test_code2wav_refuses_callers_without_the_token_and_the_talker_sends_it(fake_decoder):
    async with code2wav_server(fake_decoder, "c2w-tok", internal_token=TOKEN) as address:
        for interceptors in (None, client_interceptors("wrong")):
            async with grpc.aio.insecure_channel(address, interceptors=interceptors) as channel:
                call = code2wav_pb2_grpc.Code2WavServiceStub(channel).Decode()
                # The refusal may end the call before the write: then the write raises it.
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await call.write(
                        code2wav_pb2.DecodeRequest(start=code2wav_pb2.StreamStart(request_id="x"))
                    )
                    async for _ in call:
                        pass
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
                health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
                assert health.status == health_pb2.HealthCheckResponse.SERVING  # probes carry no token
        # A talker with the token decodes through it; its code2wav calls carry the token.
        async with fake_talker([], code2wav_addresses=[address], internal_token=TOKEN) as s:
            client = TalkerClient(f"127.0.0.1:{s.talker.host.bound_port}", token=TOKEN)
            try:
                events = [e async for e in client.generate(voice_clone_job("tok-c2w"))]
            finally:
                await client.close()
        assert sum(e.num_frames for e in events if isinstance(e, AudioPiece)) == 3
        assert isinstance(events[-1], SynthesisSummary) and events[-1].num_frames == 3


def test_code2wav_takes_the_token_from_the_flag():
    assert c2w_config_from_args(["--internal-token", TOKEN]).internal_token == TOKEN
    assert c2w_config_from_args([]).internal_token == ""
