"""`instructions` honoured where the variant takes them, else refused naming the field, or (with
--unsupported-instructions ignore) dropped and reported: HTTP, gRPC, and the policy itself."""

from __future__ import annotations

import base64
import dataclasses

import grpc
import httpx
import pytest
from gateway_fakes import BASE, CUSTOM, DESIGN, build_gateway, serve_http, wav_bytes
from test_gateway_grpc import request, serve_grpc

from qtts.request.errors import InvalidArgument
from qtts.request.model_variants import supports_instructions
from services.gateway.config import config_from_args
from services.gateway.instructions import IGNORED_FIELDS_HEADER

CUSTOM_1B7 = dataclasses.replace(CUSTOM, model_size="1b7")
CUSTOM_0B6 = dataclasses.replace(CUSTOM, model_size="0b6")
REF = base64.b64encode(wav_bytes()).decode()


def body(catalog, **kw) -> dict:
    extra = {
        "base": {"ref_audio": REF, "x_vector_only_mode": True},
        "custom_voice": {"voice": "vivian"},
        "voice_design": {},
    }[catalog.model_type]
    return {"input": "Hello there.", "response_format": "pcm", "stream": False, **extra, **kw}


@pytest.mark.parametrize(
    ("model_type", "size", "supported"),
    [
        ("base", "0b6", False),
        ("base", "1b7", False),
        ("custom_voice", "0b6", False),
        ("custom_voice", "1b7", True),
        ("voice_design", "1b7", True),
        ("custom_voice", "tiny", True),
    ],
)
def test_which_variants_take_instructions(model_type, size, supported):
    assert supports_instructions(model_type, size) is supported


async def test_honoured_where_the_variant_takes_them():
    for catalog in (DESIGN, CUSTOM_1B7):
        async with (
            serve_http(build_gateway(catalog, frames=2)) as gw,
            httpx.AsyncClient(base_url=gw.url) as c,
        ):
            r = await c.post("/v1/audio/speech", json=body(catalog, instructions="Warm and slow."))
            assert r.status_code == 200, r.text
            assert IGNORED_FIELDS_HEADER not in r.headers
            assert gw.talker.jobs[0].instructions == "Warm and slow."


async def test_refused_with_a_400_naming_the_field_elsewhere():
    for catalog in (BASE, CUSTOM_0B6):
        async with (
            serve_http(build_gateway(catalog, frames=2)) as gw,
            httpx.AsyncClient(base_url=gw.url) as c,
        ):
            r = await c.post("/v1/audio/speech", json=body(catalog, instructions="Warm and slow."))
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == "instructions" and "not supported" in error["message"], error
            assert gw.talker.jobs == []
            # Without the field the same request runs.
            r = await c.post("/v1/audio/speech", json=body(catalog))
            assert r.status_code == 200, r.text


async def test_ignore_policy_drops_and_reports_them():
    gw0 = build_gateway(BASE, frames=2, unsupported_instructions="ignore")
    async with serve_http(gw0) as gw, httpx.AsyncClient(base_url=gw.url) as c:
        r = await c.post("/v1/audio/speech", json=body(BASE, instructions="Warm and slow."))
        assert r.status_code == 200 and r.headers[IGNORED_FIELDS_HEADER] == "instructions"
        async with c.stream("POST", "/v1/audio/speech", json=body(BASE, instructions="x", stream=True)) as r:
            assert r.status_code == 200 and r.headers[IGNORED_FIELDS_HEADER] == "instructions"
            await r.aread()
        r = await c.post("/v1/audio/speech", json=body(BASE))
        assert r.status_code == 200 and IGNORED_FIELDS_HEADER not in r.headers
        assert [j.instructions for j in gw.talker.jobs] == ["", "", ""]


async def test_grpc_refuses_with_invalid_argument_or_reports_in_metadata():
    async with serve_grpc(build_gateway(BASE, frames=2)) as stub:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            [m async for m in stub.Synthesize(request(instructions="calm"))]
        assert (
            info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "instructions" in info.value.details()
        )
    gw = build_gateway(BASE, frames=2, unsupported_instructions="ignore")
    async with serve_grpc(gw) as stub:
        call = stub.Synthesize(request(instructions="calm"))
        msgs = [m async for m in call]
        assert msgs[-1].HasField("summary")
        assert dict(await call.initial_metadata())[IGNORED_FIELDS_HEADER] == "instructions"
        assert gw.talker.jobs[0].instructions == ""


def test_the_policy_and_its_flag(monkeypatch):
    job = build_gateway(BASE).synth.validate
    from services.gateway.job import SpeechFields

    fields = SpeechFields(text="Hi.", reference_audio=b"RIFF", x_vector_only=True, instructions="calm")
    with pytest.raises(InvalidArgument) as info:
        job(fields)
    assert info.value.param == "instructions"
    plain = job(dataclasses.replace(fields, instructions=None))
    assert plain.ignored_fields == () and plain.instructions == ""
    assert config_from_args([]).unsupported_instructions == "reject"
    assert config_from_args(["--unsupported-instructions", "ignore"]).unsupported_instructions == "ignore"
    monkeypatch.setenv("TTS_GATEWAY_UNSUPPORTED_INSTRUCTIONS", "ignore")
    assert config_from_args([]).unsupported_instructions == "ignore"
    with pytest.raises(InvalidArgument, match="unsupported-instructions"):
        dataclasses.replace(config_from_args([]), unsupported_instructions="drop").validate()
