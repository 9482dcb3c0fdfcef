"""Fused Triton kernels for the one-token decode layers of the talker and the code predictor.

The frame step runs 28 talker layers and 15 x 5 predictor layers. Written as PyTorch ops (even
under torch.compile) each layer became about 23 kernels, and at small batches kernel count, not
bytes, sets the step time (BENCHMARKS.md, the fused decode kernels). With these kernels a layer is

    add_rms_norm -> q|k|v matmul -> qk_norm_rope_store -> decode_attention -> o matmul ->
    add_rms_norm -> gate|up matmul -> silu_mul -> down matmul (its add joins the next layer's norm)

nine kernels plus what cuBLAS launches for the four matmuls. The attention reads only the
positions a row has (its own length), not a padded context bucket; its kernels live in
`triton_attention` (re-exported here as `decode_attention`).

Numerics follow the fast path (`fused_layers.fast_qkv` / `fast_out_mlp`): activations in the
model dtype between kernels, norms and softmax in float32. Rounding points differ slightly from the
PyTorch ops, so graph and eager codes can differ on near ties, as between any two kernels.

All kernels also run under Triton's interpreter (`TRITON_INTERPRET=1`) on CPU tensors, which is
how the CPU tests check them against the PyTorch reference.
"""

from __future__ import annotations

import torch

try:  # Triton ships with CUDA builds of torch; CPU builds run the PyTorch path instead.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None

from qtts.engine.triton_attention import (  # re-exported
    decode_attention,
    kv_fp8,
    prefill_attention,
    prefill_block_m,
)
from qtts.engine.triton_qkv_attention import qkv_attention  # re-exported

__all__ = [
    "SKINNY_RULES",
    "add_rms_norm",
    "available",
    "decode_attention",
    "linear",
    "prefill_attention",
    "prefill_block_m",
    "qk_norm_rope_store",
    "qkv_attention",
    "silu_mul",
    "skinny_linear",
    "use_skinny",
]


def available(device: torch.device) -> bool:
    """Whether the fused kernels can run on `device` (CUDA with Triton, or Triton's interpreter)."""
    if triton is None:
        return False
    import os

    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


if triton is not None:
    from qtts.engine.triton_attention import cache_value

    @triton.jit
    def _add_rms_norm_kernel(
        x_ptr, d_ptr, w_ptr, xo_ptr, h_ptr, eps, H: tl.constexpr, BLOCK: tl.constexpr, HAS_D: tl.constexpr
    ):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        m = offs < H
        x = tl.load(x_ptr + row * H + offs, mask=m, other=0.0)
        if HAS_D:
            d = tl.load(d_ptr + row * H + offs, mask=m, other=0.0)
            x = (x.to(tl.float32) + d.to(tl.float32)).to(xo_ptr.dtype.element_ty)
            tl.store(xo_ptr + row * H + offs, x, mask=m)
        xf = x.to(tl.float32)
        inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / H + eps)
        w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(h_ptr + row * H + offs, (xf * inv * w).to(h_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _qk_norm_rope_store_kernel(
        qkv_ptr,
        qw_ptr,
        kw_ptr,
        cos_ptr,
        sin_ptr,
        q_ptr,
        kc_ptr,
        vc_ptr,
        row_ptr,
        pos_ptr,
        eps,
        cs_stride,
        kc_s_slot,
        kc_s_head,
        kc_s_pos,
        HQ: tl.constexpr,
        HKV: tl.constexpr,
        D: tl.constexpr,
        HB: tl.constexpr,
        KV_FP8: tl.constexpr,
    ):
        """Heads [p * HB, (p + 1) * HB) of the q|k heads of token m (program (m, p)) as one
        [HB, D / 2] tile per half: per-head RMSNorm, RoPE, q to `q_ptr`, k to the cache; a k head's
        program also copies the matching v head into the cache. (One program per head was 24
        programs of 64-element loads a token: the kernel ran at a fraction of bandwidth.)"""
        m = tl.program_id(0)
        h = tl.program_id(1) * HB + tl.arange(0, HB)
        half = tl.arange(0, D // 2)
        hm = h < HQ + HKV
        is_q = h < HQ
        is_k = hm & (h >= HQ)
        base = qkv_ptr + m * (HQ + 2 * HKV) * D
        offs = h[:, None] * D + half[None, :]
        x1 = tl.load(base + offs, mask=hm[:, None], other=0.0).to(tl.float32)
        x2 = tl.load(base + offs + D // 2, mask=hm[:, None], other=0.0).to(tl.float32)
        inv = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / D + eps)
        c1 = tl.load(cos_ptr + m * cs_stride + half).to(tl.float32)[None, :]
        c2 = tl.load(cos_ptr + m * cs_stride + D // 2 + half).to(tl.float32)[None, :]
        s1 = tl.load(sin_ptr + m * cs_stride + half).to(tl.float32)[None, :]
        s2 = tl.load(sin_ptr + m * cs_stride + D // 2 + half).to(tl.float32)[None, :]
        w1 = tl.where(
            is_q[:, None],
            tl.load(qw_ptr + half).to(tl.float32)[None, :],
            tl.load(kw_ptr + half).to(tl.float32)[None, :],
        )
        w2 = tl.where(
            is_q[:, None],
            tl.load(qw_ptr + D // 2 + half).to(tl.float32)[None, :],
            tl.load(kw_ptr + D // 2 + half).to(tl.float32)[None, :],
        )
        n1 = x1 * inv[:, None] * w1
        n2 = x2 * inv[:, None] * w2
        r1 = n1 * c1 - n2 * s1
        r2 = n2 * c2 + n1 * s2
        qo = q_ptr + m * HQ * D + offs
        tl.store(qo, r1.to(q_ptr.dtype.element_ty), mask=is_q[:, None])
        tl.store(qo + D // 2, r2.to(q_ptr.dtype.element_ty), mask=is_q[:, None])
        slot = tl.load(row_ptr + m)
        pos = tl.load(pos_ptr + m)
        hk = tl.where(is_k, h - HQ, 0)
        dst = slot * kc_s_slot + hk[:, None] * kc_s_head + pos * kc_s_pos + half[None, :]
        tl.store(kc_ptr + dst, cache_value(r1, kc_ptr, KV_FP8), mask=is_k[:, None])
        tl.store(kc_ptr + dst + D // 2, cache_value(r2, kc_ptr, KV_FP8), mask=is_k[:, None])
        full = tl.arange(0, D)
        v = tl.load(base + (HQ + HKV + hk)[:, None] * D + full[None, :], mask=is_k[:, None], other=0.0)
        vdst = slot * kc_s_slot + hk[:, None] * kc_s_head + pos * kc_s_pos + full[None, :]
        tl.store(vc_ptr + vdst, cache_value(v, vc_ptr, KV_FP8), mask=is_k[:, None])

    @triton.jit
    def _silu_mul_kernel(gu_ptr, out_ptr, inter, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = col < inter
        g = tl.load(gu_ptr + row * 2 * inter + col, mask=m, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + row * 2 * inter + inter + col, mask=m, other=0.0).to(tl.float32)
        silu = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + row * inter + col, (silu * u).to(out_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _skinny_linear_kernel(
        x_ptr,
        w_ptr,
        b_ptr,
        y_ptr,
        M,
        N,
        K,
        sxm,
        swn,
        sym,
        K_ITERS: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        SPLIT_K: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        """y[M, N] = x[M, K] @ w[N, K]^T (+ b) for a few rows: each program streams BLOCK_N rows of
        the weight (contiguous along K) once; the rows of x ride along padded to BLOCK_M >= 16 for
        the tensor-core dot. SPLIT_K > 1 writes float32 partial sums [SPLIT_K, M, N] instead."""
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        rm = tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        mm = rm < M
        nm = rn < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        k_lo = pid_k * (K_ITERS * BLOCK_K)
        for i in range(K_ITERS):  # a compile-time trip count: pipelined, and the interpreter can run it
            kk = k_lo + i * BLOCK_K + rk
            km = kk < K
            x = tl.load(x_ptr + rm[:, None] * sxm + kk[None, :], mask=mm[:, None] & km[None, :], other=0.0)
            w = tl.load(w_ptr + rn[:, None] * swn + kk[None, :], mask=nm[:, None] & km[None, :], other=0.0)
            if IEEE:
                acc += tl.dot(x, tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(w))
        out_mask = mm[:, None] & nm[None, :]
        if SPLIT_K == 1:
            if HAS_BIAS:
                acc += tl.load(b_ptr + rn, mask=nm, other=0.0).to(tl.float32)[None, :]
            tl.store(y_ptr + rm[:, None] * sym + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=out_mask)
        else:
            tl.store(y_ptr + pid_k * M * N + rm[:, None] * N + rn[None, :], acc, mask=out_mask)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """(x + delta, rms_norm(x + delta) * weight) for x [M, H] (delta None: x itself)."""
    m, h = x.shape
    normed = torch.empty_like(x)
    x_out = torch.empty_like(x) if delta is not None else x
    _add_rms_norm_kernel[(m,)](
        x,
        delta if delta is not None else x,
        weight,
        x_out,
        normed,
        eps,
        H=h,
        BLOCK=triton.next_power_of_2(h),
        HAS_D=delta is not None,
    )
    return x_out, normed


# q|k heads per program of qk_norm_rope_store: a token's 16 + 8 heads of the 1.7B talker in 3
# programs, each a [8, 64] tile per half.
QK_HEADS_PER_PROGRAM = 8


def qk_norm_rope_store(
    qkv,
    q_norm,
    k_norm,
    cos,
    sin,
    k_cache,
    v_cache,
    rows,
    positions,
    eps: float,
    num_heads: int,
    num_kv_heads: int,
    heads_per_program: int = QK_HEADS_PER_PROGRAM,
    num_warps: int = 4,
) -> torch.Tensor:
    """qkv [M, (HQ + 2 HKV) * D] -> q [M, HQ, D] (per-head RMSNorm, RoPE); the normed, rotated key
    and the value of token m go to k_cache / v_cache [slot, head, pos, D] at (rows[m], positions[m]).
    cos / sin: [M, D] (a stride-0 first dimension is fine). `heads_per_program` (a power of two)
    and `num_warps` set the tile (benchmarks/qk_rope_store.py times them)."""
    m = qkv.shape[0]
    d = q_norm.shape[0]
    if d < 2 or d & (d - 1):
        raise ValueError(f"head_dim must be a power of two for the fused kernels, got {d}")
    q = torch.empty(m, num_heads, d, device=qkv.device, dtype=qkv.dtype)
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1 or cos.stride(-1) != 1:
        raise ValueError(
            "k_cache and v_cache need equal strides with contiguous heads, cos/sin contiguous rows"
        )
    hb = min(heads_per_program, triton.next_power_of_2(num_heads + num_kv_heads))
    _qk_norm_rope_store_kernel[(m, triton.cdiv(num_heads + num_kv_heads, hb))](
        qkv,
        q_norm,
        k_norm,
        cos,
        sin,
        q,
        k_cache,
        v_cache,
        rows,
        positions,
        eps,
        cos.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        HQ=num_heads,
        HKV=num_kv_heads,
        D=d,
        HB=hb,
        KV_FP8=kv_fp8(k_cache),
        num_warps=num_warps,
    )
    return q


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[M, 2I] (gate | up) -> silu(gate) * up, [M, I]."""
    m, two_i = gate_up.shape
    inter = two_i // 2
    out = torch.empty(m, inter, device=gate_up.device, dtype=gate_up.dtype)
    block = 1024
    _silu_mul_kernel[(m, triton.cdiv(inter, block))](gate_up, out, inter, BLOCK=block)
    return out


# Skinny-matmul tiles: (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages).
SKINNY_DEFAULT = (32, 128, 1, 4, 4)
# Weight shapes (N, K) where the skinny kernel beat cuBLAS inside CUDA graphs
# (benchmarks/skinny_linear.py; the runs are in BENCHMARKS.md): (most rows it wins at, tile).
# Every other shape measured equal or slower and stays on cuBLAS.
SKINNY_RULES: dict[tuple[int, int], tuple[int, tuple[int, int, int, int, int]]] = {
    (4096, 1024): (16, (32, 128, 1, 4, 5)),
    (1024, 2048): (4, (16, 256, 1, 4, 5)),
    (2048, 1024): (32, (16, 128, 1, 4, 5)),
}


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: tuple[int, int, int, int, int] | None = None,
) -> torch.Tensor:
    """F.linear for x [M, K] with M <= 64 rows, as one Triton kernel that reads the weight once
    (split-K > 1: a second, summing step). `config` overrides the tile table.

    Long, kept in one piece: a launch wrapper (tile choice, then one or two launches) reads best whole."""
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k or x.stride(-1) != 1 or weight.stride(-1) != 1 or m > 64:
        raise ValueError("skinny_linear needs x [M <= 64, K] and weight [N, K] with contiguous rows")
    rule = SKINNY_RULES.get((n, k))
    block_n, block_k, split_k, warps, stages = config or (rule[1] if rule else SKINNY_DEFAULT)
    block_m = max(16, triton.next_power_of_2(m))
    k_per = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    split_k = triton.cdiv(k, k_per)
    grid = (triton.cdiv(n, block_n), split_k)
    ieee = x.dtype == torch.float32
    if split_k == 1:
        y = torch.empty(m, n, device=x.device, dtype=x.dtype)
        _skinny_linear_kernel[grid](
            x,
            weight,
            bias if bias is not None else weight,
            y,
            m,
            n,
            k,
            x.stride(0),
            weight.stride(0),
            y.stride(0),
            k_per // block_k,
            HAS_BIAS=bias is not None,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            SPLIT_K=1,
            IEEE=ieee,
            num_warps=warps,
            num_stages=stages,
        )
        return y
    part = torch.empty(split_k, m, n, device=x.device, dtype=torch.float32)
    _skinny_linear_kernel[grid](
        x,
        weight,
        weight,
        part,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        n,
        k_per // block_k,
        HAS_BIAS=False,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        SPLIT_K=split_k,
        IEEE=ieee,
        num_warps=warps,
        num_stages=stages,
    )
    y = part.sum(0)
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype)


def use_skinny(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear` takes the skinny kernel for this input and weight (see SKINNY_RULES)."""
    rule = SKINNY_RULES.get(tuple(weight.shape))
    return (
        rule is not None
        and x.dim() == 2
        and x.shape[0] <= rule[0]
        and x.stride(-1) == 1
        and weight.stride(-1) == 1
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, through `skinny_linear` where SKINNY_RULES says it is faster (few rows, 2-D x)."""
    if use_skinny(x, weight):
        return skinny_linear(x, weight, bias)
    return torch.nn.functional.linear(x, weight, bias)


def self_check(
    device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, block_n: int
) -> bool:
    """Whether `qkv_attention` compiles here and equals the two kernels it replaces on a small
    random case of these head counts (the runner falls back to the two kernels otherwise)."""
    try:
        g = torch.Generator(device="cpu").manual_seed(0)
        m, slots, length = 3, 4, 40
        qkv = torch.randn(m, (heads + 2 * kv_heads) * head_dim, generator=g).to(device, dtype)
        qn = (torch.rand(head_dim, generator=g) + 0.5).to(device, dtype)
        kn = (torch.rand(head_dim, generator=g) + 0.5).to(device, dtype)
        ang = torch.rand(m, head_dim, generator=g).to(device, torch.float32)
        cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
        cache = torch.randn(2, slots, kv_heads, length, head_dim, generator=g).to(device, dtype)
        rows = torch.tensor([2, 0, 3], device=device)
        wpos = torch.tensor([5, 0, length - 1], device=device)
        apos = torch.tensor([5, 0, 30], device=device)
        kc, vc = cache[0].clone(), cache[1].clone()
        q = qk_norm_rope_store(qkv, qn, kn, cos, sin, kc, vc, rows, wpos, 1e-6, heads, kv_heads)
        want = decode_attention(q, kc, vc, rows, apos, block_n=block_n)
        kc2, vc2 = cache[0].clone(), cache[1].clone()
        got = qkv_attention(
            qkv, qn, kn, cos, sin, kc2, vc2, rows, wpos, apos, 1e-6, heads, kv_heads, block_n=block_n
        )
        tol = 1e-3 if dtype == torch.float32 else 5e-2
        return bool(
            torch.allclose(got.float(), want.float(), atol=tol, rtol=tol)
            and torch.allclose(kc2.float(), kc.float(), atol=tol, rtol=tol)
            and torch.equal(vc2, vc)
        )
    except Exception:  # a compile or launch failure on this device: keep the two kernels
        return False
