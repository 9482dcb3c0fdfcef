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
    cfg = dict(max_batch=4, max_len=48, max_trailing=8, fast_path=True, compile_layers=False, fp8_min_rows=0)
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


def _fp8_interpreter_ok() -> bool:
    from qtts.engine import triton_fp8, triton_ops

    return triton_fp8.triton is not None and triton_ops.available(
        torch.device("cuda" if torch.cuda.is_available() else "cpu")
    )


@pytest.mark.parametrize("with_delta", [False, True])
def test_norm_and_swiglu_hand_over_their_output_quantized(with_delta):
    """add_rms_norm_fp8 / silu_mul_fp8 equal the unfused kernel followed by the row quantization
    (exactly on CUDA; on the interpreter up to its float8 rounding, as above)."""
    if not _fp8_interpreter_ok():
        pytest.skip("needs Triton (or its interpreter)")
    from qtts.engine import triton_fp8, triton_ops

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 96, generator=g).to(device, dtype)
    d = torch.randn(5, 96, generator=g).to(device, dtype) if with_delta else None
    w = (torch.rand(96, generator=g) + 0.5).to(device, dtype)
    gu = torch.randn(5, 2 * 80, generator=g).to(device, dtype)
    x_out, hq = triton_fp8.add_rms_norm_fp8(x, d, w, 1e-6)
    want_x, want_h = triton_ops.add_rms_norm(x, d, w, 1e-6)
    assert torch.equal(x_out, want_x) and hq.dtype == dtype
    sq = triton_fp8.silu_mul_fp8(gu)
    for got, ref in ((hq, want_h), (sq, triton_ops.silu_mul(gu))):
        q, s = fp8.quantize_rows_reference(ref)
        assert torch.allclose(got.scale, s, rtol=1e-6)
        same = (got.q.float() == q.float()).float().mean()
        assert same == 1.0 if device == "cuda" else same > 0.95
        # A QuantRows goes into the FP8 product as is.
        wq = fp8.quantize_weight(torch.randn(32, ref.shape[1], generator=g).to(device))
        assert fp8.fp8_linear(got, wq).dtype == dtype


def test_fused_fp8_layers_stay_close_to_the_pytorch_fp8_layers(tiny_bundle, monkeypatch):
    """The fused Triton layers with the quantizing norm/SwiGLU (what CUDA runs; forced here on the
    interpreter) against the PyTorch FP8 layers: the same decode hidden state within the
    interpreter's float8 rounding differences."""
    if not _fp8_interpreter_ok():
        pytest.skip("needs Triton (or its interpreter)")
    from qtts.engine import fused_layers, packed_prefill, triton_fp8

    def quantizing(kernels, weights, x):
        return triton_fp8.add_rms_norm_fp8, triton_fp8.silu_mul_fp8

    prompts = [make_prompt(tiny_bundle, n, 2, seed=1300 + n) for n in (7, 10)]
    ref = _loaded(tiny_bundle, prompts, weight_dtype="fp8", decode_kernels="torch")
    monkeypatch.setattr(fused_layers, "fp8_fused_kernels", quantizing)
    monkeypatch.setattr(packed_prefill, "fp8_fused_kernels", quantizing)
    fused = _loaded(tiny_bundle, prompts, weight_dtype="fp8", decode_kernels="triton")
    h_ref, h_fused = ref._talker_decode(2, ref.max_len), fused._talker_decode(2, fused.max_len)
    assert ((h_fused - h_ref).norm() / h_ref.norm()).item() < 0.05


def test_fp8_below_its_row_threshold_runs_the_model_dtype_weights(tiny_bundle):
    """fp8_min_rows: products of fewer rows take the kept model-dtype weights (the same result as
    the model-dtype runner), larger ones FP8."""
    prompts = [make_prompt(tiny_bundle, n, 2, seed=1400 + n) for n in (8, 12, 10, 9)]
    model = _loaded(tiny_bundle, prompts, decode_kernels="torch")
    hybrid = _loaded(tiny_bundle, prompts, weight_dtype="fp8", decode_kernels="torch", fp8_min_rows=3)
    w = hybrid.talker_weights[0].w_qkv
    assert isinstance(w, fp8.Fp8Weight) and w.full is not None and w.min_rows == 3
    # The prefill (8 + 12 + 10 + 9 - 4 = 35 packed tokens) took FP8, so compare decode from the same KV.
    hybrid.k_cache.copy_(model.k_cache)
    hybrid.v_cache.copy_(model.v_cache)
    assert torch.equal(hybrid._talker_decode(2, hybrid.max_len), model._talker_decode(2, model.max_len))
    assert not torch.allclose(
        hybrid._talker_decode(4, hybrid.max_len), model._talker_decode(4, model.max_len)
    )
