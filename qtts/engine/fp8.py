"""FP8 (float8_e4m3fn) linear weights for the talker and code-predictor decoder layers (opt-in).

`RunnerConfig.weight_dtype="fp8"` quantizes every decoder-layer linear (q|k|v, o, gate|up, down of
the talker's 28 and the predictor's 5 layers) once at start-up: an `Fp8Weight` holds the weight in
float8_e4m3fn with one float32 scale per output channel (its row's absolute maximum / 448).
Activations are quantized per token (row) at run time, the same way, and the product is

    y[m, n] = sx[m] * sw[n] * sum_k xq[m, k] * wq[n, k]   (+ bias)

On CUDA that is `torch._scaled_mm` with row-wise scales (FP8 tensor cores, sm90; float32
accumulation, bfloat16 output); the per-token quantization of x is one Triton kernel where Triton
runs. Everywhere else (the CPU tests) a reference path computes the same formula from the
dequantized operands in float32 (float64 for a float64 model). The output heads, embeddings and
the predictor's input projection stay in the model dtype: they are a few percent of the bytes a
step reads and set the logits directly.

`linear(x, w, b)` is F.linear for a tensor weight and the FP8 product for an `Fp8Weight`: the fast
path's layer functions call it, so one switch covers decode, predictor and prefill.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from qtts.engine.fp8_types import FP8, FP8_MAX, QuantRows

__all__ = ["FP8", "FP8_MAX", "QuantRows"]  # re-exported: the kernels' and the tests' names

log = logging.getLogger(__name__)

WEIGHT_DTYPES = ("model", "fp8")
_MIN_AMAX = 1e-12


@dataclass(frozen=True)
class Fp8Weight:
    """A linear weight [N, K] as float8_e4m3fn `q` with per-output-channel float32 `scale` [N].
    `full` (optional): the model-dtype weight, which products of fewer than `min_rows` rows use
    instead (at small batches FP8 saved nothing measurable and its quantization costs kernels)."""

    q: torch.Tensor
    scale: torch.Tensor
    full: torch.Tensor | None = None
    min_rows: int = 0

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def takes_fp8(self, rows: int) -> bool:
        """Whether a product of `rows` rows uses the FP8 weight (else `full`)."""
        return self.full is None or rows >= self.min_rows

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return self.q.to(dtype) * self.scale.to(dtype)[:, None]


def quantize_weight(w: torch.Tensor, min_rows: int = 0) -> Fp8Weight:
    """Per-output-channel symmetric quantization: row n scaled so its absolute maximum is 448.
    `min_rows` > 0 keeps `w` itself for products of fewer rows."""
    wf = w.detach().float()
    scale = wf.abs().amax(dim=1).clamp_min(_MIN_AMAX) / FP8_MAX
    q = (wf / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    full = w if min_rows > 0 else None
    return Fp8Weight(q=q.contiguous(), scale=scale.contiguous(), full=full, min_rows=min_rows)


def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (float8 [M, K], float32 scale [M, 1]): per-token dynamic scaling."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp_min(_MIN_AMAX) / FP8_MAX
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows_reference`, as one Triton kernel on CUDA."""
    if x.is_cuda:
        from qtts.engine import triton_fp8

        if triton_fp8.triton is not None:
            return triton_fp8.quantize_rows(x)
    return quantize_rows_reference(x)


def _scaled_mm_ok(x: torch.Tensor, w: Fp8Weight) -> bool:
    n, k = w.q.shape
    return x.is_cuda and k % 16 == 0 and n % 16 == 0


_SCALED_MM_FAILED: list[str] = []  # the first failure, kept: every later call takes the reference


def _scaled_mm(xq: torch.Tensor, xs: torch.Tensor, w: Fp8Weight, dtype: torch.dtype) -> torch.Tensor | None:
    """torch._scaled_mm with row-wise scales (None where this device or build refuses it: the
    caller computes the reference instead, and a warning says so once)."""
    if _SCALED_MM_FAILED:
        return None
    try:
        y = torch._scaled_mm(xq, w.q.t(), scale_a=xs, scale_b=w.scale[None, :], out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError) as exc:
        _SCALED_MM_FAILED.append(str(exc))
        log.warning("torch._scaled_mm with row-wise scales failed (%s): FP8 linears take the reference", exc)
        return None
    return y.to(dtype)


def fp8_linear(x, w: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ w^T with x quantized per token (or already: a `QuantRows` [M, K]); output in
    x's (model) dtype."""
    if isinstance(x, QuantRows):
        x2, xq, xs, lead, dtype = x.q, x.q, x.scale, x.q.shape[:-1], x.dtype
    else:
        if not w.takes_fp8(x.numel() // max(x.shape[-1], 1)):
            return F.linear(x, w.full, bias)
        lead, k, dtype = x.shape[:-1], x.shape[-1], x.dtype
        x2 = x.reshape(-1, k)
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        xq, xs = quantize_rows(x2)
    y = _scaled_mm(xq, xs, w, dtype) if _scaled_mm_ok(x2, w) else None
    if y is None:
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        y = F.linear(xq.to(acc) * xs.to(acc), w.dequantize(acc)).to(dtype)
    if bias is not None:
        y = y + bias
    return y.reshape(*lead, -1)


def linear(x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, or `fp8_linear` when `w` is an `Fp8Weight`."""
    if isinstance(w, Fp8Weight):
        return fp8_linear(x, w, bias)
    return F.linear(x, w, bias)


def dispatching(lin):
    """`lin` (F.linear or the skinny-matmul `linear`) for tensor weights, `fp8_linear` for FP8 ones."""

    def call(x, w, bias=None):
        if isinstance(w, Fp8Weight):
            if isinstance(x, QuantRows) or w.takes_fp8(x.numel() // max(x.shape[-1], 1)):
                return fp8_linear(x, w, bias)
            w = w.full
        return lin(x, w, bias)

    return call


def quantize_layer(w, min_rows: int = 0):
    """A `fused_layers.LayerWeights` with its four linear weights in FP8 (norms and biases kept);
    `min_rows` > 0: products of fewer rows keep the model-dtype weights."""
    return dataclasses.replace(
        w,
        w_qkv=quantize_weight(w.w_qkv, min_rows),
        w_o=quantize_weight(w.w_o, min_rows),
        w_gate_up=quantize_weight(w.w_gate_up, min_rows),
        w_down=quantize_weight(w.w_down, min_rows),
    )
