"""The talker's 8-bit KV cache (RunnerConfig.kv_cache_dtype="fp8").

The kernels that write the cache round into e4m3 exactly as torch's own cast does (ties to even,
saturating at 448), and the kernels that read it widen each block to the queries' type first, so
attention over an 8-bit cache equals attention over that cache widened. On CPU the kernels run
under Triton's interpreter (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

triton_ops = pytest.importorskip("qtts.engine.triton_ops")

from qtts.model.layers import RotaryEmbedding  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
F8 = torch.float8_e4m3fn


def _e4m3(x: torch.Tensor) -> torch.Tensor:
    """torch's cast, saturated as the kernels saturate (on CUDA torch casts past 448 to NaN)."""
    return x.float().clamp(-448.0, 448.0).to(F8)


def test_the_rope_store_rounds_keys_and_values_into_an_8bit_cache_as_torch_casts():
    """Keys from the kernel's float32 norm and RoPE, values straight from q|k|v, over magnitudes
    where the e4m3 mantissa carries into the exponent, subnormals and past 448 (saturated)."""
    g = torch.Generator().manual_seed(11)
    hq, hkv, d, m = 4, 2, 16, 6
    qkv = torch.randn(m, (hq + 2 * hkv) * d, generator=g) * torch.logspace(-3, 3, m)[:, None]
    qkv = qkv.to(DEVICE)
    qn = (torch.rand(d, generator=g) * 8 + 0.5).to(DEVICE)
    kn = (torch.rand(d, generator=g) * 8 + 0.5).to(DEVICE)
    positions = torch.tensor([0, 3, 7, 1, 2, 9], device=DEVICE)
    rows = torch.tensor([0, 0, 1, 2, 2, 3], device=DEVICE)
    cos, sin = RotaryEmbedding(d, 10000.0)(positions, torch.float32)
    wide_k = torch.zeros(4, hkv, 10, d, device=DEVICE)
    wide_v = torch.zeros_like(wide_k)
    q_wide = triton_ops.qk_norm_rope_store(
        qkv, qn, kn, cos, sin, wide_k, wide_v, rows, positions, 1e-6, hq, hkv
    )
    k8 = torch.zeros(4, hkv, 10, d, device=DEVICE, dtype=F8)
    v8 = torch.zeros_like(k8)
    q8 = triton_ops.qk_norm_rope_store(qkv, qn, kn, cos, sin, k8, v8, rows, positions, 1e-6, hq, hkv)
    assert torch.equal(q8, q_wide)  # the queries do not go through the cache
    assert torch.equal(k8.float(), _e4m3(wide_k).float())
    assert torch.equal(v8.float(), _e4m3(wide_v).float())
    assert wide_v.abs().max() > 448 and v8.float().abs().max() == 448  # saturated, not NaN


@pytest.mark.parametrize("tile", [(32, 4), (16, 1)])
def test_decode_attention_over_an_8bit_cache_equals_it_over_the_cache_widened(tile):
    g = torch.Generator().manual_seed(12)
    hkv, hq, d, slots, length = 2, 4, 32, 3, 70
    k8 = _e4m3(torch.randn(slots, hkv, length + 1, d, generator=g)).to(DEVICE)
    v8 = _e4m3(torch.randn(slots, hkv, length + 1, d, generator=g) * 3).to(DEVICE)
    rows = torch.tensor([0, 0, 1, 2], device=DEVICE)
    positions = torch.tensor([0, 1, 69, 40], device=DEVICE)
    q = torch.randn(4, hq, d, generator=g).to(DEVICE)
    block_n, warps = tile
    out8 = triton_ops.decode_attention(q, k8, v8, rows, positions, block_n=block_n, num_warps=warps)
    wide = triton_ops.decode_attention(
        q, k8.float(), v8.float(), rows, positions, block_n=block_n, num_warps=warps
    )
    assert torch.equal(out8, wide)


def test_prefill_attention_over_an_8bit_cache_equals_it_over_the_cache_widened():
    g = torch.Generator().manual_seed(13)
    hkv, hq, d = 2, 4, 32
    k8 = _e4m3(torch.randn(2, hkv, 40, d, generator=g)).to(DEVICE)
    v8 = _e4m3(torch.randn(2, hkv, 40, d, generator=g)).to(DEVICE)
    q = torch.randn(12, hq, d, generator=g).to(DEVICE)
    # slot 0: tokens 0-6 at positions 3-9; slot 1: tokens 7-11 at positions 0-4 (block of 16)
    blocks = torch.tensor([[0, 0, 7, 3], [1, 7, 5, 0]], dtype=torch.int32, device=DEVICE)
    out8 = triton_ops.prefill_attention(q, k8, v8, blocks, block_m=16)
    wide = triton_ops.prefill_attention(q, k8.float(), v8.float(), blocks, block_m=16)
    assert torch.equal(out8, wide) and out8.abs().sum() > 0


def test_the_fused_qkv_attention_stores_like_the_rope_store_and_reads_the_rounded_cache():
    g = torch.Generator().manual_seed(14)
    hq, hkv, d, m = 4, 2, 16, 3
    qkv = (torch.randn(m, (hq + 2 * hkv) * d, generator=g) * 5).to(DEVICE)
    qn = (torch.rand(d, generator=g) + 0.5).to(DEVICE)
    kn = (torch.rand(d, generator=g) + 0.5).to(DEVICE)
    rows = torch.tensor([0, 1, 2], device=DEVICE)
    wpos = torch.tensor([4, 0, 9], device=DEVICE)
    cos, sin = RotaryEmbedding(d, 10000.0)(wpos, torch.float32)
    k8 = _e4m3(torch.randn(3, hkv, 12, d, generator=g)).to(DEVICE)
    v8 = _e4m3(torch.randn(3, hkv, 12, d, generator=g)).to(DEVICE)
    k_ref, v_ref = k8.clone(), v8.clone()
    out = triton_ops.qkv_attention(qkv, qn, kn, cos, sin, k8, v8, rows, wpos, wpos, 1e-6, hq, hkv, block_n=16)
    q = triton_ops.qk_norm_rope_store(qkv, qn, kn, cos, sin, k_ref, v_ref, rows, wpos, 1e-6, hq, hkv)
    assert torch.equal(k8.float(), k_ref.float()) and torch.equal(v8.float(), v_ref.float())
    want = triton_ops.decode_attention(q, k_ref, v_ref, rows, wpos, block_n=16)
    assert torch.allclose(out, want, atol=1e-5, rtol=1e-5)


def _runner(bundle, kv: str, prompts, kernels: str = "triton"):
    from tests.qtts.engine.test_triton_ops import _runner as make

    return make(bundle, kernels, prompts, kv_cache_dtype=kv)


def test_a_runner_with_an_8bit_cache_halves_its_bytes_and_tracks_the_wide_cache(tiny_bundle):
    """The tiny float64 model (float32 on a GPU): the cache is e4m3 at one byte an element (the sizing counts it),
    layer 0's keys and values (from the prompt alone) are the wide runner's rounded, and the frame
    step's hidden states stay near the wide cache's (e4m3 keeps 3 mantissa bits: ~3% a value)."""
    from tests.qtts.engine.tiny_talker import float32_copy_on, make_prompt

    prompts = [make_prompt(tiny_bundle, n, 2, seed=900 + n) for n in (6, 11, 15)]
    if DEVICE.type == "cuda":  # the kernels compiled: the tiny weights in float32 on the GPU
        tiny_bundle = float32_copy_on(tiny_bundle, DEVICE)
    wide = _runner(tiny_bundle, "model", prompts)
    narrow = _runner(tiny_bundle, "fp8", prompts)
    assert narrow.k_cache.dtype == F8 and narrow.v_cache.dtype == F8
    assert narrow.pk_cache.dtype == wide.pk_cache.dtype == tiny_bundle.dtype  # the predictor's stay wide
    assert narrow.bytes_per_position() * tiny_bundle.dtype.itemsize == wide.bytes_per_position()
    lens = [p.embeds.shape[0] for p in prompts]
    for slot, n in enumerate(lens):
        for cache_n, cache_w in ((narrow.k_cache, wide.k_cache), (narrow.v_cache, wide.v_cache)):
            got, want = cache_n[0, slot, :, :n].float(), _e4m3(cache_w[0, slot, :, :n]).float()
            # equal, or one e4m3 step apart where the float32 and float64 maths straddle a tie
            assert (got == want).float().mean() > 0.99
            assert torch.allclose(got, want, rtol=0.125, atol=2**-9)
    for r in (wide, narrow):
        r.active[:3] = True
    h_w, h_n = wide._talker_decode(4, 32)[:3].float(), narrow._talker_decode(4, 32)[:3].float()
    rel = (h_n - h_w).norm() / h_w.norm()
    assert 0 < rel < 0.1, rel
    narrow._frame_step(4, 32)
    codes = narrow.codes_out[:3]
    assert codes.min() >= 0 and codes.max() < tiny_bundle.talker.cfg.vocab_size


def test_an_8bit_cache_needs_the_fused_kernels(tiny_bundle):
    from tests.qtts.engine.tiny_talker import make_prompt

    with pytest.raises(ValueError, match="kv_cache_dtype='fp8' needs the fused decode kernels"):
        _runner(tiny_bundle, "fp8", [make_prompt(tiny_bundle, 6, 2, seed=1)], kernels="torch")
    from qtts.engine.runner_config import RunnerConfig

    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        RunnerConfig(kv_cache_dtype="int8")
