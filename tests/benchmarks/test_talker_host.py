"""benchmarks/talker_host.py: the stand-in model's generator, and one short run through the real
talker and code2wav services (processes of their own) driven as the gateway drives the talker."""

from __future__ import annotations

import json

import pytest

from benchmarks.talker_host import SleepGenerator, Spec, StandInBundle, main
from services.launcher.config import free_port


def test_the_stand_in_model_makes_the_frames_its_text_asks_for():
    bundle = StandInBundle()
    prompt = bundle.build_prompt(Spec(text="frames=3"))
    gen = SleepGenerator(max_batch=4, step_s=0.0, per_stream_s=0.0)
    gen.add("a", prompt, bundle.generation_defaults)
    gen.add("b", bundle.build_prompt(Spec(text="frames=9")), bundle.generation_defaults, max_new_frames=2)
    made = {"a": 0, "b": 0}
    ended = []
    while gen.num_active:
        for out in gen.step():
            if out.codes is not None:
                made[out.request_id] += 1
            if out.finished:
                ended.append(out.request_id)
    assert made == {"a": 3, "b": 2} and sorted(ended) == ["a", "b"]


def test_the_stand_in_step_pays_for_the_requests_added_since_the_last(monkeypatch):
    """--prefill-ms: each request added makes the next step that much longer, once."""
    slept = []
    monkeypatch.setattr("benchmarks.talker_host.time.sleep", slept.append)
    bundle = StandInBundle()
    gen = SleepGenerator(max_batch=4, step_s=0.004, per_stream_s=0.0, prefill_s=0.002)
    for rid in ("a", "b"):
        gen.add(rid, bundle.build_prompt(Spec(text="frames=5")), bundle.generation_defaults)
    gen.step()
    gen.step()
    assert slept == [pytest.approx(0.008), pytest.approx(0.004)]


def short_run(tmp_path, streams: int, *flags: str) -> dict:
    """A 1 s level of `streams` on free ports, with `flags`; its results JSON."""
    out = tmp_path / "talker.json"
    ports = [str(free_port()) for _ in range(4)]
    argv = [
        "--streams",
        str(streams),
        "--seconds",
        "1",
        "--clip-s",
        "0.8",
        "--ramp-s",
        "0.1",
        "--out",
        str(out),
    ]
    argv += ["--port", ports[0], "--metrics-port", ports[1], "--code2wav-port", ports[2]]
    argv += ["--code2wav-metrics-port", ports[3], *flags]
    assert main(argv) == 0
    return json.loads(out.read_text())


def test_a_short_run_through_the_real_talker_and_code2wav(tmp_path, capsys):
    result = short_run(tmp_path, 4, "--talker-args", "--queue-budget-share 1")
    assert result["conditions"]["talker_args"] == ["--queue-budget-share", "1"]
    (level,) = result["levels"]
    assert level["errors"] == {} and level["refused"] == 0
    assert level["finished"] >= 4 and level["gap_free_share"] is not None
    assert 0 < level["ttfa_s"]["p50"] <= level["ttfa_s"]["max"]
    assert level["talker_stages"]["prompt_queue"]["count"] >= 4
    assert level["talker_chunk_hop_means_s"] and level["talker_cpu_per_s"] > 0
    assert "streams     4: finished" in capsys.readouterr().out


def test_a_short_run_with_the_engine_in_its_own_process_started_through_the_gateway_pool(tmp_path):
    """As on the GPU: the stand-in model is loaded by the spawned engine process (installed there
    from the environment), and streams are started as the gateway starts them (its room watched)."""
    result = short_run(tmp_path, 3, "--engine-process", "--gateway-pool")
    assert result["conditions"]["engine"] == "own process"
    assert result["conditions"]["driver"] == "gateway pool (watch)"
    (level,) = result["levels"]
    assert level["errors"] == {} and level["refused"] == 0 and level["finished"] >= 3
    assert level["talker_stages"]["build_prompt"]["count"] >= 3  # built in the engine process
    assert level["capacity_poll_s"]["count"] <= 2  # the room came from the watch, not from polls
