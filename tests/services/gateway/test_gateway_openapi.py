"""The typed request model: /openapi.json and /docs describe the body the handler really accepts."""

from __future__ import annotations

import re

import httpx
import pytest
from gateway_fakes import build_gateway, serve_http

from qtts.request import request_limits as lim
from qtts.request.errors import InvalidArgument
from qtts.request.sampling_overrides import sampling_fields
from services.gateway.http_request import SpeechRequest, StreamingSessionConfig, parse_speech_body

# Every field the speech endpoint accepts (OpenAI's and vLLM-Omni's), as clients send them: the
# sampling fields under their HTTP names, as `SamplingOverrides` declares them, and the others.
ACCEPTED = {f.http_name for f in sampling_fields()} | {
    "model",
    "input",
    "voice",
    "speaker",
    "response_format",
    "speed",
    "stream",
    "stream_format",
    "word_timestamps",
    "task_type",
    "language",
    "instructions",
    "ref_audio",
    "ref_text",
    "x_vector_only_mode",
    "max_new_tokens",
    "sample_rate",
    "speaker_embedding",
    "initial_codec_chunk_frames",
    "non_streaming_mode",
    "extra_params",
}


async def test_openapi_documents_the_speech_body_and_responses():
    async with serve_http(build_gateway()) as gw, httpx.AsyncClient(base_url=gw.url) as c:
        schema = (await c.get("/openapi.json")).json()
        docs = await c.get("/docs")
    assert docs.status_code == 200 and "swagger" in docs.text.lower()
    op = schema["paths"]["/v1/audio/speech"]["post"]
    assert op["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/SpeechRequest"
    }
    body = schema["components"]["schemas"]["SpeechRequest"]
    assert set(body["properties"]) == ACCEPTED and body["required"] == ["input"]
    assert body["additionalProperties"] is False
    props = body["properties"]
    assert (props["speed"]["minimum"], props["speed"]["maximum"], props["speed"]["default"]) == (
        0.25,
        4.0,
        1.0,
    )
    assert props["response_format"]["default"] == "mp3" and "mulaw" in props["response_format"]["enum"]
    top_p = props["top_p"]["anyOf"][0]
    assert (top_p["minimum"], top_p["maximum"]) == (lim.TOP_P_MIN, 1)
    temperature = props["temperature"]["anyOf"][0]
    assert (temperature["minimum"], temperature["maximum"]) == (0, lim.TEMPERATURE_MAX)
    assert props["input"]["maxLength"] == lim.TEXT_MAX_CHARS
    assert props["ref_text"]["anyOf"][0]["maxLength"] == lim.REF_TEXT_MAX_CHARS
    assert {"$ref": "#/components/schemas/VoiceId"} in props["voice"]["anyOf"]
    assert all(p.get("description") for p in props.values())
    content = op["responses"]["200"]["content"]
    assert {"audio/mpeg", "audio/wav", "audio/pcm", "audio/basic", "text/event-stream"} <= set(content)
    assert "Retry-After" in op["responses"]["429"]["headers"]
    for status in ("400", "404", "429", "500", "503"):
        ref = op["responses"][status]["content"]["application/json"]["schema"]
        assert ref == {"$ref": "#/components/schemas/ErrorResponse"}
    error = schema["components"]["schemas"]["ErrorDetail"]["properties"]
    assert set(error) == {"message", "type", "param", "code"}
    session = schema["components"]["schemas"]["StreamingSessionConfig"]["properties"]
    assert {"stream_audio", "split_granularity", "voice", "ref_audio"} <= set(session)


def test_the_model_declares_what_the_parser_accepts():
    assert set(SpeechRequest.model_fields) == ACCEPTED
    fields, out = parse_speech_body({k: None for k in ACCEPTED} | {"input": "hi"})  # null is absent
    assert (fields.text, out.response_format, out.speed, fields.x_vector_only) == ("hi", "mp3", 1.0, False)
    assert set(StreamingSessionConfig.model_fields) - set(SpeechRequest.model_fields) == {
        "type",
        "stream_audio",
        "split_granularity",
    }


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"initial_codec_chunk_frames": 5000}, "initial_codec_chunk_frames", "must be in 0..4096, got 5000"),
        ({"top_p": 0}, "top_p", "must be in 0.001..1.0, got 0"),
        ({"temperature": -0.5}, "temperature", "must be in 0..10.0, got -0.5"),
        ({"sample_rate": 96000}, "sample_rate", "must be in 8000..48000, got 96000"),
        ({"temperature": float("nan")}, "temperature", "finite"),
        ({"top_k": 1.5}, "top_k", "must be an integer"),
        ({"x_vector_only_mode": 1}, "x_vector_only_mode", "must be a boolean"),
        ({"extra_params": [1]}, "extra_params", "must be an object"),
        ({"speaker": "a", "voice": {"id": "b"}}, "speaker", "disagree"),
    ],
)
def test_errors_name_the_field_and_its_declared_range(body, param, words):
    with pytest.raises(InvalidArgument) as info:
        parse_speech_body({"input": "hi", **body})
    assert info.value.param == param and words in info.value.message


async def test_an_integer_too_long_to_convert_is_a_400():
    async with serve_http(build_gateway()) as gw, httpx.AsyncClient(base_url=gw.url) as c:
        r = await c.post(
            "/v1/audio/speech",
            content=b'{"input": "a", "seed": ' + b"9" * 5000 + b"}",
            headers={"content-type": "application/json"},
        )
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_value"
        assert gw.talker.jobs == []


async def test_docs_pages_load_their_assets_from_the_gateway():
    """/docs and /redoc name no other host: their scripts, styles and icon are served here."""
    async with serve_http(build_gateway()) as gw, httpx.AsyncClient(base_url=gw.url) as c:
        pages = {path: await c.get(path) for path in ("/docs", "/redoc")}
        for path, page in pages.items():
            assert page.status_code == 200, path
            assert re.findall(r"(?:src|href)=['\"]?(https?:)", page.text) == [], (path, page.text)
            assert "fonts.googleapis" not in page.text, path
            for asset in re.findall(r"/docs-assets/[\w.-]+", page.text):
                r = await c.get(asset)
                assert r.status_code == 200 and len(r.content) > 1000, asset
        assert "/docs-assets/swagger-ui-bundle.js" in pages["/docs"].text
        assert "/docs-assets/redoc.standalone.js" in pages["/redoc"].text
        assert pages["/redoc"].headers["content-security-policy"].startswith("img-src 'self'")
