"""The step model's figures are trimmed means of recent steps: single slow steps and runs of small,
noisy batches leave the capacity where the steady steps put it, and a lasting change of the step's
cost (another process comes to share the GPU) is followed within a window."""

from __future__ import annotations

import random

import pytest

from services.talker.admission import Admission, AdmissionConfig, StepModel, trimmed_mean

BASE_S, PER_STREAM_S = 0.0044, 0.00002  # the stand-in H200 frame step


def test_the_trimmed_mean_drops_a_quarter_of_the_weight_at_each_end():
    assert trimmed_mean([(5.0, 1.0)]) == 5.0
    assert trimmed_mean([(1.0, 1.0), (2.0, 1.0), (3.0, 1.0), (100.0, 1.0)]) == pytest.approx(2.5)
    # Weights count: one heavy sample outweighs three light outliers on either side.
    assert trimmed_mean([(0.0, 1.0), (10.0, 10.0), (50.0, 1.0), (90.0, 1.0)]) == pytest.approx(10.0)
    assert trimmed_mean([(1.0, 0.0), (3.0, 0.0)]) == 3.0  # no weight: the middle sample


def _noisy_steps(rng: random.Random, n: int, per_stream_s: float = PER_STREAM_S):
    """(batch, seconds) as a shared GPU gives them: steady large batches with 2% jitter, one step in
    ten stalled by 5-40 ms, and now and then a run of small batches, each slowed by 2-15 ms (the
    tail of a closed-loop level while the decoder and the aligner finish its streams' audio)."""
    i = 0
    while i < n:
        if rng.random() < 0.05:
            for _ in range(rng.randint(10, 30)):
                b = rng.randint(9, 30)
                yield b, BASE_S + per_stream_s * b + rng.uniform(0.002, 0.015)
                i += 1
            continue
        b = rng.randint(300, 600)
        s = (BASE_S + per_stream_s * b) * rng.uniform(0.98, 1.02)
        if rng.random() < 0.1:
            s += rng.uniform(0.005, 0.04)
        yield b, s
        i += 1


def test_slow_steps_and_small_noisy_batches_leave_the_capacity_steady():
    cfg = AdmissionConfig(step_base_s=BASE_S, step_per_stream_s=PER_STREAM_S)
    adm = Admission(cfg)
    true_capacity = adm.capacity(10.0)
    rng = random.Random(7)
    slopes, capacities = [], []
    for k, (b, s) in enumerate(_noisy_steps(rng, 4000)):
        if k % 50 == 0:
            adm.model.observe(2, BASE_S + PER_STREAM_S * 2 + rng.uniform(0.0, 0.002))  # an idle-time step
        adm.model.observe(b, s)
        if k >= 200:
            slopes.append(adm.model.per_stream_s)
            capacities.append(adm.capacity(10.0))
    # The stalls add about 2.2 ms a step on average: the fit may lean that way, not swing.
    assert min(slopes) >= 0.85 * PER_STREAM_S and max(slopes) <= 1.25 * PER_STREAM_S
    assert min(capacities) >= 0.8 * true_capacity and max(capacities) <= 1.1 * true_capacity


def test_a_lasting_change_of_the_step_cost_is_followed_within_a_window():
    m = StepModel(AdmissionConfig(step_base_s=BASE_S, step_per_stream_s=PER_STREAM_S))
    rng = random.Random(3)
    for b, s in _noisy_steps(rng, 500):
        m.observe(b, s)
    assert m.per_stream_s == pytest.approx(PER_STREAM_S, rel=0.2)
    # The GPU is now shared: every stream costs twice as much, for good.
    for b, s in _noisy_steps(rng, 120, per_stream_s=2 * PER_STREAM_S):
        m.observe(b, s)
    assert m.per_stream_s == pytest.approx(2 * PER_STREAM_S, rel=0.2)


def test_one_stalled_prefill_does_not_move_what_a_prefill_costs():
    m = StepModel(
        AdmissionConfig(step_base_s=BASE_S, step_per_stream_s=PER_STREAM_S, prefill_request_s=0.002)
    )
    for _ in range(40):
        m.observe(300, m.predict(300) + 2 * 0.002, prefill_positions=600, prefill_requests=2)
    m.observe(300, m.predict(300) + 0.5, prefill_positions=300, prefill_requests=1)  # a 0.5 s stall
    assert m.prefill_request_s == pytest.approx(0.002, rel=0.05)
    assert m.prefill_position_s == pytest.approx(2 * 0.002 / 600, rel=0.05)


def test_a_bursts_shared_prefill_steps_set_the_cost_of_a_prefill_within_a_few_steps():
    """An idle talker prefills one prompt a step, and that step's fixed cost falls on the one
    prompt (2.7 ms on an H100, bdbd10a); a burst prefills sixteen a step at 0.9 ms each. Each
    step's figure counts by its prompts, so four such steps outweigh thirty idle ones: the steady
    load the burst becomes is not costed at the idle figure (which held a c=768 opening's
    capacity near 700 streams where the costs of its own steps allow about 860)."""
    m = StepModel(AdmissionConfig(step_base_s=BASE_S, step_per_stream_s=PER_STREAM_S, prefill_request_s=0.01))
    for _ in range(30):
        m.observe(2, m.predict(2) + 0.0027, prefill_positions=299, prefill_requests=1)
    assert m.prefill_request_s == pytest.approx(0.0027)
    for _ in range(4):
        m.observe(600, m.predict(600) + 16 * 0.0009, prefill_positions=16 * 299, prefill_requests=16)
    assert m.prefill_request_s < 0.0013
    # The per-position figure (the prefill budget's) still counts each step once.
    assert m.prefill_position_s == pytest.approx(0.0027 / 299, rel=0.05)


def test_the_window_flags_are_checked():
    for bad in ({"fit_steps": 0}, {"fit_stream_steps": 0}):
        with pytest.raises(ValueError, match="fit_steps"):
            AdmissionConfig(**bad)


def test_the_uncontended_fit_reads_the_step_as_it_runs_alone():
    """Half the steps overlap the decoder's calls and take 60% longer: the typical fit reads the
    contended mix, the uncontended one the step alone (the decoder's published cost is its own
    lower envelope, so the two are summed without counting the overlap twice)."""
    rng = random.Random(5)
    steps = []
    for _ in range(400):
        b = rng.randint(300, 600)
        s = (BASE_S + PER_STREAM_S * b) * rng.uniform(0.99, 1.01)
        steps.append((b, s * 1.6 if rng.random() < 0.5 else s))
    fitted = {}
    for fit in ("typical", "uncontended"):
        m = StepModel(AdmissionConfig(step_base_s=BASE_S, step_per_stream_s=PER_STREAM_S, step_fit=fit))
        for b, s in steps:
            m.observe(b, s)
        fitted[fit] = m.per_stream_s
    assert fitted["uncontended"] == pytest.approx(PER_STREAM_S, rel=0.05)
    assert fitted["typical"] > 1.2 * PER_STREAM_S
    with pytest.raises(ValueError, match="step_fit"):
        AdmissionConfig(step_fit="median")


def test_the_talker_flag_picks_the_fit():
    from services.talker.config import config_from_args

    assert config_from_args([]).admission_step_fit == "typical"
    assert config_from_args(["--admission-step-fit", "uncontended"]).admission_step_fit == "uncontended"
    with pytest.raises(SystemExit):
        config_from_args(["--admission-step-fit", "median"])


def test_a_fresh_talker_keeps_its_prior_until_a_window_holds_enough_steps():
    """A cold start's few slow steps (one prefill of 300 ms on a loaded CPU) do not set the capacity
    alone: each figure stays at its prior until its window holds MIN_SAMPLES steps."""
    cfg = AdmissionConfig(step_base_s=BASE_S, step_per_stream_s=PER_STREAM_S, prefill_request_s=0.01)
    m = StepModel(cfg)
    for _ in range(StepModel.MIN_SAMPLES - 1):
        m.observe(300, m.predict(300) + 0.3, prefill_positions=300, prefill_requests=1)
        m.observe(2, 0.05)
        m.observe(300, 0.1)
    assert (m.prefill_request_s, m.base_s, m.per_stream_s) == (0.01, BASE_S, PER_STREAM_S)
    m.observe(300, m.predict(300) + 0.3, prefill_positions=300, prefill_requests=1)
    assert m.prefill_request_s == pytest.approx(0.3)
