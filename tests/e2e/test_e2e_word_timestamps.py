"""Word timestamps through the real processes: the aligner stage beside the stack (launcher's
--aligner wiring), HTTP JSON and SSE answers equal to the tiny aligner run here on the same audio,
and a stack without an aligner refusing the field with a 400 naming it."""

from __future__ import annotations

import base64
import io
import json
import wave

import grpc
import httpx
import numpy as np
import pytest
from e2e_helpers import REF_WAV, poll, running_stack, scrape, tiny_stack_config
from websockets.sync.client import connect

from qtts.pb import tts_pb2, tts_pb2_grpc
from services.launcher import free_port

pytestmark = pytest.mark.e2e

TEXT = "Hello there, this is a word timestamp test."
REF_B64 = base64.b64encode(REF_WAV).decode()


def _body(**kw) -> dict:
    return {
        "input": TEXT,
        "ref_audio": REF_B64,
        "x_vector_only_mode": True,
        "max_new_tokens": 20,
        "temperature": 0,
        "language": "english",
        "response_format": "wav",
        "word_timestamps": True,
        **kw,
    }


@pytest.fixture(scope="module")
def aligned_stack(snapshot_root, tmp_path_factory):
    config = tiny_stack_config(
        snapshot_root,
        tmp_path_factory.mktemp("logs-aligner"),
        aligner_port=free_port(),
        aligner_metrics_port=free_port(),
    )
    with running_stack(config) as started:
        yield started


def _local_words(pcm_s16: bytes) -> list[dict]:
    """The tiny aligner (the snapshot the stage serves: seed 0) run in this process."""
    from qtts.model.aligner import load_aligner
    from qtts.tiny_model.aligner import ensure_tiny_aligner

    aligner = load_aligner(ensure_tiny_aligner())
    pcm = np.frombuffer(pcm_s16, "<i2").astype(np.float32) / 32768.0
    return [
        {"word": w.word, "start_ms": round(w.start_s * 1000), "end_ms": round(w.end_s * 1000)}
        for w in aligner.align(pcm, 24000, TEXT, "english")
    ]


def test_http_json_answer_has_the_aligners_words(aligned_stack):
    r = httpx.post(f"{aligned_stack.http_url}/v1/audio/speech", json=_body(), timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    with wave.open(io.BytesIO(base64.b64decode(out["audio"]))) as w:
        assert (w.getframerate(), w.getnframes()) == (24000, 20 * 1920)
        pcm = w.readframes(w.getnframes())
    words = out["timestamps"]
    assert [w["word"] for w in words] == ["Hello", "there", "this", "is", "a", "word", "timestamp", "test"]
    assert words == _local_words(pcm)
    assert all(0 <= w["start_ms"] <= w["end_ms"] for w in words)
    # the aligner stage did the work: its metrics count the audio it aligned
    assert poll(
        lambda: (
            scrape(aligned_stack.config.aligner_metrics_port).get("tts_aligner_audio_seconds_total", 0) > 0
        )
    )


def test_sse_timestamps_event_before_done(aligned_stack):
    r = httpx.post(
        f"{aligned_stack.http_url}/v1/audio/speech",
        json=_body(stream_format="sse", response_format="pcm"),
        timeout=120,
    )
    assert r.status_code == 200, r.text
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    assert [e["type"] for e in events[-2:]] == ["speech.audio.timestamps", "speech.audio.done"]
    pcm = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")
    assert events[-2]["timestamps"] == _local_words(pcm)


def _local_segment_words(pcm_s16: bytes, text: str, offset_ms: float) -> list[dict]:
    from qtts.model.aligner import load_aligner
    from qtts.tiny_model.aligner import ensure_tiny_aligner

    aligner = load_aligner(ensure_tiny_aligner())
    pcm = np.frombuffer(pcm_s16, "<i2").astype(np.float32) / 32768.0
    return [
        {
            "word": w.word,
            "start_ms": round(w.start_s * 1000 + offset_ms),
            "end_ms": round(w.end_s * 1000 + offset_ms),
        }
        for w in aligner.align(pcm, 24000, text, "english")
    ]


def test_websocket_text_streamed_in_sentence_segments_carry_their_words(aligned_stack):
    url = aligned_stack.http_url.replace("http://", "ws://") + "/v1/audio/speech/stream"
    config = {
        "type": "session.config",
        "ref_audio": REF_B64,
        "x_vector_only_mode": True,
        "max_new_tokens": 12,
        "temperature": 0,
        "language": "english",
        "response_format": "pcm",
        "stream_audio": True,
        "split_granularity": "sentence",
        "word_timestamps": True,
    }
    segments = []
    with connect(url, max_size=None) as ws:
        ws.send(json.dumps(config))
        for piece in ["Hello there. ", "How are ", "you today? "]:
            ws.send(json.dumps({"type": "input.text", "text": piece}))
        ws.send(json.dumps({"type": "input.done"}))
        audio = b""
        while True:
            msg = ws.recv(timeout=120)
            if isinstance(msg, bytes):
                audio += msg
                continue
            event = json.loads(msg)
            assert event["type"] != "error", event
            if event["type"] == "audio.done":
                segments.append((audio, event))
                audio = b""
            elif event["type"] == "session.done":
                break
    assert len(segments) == 2
    offset = 0.0
    for pcm, done in segments:
        assert done["timestamps"] == _local_segment_words(pcm, done["sentence_text"], offset)
        offset += len(pcm) / 2 / 24000 * 1000
    assert [w["word"] for _, d in segments for w in d["timestamps"]] == [
        "Hello",
        "there",
        "How",
        "are",
        "you",
        "today",
    ]


def test_grpc_summary_carries_the_words(aligned_stack):
    req = tts_pb2.SynthesizeRequest(
        text=TEXT,
        reference_audio=REF_WAV,
        x_vector_only=True,
        max_new_frames=20,
        language="english",
        word_timestamps=True,
        sampling=tts_pb2.SamplingParams(greedy=True),
    )
    with grpc.insecure_channel(aligned_stack.grpc_address) as channel:
        msgs = list(tts_pb2_grpc.TextToSpeechServiceStub(channel).Synthesize(req, timeout=120))
    pcm = b"".join(m.audio.audio for m in msgs if m.HasField("audio"))
    summary = msgs[-1].summary
    words = [{"word": w.word, "start_ms": w.start_ms, "end_ms": w.end_ms} for w in summary.word_timestamps]
    assert words == _local_segment_words(pcm, TEXT, 0.0) and not summary.word_timestamps_failed


def test_a_stack_without_an_aligner_refuses_word_timestamps(stack):
    r = httpx.post(f"{stack.http_url}/v1/audio/speech", json=_body(), timeout=60)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "word_timestamps" and "forced aligner" in err["message"]


def test_the_aligner_drains_and_exits_cleanly_on_sigterm(aligned_stack):
    proc = aligned_stack["aligner"]
    assert proc.alive()
    assert proc.stop(grace=15.0) == 0
