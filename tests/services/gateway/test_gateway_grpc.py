"""tts.v1 over a real grpc.aio server (with the shared error interceptor) and a fake talker."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest
from gateway_fakes import FRAME, build_gateway, frame_pcm, wav_bytes

from qtts.pb import tts_pb2, tts_pb2_grpc
from qtts.serving.grpc_server import ErrorMappingInterceptor
from services.gateway.grpc_servicer import TextToSpeechServicer


@contextlib.asynccontextmanager
async def serve_grpc(gw):
    server = grpc.aio.server(interceptors=[ErrorMappingInterceptor(gw.metrics)])
    tts_pb2_grpc.add_TextToSpeechServiceServicer_to_server(
        TextToSpeechServicer(gw.synth, gw.voice_service), server
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield tts_pb2_grpc.TextToSpeechServiceStub(channel)
    await server.stop(0)


def request(**kw) -> tts_pb2.SynthesizeRequest:
    fields = {"text": "Hello.", "reference_audio": wav_bytes(), "x_vector_only": True, **kw}
    return tts_pb2.SynthesizeRequest(**fields)


async def test_synthesize_streams_chunks_with_ids_and_sequence_then_summary():
    gw = build_gateway(frames=5, chunk=2)
    async with serve_grpc(gw) as stub:
        msgs = [m async for m in stub.Synthesize(request(request_id="r-1", max_new_frames=5))]
    assert [m.sequence_number for m in msgs] == list(range(len(msgs)))
    assert {m.request_id for m in msgs} == {"r-1"}
    audio = [m.audio for m in msgs[:-1]]
    assert b"".join(a.audio for a in audio) == frame_pcm(0, 5)
    assert [(a.first_frame_index, a.num_frames) for a in audio] == [(0, 2), (2, 2), (4, 1)]
    summary = msgs[-1].summary
    assert summary.finish_reason == tts_pb2.FINISH_REASON_LENGTH
    assert (summary.num_frames, summary.num_samples, summary.sample_rate_hz) == (5, 5 * FRAME, 24000)


async def test_wav_encoding_and_resampling():
    gw = build_gateway(frames=4, chunk=2)
    async with serve_grpc(gw) as stub:
        msgs = [
            m
            async for m in stub.Synthesize(
                request(audio_encoding=tts_pb2.AUDIO_ENCODING_WAV, sample_rate_hz=16000)
            )
        ]
    data = b"".join(m.audio.audio for m in msgs if m.HasField("audio"))
    assert data[:4] == b"RIFF" and data[4:8] == b"\xff\xff\xff\xff"
    summary = msgs[-1].summary
    assert summary.sample_rate_hz == 16000 and abs(summary.num_samples - 4 * 1280) <= 2
    assert (len(data) - 44) // 2 == summary.num_samples


@pytest.mark.parametrize(
    "kw, code",
    [
        ({"model": "tts-1"}, grpc.StatusCode.NOT_FOUND),
        ({"text": ""}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"reference_audio": b"garbage", "x_vector_only": True}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"x_vector_only": False}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"task_type": tts_pb2.TASK_TYPE_VOICE_DESIGN}, grpc.StatusCode.INVALID_ARGUMENT),
    ],
)
async def test_errors_map_to_status_codes(kw, code):
    gw = build_gateway()
    async with serve_grpc(gw) as stub:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            [m async for m in stub.Synthesize(request(**kw))]
        assert info.value.code() == code
        assert len([m async for m in stub.Synthesize(request())]) > 1  # still serving


async def test_resource_exhausted_and_cancel_frees_the_talker():
    gw = build_gateway(max_streams=1, frames=1000, chunk=1, delay_s=0.05)
    async with serve_grpc(gw) as stub:
        call = stub.Synthesize(request(max_new_frames=100))
        await call.read()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            [m async for m in stub.Synthesize(request())]
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # Counted among the requests' outcomes, as a request refused by validation is.
        assert gw.synth.metrics.requests_total.labels("grpc", "resource_exhausted")._value.get() == 1
        call.cancel()
        for _ in range(200):
            if gw.talker.active == 0 and gw.synth.admission.active == 0:
                break
            await asyncio.sleep(0.02)
        assert gw.talker.active == 0 and gw.synth.admission.active == 0 and gw.talker.completed == 0


async def test_voices_api():
    gw = build_gateway()
    async with serve_grpc(gw) as stub:
        created = await stub.CreateVoice(
            tts_pb2.CreateVoiceRequest(name="v1", reference_audio=wav_bytes(), reference_text="hi")
        )
        assert created.voice.name == "v1" and created.voice.kind == "cloned"
        voices = await stub.ListVoices(tts_pb2.ListVoicesRequest())
        assert [v.name for v in voices.voices] == ["v1"]
        await stub.DeleteVoice(tts_pb2.DeleteVoiceRequest(name="v1"))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.DeleteVoice(tts_pb2.DeleteVoiceRequest(name="v1"))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.CreateVoice(
                tts_pb2.CreateVoiceRequest(name="bad name", reference_audio=wav_bytes(), reference_text="hi")
            )
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
