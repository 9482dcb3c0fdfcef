"""FP8 weights (`RunnerConfig.weight_dtype="fp8"`): the quantization, the product, and the runner.

On CPU the FP8 product is the dequantizing reference (what `torch._scaled_mm` computes with row-wise
scales); the runner tests check that every path of the engine (PyTorch layers, fused Triton kernels
under the interpreter, packed and per-row prefill) uses it alike, and how far FP8 moves the
logits of the tiny model from its float64 weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qtts.engine import fp8
from qtts.engine.model_runner import ModelRunner, RunnerConfig
from qtts.engine.sequence import Sequence
from qtts.engine.slot_scheduler import PrefillChunk
from qtts.model import SamplingParams
from tests.qtts.engine.tiny_talker import make_prompt


def test_weight_quantization_is_per_output_channel():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(24, 40, generator=g) * torch.logspace(-3, 1, 24)[:, None]  # rows of very different scale
    q = fp8.quantize_weight(w)
    assert q.q.dtype == fp8.FP8 and q.scale.shape == (24,) and q.shape == (24, 40)
    assert torch.allclose(q.q.float().abs().amax(dim=1), torch.full((24,), fp8.FP8_MAX))
    # e4m3 keeps 3 mantissa bits: every element within half a step (1/16 relative) of its row's grid.
    err = (q.dequantize(torch.float32) - w).abs()
    assert (err <= w.abs() / 16 + q.scale[:, None] * 2**-9).all()


def test_fp8_linear_is_the_scaled_product_of_the_quantized_operands():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 5, 64, generator=g)
    w = torch.randn(48, 64, generator=g) / 8
    b = torch.randn(48, generator=g)
    fw = fp8.quantize_weight(w)
    y = fp8.fp8_linear(x, fw, b)
    assert y.shape == (3, 5, 48) and y.dtype == x.dtype
    xq, xs = fp8.quantize_rows_reference(x.reshape(-1, 64))
    want = (xs * (xq.float() @ fw.q.float().t()) * fw.scale[None, :] + b).reshape(3, 5, 48)
    assert torch.allclose(y, want, atol=1e-5, rtol=1e-5)
    exact = F.linear(x, w, b)
    assert ((y - exact).norm() / exact.norm()).item() < 0.06  # a few percent: two e4m3 roundings
    assert torch.equal(fp8.linear(x, w, b), exact)  # a tensor weight is F.linear
    assert torch.equal(fp8.dispatching(F.linear)(x, fw, b), y)


def test_triton_row_quantization_matches_the_reference():
    from qtts.engine import triton_fp8

    if triton_fp8.triton is None:
        pytest.skip("triton is not installed")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(6, 3000, generator=g) * torch.logspace(-2, 2, 6)[:, None]).to(device)
    q, s = triton_fp8.quantize_rows(x)
    qr, sr = fp8.quantize_rows_reference(x)
    assert torch.allclose(s, sr, rtol=1e-6)
    a, b = q.float(), qr.float()
    if device == "cuda":  # round to nearest even, saturated, like the reference
        assert torch.equal(a, b)
    else:  # the interpreter's float8 cast rounds its own way where rounding crosses a power of two
        assert (a == b).float().mean() > 0.95


def _loaded(bundle, prompts, **kw) -> ModelRunner:
    cfg = dict(max_batch=4, max_len=48, max_trailing=8, fast_path=True, compile_layers=False)
    cfg.update(kw)
    runner = ModelRunner(bundle, RunnerConfig(**cfg))
    seqs = []
    for slot, p in enumerate(prompts):
        seq = Sequence(
            f"s{slot}", p, SamplingParams(greedy=True), seed=slot, max_frames=5, cap_reason="length"
        )
        seq.slot = slot
        seqs.append(seq)
    runner.prefill([PrefillChunk(s, 0, s.num_prefill_positions) for s in seqs])
    runner.start(seqs)
    runner.active[: len(prompts)] = True
    return runner


def _codes(runner: ModelRunner, n: int, frames: int) -> torch.Tensor:
    out = []
    for _ in range(frames):
        runner._frame_step(n, runner.max_len)
        out.append(runner.codes_out[:n].clone())
    return torch.stack(out)


def test_fp8_runner_weights_and_paths_agree(tiny_bundle):
    """Every decoder-layer linear is FP8 (heads and embeddings are not); the PyTorch layers, the
    fused Triton kernels and the per-row prefill give the same greedy codes from the same FP8
    weights."""
    prompts = [make_prompt(tiny_bundle, n, 2, seed=1100 + n) for n in (6, 11, 15)]
    torch_path = _loaded(tiny_bundle, prompts, weight_dtype="fp8", decode_kernels="torch")
    assert torch_path.fp8 and torch_path.prefill_packed
    for w in torch_path.talker_weights + torch_path.predictor_weights:
        assert all(isinstance(t, fp8.Fp8Weight) for t in (w.w_qkv, w.w_o, w.w_gate_up, w.w_down))
    assert isinstance(torch_path.talker.codec_head.weight, torch.Tensor)
    rows = _loaded(tiny_bundle, prompts, weight_dtype="fp8", decode_kernels="torch", prefill_packed=False)
    for slot, p in enumerate(prompts):  # (the per-row path's padding writes past each prompt)
        n = p.embeds.shape[0] - 1  # the last embedding is the first decode input
        for cache in ("k_cache", "v_cache"):
            a, b = getattr(rows, cache)[:, slot, :, :n], getattr(torch_path, cache)[:, slot, :, :n]
            assert torch.allclose(a, b, atol=1e-10)
    want = _codes(torch_path, 3, 3)
    assert torch.equal(_codes(rows, 3, 3), want)
    from qtts.engine import triton_ops

    if triton_ops.available(torch_path.device):
        fused = _loaded(tiny_bundle, prompts, weight_dtype="fp8", decode_kernels="triton")
        assert fused.fused_decode
        assert torch.equal(_codes(fused, 3, 1), want[:1])


def test_fp8_moves_the_logits_by_a_few_percent(tiny_bundle):
    """Codebook-0 logits of the first frame, FP8 against the float64 weights: a bounded relative
    error (the H200 report, benchmarks/fp8_fidelity.py, measures the full-size model)."""
    prompts = [make_prompt(tiny_bundle, n, 2, seed=1200 + n) for n in (9, 13)]
    logits = []
    for dtype in ("model", "fp8"):
        r = _loaded(tiny_bundle, prompts, weight_dtype=dtype, decode_kernels="torch")
        logits.append(F.linear(r._talker_decode(2, r.max_len), r.talker.codec_head.weight))
    ref, got = logits
    rel = ((got - ref).norm() / ref.norm()).item()
    assert 0 < rel < 0.1


def test_fp8_needs_a_known_dtype_and_the_fast_path(tiny_bundle):
    with pytest.raises(ValueError, match="weight_dtype"):
        RunnerConfig(weight_dtype="int4")
    with pytest.raises(ValueError, match="fast path"):
        ModelRunner(tiny_bundle, RunnerConfig(max_batch=2, max_len=16, fast_path=False, weight_dtype="fp8"))
