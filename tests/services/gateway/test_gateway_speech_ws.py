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

from qtts.request.errors import NotFound
from services.gateway.text_stream import SegmentText, TextPiece, TextSplitter

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


def segments(splitter: TextSplitter, pieces: list[str], flush: bool = True) -> list[str]:
    """The segments the pieces make, text handed on as it came ("|" marks an open segment's end)."""
    out, cur = [], ""
    for piece in pieces:
        for p in splitter.feed(piece):
            cur += p.text
            if p.end:
                out.append(cur)
                cur = ""
    for p in splitter.flush() if flush else []:
        cur += p.text
        if p.end:
            out.append(cur)
            cur = ""
    return out + ([cur + "|"] if cur else [])


def test_splitter_hands_text_on_at_once_and_ends_segments_at_sentence_ends():
    s = TextSplitter("sentence")
    assert s.feed("Hello wor") == [TextPiece("Hello wor")]  # at once: the talker holds partial words
    assert s.feed("ld.") == [TextPiece("ld.")]
    assert s.feed(" It costs 3.") == [TextPiece("", end=True), TextPiece("It costs 3.")]
    assert s.feed("14 dollars! Re") == [TextPiece("14 dollars!", end=True), TextPiece("Re")]
    assert s.feed('ally? He said "no." ') == [
        TextPiece("ally?", end=True),
        TextPiece('He said "no."', end=True),
    ]
    assert segments(s, ["你好。再见"]) == ["你好。", "再见"]
    assert segments(TextSplitter("clause"), ["one, two; three"], flush=False) == ["one,", "two;", "three|"]
    assert segments(TextSplitter("none"), ["  One. Two. ", "Three  "]) == ["One. Two. Three  "]
    # Leading whitespace goes; a flush of nothing ends nothing.
    s = TextSplitter("none")
    assert s.feed("  ") == [] and s.feed(" Hi ") == [TextPiece("Hi ")] and not TextSplitter().open
    assert TextSplitter().flush() == [] and TextSplitter().granularity == "none"
    long = TextSplitter("none", max_chars=10)
    assert segments(long, ["one two three four five"]) == ["one two", "three four", "five"]
    with pytest.raises(ValueError):
        TextSplitter("word")


async def test_segment_text_starts_with_the_first_piece_and_streams_the_rest():
    seg = SegmentText()
    seg.append("Hello ")
    assert await seg.first() == "Hello "
    seg.append("there, ")
    seg.append("friend")
    rest = seg.rest()
    assert await anext(rest) == ("there, friend", False)  # what piled up comes in one piece
    seg.append(".")
    seg.close()
    assert await anext(rest) == (".", True)
    assert [p async for p in rest] == []


async def test_an_utterance_is_one_running_request_with_audio_before_its_text_is_complete():
    async with serve_http(build_gateway(frames=3, chunk=2)) as gw, connect(ws_url(gw)) as ws:
        await send(ws, "session.config", **CONFIG)
        await send(ws, "input.text", text="Hello ")
        await send(ws, "input.text", text="there. How")
        start = await recv_json(ws)
        assert (start["type"], start["sentence_index"], start["format"]) == ("audio.start", 0, "pcm")
        assert start["sentence_text"].startswith("Hello")
        assert (start["sample_rate"], start["channels"], start["utterance_index"]) == (24000, 1, 0)
        audio = b""
        while len(audio) < len(frame_pcm(0, 3)):  # before the rest of the text is sent
            audio += await asyncio.wait_for(ws.recv(), 5)
        assert audio == frame_pcm(0, 3)
        await send(ws, "input.text", text=" are you")
        await asyncio.sleep(0.05)
        assert len(gw.talker.jobs) == 1 and gw.talker.active == 1  # the request waits for its text
        await send(ws, "input.done")
        done = await recv_json(ws)
        assert done["type"] == "audio.done" and done["error"] is False and done["total_bytes"] == len(audio)
        assert done["sentence_text"] == "Hello there. How are you" and done["num_frames"] == 3
        end = await recv_json(ws)
        assert end == {
            "type": "session.done",
            "utterance_index": 0,
            "total_sentences": 1,
            "usage": {"input_tokens": 5, "output_tokens": 3, "total_tokens": 8},
        }
        # The session stays open for the next utterance: a request of its own.
        await send(ws, "input.text", text="Again.")
        await send(ws, "input.done")
        start, _, _ = await recv_segment(ws)
        assert (start["utterance_index"], start["sentence_index"]) == (1, 0)
        assert (await recv_json(ws))["type"] == "session.done"
        await send(ws, "session.close")
        with pytest.raises(ConnectionClosed) as info:
            await asyncio.wait_for(ws.recv(), 5)
        assert info.value.rcvd.code == 1000
    assert gw.talker.texts == ["Hello there. How are you", "Again."]
    assert gw.talker.streamed[0] is True
    assert [j.text for j in gw.talker.jobs][0].startswith("Hello")
    assert all(j.x_vector_only and j.reference_pcm is not None for j in gw.talker.jobs)
    assert gw.synth.admission.active == 0


async def test_sentence_granularity_makes_a_running_request_per_sentence():
    async with serve_http(build_gateway(frames=2, chunk=2)) as gw, connect(ws_url(gw)) as ws:
        await send(ws, "session.config", **CONFIG, split_granularity="sentence")
        await send(ws, "input.text", text="One. Tw")
        await send(ws, "input.text", text="o. Thr")
        await send(ws, "input.done")
        for index in range(3):
            start, audio, done = await recv_segment(ws)
            assert start["sentence_index"] == index and audio == frame_pcm(0, 2)
        assert (await recv_json(ws))["total_sentences"] == 3
    assert gw.talker.texts == ["One.", "Two.", "Thr"]


async def test_non_streaming_mode_sends_each_segment_whole():
    async with serve_http(build_gateway(frames=2)) as gw, connect(ws_url(gw)) as ws:
        await send(ws, "session.config", **CONFIG, non_streaming_mode=True)
        await send(ws, "input.text", text="All of it ")
        await asyncio.sleep(0.05)
        assert gw.talker.jobs == []  # the model is to see the whole text up front
        await send(ws, "input.text", text="at once.")
        await send(ws, "input.done")
        await recv_segment(ws)
        assert (await recv_json(ws))["type"] == "session.done"
    assert [(j.text, j.streaming_text) for j in gw.talker.jobs] == [("All of it at once.", False)]
    assert gw.talker.streamed == [False]


async def test_one_complete_file_per_segment_without_stream_audio():
    config = {**CONFIG, "response_format": "wav", "stream_audio": False, "sample_rate": 16000}
    async with serve_http(build_gateway(frames=4, chunk=1)) as gw, connect(ws_url(gw)) as ws:
        await send(ws, "session.config", **config, split_granularity="sentence")
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
        assert (await recv_json(ws))["type"] == "audio.start"  # its request starts at once
        assert await asyncio.wait_for(ws.recv(), 5) == frame_pcm(0, 2)
        await send(ws, "session.config", voice="ryan")
        assert "in progress" in (await recv_json(ws))["message"]
        await send(ws, "input.done")
        assert (await recv_json(ws))["type"] == "audio.done"
        assert (await recv_json(ws))["type"] == "session.done"
        await send(ws, "session.config", voice="ryan", response_format="pcm", stream_audio=True)
        await send(ws, "input.text", text="Now ryan.")
        await send(ws, "input.done")
        await recv_segment(ws)
        assert [j.voice for j in gw.talker.jobs] == ["vivian", "ryan"]
        assert gw.talker.texts == ["Half a", "Now ryan."]


async def test_a_failed_segment_is_an_error_event_and_the_next_one_still_plays():
    gw0 = build_gateway(CUSTOM, frames=2)
    async with serve_http(gw0) as gw, connect(ws_url(gw)) as ws:
        await send(ws, "session.config", voice="vivian", response_format="pcm", stream_audio=True)
        gw.talker.error_before = NotFound("voice went away")
        await send(ws, "input.text", text="First. ")  # the utterance's request fails
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
        await send(ws, "input.text", text="Second.")  # the same utterance goes on in a new request
        await send(ws, "input.done")
        start, audio, done = await recv_segment(ws)
        assert audio == frame_pcm(0, 2) and done["error"] is False and start["sentence_index"] == 1
        assert (await recv_json(ws))["total_sentences"] == 2
        assert gw.talker.texts == ["First. ", "Second."]  # as sent (the talker drops the last space)
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
        assert len(gw.talker.jobs) == 1 and gw.talker.texts[0].startswith("One.")
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
