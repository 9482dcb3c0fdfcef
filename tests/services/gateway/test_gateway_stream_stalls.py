"""Listeners that never read, over gRPC and the WebSocket: a response write that does not complete
within the write timeout ends that stream and frees its admission slot (as HTTP's
--http-write-timeout-s does for a streamed response); nobody else waits."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import time

import grpc
import uvicorn
from gateway_fakes import build_gateway, free_port, wav_bytes
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from qtts.pb import tts_pb2, tts_pb2_grpc
from qtts.serving.grpc_server import ErrorMappingInterceptor
from services.gateway.grpc_servicer import TextToSpeechServicer
from services.gateway.http_app import HttpDeps, create_app
from services.gateway.server import _UvicornServer

TIMEOUT_S = 0.5
# No BDP probing: the flow-control window stays small, so a client that reads nothing stalls
# the server's writes soon.
SMALL_WINDOW = [("grpc.http2.bdp_probe", 0)]


def flooding_gateway():
    # One slot, and a talker that would go on for a long time in big chunks.
    return build_gateway(max_streams=1, frames=100_000, chunk=100, delay_s=0.001)


async def freed(gw, within_s: float = 10.0) -> float:
    start = time.monotonic()
    while (gw.synth.admission.active or gw.talker.active) and time.monotonic() - start < within_s:
        await asyncio.sleep(0.05)
    assert gw.synth.admission.active == 0 and gw.talker.active == 0
    return time.monotonic() - start


@contextlib.asynccontextmanager
async def serve_grpc(gw, write_timeout_s: float):
    server = grpc.aio.server(interceptors=[ErrorMappingInterceptor(gw.metrics)], options=SMALL_WINDOW)
    servicer = TextToSpeechServicer(gw.synth, gw.voice_service, write_timeout_s=write_timeout_s)
    tts_pb2_grpc.add_TextToSpeechServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=SMALL_WINDOW) as channel:
        yield tts_pb2_grpc.TextToSpeechServiceStub(channel)
    await server.stop(0)


def synthesis(**kw) -> tts_pb2.SynthesizeRequest:
    return tts_pb2.SynthesizeRequest(
        **{"text": "Hello.", "reference_audio": wav_bytes(), "x_vector_only": True, **kw}
    )


async def assert_cancelled_for_not_reading(call) -> None:
    # What was sent before the stall is still there to read; then the status.
    with contextlib.suppress(grpc.aio.AioRpcError):
        async for _ in call:
            pass
    assert await asyncio.wait_for(call.code(), 10) == grpc.StatusCode.CANCELLED
    assert "took no audio" in await call.details()


async def test_a_grpc_synthesize_caller_that_never_reads_loses_its_stream_and_slot():
    gw = flooding_gateway()
    async with serve_grpc(gw, TIMEOUT_S) as stub:
        call = stub.Synthesize(synthesis())  # and reads nothing
        await asyncio.sleep(0.2)
        assert gw.synth.admission.active == 1
        await freed(gw)
        # The slot is free for the next caller.
        gw.talker.frames, gw.talker.chunk = 2, 1
        done = [m async for m in stub.Synthesize(synthesis())]
        assert done[-1].HasField("summary")
        await assert_cancelled_for_not_reading(call)


async def test_a_grpc_streaming_synthesize_caller_that_never_reads_loses_its_stream_and_slot():
    gw = flooding_gateway()
    async with serve_grpc(gw, TIMEOUT_S) as stub:
        call = stub.StreamingSynthesize()
        config = tts_pb2.StreamingSynthesizeConfig(synthesis=synthesis(text=""))
        await call.write(tts_pb2.StreamingSynthesizeRequest(streaming_config=config))
        await call.write(
            tts_pb2.StreamingSynthesizeRequest(
                input=tts_pb2.StreamingSynthesisInput(text="Hello.", flush=True)
            )
        )
        await asyncio.sleep(0.2)
        assert gw.synth.admission.active == 1
        await freed(gw)
        await assert_cancelled_for_not_reading(call)


async def test_no_write_timeout_keeps_a_slow_grpc_reader():
    gw = flooding_gateway()
    async with serve_grpc(gw, 0.0) as stub:
        call = stub.Synthesize(synthesis())
        await asyncio.sleep(1.5)
        assert gw.synth.admission.active == 1  # held: no rule without a timeout
        call.cancel()
        await freed(gw)


@contextlib.asynccontextmanager
async def serve_http(gw, write_timeout_s: float):
    async def stage_health():
        return {"talker": "SERVING", "speaker_cache": "SERVING"}

    app = create_app(
        HttpDeps(gw.synth, gw.voice_service, gw.metrics, stage_health, write_timeout_s=write_timeout_s)
    )
    port = free_port()
    server = _UvicornServer(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    )
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield f"ws://127.0.0.1:{port}/v1/audio/speech/stream"
    finally:
        server.should_exit = True
        await task


CONFIG = {
    "type": "session.config",
    "ref_audio": base64.b64encode(wav_bytes()).decode(),
    "x_vector_only_mode": True,
    "response_format": "pcm",
    "stream_audio": True,
}


async def test_a_websocket_listener_that_never_reads_loses_its_stream_and_slot():
    gw = flooding_gateway()
    async with serve_http(gw, TIMEOUT_S) as url:
        async with connect(url, max_queue=1, compression=None) as ws:
            await ws.send(json.dumps(CONFIG))
            await ws.send(json.dumps({"type": "input.text", "text": "Hello."}))
            await ws.send(json.dumps({"type": "input.done"}))  # and reads nothing
            await asyncio.sleep(0.2)
            assert gw.synth.admission.active == 1
            await freed(gw)
            # Reading now: what was buffered, then the server's close with a policy code.
            with contextlib.suppress(ConnectionClosed):
                while True:
                    await asyncio.wait_for(ws.recv(), 20)
            assert ws.close_code == 1008, ws.close_code
        # The slot is free for the next client.
        gw.talker.frames, gw.talker.chunk = 2, 1
        async with connect(url) as ws:
            await ws.send(json.dumps(CONFIG))
            await ws.send(json.dumps({"type": "input.text", "text": "Hi."}))
            await ws.send(json.dumps({"type": "input.done"}))
            kinds = []
            while "session.done" not in kinds:
                msg = await asyncio.wait_for(ws.recv(), 5)
                if isinstance(msg, str):
                    kinds.append(json.loads(msg)["type"])
            assert kinds[0] == "audio.start" and "audio.done" in kinds
