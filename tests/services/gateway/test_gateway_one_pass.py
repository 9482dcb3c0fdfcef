"""Every transport converts its input to the one typed request (`SpeechFields`) and hands it to
`GatewayCore.validate` the same way: once per request, once per streamed session before its
text (text None) and once per segment, over real servers with a fake talker."""

from __future__ import annotations

import asyncio
import json

import grpc
import httpx
from gateway_fakes import CUSTOM, build_gateway, serve_http
from test_gateway_grpc import serve_grpc
from test_gateway_grpc_streaming import config, read_segment, text
from websockets.asyncio.client import connect

from qtts.pb import tts_pb2
from services.gateway.job import SpeechFields


def spied(gw) -> list[SpeechFields]:
    """The typed requests `gw`'s core validates, in order."""
    seen: list[SpeechFields] = []
    validate = gw.synth.validate

    def spy(fields: SpeechFields):
        assert isinstance(fields, SpeechFields)
        seen.append(fields)
        return validate(fields)

    gw.synth.validate = spy
    return seen


async def test_http_and_batch_validate_each_request_once():
    gw = build_gateway(CUSTOM, frames=2)
    seen = spied(gw)
    async with serve_http(gw), httpx.AsyncClient(base_url=gw.url) as c:
        r = await c.post(
            "/v1/audio/speech", json={"input": " Hi. ", "voice": "ryan", "response_format": "pcm"}
        )
        assert r.status_code == 200, r.text
        assert [(f.text, f.voice) for f in seen] == [(" Hi. ", "ryan")]
        seen.clear()
        r = await c.post(
            "/v1/audio/speech/batch", json={"voice": "vivian", "items": [{"input": "A."}, {"input": "B."}]}
        )
        assert r.json()["succeeded"] == 2, r.text
    assert sorted((f.text, f.voice) for f in seen) == [("A.", "vivian"), ("B.", "vivian")]
    assert gw.talker.jobs[0].text == "Hi."  # as checked: stripped


async def test_grpc_validates_a_request_once_and_a_stream_per_session_and_segment():
    gw = build_gateway(CUSTOM, frames=2)
    seen = spied(gw)
    async with serve_grpc(gw) as stub:
        msgs = [m async for m in stub.Synthesize(tts_pb2.SynthesizeRequest(text="Hi.", voice="ryan"))]
        assert msgs[-1].HasField("summary")
        assert [(f.text, f.voice, f.text_follows) for f in seen] == [("Hi.", "ryan", False)]
        seen.clear()
        call = stub.StreamingSynthesize()
        await call.write(config(request_id="s"))
        await call.write(text("One "))
        await call.write(text("two.", flush=True))
        await call.done_writing()
        await read_segment(call)
        assert await call.code() == grpc.StatusCode.OK
    session, segment = seen
    assert (session.text, session.voice) == (None, "vivian")
    assert segment.request_id == "s-0" and segment.text.startswith("One")


async def test_websocket_validates_the_session_once_and_each_segment_once():
    gw = build_gateway(CUSTOM, frames=2)
    seen = spied(gw)
    async with serve_http(gw):
        url = gw.url.replace("http://", "ws://") + "/v1/audio/speech/stream"
        async with connect(url) as ws:
            await ws.send(json.dumps({"type": "session.config", "voice": "ryan", "response_format": "pcm"}))
            await ws.send(json.dumps({"type": "input.text", "text": "Hello "}))
            await ws.send(json.dumps({"type": "input.done"}))
            while (msg := await asyncio.wait_for(ws.recv(), 5)) and not (
                isinstance(msg, str) and json.loads(msg)["type"] == "session.done"
            ):
                pass
    session, segment = seen
    assert (session.text, session.voice) == (None, "ryan")
    assert segment.text.startswith("Hello") and segment.request_id.endswith("-u0-s0")
