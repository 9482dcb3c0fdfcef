"""EagerGenerator bookkeeping: joining/leaving, seeded sampling, stop rules, frame cap, cancel."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import qtts.model.generator as generator_module
from qtts.model import EagerGenerator, SamplingParams, SynthesisSpec
from qtts.model.prompt import default_length, frame_cap
from qtts.model.sampling import choose_codebook0

TEXTS = ["Hello world.", "The quick brown fox jumps over the lazy dog, again and again.", "你好"]


@pytest.fixture(scope="module")
def bundle(bundle_factory):
    return bundle_factory("voice_design")


def _prompts(bundle):
    return [bundle.build_prompt(SynthesisSpec(text=t, task="voice_design", instruct="calm")) for t in TEXTS]


def _drain(gen, joins=None):
    """Run to completion; `joins` maps a step index to [(rid, prompt, sampling, max_new_frames)]."""
    joins = joins or {}
    got, ends, step = {}, {}, 0
    while step <= max(joins, default=0) or gen.num_active:
        for rid, prompt, sampling, n in joins.get(step, []):
            gen.add(rid, prompt, sampling, max_new_frames=n)
            got[rid] = []
        for o in gen.step():
            assert o.request_id not in ends, "output after the request finished"
            if o.codes is not None:
                assert o.codes.shape == (16,) and o.codes.dtype == torch.long
                assert int(o.codes.max()) < 2048
                got[o.request_id].append(o.codes)
            if o.finished:
                ends[o.request_id] = o.finish_reason
        step += 1
    return got, ends


@pytest.mark.parametrize("greedy", [True, False])
def test_batched_equals_alone(bundle, greedy):
    prompts = _prompts(bundle)
    params = [SamplingParams(greedy=greedy, seed=10 + i, min_new_tokens=10**6) for i in range(3)]
    n = [9, 5, 7]
    alone = []
    for i in range(3):
        got, ends = _drain(EagerGenerator(bundle, max_batch=1), {0: [("x", prompts[i], params[i], n[i])]})
        assert ends["x"] == "length" and len(got["x"]) == n[i]
        alone.append(torch.stack(got["x"]))
    joins = {
        0: [("a", prompts[0], params[0], n[0])],
        1: [("b", prompts[1], params[1], n[1])],
        3: [("c", prompts[2], params[2], n[2])],
    }
    got, ends = _drain(EagerGenerator(bundle, max_batch=3), joins)
    for rid, i in (("a", 0), ("b", 1), ("c", 2)):
        assert torch.equal(torch.stack(got[rid]), alone[i]), rid


def test_seed_reproducible_and_distinct(bundle):
    p = _prompts(bundle)[0]
    runs = []
    for seed in (1, 1, 2):
        got, _ = _drain(
            EagerGenerator(bundle), {0: [("r", p, SamplingParams(seed=seed, min_new_tokens=99), 6)]}
        )
        runs.append(torch.stack(got["r"]))
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])


def test_frame_cap_ends_request(bundle):
    # As a real checkpoint's prompt: no default length, so an unbounded run into the cap fails.
    p = dataclasses.replace(_prompts(bundle)[0], max_frames=4, default_max_frames=None)
    got, ends = _drain(
        EagerGenerator(bundle), {0: [("r", p, SamplingParams(greedy=True, min_new_tokens=10**6), None)]}
    )
    assert ends == {"r": "frame_cap"} and len(got["r"]) == 4
    # max_new_frames below the cap wins as "length".
    got, ends = _drain(
        EagerGenerator(bundle), {0: [("r", p, SamplingParams(greedy=True, min_new_tokens=10**6), 2)]}
    )
    assert ends == {"r": "length"} and len(got["r"]) == 2
    # A bound above the cap: the cap ends it, as "length" (the caller bounded it), not a failure.
    got, ends = _drain(
        EagerGenerator(bundle), {0: [("r", p, SamplingParams(greedy=True, min_new_tokens=10**6), 9)]}
    )
    assert ends == {"r": "length"} and len(got["r"]) == 4


def test_tiny_model_default_length_ends_as_length(bundle):
    """The tiny random snapshot never says end of speech: without a caller's bound it ends as
    "length" at its declared text-proportional default, below the text's frame cap."""
    prompts = _prompts(bundle)
    want = [default_length(p.num_text_tokens, 1.5, p.max_frames) for p in prompts]
    assert [p.default_max_frames for p in prompts] == want
    assert all(w < p.max_frames for w, p in zip(want, prompts, strict=True)) and want[0] < want[1]
    got, ends = _drain(
        EagerGenerator(bundle), {0: [("r", prompts[0], SamplingParams(min_new_tokens=10**6), None)]}
    )
    assert ends == {"r": "length"} and len(got["r"]) == want[0]


def test_default_length_formula():
    assert default_length(10, None, 160) is None
    assert default_length(10, 1.5, 160) == 8 + 15
    assert default_length(0, 1.5, 160) == 8 + 2  # at least one token's worth
    assert default_length(1000, 1.5, 52) == 52  # never past the cap: a default ends as "length"


def test_frame_cap_formula():
    assert frame_cap(1) == 52 and frame_cap(10) == 160
    assert frame_cap(10_000, limit=8192) == 8192


def test_eos_stops_without_codes(bundle, monkeypatch):
    eos = bundle.config.talker.codec_eos_id
    calls = {"n": 0}

    def fake(logits, params, history, num_generated, eos_id, suppress_mask, generator):
        calls["n"] += 1
        if num_generated >= 3:
            return eos_id
        return choose_codebook0(logits, params, history, num_generated, eos_id, suppress_mask, generator)

    monkeypatch.setattr(generator_module, "choose_codebook0", fake)
    gen = EagerGenerator(bundle, max_batch=1)
    got, ends = _drain(gen, {0: [("r", _prompts(bundle)[0], SamplingParams(greedy=True), None)]})
    assert ends == {"r": "stop"} and len(got["r"]) == 3
    assert eos not in [int(c[0]) for c in got["r"]]
    assert gen.free_slots == [0] and gen.num_active == 0


def test_eos_masked_for_first_two_steps():
    logits = torch.zeros(3072)
    logits[2150] = 10.0
    mask = torch.zeros(3072, dtype=torch.bool)
    mask[2048:] = True
    mask[2150] = False
    p = SamplingParams(greedy=True)
    assert choose_codebook0(logits, p, None, 0, 2150, mask, None) != 2150
    assert choose_codebook0(logits, p, None, 1, 2150, mask, None) != 2150
    assert choose_codebook0(logits, p, None, 2, 2150, mask, None) == 2150
    logits[2500] = 100.0  # suppressed control id never wins
    assert choose_codebook0(logits, p, None, 0, 2150, mask, None) < 2048


def test_repetition_penalty_and_top_k():
    logits = torch.tensor([1.0, 1.02, -0.5, 0.0])
    mask = torch.zeros(4, dtype=torch.bool)
    p = SamplingParams(greedy=True, repetition_penalty=1.05, min_new_tokens=0)
    assert choose_codebook0(logits, p, None, 0, 3, mask, None) == 1
    assert choose_codebook0(logits, p, torch.tensor([1]), 1, 3, mask, None) == 0  # 1.02/1.05 < 1.0
    g = torch.Generator().manual_seed(0)
    p = SamplingParams(top_k=1, repetition_penalty=1.0, min_new_tokens=0)
    assert {choose_codebook0(logits, p, None, 0, 3, mask, g) for _ in range(20)} == {1}


def test_cancel_frees_slot(bundle):
    prompts = _prompts(bundle)
    gen = EagerGenerator(bundle, max_batch=1)
    forced = SamplingParams(greedy=True, min_new_tokens=10**6)
    gen.add("a", prompts[0], forced, 50)
    gen.add("b", prompts[1], forced, 2)
    assert [o.request_id for o in gen.step()] == ["a"]  # b waits for a slot
    assert gen.num_active == 2
    assert gen.cancel("a") and not gen.cancel("a")
    assert [o.request_id for o in gen.step()] == ["b"]
    assert gen.cancel("b") and gen.num_active == 0 and gen.step() == []
    gen.add("c", prompts[2], forced, 1)
    assert gen.cancel("c") and gen.step() == []  # cancelled before its prefill


def test_add_validates(bundle):
    gen = EagerGenerator(bundle)
    p = _prompts(bundle)[0]
    gen.add("a", p, SamplingParams())
    with pytest.raises(ValueError, match="already"):
        gen.add("a", p, SamplingParams())
    with pytest.raises(ValueError, match="max_new_frames"):
        gen.add("b", p, SamplingParams(), max_new_frames=0)
    with pytest.raises(ValueError, match="top_p"):
        gen.add("c", p, SamplingParams(top_p=0.0))


def test_kv_cache_grows(bundle):
    gen = EagerGenerator(bundle, max_batch=2, initial_capacity=8)
    p = _prompts(bundle)[1]
    got, ends = _drain(gen, {0: [("r", p, SamplingParams(greedy=True, min_new_tokens=10**6), 5)]})
    assert gen.cache.capacity >= p.embeds.shape[0] + 4
    ref, _ = _drain(
        EagerGenerator(bundle, max_batch=2),
        {0: [("r", p, SamplingParams(greedy=True, min_new_tokens=10**6), 5)]},
    )
    assert torch.equal(torch.stack(got["r"]), torch.stack(ref["r"]))


def test_skipped_requests_wait_and_resume_unchanged(bundle):
    prompts = _prompts(bundle)
    forced = SamplingParams(greedy=True, min_new_tokens=10**6)
    ref, _ = _drain(EagerGenerator(bundle), {0: [("a", prompts[0], forced, 4)]})
    gen = EagerGenerator(bundle, max_batch=2)
    gen.add("a", prompts[0], forced, 4)
    gen.add("b", prompts[1], forced, 2)
    out = gen.step(skip={"b"})  # b stays queued
    assert [o.request_id for o in out] == ["a"] and "b" in gen.waiting
    frames = [out[0].codes]
    assert [o.request_id for o in gen.step(skip={"a"})] == ["b"]  # a keeps its slot, no frame
    for _ in range(3):
        frames += [o.codes for o in gen.step(skip={"b"})]
    assert torch.equal(torch.stack(frames), torch.stack(ref["a"]))
    assert gen.num_active == 1


def test_batched_residual_sampling_equals_row_by_row():
    from qtts.model.sampling import choose_residual, choose_residual_batch, make_generator

    logits = torch.randn(5, 2048, generator=torch.Generator().manual_seed(0)) * 3
    params = [
        SamplingParams(seed=1),
        SamplingParams(seed=2, subtalker_top_k=5, subtalker_temperature=0.5),
        SamplingParams(greedy=True),
        SamplingParams(seed=3, subtalker_top_p=0.8),
        SamplingParams(seed=4),
    ]
    batch = choose_residual_batch(logits, params, [make_generator(p.seed, "cpu") for p in params])
    rows = [choose_residual(logits[i], p, make_generator(p.seed, "cpu")) for i, p in enumerate(params)]
    assert batch.tolist() == rows
