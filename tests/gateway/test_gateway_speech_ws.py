"""WebSocket /v1/audio/speech/stream (vLLM-Omni's protocol) on a real uvicorn server, fake talker."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import wave

import pytest
from gateway_fakes import CUSTOM, build_gateway, frame_pcm, serve_http, wav_bytes
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from qtts.errors import NotFound
from services.gateway.text_stream import TextSplitter

REF = base64.b64encode(wav_bytes()).decode()
CONFIG = {
    "type": "session.config",
    "ref_audio": REF,
    "x_vector_only_mode": True,
    "response_format": "pcm",
    "stream_audio": True,
}


def ws_url(gw) -> str:
    return gw.url.replace("http://", "ws://") + "/v1/audio/speech/stream"


async def recv_json(ws) -> dict:
    msg = await asyncio.wait_for(ws.recv(), 5)
    assert isinstance(msg, str), f"expected a JSON event, got {len(msg)} audio bytes"
    return json.loads(msg)


async def recv_segment(ws) -> tuple[dict, bytes, dict]:
    """audio.start, the binary frames, audio.done of one segment."""
    start = await recv_json(ws)
    assert start["type"] == "audio.start", start
    audio = b""
    while isinstance(msg := await asyncio.wait_for(ws.recv(), 5), bytes):
        audio += msg
    return start, audio, json.loads(msg)


async def send(ws, kind: str, **kw) -> None:
    await ws.send(json.dumps({"type": kind, **kw}))


def test_splitter_cuts_at_sentence_ends_only_when_complete():
    s = TextSplitter("sentence")
    assert s.feed("Hello world") == [] and s.feed(".") == [] and s.feed(" It costs 3.") == ["Hello world."]
    assert s.feed("14 dollars! Re") == ["It costs 3.14 dollars!"]
    assert s.feed('ally? He said "no." ') == ["Really?", 'He said "no."']
    assert s.feed("你好。再见") == ["你好。"] and s.flush() == ["再见"] and s.flush() == []
    assert TextSplitter("clause").feed("one, two; three") == ["one,", "two;"]
    assert TextSplitter("none").feed("One. Two. ") == []
    long = TextSplitter("none", max_chars=10)
    assert long.feed("one two three four five") == ["one two", "three four"] and long.flush() == ["five"]
    with pytest.raises(ValueError):
        TextSplitter("word")


async def test_text_in_pieces_gets_audio_before_the_text_is_complete():
    async with serve_http(build_gateway(frames=3, chunk=2)) as gw, connect(ws_url(gw)) as ws:
        await send(ws, "session.config", **CONFIG)
        await send(ws, "input.text", text="Hello ")
        await send(ws, "input.text", text="there. How")
        start, audio, done = await recv_segment(ws)  # the first sentence, before the rest is sent
        assert (start["sentence_index"], start["sentence_text"], start["format"]) == (
            0,
            "Hello there.",
            "pcm",
        )
        assert (start["sample_rate"], start["channels"], start["utterance_index"]) == (24000, 1, 0)
        assert audio == frame_pcm(0, 3) and done["total_bytes"] == len(audio) and done["error"] is False
        assert done["finish_reason"] == "length" and done["num_frames"] == 3
        await send(ws, "input.text", text=" are you")
        await asyncio.sleep(0.05)
        assert len(gw.talker.jobs) == 1  # no sentence end yet: nothing new to synthesise
        await send(ws, "input.done")
        start, audio, done = await recv_segment(ws)
        assert (start["sentence_index"], start["sentence_text"]) == (1, "How are you")
        end = await recv_json(ws)
        assert end == {
            "type": "session.done",
            "utterance_index": 0,
            "total_sentences": 2,
            "usage": {"input_tokens": 5, "output_tokens": 6, "total_tokens": 11},
        }
        # The session stays open for the next utterance.
        await send(ws, "input.text", text="Again.")
        await send(ws, "input.done")
        start, _, _ = await recv_segment(ws)
        assert (start["utterance_index"], start["sentence_index"]) == (1, 0)
        assert (await recv_json(ws))["type"] == "session.done"
        await send(ws, "session.close")
        with pytest.raises(ConnectionClosed) as info:
            await asyncio.wait_for(ws.recv(), 5)
        assert info.value.rcvd.code == 1000
    assert [j.text for j in gw.talker.jobs] == ["Hello there.", "How are you", "Again."]
    assert all(j.x_vector_only and j.reference_pcm is not None for j in gw.talker.jobs)
    assert gw.synth.admission.active == 0


async def test_one_complete_file_per_sentence_without_stream_audio():
    config = {**CONFIG, "response_format": "wav", "stream_audio": False, "sample_rate": 16000}
    async with serve_http(build_gateway(frames=4, chunk=1)) as gw, connect(ws_url(gw)) as ws:
        await send(ws, "session.config", **config)
        await send(ws, "input.text", text="One. Two.")
        await send(ws, "session.close")  # finishes what was sent, then closes
        for index in range(2):
            start = await recv_json(ws)
            assert (start["sentence_index"], start["sample_rate"]) == (index, 16000)
            data = await asyncio.wait_for(ws.recv(), 5)
            with wave.open(io.BytesIO(data)) as w:
                assert w.getframerate() == 16000 and abs(w.getnframes() - 4 * 1280) <= 2
            assert (await recv_json(ws))["type"] == "audio.done"
        assert (await recv_json(ws))["total_sentences"] == 2
        with pytest.raises(ConnectionClosed):
            await asyncio.wait_for(ws.recv(), 5)


async def test_config_errors_name_the_field_and_a_bad_first_message_closes():
    async with serve_http(build_gateway(CUSTOM, frames=2)) as gw:
        async with connect(ws_url(gw)) as ws:
            await send(ws, "input.text", text="hi")
            err = await recv_json(ws)
            assert err["type"] == "error" and "session.config" in err["message"] and err["param"] == "type"
            with pytest.raises(ConnectionClosed) as info:
                await asyncio.wait_for(ws.recv(), 5)
            assert info.value.rcvd.code == 1008
        for bad, param, code in (
            ({"speed": 9}, "speed", "invalid_value"),
            ({"voice": "nobody"}, "voice", "not_found"),
            ({"bogus": 1}, "bogus", "invalid_value"),
            ({"word_timestamps": True}, "word_timestamps", "invalid_value"),
            ({"response_format": "mulaw", "sample_rate": 16000}, "sample_rate", "invalid_value"),
        ):
            async with connect(ws_url(gw)) as ws:
                await send(ws, "session.config", **{"voice": "vivian", **bad})
                err = await recv_json(ws)
                assert (err["type"], err["param"], err["code"]) == ("error", param, code), (bad, err)
        assert gw.talker.jobs == []


async def test_bad_messages_after_config_keep_the_session():
    async with serve_http(build_gateway(CUSTOM, frames=2)) as gw, connect(ws_url(gw)) as ws:
        await send(ws, "session.config", voice="vivian", response_format="pcm", stream_audio=True)
        await ws.send("{not json")
        assert "not valid JSON" in (await recv_json(ws))["message"]
        await ws.send(b"\x00\x01")
        assert "binary" in (await recv_json(ws))["message"]
        await send(ws, "input.speak", text="x")
        assert "unknown message type" in (await recv_json(ws))["message"]
        await send(ws, "input.text", text=5)
        assert (await recv_json(ws))["param"] == "text"
        await send(ws, "input.text", text="Half a")
        await send(ws, "session.config", voice="ryan")
        assert "in progress" in (await recv_json(ws))["message"]
        await send(ws, "input.done")
        _, audio, _ = await recv_segment(ws)
        assert audio == frame_pcm(0, 2) and (await recv_json(ws))["type"] == "session.done"
        await send(ws, "session.config", voice="ryan", response_format="pcm", stream_audio=True)
        await send(ws, "input.text", text="Now ryan.")
        await send(ws, "input.done")
        await recv_segment(ws)
        assert [(j.text, j.voice) for j in gw.talker.jobs] == [("Half a", "vivian"), ("Now ryan.", "ryan")]


async def test_a_failed_segment_is_an_error_event_and_the_next_one_still_plays():
    gw0 = build_gateway(CUSTOM, frames=2)
    async with serve_http(gw0) as gw, connect(ws_url(gw)) as ws:
        await send(ws, "session.config", voice="vivian", response_format="pcm", stream_audio=True)
        gw.talker.error_before = NotFound("voice went away")
        await send(ws, "input.text", text="First. ")
        start = await recv_json(ws)
        err = await recv_json(ws)
        assert (start["type"], err["type"], err["code"], err["sentence_index"]) == (
            "audio.start",
            "error",
            "not_found",
            0,
        )
        assert err["message"] == "voice went away" and "partial_audio" not in err
        done = await recv_json(ws)
        assert done["type"] == "audio.done" and done["error"] is True and done["total_bytes"] == 0
        gw.talker.error_before = None
        await send(ws, "input.text", text="Second.")
        await send(ws, "input.done")
        _, audio, done = await recv_segment(ws)
        assert audio == frame_pcm(0, 2) and done["error"] is False
        assert (await recv_json(ws))["total_sentences"] == 2
        assert gw.synth.admission.active == 0


async def test_cancel_cuts_the_segment_in_flight_and_drops_the_queue():
    gw0 = build_gateway(CUSTOM, frames=200, chunk=1, delay_s=0.02)
    async with serve_http(gw0) as gw, connect(ws_url(gw)) as ws:
        await send(ws, "session.config", voice="vivian", response_format="pcm", stream_audio=True)
        await send(ws, "input.text", text="One. Two. Three. Four")
        assert (await recv_json(ws))["type"] == "audio.start"
        assert isinstance(await asyncio.wait_for(ws.recv(), 5), bytes)
        await send(ws, "input.cancel")
        while isinstance(msg := await asyncio.wait_for(ws.recv(), 5), bytes):
            pass
        done = json.loads(msg)
        assert done["type"] == "audio.done" and done["cancelled"] is True and done["sentence_index"] == 0
        end = await recv_json(ws)
        assert (end["type"], end["cancelled"], end["utterance_index"]) == ("session.done", True, 0)
        assert gw.talker.active == 0 and gw.synth.admission.active == 0
        assert [j.text for j in gw.talker.jobs] == ["One."]
        # The session goes on with the next utterance.
        gw.talker.frames, gw.talker.delay_s = 2, 0.0
        await send(ws, "input.text", text="Fresh.")
        await send(ws, "input.done")
        start, audio, _ = await recv_segment(ws)
        assert (start["utterance_index"], start["sentence_text"], audio) == (1, "Fresh.", frame_pcm(0, 2))


async def test_client_disconnect_frees_every_slot():
    gw0 = build_gateway(CUSTOM, frames=500, chunk=1, delay_s=0.02)
    async with serve_http(gw0) as gw:
        async with connect(ws_url(gw)) as ws:
            await send(ws, "session.config", voice="vivian", response_format="pcm", stream_audio=True)
            await send(ws, "input.text", text="A long sentence. Another one.")
            await recv_json(ws)
            await asyncio.wait_for(ws.recv(), 5)
            assert gw.talker.active == 1
        for _ in range(100):
            if gw.talker.active == 0 and gw.synth.admission.active == 0:
                break
            await asyncio.sleep(0.02)
        assert gw.talker.active == 0 and gw.synth.admission.active == 0
        assert gw.talker.completed == 0 and len(gw.talker.jobs) == 1
