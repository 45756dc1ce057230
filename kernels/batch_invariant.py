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
  an online softmax in fp32. Products are summed over D and over a block's keys by reductions of
  fixed size, and blocks are folded in order; blocks past a row's last key change nothing
  (exactly: their weights are 0), so neither N, nor B, nor the other rows' lengths reach a row's
  result.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

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
        padded = rows.new_zeros(tiles * ROW_TILE, rows.shape[1])
        padded[:count] = rows
        rows = padded
    if tiles == 1:
        out = fn(rows)
    else:
        out = torch.cat([fn(rows[t * ROW_TILE : (t + 1) * ROW_TILE]) for t in range(tiles)])
    return out[:count].reshape(*x.shape[:-1], out.shape[-1])


def linear_exact(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` (x `[..., K]`, weight `[N, K]`, bias `[N]` or None) with each
    output row independent of the other rows of `x`."""
    if x.is_cuda:
        from .matmul import matmul_fixed_tile

        rows = x.reshape(-1, x.shape[-1])
        out = matmul_fixed_tile(rows, weight, bias)
        return out.reshape(*x.shape[:-1], weight.shape[0])
    return row_tiled(lambda tile: F.linear(tile, weight, bias), x)


def _key_blocks(cache: torch.Tensor, first_slots: torch.Tensor | None, block: int, span: int):
    """Block `block` of each row's keys (or values), fp32.

    `first_slots` None: every row's keys are the slots from 0 (causal steps without a window),
    so a block is one slice shared by a sequence's rows: `[B, 1, Hkv, KEY_BLOCK, D]`. Else the
    int64 `[blocks, B, N, KEY_BLOCK]` slot of each row's dense keys: `[B, N, Hkv, KEY_BLOCK, D]`.
    """
    batch, num_kv_heads, capacity, head_dim = cache.shape
    if first_slots is None:
        start = block * KEY_BLOCK
        keys = cache[:, None, :, start : min(start + KEY_BLOCK, span)]
        keys = keys.to(torch.float32, memory_format=torch.contiguous_format)
        return F.pad(keys, (0, 0, 0, KEY_BLOCK - keys.shape[3]))
    slots = first_slots[block]  # [B, N, KEY_BLOCK]
    rows = (
        torch.arange(batch, device=cache.device)[:, None, None, None] * num_kv_heads
        + torch.arange(num_kv_heads, device=cache.device)[None, None, :, None]
    ) * capacity + slots[:, :, None, :]
    flat = cache.reshape(batch * num_kv_heads * capacity, head_dim)
    gathered = flat.index_select(0, rows.flatten()).view(*rows.shape, head_dim)
    return gathered.float()


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
    device = q.device
    if window is not None and window >= capacity:
        window = None
    span = min(int(cache_lens.max()) + num_new, capacity)
    gathered = tree_mask is not None or window is not None
    if gathered:
        visible = key_visibility(cache_lens, tree_mask, q_lens, num_new, span, window, q_depths)
        counts = visible.sum(dim=-1)  # [B, N]
    else:
        # Causal: row i sees slots [0, cache_lens[b] + i], unless it is padding.
        row = torch.arange(num_new, device=device)
        counts = cache_lens.long()[:, None] + row + 1
        if q_lens is not None:
            counts = torch.where(row < q_lens.long()[:, None], counts, 0)
    blocks = max(1, -(-int(counts.max()) // KEY_BLOCK))
    width = blocks * KEY_BLOCK
    key_index = torch.arange(width, device=device)
    # Row (b, i)'s dense key j is valid below its count; its slot, j itself when every row's
    # keys start at slot 0 in order (causal, no window), else its j-th visible slot.
    valid = key_index < counts[..., None]  # [B, N, width]
    first_slots = None
    if gathered:
        order = torch.sort((~visible).to(torch.int8), dim=-1, stable=True).indices
        order = F.pad(order, (0, max(0, width - span)))[..., :width]
        first_slots = order.reshape(batch, num_new, blocks, KEY_BLOCK).permute(2, 0, 1, 3)
    # Slots past a sequence's new tokens may hold anything (NaN): values there become 0.
    written = (cache_lens.long() + num_new)[:, None, None, None, None]
    queries = (
        q.reshape(batch, num_kv_heads, group, num_new, head_dim)
        .permute(0, 3, 1, 2, 4)[:, :, :, :, None, :]
        .to(torch.float32, memory_format=torch.contiguous_format)
    )  # [B, N, Hkv, G, 1, D]
    best = torch.full((batch, num_new, num_kv_heads, group), float("-inf"), device=device)
    total = torch.zeros_like(best)
    acc = torch.zeros(batch, num_new, num_kv_heads, group, head_dim, device=device)
    for block in range(blocks):
        block_valid = valid[:, :, None, None, block * KEY_BLOCK : (block + 1) * KEY_BLOCK]
        keys = _key_blocks(k_cache, first_slots, block, span)[:, :, :, None]
        scores = (queries * keys).sum(dim=-1) * scale  # [B, N, Hkv, G, KEY_BLOCK]
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        scores = scores.masked_fill(~block_valid, float("-inf"))
        new_best = torch.maximum(best, scores.amax(dim=-1))
        # Rows with no key yet keep -inf; their weights are then taken against 0.
        reference = torch.where(torch.isinf(new_best), 0.0, new_best)
        weights = torch.exp(scores - reference[..., None])
        rescale = torch.exp(best - reference)
        total = total * rescale + weights.sum(dim=-1)
        values = _key_blocks(v_cache, first_slots, block, span)
        if first_slots is None:
            slots = block * KEY_BLOCK + torch.arange(KEY_BLOCK, device=device)[:, None]
            values = values.masked_fill(slots >= written, 0.0)
        else:
            values = values.masked_fill(~block_valid[:, :, :, 0, :, None], 0.0)
        # [B, N', Hkv, 1, D, KEY_BLOCK]: the block's keys innermost, summed in a fixed order.
        values = values.transpose(-1, -2).contiguous()[:, :, :, None]
        mixed = (weights[..., None, :] * values).sum(dim=-1)
        acc = acc * rescale[..., None] + mixed
        best = new_best
    out = torch.where(counts[:, :, None, None, None] > 0, acc / total[..., None], 0.0)
    return (
        out.reshape(batch, num_new, num_q_heads, head_dim)
        .transpose(1, 2)
        .to(q.dtype, memory_format=torch.contiguous_format)
    )
