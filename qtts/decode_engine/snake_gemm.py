"""The tail of a residual unit and the head of the next in one GEMM pass, time-major rows:

    g      = snake2(y + b1)                   prologue, on each tile of the GEMM's input
    x_new  = g @ W2^T + b2 + residual         the unit's 1x1 conv and residual add (epilogue)
    act    = snake1_next(x_new)               the next unit's activation, written after its
                                              carried history in that unit's conv input

After a block's last unit the next activation is the next block's (written in the "paired" layout
of its transposed conv, see `snake_nwc`) or the final one, and x_new itself is not needed.

y [M, K] is the unit's dilated conv output (M = B*T rows), x_new [M, N] the residual stream. Apart
from the conv, a residual unit then reads two tensors and writes two, instead of eight passes for a
separate SnakeBeta, GEMM, residual add and SnakeBeta. On CUDA (or under TRITON_INTERPRET=1 when
asked) this is one Triton kernel, accumulation in float32; the torch version computes the same.
"""

from __future__ import annotations

import torch

from qtts.decode_engine.snake_nwc import fast_sin_ok, sin_f32, tl, triton

if triton is not None:

    @triton.jit
    def _snake_gemm_kernel(
        y_ptr,
        w_ptr,
        b1_ptr,
        a2_ptr,
        ib2_ptr,
        b2_ptr,
        res_ptr,
        a1_ptr,
        ib1_ptr,
        x_ptr,
        act_ptr,
        M,
        steps,
        act_batch_stride,
        act_row_stride,
        act_row_offset,
        N: tl.constexpr,  # channels are few per model: one compiled kernel per width
        K: tl.constexpr,
        WRITE_X: tl.constexpr,
        ACT_MODE: tl.constexpr,  # 0: none, 1: after the history, 2: paired (prev | own step)
        IEEE: tl.constexpr,
        FAST_SIN: tl.constexpr,
        BM: tl.constexpr,
        BN: tl.constexpr,
        BK: tl.constexpr,
    ):
        rm = tl.program_id(0) * BM + tl.arange(0, BM)
        rm64 = rm.to(tl.int64)  # row bases in 64 bits, offsets within a row in 32
        rn = tl.program_id(1) * BN + tl.arange(0, BN)
        m_ok = rm < M
        n_ok = rn < N
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            rk = k0 + tl.arange(0, BK)
            k_ok = rk < K
            a = tl.load(
                (y_ptr + rm64 * K)[:, None] + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0
            )
            a = a.to(tl.float32) + tl.load(b1_ptr + rk, mask=k_ok, other=0.0).to(tl.float32)[None, :]
            al = tl.load(a2_ptr + rk, mask=k_ok, other=0.0)
            ib = tl.load(ib2_ptr + rk, mask=k_ok, other=0.0)
            s = sin_f32(a * al[None, :], FAST_SIN)
            g = (a + ib[None, :] * s * s).to(w_ptr.dtype.element_ty)  # masked columns stay 0
            w = tl.load(w_ptr + rk[:, None] * N + rn[None, :], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if IEEE:
                acc = tl.dot(g, w, acc, input_precision="ieee")
            else:
                acc = tl.dot(g, w, acc)
        mask = m_ok[:, None] & n_ok[None, :]
        acc = acc + tl.load(b2_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        acc = acc + tl.load((res_ptr + rm64 * N)[:, None] + rn[None, :], mask=mask, other=0.0).to(tl.float32)
        if WRITE_X:
            tl.store((x_ptr + rm64 * N)[:, None] + rn[None, :], acc.to(x_ptr.dtype.element_ty), mask=mask)
        if ACT_MODE != 0:
            al1 = tl.load(a1_ptr + rn, mask=n_ok, other=0.0)
            ib1 = tl.load(ib1_ptr + rn, mask=n_ok, other=0.0)
            s1 = sin_f32(acc * al1[None, :], FAST_SIN)
            v = (acc + ib1[None, :] * s1 * s1).to(act_ptr.dtype.element_ty)
            b = rm // steps  # 32-bit division; the address is formed in 64 bits
            t = rm % steps
            base = b.to(tl.int64) * act_batch_stride
            if ACT_MODE == 1:
                row = base + (t + act_row_offset).to(tl.int64) * act_row_stride
                tl.store((act_ptr + row)[:, None] + rn[None, :], v, mask=mask)
            else:
                own = base + t.to(tl.int64) * act_row_stride + N
                tl.store((act_ptr + own)[:, None] + rn[None, :], v, mask=mask)
                nxt = base + (t + 1).to(tl.int64) * act_row_stride
                tl.store((act_ptr + nxt)[:, None] + rn[None, :], v, mask=mask & (t + 1 < steps)[:, None])


def _pow2(n: int, lo: int, hi: int) -> int:
    p = lo
    while p < n and p < hi:
        p *= 2
    return p


def snake_gemm(
    y: torch.Tensor,
    b1: torch.Tensor,
    act2: tuple[torch.Tensor, torch.Tensor],
    w2t: torch.Tensor,
    b2: torch.Tensor,
    residual: torch.Tensor,
    act_next: tuple[torch.Tensor, torch.Tensor] | None = None,
    history_next: torch.Tensor | None = None,
    *,
    paired: bool = False,
    want_x: bool = True,
    use_triton: bool | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(x_new [B, T, N] or None, the next conv's input or None) for y [B, T, K], w2t [K, N] (the 1x1
    conv's weight, transposed) and residual [B, T, N].

    The next conv's input is cat(history_next [B, h, N], act) [B, h + T, N], or with `paired` the
    rows (act[t-1], act[t]) [B, T, 2N] with act[-1] = history_next [B, 1, N]."""
    b, t, k = y.shape
    n = w2t.shape[1]
    if use_triton is None:
        use_triton = y.is_cuda and triton is not None
    if not use_triton:
        return _snake_gemm_torch(y, b1, act2, w2t, b2, residual, act_next, history_next, paired, want_x)
    y = y.contiguous()
    residual = residual.contiguous()
    x_new = torch.empty(b, t, n, device=y.device, dtype=y.dtype) if want_x else None
    out, h = None, 0
    if act_next is not None:
        h = history_next.shape[1]
        if paired:
            out = torch.empty(b, t, 2 * n, device=y.device, dtype=y.dtype)
            out[:, 0, :n] = history_next[:, 0]
        else:
            out = torch.empty(b, h + t, n, device=y.device, dtype=y.dtype)
            if h:
                out[:, :h] = history_next
    if b * t == 0:
        return x_new, out
    # 64 x 64 x 32 tiles with 8 warps compile for sm_90 to wgmma at 98 registers (two CTAs, 16
    # warps an SM): this pass is memory-bound, and the first try (64 x 128 x 64, 219 registers,
    # one CTA an SM) measured 19.7 us a frame on the H200, far from its traffic.
    bm, bn, bk = 64, _pow2(n, 16, 64), _pow2(k, 16, 32)
    grid = (triton.cdiv(b * t, bm), triton.cdiv(n, bn))
    a1, ib1 = act_next if act_next is not None else act2
    dummy = y if x_new is None else x_new
    _snake_gemm_kernel[grid](
        y,
        w2t,
        b1,
        act2[0],
        act2[1],
        b2,
        residual,
        a1,
        ib1,
        dummy,
        dummy if out is None else out,
        b * t,
        t,
        0 if out is None else out.stride(0),
        0 if out is None else out.stride(1),
        h,
        N=n,
        K=k,
        WRITE_X=want_x,
        ACT_MODE=0 if act_next is None else 2 if paired else 1,
        IEEE=y.dtype == torch.float32,
        FAST_SIN=fast_sin_ok(y),
        BM=bm,
        BN=bn,
        BK=bk,
        num_warps=8 if bn >= 64 else 4,
    )
    return x_new, out


def _snake_gemm_torch(
    y: torch.Tensor,
    b1: torch.Tensor,
    act2: tuple[torch.Tensor, torch.Tensor],
    w2t: torch.Tensor,
    b2: torch.Tensor,
    residual: torch.Tensor,
    act_next: tuple[torch.Tensor, torch.Tensor] | None,
    history_next: torch.Tensor | None,
    paired: bool,
    want_x: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    v = y.float() + b1.float()
    g = (v + act2[1] * torch.sin(v * act2[0]).pow(2)).to(y.dtype)
    acc = torch.matmul(g.float(), w2t.float()) + b2.float() + residual.float()
    x_new = acc.to(y.dtype) if want_x else None
    if act_next is None:
        return x_new, None
    # The next activation is applied to the unrounded sum, as in the kernel.
    act = (acc + act_next[1] * torch.sin(acc * act_next[0]).pow(2)).to(y.dtype)
    hist = history_next.to(y.dtype)
    if paired:
        return x_new, torch.cat([torch.cat([hist, act[:, :-1]], dim=1), act], dim=2)
    return x_new, torch.cat([hist, act], dim=1)
