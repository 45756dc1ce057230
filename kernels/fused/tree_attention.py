"""Fused-torch `tree_attention` for CPU tensors: fused SDPA over the live prefix only.

Unlike the reference, it never touches the cache beyond the longest live row (`max(cache_lens) +
N` slots, read from the lengths, which costs nothing on the CPU), makes no fp32 copy of K/V, and
builds no mask at all for a decode step whose rows share one length (plain decoding at batch 1).
GQA query heads are packed as rows of their KV head, as the Triton kernel packs them, so SDPA
reads each K/V once per KV head. Soft-capping, which SDPA cannot apply, runs explicit math in the
cache's dtype with an fp32 softmax, as HF's eager attention does.
"""

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
    batch, num_q_heads, num_new, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_q_heads // num_kv_heads
    scale = head_dim**-0.5 if scale is None else scale
    if q.numel() == 0:
        return torch.empty_like(q, memory_format=torch.contiguous_format)
    lens = cache_lens.tolist()
    span = min(max(lens) + num_new, k_cache.shape[2])
    keys, values = k_cache[:, :, :span], v_cache[:, :, :span]
    # Query head h = kv * group + g reads KV head kv: rows g * N + i of that KV head.
    rows = q.reshape(batch, num_kv_heads, group * num_new, head_dim)
    visible = _visibility(cache_lens, lens, tree_mask, q_lens, num_new, span, window, q_depths)
    empty = None
    if visible is not None:
        # Slots that no row sees (past a shorter row's tokens, below every window) may hold
        # anything, NaN included, and SDPA would still multiply them: zero them (a copy only for
        # ragged rows; a batch-1 tree sees every slot of its span).
        unread = ~visible.any(dim=1)[:, None, :, None]
        if bool(unread.any()):
            keys, values = keys.masked_fill(unread, 0.0), values.masked_fill(unread, 0.0)
        empty = ~visible.any(dim=-1, keepdim=True)  # [B, N, 1]
        if q_lens is not None:
            # Padding rows may hold anything too, and blocked matmuls do not always keep a NaN
            # row to itself (seen with bf16 at head dim 80): they become zeros before the math.
            rows = rows.masked_fill(empty.repeat(1, group, 1)[:, None], 0.0)
        # A row that sees nothing would make the softmax NaN: let it see everything, then zero it.
        visible = (visible | empty).repeat(1, group, 1)[:, None]
    if softcap is None:
        out = F.scaled_dot_product_attention(rows, keys, values, attn_mask=visible, scale=scale)
    else:
        scores = torch.matmul(rows, keys.transpose(-1, -2)).float() * scale
        scores = softcap * torch.tanh(scores / softcap)
        if visible is not None:
            scores = scores.masked_fill(~visible, float("-inf"))
        out = torch.matmul(torch.softmax(scores, dim=-1).to(values.dtype), values)
    out = out.view(batch, num_q_heads, num_new, head_dim)
    if empty is not None:
        out = out.masked_fill(empty[:, None], 0.0)
    return out
