"""A matmul with one tile shape for every call: the batch-invariant linear layer of exact mode.

Each program computes a BLOCK_M x BLOCK_N tile of `x @ weight.T (+ bias)`, walking K in order
in BLOCK_K steps with an fp32 accumulator: no split-K and no shape-dependent configuration, so
an output element's reduction order depends only on K, never on how many rows the call has or
which tile the row falls in (rows past M are masked to zeros, not computed differently).
"""

import triton
import triton.language as tl


@triton.jit
def matmul_kernel(
    x_ptr,
    weight_ptr,
    bias_ptr,
    out_ptr,
    num_rows,
    num_cols,
    inner,
    stride_x_row,
    stride_x_inner,
    stride_weight_col,
    stride_weight_inner,
    stride_out_row,
    stride_out_col,
    HAS_BIAS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    row_block = tl.program_id(0).to(tl.int64)
    col_block = tl.program_id(1).to(tl.int64)
    rows = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    steps = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, inner, BLOCK_K):
        k = start + steps
        x = tl.load(
            x_ptr + rows[:, None] * stride_x_row + k[None, :] * stride_x_inner,
            mask=(rows[:, None] < num_rows) & (k[None, :] < inner),
            other=0.0,
        )
        w = tl.load(
            weight_ptr + cols[None, :] * stride_weight_col + k[:, None] * stride_weight_inner,
            mask=(cols[None, :] < num_cols) & (k[:, None] < inner),
            other=0.0,
        )
        # fp32 inputs multiply in full precision (TF32 would drop mantissa bits).
        if DOT_UPCAST:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + cols, mask=cols < num_cols, other=0.0)
        acc += bias[None, :].to(tl.float32)
    tl.store(
        out_ptr + rows[:, None] * stride_out_row + cols[None, :] * stride_out_col,
        acc.to(out_ptr.dtype.element_ty),
        mask=(rows[:, None] < num_rows) & (cols[None, :] < num_cols),
    )
