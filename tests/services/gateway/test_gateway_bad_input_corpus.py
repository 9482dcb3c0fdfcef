"""The bad-input corpus (hostile_corpus.py) against the gateway's HTTP app on a real uvicorn server
and its tts.v1 servicer on a real grpc.aio server, with the fake talker and the real reference
decoder: every case gets its status and names its field (`param`; INVALID_ARGUMENT with a
google.rpc.BadRequest on gRPC), the same keep-alive connection (gRPC channel) serves a good
request after each, and good requests running alongside the whole corpus all come back whole.
tests/e2e/test_e2e_hostile.py runs the same corpus against the real processes."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json

import grpc
import hostile_corpus as corpus
import uvicorn
from gateway_fakes import BASE, FakeTalker, FakeVoiceStore, GatewayUnderTest, frame_pcm, free_port
from prometheus_client import CollectorRegistry

from qtts.pb import tts_pb2_grpc
from qtts.serving.grpc_server import ErrorMappingInterceptor
from qtts.serving.metrics import GatewayMetrics
from services.gateway.core import GatewayCore, decode_reference
from services.gateway.grpc_servicer import TextToSpeechServicer
from services.gateway.http_app import HttpDeps, create_app
from services.gateway.http_limits import header_timeout_protocol
from services.gateway.server import _UvicornServer
from services.gateway.stream_limits import StreamLimits
from services.gateway.validation import RequestLimits
from services.gateway.voices import VoiceService

GOOD_FRAMES = 3


def corpus_gateway() -> GatewayUnderTest:
    """The fake talker behind the corpus's limits and the real decoder (clip length and decoding)."""
    talker = FakeTalker(chunk=1)
    metrics = GatewayMetrics(CollectorRegistry())
    decode = functools.partial(decode_reference, max_seconds=corpus.MAX_REF_AUDIO_SECONDS)
    limits = RequestLimits(max_ref_audio_bytes=corpus.MAX_REF_AUDIO_BYTES)
    synth = GatewayCore(talker, lambda: BASE, limits, StreamLimits(16), metrics, decode=decode)
    store = FakeVoiceStore()
    voices = VoiceService(store, decode, lambda: BASE, corpus.MAX_REF_AUDIO_BYTES)
    return GatewayUnderTest(talker, store, synth, metrics, voices)


@contextlib.asynccontextmanager
async def serve_http(gw: GatewayUnderTest):
    async def stage_health():
        return {"talker": "SERVING", "speaker_cache": "SERVING"}

    app = create_app(
        HttpDeps(gw.synth, gw.voice_service, gw.metrics, stage_health, max_body_bytes=corpus.MAX_BODY_BYTES)
    )
    port = free_port()
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=port,
        log_level="warning",
        lifespan="off",
        http=header_timeout_protocol(10),
    )
    server = _UvicornServer(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield port
    finally:
        server.should_exit = True
        await task


GOOD_BODY = json.dumps({**corpus.GOOD_SPEECH, "max_new_tokens": GOOD_FRAMES}).encode()


async def good_requests_until(port: int, done: asyncio.Event) -> list[bytes]:
    """Good requests, one after another on their own connection, for as long as the corpus runs."""
    conn, bodies = await corpus.Http11.open(port), []
    try:
        while not done.is_set() or not bodies:
            status, _, body = await conn.request("POST", "/v1/audio/speech", GOOD_BODY)
            assert status == 200, body[:300]
            bodies.append(body)
    finally:
        conn.close()
    return bodies


def test_the_corpus_covers_the_issue():
    ids = [c.id for c in corpus.HTTP_CASES]
    assert len(ids) == len(set(ids)) >= 80
    assert set(corpus.ISSUE_HTTP_CASES) <= set(ids)
    grpc_ids = [c.id for c in corpus.GRPC_CASES]
    assert len(grpc_ids) == len(set(grpc_ids)) >= 40
    assert set(corpus.ISSUE_GRPC_CASES) <= set(grpc_ids)


async def test_http_corpus_each_named_on_a_connection_that_keeps_serving():
    gw = corpus_gateway()
    async with serve_http(gw) as port:
        done = asyncio.Event()
        alongside = asyncio.create_task(good_requests_until(port, done))
        conn = await corpus.Http11.open(port)
        failures = []
        try:
            for case in corpus.HTTP_CASES:
                status, headers, body = await conn.request(
                    case.method, case.path, case.body, case.content_type
                )
                error = json.loads(body).get("error", {}) if body.startswith(b"{") else {}
                if (status, error.get("param")) != (case.status, case.param) or not error.get("message"):
                    failures.append((case.id, status, body[:200]))
                if case.closes:
                    assert headers.get("connection") == "close", case.id
                    conn.close()
                    conn = await corpus.Http11.open(port)
                    continue
                assert conn.usable and headers.get("connection") != "close", case.id
                status, _, audio = await conn.request("POST", "/v1/audio/speech", GOOD_BODY)
                assert status == 200 and audio == frame_pcm(0, GOOD_FRAMES), case.id
        finally:
            conn.close()
            done.set()
        assert not failures, failures
        bodies = await alongside
    assert bodies and all(b == frame_pcm(0, GOOD_FRAMES) for b in bodies)
    # Only good requests reached the talker, and none is left holding a slot.
    assert {job.text for job in gw.talker.jobs} == {corpus.GOOD_SPEECH["input"]}
    assert gw.synth.admission.active == 0 and gw.talker.active == 0


@contextlib.asynccontextmanager
async def serve_grpc(gw: GatewayUnderTest):
    server = grpc.aio.server(interceptors=[ErrorMappingInterceptor(gw.metrics, redact=True)])
    tts_pb2_grpc.add_TextToSpeechServiceServicer_to_server(
        TextToSpeechServicer(gw.synth, gw.voice_service), server
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield channel
    finally:
        await server.stop(0)


GOOD_GRPC = corpus.synthesize(max_new_frames=GOOD_FRAMES)


async def good_synthesis(stub) -> bytes:
    msgs = [m async for m in stub.Synthesize(GOOD_GRPC, timeout=30)]
    assert msgs[-1].summary.num_frames == GOOD_FRAMES
    return b"".join(m.audio.audio for m in msgs if m.HasField("audio"))


async def test_grpc_corpus_invalid_argument_with_bad_request_naming_the_field():
    gw = corpus_gateway()
    async with serve_grpc(gw) as channel:
        stub = tts_pb2_grpc.TextToSpeechServiceStub(channel)
        done = asyncio.Event()

        async def alongside() -> list[bytes]:
            out = []
            while not done.is_set() or not out:
                out.append(await good_synthesis(stub))
            return out

        task = asyncio.create_task(alongside())
        failures = []
        try:
            for case in corpus.GRPC_CASES:
                exc = await corpus.call(channel, case.method, case.payloads)
                got = (exc.code(), exc.details()) if exc is not None else (grpc.StatusCode.OK, "")
                if got[0] != case.code or (case.param is not None and case.param not in got[1]):
                    failures.append((case.id, got[0], got[1][:200]))
                elif (
                    corpus.bad_request_field(exc) != case.field
                ):  # None: no BadRequest (not INVALID_ARGUMENT)
                    failures.append((case.id, "BadRequest field", corpus.bad_request_field(exc), case.field))
                elif len(got[1]) > 1100:
                    failures.append((case.id, "message of", len(got[1])))
                assert await good_synthesis(stub) == frame_pcm(0, GOOD_FRAMES), case.id
        finally:
            done.set()
        assert not failures, failures
        assert all(audio == frame_pcm(0, GOOD_FRAMES) for audio in await task)
    assert {job.text for job in gw.talker.jobs} == {"Hello."}
    assert gw.synth.admission.active == 0 and gw.talker.active == 0
