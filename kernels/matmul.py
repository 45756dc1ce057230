"""Launcher of the fixed-tile matmul (`jit/matmul.py`): exact mode's linear layers on CUDA.

`matmul_fixed_tile(x, weight, bias)` is `F.linear` for 2-D `x` with one launch configuration for
every shape, so each output row is the same bits whichever rows share the call. On CPU tensors it
runs under the Triton interpreter (tests); the engine's CPU path is `batch_invariant.row_tiled`.
"""

import torch
import triton

from . import interpreter_compat  # noqa: F401  (interpreted kernels need it before launch)
from .jit.matmul import matmul_kernel

# One tile for every call: 64 x 64 outputs per program, K in steps of 64, 4 warps, 3 stages.
BLOCK_M = 64
BLOCK_N = 64
BLOCK_K = 64
NUM_WARPS = 4
NUM_STAGES = 3


def matmul_fixed_tile(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`x @ weight.T + bias` for x `[M, K]`, weight `[N, K]`, bias `[N]` or None (one dtype,
    fp16, bf16 or fp32); returns `[M, N]` in that dtype, fp32-accumulated in K order."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"x, weight: expected [M, K] and [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias: expected [{weight.shape[0]}], got {tuple(bias.shape)}")
    num_rows, inner = x.shape
    num_cols = weight.shape[0]
    out = torch.empty(num_rows, num_cols, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    grid = (triton.cdiv(num_rows, BLOCK_M), triton.cdiv(num_cols, BLOCK_N))
    upcast = x.device.type == "cpu" and x.dtype == torch.bfloat16
    matmul_kernel[grid](
        x,
        weight,
        weight if bias is None else bias,  # unread without a bias
        out,
        num_rows,
        num_cols,
        inner,
        *x.stride(),
        *weight.stride(),
        *out.stride(),
        HAS_BIAS=bias is not None,
        # fp32 multiplies in full precision (TF32 would drop mantissa bits); the interpreter's
        # bf16 dot is wrong, so CPU tensors (tests) multiply bf16 values in fp32, exactly.
        DOT_PRECISION="ieee" if x.dtype == torch.float32 or upcast else "tf32",
        DOT_UPCAST=upcast,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
    )
    return out
