"""Pure parts of the load mix and its verdicts: the per-request length distribution, refusal
accounting, the TTFA tail ratio and the highest gap-free load of a run."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.loadgen import FRAMES_PER_SECOND, LengthDistribution, LevelRun, length_stats
from benchmarks.metrics import build_record, is_refusal, summarize
from benchmarks.report import gap_free_lines, highest_gap_free_load, is_gap_free, level_result, markdown_table

# --- length distribution -------------------------------------------------------------------------


def test_fixed_is_the_default_and_has_no_draws():
    fixed = LengthDistribution.parse("fixed")
    assert fixed.is_fixed and fixed == LengthDistribution()
    assert fixed.describe()["spec"] == "fixed"
    with pytest.raises(ValueError):
        fixed.frames(3)


def test_mixed_lengths_are_seeded_and_prefix_stable():
    mix = LengthDistribution.parse("mixed:2:20")
    assert mix.frames(200, seed=3) == mix.frames(200, seed=3)
    assert mix.frames(200, seed=3) != mix.frames(200, seed=4)
    # Levels of different sizes see the same lengths for the same request indices.
    assert mix.frames(500, seed=3)[:200] == mix.frames(200, seed=3)
    assert mix.frames(0) == []


def test_mixed_lengths_stay_in_bounds_with_the_target_mean():
    mix = LengthDistribution.parse("mixed:2:20")
    seconds = np.asarray(mix.seconds(20000, seed=0))
    assert seconds.min() >= 2.0 and seconds.max() <= 20.0
    assert seconds.mean() == pytest.approx(4.8, abs=0.1)
    # Mostly short replies with a long tail: median below the mean, some requests above 12 s.
    assert 3.5 < np.median(seconds) < 4.8 and 0.005 < np.mean(seconds > 12.0) < 0.1
    frames = np.asarray(mix.frames(20000, seed=0))
    assert frames.min() >= 25 and frames.max() <= 250  # 2 s and 20 s at 12.5 frames/s
    assert frames.dtype.kind == "i"
    assert frames.mean() / FRAMES_PER_SECOND == pytest.approx(4.8, abs=0.1)
    # A small run's realised mean is near the target too (about 2.5 s spread / sqrt(n)).
    for seed in range(5):
        assert np.mean(mix.frames(256, seed=seed)) / FRAMES_PER_SECOND == pytest.approx(4.8, abs=0.6)


def test_mixed_mean_can_be_set_and_is_honoured():
    mix = LengthDistribution.parse("mixed:1:10:3")
    seconds = mix.seconds(20000, seed=1)
    assert min(seconds) >= 1.0 and max(seconds) <= 10.0
    assert np.mean(seconds) == pytest.approx(3.0, abs=0.07)
    d = mix.describe()
    assert d["kind"] == "truncated log-normal" and d["lo_s"] == 1.0 and d["hi_s"] == 10.0
    assert d["target_mean_s"] == 3.0 and d["log_sigma"] == pytest.approx(0.6)


@pytest.mark.parametrize(
    "spec", ["mixed", "mixed:2", "mixed:20:2", "mixed:2:20:25", "mixed:0:20", "lognormal:2:20", "mixed:a:b"]
)
def test_bad_length_specs_are_rejected(spec):
    with pytest.raises(ValueError):
        LengthDistribution.parse(spec)


def test_length_stats_of_the_requests_sent():
    stats = length_stats([25, 50, None, 250])
    assert stats["num_requests"] == 3
    assert stats["min_s"] == 2.0 and stats["max_s"] == 20.0
    assert stats["mean_s"] == pytest.approx(325 / 3 / 12.5) and stats["mean_frames"] == pytest.approx(325 / 3)
    assert length_stats([None, None]) is None and length_stats([]) is None


# --- refusals and the TTFA tail ----------------------------------------------------------------------


def _rec(index, *, ok=True, status="200", times=(0.1, 0.2), sizes=(48000, 48000), e2e=0.3):
    return build_record(
        index=index,
        prompt_index=0,
        start_s=0.0,
        chunk_times_s=list(times),
        chunk_bytes=list(sizes),
        e2e_s=e2e,
        ok=ok,
        status=status,
    )


def _refused(index, status="429", e2e=0.002):
    return _rec(index, ok=False, status=status, times=(), sizes=(), e2e=e2e)


def test_refusals_are_counted_apart_from_errors():
    records = [
        _rec(0),
        _refused(1, "429", 0.001),
        _refused(2, "RESOURCE_EXHAUSTED", 0.003),
        _refused(3, "429", 0.005),
        _rec(4, ok=False, status="500", times=(), sizes=(), e2e=0.5),
        # RESOURCE_EXHAUSTED after audio started: a broken stream, not an admission refusal.
        _rec(5, ok=False, status="RESOURCE_EXHAUSTED", times=(0.1,), sizes=(4800,), e2e=0.4),
    ]
    assert [is_refusal(r) for r in records] == [False, True, True, True, False, False]
    agg = summarize(records, wall_s=1.0)
    assert agg["num_requests"] == 6 and agg["num_ok"] == 1 and agg["num_failed"] == 5
    assert agg["num_refused"] == 3 and agg["num_errors"] == 2
    assert agg["refused_share"] == pytest.approx(0.5)
    assert agg["refusals"] == {"429": 2, "RESOURCE_EXHAUSTED": 1}
    assert agg["errors"] == {"500": 1, "RESOURCE_EXHAUSTED": 1}
    lat = agg["refusal_latency_s"]
    assert lat["p50"] == pytest.approx(0.003) and lat["p95"] == pytest.approx(0.0048)
    assert lat["max"] == pytest.approx(0.005)


def test_no_refusals_and_empty_levels():
    agg = summarize([_rec(0), _rec(1)], wall_s=1.0)
    assert agg["num_refused"] == 0 and agg["refused_share"] == 0.0 and agg["refusals"] == {}
    assert agg["refusal_latency_s"]["p50"] is None
    empty = summarize([], wall_s=0.0)
    assert empty["refused_share"] is None and empty["ttfa_p99_over_p50"] is None


def test_ttfa_p99_over_p50():
    records = [_rec(i, times=(0.1 if i < 99 else 1.1, 2.0)) for i in range(100)]
    agg = summarize(records, wall_s=1.0)
    ttfa = agg["ttfa_s"]
    assert agg["ttfa_p99_over_p50"] == pytest.approx(ttfa["p99"] / ttfa["p50"])
    assert agg["ttfa_p99_over_p50"] > 1.0
    flat = summarize([_rec(i) for i in range(10)], wall_s=1.0)
    assert flat["ttfa_p99_over_p50"] == pytest.approx(1.0)


# --- highest gap-free load --------------------------------------------------------------------------


def _clean():
    return [_rec(i) for i in range(4)]


def _stalled():
    # Chunk 1 arrives 1 s after chunk 0 with only 0.5 s received: 0.5 s underrun.
    return [_rec(0), _rec(1, times=(0.1, 1.1), sizes=(24000, 24000))]


def _level(mode, load, records, *, aborted=0, hit_deadline=False):
    run = LevelRun(records=records, wall_s=1.0, aborted=aborted, hit_deadline=hit_deadline)
    if mode == "closed":
        return level_result("closed", run, concurrency=load)
    return level_result("open", run, rate=load)


def test_a_level_passes_only_with_zero_underrun_and_full_success():
    assert _level("closed", 1, _clean())["gap_free"]
    assert not _level("closed", 1, _stalled())["gap_free"]
    assert not _level("closed", 1, [*_clean(), _refused(9)])["gap_free"]  # a refusal is a failure
    assert not _level("closed", 1, [*_clean(), _rec(9, ok=False, status="500")])["gap_free"]
    assert not _level("closed", 1, _clean(), aborted=1, hit_deadline=True)["gap_free"]
    assert not _level("closed", 1, [])["gap_free"]
    # A tiny underrun is still an underrun (only float rounding is forgiven).
    late = [_rec(0, times=(0.1, 1.1001), sizes=(48000, 48000))]
    assert not _level("closed", 1, late)["gap_free"]
    assert is_gap_free(summarize(_clean(), 1.0))


def test_highest_gap_free_load_per_mode():
    levels = [
        _level("closed", 1, _clean()),
        _level("closed", 8, _clean()),
        _level("closed", 32, _stalled()),
        _level("closed", 64, [*_clean(), _refused(9)]),
        _level("open", 2.0, _clean()),
        _level("open", 5.0, _stalled()),
        _level("open", 10.0, _clean()),  # passes although 5 req/s did not: reported, flagged
    ]
    summary = highest_gap_free_load(levels)
    assert summary["closed"]["highest"] == 8 and summary["closed"]["gap_free"] == [1, 8]
    assert summary["closed"]["loads"] == [1, 8, 32, 64]
    assert summary["closed"]["not_gap_free_below_highest"] == []
    assert summary["open"]["highest"] == 10.0 and summary["open"]["not_gap_free_below_highest"] == [5.0]
    lines = gap_free_lines(levels)
    assert lines[0].endswith(": c=8")
    assert lines[1].endswith(": 10 req/s (but 5 req/s did not pass)")
    table = markdown_table(levels)
    assert "| yes |" in table.splitlines()[2] and "| no |" in table.splitlines()[4]


def test_highest_gap_free_load_when_nothing_passes_or_a_mode_did_not_run():
    levels = [_level("open", 4.0, _stalled()), _level("open", 8.0, [_refused(0)])]
    summary = highest_gap_free_load(levels)
    assert set(summary) == {"open"} and summary["open"]["highest"] is None
    assert gap_free_lines(levels) == [
        "Highest gap-free load (open loop, zero underruns and 100% success): "
        "none (no level passed: 4 req/s, 8 req/s)"
    ]
    assert highest_gap_free_load([]) == {} and gap_free_lines([]) == []


def test_a_load_measured_twice_passes_only_if_both_passed():
    levels = [_level("closed", 4, _clean()), _level("closed", 4, _stalled()), _level("closed", 2, _clean())]
    assert highest_gap_free_load(levels)["closed"]["highest"] == 2


def test_results_saved_before_gap_free_existed_are_still_judged():
    level = _level("closed", 4, _clean())
    del level["gap_free"]
    assert highest_gap_free_load([level])["closed"]["highest"] == 4
