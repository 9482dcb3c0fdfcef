"""benchmarks/host_probe.py: the host's CPU use between two snapshots (steal included) and a Python
loop's time, as launch_gpu_stack.sh records them beside each sweep and stack_summary prints them."""

from __future__ import annotations

import json

import pytest

from benchmarks import host_probe
from benchmarks.stack_summary import ScrapedMetrics, cpu_lines, summary

STAT_BEFORE = """cpu  1000 0 200 8000 100 0 50 0 0 0
cpu0 500 0 100 4000 50 0 25 0 0 0
cpu1 500 0 100 4000 50 0 25 0 0 0
intr 12345
ctxt 999
"""
# 1,000 ticks later: 400 user, 100 system, 50 softirq, 300 idle, 0 iowait, 150 steal.
STAT_AFTER = """cpu  1400 0 300 8300 100 0 100 150 0 0
cpu0 700 0 150 4150 50 0 50 75 0 0
cpu1 700 0 150 4150 50 0 50 75 0 0
"""


def test_the_aggregate_counters_and_the_cpu_count_are_parsed():
    parsed = host_probe.parse_stat(STAT_BEFORE)
    assert parsed["cpus"] == 2
    assert parsed["counters"] == {
        "user": 1000,
        "nice": 0,
        "system": 200,
        "idle": 8000,
        "iowait": 100,
        "irq": 0,
        "softirq": 50,
        "steal": 0,
    }
    # An older kernel's shorter line: the missing counters are 0.
    assert host_probe.parse_stat("cpu  10 0 5 100\ncpu0 10 0 5 100\n")["counters"]["steal"] == 0
    with pytest.raises(ValueError, match="no aggregate"):
        host_probe.parse_stat("cpu0 1 2 3 4\n")


def test_the_shares_between_two_snapshots_count_steal_apart_from_busy():
    before = {"time": 100.0, **host_probe.parse_stat(STAT_BEFORE)}
    after = {"time": 110.0, **host_probe.parse_stat(STAT_AFTER)}
    u = host_probe.usage(before, after)
    assert u["seconds"] == pytest.approx(10.0)
    assert u["cpus"] == 2
    assert u["busy"] == pytest.approx(0.55)  # 400 user + 100 system + 50 softirq of 1,000
    assert u["user"] == pytest.approx(0.40)
    assert u["system"] == pytest.approx(0.15)
    assert u["idle"] == pytest.approx(0.30)
    assert u["steal"] == pytest.approx(0.15)
    assert u["busy"] + u["idle"] + u["steal"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="no CPU time"):
        host_probe.usage(before, before)


def test_snap_and_report_from_the_command_line(tmp_path, capsys):
    stat_a, stat_b = tmp_path / "a.stat", tmp_path / "b.stat"
    stat_a.write_text(STAT_BEFORE)
    stat_b.write_text(STAT_AFTER)
    before, after, out = tmp_path / "before.json", tmp_path / "after.json", tmp_path / "host-cpu.json"
    assert host_probe.main(["snap", str(before), "--stat", str(stat_a)]) == 0
    assert host_probe.main(["snap", str(after), "--no-loop", "--stat", str(stat_b)]) == 0
    assert json.loads(before.read_text())["loop_ms"] > 0  # the loop was timed
    assert "loop_ms" not in json.loads(after.read_text())
    assert host_probe.main(["report", str(before), str(after), "--out", str(out)]) == 0
    line = capsys.readouterr().out.strip()
    report = json.loads(out.read_text())
    assert report["line"] == line
    assert report["usage"]["steal"] == pytest.approx(0.15)
    assert "busy 55% (user 40%, system 15%), steal 15.0%, idle 30%" in line
    assert "python loop of 3M before / after: " in line and line.endswith(" / - ms")


def test_the_real_proc_stat_is_read(tmp_path):
    # This machine's own counters (Linux): one snapshot and a second, without the loop.
    a = host_probe.snap(loop=False)
    b = host_probe.snap(loop=False)
    assert a["cpus"] >= 1 and set(a["counters"]) == set(host_probe.STAT_FIELDS)
    assert all(b["counters"][f] >= a["counters"][f] for f in host_probe.STAT_FIELDS)


def test_stack_summary_prints_the_host_line_of_each_run(tmp_path):
    run = tmp_path / "http1"
    (run / "idle").mkdir(parents=True)
    for folder, steal in ((run, 0.15), (run / "idle", 0.0)):
        line = f"host over the sweep (10 s, 16 cpus): busy 40% (user 30%, system 10%), steal {steal:.1%}"
        (folder / "host-cpu.json").write_text(json.dumps({"line": line}))
        (folder / "metrics-talker.txt").write_text("")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "host-cpu.json").write_text("{")
    (tmp_path / "broken" / "metrics-talker.txt").write_text("")
    text = summary([tmp_path])
    assert "  host over the sweep (10 s, 16 cpus): busy 40% (user 30%, system 10%), steal 15.0%" in text
    assert "steal 0.0%" in text  # the idle sweep's own line
    assert "host-cpu.json unreadable" in text


def test_stack_summary_names_what_outlived_a_stack(tmp_path):
    """run_h200.sh stacks' leftovers.txt: shown when something outlived the stack, else nothing."""
    left, clean = tmp_path / "http1", tmp_path / "http2"
    for run in (left, clean):
        run.mkdir()
        (run / "metrics-talker.txt").write_text("")
    (left / "leftovers.txt").write_text(
        "processes:\n4242 python3 -c from multiprocessing.spawn import spawn_main\n"
        "gpu:\n4242, python3, 70000 MiB\n"
    )
    (clean / "leftovers.txt").write_text("processes:\ngpu:\nNo running processes found\n")
    text = summary([tmp_path])
    assert "left running after the stack stopped (killed before the next): 1 processes" in text
    assert "4242 python3 -c from multiprocessing.spawn import spawn_main" in text
    assert "gpu: 4242, python3, 70000 MiB" in text
    assert text.count("left running after the stack stopped") == 1  # the clean stack says nothing


def test_stack_summary_gives_each_service_s_cpu_since_the_idle_requests(tmp_path):
    """A service's process CPU between the idle sweep's scrape and the level's, over the time
    between the two pages: the cores it used on average."""
    import os

    run = tmp_path / "http1"
    (run / "idle").mkdir(parents=True)
    before, after = run / "idle" / "metrics-talker.txt", run / "metrics-talker.txt"
    before.write_text("# TYPE process_cpu_seconds_total counter\nprocess_cpu_seconds_total 100.0\n")
    after.write_text("# TYPE process_cpu_seconds_total counter\nprocess_cpu_seconds_total 112.5\n")
    os.utime(before, (1000.0, 1000.0))
    os.utime(after, (1020.0, 1020.0))
    text = summary([run])
    assert "  CPU since the idle requests' scrape (20 s before): 12.5 s" in text
    assert "cores at most" not in text  # no level's wall time to divide by
    # The idle run's own page has no baseline before it: no line there.
    assert text.count("CPU since the idle requests") == 1
    # With the levels' wall time (summary: the run's results.json), the cores at most.
    assert cpu_lines(after, ScrapedMetrics(after.read_text()), 25.0) == [
        "  CPU since the idle requests' scrape (20 s before): 12.5 s; over the levels' 25 s, 0.50 cores at most"
    ]
