"""code2wav measures what its decode calls cost and publishes it on its credit grants."""

from __future__ import annotations

import math

import pytest

from services.code2wav.decode_cost import DecodeCost
from tests.services.code2wav.test_code2wav import _codes, _start, code2wav, run_stream


def test_the_fit_separates_the_per_call_cost_from_the_per_frame_cost():
    cost = DecodeCost(refit_s=0.0)
    assert cost.estimate() is None
    t = 0.0
    for frames in (4, 16, 64, 128, 8, 256) * 20:  # 2 ms a call + 30 us a frame, 10 calls a second
        t += 0.1
        cost.observe(frames, 0.002 + 0.00003 * frames, t)
    est = cost.estimate()
    assert est.call_s == pytest.approx(0.002, rel=1e-6)
    assert est.frame_s == pytest.approx(0.00003, rel=1e-6)
    assert est.calls_per_s == pytest.approx(10.0)


def test_calls_of_one_size_put_the_whole_call_on_its_frames_and_idle_gaps_are_capped():
    cost = DecodeCost(max_gap_s=1.0, refit_s=0.0)
    for i in range(5):
        cost.observe(16, 0.0032, 10.0 * i)  # 10 s apart: each gap counts 1 s
    est = cost.estimate()
    assert (est.call_s, est.frame_s) == (0.0, pytest.approx(0.0002))
    assert est.calls_per_s == pytest.approx(1.0)
    cost.observe(0, 1.0, 60.0)  # ignored: no frames
    cost.observe(16, math.nan, 60.0)
    assert cost.estimate() == est
    with pytest.raises(ValueError):
        DecodeCost(memory_calls=1)


def test_calls_slowed_beside_the_talker_s_steps_do_not_count_as_the_decoder_s_cost():
    """Three calls in four ran beside a frame step and took 4x as long: the fit follows the calls
    made on a free GPU (2 ms a call, 30 us a frame), not the mean. (Seven sizes to every four
    calls: the calls on a free GPU come in every size, as they do in a stack.)"""
    cost = DecodeCost(refit_s=0.0)
    t = 0.0
    for i, frames in enumerate((4, 16, 64, 128, 8, 256, 32) * 28):
        t += 0.05
        alone = 0.002 + 0.00003 * frames
        cost.observe(frames, alone if i % 4 == 0 else 4 * alone, t)
    est = cost.estimate()
    assert est.call_s == pytest.approx(0.002, rel=0.01) and est.frame_s == pytest.approx(0.00003, rel=0.01)


def test_small_calls_keep_the_per_frame_cost_of_the_last_wide_fit():
    """An idle replica's calls (one stream, 1-8 frames, about 3 ms each, noisy) cannot tell a
    frame's cost from a call's: the per-frame cost stays what calls of wide sizes measured, and
    the small calls set the per-call part. Before, a line through them put 57 us on a frame."""
    cost = DecodeCost(refit_s=0.0)
    for _ in range(3):
        for frames in (1, 16, 1024):  # start-up calibration: 2 ms a call + 25 us a frame
            cost.calibrate(frames, 0.002 + 0.000025 * frames)
    est = cost.estimate()
    assert est.frame_s == pytest.approx(0.000025, rel=1e-6) and est.call_s == pytest.approx(0.002, rel=1e-6)
    assert est.calls_per_s == 0.0  # back-to-back calibration calls are no call rate
    t = 0.0
    for i in range(200):
        t += 0.1
        frames = (1, 2, 4, 8)[i % 4]
        cost.observe(frames, 0.003 + (0.0004 if i % 3 else 0.0) + 0.00006 * frames, t)
    est = cost.estimate()
    assert est.frame_s == pytest.approx(0.000025, rel=1e-6)
    assert 0.003 <= est.call_s <= 0.0032
    assert est.calls_per_s == pytest.approx(10.0)
    # Wide calls again: the per-frame cost follows them.
    for frames in (16, 256, 1024, 64) * 60:
        t += 0.05
        cost.observe(frames, 0.002 + 0.00003 * frames, t)
    assert cost.estimate().frame_s == pytest.approx(0.00003, rel=1e-6)


async def test_a_replica_publishes_a_calibrated_cost_before_any_stream(fake_decoder):
    """Start-up decodes one frame, one chunk and a wide batch: the fit has both parts before the
    first stream, and no call rate."""
    async with code2wav(fake_decoder) as (server, _stub):
        est = server.engine.cost.estimate()
        sizes = server.engine.calibration_calls()
    assert sizes[0] == (1, 1) and sizes[-1][0] > 1
    assert est is not None and est.frame_s > 0 and est.calls_per_s == 0.0


def test_the_fit_is_refreshed_at_most_every_refit_interval():
    cost = DecodeCost(refit_s=1.0)
    cost.observe(10, 0.001, 0.0)
    first = cost.estimate()
    cost.observe(10, 0.003, 0.5)  # within the interval: the estimate stays
    assert cost.estimate() is first
    cost.observe(10, 0.003, 1.2)
    assert cost.estimate().frame_s > first.frame_s


async def test_credit_grants_carry_the_replica_s_measured_decode_cost(fake_decoder, bidi_client):
    async with code2wav(fake_decoder) as (server, stub):
        await run_stream(bidi_client, stub, _codes(12))
        est = server.engine.cost.estimate()
        assert est is not None and est.frame_s > 0
        client = bidi_client(stub.Decode)
        client.send(_start())
        msg = await client.read()
        assert msg.WhichOneof("event") == "credit"
        assert msg.credit.decode_frame_ns == round(est.frame_s * 1e9) > 0
        assert msg.credit.decode_call_ns == round(est.call_s * 1e9)
        assert msg.credit.decode_calls_per_s == pytest.approx(est.calls_per_s, rel=1e-6)
        client.call.cancel()


# An H100's decoder alone, as its start-up calibration read it: 1.85 ms a call + 19 us a frame.
ALONE_CALL_S, ALONE_FRAME_S = 0.00185, 0.000019
LIVE_SIZES = (16, 64, 128, 256, 32)


def _calibrated(**kw) -> DecodeCost:
    cost = DecodeCost(refit_s=0.0, **kw)
    for _ in range(3):
        for frames in (1, 16, 1024):
            cost.calibrate(frames, ALONE_CALL_S + ALONE_FRAME_S * frames)
    return cost


def _feed(cost: DecodeCost, call_s: float, frame_s: float, t: float = 0.0, jitter: bool = False) -> float:
    """300 calls of the live sizes at `call_s + frame_s * frames` (with `jitter`, every call but
    each seventh up to 60% slower: an envelope across every size); returns the clock after them."""
    for i, frames in enumerate(LIVE_SIZES * 60):
        t += 0.01
        slower = 1.0 + 0.1 * (i % 7) if jitter else 1.0
        cost.observe(frames, slower * (call_s + frame_s * frames), t)
    return t


def test_a_burst_of_contended_calls_is_held_within_the_ceiling_over_the_calibration():
    """A closed loop's opening: every call in memory ran beside a prefill-heavy step (3.4x the
    decoder alone, as an H100 stack read, 65 against 19 us a frame). The published cost stays
    within CONTENTION_CEILING of the start-up calibration; a steady load's envelope at 1.3x the
    calibration is published as measured. The per-call part is not bounded."""
    cost = _calibrated()
    t = _feed(cost, 3.4 * ALONE_CALL_S, 3.4 * ALONE_FRAME_S)  # the burst
    est = cost.estimate()
    ceiling = DecodeCost.CONTENTION_CEILING
    assert est.frame_s == pytest.approx(ceiling * 0.000019, rel=1e-6)
    assert est.call_s == pytest.approx(3.4 * 0.00185, rel=1e-6)
    _feed(cost, 1.3 * ALONE_CALL_S, 1.3 * ALONE_FRAME_S, t)  # a steady load, below the ceiling
    est = cost.estimate()
    assert est.frame_s == pytest.approx(1.3 * 0.000019, rel=1e-6)
    assert est.call_s == pytest.approx(1.3 * 0.00185, rel=1e-6)


def test_without_a_calibration_nothing_bounds_the_fit():
    cost = DecodeCost(refit_s=0.0)
    _feed(cost, 3.4 * ALONE_CALL_S, 3.4 * ALONE_FRAME_S)
    assert cost.estimate().frame_s == pytest.approx(3.4 * 0.000019, rel=1e-6)


def test_the_ceiling_is_a_flag_and_zero_turns_it_off():
    from qtts.request.errors import InvalidArgument
    from services.code2wav.config import config_from_args

    assert config_from_args([]).decode_cost_ceiling == DecodeCost.CONTENTION_CEILING
    assert config_from_args(["--decode-cost-ceiling", "2"]).decode_cost_ceiling == 2.0
    for bad in ("0.5", "-1", "nan", "inf"):
        with pytest.raises(InvalidArgument, match="--decode-cost-ceiling"):
            config_from_args(["--decode-cost-ceiling", bad])
    for bad in (0.5, -1.0, math.nan):
        with pytest.raises(ValueError, match="contention_ceiling"):
            DecodeCost(contention_ceiling=bad)
    cost = _calibrated(contention_ceiling=0.0)
    _feed(cost, 3.4 * ALONE_CALL_S, 3.4 * ALONE_FRAME_S)
    assert cost.estimate().frame_s == pytest.approx(3.4 * 0.000019, rel=1e-6)


async def test_a_replica_bounds_its_published_cost_by_the_flag(fake_decoder):
    """The server hands `--decode-cost-ceiling` to its cost fit: after its start-up calibration,
    calls five times as slow publish twice the calibration's cost a frame."""
    async with code2wav(fake_decoder, decode_cost_ceiling=2.0) as (server, _stub):
        cost = server.engine.cost
        alone = cost.estimate()
        assert alone is not None and alone.frame_s > 0
        _feed(cost, 5 * alone.call_s, 5 * alone.frame_s, t=1e6, jitter=True)
        assert cost.estimate().frame_s == pytest.approx(2.0 * alone.frame_s, rel=1e-6)


def test_a_calibration_of_no_time_sets_no_bound():
    cost = DecodeCost(refit_s=0.0)
    cost.calibrate(16, 0.0)
    assert cost.estimate().frame_s == 0.0
    _feed(cost, 0.002, 0.00003)
    assert cost.estimate().frame_s == pytest.approx(0.00003, rel=1e-6)
