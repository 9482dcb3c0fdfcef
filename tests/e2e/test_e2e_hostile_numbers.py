"""Numbers out of their type's range and text that is not Unicode, through the real processes
(issue 28): a 500-digit integer in a float field is a 400 naming the field over HTTP, an item
error in a batch (the other items are spoken), an error event on the WebSocket (the session goes
on, no 1011); a lone surrogate is a 400 / an error event naming the field. Before the fix the
integers raised OverflowError in math.isfinite: a 500, a failed batch, a WebSocket closed with
1011. A WAV whose header claims 4 GB over 100 bytes is refused at upload (it was stored as a
2 ms voice)."""

from __future__ import annotations

import json
import struct

import grpc
import httpx
import pytest
from e2e_helpers import REF_B64, REF_WAV
from websockets.sync.client import connect

from qtts.pb import tts_pb2, tts_pb2_grpc

pytestmark = pytest.mark.e2e

HUGE = 10**500
FLOAT_FIELDS = ["speed", "temperature", "top_p", "repetition_penalty", "speaker_embedding"]
BODY = {
    "input": "Hello.",
    "ref_audio": REF_B64,
    "x_vector_only_mode": True,
    "response_format": "pcm",
    "stream": False,
    "max_new_tokens": 4,
    "seed": 1,
}


def _huge(field: str):
    return [0.1, HUGE] if field == "speaker_embedding" else HUGE


def _post(client: httpx.Client, path: str, body: dict) -> httpx.Response:
    # json.dumps writes the 500 digits as they are (httpx's json= would too).
    return client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})


@pytest.mark.parametrize("field", FLOAT_FIELDS)
def test_a_500_digit_integer_in_a_float_field_is_a_400_naming_it(stack, field):
    with httpx.Client(base_url=stack.http_url, timeout=120) as c:
        r = _post(c, "/v1/audio/speech", {**BODY, field: _huge(field)})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == field, r.text


def test_a_500_digit_integer_fails_only_its_batch_item(stack):
    items = [{"input": "One."}, {"input": "Two.", "temperature": HUGE}, {"input": "Three.", "top_p": -HUGE}]
    body = {k: v for k, v in BODY.items() if k not in ("input", "stream", "seed")} | {"items": items}
    with httpx.Client(base_url=stack.http_url, timeout=300) as c:
        r = _post(c, "/v1/audio/speech/batch", body)
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert [x["status"] for x in results] == ["success", "error", "error"], results
    assert (results[1]["param"], results[2]["param"]) == ("temperature", "top_p")


def test_a_lone_surrogate_is_a_400_naming_the_field(stack):
    with httpx.Client(base_url=stack.http_url, timeout=60) as c:
        for field in ("input", "instructions", "ref_text"):
            r = c.post(
                "/v1/audio/speech",
                content=json.dumps({"input": "Hi", field: "a \ud800 b", "ref_audio": REF_B64}),
                headers={"content-type": "application/json"},
            )
            assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def _events_until(ws, kind: str) -> dict:
    while True:
        msg = ws.recv(timeout=60)
        if isinstance(msg, str) and (event := json.loads(msg))["type"] == kind:
            return event


def test_websocket_refuses_huge_numbers_and_lone_surrogates_and_goes_on(stack):
    url = stack.http_url.replace("http://", "ws://") + "/v1/audio/speech/stream"
    config = {
        "type": "session.config",
        "ref_audio": REF_B64,
        "x_vector_only_mode": True,
        "response_format": "pcm",
        "max_new_tokens": 4,
    }
    with connect(url, max_size=None, open_timeout=10) as ws:
        ws.send(json.dumps(config))
        for field in FLOAT_FIELDS:
            ws.send(json.dumps({**config, field: _huge(field)}))
            err = _events_until(ws, "error")
            assert err["param"] == field, err
        ws.send('{"type": "input.text", "text": "a \\udc00 lone surrogate"}')
        err = _events_until(ws, "error")
        assert err["param"] == "text" and "surrogate" in err["message"], err
        ws.send(json.dumps({"type": "input.text", "text": "Still here."}))
        ws.send(json.dumps({"type": "input.done"}))
        done = _events_until(ws, "audio.done")
        assert done["error"] is False and done["total_bytes"] > 0
        assert _events_until(ws, "session.done")["utterance_index"] == 0


def _lying_wav(claimed: int) -> bytes:
    """A 16 kHz PCM16 WAV whose header claims `claimed` bytes of audio over 100 real ones."""
    body = bytes(range(100))
    fmt = struct.pack("<4sIHHIIHH", b"fmt ", 16, 1, 1, 16000, 32000, 2, 16)
    return (
        b"RIFF"
        + struct.pack("<I", min(claimed + 36, 0xFFFFFFFE))
        + b"WAVE"
        + fmt
        + b"data"
        + struct.pack("<I", claimed)
        + body
    )


def test_a_wav_whose_header_claims_more_than_it_holds_is_refused_at_upload(stack):
    with httpx.Client(base_url=stack.http_url, timeout=60) as c:
        c.delete("/v1/audio/voices/liar")
        r = c.post(
            "/v1/audio/voices",
            data={"name": "liar"},
            files={"audio": ("ref.wav", _lying_wav(4_000_000_000), "audio/wav")},
        )
        assert r.status_code == 400, r.text
        assert (
            r.json()["error"]["param"] == "audio"
            and "claims 4000000000 bytes" in r.json()["error"]["message"]
        )
        assert c.get("/v1/audio/voices/liar").status_code == 404
        # The same clip with a true header is stored (its sizes agree).
        r = c.post(
            "/v1/audio/voices", data={"name": "liar"}, files={"audio": ("ref.wav", REF_WAV, "audio/wav")}
        )
        assert r.status_code == 201, r.text
        assert c.delete("/v1/audio/voices/liar").status_code == 200
    with grpc.insecure_channel(stack.grpc_address) as channel:
        stub = tts_pb2_grpc.TextToSpeechServiceStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.CreateVoice(
                tts_pb2.CreateVoiceRequest(name="liar", reference_audio=_lying_wav(4_000_000_000)), timeout=30
            )
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "claims" in err.value.details()
