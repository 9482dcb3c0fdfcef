"""Underrun, first-audible detection, percentiles and aggregates on hand-built stream traces."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.metrics import (
    PCM_BYTES_PER_SECOND,
    AudibleDetector,
    build_record,
    dbfs_to_s16_amplitude,
    max_underrun_s,
    percentiles,
    summarize,
)

CHUNK_80MS = 3840  # 80 ms of 24 kHz s16 mono


def test_on_time_stream_has_zero_underrun():
    # Every chunk arrives exactly when the previous one finishes playing (0.25 s chunks, dyadic times).
    times = [0.5 + 0.25 * i for i in range(20)]
    sizes = [PCM_BYTES_PER_SECOND // 4] * 20
    assert max_underrun_s(times, sizes) == 0.0


def test_stream_faster_than_real_time_has_zero_underrun():
    times = [0.1 + 0.05 * i for i in range(50)]
    assert max_underrun_s(times, [CHUNK_80MS] * 50) == 0.0


def test_known_stall_is_reported_exactly():
    # 0.2 s chunks; chunk 3 arrives 0.8 s after chunk 0 although only 0.6 s of audio came before it.
    times = [0.1, 0.2, 0.3, 0.9, 0.95, 1.0]
    sizes = [9600] * 6
    # chunk 3: 0.8 s played vs 0.6 s received -> 0.2 s; chunk 4: 0.85 vs 0.8 -> 0.05; chunk 5: 0.9 vs 1.0 -> 0.
    assert max_underrun_s(times, sizes) == pytest.approx(0.2, abs=1e-12)
    assert max_underrun_s(times[:5], sizes[:5]) == pytest.approx(0.2, abs=1e-12)
    assert max_underrun_s(times[:3] + [0.75], sizes[:4]) == pytest.approx(0.05, abs=1e-12)


def test_late_first_chunk_with_on_time_rest_has_zero_underrun():
    # Playback starts when the first chunk has arrived: a slow start is TTFA, not an underrun.
    times = [2.0] + [2.0 + 0.07 * i for i in range(1, 30)]
    assert max_underrun_s(times, [CHUNK_80MS] * 30) == 0.0


def test_underrun_accumulates_from_the_first_chunk_clock():
    # A stall is not forgiven later: playback never pauses, so every later chunk is measured on the
    # original clock (vLLM-Omni's definition).
    sizes = [4800, 4800, 4800]  # 0.1 s each
    assert max_underrun_s([0.0, 1.0, 1.01], sizes) == pytest.approx(0.9, abs=1e-12)
    # The stall hits the last chunk: 1.02 s played, 0.2 s received.
    assert max_underrun_s([0.0, 0.05, 1.02], sizes) == pytest.approx(0.82, abs=1e-12)


def test_empty_chunks_are_ignored_and_lengths_must_match():
    assert max_underrun_s([0.0, 0.5, 0.6], [0, 4800, 4800]) == 0.0
    assert max_underrun_s([], []) == 0.0
    with pytest.raises(ValueError):
        max_underrun_s([0.0, 1.0], [10])


def test_percentiles_on_known_data():
    stats = percentiles([float(v) for v in range(1, 101)] + [None])
    assert stats["p50"] == pytest.approx(50.5)
    assert stats["p90"] == pytest.approx(90.1)
    assert stats["p95"] == pytest.approx(95.05)
    assert stats["p99"] == pytest.approx(99.01)
    assert stats["mean"] == pytest.approx(50.5)
    assert stats["max"] == 100.0
    assert percentiles([7.0])["p99"] == 7.0
    assert percentiles([None])["p50"] is None


def test_audible_detector_across_odd_chunk_boundaries():
    samples = np.zeros(2000, dtype="<i2")
    samples[700] = 1000  # well above -50 dBFS (about 104)
    samples[100] = 50  # quiet: below the threshold
    data = samples.tobytes()
    detector = AudibleDetector(-50.0)
    assert detector.feed(data[:1001]) is False  # splits sample 500 in the middle
    assert detector.feed(data[1001:1403]) is True  # holds sample 700 (bytes 1400-1401)
    assert detector.first_audible_sample == 700
    assert detector.feed(data[1403:]) is False  # only the first one counts


def test_audible_detector_ignores_quiet_stream():
    detector = AudibleDetector(-50.0)
    quiet = np.full(5000, 100, dtype="<i2").tobytes()
    assert detector.feed(quiet) is False
    assert not detector.found
    assert dbfs_to_s16_amplitude(0.0) == 32768.0
    assert dbfs_to_s16_amplitude(-50.0) == pytest.approx(103.6, abs=0.1)


def test_build_record_derives_ttfa_audio_rtf_and_underrun():
    record = build_record(
        index=3,
        prompt_index=1,
        start_s=10.0,
        chunk_times_s=[0.05, 0.1, 0.2, 1.0],
        chunk_bytes=[0, 4800, 48000, 48000],
        e2e_s=1.1,
        ok=True,
        status="200",
        first_audible_s=0.2,
    )
    assert record.ttfa_s == 0.1  # first non-empty chunk
    assert record.audio_s == pytest.approx(2.1)
    assert record.rtf == pytest.approx(1.1 / 2.1)
    # chunk at 1.0: 0.9 s played, 1.1 s received -> no underrun; chunk at 0.2: 0.1 played vs 0.1 -> none.
    assert record.max_underrun_s == 0.0
    assert record.first_audible_s == 0.2
    failed = build_record(
        index=0,
        prompt_index=0,
        start_s=0.0,
        chunk_times_s=[],
        chunk_bytes=[],
        e2e_s=0.01,
        ok=False,
        status="429",
    )
    assert (
        failed.ttfa_s is None and failed.rtf is None and failed.max_underrun_s is None and failed.audio_s == 0
    )


def _record(index, *, ok=True, status="200", times=(0.1, 0.2), sizes=(48000, 48000), e2e=0.3):
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


def test_summarize_aggregates():
    records = [
        _record(0),  # 2 s of audio, no underrun
        _record(1, times=(0.1, 3.1)),  # 3 s after the first chunk, only 1 s received: 2 s underrun
        _record(2, ok=False, status="429", times=(), sizes=()),
        _record(3, ok=False, status="TRANSPORT", times=(0.1,), sizes=(24000,)),  # 0.5 s delivered, then cut
    ]
    agg = summarize(records, wall_s=4.0)
    assert agg["num_requests"] == 4 and agg["num_ok"] == 2 and agg["num_failed"] == 2
    assert agg["success_rate"] == 0.5
    assert agg["zero_underrun_share"] == 0.5
    assert agg["pass_rate"] == 0.25
    assert agg["audio_s_total"] == pytest.approx(4.5)
    assert agg["xrt"] == pytest.approx(4.5 / 4.0)
    assert agg["requests_per_s"] == pytest.approx(0.5)
    # The 429 is a refusal, counted apart from the other errors (num_failed has both).
    assert agg["errors"] == {"TRANSPORT": 1} and agg["num_errors"] == 1
    assert agg["refusals"] == {"429": 1} and agg["num_refused"] == 1 and agg["refused_share"] == 0.25
    assert agg["max_underrun_s"]["max"] == pytest.approx(2.0)
    assert agg["ttfa_s"]["p50"] == pytest.approx(0.1)
    assert set(agg["rtf"]) >= {"p50", "p90", "p95", "p99"}
    assert agg["audio_s"]["mean"] == pytest.approx(2.0)  # successful requests only
    empty = summarize([], wall_s=0.0)
    assert empty["success_rate"] is None and empty["xrt"] is None and empty["ttfa_s"]["p50"] is None
