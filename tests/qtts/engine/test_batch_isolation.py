"""One request's sampling cannot hurt the streams batched with it.

A batch holds good rows (greedy, and seeded sampling: counter-based uniforms make a row's draws
independent of its neighbours) beside rows with sampling settings at the edges of the API's
declared ranges, far outside them (what a direct caller of the engine could pass), and prompts
with NaN / inf in them (non-finite logits). The good rows' codes must equal those of the same
batch without the other rows; a broken row may only end itself (`SAMPLING_FAILED`), and the
slot it frees serves the next request as if it had never been used."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qtts.engine import GraphEngine, GraphEngineConfig, RunnerConfig, sampler
from qtts.model import EagerGenerator, SamplingParams
from qtts.model.generator import SAMPLING_FAILED
from qtts.request import request_limits as lim
from tests.qtts.engine.tiny_talker import make_prompt

FRAMES = 6
GOOD = {
    "greedy-a": SamplingParams(greedy=True),
    "greedy-b": SamplingParams(greedy=True, repetition_penalty=1.3),
    "seeded-a": SamplingParams(seed=11),
    "seeded-b": SamplingParams(seed=12, temperature=0.7, top_k=20, top_p=0.8),
}
# At the edges of the ranges the gateway and the talker enforce (qtts/request/request_limits.py): served.
EDGES = {
    "t-min": SamplingParams(seed=1, temperature=lim.TEMPERATURE_MIN),
    "t-max": SamplingParams(seed=2, temperature=lim.TEMPERATURE_MAX),
    "top_p-min": SamplingParams(seed=3, top_p=lim.TOP_P_MIN),
    "top_k-max": SamplingParams(seed=4, top_k=lim.TOP_K_MAX),
    "rp-min": SamplingParams(seed=5, repetition_penalty=lim.REPETITION_PENALTY_MIN),
    "rp-max": SamplingParams(seed=6, repetition_penalty=lim.REPETITION_PENALTY_MAX),
    "min-frames-max": SamplingParams(seed=7, min_new_tokens=lim.MAX_FRAMES),
}
# Far outside them (float32 turns 3.5e38 into inf and 1e-45 into a denormal): may fail, alone.
EXTREMES = {
    "t-3.5e38": SamplingParams(seed=8, temperature=3.5e38),
    "t-1e-45": SamplingParams(seed=9, temperature=1e-45),
    "rp-1e-45": SamplingParams(seed=10, repetition_penalty=1e-45),
    "rp-3.5e38": SamplingParams(seed=13, repetition_penalty=3.5e38),
    "top_p-1e-45": SamplingParams(seed=14, top_p=1e-45),
    "top_k-2^40": SamplingParams(seed=15, top_k=2**40),
}
# Prompts whose embeddings are not finite: NaN / inf hidden states and logits in that row only.
POISONED = {"nan-prompt": float("nan"), "inf-prompt": float("inf")}


def _prompt(bundle, name: str):
    prompt = make_prompt(bundle, 10 + len(name) % 5, 3, seed=sum(map(ord, name)), max_frames=40)
    if name in POISONED:
        prompt.embeds[-1, :4] = POISONED[name]
    return prompt


def _graph_engine(bundle, max_batch: int, **runner_kw) -> GraphEngine:
    cfg = RunnerConfig(max_batch=max_batch, max_len=96, max_trailing=16, **runner_kw)
    return GraphEngine(bundle, config=GraphEngineConfig(runner=cfg, max_prefill_tokens=2048))


def _run(gen, requests: dict[str, SamplingParams], bundle, max_steps: int = 100) -> dict[str, list]:
    for name, sampling in requests.items():
        gen.add(name, _prompt(bundle, name), sampling, FRAMES)
    out: dict[str, list] = {}
    for _ in range(max_steps):
        if not gen.num_active:
            break
        for o in gen.step():  # never raises: a broken row is that row's output
            codes = None if o.codes is None else np.asarray(o.codes, dtype=np.int64).tolist()
            out.setdefault(o.request_id, []).append((codes, o.finished, o.finish_reason))
    assert not gen.num_active
    return out


ENGINES = {
    "graph-exact": lambda b, n: _graph_engine(b, n),
    "graph-padded": lambda b, n: _graph_engine(
        b, n, pad_to_buckets=True, context_buckets=(16, 32, 64), batch_buckets=(4, 8, 16, 32)
    ),
    "graph-matmul-capped": lambda b, n: _graph_engine(
        b, n, talker_attention="matmul", predictor_attention="sdpa", max_candidates=64
    ),
    "eager": lambda b, n: EagerGenerator(b, max_batch=n),
}


@pytest.mark.parametrize("kind", list(ENGINES))
def test_good_rows_equal_the_batch_without_the_bad_rows(tiny_bundle, kind):
    make = ENGINES[kind]
    alone = _run(make(tiny_bundle, len(GOOD)), GOOD, tiny_bundle)
    mixed_requests = {**GOOD, **EDGES, **EXTREMES, **dict.fromkeys(POISONED, SamplingParams(greedy=True))}
    mixed = _run(make(tiny_bundle, len(mixed_requests)), mixed_requests, tiny_bundle)

    for name in GOOD:
        assert mixed[name] == alone[name], name
        assert mixed[name][-1][2] in ("stop", "length")
    for name in EDGES:  # inside the declared ranges: served to the end
        assert mixed[name][-1][2] in ("stop", "length"), (name, mixed[name][-1])
        assert all(c is None or min(c) >= 0 for c, *_ in mixed[name]), name
    for name in POISONED:  # non-finite logits from the first frame: that row fails, at once
        assert mixed[name] == [(None, True, SAMPLING_FAILED)], name
    for name in EXTREMES:  # served or failed, but only ever valid codes
        assert mixed[name][-1][2] in ("stop", "length", SAMPLING_FAILED), (name, mixed[name][-1])
        assert all(c is None or min(c) >= 0 for c, *_ in mixed[name]), name
    assert mixed["t-3.5e38"][-1][2] == SAMPLING_FAILED  # inf in float32: the row's scores are NaN


@pytest.mark.parametrize("kind", ["graph-exact", "eager"])
def test_a_slot_freed_by_a_broken_row_serves_the_next_request_as_new(tiny_bundle, kind):
    gen = ENGINES[kind](tiny_bundle, 2)
    gen.add("greedy-a", _prompt(tiny_bundle, "greedy-a"), GOOD["greedy-a"], FRAMES)
    gen.add("nan-prompt", _prompt(tiny_bundle, "nan-prompt"), SamplingParams(greedy=True), FRAMES)
    first = gen.step()
    assert ("nan-prompt", True, SAMPLING_FAILED) in [
        (o.request_id, o.finished, o.finish_reason) for o in first
    ]
    # The next request takes the slot whose KV cache holds the NaN row's keys and values.
    gen.add("seeded-a", _prompt(tiny_bundle, "seeded-a"), GOOD["seeded-a"], FRAMES)
    got: dict[str, list] = {}
    for o in first:
        got.setdefault(o.request_id, []).append(o)
    while gen.num_active:
        for o in gen.step():
            got.setdefault(o.request_id, []).append(o)
    want = _run(ENGINES[kind](tiny_bundle, 2), {k: GOOD[k] for k in ("greedy-a", "seeded-a")}, tiny_bundle)
    for name in ("greedy-a", "seeded-a"):
        codes = [
            (
                None if o.codes is None else np.asarray(o.codes, dtype=np.int64).tolist(),
                o.finished,
                o.finish_reason,
            )
            for o in got[name]
        ]
        assert codes == want[name], name


def test_sampler_marks_only_the_broken_rows():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 32, generator=g) * 3
    logits[1, 5] = float("nan")
    logits[2, 7] = float("inf")
    logits[3] = float("-inf")  # nothing left to sample
    logits[4, 0] = float("-inf")  # a masked id: -inf / inf (the temperature below) is NaN
    temperature = torch.tensor([0.9, 0.9, 0.9, 0.9, float("inf"), 0.9])
    top_k = torch.tensor([0, 5, 0, 0, 0, 3])
    top_p = torch.tensor([1.0, 0.9, 1.0, 1.0, 1.0, 0.5])
    greedy = torch.tensor([False, True, False, True, False, False])
    uniform = torch.rand(6, generator=g)
    ids = sampler.sample_rows(logits, temperature, top_k, top_p, greedy, uniform)
    assert ids[1:5].tolist() == [sampler.INVALID_ID] * 4
    good = [0, 5]
    alone = sampler.sample_rows(
        logits[good], temperature[good], top_k[good], top_p[good], greedy[good], uniform[good]
    )
    assert ids[good].tolist() == alone.tolist() and min(alone.tolist()) >= 0


# Triton's interpreter computes in numpy, which warns about the NaN / inf rows on purpose here.
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_sampling_kernel_marks_the_same_rows_as_the_reference():
    triton_sampling = pytest.importorskip("qtts.engine.triton_sampling")
    if triton_sampling.triton is None:
        pytest.skip("triton is not installed")
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 32, generator=g) * 3
    logits[1, 5] = float("nan")
    logits[2, 7] = float("inf")
    logits[3] = float("-inf")
    logits[4, 0] = float("-inf")
    temperature = torch.tensor([0.9, 0.9, 0.9, 0.9, float("inf"), 0.9])
    top_k = torch.tensor([0, 5, 0, 0, 0, 3])
    top_p = torch.tensor([1.0, 0.9, 1.0, 1.0, 1.0, 0.5])
    greedy = torch.tensor([False, True, False, True, False, False])
    seed = torch.arange(6, dtype=torch.long) * 977
    frame = torch.full((6,), 3, dtype=torch.long)
    want = sampler.sample_rows(
        logits, temperature, top_k, top_p, greedy, sampler.counter_uniform(seed, frame, torch.tensor(0))
    )
    got = triton_sampling.sample(logits, temperature, top_k, top_p, greedy, seed, frame, 0)
    assert got.tolist() == want.tolist()
    assert got[1:5].tolist() == [sampler.INVALID_ID] * 4
