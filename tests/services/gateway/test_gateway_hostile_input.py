"""Hostile and broken request bodies: each is a 400 naming the field at fault, on a keep-alive
connection that goes on serving, and the fake talker never sees any of them."""

from __future__ import annotations

import base64
import contextlib
import json

import grpc
import httpx
import pytest
from gateway_fakes import build_gateway, frame_pcm, serve_http, wav_bytes
from test_gateway_grpc import serve_grpc

from qtts.pb import tts_pb2, tts_pb2_grpc
from qtts.request import request_limits as lim
from qtts.serving.grpc_server import ErrorMappingInterceptor
from services.gateway.grpc_servicer import TextToSpeechServicer

REF = base64.b64encode(wav_bytes()).decode()
GOOD = {
    "model": "tiny-base",
    "input": "Hello there.",
    "voice": "any",
    "ref_audio": REF,
    "x_vector_only_mode": True,
    "response_format": "pcm",
    "stream": False,
}


def raw(**kw) -> bytes:
    return json.dumps({**GOOD, **kw}).encode()


def spliced(field: str, literal: str) -> bytes:
    """A body with `field` set to a JSON literal json.dumps cannot write (a lone surrogate, ...)."""
    return raw(**{field: "@@"}).replace(b'"@@"', literal.encode())


# (case, body, param): param None where the body as a whole is at fault.
CASES = [
    ("temperature-huge", raw(temperature=3.5e38), "temperature"),
    ("temperature-denormal", raw(temperature=1e-45), "temperature"),
    ("temperature-below-min", raw(temperature=1e-4), "temperature"),
    ("temperature-negative", raw(temperature=-1), "temperature"),
    ("temperature-inf", spliced("temperature", "1e999"), "temperature"),
    ("temperature-nan", spliced("temperature", "NaN"), "temperature"),
    ("repetition_penalty-denormal", raw(repetition_penalty=1e-45), "repetition_penalty"),
    ("repetition_penalty-huge", raw(repetition_penalty=1e30), "repetition_penalty"),
    ("top_p-underflows-float32", raw(top_p=1e-46), "top_p"),
    ("top_p-above-1", raw(top_p=1.5), "top_p"),
    ("top_k-above-uint32", raw(top_k=2**33), "top_k"),
    ("top_k-negative", raw(top_k=-1), "top_k"),
    ("seed-above-int64", raw(seed=2**64), "seed"),
    ("seed-4300-digits", spliced("seed", "9" * 5000), None),
    ("min_new_tokens-above-uint32", raw(min_new_tokens=2**33), "min_new_tokens"),
    ("max_new_tokens-huge", raw(max_new_tokens=10**30), "max_new_tokens"),
    ("initial_codec_chunk_frames-huge", raw(initial_codec_chunk_frames=10**12), "initial_codec_chunk_frames"),
    ("nested-array", b'{"input":' + b"[" * 100_000 + b"]" * 100_000 + b"}", None),
    ("nested-object", b'{"extra_params":' + b'{"a":' * 5000 + b"1" + b"}" * 5001, None),
    ("surrogate-input", spliced("input", '"hi \\ud800 there"'), "input"),
    ("surrogate-voice", spliced("voice", '"\\udc00"'), "voice"),
    ("surrogate-ref_text", spliced("ref_text", '"a\\ud83d"'), "ref_text"),
    ("surrogate-instructions", spliced("instructions", '"\\udfff"'), "instructions"),
    ("control-only-input", raw(input="\x00\x01\x02\x7f\u200b\n\t"), "input"),
    ("input-too-long", raw(input="a" * (lim.TEXT_MAX_CHARS + 1)), "input"),
    ("ref_text-too-long", raw(ref_text="a" * 200_000, x_vector_only_mode=False), "ref_text"),
    ("instructions-too-long", raw(instructions="a" * 200_000), "instructions"),
    ("voice-too-long", raw(voice="a" * 200_000), "voice"),
    ("voice-id-too-long", raw(voice={"id": "a" * 200_000}), "voice"),
    ("speaker-too-long", raw(speaker="a" * 200_000), "speaker"),
    ("model-too-long", raw(model="a" * 200_000), "model"),
    ("language-too-long", raw(language="a" * 200_000), "language"),
    ("task_type-too-long", raw(task_type="a" * 200_000), "task_type"),
    ("speaker_embedding-huge", raw(speaker_embedding=[[0.5] * 100] * 1000), "speaker_embedding"),
    ("bad-utf8", b'{"input": "\xff\xfe"}', None),
    ("not-an-object", b"[1, 2]", None),
]


async def test_every_hostile_body_is_a_400_naming_its_field_on_a_connection_that_keeps_serving():
    gw = build_gateway(frames=2)
    # One connection for everything: a 4xx must leave it usable for the next request.
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    async with serve_http(gw) as gw, httpx.AsyncClient(base_url=gw.url, limits=limits, timeout=30) as c:
        for case, body, param in CASES:
            r = await c.post("/v1/audio/speech", content=body, headers={"content-type": "application/json"})
            assert r.status_code == 400, (case, r.status_code, r.text[:300])
            error = r.json()["error"]
            assert error["type"] == "invalid_request_error" and error["param"] == param, (case, error)
            assert r.headers.get("connection") != "close", case
            good = await c.post("/v1/audio/speech", json={**GOOD, "max_new_tokens": 2})
            assert good.status_code == 200 and good.content == frame_pcm(0, 2), case
    assert len(gw.talker.jobs) == len(CASES)  # only the good requests reached the talker


async def test_extremes_of_the_declared_ranges_are_accepted():
    gw = build_gateway(frames=2)
    edges = [
        {"temperature": 0},
        {"temperature": lim.TEMPERATURE_MIN},
        {"temperature": lim.TEMPERATURE_MAX},
        {"top_p": lim.TOP_P_MIN},
        {"top_k": lim.TOP_K_MAX},
        {"repetition_penalty": lim.REPETITION_PENALTY_MIN},
        {"repetition_penalty": lim.REPETITION_PENALTY_MAX},
        {"seed": -(2**63)},
        {"min_new_tokens": 2},
    ]
    async with serve_http(gw) as gw, httpx.AsyncClient(base_url=gw.url) as c:
        for kw in edges:
            r = await c.post("/v1/audio/speech", json={**GOOD, **kw})
            assert r.status_code == 200, (kw, r.text)
    assert gw.talker.jobs[0].sampling.greedy


def grpc_request(**kw) -> tts_pb2.SynthesizeRequest:
    sampling = kw.pop("sampling", None)
    streaming = kw.pop("streaming", None)
    fields = {"text": "Hello.", "reference_audio": wav_bytes(), "x_vector_only": True, **kw}
    msg = tts_pb2.SynthesizeRequest(**fields)
    if sampling:
        msg.sampling.CopyFrom(tts_pb2.SamplingParams(**sampling))
    if streaming:
        msg.streaming.CopyFrom(tts_pb2.StreamingOptions(**streaming))
    return msg


GRPC_CASES = [
    ({"sampling": {"temperature": 3.5e38}}, "temperature"),
    ({"sampling": {"temperature": 1e-45}}, "temperature"),
    ({"sampling": {"repetition_penalty": 1e-45}}, "repetition_penalty"),
    ({"sampling": {"top_p": 1e-40}}, "top_p"),
    ({"sampling": {"top_k": 2**32 - 1}}, "top_k"),
    ({"sampling": {"seed": 2**64 - 1}}, "seed"),
    ({"sampling": {"min_new_frames": 2**32 - 1}}, "min_new_tokens"),
    ({"text": "\x00\x01\x02"}, "input"),
    ({"text": "a" * (lim.TEXT_MAX_CHARS + 1)}, "input"),
    ({"reference_text": "a" * 200_000, "x_vector_only": False}, "ref_text"),
    ({"instructions": "a" * 200_000}, "instructions"),
    ({"voice": "a" * 200_000}, "voice"),
    ({"request_id": "a" * 200_000}, "request_id"),
    ({"language": "a" * 200_000}, "language"),
    ({"streaming": {"chunk_frames_ramp": [1] * 1000}}, "chunk_frames_ramp"),
    ({"streaming": {"chunk_frames_ramp": [0]}}, "chunk_frames_ramp"),
    ({"streaming": {"first_chunk_frames": 2**32 - 1}}, "first_chunk_frames"),
]


@pytest.mark.parametrize("kw, param", GRPC_CASES, ids=[p for _, p in GRPC_CASES])
async def test_grpc_out_of_range_fields_are_invalid_argument_naming_the_field(kw, param):
    gw = build_gateway(frames=2)
    async with serve_grpc(gw) as stub:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in stub.Synthesize(grpc_request(**kw)):
                pass
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert param in info.value.details()
        msgs = [m async for m in stub.Synthesize(grpc_request(max_new_frames=2))]
        assert msgs[-1].summary.num_frames == 2
    assert len(gw.talker.jobs) == 1


@contextlib.asynccontextmanager
async def grpc_channel(gw):
    server = grpc.aio.server(interceptors=[ErrorMappingInterceptor(gw.metrics)])
    servicer = TextToSpeechServicer(gw.synth, gw.voice_service)
    tts_pb2_grpc.add_TextToSpeechServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield channel
    await server.stop(0)


@pytest.mark.parametrize("method", ["Synthesize", "StreamingSynthesize", "GetVoice"])
@pytest.mark.parametrize(
    "payload", [b"\xff\xff\xff", b"\x0a\x05\xc3\x28\xc3\x28\x00"], ids=["junk", "bad-utf8"]
)
async def test_bad_protobuf_is_invalid_argument_and_the_server_keeps_serving(method, payload):
    gw = build_gateway(frames=2)
    async with grpc_channel(gw) as channel:
        path = f"/tts.v1.TextToSpeechService/{method}"
        with pytest.raises(grpc.aio.AioRpcError) as info:
            if method == "Synthesize":
                async for _ in channel.unary_stream(path)(payload):
                    pass
            elif method == "StreamingSynthesize":
                async for _ in channel.stream_stream(path)(iter([payload])):
                    pass
            else:
                await channel.unary_unary(path)(payload)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value
        assert "protobuf" in info.value.details()
        stub = tts_pb2_grpc.TextToSpeechServiceStub(channel)
        msgs = [m async for m in stub.Synthesize(grpc_request(max_new_frames=2))]
        assert msgs[-1].summary.num_frames == 2
