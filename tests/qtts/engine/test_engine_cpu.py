"""GraphEngine on the CPU (eager frame step) against the model core run request by request."""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest
import torch

from qtts.engine import GraphEngine, GraphEngineConfig, NoFreeSlot, RunnerConfig
from qtts.model import SamplingParams
from qtts.request.errors import InvalidArgument
from tests.qtts.engine.tiny_talker import make_prompt, run_alone

GREEDY = SamplingParams(greedy=True)


def engine(bundle, **runner_kw) -> GraphEngine:
    prefill = runner_kw.pop("max_prefill_tokens", 2048)
    cfg = RunnerConfig(**{"max_batch": 4, "max_len": 96, "max_trailing": 16, **runner_kw})
    return GraphEngine(bundle, config=GraphEngineConfig(runner=cfg, max_prefill_tokens=prefill))


def same_outputs(got: list, want: list) -> bool:
    if len(got) != len(want):
        return False
    for g, w in zip(got, want, strict=True):
        if (g.finished, g.finish_reason) != (w.finished, w.finish_reason):
            return False
        if (g.codes is None) != (w.codes is None):
            return False
        if g.codes is not None and not np.array_equal(
            np.asarray(g.codes, dtype=np.int64), np.asarray(w.codes)
        ):
            return False
    return True


# (prompt length, trailing text positions, max_new_frames, frame cap, join at step); with the tiny
# model's weights, r1, r4, r5 and r7 meet EOS, r2 hits its frame cap, the others their length.
REQUESTS = [
    (12, 0, 6, 40, 0),
    (23, 5, None, 40, 0),
    (9, 3, None, 5, 0),
    (17, 0, 7, 40, 2),
    (30, 8, None, 40, 3),
    (11, 2, None, 40, 5),
    (20, 4, 6, 40, 6),
    (14, 1, None, 40, 6),
]


@pytest.fixture(scope="module")
def mixed_reference(tiny_bundle):
    prompts = [
        make_prompt(tiny_bundle, L, t, seed=i, max_frames=cap) for i, (L, t, _, cap, _) in enumerate(REQUESTS)
    ]
    want = {f"r{i}": run_alone(tiny_bundle, p, GREEDY, REQUESTS[i][2]) for i, p in enumerate(prompts)}
    return prompts, want


@pytest.mark.parametrize(
    "runner_kw",
    [
        {},  # exact shapes
        {"max_prefill_tokens": 10},  # chunked prefill across steps
        {"pad_to_buckets": True, "context_buckets": (16, 32, 64), "batch_buckets": (1, 2, 4)},
        {"talker_attention": "matmul", "predictor_attention": "sdpa", "max_candidates": 64},
        # The fast path's packed prefill (the CUDA default): whole prompts, then split by the budget.
        {"fast_path": True, "decode_kernels": "torch", "compile_layers": False},
        {"fast_path": True, "decode_kernels": "torch", "compile_layers": False, "max_prefill_tokens": 10},
    ],
    ids=["exact", "chunked-prefill", "padded-buckets", "matmul-attention", "packed", "packed-chunked"],
)
def test_mixed_batch_joining_and_leaving_equals_requests_run_alone(tiny_bundle, mixed_reference, runner_kw):
    prompts, want = mixed_reference
    assert {w[-1].finish_reason for w in want.values()} >= {"stop", "length", "frame_cap"}

    eng = engine(tiny_bundle, **runner_kw)  # 4 slots for 8 requests: some wait, slots get reused
    got: dict[str, list] = {}
    waiting: deque = deque()  # the caller's queue (the deadline scheduler's): the engine has none
    step = 0
    skipped = waited = False
    while step < 200 and (eng.has_work or waiting or any(j >= step for *_, j in REQUESTS)):
        for i, (*_, new_frames, _, join) in enumerate(REQUESTS):
            if join == step:
                waiting.append((f"r{i}", prompts[i], GREEDY, new_frames))
        while waiting and eng.num_free_slots:
            eng.add(*waiting.popleft())
        waited |= bool(waiting)
        # A stream without credit skips a few steps: it must resume exactly where it was.
        skip = {"r1"} if 2 <= step < 4 else set()
        for out in eng.step(skip=skip):
            assert out.request_id not in skip
            skipped |= step >= 4 and out.request_id == "r1"  # it did resume
            got.setdefault(out.request_id, []).append(out)
        step += 1
    assert skipped and waited and not eng.has_work and eng.num_active == 0 and eng.runner.num_slots == 4
    for rid in want:
        assert same_outputs(got[rid], want[rid]), rid


def test_cancel_mid_generation_frees_the_slot_for_others(tiny_bundle):
    prompts = [make_prompt(tiny_bundle, 10 + i, 2, seed=100 + i) for i in range(3)]
    want = [run_alone(tiny_bundle, p, GREEDY, 5) for p in prompts]
    eng = engine(tiny_bundle, max_batch=2)
    got: dict[str, list] = {}
    eng.add("a", prompts[0], GREEDY, 5)
    eng.add("b", prompts[1], GREEDY, 5)
    with pytest.raises(NoFreeSlot):  # no slot yet: the caller keeps it waiting
        eng.add("c", prompts[2], GREEDY, 5)
    assert eng.num_active == 2 and eng.num_free_slots == 0
    for _ in range(2):
        for o in eng.step():
            got.setdefault(o.request_id, []).append(o)
    assert eng.cancel("a") and not eng.cancel("a") and not eng.cancel("nope")
    eng.add("c", prompts[2], GREEDY, 5)
    while eng.has_work:
        for o in eng.step():
            got.setdefault(o.request_id, []).append(o)
    assert same_outputs(got["a"], want[0][:2])
    assert same_outputs(got["b"], want[1]) and same_outputs(got["c"], want[2])


def test_prefix_cache_hit_gives_the_same_codes(tiny_bundle):
    h = tiny_bundle.config.talker.decoder.hidden_size
    voice = torch.randn(8, h, generator=torch.Generator().manual_seed(9), dtype=tiny_bundle.dtype)
    prompts = [make_prompt(tiny_bundle, 14 + i, 2, seed=200 + i, prefix=voice) for i in range(3)]
    want = [run_alone(tiny_bundle, p, GREEDY, 4) for p in prompts]
    eng = engine(tiny_bundle, prefix_cache_bytes=1 << 20, max_prefill_tokens=5)
    got: dict[str, list] = {}
    eng.add("p0", prompts[0], GREEDY, 4, prefix_key="voice-1", prefix_len=8)
    for i in range(4):
        if i == 2:  # later joiners find the prefix cached
            eng.add("p1", prompts[1], GREEDY, 4, prefix_key="voice-1", prefix_len=8)
            eng.add("p2", prompts[2], GREEDY, 4, prefix_key="voice-1", prefix_len=8)
        for o in eng.step():
            got.setdefault(o.request_id, []).append(o)
    while eng.has_work:
        for o in eng.step():
            got.setdefault(o.request_id, []).append(o)
    cache = eng.runner.prefix_cache
    assert cache.hits == 2 and len(cache) == 1
    for i in range(3):
        assert same_outputs(got[f"p{i}"], want[i]), i


def test_seeded_sampling_does_not_depend_on_batch_neighbours(tiny_bundle):
    sp = SamplingParams(seed=1234, temperature=0.9, top_k=50)
    mine = make_prompt(tiny_bundle, 15, 3, seed=300)

    def codes_of(eng, n_others: int) -> list:
        for i in range(n_others):
            eng.add(f"o{i}", make_prompt(tiny_bundle, 10 + 3 * i, i, seed=400 + i), SamplingParams(seed=i), 6)
        eng.step()  # neighbours are mid-generation when ours joins
        eng.add("me", mine, sp, 6)
        outs = []
        while eng.has_work:
            outs += [o for o in eng.step() if o.request_id == "me"]
        return outs

    alone = codes_of(engine(tiny_bundle), 0)
    crowded = codes_of(engine(tiny_bundle, pad_to_buckets=True, batch_buckets=(4,)), 3)
    assert same_outputs(alone, crowded)
    other_seed = engine(tiny_bundle)
    other_seed.add("me", mine, SamplingParams(seed=99), 6)
    outs = []
    while other_seed.has_work:
        outs += other_seed.step()
    assert not same_outputs(alone, outs)


def test_add_validates(tiny_bundle):
    eng = engine(tiny_bundle)
    p = make_prompt(tiny_bundle, 10, 2, seed=1)
    eng.add("x", p, GREEDY, 5)
    with pytest.raises(ValueError):
        eng.add("x", p, GREEDY, 5)
    with pytest.raises(ValueError):
        eng.add("y", p, GREEDY, 0)
    # Requests that cannot fit are the caller's error (InvalidArgument: HTTP 400), with the limit named.
    with pytest.raises(InvalidArgument, match="at most 6 frames"):  # 90 positions + 10 frames > 96
        eng.add("z", make_prompt(tiny_bundle, 90, 0, seed=2), GREEDY, 10)
    with pytest.raises(InvalidArgument, match="--max-len"):  # the prompt alone fills the slot
        eng.add("v", make_prompt(tiny_bundle, 95, 0, seed=4), GREEDY, None)
    with pytest.raises(InvalidArgument, match="at most 16"):
        eng.add("w", make_prompt(tiny_bundle, 10, 17, seed=3), GREEDY, 5)
    assert eng.num_active == 1


def test_frame_cap_is_clamped_to_what_a_slot_holds(tiny_bundle):
    """Without max_new_frames the text's frame cap (generous) may exceed the slot: the request runs
    with the cap lowered to the slot's room and ends with "frame_cap" there, instead of failing."""
    eng = engine(tiny_bundle, max_len=40)
    p = make_prompt(tiny_bundle, 30, 2, seed=5, max_frames=500)
    eng.add("long", p, SamplingParams(greedy=True, min_new_tokens=100), None)  # never stops by itself
    outs = []
    while eng.num_active:
        outs += eng.step()
    assert outs[-1].finished and outs[-1].finish_reason == "frame_cap"
    assert sum(o.codes is not None for o in outs) == 40 - 30


@pytest.mark.parametrize(("default", "max_len", "frames"), [(6, 96, 6), (500, 40, 10)])
def test_a_model_default_length_ends_as_length(tiny_bundle, default, max_len, frames):
    """A prompt's model-declared default length (the tiny snapshots') bounds a request that gives
    none, as "length"; one above what the slot holds is lowered to it rather than refused."""
    import dataclasses

    eng = engine(tiny_bundle, max_len=max_len)
    p = dataclasses.replace(
        make_prompt(tiny_bundle, 30, 2, seed=7, max_frames=500), default_max_frames=default
    )
    eng.add("plain", p, SamplingParams(greedy=True, min_new_tokens=100), None)
    outs = []
    while eng.num_active:
        outs += eng.step()
    assert outs[-1].finished and outs[-1].finish_reason == "length"
    assert sum(o.codes is not None for o in outs) == frames


def test_a_bound_above_the_text_cap_ends_as_length(tiny_bundle):
    """max_new_frames above the text's frame cap: the cap ends the request, as "length" (the
    caller bounded its length), not as the "frame_cap" failure of an unbounded run."""
    eng = engine(tiny_bundle, max_len=96)
    p = make_prompt(tiny_bundle, 20, 2, seed=6, max_frames=5)
    eng.add("bounded", p, SamplingParams(greedy=True, min_new_tokens=100), 50)
    outs = []
    while eng.num_active:
        outs += eng.step()
    assert outs[-1].finished and outs[-1].finish_reason == "length"
    assert sum(o.codes is not None for o in outs) == 5
