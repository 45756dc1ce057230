"""Batch-invariant forms of the ops a decoder forward reduces over: each output row is computed
from that row's own inputs in an order that does not depend on how many rows share the call.

This is what the engine's exact mode runs (`specdec_fast.exact`): with it, a token's logits are
the same bits whether it is verified in a tree of N nodes among B sequences or decoded alone, so
speculative output equals plain output bit for bit.

- `row_tiled(fn, x)`: `fn` (a row-wise op: a linear layer, a norm, an MLP) on fixed tiles of
  `ROW_TILE` rows, each a fresh 64-byte-aligned buffer with zero rows as padding. A CPU GEMM
  picks its kernel (and so its reduction order) by the row count and the alignment of its
  operands; at one tile shape it runs one kernel for every call, and a row's result is the same
  at any position in the tile (tested).
- `linear_exact(x, weight, bias)`: `F.linear` on row tiles; on CUDA the Triton matmul of
  `jit/matmul.py` (one tile shape, no split-K) instead.
- `tree_attention_exact(...)`: `tree_attention`'s arguments and semantics. Each query row
  gathers the keys it sees, in slot order (the prefix, then its tree ancestors: the order a
  plain decode step sees the same tokens in), and walks them in blocks of `KEY_BLOCK` keys with
  an online softmax in fp32. Per (row, KV head) a block is two GEMMs of fixed shapes ([G, D] x
  [D, KEY_BLOCK], then [G, KEY_BLOCK] x [KEY_BLOCK, D]), batched: a batched GEMM computes each
  item as that GEMM alone, whatever the number of items (tested on this CPU); blocks are folded
  in order, and blocks past a row's last key change nothing (exactly: their weights are 0), so
  neither N, nor B, nor the other rows' lengths reach a row's result. The step's gather rows
  and key masks are planned once and shared by every layer (compared by value, as the fused
  backend's plan).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .fused.tree_attention import _plan_key, _same_key
from .matmul import matmul_fixed_tile
from .ops import define_op
from .reference.tree_attention import key_visibility

ROW_TILE = 16
KEY_BLOCK = 64
ALIGNMENT_BYTES = 64


def _aligned(rows: torch.Tensor) -> bool:
    return rows.is_contiguous() and rows.data_ptr() % ALIGNMENT_BYTES == 0


def row_tiled(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """`fn(x)` for a row-wise `fn` over the last dim of `x` `[..., K]`, run on tiles of exactly
    `ROW_TILE` rows (zero rows pad the last one). Returns `[..., K']`, what `fn` returns per row."""
    rows = x.reshape(-1, x.shape[-1])
    count = rows.shape[0]
    tiles = max(1, -(-count // ROW_TILE))
    # Tile t starts t * ROW_TILE * K elements into an aligned buffer, aligned too for even K.
    if count != tiles * ROW_TILE or not _aligned(rows) or rows.shape[1] % 2:
        rows = F.pad(rows, (0, 0, 0, tiles * ROW_TILE - count))
    if tiles == 1:
        out = fn(rows)
    else:
        out = torch.cat([fn(rows[t * ROW_TILE : (t + 1) * ROW_TILE]) for t in range(tiles)])
    return out[:count].reshape(*x.shape[:-1], out.shape[-1])


def _linear_exact_fake(x: torch.Tensor, weight: torch.Tensor, bias) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@define_op("linear_exact(Tensor x, Tensor weight, Tensor? bias) -> Tensor", _linear_exact_fake)
def linear_exact(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` (x `[..., K]`, weight `[N, K]`, bias `[N]` or None) with each
    output row independent of the other rows of `x`."""
    if x.is_cuda:
        rows = x.reshape(-1, x.shape[-1])
        out = matmul_fixed_tile(rows, weight, bias)
        return out.reshape(*x.shape[:-1], weight.shape[0])
    return row_tiled(lambda tile: F.linear(tile, weight, bias), x)


@dataclass(frozen=True)
class _Plan:
    """What one step's exact attention needs besides q, K and V, the same for every layer.

    rows: per key block, int64 `[B * N * Hkv * KEY_BLOCK]`, the rows of the cache viewed as
        `[B * Hkv * Lmax, D]` that hold each (row, KV head)'s keys of that block, in order.
    valid: per key block, bool `[B * N * Hkv, 1, KEY_BLOCK]`, which of them the row sees.
    """

    rows: tuple[torch.Tensor, ...]
    valid: tuple[torch.Tensor, ...]


def _make_plan(cache_lens, tree_mask, q_lens, num_new, num_kv_heads, capacity, window, q_depths):
    batch = cache_lens.shape[0]
    device = cache_lens.device
    if tree_mask is None and window is None:
        # Causal: row i sees slots [0, cache_lens[b] + i] (none if it is padding), in order.
        row = torch.arange(num_new, device=device)
        counts = cache_lens.long()[:, None] + row + 1
        if q_lens is not None:
            counts = torch.where(row < q_lens.long()[:, None], counts, 0)
        blocks = max(1, -(-int(counts.max()) // KEY_BLOCK))
        order = torch.arange(blocks * KEY_BLOCK, device=device).clamp(max=capacity - 1)
        order = order.expand(batch, num_new, -1)
    else:
        span = min(int(cache_lens.max()) + num_new, capacity)
        visible = key_visibility(cache_lens, tree_mask, q_lens, num_new, span, window, q_depths)
        counts = visible.sum(dim=-1)
        blocks = max(1, -(-int(counts.max()) // KEY_BLOCK))
        # Each row's visible slots first, in slot order (the order a decode step sees them).
        order = torch.sort((~visible).to(torch.int8), dim=-1, stable=True).indices
        order = F.pad(order, (0, max(0, blocks * KEY_BLOCK - span)))
    # Row (b, i)'s j-th key is valid below its count; invalid ones may hold anything (NaN).
    valid = torch.arange(blocks * KEY_BLOCK, device=device) < counts[..., None]
    valid = valid[:, :, None].expand(batch, num_new, num_kv_heads, -1)
    heads = (
        torch.arange(batch, device=device)[:, None, None, None] * num_kv_heads
        + torch.arange(num_kv_heads, device=device)[None, None, :, None]
    ) * capacity
    rows, masks = [], []
    for block in range(blocks):
        keys_in = slice(block * KEY_BLOCK, (block + 1) * KEY_BLOCK)
        rows.append((heads + order[:, :, None, keys_in]).flatten())
        masks.append(valid[..., keys_in].reshape(-1, 1, KEY_BLOCK))
    return _Plan(tuple(rows), tuple(masks))


# The last plan and what it was made from (compared by value): a step's layers share it.
_last_plan: tuple[tuple, _Plan] | None = None


def _plan(cache_lens, tree_mask, q_lens, num_new, num_kv_heads, capacity, window, q_depths):
    global _last_plan
    lens = cache_lens.tolist()
    scalars = (num_new, num_kv_heads, capacity, window, str(cache_lens.device))
    last = _last_plan
    if last is not None and _same_key(last[0], lens, tree_mask, q_lens, q_depths, scalars):
        return last[1]
    plan = _make_plan(
        cache_lens, tree_mask, q_lens, num_new, num_kv_heads, capacity, window, q_depths
    )
    _last_plan = (_plan_key(lens, tree_mask, q_lens, q_depths, scalars), plan)
    return plan


def tree_attention_exact(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_lens: torch.Tensor,
    tree_mask: torch.Tensor | None = None,
    q_lens: torch.Tensor | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    window: int | None = None,
    q_depths: torch.Tensor | None = None,
) -> torch.Tensor:
    """`tree_attention` (same arguments, validated, `tree_mask` packed or None) with each query
    row's result independent of N, B and the other rows (see the module doc).

    Returns `[B, Hq, N, D]` in the dtype of q; rows that see no key are zeros.
    """
    batch, num_q_heads, num_new, head_dim = q.shape
    num_kv_heads, capacity = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    scale = head_dim**-0.5 if scale is None else scale
    if q.numel() == 0:
        return torch.empty_like(q, memory_format=torch.contiguous_format)
    if window is not None and window >= capacity:
        window = None
    plan = _plan(cache_lens, tree_mask, q_lens, num_new, num_kv_heads, capacity, window, q_depths)
    items = batch * num_new * num_kv_heads
    queries = (
        q.reshape(batch, num_kv_heads, group, num_new, head_dim)
        .permute(0, 3, 1, 2, 4)
        .float()
        .contiguous()
        .view(items, group, head_dim)
    )
    keys_flat = k_cache.reshape(-1, head_dim)
    values_flat = v_cache.reshape(-1, head_dim)
    best = torch.full((items, group), float("-inf"), device=q.device)
    total = torch.zeros_like(best)
    acc = torch.zeros(items, group, head_dim, device=q.device)
    for rows, valid in zip(plan.rows, plan.valid, strict=True):
        keys = keys_flat.index_select(0, rows).view(items, KEY_BLOCK, head_dim).float()
        values = values_flat.index_select(0, rows).view(items, KEY_BLOCK, head_dim).float()
        values = values.masked_fill(~valid.transpose(1, 2), 0.0)
        # Every batched product is one GEMM of a fixed shape per (row, KV head): [G, D] x
        # [D, KEY_BLOCK], then [G, KEY_BLOCK] x [KEY_BLOCK, D]; a batched GEMM computes each
        # item alone, as the same GEMM whatever the number of items (tested).
        scores = torch.bmm(queries, keys.transpose(1, 2)) * scale  # [items, G, KEY_BLOCK]
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        scores = scores.masked_fill(~valid, float("-inf"))
        new_best = torch.maximum(best, scores.amax(dim=-1))
        # Rows with no key yet keep -inf; their weights are then taken against 0.
        reference = torch.where(torch.isinf(new_best), 0.0, new_best)
        weights = torch.exp(scores - reference[..., None])
        rescale = torch.exp(best - reference)
        total = total * rescale + weights.sum(dim=-1)
        acc = acc * rescale[..., None] + torch.bmm(weights, values)
        best = new_best
    out = torch.where(total[..., None] > 0, acc / total[..., None], 0.0)
    return out.view(batch, num_new, num_q_heads, head_dim).transpose(1, 2).to(q.dtype).contiguous()
