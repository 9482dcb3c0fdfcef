"""Tracing and request ids across the four services as separate processes: the stack exports OTLP
to a collector in this test; one synthesis request with a named voice yields one trace with spans
from the gateway, talker, speaker_cache and code2wav, and its X-Request-Id appears in every
service's JSON log."""

from __future__ import annotations

import base64
import io
import json
import threading
import time
import urllib.request
import wave
from concurrent import futures

import grpc
import numpy as np
import pytest

pytest.importorskip("opentelemetry.sdk", reason="the tracing extra is not installed")
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc  # noqa: E402

from services.launcher import StackConfig, StartupError, start_stack  # noqa: E402

pytestmark = pytest.mark.e2e


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP trace receiver: (service.name, span) for every exported span."""

    def __init__(self):
        self.spans: list[tuple[str, object]] = []
        self.lock = threading.Lock()

    def Export(self, request, context):
        with self.lock:
            for rs in request.resource_spans:
                service = next(
                    (a.value.string_value for a in rs.resource.attributes if a.key == "service.name"), ""
                )
                for ss in rs.scope_spans:
                    self.spans += [(service, span) for span in ss.spans]
        return trace_service_pb2.ExportTraceServiceResponse()


def _tone_wav(seconds: float = 1.0, rate: int = 24000) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((0.3 * np.sin(2 * np.pi * 220 * t) * 32767).astype("<i2").tobytes())
    return buf.getvalue()


def _post(url: str, body: dict, headers: dict | None = None) -> tuple[int, bytes, dict]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, resp.read(), dict(resp.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), dict(exc.headers)


def test_one_request_is_one_trace_over_four_services_and_its_id_is_in_every_log(tmp_path):
    collector = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
        "TTS_LOG_FORMAT": "json",
    }
    config = StackConfig.on_free_ports(startup_timeout_s=300.0, drain_seconds=2.0, log_dir=tmp_path / "logs")
    try:
        stack = start_stack(config, env=env)
    except StartupError as exc:
        server.stop(0)
        pytest.fail(f"stack did not start: {exc}")
    rid = "trace-test-0001"
    try:
        status, body, _ = _post(
            f"{stack.http_url}/v1/audio/voices",
            {"name": "tracer", "audio": base64.b64encode(_tone_wav()).decode(), "x_vector_only_mode": True},
        )
        assert status in (200, 201), body[:300]
        status, audio, headers = _post(
            f"{stack.http_url}/v1/audio/speech",
            {
                "input": "Hello.",
                "voice": "tracer",
                "max_new_tokens": 6,
                "response_format": "pcm",
                "stream": False,
            },
            headers={"X-Request-Id": rid},
        )
        assert status == 200 and audio, audio[:300]
        assert {k.lower(): v for k, v in headers.items()}["x-request-id"] == rid
        wanted = {"qtts-gateway", "qtts-talker", "qtts-speaker_cache", "qtts-code2wav"}
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with collector.lock:
                spans = list(collector.spans)
            http = [s for svc, s in spans if svc == "qtts-gateway" and s.name == "HTTP POST /v1/audio/speech"]
            if http:
                trace_id = http[0].trace_id
                services = {svc for svc, s in spans if s.trace_id == trace_id}
                if wanted <= services:
                    break
            time.sleep(0.2)
        else:
            pytest.fail(f"spans seen: {sorted({(svc, s.name) for svc, s in spans})}")
        in_trace = [(svc, s) for svc, s in spans if s.trace_id == trace_id]
        names = {(svc, s.name) for svc, s in in_trace}
        assert ("qtts-talker", "talker.v1.TalkerService/Generate") in names
        assert ("qtts-code2wav", "code2wav.v1.Code2WavService/Decode") in names
        # Parent links: every span but the HTTP one has its parent in the same trace.
        ids = {s.span_id for _, s in in_trace}
        assert all(s.parent_span_id in ids for _, s in in_trace if s is not http[0])
        # The talker's stage timings are attributes of the gateway's span.
        keys = {a.key for a in http[0].attributes}
        assert {"qtts.total_ns", "qtts.first_audio_ns", "qtts.code2wav_replica"} <= keys
    finally:
        stack.stop(grace=10.0)
        server.stop(0)
    for service in ("gateway", "talker", "speaker_cache", "code2wav"):
        logs = list((tmp_path / "logs").glob(f"{service}*.log"))
        assert logs, service
        lines = []
        for log in logs:
            for line in log.read_text().splitlines():
                try:
                    lines.append(json.loads(line))
                except ValueError:
                    pass  # output that is not a log record (e.g. a library's print)
        assert any(entry.get("request_id") == rid for entry in lines), f"{service}: no log line with {rid}"
