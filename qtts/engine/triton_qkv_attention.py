"""The frame step's q/k norm, RoPE, KV store and decode attention as one Triton kernel.

`triton_ops.qk_norm_rope_store` then `triton_attention.decode_attention` were two kernels a layer
(103 a frame step: 28 talker layers and 75 predictor layer-steps), and q made a round trip through
memory between them. Here the program of (token m, KV head h) normalizes and rotates the G query
heads of h and the key of h, stores the key and the value at (rows[m], wpos[m]), and attends
positions [0, apos[m]] of slot rows[m] with the queries still in registers. Its own key is read
back from the cache after a block barrier (the same program wrote it). Same arithmetic as the two
kernels (float32 norms and RoPE, q rounded to the model dtype before the dots); only the norm's
sum runs over the whole head at once instead of two halves.

Runs under Triton's interpreter (`TRITON_INTERPRET=1`) on CPU tensors, like the others.
"""

from __future__ import annotations

import torch

from qtts.engine.triton_attention import kv_fp8, triton

if triton is not None:
    import triton.language as tl

    from qtts.engine.triton_attention import _attend_group, cache_value

    @triton.jit
    def _normed_rotated(x_ptr, w_ptr, cos, sin, rows_off, d, part, sign, mask, eps, D: tl.constexpr):
        """Rows at `rows_off` (+ d) of D elements: RMSNorm (weight w) then RoPE (rotate half)."""
        x = tl.load(x_ptr + rows_off + d[None, :], mask=mask, other=0.0).to(tl.float32)
        xp = tl.load(x_ptr + rows_off + part[None, :], mask=mask, other=0.0).to(tl.float32)
        inv = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]
        n = x * inv * tl.load(w_ptr + d, mask=d < D, other=0.0).to(tl.float32)[None, :]
        np_ = xp * inv * tl.load(w_ptr + part, mask=d < D, other=0.0).to(tl.float32)[None, :]
        return n * cos[None, :] + sign[None, :] * np_ * sin[None, :]

    @triton.jit
    def _qkv_attention_kernel(
        qkv_ptr,
        qw_ptr,
        kw_ptr,
        cos_ptr,
        sin_ptr,
        kc_ptr,
        vc_ptr,
        row_ptr,
        wpos_ptr,
        apos_ptr,
        o_ptr,
        eps,
        scale,
        cs_stride,
        kc_s_slot,
        kc_s_head,
        kc_s_pos,
        HQ: tl.constexpr,
        HKV: tl.constexpr,
        D: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_N: tl.constexpr,
        IEEE: tl.constexpr,
        PIPELINED: tl.constexpr,
        KV_FP8: tl.constexpr,
    ):
        """Long, kept in one piece: prologue (q, k, v of one KV head), barrier, attention loop."""
        m = tl.program_id(0)
        hk = tl.program_id(1)
        G: tl.constexpr = HQ // HKV
        gi = tl.arange(0, BLOCK_H)
        gm = gi < G
        d = tl.arange(0, BLOCK_D)
        dm = d < D
        part = tl.where(d < D // 2, d + D // 2, d - D // 2)  # the rotate-half partner
        sign = tl.where(d < D // 2, -1.0, 1.0)
        cos = tl.load(cos_ptr + m * cs_stride + d, mask=dm, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + m * cs_stride + d, mask=dm, other=0.0).to(tl.float32)
        row = qkv_ptr + m * (HQ + 2 * HKV) * D
        q = _normed_rotated(
            row,
            qw_ptr,
            cos,
            sin,
            ((hk * G + gi) * D)[:, None],
            d,
            part,
            sign,
            gm[:, None] & dm[None, :],
            eps,
            D,
        ).to(o_ptr.dtype.element_ty)
        k = _normed_rotated(
            row,
            kw_ptr,
            cos,
            sin,
            (HQ + hk) * D + tl.zeros([1, 1], tl.int32),
            d,
            part,
            sign,
            dm[None, :],
            eps,
            D,
        )
        v = tl.load(row + (HQ + HKV + hk) * D + d, mask=dm, other=0.0)
        slot = tl.load(row_ptr + m)
        base = slot * kc_s_slot + hk * kc_s_head
        dst = base + tl.load(wpos_ptr + m) * kc_s_pos + d[None, :]
        tl.store(kc_ptr + dst, cache_value(k, kc_ptr, KV_FP8), mask=dm[None, :])
        tl.store(vc_ptr + dst, cache_value(v, vc_ptr, KV_FP8)[None, :], mask=dm[None, :])
        tl.debug_barrier()  # the key and value just stored are read back below
        n_keys = tl.load(apos_ptr + m) + 1
        out = _attend_group(
            q,
            kc_ptr,
            vc_ptr,
            base,
            n_keys,
            d,
            dm,
            kc_s_pos,
            scale,
            BLOCK_H,
            BLOCK_D,
            BLOCK_N,
            IEEE,
            PIPELINED,
        )
        tl.store(
            o_ptr + m * HQ * D + (hk * G + gi)[:, None] * D + d[None, :],
            out.to(o_ptr.dtype.element_ty),
            mask=gm[:, None] & dm[None, :],
        )


def qkv_attention(
    qkv,
    q_norm,
    k_norm,
    cos,
    sin,
    k_cache,
    v_cache,
    rows,
    wpos,
    apos,
    eps: float,
    num_heads: int,
    num_kv_heads: int,
    block_n: int = 64,
    num_stages: int = 3,
    num_warps: int = 4,
    pipelined: bool | None = None,
) -> torch.Tensor:
    """`qk_norm_rope_store(qkv, ..., rows, wpos)` then `decode_attention(q, ..., rows, apos)` in
    one kernel: qkv [M, (HQ + 2 HKV) * D] -> attention output [M, HQ * D]; K/V of token m written
    at (rows[m], wpos[m]) of k_cache / v_cache [slot, HKV, pos, D]. cos / sin: [M, D] rows (a
    stride-0 first dimension is fine)."""
    m = qkv.shape[0]
    d = q_norm.shape[0]
    if d < 2 or d & (d - 1):
        raise ValueError(f"head_dim must be a power of two for the fused kernels, got {d}")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1 or cos.stride(-1) != 1:
        raise ValueError(
            "k_cache and v_cache need equal strides with contiguous heads, cos/sin contiguous rows"
        )
    out = torch.empty(m, num_heads * d, device=qkv.device, dtype=qkv.dtype)
    _qkv_attention_kernel[(m, num_kv_heads)](
        qkv,
        q_norm,
        k_norm,
        cos,
        sin,
        k_cache,
        v_cache,
        rows,
        wpos,
        apos,
        out,
        eps,
        d**-0.5,
        cos.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        HQ=num_heads,
        HKV=num_kv_heads,
        D=d,
        BLOCK_D=max(16, d),
        BLOCK_H=max(16, triton.next_power_of_2(num_heads // num_kv_heads)),
        BLOCK_N=block_n,
        IEEE=qkv.dtype == torch.float32,
        PIPELINED=qkv.is_cuda if pipelined is None else pipelined,
        KV_FP8=kv_fp8(k_cache),
        num_stages=num_stages,
        num_warps=num_warps,
    )
    return out
