"""Voice consents kept by speaker_cache: two gateways (their consent stores) over one real
speaker_cache server see the same records, and gRPC CreateVoice checks its `consent` field."""

from __future__ import annotations

import contextlib

import grpc
import pytest
from gateway_fakes import build_gateway, wav_bytes

from qtts.pb import tts_pb2, tts_pb2_grpc
from qtts.request.errors import NotFound
from qtts.serving.grpc_server import ErrorMappingInterceptor
from services.gateway.consents import ConsentStore
from services.gateway.grpc_servicer import TextToSpeechServicer
from services.gateway.voice_client import SpeakerCacheConsents, VoiceClient
from services.speaker_cache.config import SpeakerCacheConfig
from services.speaker_cache.server import SpeakerCacheServer


@contextlib.asynccontextmanager
async def speaker_cache():
    server = SpeakerCacheServer(SpeakerCacheConfig(port=0, metrics_port=0, drain_seconds=0.5).validate())
    port = await server.start()
    await server.wait_serving(timeout=10)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(0.5)


async def test_two_gateways_share_their_consents_through_speaker_cache():
    async with speaker_cache() as address:
        clients = [VoiceClient(address), VoiceClient(address)]
        one, two = (ConsentStore(SpeakerCacheConsents(c)) for c in clients)
        try:
            made = await one.create("Speaker", "en-US", b"consent audio")
            assert made.id.startswith("cons_") and made.recording_bytes == len(b"consent audio")
            assert await two.get(made.id) == made
            await two.check(made.id)  # a voice upload on the other gateway finds it
            renamed = await two.rename(made.id, "Renamed")
            assert (await one.get(made.id)).name == "Renamed" == renamed.name
            later = await one.create("Other", "de-DE", b"x")
            page, more = await two.page(None, 1)
            assert [c.id for c in page] == [made.id] and more
            assert [c.id for c in (await two.page(made.id, 5))[0]] == [later.id]
            await one.delete(made.id)
            with pytest.raises(NotFound) as err:
                await two.get(made.id)
            assert err.value.param == "consent_id"
            with pytest.raises(NotFound) as err:
                await two.check(made.id)
            assert err.value.param == "consent"
        finally:
            for c in clients:
                await c.close()


@contextlib.asynccontextmanager
async def serve_grpc(gw, consents: ConsentStore):
    server = grpc.aio.server(interceptors=[ErrorMappingInterceptor(gw.metrics)])
    servicer = TextToSpeechServicer(gw.synth, gw.voice_service, consents=consents)
    tts_pb2_grpc.add_TextToSpeechServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield tts_pb2_grpc.TextToSpeechServiceStub(channel)
    await server.stop(0)


async def test_grpc_create_voice_checks_its_consent():
    gw = build_gateway()
    consents = ConsentStore()
    consent = await consents.create("Speaker", "en-US", b"consent audio")
    async with serve_grpc(gw, consents) as stub:
        made = await stub.CreateVoice(
            tts_pb2.CreateVoiceRequest(name="agreed", reference_audio=wav_bytes(), consent=consent.id)
        )
        assert made.voice.name == "agreed"
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.CreateVoice(
                tts_pb2.CreateVoiceRequest(name="nope", reference_audio=wav_bytes(), consent="cons_nobody")
            )
        assert info.value.code() == grpc.StatusCode.NOT_FOUND and "consent" in info.value.details()
    assert sorted(gw.voices.voices) == ["agreed"]
