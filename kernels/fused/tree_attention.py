"""Fused-torch `tree_attention` for CPU tensors: fused SDPA over the live prefix only.

Unlike the reference, it never touches the cache beyond the longest live row (`max(cache_lens) +
N` slots, read from the lengths, which costs nothing on the CPU), makes no fp32 copy of K/V, and
builds no mask at all for a decode step whose rows share one length (plain decoding at batch 1).
A decode step packs GQA query heads as rows of their KV head, as the Triton kernel does, so SDPA
reads each K/V once per KV head; masked steps broadcast one `[N, span]` mask over the heads
(SDPA's GQA mode), and build it once per step for all layers (the plan of `_plan`).
Soft-capping, which SDPA cannot apply, runs explicit math in the cache's dtype with an fp32
softmax, as HF's eager attention does.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F


def _host(tensor: torch.Tensor | None) -> np.ndarray | None:
    """A small metadata tensor as an int64 numpy array on the host."""
    return None if tensor is None else tensor.detach().cpu().numpy().astype(np.int64, copy=False)


def _unpack_on_host(tree_mask: np.ndarray, num_new: int) -> np.ndarray:
    """`unpack_tree_mask` in numpy: bool `[B, N, N]` from packed int32 words `[B, N, W]`."""
    node = np.arange(num_new)
    return ((tree_mask[:, :, node // 32] >> (node % 32)) & 1).astype(bool)


def _one_length(
    length: int, tree_bits: np.ndarray | None, live: np.ndarray | None, num_new: int, span: int
) -> np.ndarray:
    """`_visibility` when every row has one length and no window (a batch-1 step, an aligned
    batch): the prefix, then the mask's columns, written as slices."""
    among = np.tri(num_new, dtype=bool)[None] if tree_bits is None else tree_bits
    visible = np.zeros((among.shape[0], num_new, span), dtype=bool)
    visible[:, :, :length] = True
    width = max(0, min(num_new, span - length))
    if live is not None:  # one row
        width = min(width, int(live[0]))
    visible[:, :, length : length + width] = among[:, :, :width]
    if live is not None:
        visible[:, int(live[0]) :] = False
    return visible


def _visibility(
    lens: list[int],
    tree_bits: np.ndarray | None,
    live: np.ndarray | None,
    num_new: int,
    span: int,
    window: int | None,
    depths: np.ndarray | None,
) -> np.ndarray | None:
    """Bool `[B, N, span]` (or `[1, N, span]` when every row agrees): new token i of sequence b
    sees slot j; None when every row sees every slot (a decode step at one shared length).

    In numpy on host copies of the metadata (`_host`): `lens` the rows' lengths, `tree_bits`
    the unpacked tree mask (None: causal), `live` the q_lens (None: all live), `depths` the
    q_depths. A dozen array ops over a few thousand booleans, which torch's per-op dispatch
    made ~5x dearer than the work (~150 us a plan, 15% of the bundled PARD model's step)."""
    shared_length = min(lens) == max(lens)
    if shared_length and live is None and window is None and tree_bits is None and num_new == 1:
        return None
    row_lens = lens[:1] if shared_length and live is None else lens
    if len(row_lens) == 1 and window is None:
        return _one_length(row_lens[0], tree_bits, live, num_new, span)
    slot = np.arange(span)
    row = np.arange(num_new)[:, None]
    base = np.asarray(row_lens, dtype=np.int64)
    # Index of slot j among the new tokens of its row (negative in the prefix): [B', 1, span].
    new_index = slot - base[:, None, None]
    in_prefix = new_index < 0
    is_new = (new_index >= 0) & (new_index < num_new)
    if live is not None:
        is_new &= new_index < live[:, None, None]
    clamped = np.clip(new_index, 0, num_new - 1)
    if tree_bits is None:
        among_new = new_index <= row
    else:
        among_new = np.take_along_axis(
            tree_bits, np.broadcast_to(clamped, (tree_bits.shape[0], num_new, span)), axis=2
        )
    visible = in_prefix | (is_new & among_new)
    if window is not None:
        if depths is None:
            depths = np.broadcast_to(row.T, (base.shape[0], num_new))
        key_index = np.broadcast_to(clamped[:, 0], (depths.shape[0], span))
        key_depth = np.take_along_axis(depths, key_index, axis=1)[:, None, :]
        key_position = np.where(in_prefix, slot, base[:, None, None] + key_depth)
        row_position = base[:, None, None] + depths[:, :, None]
        visible &= key_position > row_position - window
    if live is not None:
        visible &= row < live[:, None, None]
    return visible


# Ragged batches up to this size attend row by row, each row over exactly its own span: no mask
# for a decode step, and no slot a row does not see (so nothing to zero); beyond it one masked
# call over the longest span beats a loop of small ones.
PER_ROW_MAX_BATCH = 16


@dataclass(frozen=True)
class _Plan:
    """What one call's masking needs, the same for every layer of a step.

    span: the slots read, `max(cache_lens) + N` (capped at the capacity).
    visible: bool `[B', 1, N, span]` (B' is 1 when every row agrees), None for a decode step
        at one shared length; rows that see nothing are let see everything (zeroed after).
    unread: bool `[B', 1, span, 1]`, slots no row sees (they may hold NaN), or None.
    empty: bool `[B', 1, N, 1]`, rows that see no key (padding), or None.
    rows: for a ragged batch attended row by row, each row's own plan; else None.
    """

    span: int
    visible: torch.Tensor | None
    unread: torch.Tensor | None
    empty: torch.Tensor | None
    rows: tuple[_Plan, ...] | None = None


def _mask_plan(span: int, visible: np.ndarray | None, device: torch.device) -> _Plan:
    if visible is None:
        return _Plan(span, None, None, None)
    unread = ~visible.any(axis=1)[:, None, :, None]
    empty = ~visible.any(axis=-1, keepdims=True)[:, None]

    def tensor(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(device)

    return _Plan(
        span,
        tensor(visible[:, None] | empty),
        tensor(unread) if unread.any() else None,
        tensor(empty) if empty.any() else None,
    )


# The last plan and copies of what it was made from. A step's layers pass the same metadata
# (under torch.compile, as fresh views of one buffer), so all but the first reuse the plan; the
# inputs are compared by value, a few small tensors, which is always right.
_last_plan: tuple[tuple, _Plan] | None = None


def _plan_key(lens, tree_mask, q_lens, q_depths, scalars) -> tuple:
    tensors = tuple(
        None if t is None else t.detach().clone() for t in (tree_mask, q_lens, q_depths)
    )
    return (tuple(lens), tensors, scalars)


def _same_key(key: tuple, lens, tree_mask, q_lens, q_depths, scalars) -> bool:
    if key[0] != tuple(lens) or key[2] != scalars:
        return False
    for stored, given in zip(key[1], (tree_mask, q_lens, q_depths), strict=True):
        if (stored is None) != (given is None):
            return False
        if stored is not None and (
            stored.shape != given.shape
            or stored.dtype != given.dtype
            or not torch.equal(stored, given)
        ):
            return False
    return True


def _make_plan(cache_lens, lens, tree_mask, q_lens, num_new, capacity, window, q_depths):
    span = min(max(lens) + num_new, capacity)
    ragged = min(lens) != max(lens)
    device = cache_lens.device
    tree_bits = None if tree_mask is None else _unpack_on_host(_host(tree_mask), num_new)
    live, depths = _host(q_lens), _host(q_depths)
    if not ragged or q_lens is not None or len(lens) > PER_ROW_MAX_BATCH:
        visible = _visibility(lens, tree_bits, live, num_new, span, window, depths)
        return _mask_plan(span, visible, device)
    rows = []
    for b, length in enumerate(lens):
        row_span = min(length + num_new, capacity)
        visible = _visibility(
            [length],
            None if tree_bits is None else tree_bits[b : b + 1],
            None,
            num_new,
            row_span,
            window,
            None if depths is None else depths[b : b + 1],
        )
        rows.append(_mask_plan(row_span, visible, device))
    return _Plan(span, None, None, None, tuple(rows))


def _plan(cache_lens, lens, tree_mask, q_lens, num_new, capacity, window, q_depths) -> _Plan:
    global _last_plan
    scalars = (num_new, capacity, window, str(cache_lens.device))
    last = _last_plan
    if last is not None and _same_key(last[0], lens, tree_mask, q_lens, q_depths, scalars):
        return last[1]
    plan = _make_plan(cache_lens, lens, tree_mask, q_lens, num_new, capacity, window, q_depths)
    _last_plan = (_plan_key(lens, tree_mask, q_lens, q_depths, scalars), plan)
    return plan


def _attend(q, k_cache, v_cache, plan: _Plan, scale: float, softcap: float | None):
    """Attention of `q` `[B, Hq, N, D]` over the first `plan.span` slots under `plan`'s mask."""
    batch, num_q_heads, num_new, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_q_heads // num_kv_heads
    keys, values = k_cache[:, :, : plan.span], v_cache[:, :, : plan.span]
    if plan.visible is None and softcap is None:
        # Query head h = kv * group + g reads KV head kv: as rows g * N + i of that KV head,
        # SDPA reads each K/V once per KV head.
        rows = q.reshape(batch, num_kv_heads, group * num_new, head_dim)
        out = F.scaled_dot_product_attention(rows, keys, values, scale=scale)
        return out.view(batch, num_q_heads, num_new, head_dim)
    if plan.unread is not None:
        # Slots that no row sees (past a shorter row's tokens, below every window) may hold
        # anything, NaN included, and SDPA would still multiply them: zero them (a copy; a
        # batch-1 tree, or a ragged batch attended row by row, sees every slot of its span).
        keys, values = keys.masked_fill(plan.unread, 0.0), values.masked_fill(plan.unread, 0.0)
    if plan.empty is not None:
        # Padding rows may hold anything too, and blocked matmuls do not always keep a NaN row
        # to itself (seen with bf16 at head dim 80): they become zeros before the math.
        q = q.masked_fill(plan.empty, 0.0)
    if softcap is None:
        out = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=plan.visible, scale=scale, enable_gqa=group > 1
        )
    else:
        # Heads grouped by KV head: [B, Hkv, G, N, D] against [B, Hkv, 1, span, D].
        grouped = q.reshape(batch, num_kv_heads, group, num_new, head_dim)
        scores = torch.matmul(grouped, keys[:, :, None].transpose(-1, -2)).float() * scale
        scores = softcap * torch.tanh(scores / softcap)
        if plan.visible is not None:
            scores = scores.masked_fill(~plan.visible[:, :, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(values.dtype)
        out = torch.matmul(probs, values[:, :, None]).reshape(q.shape)
    if plan.empty is not None:
        out = out.masked_fill(plan.empty, 0.0)
    return out


def tree_attention_fused(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_lens: torch.Tensor,
    tree_mask: torch.Tensor | None = None,
    q_lens: torch.Tensor | None = None,
    scale: float | None = None,
    *,
    softcap: float | None = None,
    window: int | None = None,
    q_depths: torch.Tensor | None = None,
) -> torch.Tensor:
    """`tree_attention` (same arguments, same semantics) on validated arguments.

    `tree_mask` is None or packed int32 `[B, N, ceil(N/32)]`. Returns `[B, Hq, N, D]` in the dtype
    of q; rows that see no key (padding rows) are zeros.
    """
    num_new, head_dim = q.shape[2], q.shape[3]
    scale = head_dim**-0.5 if scale is None else scale
    if q.numel() == 0:
        return torch.empty_like(q, memory_format=torch.contiguous_format)
    lens = cache_lens.tolist()
    plan = _plan(cache_lens, lens, tree_mask, q_lens, num_new, k_cache.shape[2], window, q_depths)
    if plan.rows is None:
        return _attend(q, k_cache, v_cache, plan, scale, softcap)
    return torch.cat(
        [
            _attend(q[b : b + 1], k_cache[b : b + 1], v_cache[b : b + 1], row, scale, softcap)
            for b, row in enumerate(plan.rows)
        ]
    )
