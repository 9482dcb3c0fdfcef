"""A client that goes away mid-stream leaves no talker slot and no decoder state behind."""

from __future__ import annotations

import grpc
import httpx
import pytest
from e2e_helpers import REF_B64, REF_WAV, poll, scrape

from qtts.pb import tts_pb2, tts_pb2_grpc

pytestmark = pytest.mark.e2e

# Frames: far more than the test reads before it leaves, and more audio (11.5 MB) than the socket
# buffers between gateway and client hold, so the stream cannot finish while the client idles.
LONG = 3000
TEXT = "A long story that the client will not wait to hear until its very end. " * 20


def _live(stack) -> tuple[float, float]:
    talker = scrape(stack["talker"].spec.metrics_port).get("tts_talker_active_streams", 0.0)
    states = sum(
        scrape(p.spec.metrics_port).get("tts_code2wav_live_states", 0.0)
        for p in stack.processes
        if p.name.startswith("code2wav")
    )
    return talker, states


def test_http_client_disconnect_frees_talker_and_decoder(stack):
    assert poll(lambda: _live(stack) == (0, 0)), _live(stack)
    body = {
        "input": TEXT,
        "voice": "v",
        "ref_audio": REF_B64,
        "x_vector_only_mode": True,
        "max_new_tokens": LONG,
        "seed": 1,
        "stream": True,
        "response_format": "pcm",
    }
    with (
        httpx.Client(timeout=120) as c,
        c.stream("POST", f"{stack.http_url}/v1/audio/speech", json=body) as r,
    ):
        assert r.status_code == 200
        # Keep the iterator: dropping it closes the connection before the test means to.
        chunks = r.iter_raw()
        first = next(chunks)
        assert first
        assert poll(lambda: _live(stack) == (1, 1)), _live(stack)
    assert poll(lambda: _live(stack) == (0, 0)), _live(stack)
    assert httpx.get(f"{stack.http_url}/health", timeout=10).status_code == 200


def test_grpc_cancel_frees_talker_and_decoder(stack):
    assert poll(lambda: _live(stack) == (0, 0)), _live(stack)
    req = tts_pb2.SynthesizeRequest(
        text=TEXT, reference_audio=REF_WAV, x_vector_only=True, max_new_frames=LONG
    )
    with grpc.insecure_channel(stack.grpc_address) as channel:
        call = tts_pb2_grpc.TextToSpeechServiceStub(channel).Synthesize(req, timeout=120)
        assert next(call).HasField("audio")
        assert poll(lambda: _live(stack) == (1, 1)), _live(stack)
        call.cancel()
    assert poll(lambda: _live(stack) == (0, 0)), _live(stack)
