"""One request id through every hop: the gateway's HTTP front takes or makes X-Request-Id, the
gateway's talker client, the talker's code2wav client pass it as gRPC metadata, each server binds
it for the call, and each service's JSON log lines carry it."""

from __future__ import annotations

import asyncio
import io
import json
import logging

import httpx
from fastapi import FastAPI

from qtts.pb import code2wav_pb2, code2wav_pb2_grpc, talker_pb2, talker_pb2_grpc, tts_pb2
from qtts.request.vocabulary import SynthesisSummary
from qtts.serving.grpc_server import GrpcServiceHost, service_full_name
from qtts.serving.log_context import JsonFormatter, RequestIdFilter, current_request_id, log_handler
from services.gateway.job import SynthesisJob
from services.gateway.request_id import RequestIdMiddleware
from services.gateway.talker_client import TalkerClient
from services.talker.code2wav_client import DecodeCall
from tests.synthesis_jobs import talker_job

log_talker = logging.getLogger("test.talker")
log_code2wav = logging.getLogger("test.code2wav")


class Code2Wav(code2wav_pb2_grpc.Code2WavServiceServicer):
    def __init__(self):
        self.seen: list[str] = []

    async def Decode(self, request_iterator, context):
        async for _ in request_iterator:
            self.seen.append(current_request_id())
            log_code2wav.info("decode start")
            return
        yield  # pragma: no cover - makes this an async generator


class Talker(talker_pb2_grpc.TalkerServiceServicer):
    def __init__(self, code2wav_address: str):
        self.channel = None
        self.address = code2wav_address
        self.seen: list[str] = []

    async def Generate(self, request, context):
        self.seen.append(current_request_id())
        log_talker.info("generate %s", request.request_id)
        if self.channel is None:
            import grpc

            self.channel = grpc.aio.insecure_channel(self.address)
        # As the talker's stream does: the decode call is opened inside the request's task.
        decode = DecodeCall(code2wav_pb2_grpc.Code2WavServiceStub(self.channel), "c2w-0")
        await decode.start(request.request_id, 16, None, 1, ())
        await asyncio.sleep(0.1)
        yield talker_pb2.GenerateResponse(
            request_id=request.request_id,
            summary=talker_pb2.GenerateSummary(finish_reason=tts_pb2.FINISH_REASON_STOP),
        )


async def start(servicer, add, pb2, name) -> GrpcServiceHost:
    host = GrpcServiceHost(service_names=[service_full_name(pb2, name)], port=0)
    add(servicer, host.server)
    await host.start()
    await host.set_serving()
    return host


def job(request_id: str) -> SynthesisJob:
    return talker_job(request_id)


async def test_the_request_id_reaches_talker_and_code2wav_and_their_json_logs():
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(JsonFormatter("test"))
    for logger in (log_talker, log_code2wav):
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    c2w = Code2Wav()
    c2w_host = await start(
        c2w, code2wav_pb2_grpc.add_Code2WavServiceServicer_to_server, code2wav_pb2, "Code2WavService"
    )
    talker = Talker(f"127.0.0.1:{c2w_host.bound_port}")
    talker_host = await start(
        talker, talker_pb2_grpc.add_TalkerServiceServicer_to_server, talker_pb2, "TalkerService"
    )
    client = TalkerClient(f"127.0.0.1:{talker_host.bound_port}")
    try:
        events = [e async for e in client.generate(job("req-abc123"))]
        assert isinstance(events[-1], SynthesisSummary)
        for _ in range(50):
            if c2w.seen:
                break
            await asyncio.sleep(0.02)
        assert talker.seen == ["req-abc123"] and c2w.seen == ["req-abc123"]
        lines = [json.loads(line) for line in out.getvalue().splitlines()]
        assert {(line["logger"], line["request_id"]) for line in lines} == {
            ("test.talker", "req-abc123"),
            ("test.code2wav", "req-abc123"),
        }
        assert all(line["service"] == "test" and line["level"] == "INFO" for line in lines)
        # Outside any call nothing is bound.
        assert current_request_id() == ""
    finally:
        for logger in (log_talker, log_code2wav):
            logger.removeHandler(handler)
        await client.close()
        if talker.channel is not None:
            await talker.channel.close()
        await talker_host.stop(0)
        await c2w_host.stop(0)


def http_app() -> FastAPI:
    app = FastAPI()

    @app.get("/rid")
    async def rid():
        return {"request_id": current_request_id()}

    app.add_middleware(RequestIdMiddleware)
    return app


async def test_gateway_http_takes_a_clients_request_id_or_makes_one():
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=http_app()), base_url="http://gw") as c:
        r = await c.get("/rid", headers={"X-Request-Id": "client-42"})
        assert r.json() == {"request_id": "client-42"} and r.headers["x-request-id"] == "client-42"
        r = await c.get("/rid")
        made = r.json()["request_id"]
        assert made.startswith("req-") and r.headers["x-request-id"] == made
        for bad in ("has space", "x" * 200, "new\\nline"):
            r = await c.get("/rid", headers={"X-Request-Id": bad})
            assert r.json()["request_id"].startswith("req-"), bad


def test_log_handler_writes_text_or_one_json_object_per_line():
    record = logging.LogRecord("svc", logging.WARNING, __file__, 1, "hello %s", ("there",), None)
    for fmt in ("text", "json"):
        handler = log_handler(fmt, service="talker")
        stream = io.StringIO()
        handler.setStream(stream)
        handler.handle(record)
        line = stream.getvalue().strip()
        if fmt == "json":
            entry = json.loads(line)
            assert (entry["message"], entry["service"], entry["level"]) == (
                "hello there",
                "talker",
                "WARNING",
            )
            assert "request_id" not in entry
        else:
            assert line.endswith("WARNING svc: hello there")
