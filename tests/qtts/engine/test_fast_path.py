"""The runner's fast path (q|k|v and gate|up weights concatenated, fused RMSNorm; the CUDA default)
computes what the model core's modules compute, to rounding."""

from __future__ import annotations

import pytest
import torch

from qtts.engine.model_runner import ModelRunner, RunnerConfig
from qtts.engine.sequence import Sequence
from qtts.engine.slot_scheduler import PrefillChunk
from qtts.model import SamplingParams
from tests.qtts.engine.tiny_talker import make_prompt


def loaded_runner(bundle, fast: bool, prompts, packed: bool = False) -> tuple[ModelRunner, list[Sequence]]:
    """`packed` False: the per-row prefill (test_packed_prefill checks the packed one)."""
    runner = ModelRunner(
        bundle,
        RunnerConfig(max_batch=4, max_len=64, max_trailing=8, fast_path=fast, prefill_packed=packed and fast),
    )
    seqs = []
    for slot, p in enumerate(prompts):
        seq = Sequence(
            f"s{slot}", p, SamplingParams(greedy=True), seed=slot, max_frames=5, cap_reason="length"
        )
        seq.slot = slot
        seqs.append(seq)
    # Two ragged prefill calls: a chunk of each prompt, then the rest.
    runner.prefill([PrefillChunk(s, 0, min(5, s.num_prefill_positions)) for s in seqs])
    runner.prefill([PrefillChunk(s, 5, s.num_prefill_positions) for s in seqs])
    runner.start(seqs)
    return runner, seqs


def test_fast_prefill_and_decode_match_the_module_path(tiny_bundle):
    prompts = [make_prompt(tiny_bundle, n, 2, seed=500 + n) for n in (7, 12, 16)]
    slow, seqs = loaded_runner(tiny_bundle, False, prompts)
    fast, _ = loaded_runner(tiny_bundle, True, prompts)
    assert fast.fast_path and not slow.fast_path
    for s in seqs:
        n = s.num_prefill_positions
        assert torch.allclose(fast.k_cache[:, s.slot, :, :n], slow.k_cache[:, s.slot, :, :n], atol=1e-5)
        assert torch.allclose(fast.v_cache[:, s.slot, :, :n], slow.v_cache[:, s.slot, :, :n], atol=1e-5)
    for r in (slow, fast):
        r.active[:3] = True
    ctx = max(s.num_prefill_positions for s in seqs) + 1
    h_slow, h_fast = slow._talker_decode(3, ctx), fast._talker_decode(3, ctx)
    assert torch.allclose(h_fast, h_slow, atol=1e-5)
    assert not torch.allclose(h_fast[0], h_fast[1])  # the rows are different streams


def predictor_hiddens(runner: ModelRunner, hidden: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """Final hidden state of every predictor step, teacher-forced with `codes` [n, 16]."""
    pred = runner.predictor
    proj = pred.small_to_mtp_projection
    x = proj(torch.stack([hidden, runner.talker.model.codec_embedding(codes[:, 0])], dim=1))
    carry: list = [None] * runner.pdec.num_layers
    start, outs = 0, []
    for j in range(pred.num_steps):
        h = runner._predictor_layers(x, start, hidden.shape[0], carry)
        start += x.shape[1]
        outs.append(h[:, -1])
        x = proj(pred.model.codec_embedding[j](codes[:, j + 1]))[:, None]
    return torch.stack(outs, dim=1)


def test_fast_predictor_matches_the_module_path(tiny_bundle):
    slow = ModelRunner(tiny_bundle, RunnerConfig(max_batch=4, max_len=16, max_trailing=2, fast_path=False))
    fast = ModelRunner(tiny_bundle, RunnerConfig(max_batch=4, max_len=16, max_trailing=2, fast_path=True))
    g = torch.Generator().manual_seed(7)
    hidden = torch.randn(3, slow.hidden, generator=g, dtype=tiny_bundle.dtype)
    codes = torch.randint(0, 2048, (3, 16), generator=g)
    want, got = predictor_hiddens(slow, hidden, codes), predictor_hiddens(fast, hidden, codes)
    assert got.shape == (3, 15, slow.pdec.hidden_size)
    assert torch.allclose(got, want, atol=1e-5)
    assert not torch.allclose(got[:, 0], got[:, 1])


@pytest.mark.parametrize("rows", [(1,), (1, 2), (4,)])
def test_bucketed_prefill_writes_the_same_kv_as_the_ragged_batch(tiny_bundle, rows):
    """Prefill at static (rows, width) shapes (what the CUDA graphs replay; eager here) pads each
    chunk with scratch positions, fills batches with padding rows and attends over the whole slot;
    the KV must equal the ragged batch's, and the padding must leave every other slot and the rows'
    later columns untouched. Row buckets (1, 2) split a group of 3 into 2 + 1; (4,) pads it to 4."""
    prompts = [make_prompt(tiny_bundle, n, 2, seed=700 + n) for n in (7, 12, 16)]
    ragged, seqs = loaded_runner(tiny_bundle, True, prompts)
    bucketed = ModelRunner(
        tiny_bundle,
        RunnerConfig(
            max_batch=4,
            max_len=64,
            max_trailing=8,
            fast_path=True,
            prefill_packed=False,
            prefill_buckets=(4, 8, 16),
            prefill_rows=rows,
        ),
    )
    assert bucketed.prefill_buckets == (4, 8, 16)
    sentinel = 123.0
    bucketed.k_cache.fill_(sentinel)
    bucketed.v_cache.fill_(sentinel)
    # The same two chunks per prompt (widths 5 and 2..11 -> buckets 8 and 4/16).
    bucketed.prefill([PrefillChunk(s, 0, min(5, s.num_prefill_positions)) for s in seqs])
    bucketed.prefill([PrefillChunk(s, 5, s.num_prefill_positions) for s in seqs])
    for s in seqs:
        n = s.num_prefill_positions
        assert torch.allclose(bucketed.k_cache[:, s.slot, :, :n], ragged.k_cache[:, s.slot, :, :n], atol=1e-5)
        assert torch.allclose(bucketed.v_cache[:, s.slot, :, :n], ragged.v_cache[:, s.slot, :, :n], atol=1e-5)
        # Columns past the prompt (below the scratch column) were not written by the padding.
        assert (bucketed.k_cache[:, s.slot, :, n : bucketed.scratch] == sentinel).all()
    assert (bucketed.k_cache[:, 3, :, : bucketed.scratch] == sentinel).all()  # an unused slot
    # A chunk wider than the largest bucket takes the ragged path and still matches.
    wide = make_prompt(tiny_bundle, 30, 2, seed=799)
    seq = Sequence("w", wide, SamplingParams(greedy=True), seed=0, max_frames=5, cap_reason="length")
    seq.slot = 3
    bucketed.prefill([PrefillChunk(seq, 0, seq.num_prefill_positions)])
    ragged.prefill([PrefillChunk(seq, 0, seq.num_prefill_positions)])
    n = seq.num_prefill_positions
    assert torch.allclose(bucketed.k_cache[:, 3, :, :n], ragged.k_cache[:, 3, :, :n], atol=1e-5)
