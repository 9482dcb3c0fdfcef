"""One Triton kernel per sampling call: temperature, top-k, top-p, greedy and the inverse-CDF draw.

`sampler.sample_rows` (the PyTorch reference) sorts the vocabulary and draws its uniforms in many
small kernels, which dominated the frame step's sampling time on the GPU. `sample` does one row
per program, with the whole row in registers:

- the uniform is `sampler.counter_uniform(seed, frame, codebook)`, computed in uint32 arithmetic
  in the kernel (bit-for-bit the same), or read from a given tensor;
- top-k: the k-th largest scaled logit by bisection over order-preserving int32 keys of the
  float32 values (at most 32 block reductions, fewer when the count hits k exactly);
- top-p: the smallest key t whose mass strictly above t is below p, by the same bisection over
  float32 sums of the probabilities;
- the draw: `tl.cumsum` of the kept probabilities in vocabulary order.

The semantics (value thresholds, ties kept together, draw in index order) are those of
`sampler.sample_rows` without `max_candidates`; results agree with it except where float32
rounding of a sum lands exactly on a boundary (summation orders differ).

The kernel also runs under Triton's interpreter (`TRITON_INTERPRET=1`) on CPU tensors, which is
how the CPU tests check it against the reference.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

# The same Triton import guard and device check as the decode kernels (None without Triton).
from qtts.engine.triton_ops import available, tl, triton

__all__ = ["available", "sample"]


if triton is not None:

    @triton.jit
    def _mix32(x):
        """sampler._mix32 on uint32 (the multiplies wrap modulo 2**32)."""
        x = x ^ (x >> 16)
        x = x * 0x7FEB352D
        x = x ^ (x >> 15)
        x = x * 0x846CA68B
        return x ^ (x >> 16)

    @triton.jit
    def _counter_uniform(seed, frame, codebook):
        """sampler.counter_uniform for one int64 seed (>= 0), int64 frame and int32 codebook."""
        h = _mix32(seed.to(tl.uint32))
        h = _mix32(h ^ (seed >> 32).to(tl.uint32))
        h = _mix32(h ^ frame.to(tl.uint32))
        h = _mix32(h ^ (codebook.to(tl.uint32) * 0x9E3779B9 + 1))
        return (h >> 8).to(tl.float32) * (1.0 / 16777216.0)

    @triton.jit
    def _sample_row(x, valid, offs, temp, k, p, u, V: tl.constexpr):
        s = tl.div_rn(x, tl.maximum(temp, 1e-5))  # IEEE division, as torch
        bits = s.to(tl.int32, bitcast=True)
        key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # int32 order == float order
        key = tl.where(s == 0.0, 0, key)  # -0.0 ties with +0.0
        key = tl.where(valid, key, -2147483648)  # below every float's key, -inf included
        kmax = tl.max(key, axis=0)
        thr = tl.min(tl.where(valid, key, 2147483647), axis=0)  # keep everything
        if (k > 0) & (k < V):
            kk = k.to(tl.int32)
            # Largest t with count(key >= t) >= k, i.e. the k-th largest key. Invariant:
            # count(key >= lo) >= k > count(key >= hi). A count of exactly k ends early: {key >= lo}
            # is then already the kept set.
            lo = thr
            hi = kmax + 1
            c_lo = kk * 0 + V
            while (lo + 1 < hi) & (c_lo != kk):
                mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)  # floor((lo + hi) / 2), no overflow
                c = tl.sum((key >= mid).to(tl.int32), axis=0)
                up = c >= kk
                lo = tl.where(up, mid, lo)
                c_lo = tl.where(up, c, c_lo)
                hi = tl.where(up, hi, mid)
            thr = lo
        m = tl.where(kmax < 0, kmax ^ 0x7FFFFFFF, kmax).to(tl.float32, bitcast=True)  # max(s)
        e = tl.where(key >= thr, tl.exp(s - m), 0.0)
        probs = tl.div_rn(e, tl.sum(e, axis=0))
        if p < 1.0:
            # Smallest t with G(t) = sum(probs[key > t]) < p; id i stays iff G(key_i) < p, i.e.
            # iff key_i >= t (G does not increase with t). Invariant: G(lo) >= p > G(hi).
            # G(max key) = 0, so the top tie group always stays.
            lo = thr - 1
            hi = kmax
            while lo + 1 < hi:
                mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)  # floor((lo + hi) / 2), no overflow
                g = tl.sum(tl.where(key > mid, probs, 0.0), axis=0)
                below = g < p
                hi = tl.where(below, mid, hi)
                lo = tl.where(below, lo, mid)
            thr = tl.maximum(thr, hi)
        w = tl.where(key >= thr, probs, 0.0)
        target = u * tl.sum(w, axis=0)
        cdf = tl.cumsum(w, axis=0)
        choice = tl.sum(((cdf <= target) & valid).to(tl.int32), axis=0)
        hit = tl.sum(tl.where(offs == choice, w, 0.0), axis=0)
        last = tl.max(tl.where(w > 0.0, offs, -1), axis=0)
        return tl.where((choice >= V) | (hit == 0.0), last, choice)

    @triton.jit(do_not_specialize=["codebook"])
    def _sample_kernel(
        x_ptr,
        x_stride,
        t_ptr,
        t_stride,
        k_ptr,
        k_stride,
        p_ptr,
        p_stride,
        g_ptr,
        g_stride,
        seed_ptr,
        seed_stride,
        frame_ptr,
        frame_stride,
        u_ptr,
        u_stride,
        out_ptr,
        u_out_ptr,
        codebook,
        V: tl.constexpr,
        BLOCK: tl.constexpr,
        HAS_U: tl.constexpr,
        WRITE_U: tl.constexpr,
    ):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        valid = offs < V
        x = tl.load(x_ptr + row * x_stride + offs, mask=valid, other=float("-inf")).to(tl.float32)
        if HAS_U:
            u = tl.load(u_ptr + row * u_stride).to(tl.float32)
        else:
            u = _counter_uniform(
                tl.load(seed_ptr + row * seed_stride), tl.load(frame_ptr + row * frame_stride), codebook
            )
        if WRITE_U:
            tl.store(u_out_ptr + row, u)
        greedy = tl.load(g_ptr + row * g_stride) != 0
        temp = tl.load(t_ptr + row * t_stride).to(tl.float32)
        if greedy:
            choice = tl.argmax(x, axis=0).to(tl.int32)
        else:
            k = tl.load(k_ptr + row * k_stride)
            p = tl.load(p_ptr + row * p_stride).to(tl.float32)
            choice = _sample_row(x, valid, offs, temp, k, p, u, V).to(tl.int32)
        # sampler.INVALID_ID for a row whose scaled logits hold NaN or +inf, or no finite value.
        s = tl.div_rn(x, tl.where(greedy, 1.0, tl.maximum(temp, 1e-5)))
        nonfinite = tl.sum((((s != s) | (s == float("inf"))) & valid).to(tl.int32), axis=0)
        finite = tl.sum(((s > float("-inf")) & valid).to(tl.int32), axis=0)
        choice = tl.where((nonfinite > 0) | (finite == 0), -1, choice)
        tl.store(out_ptr + row, choice.to(tl.int64))


def _stride(t: torch.Tensor) -> int:
    if t.dim() != 1:
        raise ValueError(f"per-row arguments must be 1-D, got shape {tuple(t.shape)}")
    return t.stride(0)


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    greedy: torch.Tensor,
    seed: torch.Tensor | None,
    frame: torch.Tensor | None,
    codebook: int,
    uniform: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    return_uniform: bool = False,
    num_warps: int | None = None,
):
    """One int64 id per row of `logits` [B, V] (bf16 / fp16 / fp32, unit column stride, any row
    stride; -inf allowed), with `sampler.sample_rows`'s semantics (no max_candidates), including
    `sampler.INVALID_ID` for a row with NaN / +inf scores or no finite one.

    Per row: temperature (float), top_k (integer; <= 0 or >= V: all), top_p (float; >= 1: off),
    greedy (bool or integer, nonzero: argmax), seed and frame (int64, seed in [0, 2**63)). All are
    1-D with any stride, so columns of a state matrix can be passed as they are. The draw uses
    `sampler.counter_uniform(seed, frame, codebook)`, computed in the kernel, or `uniform` [B]
    (float32 in [0, 1)) when given (seed and frame may then be None).

    `codebook` is a Python int (0 for the talker's codebook 0, j + 1 for predictor step j).
    `out`: a contiguous int64 [B] tensor to write into. `return_uniform`: also return the float32 [B]
    uniforms the kernel used. `num_warps`: 4 for V <= 2048, else 8 unless given (not tuned on a GPU
    yet). No host synchronisation: safe to capture in a CUDA graph.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [B, V], got shape {tuple(logits.shape)}")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    b, v = logits.shape
    if out is None:
        out = torch.empty(b, dtype=torch.long, device=logits.device)
    elif out.shape != (b,) or out.dtype != torch.long or not out.is_contiguous():
        raise ValueError("out must be a contiguous int64 [B] tensor")
    u_out = torch.empty(b, dtype=torch.float32, device=logits.device) if return_uniform else out
    if uniform is None and (seed is None or frame is None):
        raise ValueError("seed and frame are needed when no uniform is given")
    rows = _Rows(temperature, top_k, top_p, greedy, seed, frame, uniform)
    _launch(logits, rows, out, u_out, codebook, num_warps)
    return (out, u_out) if return_uniform else out


class _Rows(NamedTuple):
    """`sample`'s per-row arguments, as it takes them."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    greedy: torch.Tensor
    seed: torch.Tensor | None
    frame: torch.Tensor | None
    uniform: torch.Tensor | None


def _launch(
    logits: torch.Tensor,
    rows: _Rows,
    out: torch.Tensor,
    u_out: torch.Tensor,
    codebook: int,
    num_warps: int | None,
) -> None:
    """`sample`'s kernel launch on the rows of `logits`, its arguments checked there (one program
    per row, none without rows); `u_out` is `out` unless the uniforms are to be written."""
    b, v = logits.shape
    temperature, top_k, top_p, greedy, seed, frame, uniform = rows
    if uniform is None:
        u_arg, u_stride = temperature, 0
    else:
        u_arg, u_stride = uniform, _stride(uniform)
        seed = frame = top_k  # unused by the kernel; any 1-D int64 tensor
    block = triton.next_power_of_2(v)
    if num_warps is None:
        num_warps = 4 if block <= 2048 else 8
    if b:
        _sample_kernel[(b,)](
            logits,
            logits.stride(0),
            temperature,
            _stride(temperature),
            top_k,
            _stride(top_k),
            top_p,
            _stride(top_p),
            greedy,
            _stride(greedy),
            seed,
            _stride(seed),
            frame,
            _stride(frame),
            u_arg,
            u_stride,
            out,
            u_out,
            int(codebook),
            V=v,
            BLOCK=block,
            HAS_U=uniform is not None,
            WRITE_U=u_out is not out,  # `sample`'s return_uniform
            num_warps=num_warps,
        )
