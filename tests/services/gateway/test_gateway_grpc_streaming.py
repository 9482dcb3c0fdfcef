"""tts.v1 StreamingSynthesize (text in, audio out) over a real grpc.aio server and a fake talker."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from gateway_fakes import CUSTOM, FRAME, build_gateway, frame_pcm
from test_gateway_grpc import serve_grpc

from qtts.pb import tts_pb2
from qtts.request.errors import NotFound


def config(**kw) -> tts_pb2.StreamingSynthesizeRequest:
    split = kw.pop("text_split", tts_pb2.TEXT_SPLIT_UNSPECIFIED)
    synthesis = tts_pb2.SynthesizeRequest(**{"voice": "vivian", **kw})
    return tts_pb2.StreamingSynthesizeRequest(
        streaming_config=tts_pb2.StreamingSynthesizeConfig(synthesis=synthesis, text_split=split)
    )


def text(piece: str, flush: bool = False) -> tts_pb2.StreamingSynthesizeRequest:
    return tts_pb2.StreamingSynthesizeRequest(input=tts_pb2.StreamingSynthesisInput(text=piece, flush=flush))


async def read_segment(call) -> list[tts_pb2.StreamingSynthesizeResponse]:
    """segment_start, audio chunks, segment_summary of one segment."""
    msgs = [await asyncio.wait_for(call.read(), 5)]
    assert msgs[0].HasField("segment_start"), msgs[0]
    while not msgs[-1].HasField("segment_summary"):
        msgs.append(await asyncio.wait_for(call.read(), 5))
    return msgs


async def test_text_in_pieces_is_one_running_request_with_audio_before_the_input_ends():
    gw = build_gateway(CUSTOM, frames=3, chunk=2)
    async with serve_grpc(gw) as stub:
        call = stub.StreamingSynthesize()
        await call.write(config(request_id="s-1"))
        await call.write(text("Hello "))
        await call.write(text("there. How"))
        first = [await asyncio.wait_for(call.read(), 5)]
        assert first[0].segment_start.text.startswith("Hello")
        while len(first) < 3:  # both audio chunks, before the rest of the text is sent
            first.append(await asyncio.wait_for(call.read(), 5))
        assert b"".join(m.audio.audio for m in first[1:]) == frame_pcm(0, 3)
        await call.write(text(" are you"))
        await call.write(text(" today", flush=True))  # the utterance ends: its request finishes
        first.append(await asyncio.wait_for(call.read(), 5))
        summary = first[-1].segment_summary
        assert (summary.num_frames, summary.num_samples, summary.finish_reason) == (
            3,
            3 * FRAME,
            tts_pb2.FINISH_REASON_LENGTH,
        )
        await call.write(text("Last words."))
        await call.done_writing()
        second = await read_segment(call)
        assert await call.read() == grpc.aio.EOF
        assert await call.code() == grpc.StatusCode.OK
    msgs = first + second
    assert [m.sequence_number for m in msgs] == list(range(len(msgs)))
    assert {m.request_id for m in msgs} == {"s-1"}
    assert [m.segment_index for m in (first[0], second[0])] == [0, 1]
    assert gw.talker.texts == ["Hello there. How are you today", "Last words."]
    assert [j.request_id for j in gw.talker.jobs] == ["s-1-0", "s-1-1"]
    assert gw.talker.streamed[0] is True and gw.synth.admission.active == 0


async def test_sentence_split_makes_a_running_request_per_sentence():
    gw = build_gateway(CUSTOM, frames=2, chunk=2)
    async with serve_grpc(gw) as stub:
        requests = [config(text_split=tts_pb2.TEXT_SPLIT_SENTENCE), text("One. Tw"), text("o. Three")]
        msgs = [m async for m in stub.StreamingSynthesize(iter(requests))]
    assert [m.segment_index for m in msgs if m.HasField("segment_summary")] == [0, 1, 2]
    assert gw.talker.texts == ["One.", "Two.", "Three"]


async def test_wav_and_one_segment_until_the_end():
    gw = build_gateway(CUSTOM, frames=2, chunk=2)
    async with serve_grpc(gw) as stub:
        requests = [config(audio_encoding=tts_pb2.AUDIO_ENCODING_WAV), text("One. "), text("Two.")]
        msgs = [m async for m in stub.StreamingSynthesize(iter(requests))]
    assert len([m for m in msgs if m.HasField("segment_start")]) == 1 and gw.talker.texts == ["One. Two."]
    data = b"".join(m.audio.audio for m in msgs if m.HasField("audio"))
    assert data[:4] == b"RIFF" and data[44:] == frame_pcm(0, 2)


@pytest.mark.parametrize(
    "requests, code, words",
    [
        ([text("hi")], grpc.StatusCode.INVALID_ARGUMENT, "streaming_config"),
        ([], grpc.StatusCode.INVALID_ARGUMENT, "streaming_config"),
        ([config(text="inline")], grpc.StatusCode.INVALID_ARGUMENT, "must be empty"),
        ([config(voice="nobody")], grpc.StatusCode.NOT_FOUND, "unknown speaker"),
        ([config(model="tts-1")], grpc.StatusCode.NOT_FOUND, "does not exist"),
        ([config(audio_encoding=7)], grpc.StatusCode.INVALID_ARGUMENT, "audio_encoding"),
        ([config(), text("One."), config()], grpc.StatusCode.INVALID_ARGUMENT, "only allowed in the first"),
    ],
)
async def test_protocol_and_config_errors_are_status_codes(requests, code, words):
    gw = build_gateway(CUSTOM, frames=2)
    async with serve_grpc(gw) as stub:
        call = stub.StreamingSynthesize(iter(requests))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in call:
                pass
    assert info.value.code() == code and words in info.value.details()
    assert gw.synth.admission.active == 0


async def test_a_failed_segment_ends_the_call_with_its_status():
    gw = build_gateway(CUSTOM, frames=2, error_before=NotFound("voice went away"))
    async with serve_grpc(gw) as stub:
        call = stub.StreamingSynthesize(iter([config(), text("One. Two.")]))
        msgs = []
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for m in call:
                msgs.append(m)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND and info.value.details() == "voice went away"
    assert len([m for m in msgs if m.HasField("segment_start")]) == 1 and len(gw.talker.jobs) == 1


async def test_admission_refusal_is_resource_exhausted():
    gw = build_gateway(CUSTOM, max_streams=1, frames=2)
    gw.synth.admission.admit()  # the one slot is taken
    async with serve_grpc(gw) as stub:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in stub.StreamingSynthesize(iter([config(), text("One.")])):
                pass
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_client_cancel_frees_every_slot():
    gw = build_gateway(CUSTOM, frames=500, chunk=1, delay_s=0.02)
    async with serve_grpc(gw) as stub:
        call = stub.StreamingSynthesize()
        await call.write(config())
        await call.write(text("A long sentence. "))
        assert (await call.read()).HasField("segment_start")
        assert (await call.read()).HasField("audio")
        assert gw.talker.active == 1
        call.cancel()
        for _ in range(100):
            if gw.talker.active == 0 and gw.synth.admission.active == 0:
                break
            await asyncio.sleep(0.02)
    assert gw.talker.active == 0 and gw.synth.admission.active == 0 and gw.talker.completed == 0
