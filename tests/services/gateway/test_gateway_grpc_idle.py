"""gRPC StreamingSynthesize closes a call whose client goes quiet, as the WebSocket closes such a
session (--stream-idle-timeout-s): config and one piece, then silence, frees the talker slot; a
call whose segment is still being synthesised is not idle."""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc
from gateway_fakes import CUSTOM, build_gateway
from test_gateway_grpc_streaming import config, text

from qtts.pb import tts_pb2_grpc
from qtts.serving.grpc_server import ErrorMappingInterceptor
from services.gateway.grpc_servicer import TextToSpeechServicer

IDLE_S = 0.4


@contextlib.asynccontextmanager
async def serve(gw, idle_timeout_s: float = IDLE_S):
    server = grpc.aio.server(interceptors=[ErrorMappingInterceptor(gw.metrics)])
    servicer = TextToSpeechServicer(gw.synth, gw.voice_service, idle_timeout_s=idle_timeout_s)
    tts_pb2_grpc.add_TextToSpeechServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield tts_pb2_grpc.TextToSpeechServiceStub(channel)
    await server.stop(0)


async def _status_after(call) -> tuple[grpc.StatusCode, float]:
    started = time.monotonic()
    with contextlib.suppress(grpc.aio.AioRpcError):
        while await asyncio.wait_for(call.read(), 10) is not grpc.aio.EOF:
            pass
    return await call.code(), time.monotonic() - started


async def test_a_call_silent_after_one_piece_is_closed_and_its_slot_freed():
    gw = build_gateway(CUSTOM, frames=2, chunk=2)
    async with serve(gw) as stub:
        call = stub.StreamingSynthesize()
        await call.write(config())
        await call.write(text("Hello, and then"))  # the segment waits for more text
        code, waited = await _status_after(call)
        assert code == grpc.StatusCode.CANCELLED and "no message within" in await call.details()
        assert waited < IDLE_S + 2
        assert gw.talker.active == 0 and gw.synth.admission.active == 0


async def test_a_call_that_never_sends_its_config_is_closed():
    gw = build_gateway(CUSTOM)
    async with serve(gw) as stub:
        call = stub.StreamingSynthesize()
        code, _ = await _status_after(call)
        assert code == grpc.StatusCode.CANCELLED and "no message within" in await call.details()


async def test_a_segment_being_synthesised_is_not_idle():
    # 6 chunks of 0.2 s: synthesis outlasts the idle timeout while the client sends nothing.
    gw = build_gateway(CUSTOM, frames=6, chunk=1, delay_s=0.2)
    async with serve(gw) as stub:
        call = stub.StreamingSynthesize()
        await call.write(config())
        await call.write(text("Hello.", flush=True))
        audio = 0
        started = time.monotonic()
        while (msg := await asyncio.wait_for(call.read(), 10)) is not grpc.aio.EOF:
            audio += msg.HasField("audio")
            if msg.HasField("segment_summary"):
                break
        assert audio == 6 and time.monotonic() - started > IDLE_S
        await call.done_writing()
        while await asyncio.wait_for(call.read(), 10) is not grpc.aio.EOF:
            pass
        assert await call.code() == grpc.StatusCode.OK
