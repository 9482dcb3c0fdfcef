"""The packed prefill (all chunks of a step on one token axis, varlen causal attention) writes the
KV the per-prompt path writes, so decode logits and greedy codes are the same.

The tiny model is float64 (tests/qtts/engine/conftest.py): the PyTorch packed path must match the
per-prompt prefill of the same layer functions (the per-row path, one prompt a call) to float64
rounding, and the model core's modules within 1e-5 (their RoPE rounds differently, as in
test_fast_path); the Triton path (the interpreter on CPU) computes its attention dots in float32
and matches within 1e-5."""

from __future__ import annotations

import pytest
import torch

from qtts.engine.model_runner import ModelRunner, RunnerConfig
from qtts.engine.packed_prefill import MAX_PACKED_CHUNKS, query_blocks
from qtts.engine.sequence import Sequence
from qtts.engine.slot_scheduler import PrefillChunk
from qtts.model import SamplingParams
from tests.qtts.engine.tiny_talker import make_prompt

SENTINEL = 123.0
LENGTHS = (7, 12, 16, 5, 9, 14, 3, 11)


def _runner(bundle, **kw) -> ModelRunner:
    cfg = dict(max_batch=8, max_len=48, max_trailing=8, compile_layers=False)
    cfg.update(kw)
    runner = ModelRunner(bundle, RunnerConfig(**cfg))
    runner.k_cache.fill_(SENTINEL)
    runner.v_cache.fill_(SENTINEL)
    return runner


def _seqs(prompts) -> list[Sequence]:
    seqs = []
    for slot, p in enumerate(prompts):
        seq = Sequence(
            f"s{slot}", p, SamplingParams(greedy=True), seed=slot, max_frames=5, cap_reason="length"
        )
        seq.slot = slot
        seqs.append(seq)
    return seqs


def _prefill_per_prompt(runner: ModelRunner, seqs) -> None:
    """The reference: every prompt alone, whole, one call each."""
    for s in seqs:
        runner.prefill([PrefillChunk(s, 0, s.num_prefill_positions)])
    runner.start(seqs)


def _prefill_chunked(runner: ModelRunner, seqs, split: int = 5) -> None:
    """Two packed calls: the first `split` positions of every prompt, then the rest (continuing
    chunks attend to keys written by the earlier call)."""
    runner.prefill([PrefillChunk(s, 0, min(split, s.num_prefill_positions)) for s in seqs])
    runner.prefill(
        [PrefillChunk(s, split, s.num_prefill_positions) for s in seqs if s.num_prefill_positions > split]
    )
    runner.start(seqs)


def _c0_logits(runner: ModelRunner, n: int) -> torch.Tensor:
    runner.active[:n] = True
    hidden = runner._talker_decode(n, runner.max_len)
    return torch.nn.functional.linear(hidden, runner.talker.codec_head.weight)


def _greedy_codes(runner: ModelRunner, n: int, frames: int) -> torch.Tensor:
    runner.active[:n] = True
    out = []
    for _ in range(frames):
        runner._frame_step(n, runner.max_len)
        out.append(runner.codes_out[:n].clone())
    return torch.stack(out)


def _assert_same_kv(got: ModelRunner, want: ModelRunner, seqs, atol: float) -> None:
    for s in seqs:
        n = s.num_prefill_positions
        for cache in ("k_cache", "v_cache"):
            a, b = getattr(got, cache)[:, s.slot], getattr(want, cache)[:, s.slot]
            assert torch.allclose(a[:, :, :n], b[:, :, :n], atol=atol, rtol=0), (s.slot, cache)
            # Nothing past the prompt (below the scratch column) was written.
            assert (a[:, :, n : got.scratch] == SENTINEL).all()


def test_query_blocks_split_chunks_at_block_m():
    spans = [(3, 0, 5, 0), (0, 5, 2, 7), (1, 7, 4, 0)]
    assert query_blocks(spans, 2) == [
        (3, 0, 2, 0),
        (3, 2, 2, 2),
        (3, 4, 1, 4),
        (0, 5, 2, 7),
        (1, 7, 2, 0),
        (1, 9, 2, 2),
    ]


@pytest.mark.parametrize("count", [1, 3, 8])
def test_packed_prefill_matches_the_per_prompt_path(tiny_bundle, count):
    """1, 3 and 8 prompts of different lengths, prefilled whole and in two packed calls, against
    the model core's per-prompt prefill: KV, codebook-0 logits and greedy codes."""
    prompts = [make_prompt(tiny_bundle, n, 2, seed=900 + n) for n in LENGTHS[:count]]
    ref = _runner(tiny_bundle, fast_path=True, decode_kernels="torch", prefill_packed=False)
    seqs = _seqs(prompts)
    _prefill_per_prompt(ref, seqs)
    assert not ref.prefill_packed
    module = _runner(tiny_bundle, fast_path=False)
    _prefill_per_prompt(module, seqs)
    _assert_same_kv(ref, module, seqs, atol=1e-5)
    whole = _runner(tiny_bundle, fast_path=True, decode_kernels="torch")
    assert whole.prefill_packed and not whole.fused_decode
    whole.prefill([PrefillChunk(s, 0, s.num_prefill_positions) for s in seqs])
    whole.start(seqs)
    chunked = _runner(tiny_bundle, fast_path=True, decode_kernels="torch")
    _prefill_chunked(chunked, seqs)
    for r in (whole, chunked):
        _assert_same_kv(r, ref, seqs, atol=1e-10)
        assert (r.k_cache[:, count:, :, : r.scratch] == SENTINEL).all()  # unused slots untouched
    want = _c0_logits(ref, count)
    for r in (whole, chunked):
        assert torch.allclose(_c0_logits(r, count), want, atol=1e-10, rtol=0)
    assert torch.allclose(want, _c0_logits(module, count), atol=1e-5, rtol=0)
    for r in (ref, whole, chunked):  # undo the K/V the logits check wrote at each prompt's end
        r.slot_ints[:count, 0] = torch.tensor([s.num_prefill_positions for s in seqs])
    codes = [_greedy_codes(r, count, 3) for r in (ref, whole, chunked)]
    assert torch.equal(codes[1], codes[0]) and torch.equal(codes[2], codes[0])


def test_packed_prefill_with_the_triton_kernels_matches_the_per_prompt_path(tiny_bundle):
    """The fused path: packed GEMMs, the fused norm/RoPE/store kernel and `prefill_attention` (the
    interpreter on CPU). Chunks of 7..16 positions span several query blocks of the kernel when
    block_m is small."""
    from qtts.engine import triton_ops

    if not triton_ops.available(torch.device("cpu")) and not torch.cuda.is_available():
        pytest.skip("needs Triton (or its interpreter)")
    prompts = [make_prompt(tiny_bundle, n, 2, seed=950 + n) for n in LENGTHS[:3]]
    seqs = _seqs(prompts)
    ref = _runner(tiny_bundle, fast_path=False)
    _prefill_per_prompt(ref, seqs)
    fused = _runner(tiny_bundle, fast_path=True, decode_kernels="triton")
    assert fused.prefill_packed and fused.fused_decode
    fused._packed_block_m = 4  # several query blocks per chunk
    _prefill_chunked(fused, seqs)
    _assert_same_kv(fused, ref, seqs, atol=1e-5)
    assert torch.allclose(_c0_logits(fused, 3), _c0_logits(ref, 3), atol=1e-5, rtol=0)


def test_many_chunks_split_into_packed_calls(tiny_bundle, monkeypatch):
    """More chunks than one packed call holds go in several calls, with the same KV."""
    monkeypatch.setattr("qtts.engine.packed_prefill.MAX_PACKED_CHUNKS", 2)
    prompts = [make_prompt(tiny_bundle, n, 2, seed=980 + n) for n in LENGTHS[:5]]
    seqs = _seqs(prompts)
    ref = _runner(tiny_bundle, fast_path=True, decode_kernels="torch", prefill_packed=False)
    _prefill_per_prompt(ref, seqs)
    packed = _runner(tiny_bundle, fast_path=True, decode_kernels="torch")
    calls = []
    real = packed._packed_call
    monkeypatch.setattr(packed, "_packed_call", lambda chunks: calls.append(len(chunks)) or real(chunks))
    packed.prefill([PrefillChunk(s, 0, s.num_prefill_positions) for s in seqs])
    assert calls == [2, 2, 1]
    _assert_same_kv(packed, ref, seqs, atol=1e-10)
    assert MAX_PACKED_CHUNKS >= 16


def test_packed_prefill_needs_the_fast_path(tiny_bundle):
    with pytest.raises(ValueError, match="fast path"):
        ModelRunner(tiny_bundle, RunnerConfig(max_batch=2, max_len=16, fast_path=False, prefill_packed=True))


class _EagerReplay:
    """Stands in for a captured graph on the CPU: replaying it runs the layers on the static
    buffers, which is what the graph captured."""

    def __init__(self, runner: ModelRunner, n: int) -> None:
        self.runner, self.n = runner, n
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        self.runner._packed_layers(*self.runner._packed_graph_args(self.n))


def test_token_bucket_replays_write_the_same_kv_as_the_eager_call(tiny_bundle):
    """The graph path: chunks copied into the static buffers at a token bucket, padding tokens at
    the scratch column of slot 0, unused query blocks empty. Calls of 21 and 27 tokens go through
    buckets 24 and 32; a call of 40 tokens (above the largest bucket) runs eagerly."""
    from qtts.engine import triton_ops

    if not triton_ops.available(torch.device("cpu")) and not torch.cuda.is_available():
        pytest.skip("needs Triton (or its interpreter)")
    prompts = [make_prompt(tiny_bundle, n, 2, seed=990 + n) for n in (9, 14, 16, 12)]
    seqs = _seqs(prompts)
    eager = _runner(tiny_bundle, fast_path=True, decode_kernels="triton")
    graphed = _runner(tiny_bundle, fast_path=True, decode_kernels="triton", prefill_token_buckets=(8, 24, 32))
    graphed._alloc_packed_buffers()
    graphed.packed_graphs = {n: _EagerReplay(graphed, n) for n in graphed.packed_token_buckets}
    for r in (eager, graphed):
        r.prefill([PrefillChunk(s, 0, s.num_prefill_positions) for s in seqs[:2]])  # 8 + 13 = 21 tokens
        r.prefill([PrefillChunk(s, 0, s.num_prefill_positions) for s in seqs[2:]])  # 15 + 11 = 26 tokens
    assert [graphed.packed_graphs[n].replays for n in (8, 24, 32)] == [0, 1, 1]
    # Padding wrote only slot 0's scratch column.
    _assert_same_kv(graphed, eager, seqs, atol=1e-6)
    wide = make_prompt(tiny_bundle, 41, 2, seed=999)
    (seq,) = _seqs([wide])
    graphed.prefill([PrefillChunk(seq, 0, seq.num_prefill_positions)])
    assert sum(g.replays for g in graphed.packed_graphs.values()) == 2
