"""Streamed text costs its length and has bounds: the splitter is linear in its text, and a
WebSocket `input.text` / gRPC `input.text` piece or an utterance above its limit is refused
before any work (an error event naming `text`, the session goes on; INVALID_ARGUMENT naming
`input.text`)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time

import grpc
import pytest
from gateway_fakes import CUSTOM, build_gateway, frame_pcm, serve_http
from hostile_corpus import bad_request_field
from test_gateway_grpc import serve_grpc
from test_gateway_grpc_streaming import config, read_segment, text
from test_gateway_speech_ws import CONFIG, recv_json, recv_segment, send, ws_url
from websockets.asyncio.client import connect

from services.gateway.config import config_from_args
from services.gateway.text_stream import TextSplitter

PIECE, UTTERANCE = 50, 120


def bounded_gateway(**kw):
    gw = build_gateway(**kw)
    gw.synth.limits = dataclasses.replace(
        gw.synth.limits, max_text_piece_chars=PIECE, max_utterance_chars=UTTERANCE
    )
    return gw


def _split_seconds(granularity: str, chars: int) -> float:
    splitter = TextSplitter(granularity, max_chars=4096)
    text = ("word " * (chars // 5))[:chars]
    started = time.perf_counter()
    pieces = splitter.feed(text) + splitter.flush()
    elapsed = time.perf_counter() - started
    assert "".join(p.text + (" " if p.end else "") for p in pieces).split() == text.split()
    return elapsed


@pytest.mark.parametrize("granularity", ["none", "sentence"])
def test_the_splitter_costs_the_length_of_its_text_not_its_square(granularity):
    # A 4 MB piece cut into ~1,000 segments of --max-input-chars: the old splitter rescanned (and
    # copied) the rest of its buffer at every cut, about 2 GB of work; linear it is milliseconds.
    small, large = _split_seconds(granularity, 400_000), _split_seconds(granularity, 4_000_000)
    assert large < 2.0, f"{large:.2f} s for 4 MB"
    assert large < 30 * max(small, 1e-3), f"10x the text took {large / max(small, 1e-3):.0f}x the time"


def test_a_long_sentence_in_one_piece_is_cut_at_the_length_limit_before_its_end():
    # The old splitter took the sentence end first: one 48-character segment that validation
    # then refused as longer than --max-input-chars.
    s = TextSplitter("sentence", max_chars=12)
    pieces = s.feed("One. Two! " + "x" * 30 + " three four five six. End") + s.flush()
    assert [(p.text, p.end) for p in pieces] == [
        ("One.", True),
        ("Two!", True),
        ("x" * 12, True),
        ("x" * 12, True),
        ("xxxxxx three", True),
        ("four five", True),
        ("six.", True),
        ("End", False),
        ("", True),
    ]


def test_the_limits_are_settings_with_defaults_that_fit_each_other():
    cfg = config_from_args([])
    assert (cfg.max_text_piece_chars, cfg.max_utterance_chars) == (65536, 262144)
    assert cfg.ws_message_limit_bytes == cfg.body_limit_bytes  # room for a session.config with a clip
    assert config_from_args(["--ws-max-message-bytes", "1000"]).ws_message_limit_bytes == 1000
    with pytest.raises(Exception, match="max-text-piece-chars"):
        config_from_args(["--max-text-piece-chars", "10", "--max-utterance-chars", "5"])


async def next_event(ws, kind: str) -> dict:
    """The next JSON event of type `kind`, skipping audio and other events."""
    while True:
        msg = await asyncio.wait_for(ws.recv(), 5)
        if isinstance(msg, str) and (event := json.loads(msg))["type"] == kind:
            return event


async def test_websocket_refuses_an_overlong_piece_and_utterance_and_the_session_goes_on():
    gw = bounded_gateway(frames=2, chunk=2)
    async with serve_http(gw), connect(ws_url(gw), max_size=None) as ws:
        await send(ws, "session.config", **CONFIG)
        await send(ws, "input.text", text="x" * (PIECE + 1))
        err = await recv_json(ws)
        assert (err["type"], err["param"], err["code"]) == ("error", "text", "invalid_value")
        assert f"limit for one piece is {PIECE}" in err["message"]
        piece = "y" * (PIECE - 1) + " "
        for _ in range(3):
            await send(ws, "input.text", text=piece)
        err = await next_event(ws, "error")  # the third piece passes the utterance's bound
        assert err["param"] == "text" and f"limit is {UTTERANCE}" in err["message"]
        await send(ws, "input.text", text="\ud800 lone")
        err = await next_event(ws, "error")
        assert err["param"] == "text" and "surrogate" in err["message"]
        await send(ws, "input.done")
        done = await next_event(ws, "audio.done")
        assert done["error"] is False and done["sentence_text"] == 2 * piece  # without the refused ones
        assert (await recv_json(ws))["type"] == "session.done"
        # A new utterance has the whole budget again.
        for _ in range(2):
            await send(ws, "input.text", text="z" * (PIECE - 1))
        await send(ws, "input.done")
        start, audio, done = await recv_segment(ws)
        assert done["error"] is False and done["sentence_text"] == "z" * (2 * PIECE - 2)
        assert audio == frame_pcm(0, 2)


async def test_grpc_refuses_an_overlong_piece_with_invalid_argument_naming_input_text():
    gw = bounded_gateway(catalog=CUSTOM, frames=2, chunk=2)
    async with serve_grpc(gw) as stub:
        call = stub.StreamingSynthesize()
        await call.write(config())
        await call.write(text("x" * (PIECE + 1)))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call.read()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert bad_request_field(err.value) == "input.text"
        assert f"limit for one piece is {PIECE}" in err.value.details()


async def test_grpc_utterance_bound_resets_at_each_flush():
    gw = bounded_gateway(catalog=CUSTOM, frames=1, chunk=1)
    async with serve_grpc(gw) as stub:
        call = stub.StreamingSynthesize()
        await call.write(config())
        for _ in range(3):  # 3 utterances of 2 * 49 characters: each under the bound
            await call.write(text("a" * (PIECE - 1)))
            await call.write(text("a" * (PIECE - 1), flush=True))
            msgs = await read_segment(call)
            assert msgs[0].segment_start.text.startswith("a")
        for _ in range(3):  # one utterance of 3 * 49 characters: over it
            await call.write(text("b" * (PIECE - 1)))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            while True:
                await call.read()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert bad_request_field(err.value) == "input.text" and f"limit is {UTTERANCE}" in err.value.details()


async def test_websocket_refuses_a_message_too_long_for_a_piece_without_parsing_it(monkeypatch):
    gw = bounded_gateway(frames=1, chunk=1)
    parsed = []
    import services.gateway.speech_ws as speech_ws

    real_parse = speech_ws.parse_json
    monkeypatch.setattr(
        speech_ws, "parse_json", lambda raw, what: parsed.append(len(raw)) or real_parse(raw, what)
    )
    big = "w " * (6 * PIECE + 2048)  # over 12 characters a piece character and the room
    async with serve_http(gw), connect(ws_url(gw), max_size=None) as ws:
        await send(ws, "session.config", **CONFIG)
        await send(ws, "input.text", text=big)
        err = await recv_json(ws)
        assert err["param"] == "text" and "refused unread" in err["message"]
        assert f"limit for one piece is {PIECE} characters" in err["message"]
        await ws.send(json.dumps({"text": big, "type": "input.text"}))  # type last: no "session.config"
        assert "refused unread" in (await recv_json(ws))["message"]
        # A session.config may be that long (its clip): parsed, and held to its own rules.
        await ws.send(json.dumps({**CONFIG, "instructions": big}))
        err = await recv_json(ws)
        assert err["type"] == "error" and "refused unread" not in err["message"]
        assert len(parsed) == 2  # the two configs: the refused messages were never parsed
        await send(ws, "input.text", text="Still here.")
        await send(ws, "input.done")
        assert (await next_event(ws, "audio.done"))["error"] is False
