"""benchmarks/stack_host.py: a short run of the real gateway, talker and code2wav (GPUs stood in)
with the real benchmark client, leaving what stack_summary reads."""

from __future__ import annotations

import json

from benchmarks.stack_host import main
from services.launcher.config import free_port

FLAGS = ("http_port", "grpc_port", "gateway_metrics_port", "talker_port", "talker_metrics_port",
         "code2wav_port", "code2wav_metrics_port", "speaker_cache_port")  # fmt: skip


def test_a_short_run_through_the_whole_stack_leaves_results_and_every_service_s_metrics(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["--out", str(out), "--idle-first", "2", "--prefill-ms", "1", "--client-args"]
    argv += ["--task-type custom_voice --voice {voice} --no-ref-audio --concurrency 3 --num-requests 6 "
             "--max-new-tokens 10 --time-limit 60"]  # fmt: skip
    for flag in FLAGS:
        argv += [f"--{flag.replace('_', '-')}", str(free_port())]
    assert main(argv) == 0
    (level,) = json.loads((out / "results.json").read_text())["levels"]
    assert level["concurrency"] == 3 and level["gap_free"] is True
    assert level["aggregates"]["num_requests"] == 6 and level["aggregates"]["success_rate"] == 1.0
    for service in ("gateway", "talker", "code2wav"):
        assert "tts_event_loop_lag_seconds" in (out / f"metrics-{service}.txt").read_text()
        assert (out / "idle" / f"metrics-{service}.txt").is_file()
    (idle,) = json.loads((out / "idle" / "results.json").read_text())["levels"]
    assert idle["concurrency"] == 1 and idle["aggregates"]["num_requests"] == 2
    printed = capsys.readouterr().out
    assert "| c=3 | 100.0 |" in printed and "talker_first_chunk_hop_seconds" in printed
