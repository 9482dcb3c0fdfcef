"""The numerics of a `benchmarks.talker_step` run: the model dtype, TF32 (off everywhere for
float32) and which kernels the frame step runs, as recorded beside every result."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from qtts.engine.model_runner import ModelRunner

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def set_precision(dtype: str) -> dict[str, Any]:
    """float32: TF32 off everywhere (call before any CUDA work). Returns the TF32 state."""
    if dtype == "float32":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")
    return tf32_state()


def tf32_state() -> dict[str, Any]:
    state = {
        "matmul_allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
        "cudnn_allow_tf32": bool(torch.backends.cudnn.allow_tf32),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }
    fp32 = getattr(torch.backends.cuda.matmul, "fp32_precision", None)  # the newer API, where it exists
    if fp32 is not None:
        state["matmul_fp32_precision"] = str(fp32)
    return state


def tf32_label(state: dict[str, Any]) -> str:
    on = (
        state["matmul_allow_tf32"]
        or state["cudnn_allow_tf32"]
        or state["float32_matmul_precision"] != "highest"
    )
    return "on" if on else "off"


def kernel_choices(runner: ModelRunner) -> dict[str, Any]:
    """Which kernels the frame step runs (RunnerConfig.decode_kernels / sample_kernel / skinny_matmul
    as resolved). Every Triton kernel accepts float32 (IEEE dots there, no TF32), so no choice
    depends on the dtype."""
    fused, sample, skinny = (
        runner.fused_decode,
        runner._sampling_kernels is not None,
        runner._linear is not F.linear,
    )
    note = (
        f"decode {'triton' if fused else 'torch'}, sampling {'triton' if sample else 'torch'}, "
        f"skinny matmul {'on' if skinny else 'off'}"
    )
    if runner.dtype == torch.float32 and (fused or sample):
        note += " (the Triton kernels take float32 as is, with IEEE float32 dots)"
    return {"fused_decode": fused, "sample_kernel": sample, "skinny_matmul": skinny, "kernels": note}
