"""Compile the decoder's Triton kernels for sm_90 and print one line per kernel (run by
test_decode_kernels_compile.py in a process of its own: under TRITON_INTERPRET=1 Triton does not
lower kernels). Exit status 0 when all compile; 3 when this Triton has no CUDA toolchain."""

from __future__ import annotations

import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from qtts.decode_engine import snake_gemm, snake_nwc, snakebeta

H200 = GPUTarget("cuda", 90, 32)


def _ptx(fn, pointers: dict[str, str], consts: dict, num_warps: int) -> str:
    sig = {n: "constexpr" if n in consts else pointers.get(n, "i32") for n in fn.arg_names}
    src = ASTSource(fn=fn, signature=sig, constexprs=consts)
    return triton.compile(src, target=H200, options={"num_warps": num_warps}).asm["ptx"]


def main() -> int:
    bf16 = "*bf16"
    fp32 = "*fp32"
    checks = []
    try:
        ptrs = {n: bf16 for n in snake_nwc._snake_nwc_kernel.arg_names if n.endswith("_ptr")}
        ptrs.update(alpha_ptr=fp32, inv_beta_ptr=fp32)
        for paired in (False, True):
            consts = dict(
                HAS_BIAS=True,
                HAS_RES=True,
                WRITE_SUM=not paired,
                PAIRED=paired,
                FAST_SIN=True,
                BLOCK_R=32,
                BLOCK_C=128,
            )
            checks.append(
                (
                    f"snake_nwc paired={paired}",
                    _ptx(snake_nwc._snake_nwc_kernel, ptrs, consts, 8),
                    "st.global",
                )
            )
        ptrs = {n: bf16 for n in snake_gemm._snake_gemm_kernel.arg_names if n.endswith("_ptr")}
        ptrs.update(a2_ptr=fp32, ib2_ptr=fp32, a1_ptr=fp32, ib1_ptr=fp32)
        for mode in (0, 1, 2):
            consts = dict(
                N=96, K=96, WRITE_X=mode != 2, ACT_MODE=mode, IEEE=False, FAST_SIN=True, BM=64, BN=64, BK=32
            )
            checks.append(
                (f"snake_gemm act_mode={mode}", _ptx(snake_gemm._snake_gemm_kernel, ptrs, consts, 8), "mma")
            )
        ptrs = {"x_ptr": bf16, "out_ptr": bf16, "alpha_ptr": fp32, "inv_beta_ptr": fp32, "bias_ptr": bf16}
        consts = dict(HAS_BIAS=True, FAST_SIN=True, BLOCK=1024)
        checks.append(("snakebeta", _ptx(snakebeta._snake_kernel, ptrs, consts, 4), "st.global"))
    except RuntimeError as e:
        if "ptxas" in str(e):
            print(f"no CUDA toolchain: {e}")
            return 3
        raise
    for name, ptx, needle in checks:
        assert needle in ptx and "sin.approx.f32" in ptx, name
        print(f"ok {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
