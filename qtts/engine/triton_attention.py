"""Triton attention kernels over the runner's KV slots: the frame step's and the packed prefill's.

`decode_attention`: token m attends positions [0, positions[m]] of slot rows[m] in the KV cache
[slot, kv_head, pos, D], online softmax in blocks of keys; the G = HQ / HKV query heads of one KV
head share one program (padded to 16 rows for tensor-core dots). Split from `triton_ops` (the
norm, rope-store and matmul kernels of the decode layers), which re-exports it.

The KV cache may be 8-bit (`kv_fp8`, e4m3 without a scale): the kernels that write it round into
it (`cache_value`), and every key block read widens to the queries' type before its dots.

`prefill_attention`: the packed prefill's causal attention. Prompt chunks of several slots are
concatenated into one token axis; a block of up to BLOCK_M consecutive tokens of one chunk (at
consecutive positions of one slot) and one KV head is one program, whose BLOCK_M x G query rows
read the slot's keys once per key block (their own K/V are already in the cache), each row
attending positions [0, its own position]. Varlen attention without padding or gathers.

All kernels also run under Triton's interpreter (`TRITON_INTERPRET=1`) on CPU tensors.
"""

from __future__ import annotations

import torch

try:  # Triton ships with CUDA builds of torch; CPU builds run the PyTorch path instead.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None

# The KV cache's 8-bit type (RunnerConfig.kv_cache_dtype="fp8"): e4m3, no scale (keys are RMS-normed
# per head; values are the model's own activations, far inside its +-448).
KV_FP8_DTYPE = torch.float8_e4m3fn


def kv_fp8(cache: torch.Tensor) -> bool:
    """Whether `cache` holds 8-bit floats (the kernels then round into it and widen out of it)."""
    return cache.dtype == KV_FP8_DTYPE


if triton is not None:

    @triton.jit
    def e4m3_round(x):
        """x (float32) rounded to the nearest float8 e4m3fn value, ties to even, saturating at
        +-448, still float32: the cast after it is exact. (Triton's interpreter rounds float8 casts
        wrongly where the mantissa carries into the exponent; this keeps CPU tests and the GPU on
        the same values as torch's own cast.)"""
        bits = x.to(tl.int32, bitcast=True)
        lsb = (bits >> 20) & 1  # keep 3 of float32's 23 mantissa bits
        normal = ((bits + 0x7FFFF + lsb) & -1048576).to(tl.float32, bitcast=True)
        sub = ((x * 512.0 + 12582912.0) - 12582912.0) * (1.0 / 512.0)  # subnormals: steps of 2^-9
        r = tl.where(tl.abs(x) < 0.015625, sub, normal)
        return tl.minimum(tl.maximum(r, -448.0), 448.0)

    @triton.jit
    def cache_value(x, cache_ptr, FP8: tl.constexpr):
        """x in the KV cache's type: rounded to e4m3 first when the cache is 8-bit (FP8)."""
        if FP8:
            return e4m3_round(x.to(tl.float32)).to(cache_ptr.dtype.element_ty)
        else:
            return x.to(cache_ptr.dtype.element_ty)

    @triton.jit
    def widen(x, like):
        """x in the type of `like`: an 8-bit block through float32 (Triton's interpreter cannot
        widen e4m3 subnormals to float64 directly), any other a plain cast (a no-op when equal)."""
        if x.dtype.is_fp8():
            return x.to(tl.float32).to(like.dtype)
        else:
            return x.to(like.dtype)

    @triton.jit
    def _attention_block(
        q,
        kc_ptr,
        vc_ptr,
        base,
        start,
        n_keys,
        d,
        dm,
        kc_s_pos,
        scale,
        m_i,
        l_i,
        acc,
        BLOCK_N: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        """Keys [start, start + BLOCK_N) of one slot and head into the online-softmax state."""
        n = start + tl.arange(0, BLOCK_N)
        nm = n < n_keys
        offs = base + n[:, None] * kc_s_pos + d[None, :]
        kv_mask = nm[:, None] & dm[None, :]
        # (an 8-bit cache widens to the queries' type here; otherwise a no-op)
        k = widen(tl.load(kc_ptr + offs, mask=kv_mask, other=0.0), q)
        v = widen(tl.load(vc_ptr + offs, mask=kv_mask, other=0.0), q)  # issued before the dot waits on k
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        else:
            s = tl.dot(q, tl.trans(k)).to(tl.float32) * scale
        s = tl.where(nm[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
        return m_new, l_i, acc

    @triton.jit
    def _attend_group(
        q,
        kc_ptr,
        vc_ptr,
        base,
        n_keys,
        d,
        dm,
        kc_s_pos,
        scale,
        BLOCK_H: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_N: tl.constexpr,
        IEEE: tl.constexpr,
        PIPELINED: tl.constexpr,
    ):
        """The BLOCK_H query rows `q` of one KV head against keys [0, n_keys) of one slot (`base`),
        online softmax: their attention output [BLOCK_H, BLOCK_D] in float32. PIPELINED: a `range`
        loop over the loaded length, which the compiler software-pipelines (loads of the next
        blocks in flight); Triton's interpreter cannot take a loaded bound there, so it runs the
        same blocks in a while loop. Shared by the frame step's attention kernels (inlined)."""
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        if PIPELINED:
            for start in range(0, n_keys, BLOCK_N):
                m_i, l_i, acc = _attention_block(
                    q,
                    kc_ptr,
                    vc_ptr,
                    base,
                    start,
                    n_keys,
                    d,
                    dm,
                    kc_s_pos,
                    scale,
                    m_i,
                    l_i,
                    acc,
                    BLOCK_N,
                    IEEE,
                )
        else:
            start = 0
            while start < n_keys:
                m_i, l_i, acc = _attention_block(
                    q,
                    kc_ptr,
                    vc_ptr,
                    base,
                    start,
                    n_keys,
                    d,
                    dm,
                    kc_s_pos,
                    scale,
                    m_i,
                    l_i,
                    acc,
                    BLOCK_N,
                    IEEE,
                )
                start += BLOCK_N
        return acc / l_i[:, None]

    @triton.jit
    def _decode_attention_kernel(
        q_ptr,
        kc_ptr,
        vc_ptr,
        row_ptr,
        pos_ptr,
        o_ptr,
        scale,
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
    ):
        """One query token against positions [0, pos] of its slot, for the G = HQ / HKV query heads
        of one KV head (padded to BLOCK_H rows and BLOCK_D >= 16 columns for tensor-core dots),
        online softmax (`_attend_group`). IEEE: full-precision float32 dots (float32 models; TF32
        otherwise)."""
        m = tl.program_id(0)
        hk = tl.program_id(1)
        G: tl.constexpr = HQ // HKV
        gi = tl.arange(0, BLOCK_H)
        gm = gi < G
        d = tl.arange(0, BLOCK_D)
        dm = d < D
        slot = tl.load(row_ptr + m)
        n_keys = tl.load(pos_ptr + m) + 1
        q = tl.load(
            q_ptr + m * HQ * D + (hk * G + gi)[:, None] * D + d[None, :],
            mask=gm[:, None] & dm[None, :],
            other=0.0,
        )
        base = slot * kc_s_slot + hk * kc_s_head
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

    @triton.jit
    def _prefill_attention_kernel(
        q_ptr,
        kc_ptr,
        vc_ptr,
        blk_ptr,
        o_ptr,
        scale,
        kc_s_slot,
        kc_s_head,
        kc_s_pos,
        HQ: tl.constexpr,
        HKV: tl.constexpr,
        D: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_G: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        IEEE: tl.constexpr,
        PIPELINED: tl.constexpr,
    ):
        """One query block (row b of `blk`: slot, first packed token, token count, first position)
        and one KV head. Row r of the block is token r // BLOCK_G, query head r % BLOCK_G of the
        KV head's group; it attends keys [0, first position + its token index]. A block of 0
        tokens (padding of a captured grid) loops over no keys and stores nothing."""
        b = tl.program_id(0)
        hk = tl.program_id(1)
        G: tl.constexpr = HQ // HKV
        slot = tl.load(blk_ptr + b * 4).to(tl.int64)  # slot offsets pass 2**31 in large caches
        q0 = tl.load(blk_ptr + b * 4 + 1)
        count = tl.load(blk_ptr + b * 4 + 2)
        p0 = tl.load(blk_ptr + b * 4 + 3)
        r = tl.arange(0, BLOCK_M * BLOCK_G)
        t = r // BLOCK_G
        g = r % BLOCK_G
        rm = (t < count) & (g < G)
        d = tl.arange(0, BLOCK_D)
        dm = d < D
        q_offs = (q0 + t)[:, None] * (HQ * D) + (hk * G + g)[:, None] * D + d[None, :]
        q = tl.load(q_ptr + q_offs, mask=rm[:, None] & dm[None, :], other=0.0)
        row_pos = p0 + t  # padding rows see keys [0, p0 + t] too: never an empty row, no NaN
        n_keys = p0 + count
        m_i = tl.full([BLOCK_M * BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M * BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_M * BLOCK_G, BLOCK_D], tl.float32)
        base = slot * kc_s_slot + hk * kc_s_head
        if PIPELINED:
            for start in range(0, n_keys, BLOCK_N):
                m_i, l_i, acc = _causal_block(
                    q,
                    kc_ptr,
                    vc_ptr,
                    base,
                    start,
                    n_keys,
                    row_pos,
                    d,
                    dm,
                    kc_s_pos,
                    scale,
                    m_i,
                    l_i,
                    acc,
                    BLOCK_N,
                    IEEE,
                )
        else:
            start = 0
            while start < n_keys:
                m_i, l_i, acc = _causal_block(
                    q,
                    kc_ptr,
                    vc_ptr,
                    base,
                    start,
                    n_keys,
                    row_pos,
                    d,
                    dm,
                    kc_s_pos,
                    scale,
                    m_i,
                    l_i,
                    acc,
                    BLOCK_N,
                    IEEE,
                )
                start += BLOCK_N
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # an empty block (count 0) stores nothing
        tl.store(o_ptr + q_offs, out.to(o_ptr.dtype.element_ty), mask=rm[:, None] & dm[None, :])

    @triton.jit
    def _causal_block(
        q,
        kc_ptr,
        vc_ptr,
        base,
        start,
        n_keys,
        row_pos,
        d,
        dm,
        kc_s_pos,
        scale,
        m_i,
        l_i,
        acc,
        BLOCK_N: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        """Keys [start, start + BLOCK_N) into the online-softmax state of rows whose last key is
        row_pos (causal)."""
        n = start + tl.arange(0, BLOCK_N)
        nm = n < n_keys
        offs = base + n[:, None] * kc_s_pos + d[None, :]
        kv_mask = nm[:, None] & dm[None, :]
        k = widen(tl.load(kc_ptr + offs, mask=kv_mask, other=0.0), q)
        v = widen(tl.load(vc_ptr + offs, mask=kv_mask, other=0.0), q)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        else:
            s = tl.dot(q, tl.trans(k)).to(tl.float32) * scale
        s = tl.where(nm[None, :] & (n[None, :] <= row_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
        return m_new, l_i, acc


def decode_attention(
    q,
    k_cache,
    v_cache,
    rows,
    positions,
    block_n: int = 64,
    num_stages: int = 3,
    num_warps: int = 4,
    pipelined: bool | None = None,
) -> torch.Tensor:
    """q [M, HQ, D]; token m attends positions [0, positions[m]] of slot rows[m] in
    k_cache / v_cache [slot, HKV, pos, D] (positions must lie inside the cache). Returns [M, HQ * D].
    `pipelined` (default: on CUDA) takes the software-pipelined loop (see the kernel)."""
    m, hq, d = q.shape
    hkv = k_cache.shape[1]
    out = torch.empty(m, hq * d, device=q.device, dtype=q.dtype)
    block_h = max(16, triton.next_power_of_2(hq // hkv))
    _decode_attention_kernel[(m, hkv)](
        q,
        k_cache,
        v_cache,
        rows,
        positions,
        out,
        d**-0.5,
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        HQ=hq,
        HKV=hkv,
        D=d,
        BLOCK_D=max(16, triton.next_power_of_2(d)),
        BLOCK_H=block_h,
        BLOCK_N=block_n,
        IEEE=q.dtype == torch.float32,
        PIPELINED=q.is_cuda if pipelined is None else pipelined,
        num_stages=num_stages,
        num_warps=num_warps,
    )
    return out


# Query rows of one packed-prefill program: tokens per block (x the group of query heads).
PREFILL_BLOCK_M = 64


def prefill_block_m(dtype: torch.dtype) -> int:
    """Tokens per query block for `dtype`: half as many for 4- and 8-byte types (their tiles take
    twice the shared memory and registers)."""
    return PREFILL_BLOCK_M if dtype.itemsize <= 2 else PREFILL_BLOCK_M // 2


def prefill_attention(
    q,
    k_cache,
    v_cache,
    blocks,
    block_m: int = PREFILL_BLOCK_M,
    block_n: int = 64,
    num_stages: int | None = None,
    num_warps: int = 8,
    pipelined: bool | None = None,
) -> torch.Tensor:
    """q [N, HQ, D] of packed prompt tokens whose K/V are already in k_cache / v_cache
    [slot, HKV, pos, D]; `blocks` int32 [B, 4] rows (slot, first token, count <= block_m, first
    position), as `packed_prefill.query_blocks` builds them with the same `block_m` (at least
    every block's count). Token q0 + j of a block attends
    positions [0, p0 + j] of its slot. Returns [N, HQ * D] (rows of tokens in no block: zero)."""
    n, hq, d = q.shape
    hkv = k_cache.shape[1]
    out = torch.zeros(n, hq * d, device=q.device, dtype=q.dtype)
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1 or not blocks.is_contiguous():
        raise ValueError("k_cache and v_cache need equal strides with contiguous heads; blocks contiguous")
    _prefill_attention_kernel[(blocks.shape[0], hkv)](
        q,
        k_cache,
        v_cache,
        blocks,
        out,
        d**-0.5,
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        HQ=hq,
        HKV=hkv,
        D=d,
        BLOCK_D=max(16, triton.next_power_of_2(d)),
        BLOCK_G=triton.next_power_of_2(hq // hkv),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        IEEE=q.dtype in (torch.float32, torch.float64),
        PIPELINED=q.is_cuda if pipelined is None else pipelined,
        num_stages=num_stages or (2 if q.dtype.itemsize <= 2 else 1),
        num_warps=num_warps,
    )
    return out
