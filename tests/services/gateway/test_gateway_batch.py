"""POST /v1/audio/speech/batch (vLLM-Omni's shape) on a real server with a fake talker."""

from __future__ import annotations

import base64
import io
import wave

import httpx
from gateway_fakes import BASE, CUSTOM, FRAME, build_gateway, frame_pcm, serve_http, wav_bytes

from services.gateway.batch import MAX_BATCH_ITEMS

REF = base64.b64encode(wav_bytes()).decode()


async def test_items_take_the_shared_fields_and_their_own():
    async with serve_http(build_gateway(CUSTOM, frames=3)) as gw, httpx.AsyncClient(base_url=gw.url) as c:
        r = await c.post(
            "/v1/audio/speech/batch",
            json={
                "voice": "vivian",
                "language": "English",
                "items": [{"input": "One."}, {"input": "Two.", "speaker": "ryan", "response_format": "pcm"}],
            },
        )
        assert r.status_code == 200, r.text
        data = r.json()
        assert data["id"].startswith("speech-batch-")
        assert (data["total"], data["succeeded"], data["failed"]) == (2, 2, 0)
        first, second = data["results"]
        assert (first["index"], first["status"], first["media_type"]) == (0, "success", "audio/wav")
        with wave.open(io.BytesIO(base64.b64decode(first["audio_data"]))) as w:
            assert w.getnframes() == 3 * FRAME
        assert (
            base64.b64decode(second["audio_data"]) == frame_pcm(0, 3) and second["media_type"] == "audio/pcm"
        )
        assert first["usage"]["output_tokens"] == 3
        assert sorted((j.text, j.voice) for j in gw.talker.jobs) == [("One.", "vivian"), ("Two.", "ryan")]
        assert gw.synth.admission.active == 0


async def test_a_failing_item_is_reported_and_the_others_still_run():
    async with serve_http(build_gateway(BASE, frames=2)) as gw, httpx.AsyncClient(base_url=gw.url) as c:
        r = await c.post(
            "/v1/audio/speech/batch",
            json={
                "ref_audio": REF,
                "x_vector_only_mode": True,
                "response_format": "pcm",
                "items": [
                    {"input": "Fine."},
                    {"input": ""},
                    {"input": "x", "bogus": 1},
                    "not an object",
                    {"input": "Also fine.", "speed": 9},
                ],
            },
        )
        assert r.status_code == 200, r.text
        data = r.json()
        assert [x["status"] for x in data["results"]] == ["success", "error", "error", "error", "error"]
        assert (data["succeeded"], data["failed"]) == (1, 4)
        errors = data["results"]
        assert errors[2]["param"] == "bogus" and errors[4]["param"] == "speed" and errors[1]["error"]
        assert [j.text for j in gw.talker.jobs] == ["Fine."]


async def test_a_malformed_batch_is_a_400_naming_the_field():
    async with serve_http(build_gateway(BASE)) as gw, httpx.AsyncClient(base_url=gw.url) as c:
        cases = [
            ({"items": []}, "items"),
            ({"items": [{"input": "x"}] * (MAX_BATCH_ITEMS + 1)}, "items"),
            ({"input": "x"}, "input"),
            ({"items": [{"input": "x"}], "stream": True}, "stream"),
        ]
        for body, param in cases:
            r = await c.post("/v1/audio/speech/batch", json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
        assert gw.talker.jobs == []
