"""The benchmark client end to end against small in-process fake gateways (HTTP and gRPC).

The fake HTTP server is a bare asyncio HTTP/1.1 server in its own thread, streaming chunked PCM
with scripted pauses, so the recorded chunk trace and underrun can be checked against the script.
"""

from __future__ import annotations

import asyncio
import json
import threading

import grpc
import numpy as np
import pytest

from benchmarks.client import BenchConfig, build_parser, main, read_prompts
from benchmarks.metrics import max_underrun_s
from benchmarks.transport import GrpcSynthesizer, HttpSynthesizer, SynthesisOptions
from qtts.pb import tts_pb2, tts_pb2_grpc

SILENT = bytes(4800)  # 0.1 s of silence
LOUD = np.full(2400, 8000, dtype="<i2").tobytes()  # 0.1 s well above -50 dBFS
STALL_S = 0.6
# (delay before the chunk, chunk): 0.2 s of audio on time, then a stall.
STALL_SCRIPT = [(0.0, SILENT), (0.05, LOUD), (STALL_S, LOUD)]


class FakeSpeechServer:
    """`POST /v1/audio/speech` answering from a script; input "reject" -> 429, "cut" -> cut stream.
    Other requests (GET /health, /v1/models) get a 404 and their paths are kept in `gets`;
    `on_request(body)`, if set, runs in the server thread as each speech request arrives."""

    def __init__(self, script, on_request=None):
        self.script = script
        self.on_request = on_request
        self.requests: list[dict] = []
        self.gets: list[str] = []
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self) -> FakeSpeechServer:
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()
        server.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:] if ":" in line)}
        if "content-length" not in headers:  # GET /v1/models (the run's conditions): not served here
            self.gets.append(lines[0].split()[1])
            writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            await writer.drain()
            writer.close()
            return
        body = json.loads(await reader.readexactly(int(headers["content-length"])))
        self.requests.append({"path": lines[0].split()[1], **body})
        if self.on_request is not None:
            self.on_request(body)
        if body["input"] == "reject":
            payload = json.dumps({"error": {"message": "no free slot", "type": "rate_limit_error"}}).encode()
            writer.write(
                b"HTTP/1.1 429 Too Many Requests\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode()
                + payload
            )
            await writer.drain()
            writer.close()
            return
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: audio/pcm\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
        )
        for delay, data in self.script:
            await asyncio.sleep(delay)
            writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            await writer.drain()
            if body["input"] == "cut":
                writer.close()  # no terminating chunk: the client sees a broken stream
                return
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()


OPTIONS = SynthesisOptions(
    task_type="Base",
    ref_audio=b"RIFF....",
    ref_text="ref words",
    max_new_tokens=40,
    seed=5,
    request_timeout_s=30,
)


async def test_http_stream_trace_and_underrun_end_to_end():
    with FakeSpeechServer(STALL_SCRIPT) as server:
        client = HttpSynthesizer(server.url, OPTIONS)
        try:
            record = await client.synthesize(7, 2, "hello there")
        finally:
            await client.aclose()
    assert record.ok and record.status == "200" and record.error is None
    assert record.chunk_bytes == [4800, 4800, 4800]
    times = record.chunk_times_s
    assert times == sorted(times) and record.ttfa_s == times[0]
    assert record.first_audible_s == times[1]  # chunk 0 is silence
    assert record.audio_s == pytest.approx(0.3)
    assert record.e2e_s >= times[-1] and record.rtf == pytest.approx(record.e2e_s / 0.3)
    assert times[2] - times[1] >= STALL_S * 0.9  # the scripted stall shows in the trace
    assert record.max_underrun_s == max_underrun_s(times, record.chunk_bytes)
    # The stall starts after 0.2 s of audio and lasts 0.6 s: about 0.45 s of underrun.
    assert record.max_underrun_s > 0.3
    (request,) = server.requests
    assert request["path"] == "/v1/audio/speech"
    assert (
        request["input"] == "hello there"
        and request["response_format"] == "pcm"
        and request["stream"] is True
    )
    assert request["task_type"] == "voice_clone"  # vLLM-Omni's "Base", in this API's spelling
    assert request["ref_text"] == "ref words"
    assert request["ref_audio"].startswith("data:audio/")
    assert request["max_new_tokens"] == 40 and request["seed"] == 12
    assert "voice" not in request and "x_vector_only_mode" not in request


async def test_http_on_time_stream_has_zero_underrun():
    with FakeSpeechServer([(0.0, LOUD), (0.0, LOUD), (0.0, LOUD)]) as server:
        client = HttpSynthesizer(server.url, OPTIONS)
        try:
            record = await client.synthesize(0, 0, "fast")
        finally:
            await client.aclose()
    assert record.ok and sum(record.chunk_bytes) == 14400
    assert record.first_audible_s == record.ttfa_s
    # All audio arrives (far) faster than it plays; allow a scheduler hiccup well below 0.1 s.
    assert record.max_underrun_s < 0.1


async def test_http_rejection_and_cut_stream_are_failed_records():
    with FakeSpeechServer(STALL_SCRIPT) as server:
        client = HttpSynthesizer(server.url, OPTIONS)
        try:
            rejected = await client.synthesize(0, 0, "reject")
            cut = await client.synthesize(1, 0, "cut")
        finally:
            await client.aclose()
    assert not rejected.ok and rejected.status == "429" and rejected.error == "no free slot"
    assert rejected.ttfa_s is None and rejected.chunk_bytes == []
    assert not cut.ok and cut.status == "TRANSPORT"
    assert cut.chunk_bytes == [4800] and cut.audio_s == pytest.approx(0.1)


async def test_http_request_timeout_is_a_failed_record():
    options = SynthesisOptions(task_type="voice_clone", ref_audio=b"x", ref_text="t", request_timeout_s=0.3)
    with FakeSpeechServer([(0.0, LOUD), (5.0, LOUD)]) as server:
        client = HttpSynthesizer(server.url, options)
        try:
            record = await client.synthesize(0, 0, "slow")
        finally:
            await client.aclose()
    assert not record.ok and record.status == "TIMEOUT"
    assert record.chunk_bytes == [4800]


def test_cli_closed_loop_sweep_writes_results(tmp_path, capsys):
    script = [(0.0, LOUD), (0.01, LOUD)]
    with FakeSpeechServer(script) as server:
        rc = main(
            [
                "--url", server.url, "--concurrency", "1", "2", "--num-requests", "3", "--warmup", "1",
                "--max-new-tokens", "5", "--out", str(tmp_path), "--no-progress", "--gpu", "test-gpu",
                "--weights", "dummy", "--tag", "t", "--rounds", "2",
            ]
        )  # fmt: skip
    assert rc == 0
    data = json.loads((tmp_path / "results.json").read_text())
    assert [lv["concurrency"] for lv in data["levels"]] == [1, 2]
    # --rounds 2: max(3, 2 x 1) = 3 requests at c=1, max(3, 2 x 2) = 4 at c=2.
    for level, n in zip(data["levels"], (3, 4), strict=True):
        assert level["aggregates"]["num_ok"] == n
        assert [r["index"] for r in level["records"]] == list(range(n))
        assert all(r["chunk_bytes"] == [4800, 4800] for r in level["records"])
    c = data["conditions"]
    assert c["gpu"] == "test-gpu" and c["weights"] == "dummy" and c["frames_per_request"] == "max 5"
    assert c["git_revision"] and c["date"] and c["host"]
    assert data["warmup"]["num_requests"] == 1
    assert len(server.requests) == 8
    assert len({r["seed"] for r in server.requests}) == 8  # distinct per request, across levels
    prompts = read_prompts(build_parser().get_default("prompts"))
    assert [r["input"] for r in server.requests[1:4]] == prompts[:3]  # every level walks the same prompts
    assert "| c=2 |" in capsys.readouterr().out
    assert (tmp_path / "results.md").exists() and (tmp_path / "ttfa_vs_load.png").exists()


def test_cli_open_loop_and_argument_errors(tmp_path, capsys):
    with FakeSpeechServer([(0.0, LOUD)]) as server:
        rc = main(
            ["--url", server.url, "--rate", "50", "--num-requests", "4", "--warmup", "0", "--out", str(tmp_path),
             "--no-progress", "--no-plots", "--task-type", "CustomVoice", "--voice", "vivian"]
        )  # fmt: skip
    assert rc == 0
    data = json.loads((tmp_path / "results.json").read_text())
    (level,) = data["levels"]
    assert level["mode"] == "open" and level["rate"] == 50 and level["aggregates"]["num_ok"] == 4
    assert all("ref_audio" not in r and r["voice"] == "vivian" for r in server.requests)
    assert all(r["task_type"] == "custom_voice" for r in server.requests)
    assert main(["--task-type", "Nonsense", "--out", str(tmp_path)]) == 1
    assert main(["--ref-audio", str(tmp_path / "results.json"), "--out", str(tmp_path)]) == 1  # no --ref-text
    assert "--ref-text" in capsys.readouterr().err


def test_voice_clone_defaults_to_a_synthetic_reference():
    cfg = BenchConfig.from_args(build_parser().parse_args([]))
    assert cfg.options.ref_audio[:4] == b"RIFF" and cfg.options.ref_text
    assert len(cfg.prompts) >= 8


class FakeTextToSpeech(tts_pb2_grpc.TextToSpeechServiceServicer):
    """Streams two PCM chunks and a summary; text "busy" is rejected with RESOURCE_EXHAUSTED."""

    def __init__(self):
        self.requests = []

    async def Synthesize(self, request, context):
        self.requests.append(request)
        if request.text == "busy":
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "no free slot")
        for seq, data in enumerate([SILENT, LOUD]):
            chunk = tts_pb2.AudioChunk(audio=data, num_samples=len(data) // 2, sample_rate_hz=24000)
            yield tts_pb2.SynthesizeResponse(request_id=request.request_id, sequence_number=seq, audio=chunk)
            await asyncio.sleep(0.01)
        summary = tts_pb2.SynthesisSummary(
            finish_reason=tts_pb2.FINISH_REASON_STOP, num_frames=3, num_samples=4800, sample_rate_hz=24000
        )
        yield tts_pb2.SynthesizeResponse(request_id=request.request_id, sequence_number=2, summary=summary)


async def test_grpc_client_records_chunks_summary_and_errors():
    servicer = FakeTextToSpeech()
    server = grpc.aio.server()
    tts_pb2_grpc.add_TextToSpeechServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = GrpcSynthesizer(f"127.0.0.1:{port}", OPTIONS, channels=2, request_id_prefix="t")
    try:
        record = await client.synthesize(3, 0, "hello")
        busy = await client.synthesize(4, 0, "busy")
    finally:
        await client.aclose()
        await server.stop(None)
    assert record.ok and record.status == "OK"
    assert record.chunk_bytes == [4800, 4800] and record.first_audible_s == record.chunk_times_s[1]
    assert record.extra["finish_reason"] == "FINISH_REASON_STOP" and record.extra["num_frames"] == 3
    assert not busy.ok and busy.status == "RESOURCE_EXHAUSTED" and busy.error == "no free slot"
    sent = servicer.requests[0]
    assert sent.request_id == "t-3" and sent.text == "hello"
    assert sent.task_type == tts_pb2.TASK_TYPE_VOICE_CLONE
    assert sent.audio_encoding == tts_pb2.AUDIO_ENCODING_PCM_S16LE
    assert sent.reference_audio == b"RIFF...." and sent.reference_text == "ref words"
    assert sent.max_new_frames == 40 and sent.sampling.seed == 8


def test_cli_spreads_grpc_requests_over_several_gateway_targets(tmp_path):
    """--grpc-target a,b: request i goes to gateway i mod 2, as over HTTP with --url a,b."""

    async def run() -> tuple[int, list[FakeTextToSpeech]]:
        servicers, servers, targets = [], [], []
        for _ in range(2):
            servicer, server = FakeTextToSpeech(), grpc.aio.server()
            tts_pb2_grpc.add_TextToSpeechServiceServicer_to_server(servicer, server)
            targets.append(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
            await server.start()
            servicers.append(servicer)
            servers.append(server)
        args = [
            "--protocol", "grpc", "--grpc-target", ",".join(targets), "--concurrency", "2",
            "--num-requests", "4", "--warmup", "0", "--max-new-tokens", "5", "--out", str(tmp_path),
            "--no-progress", "--no-plots",
        ]  # fmt: skip
        try:
            rc = await asyncio.to_thread(main, args)
        finally:
            for server in servers:
                await server.stop(None)
        return rc, servicers

    rc, servicers = asyncio.run(run())
    assert rc == 0
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["levels"][0]["aggregates"]["num_ok"] == 4
    assert [len(s.requests) for s in servicers] == [2, 2]


def test_http_body_splices_the_pre_encoded_reference_clip():
    """The request body with the clip spliced in as pre-encoded JSON parses to the same payload."""
    from benchmarks.transport import HttpSynthesizer, SynthesisOptions, http_payload

    options = SynthesisOptions(
        task_type="voice_clone", ref_audio=b"RIFF\x00\x01 clip \xff", ref_text="ref words"
    )
    synth = HttpSynthesizer("http://127.0.0.1:1", options)
    payload = http_payload(options, 'Text with "quotes" and ünïcode', 7, synth._ref_audio_url)
    assert payload["ref_audio"] is synth._ref_audio_url
    assert json.loads(synth.body(payload)) == payload
    without = {k: v for k, v in payload.items() if k != "ref_audio"}
    assert json.loads(synth.body(without)) == without
    assert json.loads(synth.body({"ref_audio": synth._ref_audio_url})) == {"ref_audio": synth._ref_audio_url}


def test_cli_open_loop_mixed_lengths_are_sent_and_recorded(tmp_path, capsys):
    with FakeSpeechServer([(0.0, LOUD)]) as server:
        rc = main(
            ["--url", server.url, "--rate", "200", "100", "--num-requests", "40", "--warmup", "1",
             "--length-dist", "mixed:2:20", "--fixed-length", "--max-new-tokens", "125", "--seed", "3",
             "--out", str(tmp_path), "--no-progress", "--no-plots"]
        )  # fmt: skip
    assert rc == 0
    assert "--max-new-tokens 125 is not used" in capsys.readouterr().err
    frames = [r["max_new_tokens"] for r in server.requests[1:]]  # after the warm-up request
    assert len(frames) == 80 and all(25 <= f <= 250 for f in frames)
    assert len(set(frames)) > 10  # drawn per request, not one length for all
    # Every level walks the same seeded length sequence (at 100-200 req/s two requests may reach
    # the server in either order, so compare what each level sent, and each index below).
    assert sorted(frames[:40]) == sorted(frames[40:])
    assert all(r["min_new_tokens"] == r["max_new_tokens"] for r in server.requests)  # --fixed-length
    data = json.loads((tmp_path / "results.json").read_text())
    dist = data["conditions"]["length_distribution"]
    assert dist["spec"] == "mixed:2:20" and dist["kind"] == "truncated log-normal"
    assert dist["lo_s"] == 2.0 and dist["hi_s"] == 20.0 and dist["target_mean_s"] == 4.8
    realised = dist["realised"]
    assert realised["num_requests"] == 80
    assert realised["mean_s"] == pytest.approx(sum(frames) / 80 / 12.5)
    assert realised["min_s"] == min(frames) / 12.5 and realised["max_s"] == max(frames) / 12.5
    assert "mixed:2:20" in data["conditions"]["frames_per_request"]
    assert "realised over 80 requests" in data["conditions"]["frames_per_request"]
    per_index = [[r["extra"]["max_new_tokens"] for r in level["records"]] for level in data["levels"]]
    assert per_index[0] == per_index[1] and sorted(per_index[0]) == sorted(frames[:40])
    for level in data["levels"]:
        assert level["requested_length"]["num_requests"] == 40
    assert data["highest_gap_free_load"]["open"]["loads"] == [100, 200]
    assert "realised over 80 requests" in (tmp_path / "results.md").read_text()


def test_cli_closed_loop_mixed_lengths_and_fixed_default(tmp_path):
    with FakeSpeechServer([(0.0, LOUD)]) as server:
        rc = main(
            ["--url", server.url, "--concurrency", "2", "--num-requests", "6", "--warmup", "0",
             "--length-dist", "mixed:2:20", "--out", str(tmp_path / "mix"), "--no-progress", "--no-plots"]
        )  # fmt: skip
        assert rc == 0
        frames = [r["max_new_tokens"] for r in server.requests]
        assert len(frames) == 6 and all(25 <= f <= 250 for f in frames)
        assert all("min_new_tokens" not in r for r in server.requests)
        server.requests.clear()
        rc = main(
            ["--url", server.url, "--concurrency", "2", "--num-requests", "3", "--warmup", "0",
             "--max-new-tokens", "30", "--out", str(tmp_path / "fixed"), "--no-progress", "--no-plots"]
        )  # fmt: skip
    assert rc == 0
    assert [r["max_new_tokens"] for r in server.requests] == [30, 30, 30]
    data = json.loads((tmp_path / "fixed" / "results.json").read_text())
    dist = data["conditions"]["length_distribution"]
    assert dist["spec"] == "fixed" and dist["realised"]["mean_s"] == pytest.approx(30 / 12.5)
    assert data["conditions"]["frames_per_request"] == "max 30"
    assert "max_new_tokens" not in data["levels"][0]["records"][0]["extra"]
    assert main(["--length-dist", "mixed:20:2", "--out", str(tmp_path)]) == 1


def test_cli_counts_refusals_and_reports_the_highest_gap_free_load(tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello\nreject\n")
    with FakeSpeechServer([(0.0, LOUD)]) as server:
        rc = main(
            ["--url", server.url, "--concurrency", "1", "2", "--num-requests", "4", "--warmup", "0",
             "--prompts", str(prompts), "--out", str(tmp_path / "out"), "--no-progress", "--no-plots"]
        )  # fmt: skip
    assert rc == 0
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    for level in data["levels"]:
        agg = level["aggregates"]
        assert agg["num_refused"] == 2 and agg["refused_share"] == 0.5 and agg["refusals"] == {"429": 2}
        assert agg["num_errors"] == 0 and agg["errors"] == {}
        assert agg["refusal_latency_s"]["p50"] > 0 and agg["refusal_latency_s"]["p95"] is not None
        assert not level["gap_free"]
    assert data["highest_gap_free_load"]["closed"]["highest"] is None
    out = capsys.readouterr().out
    assert "| 50.0% |" in out  # refused share in the table
    assert "Highest gap-free load (closed loop, zero underruns and 100% success): none" in out
    md = (tmp_path / "out" / "results.md").read_text()
    assert "Highest gap-free load" in md and "Refused by status" in md


async def test_per_request_frames_override_the_shared_option():
    from benchmarks.transport import http_payload

    options = SynthesisOptions(task_type="custom_voice", voice="v", max_new_tokens=125, fixed_length=True)
    payload = http_payload(options, "hi", 0, max_new_tokens=33)
    assert payload["max_new_tokens"] == 33 and payload["min_new_tokens"] == 33
    assert http_payload(options, "hi", 0)["max_new_tokens"] == 125
    synth = GrpcSynthesizer("127.0.0.1:1", options)
    try:
        request = synth.request("hi", 0, max_new_tokens=33)
        assert request.max_new_frames == 33 and request.sampling.min_new_frames == 33
        assert synth.request("hi", 0).max_new_frames == 125
    finally:
        await synth.aclose()


def test_cli_levels_over_several_client_processes(tmp_path):
    """--processes 2: each level's requests are split over two spawned clients and merged back
    into one level with every index once, the same prompts, and unique seeds."""
    script = [(0.0, LOUD), (0.01, LOUD)]
    with FakeSpeechServer(script) as server:
        rc = main(
            [
                "--url", server.url, "--concurrency", "3", "--num-requests", "5", "--warmup", "0",
                "--max-new-tokens", "5", "--out", str(tmp_path), "--no-progress", "--no-plots",
                "--processes", "2",
            ]
        )  # fmt: skip
    assert rc == 0
    data = json.loads((tmp_path / "results.json").read_text())
    (level,) = data["levels"]
    assert level["client_processes"] == 2
    assert level["aggregates"]["num_ok"] == 5
    assert [r["index"] for r in level["records"]] == list(range(5))
    assert all(r["start_s"] >= 0 for r in level["records"]) and level["wall_s"] > 0
    assert len(server.requests) == 5 and len({r["seed"] for r in server.requests}) == 5
    prompts = read_prompts(build_parser().get_default("prompts"))
    assert sorted(r["input"] for r in server.requests) == sorted(prompts[:5])


async def test_a_refusal_records_its_retry_after():
    import httpx

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(429, headers={"retry-after": "7"}, json={"error": {"message": "busy"}})

    client = HttpSynthesizer("http://gateway:8000/", OPTIONS, transport=httpx.MockTransport(handler))
    try:
        record = await client.synthesize(0, 0, "x")
    finally:
        await client.aclose()
    assert record.status == "429" and record.extra["retry_after_s"] == 7.0 and record.error == "busy"


async def test_a_refusal_s_retry_after_ms_comes_first_as_the_openai_sdk_reads_it():
    import httpx

    def handler(request: httpx.Request) -> httpx.Response:
        headers = {"retry-after": "2", "retry-after-ms": "2750"}
        return httpx.Response(429, headers=headers, json={"error": {"message": "busy"}})

    client = HttpSynthesizer("http://gateway:8000/", OPTIONS, transport=httpx.MockTransport(handler))
    try:
        record = await client.synthesize(0, 0, "x")
    finally:
        await client.aclose()
    assert record.extra["retry_after_s"] == 2.75


def test_refusal_probe_times_refusals_from_the_idle_parent(tmp_path, monkeypatch):
    """--refusal-probe-s with --processes 2: while the workers run the level, the parent sends one
    1-frame request at a time; its refusals are timed apart (`probe`), not among the level's."""
    from benchmarks import refusal_probe

    monkeypatch.setattr(refusal_probe, "PROBE_TEXT", "reject")  # the fake server's 429
    script = [(0.0, LOUD), (0.2, LOUD)]
    with FakeSpeechServer(script) as server:
        rc = main(
            [
                "--url", server.url, "--concurrency", "2", "--num-requests", "4", "--warmup", "0",
                "--max-new-tokens", "5", "--out", str(tmp_path), "--no-progress", "--no-plots",
                "--processes", "2", "--refusal-probe-s", "0.01",
            ]
        )  # fmt: skip
    assert rc == 0
    (level,) = json.loads((tmp_path / "results.json").read_text())["levels"]
    probe = level["probe"]
    assert probe["sent"] >= 1 and probe["statuses"] == {"429": probe["sent"]}
    assert probe["refusal_latency_s"]["p50"] > 0 and probe["every_s"] == 0.01
    assert level["aggregates"]["num_requests"] == 4 and level["aggregates"]["num_ok"] == 4
    probes = [r for r in server.requests if r["input"] == "reject"]
    assert len(probes) == probe["sent"] and {r["max_new_tokens"] for r in probes} == {1}


def test_level_shards_and_merge_keep_every_request_once():
    from benchmarks.loadgen import LevelRun
    from benchmarks.metrics import RequestRecord
    from benchmarks.multiproc import LevelSpec, merge, shard

    spec = LevelSpec("closed", total=7, offset=0, concurrency=5)
    shards = [shard(spec, w, 3) for w in range(3)]
    assert [s[0] for s in shards] == [[0, 3, 6], [1, 4], [2, 5]]
    assert [s[1] for s in shards] == [2, 2, 1]  # 5 slots over 3 workers
    open_spec = LevelSpec("open", total=4, offset=0, arrivals=(0.0, 0.5, 1.0, 1.5))
    assert shard(open_spec, 1, 2) == ([1, 3], None, [0.5, 1.5])

    def rec(i: int, start: float) -> RequestRecord:
        return RequestRecord(index=i, prompt_index=i, start_s=start, ok=True, status="ok")

    a = LevelRun(records=[rec(0, 0.0), rec(2, 1.0)], wall_s=3.0, loop_lag_s=[0.001, 0.002])
    b = LevelRun(records=[rec(1, 0.0)], wall_s=1.0, aborted=1, hit_deadline=True, loop_lag_s=[0.3])
    merged = merge([(10.0, a), (10.5, b)])
    assert [r.index for r in merged.records] == [0, 1, 2]
    assert [r.start_s for r in merged.records] == [0.0, 0.5, 1.0]
    assert merged.wall_s == 3.0 and merged.aborted == 1 and merged.hit_deadline
    assert sorted(merged.loop_lag_s) == [0.001, 0.002, 0.3]  # every process's samples


def test_cli_spreads_requests_over_several_gateway_urls(tmp_path):
    """--url a,b: request i goes to gateway i mod 2, as a Service over two gateway pods."""
    script = [(0.0, LOUD)]
    with FakeSpeechServer(script) as first, FakeSpeechServer(script) as second:
        rc = main(
            [
                "--url", f"{first.url},{second.url}", "--concurrency", "2", "--num-requests", "4",
                "--warmup", "0", "--max-new-tokens", "5", "--out", str(tmp_path), "--no-progress",
                "--no-plots",
            ]
        )  # fmt: skip
    assert rc == 0
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["levels"][0]["aggregates"]["num_ok"] == 4
    assert len(first.requests) == 2 and len(second.requests) == 2


# --- results after every level, atomic writes -------------------------------------------------


def test_results_are_on_disk_after_level_one_while_level_two_runs(tmp_path):
    """A sweep killed during level 2 (an outer `timeout`) keeps level 1: results.json and
    results.md hold it before level 2's first request reaches the server."""
    seen: dict[str, object] = {}

    def on_request(body):
        # Seeds are seed + level_no * 1_000_000 + index: the first of level 2 is 1_000_000.
        if body["seed"] >= 1_000_000 and "json" not in seen:
            path = tmp_path / "results.json"
            seen["json"] = json.loads(path.read_text()) if path.exists() else None
            md = tmp_path / "results.md"
            seen["md"] = md.read_text() if md.exists() else None

    with FakeSpeechServer([(0.0, LOUD)], on_request=on_request) as server:
        rc = main(
            ["--url", server.url, "--concurrency", "1", "2", "--num-requests", "3", "--warmup", "0",
             "--max-new-tokens", "5", "--seed", "0", "--out", str(tmp_path), "--no-progress",
             "--no-plots"]
        )  # fmt: skip
    assert rc == 0
    partial = seen["json"]
    assert partial is not None, "no results.json after level 1"
    (level,) = partial["levels"]
    assert level["concurrency"] == 1 and level["aggregates"]["num_ok"] == 3
    assert partial["highest_gap_free_load"]["closed"]["highest"] == 1
    assert partial["conditions"]["length_distribution"]["realised"]["num_requests"] == 3
    assert "| c=1 |" in seen["md"] and "| c=2 |" not in seen["md"]
    final = json.loads((tmp_path / "results.json").read_text())
    assert [lv["concurrency"] for lv in final["levels"]] == [1, 2]
    assert final["levels"][0]["aggregates"] == level["aggregates"]
    assert not list(tmp_path.glob(".writing-*"))  # no temporary folder left behind


def _small_result(levels: int = 1) -> dict:
    from benchmarks.loadgen import LevelRun
    from benchmarks.metrics import build_record
    from benchmarks.report import level_result

    record = build_record(
        index=0, prompt_index=0, start_s=0.0, chunk_times_s=[0.05, 0.1], chunk_bytes=[4800, 4800],
        e2e_s=0.2, ok=True, status="200",
    )  # fmt: skip
    run = LevelRun(records=[record], wall_s=0.2)
    return {
        "conditions": {"gpu": "none", "length_distribution": {"realised": None}},
        "levels": [level_result("closed", run, concurrency=c + 1) for c in range(levels)],
    }


def test_write_results_matches_write_report_byte_for_byte(tmp_path):
    from benchmarks.client import write_results
    from benchmarks.report import write_report

    result = _small_result(2)
    atomic = write_results(result, tmp_path / "atomic", plots=False)
    plain = write_report(result, tmp_path / "plain", plots=False)
    assert atomic.keys() == plain.keys() == {"json", "markdown"}
    for key in atomic:
        assert atomic[key].parent == tmp_path / "atomic"
        assert atomic[key].read_bytes() == plain[key].read_bytes()
    assert sorted(p.name for p in (tmp_path / "atomic").iterdir()) == ["results.json", "results.md"]


def test_write_results_killed_mid_write_keeps_the_previous_file(tmp_path, monkeypatch):
    import benchmarks.client as client

    client.write_results(_small_result(1), tmp_path, plots=False)
    before = (tmp_path / "results.json").read_bytes()

    def torn_write(result, out_dir, *, plots=True):
        from pathlib import Path

        (Path(out_dir) / "results.json").write_text('{"conditions": {"gpu"')  # truncated
        raise OSError("disk full")

    monkeypatch.setattr(client, "write_report", torn_write)
    with pytest.raises(OSError):
        client.write_results(_small_result(2), tmp_path, plots=False)
    assert (tmp_path / "results.json").read_bytes() == before
    assert not list(tmp_path.glob(".writing-*"))


# --- warm clients --------------------------------------------------------------------------------


async def test_http_warm_sends_a_health_request_and_no_synthesis():
    import httpx

    seen: list[tuple[str, str]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.method, request.url.path))
        return httpx.Response(200, json={"status": "ok"})

    client = HttpSynthesizer("http://gateway:8000/", OPTIONS, transport=httpx.MockTransport(handler), pools=3)
    try:
        await client.warm()
    finally:
        await client.aclose()
    assert seen == [("GET", "/health")] * 3  # one through each connection pool


async def test_http_requests_spread_over_the_connection_pools():
    """Request i goes through pool i mod pools: no one pool holds every connection of a level
    (httpcore's per-request work grows with its pool's connections, faster than linearly)."""
    import httpx

    client = HttpSynthesizer(
        "http://gateway:8000/", OPTIONS, transport=httpx.MockTransport(lambda r: httpx.Response(429)), pools=4
    )
    used: list[int] = []

    def note(i: int):
        async def hook(request) -> None:
            used.append(i)

        return hook

    for i, pool in enumerate(client._clients):
        pool.event_hooks["request"] = [note(i)]
    try:
        records = [await client.synthesize(index, 0, "x") for index in range(8)]
    finally:
        await client.aclose()
    assert used == [0, 1, 2, 3, 0, 1, 2, 3] and {r.status for r in records} == {"429"}


async def test_http_warm_failure_is_one_stderr_line(capsys):
    from benchmarks.transport import warm_or_log

    client = HttpSynthesizer("http://127.0.0.1:1", OPTIONS)  # nothing listens on port 1
    try:
        assert await warm_or_log(client.warm, 5.0, "client process 3") is False
    finally:
        await client.aclose()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "client process 3" in err[0] and "warming the client failed" in err[0]


async def test_grpc_warm_checks_health_on_every_channel_and_sends_no_synthesis():
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_health.v1._async import HealthServicer

    class CountingHealth(HealthServicer):
        checks = 0

        async def Check(self, request, context):
            CountingHealth.checks += 1
            return await super().Check(request, context)

    servicer = FakeTextToSpeech()
    server = grpc.aio.server()
    tts_pb2_grpc.add_TextToSpeechServiceServicer_to_server(servicer, server)
    health = CountingHealth()
    await health.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = GrpcSynthesizer(f"127.0.0.1:{port}", OPTIONS, channels=2)
    try:
        await client.warm()
        states = [c.get_state() for c in client._channels]
    finally:
        await client.aclose()
        await server.stop(None)
    assert CountingHealth.checks == 2 and servicer.requests == []
    assert states == [grpc.ChannelConnectivity.READY] * 2


async def test_grpc_warm_accepts_a_server_without_the_health_service():
    servicer = FakeTextToSpeech()
    server = grpc.aio.server()
    tts_pb2_grpc.add_TextToSpeechServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = GrpcSynthesizer(f"127.0.0.1:{port}", OPTIONS)
    try:
        await client.warm()  # UNIMPLEMENTED: still a round trip on a connected channel
    finally:
        await client.aclose()
        await server.stop(None)
    assert servicer.requests == []


async def test_worker_warms_before_the_common_start_and_starts_on_time(capsys):
    """benchmarks.multiproc: the worker warms its client before `start_at`, sends nothing before
    it, and a failing warm-up is one stderr line, not a failed level."""
    import time

    from benchmarks.metrics import RequestRecord
    from benchmarks.multiproc import LevelSpec, _drive

    for fail in (False, True):
        events: list[tuple[str, float]] = []

        def make_sender(args, spec, fail=fail, events=events):
            async def send(index):
                events.append(("send", time.perf_counter()))
                return RequestRecord(index=index, prompt_index=0, start_s=0.0, ok=True, status="ok")

            async def aclose():
                events.append(("close", time.perf_counter()))

            async def warm():
                events.append(("warm", time.perf_counter()))
                if fail:
                    raise ConnectionError("refused")

            return send, aclose, warm

        spec = LevelSpec("closed", total=4, offset=0, concurrency=2)
        start_at = time.perf_counter() + 0.3
        started, run = await _drive(None, spec, 0, 2, start_at, None, make_sender)
        kinds = [kind for kind, _ in events]
        assert kinds == ["warm", "send", "send", "close"]
        assert events[0][1] < start_at <= events[1][1] and started >= start_at
        assert [r.index for r in run.records] == [0, 2]
        err = capsys.readouterr().err
        assert (err.count("warming the client failed") == 1) is fail


def test_cli_warms_each_client_once_without_synthesis(tmp_path, monkeypatch):
    """One process: one GET /health per connection pool before the first level (two levels);
    --processes 2: that per worker per level. The speech requests are exactly the level's requests."""
    from benchmarks import multiproc
    from benchmarks.transport import POOLS

    # A worker warms only within the wait for the common start; spawning two workers that import
    # the client takes longer than the default 2 s on a loaded machine (the suite's parallel run).
    monkeypatch.setattr(multiproc, "START_DELAY_S", 8.0)
    script = [(0.0, LOUD)]
    with FakeSpeechServer(script) as server:
        rc = main(
            ["--url", server.url, "--concurrency", "1", "2", "--num-requests", "2", "--warmup", "0",
             "--max-new-tokens", "5", "--out", str(tmp_path / "one"), "--no-progress", "--no-plots"]
        )  # fmt: skip
    assert rc == 0
    assert server.gets.count("/health") == POOLS and len(server.requests) == 4
    with FakeSpeechServer(script) as server:
        rc = main(
            ["--url", server.url, "--concurrency", "2", "--num-requests", "4", "--warmup", "0",
             "--max-new-tokens", "5", "--out", str(tmp_path / "two"), "--no-progress", "--no-plots",
             "--processes", "2"]
        )  # fmt: skip
    assert rc == 0
    assert server.gets.count("/health") == 2 * POOLS and len(server.requests) == 4


def test_warm_up_requests_are_short_unless_told_otherwise(tmp_path):
    """The warm-up's requests ask for --warmup-frames (44 by default) frames, the levels' for theirs;
    --warmup-frames 0 sends the levels' length in the warm-up too."""
    for extra, warm_frames in (([], 44), (["--warmup-frames", "5"], 5), (["--warmup-frames", "0"], 30)):
        with FakeSpeechServer([(0.0, LOUD)]) as server:
            rc = main(
                ["--url", server.url, "--concurrency", "1", "--num-requests", "2", "--warmup", "2",
                 "--max-new-tokens", "30", "--out", str(tmp_path / str(warm_frames)), "--no-progress",
                 "--no-plots", *extra]
            )  # fmt: skip
        assert rc == 0
        assert [r["max_new_tokens"] for r in server.requests] == [warm_frames, warm_frames, 30, 30]
    assert main(["--url", "http://127.0.0.1:9", "--warmup-frames", "-1", "--no-progress"]) == 1  # refused


def test_voice_pool_draws_distinct_clips_zipf_and_records_the_mix(tmp_path):
    """--voice-pool: each request sends one of N distinct clips, drawn Zipf (the first clips most),
    the same draw in every process; the level reports the repeats an unbounded cache would hit."""
    with FakeSpeechServer([(0.0, LOUD)]) as server:
        rc = main(
            ["--url", server.url, "--concurrency", "8", "--num-requests", "120", "--warmup", "0",
             "--voice-pool", "20", "--voice-pool-zipf", "1.0", "--seed", "5",
             "--out", str(tmp_path), "--no-progress", "--no-plots"]
        )  # fmt: skip
    assert rc == 0
    clips = [r["ref_audio"] for r in server.requests]
    assert len(clips) == 120 and all(c.startswith("data:audio/") for c in clips)
    counts = sorted((clips.count(c) for c in set(clips)), reverse=True)
    assert 5 < len(counts) <= 20  # many distinct voices, never more than the pool
    assert counts[0] > 3 * counts[-1]  # Zipf: the most drawn clip far above the rarest
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["conditions"]["voice_mix"] == "pool of 20 synthetic clips, Zipf 1"
    level = data["levels"][0]
    voices = [r["extra"]["voice"] for r in level["records"]]
    assert len(set(voices)) == len(counts)
    mix = level["voice_mix"]
    assert mix["pool"] == 20 and mix["distinct"] == len(counts)
    assert mix["repeat_share"] == pytest.approx(1 - len(counts) / 120)


def test_voice_pool_is_the_same_over_http_and_grpc_and_checked():
    pool = (b"RIFF-a", b"RIFF-b", b"RIFF-c")
    options = SynthesisOptions(
        task_type="voice_clone", ref_text="t", ref_pool=pool, ref_pool_zipf=0.0, seed=1
    )
    picks = [options.voice_for(i) for i in range(300)]
    assert set(picks) == {0, 1, 2} and min(picks.count(v) for v in range(3)) > 60  # Zipf 0: uniform
    assert picks == [options.voice_for(i) for i in range(300)]  # deterministic per index
    grpc_client = GrpcSynthesizer.__new__(GrpcSynthesizer)
    grpc_client._pb, grpc_client.options, grpc_client._prefix = tts_pb2, options, "t"
    http = HttpSynthesizer("http://127.0.0.1:1", options)
    for i in range(6):
        assert grpc_client.request("x", i).reference_audio == pool[picks[i]]
        assert http._pool_urls[picks[i]].endswith(__import__("base64").b64encode(pool[picks[i]]).decode())
    with pytest.raises(ValueError, match="ref_pool_zipf"):
        SynthesisOptions(ref_pool=pool, ref_pool_zipf=-1)
    with pytest.raises(ValueError, match="--voice-pool"):
        BenchConfig.from_args(build_parser().parse_args(["--voice-pool", "3", "--task-type", "custom_voice"]))


def test_voice_pool_warm_sends_every_pool_voice_once_before_the_levels(tmp_path):
    with FakeSpeechServer([(0.0, LOUD)]) as server:
        rc = main(
            ["--url", server.url, "--concurrency", "2", "--num-requests", "6", "--warmup", "0",
             "--voice-pool", "5", "--voice-pool-warm", "--out", str(tmp_path), "--no-progress", "--no-plots"]
        )  # fmt: skip
    assert rc == 0
    warm, levels = server.requests[:5], server.requests[5:]
    assert len({r["ref_audio"] for r in warm}) == 5 and all(r["max_new_tokens"] == 2 for r in warm)
    assert len(levels) == 6 and {r["ref_audio"] for r in levels} <= {r["ref_audio"] for r in warm}
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["warmup"]["voice_pool_warm"]["voices"] == 5 and data["warmup"]["voice_pool_warm"]["ok"] == 5


def test_workers_that_miss_the_common_start_wait_for_each_other():
    """benchmarks.multiproc: a worker not ready by `start_at` (its warm-up 0.5 s late) holds the
    others at the barrier, and every worker's first request goes out together, not in waves as
    each becomes ready; an idle worker (no requests of its own) still counts at the barrier."""
    import asyncio
    import threading
    import time

    from benchmarks.metrics import RequestRecord
    from benchmarks.multiproc import LevelSpec, _drive

    first_send: dict[int, float] = {}

    def make_sender_for(worker, warm_s):
        def make_sender(args, spec):
            async def send(index):
                first_send.setdefault(worker, time.perf_counter())
                return RequestRecord(index=index, prompt_index=0, start_s=0.0, ok=True, status="ok")

            async def aclose():
                pass

            async def warm():
                await asyncio.sleep(warm_s)

            return send, aclose, warm

        return make_sender

    spec = LevelSpec("closed", total=2, offset=0, concurrency=2)  # workers 0 and 1 send, 2 is idle
    barrier = threading.Barrier(3, timeout=10)
    start_at = time.perf_counter() + 0.1
    late_s = {0: 0.0, 1: 0.6, 2: 0.0}
    results = {}

    def run(worker):
        results[worker] = asyncio.run(
            _drive(
                None, spec, worker, 3, start_at, None, make_sender_for(worker, late_s[worker]), barrier.wait
            )
        )

    threads = [threading.Thread(target=run, args=(w,)) for w in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert sorted(first_send) == [0, 1]
    assert first_send[0] >= start_at + 0.5  # waited for worker 1's warm-up
    assert abs(first_send[0] - first_send[1]) < 0.1  # together
    assert [r.index for r in results[0][1].records] == [0] and results[2][1].records == []
