"""tts.v1 voices over gRPC: a clip without a transcript is an x-vector-only voice, as over HTTP."""

from __future__ import annotations

import grpc
import pytest
from gateway_fakes import CUSTOM, build_gateway, wav_bytes
from test_gateway_grpc import serve_grpc

from qtts.pb import tts_pb2


async def test_create_voice_without_transcript_is_x_vector_only():
    gw = build_gateway()
    async with serve_grpc(gw) as stub:
        plain = await stub.CreateVoice(tts_pb2.CreateVoiceRequest(name="plain", reference_audio=wav_bytes()))
        assert plain.voice.x_vector_only and plain.voice.reference_text == ""
        icl = await stub.CreateVoice(
            tts_pb2.CreateVoiceRequest(name="icl", reference_audio=wav_bytes(), reference_text="Hello.")
        )
        assert not icl.voice.x_vector_only and icl.voice.reference_text == "Hello."
        forced = await stub.CreateVoice(
            tts_pb2.CreateVoiceRequest(
                name="forced", reference_audio=wav_bytes(), reference_text="ignored", x_vector_only=True
            )
        )
        assert forced.voice.x_vector_only and forced.voice.reference_text == ""
        got = await stub.GetVoice(tts_pb2.GetVoiceRequest(name="plain"))
        assert got.voice.name == "plain" and got.voice.reference_duration_s == pytest.approx(1.0)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.CreateVoice(
                tts_pb2.CreateVoiceRequest(name="nope", reference_audio=wav_bytes(), x_vector_only=False)
            )
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "ref_text" in info.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.CreateVoice(tts_pb2.CreateVoiceRequest(name="empty"))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.GetVoice(tts_pb2.GetVoiceRequest(name="nobody"))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert sorted(gw.voices.voices) == ["forced", "icl", "plain"]


async def test_get_voice_finds_preset_speakers():
    async with serve_grpc(build_gateway(CUSTOM)) as stub:
        got = await stub.GetVoice(tts_pb2.GetVoiceRequest(name="Vivian"))
    assert (got.voice.name, got.voice.kind) == ("vivian", "preset")
