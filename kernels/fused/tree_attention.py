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

import torch
import torch.nn.functional as F

from ..reference.tree_attention import unpack_tree_mask


def _visibility(
    cache_lens: torch.Tensor,
    lens: list[int],
    tree_mask: torch.Tensor | None,
    q_lens: torch.Tensor | None,
    num_new: int,
    span: int,
    window: int | None,
    q_depths: torch.Tensor | None,
) -> torch.Tensor | None:
    """Bool `[B, N, span]` (or `[1, N, span]` when every row agrees): new token i of sequence b
    sees slot j; None when every row sees every slot (a decode step at one shared length)."""
    shared_length = min(lens) == max(lens)
    if shared_length and q_lens is None and window is None and tree_mask is None and num_new == 1:
        return None
    device = cache_lens.device
    slot = torch.arange(span, device=device)
    row = torch.arange(num_new, device=device)[:, None]
    base = cache_lens[:1] if shared_length and q_lens is None else cache_lens
    # Index of slot j among the new tokens of its row (negative in the prefix).
    new_index = slot - base.long()[:, None, None]
    in_prefix = new_index < 0
    is_new = (new_index >= 0) & (new_index < num_new)
    if q_lens is not None:
        is_new &= new_index < q_lens.long()[:, None, None]
    if tree_mask is None:
        among_new = new_index <= row
    else:
        among_new = unpack_tree_mask(tree_mask, num_new).gather(
            2, new_index.clamp(0, num_new - 1).expand(tree_mask.shape[0], num_new, span)
        )
    visible = in_prefix | (is_new & among_new)
    if window is not None:
        depths = row.T.expand(base.shape[0], num_new) if q_depths is None else q_depths.long()
        key_index = new_index[:, 0].clamp(0, num_new - 1).expand(depths.shape[0], span)
        key_depth = depths.gather(1, key_index)[:, None, :]
        key_position = torch.where(in_prefix, slot, base.long()[:, None, None] + key_depth)
        row_position = base.long()[:, None, None] + depths[:, :, None]
        visible &= key_position > row_position - window
    if q_lens is not None:
        visible &= row < q_lens.long()[:, None, None]
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


def _mask_plan(span: int, visible: torch.Tensor | None) -> _Plan:
    if visible is None:
        return _Plan(span, None, None, None)
    unread = ~visible.any(dim=1)[:, None, :, None]
    empty = ~visible.any(dim=-1, keepdim=True)[:, None]
    return _Plan(
        span,
        (visible[:, None] | empty),
        unread if bool(unread.any()) else None,
        empty if bool(empty.any()) else None,
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
    if not ragged or q_lens is not None or len(lens) > PER_ROW_MAX_BATCH:
        visible = _visibility(cache_lens, lens, tree_mask, q_lens, num_new, span, window, q_depths)
        return _mask_plan(span, visible)
    rows = []
    for b, length in enumerate(lens):
        row_span = min(length + num_new, capacity)
        visible = _visibility(
            cache_lens[b : b + 1],
            [length],
            None if tree_mask is None else tree_mask[b : b + 1],
            None,
            num_new,
            row_span,
            window,
            None if q_depths is None else q_depths[b : b + 1],
        )
        rows.append(_mask_plan(row_span, visible))
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
