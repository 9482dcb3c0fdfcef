"""The fused decode kernels (qtts.engine.triton_ops) against the PyTorch ops they replace.

On a machine without CUDA they run under Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1 there), in float32; on a GPU they compile and run in bfloat16 as well."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

triton_ops = pytest.importorskip("qtts.engine.triton_ops")
if triton_ops.triton is None:
    pytest.skip("triton is not installed", allow_module_level=True)

from qtts.model.layers import RotaryEmbedding, apply_rope  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])


def _tol(dtype):
    return {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 3e-2}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rms_norm(dtype, with_delta):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 96, generator=g).to(DEVICE, dtype)
    d = torch.randn(5, 96, generator=g).to(DEVICE, dtype) if with_delta else None
    w = torch.rand(96, generator=g).to(DEVICE, dtype) + 0.5
    x_out, h = triton_ops.add_rms_norm(x, d, w, 1e-6)
    want_x = x + d if with_delta else x
    assert torch.allclose(x_out.float(), want_x.float(), **_tol(dtype))
    want_h = F.rms_norm(want_x.float(), (96,), w.float(), 1e-6)
    assert torch.allclose(h.float(), want_h, **_tol(dtype))


def _reference_qkv(qkv, qn, kn, cos, sin, hq, hkv, d, eps):
    m = qkv.shape[0]
    q, k, v = qkv.float().split([hq * d, hkv * d, hkv * d], dim=-1)
    q = F.rms_norm(q.view(m, hq, d), (d,), qn.float(), eps).transpose(0, 1)  # [H, M, D]
    k = F.rms_norm(k.view(m, hkv, d), (d,), kn.float(), eps).transpose(0, 1)
    q = apply_rope(q[None], cos.float()[None], sin.float()[None])[0].transpose(0, 1)
    k = apply_rope(k[None], cos.float()[None], sin.float()[None])[0].transpose(0, 1)
    return q, k, v.view(m, hkv, d)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads_per_program", [2, 4, 8])
def test_qk_norm_rope_store_writes_each_token_at_its_slot_and_position(dtype, heads_per_program, monkeypatch):
    """4 q + 2 k heads a token in programs of 2 (q, q, k), 4 (q, k + 2 padding) or 8 heads."""
    monkeypatch.setattr(triton_ops, "QK_HEADS_PER_PROGRAM", heads_per_program)
    g = torch.Generator().manual_seed(1)
    hq, hkv, d, m, eps = 4, 2, 16, 6, 1e-6
    qkv = torch.randn(m, (hq + 2 * hkv) * d, generator=g).to(DEVICE, dtype)
    qn = (torch.rand(d, generator=g) + 0.5).to(DEVICE, dtype)
    kn = (torch.rand(d, generator=g) + 0.5).to(DEVICE, dtype)
    positions = torch.tensor([0, 3, 7, 1, 2, 9], device=DEVICE)
    rows = torch.tensor([0, 0, 1, 2, 2, 3], device=DEVICE)
    cos, sin = RotaryEmbedding(d, 10000.0)(positions, dtype)
    k_cache = torch.zeros(4, hkv, 10, d, device=DEVICE, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    q = triton_ops.qk_norm_rope_store(qkv, qn, kn, cos, sin, k_cache, v_cache, rows, positions, eps, hq, hkv)
    want_q, want_k, want_v = _reference_qkv(qkv, qn, kn, cos, sin, hq, hkv, d, eps)
    assert torch.allclose(q.float(), want_q, **_tol(dtype))
    written = torch.zeros(4, 10, dtype=torch.bool)
    for i in range(m):
        r, p = int(rows[i]), int(positions[i])
        written[r, p] = True
        assert torch.allclose(k_cache[r, :, p].float(), want_k[i], **_tol(dtype))
        assert torch.allclose(v_cache[r, :, p].float(), want_v[i].float(), **_tol(dtype))
    assert not k_cache.transpose(1, 2)[~written.to(DEVICE)].any()  # nothing else was touched


def test_rope_with_a_shared_position_broadcasts_cos_sin():
    """A stride-0 cos/sin (every token at one position: the predictor's one-token steps)."""
    g = torch.Generator().manual_seed(2)
    hq, hkv, d, m = 2, 1, 16, 3
    qkv = torch.randn(m, (hq + 2 * hkv) * d, generator=g).to(DEVICE)
    ones = torch.ones(d, device=DEVICE)
    cos, sin = RotaryEmbedding(d, 10000.0)(torch.tensor([5], device=DEVICE), torch.float32)
    kc = torch.zeros(m, hkv, 8, d, device=DEVICE)
    vc = torch.zeros_like(kc)
    rows, pos = torch.arange(m, device=DEVICE), torch.full((m,), 5, device=DEVICE)
    q_b = triton_ops.qk_norm_rope_store(
        qkv, ones, ones, cos.expand(m, d), sin.expand(m, d), kc, vc, rows, pos, 1e-6, hq, hkv
    )
    q_full = triton_ops.qk_norm_rope_store(
        qkv, ones, ones, cos.repeat(m, 1), sin.repeat(m, 1), kc.clone(), vc.clone(), rows, pos, 1e-6, hq, hkv
    )
    assert torch.equal(q_b, q_full)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("pipelined", [False] + ([True] if DEVICE.type == "cuda" else []))
@pytest.mark.parametrize("tile", [(32, 4), (16, 1)], ids=["talker-like", "predictor-tile"])
def test_decode_attention_attends_to_its_own_prefix(dtype, group, pipelined, tile):
    g = torch.Generator().manual_seed(3)
    hkv, d, slots, length = 2, 32, 3, 150
    hq = hkv * group
    k_cache = torch.randn(slots, hkv, length + 1, d, generator=g).to(DEVICE, dtype)
    v_cache = torch.randn(slots, hkv, length + 1, d, generator=g).to(DEVICE, dtype)
    # Tokens of several rows, two of them in the same slot (a 2-token start), one at the last column.
    rows = torch.tensor([0, 0, 1, 2, 2], device=DEVICE)
    positions = torch.tensor([0, 1, 149, 70, 150], device=DEVICE)
    q = torch.randn(5, hq, d, generator=g).to(DEVICE, dtype)
    block_n, warps = tile  # (the predictor's tile: blocks of 16 keys, one warp, over many blocks here)
    out = triton_ops.decode_attention(
        q, k_cache, v_cache, rows, positions, block_n=block_n, num_warps=warps, pipelined=pipelined
    )
    for i in range(5):
        n = int(positions[i]) + 1
        keys = k_cache[rows[i], :, :n].float().repeat_interleave(group, dim=0)  # [HQ, n, D]
        values = v_cache[rows[i], :, :n].float().repeat_interleave(group, dim=0)
        probs = torch.softmax(q[i].float()[:, None, :] @ keys.transpose(1, 2) * d**-0.5, dim=-1)
        want = (probs @ values)[:, 0].reshape(-1)
        assert torch.allclose(out[i].float(), want, **_tol(dtype)), i


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype):
    g = torch.Generator().manual_seed(4)
    gu = torch.randn(3, 2 * 1500, generator=g).to(DEVICE, dtype)  # more than one column block
    gate, up = gu.chunk(2, dim=-1)
    want = F.silu(gate) * up
    assert torch.allclose(triton_ops.silu_mul(gu).float(), want.float(), **_tol(dtype))


def _runner(bundle, kernels: str, prompts, fused_qkv: bool = False, kv_cache_dtype: str = "model"):
    from qtts.engine.model_runner import ModelRunner, RunnerConfig
    from qtts.engine.sequence import Sequence
    from qtts.engine.slot_scheduler import PrefillChunk
    from qtts.model import SamplingParams

    cfg = RunnerConfig(
        max_batch=4,
        max_len=64,
        max_trailing=8,
        fast_path=True,
        compile_layers=False,
        decode_kernels=kernels,
        fused_qkv_attention=fused_qkv,
        kv_cache_dtype=kv_cache_dtype,
    )
    runner = ModelRunner(bundle, cfg)
    seqs = []
    for slot, p in enumerate(prompts):
        seq = Sequence(
            f"s{slot}", p, SamplingParams(greedy=True), seed=slot, max_frames=6, cap_reason="length"
        )
        seq.slot = slot
        seqs.append(seq)
    runner.prefill([PrefillChunk(s, 0, s.num_prefill_positions) for s in seqs])
    runner.start(seqs)
    return runner


@pytest.mark.parametrize("skinny,fused_qkv", [(False, False), (True, False), (False, True)])
def test_runner_frame_step_with_fused_kernels_matches_the_torch_ops(
    tiny_bundle, skinny, fused_qkv, monkeypatch
):
    """CPU: the float64 tiny model under the interpreter; GPU: the same weights in float32.
    `skinny`: every few-row matmul of the fused step takes the skinny kernel (the real rules name
    only full-size shapes); `fused_qkv`: the one-kernel q/k/v attention (triton_qkv_attention)."""
    from tests.qtts.engine.tiny_talker import float32_copy_on, make_prompt

    prompts = [make_prompt(tiny_bundle, n, 2, seed=700 + n) for n in (6, 11, 15)]
    if DEVICE.type == "cuda":
        tiny_bundle = float32_copy_on(tiny_bundle, DEVICE)
    tol = 1e-5 if DEVICE.type == "cpu" else 1e-3
    calls = []
    if skinny:
        monkeypatch.setattr(
            triton_ops, "use_skinny", lambda x, w: calls.append(tuple(w.shape)) or x.dim() == 2
        )
    torch_runner = _runner(tiny_bundle, "torch", prompts)
    fused = _runner(tiny_bundle, "triton", prompts, fused_qkv=fused_qkv)
    assert fused.fused_decode and not torch_runner.fused_decode and fused.fused_qkv == fused_qkv
    assert fused.context_buckets == (64,)
    for r in (torch_runner, fused):
        r.active[:3] = True  # row 3 is padding: it must not change anything
    ctx = 32
    assert torch.allclose(fused._talker_decode(4, ctx)[:3], torch_runner._talker_decode(4, ctx)[:3], atol=tol)
    for r in (torch_runner, fused):  # undo the positions' K/V written by the check above
        r.slot_ints[:3, 0] = torch.tensor([p.embeds.shape[0] for p in prompts], device=r.device)
    frames = []
    for r in (torch_runner, fused):
        codes = []
        for _ in range(1 if skinny else 4):  # (the interpreter is slow: one frame covers every matmul)
            r._frame_step(4, ctx)
            codes.append(r.codes_out[:3].clone())
        frames.append(torch.stack(codes))
    assert torch.equal(frames[0], frames[1])
    assert torch.equal(fused.slot_ints[3], torch_runner.slot_ints[3])  # the padding row did not advance
    k_t, k_f = torch_runner.k_cache[:, :3], fused.k_cache[:, :3]
    assert torch.allclose(k_f[:, :, :, :30], k_t[:, :, :, :30], atol=tol)
    assert bool(calls) == skinny


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("with_bias", [False, True])
def test_skinny_linear_matches_linear(dtype, m, split_k, with_bias):
    g = torch.Generator().manual_seed(7)
    n, k = 40, 96  # neither a multiple of the tiles below
    x = torch.randn(m, k, generator=g).to(DEVICE, dtype)
    w = torch.randn(n, k, generator=g).to(DEVICE, dtype) / k**0.5
    b = torch.randn(n, generator=g).to(DEVICE, dtype) if with_bias else None
    y = triton_ops.skinny_linear(x, w, b, config=(16, 32, split_k, 4, 2))
    assert y.shape == (m, n) and y.dtype == dtype
    assert torch.allclose(
        y.float(), F.linear(x.float(), w.float(), None if b is None else b.float()), **_tol(dtype)
    )


def test_linear_takes_the_skinny_kernel_only_where_the_rules_say(monkeypatch):
    g = torch.Generator().manual_seed(8)
    w = torch.randn(24, 32, generator=g).to(DEVICE)
    monkeypatch.setitem(triton_ops.SKINNY_RULES, (24, 32), (2, (16, 16, 1, 4, 2)))
    calls = []
    real = triton_ops.skinny_linear
    monkeypatch.setattr(
        triton_ops, "skinny_linear", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw)
    )
    small, big = torch.randn(2, 32, generator=g).to(DEVICE), torch.randn(3, 32, generator=g).to(DEVICE)
    assert torch.allclose(triton_ops.linear(small, w), F.linear(small, w), atol=1e-4, rtol=1e-4)
    assert torch.equal(triton_ops.linear(big, w), F.linear(big, w))
    other = torch.randn(5, 32, generator=g).to(DEVICE)
    assert torch.equal(triton_ops.linear(small, other), F.linear(small, other))  # no rule for [5, 32]
    assert calls == [2]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group,head_dim", [(1, 16), (2, 16), (4, 16), (2, 8)])
def test_qkv_attention_equals_rope_store_then_decode_attention(dtype, group, head_dim):
    """One kernel for q/k norm, RoPE, KV store and attention against the two it replaces: the
    same output and cache, including a row whose write position is the scratch column past the
    positions it attends (a padding row) and head_dim 8 (tiles padded to 16, the tiny predictor)."""

    g = torch.Generator().manual_seed(11)
    hkv, m, slots, length = 2, 4, 3, 24
    hq = hkv * group
    qkv = torch.randn(m, (hq + 2 * hkv) * head_dim, generator=g).to(DEVICE, dtype)
    qn = (torch.rand(head_dim, generator=g) + 0.5).to(DEVICE, dtype)
    kn = (torch.rand(head_dim, generator=g) + 0.5).to(DEVICE, dtype)
    positions = torch.tensor([3, 0, 17, 9], device=DEVICE)
    cos, sin = RotaryEmbedding(head_dim, 10000.0)(positions, dtype)
    rows = torch.tensor([1, 0, 2, 0], device=DEVICE)
    wpos = torch.tensor([3, 0, 17, length - 1], device=DEVICE)  # the last row writes the scratch column
    cache = torch.randn(2, slots, hkv, length, head_dim, generator=g).to(DEVICE, dtype)
    kc, vc = cache[0].clone(), cache[1].clone()
    q = triton_ops.qk_norm_rope_store(qkv, qn, kn, cos, sin, kc, vc, rows, wpos, 1e-6, hq, hkv)
    want = triton_ops.decode_attention(q, kc, vc, rows, positions, block_n=16)
    kc2, vc2 = cache[0].clone(), cache[1].clone()
    got = triton_ops.qkv_attention(
        qkv, qn, kn, cos, sin, kc2, vc2, rows, wpos, positions, 1e-6, hq, hkv, block_n=16
    )
    assert torch.allclose(got.float(), want.float(), **_tol(dtype))
    assert torch.allclose(kc2.float(), kc.float(), **_tol(dtype)) and torch.equal(vc2, vc)
    assert triton_ops.self_check(DEVICE, dtype, hq, hkv, head_dim, 16)


def test_fused_qkv_attention_only_up_to_its_row_limit(tiny_bundle, monkeypatch):
    """fused_qkv_max_rows: steps of more tokens keep the two kernels (large batches). On a GPU the
    tiny weights move there in float32 first (the compiled kernels take no CPU tensors)."""
    from qtts.engine.model_runner import ModelRunner, RunnerConfig
    from tests.qtts.engine.tiny_talker import float32_copy_on

    if DEVICE.type == "cuda":
        tiny_bundle = float32_copy_on(tiny_bundle, DEVICE)
    cfg = RunnerConfig(
        max_batch=4,
        max_len=16,
        max_trailing=2,
        fast_path=True,
        compile_layers=False,
        decode_kernels="triton",
        fused_qkv_attention=True,
        fused_qkv_max_rows=2,
    )
    runner = ModelRunner(tiny_bundle, cfg)
    calls = []
    real = triton_ops.qkv_attention
    monkeypatch.setattr(
        triton_ops, "qkv_attention", lambda qkv, *a, **kw: calls.append(qkv.shape[0]) or real(qkv, *a, **kw)
    )
    runner.active[:4] = True
    runner._talker_decode(4, 16)
    assert calls == []
    runner._talker_decode(2, 16)
    assert calls == [2] * runner.tdec.num_layers
