"""The talker's decode layers in two layouts: the bundle's modules and the fast path.

The fast path concatenates q|k|v and gate|up weights (`LayerWeights`) and uses functional RMSNorm,
so a layer is a few kernels; its linears go through `fp8.linear` (F.linear, or the FP8 product
when `RunnerConfig.weight_dtype="fp8"` made the weights `fp8.Fp8Weight`); `fused_decoder_layers` runs a whole stack on the Triton kernels of
`qtts.engine.triton_ops`. Everything here is stateless: the runner owns the caches and passes them in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from qtts.engine.fp8 import Fp8Weight, linear
from qtts.model.layers import apply_rope


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, impl: str
) -> torch.Tensor:
    """q [B, Hq, T, D], k/v [B, Hkv, S, D], mask bool [B|1, 1, T, S] (True = attend) -> [B, Hq, T, D]."""
    scale = q.shape[-1] ** -0.5
    hq, hkv = q.shape[1], k.shape[1]
    if impl == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=hq != hkv)
    b, _, t, d = q.shape
    g = hq // hkv
    qg = q.reshape(b, hkv, g * t, d)
    scores = torch.matmul(qg, k.transpose(-1, -2)).float() * scale  # [B, Hkv, g*T, S]
    if mask is not None:
        m = mask.expand(mask.shape[0], 1, t, mask.shape[-1]).repeat(1, 1, g, 1)
        scores = scores.masked_fill(~m, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(probs, v).reshape(b, hq, t, d)


def module_qkv(attn, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Projections, per-head RMSNorm and RoPE of the bundle's attention module. x: [B, T, H]."""
    b, t, _ = x.shape
    q = attn.q_norm(attn.q_proj(x).view(b, t, attn.num_heads, attn.head_dim)).transpose(1, 2)
    k = attn.k_norm(attn.k_proj(x).view(b, t, attn.num_kv_heads, attn.head_dim)).transpose(1, 2)
    v = attn.v_proj(x).view(b, t, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer's weights in the fast-path layout (q|k|v and gate|up concatenated)."""

    ln1: torch.Tensor
    w_qkv: torch.Tensor
    b_qkv: torch.Tensor | None
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    w_o: torch.Tensor
    b_o: torch.Tensor | None
    ln2: torch.Tensor
    w_gate_up: torch.Tensor
    w_down: torch.Tensor


def fuse_layer(layer) -> LayerWeights:
    attn, mlp = layer.self_attn, layer.mlp
    biases = [attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]
    return LayerWeights(
        ln1=layer.input_layernorm.weight,
        w_qkv=torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).contiguous(),
        b_qkv=None if biases[0] is None else torch.cat(biases).contiguous(),
        q_norm=attn.q_norm.weight,
        k_norm=attn.k_norm.weight,
        w_o=attn.o_proj.weight,
        b_o=attn.o_proj.bias,
        ln2=layer.post_attention_layernorm.weight,
        w_gate_up=torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).contiguous(),
        w_down=mlp.down_proj.weight,
    )


def fast_qkv(x, ln1, w_qkv, b_qkv, q_norm, k_norm, cos, sin, eps: float, heads: int, kv_heads: int):
    """RMSNorm -> one q|k|v matmul -> per-head RMSNorm -> RoPE. x [B, T, H] -> q, k, v [B, h, T, D]."""
    b, t, _ = x.shape
    d = q_norm.shape[0]
    h = F.rms_norm(x, (x.shape[-1],), ln1, eps)
    q, k, v = linear(h, w_qkv, b_qkv).split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q = F.rms_norm(q.view(b, t, heads, d), (d,), q_norm, eps).transpose(1, 2)
    k = F.rms_norm(k.view(b, t, kv_heads, d), (d,), k_norm, eps).transpose(1, 2)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v.view(b, t, kv_heads, d).transpose(1, 2)


def fast_out_mlp(x, attn, w_o, b_o, ln2, w_gate_up, w_down, eps: float):
    """Output projection + residual, RMSNorm, one gate|up matmul, SwiGLU, down + residual."""
    x = x + linear(attn, w_o, b_o)
    gate, up = linear(F.rms_norm(x, (x.shape[-1],), ln2, eps), w_gate_up).chunk(2, dim=-1)
    return x + linear(F.silu(gate) * up, w_down)


def fast_predictor_layer(
    x,
    k_prev,
    v_prev,
    cos,
    sin,
    mask,
    ln1,
    w_qkv,
    b_qkv,
    q_norm,
    k_norm,
    w_o,
    b_o,
    ln2,
    w_gate_up,
    w_down,
    eps: float,
    heads: int,
    kv_heads: int,
):
    """One predictor layer that carries its per-frame keys/values as tensors (concatenated, not
    written into a cache), so the whole layer but the matmuls can fuse under torch.compile.
    (Weights are passed as tensors: compiled code guards on shapes, not on which layer it is.)"""
    b, t, _ = x.shape
    q, k, v = fast_qkv(x, ln1, w_qkv, b_qkv, q_norm, k_norm, cos, sin, eps, heads, kv_heads)
    keys, values = torch.cat([k_prev, k], dim=2), torch.cat([v_prev, v], dim=2)
    out = attend(q, keys, values, mask, "matmul").transpose(1, 2).reshape(b, t, -1)
    return fast_out_mlp(x, out, w_o, b_o, ln2, w_gate_up, w_down, eps), keys, values


def fp8_fused_kernels(kernels, weights: list[LayerWeights], x: torch.Tensor):
    """(add_rms_norm, silu_mul) for the fused layers: `kernels`' own, or with FP8 weights on CUDA
    the variants of `triton_fp8` that hand the next linear its input already quantized."""
    w = weights[0].w_qkv if weights else None
    if isinstance(w, Fp8Weight) and x.is_cuda and w.takes_fp8(x.shape[0]):
        from qtts.engine import triton_fp8

        return triton_fp8.add_rms_norm_fp8, triton_fp8.silu_mul_fp8
    return kernels.add_rms_norm, kernels.silu_mul


def fused_decoder_layers(
    kernels,
    lin,
    x,
    weights: list[LayerWeights],
    dcfg,
    k_cache,
    v_cache,
    rows,
    wpos,
    apos,
    cos,
    sin,
    final_norm,
    block_n: int = 64,
    stages: int = 3,
    fused_qkv: bool | int = False,
    warps: int = 4,
    qkv_block_n: int | None = None,
) -> torch.Tensor:
    """Decoder layers over tokens x [M, H]: token m writes its K/V at (rows[m], wpos[m]) and
    attends positions [0, apos[m]] of slot rows[m] (in blocks of `block_n` keys). Returns the
    final-normed hidden [M, H]. `kernels`: the module qtts.engine.triton_ops; `lin`: its `linear`
    (skinny matmuls) or F.linear; `stages`: the attention kernel's pipeline stages (`warps`: its
    warps a program, when not fused with the q/k norm; `qkv_block_n`: the fused kernel's key
    block, default `block_n`); `fused_qkv`:
    the q/k norm, RoPE, KV store and attention as one kernel (`qkv_attention`) instead of two,
    when true (an int: when x has at most that many rows)."""
    eps = dcfg.rms_norm_eps
    norm, silu_mul = fp8_fused_kernels(kernels, weights, x)
    if fused_qkv is not True and fused_qkv is not False:
        fused_qkv = x.shape[0] <= fused_qkv
    delta = None
    for i, w in enumerate(weights):
        x, h = norm(x, delta, w.ln1, eps)
        qkv = lin(h, w.w_qkv, w.b_qkv)
        heads = (dcfg.num_heads, dcfg.num_kv_heads)
        if fused_qkv:
            attn = kernels.qkv_attention(
                qkv,
                w.q_norm,
                w.k_norm,
                cos,
                sin,
                k_cache[i],
                v_cache[i],
                rows,
                wpos,
                apos,
                eps,
                *heads,
                block_n=qkv_block_n or block_n,
                num_stages=stages,
            )
        else:
            q = kernels.qk_norm_rope_store(
                qkv, w.q_norm, w.k_norm, cos, sin, k_cache[i], v_cache[i], rows, wpos, eps, *heads
            )
            attn = kernels.decode_attention(
                q, k_cache[i], v_cache[i], rows, apos, block_n=block_n, num_stages=stages, num_warps=warps
            )
        x, h = norm(x, lin(attn, w.w_o, w.b_o), w.ln2, eps)
        delta = lin(silu_mul(lin(h, w.w_gate_up)), w.w_down)
    return kernels.add_rms_norm(x, delta, final_norm.weight, final_norm.eps)[1]
