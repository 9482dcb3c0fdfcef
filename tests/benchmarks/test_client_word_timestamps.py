"""`tts-bench --word-timestamps`: every request asks for word timestamps, and each level counts
the words that came back (against a small in-process fake gRPC gateway)."""

from __future__ import annotations

import json
from concurrent import futures

import grpc
import numpy as np

from benchmarks.client import main
from benchmarks.transport import SynthesisOptions, http_payload
from qtts.pb import tts_pb2, tts_pb2_grpc

LOUD = np.full(2400, 8000, dtype="<i2").tobytes()


class FakeGateway(tts_pb2_grpc.TextToSpeechServiceServicer):
    """One PCM chunk and a summary; with word_timestamps, one word per word of the text, except
    for text "fail", where the summary says the aligner failed."""

    def __init__(self):
        self.requests = []

    def Synthesize(self, request, context):
        self.requests.append(request)
        chunk = tts_pb2.AudioChunk(audio=LOUD, num_samples=len(LOUD) // 2, sample_rate_hz=24000)
        yield tts_pb2.SynthesizeResponse(request_id=request.request_id, sequence_number=0, audio=chunk)
        summary = tts_pb2.SynthesisSummary(
            finish_reason=tts_pb2.FINISH_REASON_STOP, num_frames=1, num_samples=2400, sample_rate_hz=24000
        )
        if request.word_timestamps:
            if request.text == "fail":
                summary.word_timestamps_failed = True
            else:
                for i, w in enumerate(request.text.split()):
                    summary.word_timestamps.add(word=w, start_ms=100 * i, end_ms=100 * i + 50)
        yield tts_pb2.SynthesizeResponse(request_id=request.request_id, sequence_number=1, summary=summary)


def _serve(servicer):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    tts_pb2_grpc.add_TextToSpeechServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def test_word_timestamps_flag_asks_every_request_and_counts_the_words(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("one two three\nfail\nfour five\n")
    gateway = FakeGateway()
    server, port = _serve(gateway)
    try:
        rc = main(
            ["--protocol", "grpc", "--grpc-target", f"127.0.0.1:{port}", "--url", "http://127.0.0.1:9",
             "--prompts", str(prompts), "--concurrency", "2", "--num-requests", "3", "--warmup", "1",
             "--word-timestamps", "--out", str(tmp_path / "on"), "--no-progress", "--no-plots"]
        )  # fmt: skip
    finally:
        server.stop(None)
    assert rc == 0
    assert len(gateway.requests) == 4 and all(r.word_timestamps for r in gateway.requests)
    data = json.loads((tmp_path / "on" / "results.json").read_text())
    assert data["conditions"]["word_timestamps"] is True
    (level,) = data["levels"]
    assert level["word_timestamps"] == {"ok_requests": 3, "with_words": 2, "aligner_failed": 1, "words": 5}
    words = sorted(r["extra"]["words"] for r in level["records"])
    assert words == [0, 2, 3]


def test_without_the_flag_no_request_asks_and_levels_count_nothing(tmp_path):
    gateway = FakeGateway()
    server, port = _serve(gateway)
    try:
        rc = main(
            ["--protocol", "grpc", "--grpc-target", f"127.0.0.1:{port}", "--url", "http://127.0.0.1:9",
             "--concurrency", "1", "--num-requests", "2", "--warmup", "0", "--out", str(tmp_path),
             "--no-progress", "--no-plots"]
        )  # fmt: skip
    finally:
        server.stop(None)
    assert rc == 0
    assert gateway.requests and not any(r.word_timestamps for r in gateway.requests)
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["conditions"]["word_timestamps"] is False
    assert "word_timestamps" not in data["levels"][0]
    assert all("words" not in r["extra"] for r in data["levels"][0]["records"])


def test_word_timestamps_over_http_is_refused_before_any_request(tmp_path, capsys):
    rc = main(["--word-timestamps", "--url", "http://127.0.0.1:9", "--out", str(tmp_path), "--no-progress"])
    assert rc == 1
    assert "--word-timestamps needs --protocol grpc" in capsys.readouterr().err


def test_http_payload_carries_the_flag_only_when_set():
    on = http_payload(SynthesisOptions(word_timestamps=True), "hi", 0)
    off = http_payload(SynthesisOptions(), "hi", 0)
    assert on["word_timestamps"] is True and "word_timestamps" not in off
    assert {k: v for k, v in on.items() if k != "word_timestamps"} == off
