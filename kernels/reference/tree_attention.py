"""Plain-torch reference of `tree_attention`: a dense key-visibility mask and fp32 attention.

It materializes a `[B, N, Lmax]` visibility mask and an fp32 copy of the cache, then runs SDPA's
fp32 math with that mask (explicit fp32 math when soft-capping, which SDPA cannot do), so it is
meant for tests, the CPU backend and small models, not for speed on a GPU. It never reads the
lengths back to the host, so it also runs under CUDA graph capture.
"""

import torch


def unpack_tree_mask(tree_mask_words: torch.Tensor, num_nodes: int) -> torch.Tensor:
    """Bool `[B, N, N]` from the packed int32 `[B, N, ceil(N/32)]` form of `pack_tree_mask`."""
    node = torch.arange(num_nodes, device=tree_mask_words.device)
    words = tree_mask_words[:, :, node // 32]
    return ((words >> (node % 32).to(words.dtype)) & 1).bool()


def key_visibility(
    cache_lens: torch.Tensor,
    tree_mask: torch.Tensor | None,
    q_lens: torch.Tensor | None,
    num_new: int,
    cache_capacity: int,
    window: int | None = None,
    q_depths: torch.Tensor | None = None,
) -> torch.Tensor:
    """Bool `[B, N, Lmax]`: new token i of sequence b may attend to cache slot j.

    Every live row sees the committed prefix `[0, cache_lens[b])`; new token t (slot
    `cache_lens[b] + t`) is visible through the mask (causal when `tree_mask` is None) and only when
    `t < q_lens[b]`. Padding rows (`i >= q_lens[b]`) see nothing, which makes their output zero.
    With a `window`, a key is visible only when its position is above the row's minus the window
    (prefix slot k at position k, new token t at `cache_lens[b] + depth_t`, depth_t from
    `q_depths` int `[B, N]` in a tree, t when causal).
    """
    device = cache_lens.device
    batch = cache_lens.shape[0]
    lens = cache_lens.long()[:, None, None]
    slot = torch.arange(cache_capacity, device=device)[None, None, :]
    row = torch.arange(num_new, device=device)
    live_new = torch.full((batch,), num_new, device=device) if q_lens is None else q_lens.long()
    if tree_mask is None:
        among_new = (row[None, :] <= row[:, None]).expand(batch, num_new, num_new)
    elif tree_mask.dtype == torch.bool:
        among_new = tree_mask
    else:
        among_new = unpack_tree_mask(tree_mask, num_new)
    among_new = among_new & (row[None, None, :] < live_new[:, None, None])
    new_index = (slot - lens).clamp(0, num_new - 1).expand(batch, num_new, cache_capacity)
    sees_new = torch.gather(among_new, 2, new_index) & (slot >= lens) & (slot < lens + num_new)
    visible = (slot < lens) | sees_new
    if window is not None:
        depths = row.expand(batch, num_new) if q_depths is None else q_depths.long()
        slot_depth = torch.gather(depths, 1, new_index[:, 0])[:, None, :]
        key_position = torch.where(slot >= lens, lens + slot_depth, slot)
        row_position = lens + depths[:, :, None]
        visible = visible & (key_position > row_position - window)
    return visible & (row[None, :, None] < live_new[:, None, None])


def tree_attention_reference(
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
    """Attention of N new tokens over a KV cache that already holds their keys and values.

    Args:
        q: `[B, Hq, N, D]`, fp16/bf16/fp32.
        k_cache, v_cache: `[B, Hkv, Lmax, D]`, dtype of q; new token i lives in slot
            `cache_lens[b] + i`. Query head h reads KV head `h // (Hq // Hkv)`.
        cache_lens: int32 `[B]`, committed tokens before the new ones.
        tree_mask: None (causal among new tokens), bool `[B, N, N]` or packed int32
            `[B, N, ceil(N/32)]`; `[b, i, j]` means new token i sees new token j.
        q_lens: optional int32 `[B]`; rows `i >= q_lens[b]` are padding and give zeros.
        scale: softmax scale, `D ** -0.5` by default.
        softcap: None or c > 0: scaled scores s become `c * tanh(s / c)` before the mask.
        window: None or w >= 1: a query at position p sees keys at positions in (p - w, p].
        q_depths: int `[B, N]`, node depths of a tree (needed with a window and a tree_mask).

    Returns:
        `[B, Hq, N, D]` in the dtype of q. A row that sees no key at all gives zeros.
    """
    num_new, head_dim = q.shape[2], q.shape[3]
    scale = head_dim**-0.5 if scale is None else scale
    visible = key_visibility(
        cache_lens, tree_mask, q_lens, num_new, k_cache.shape[2], window, q_depths
    )[:, None]
    # Slots no row sees (beyond the live new tokens, below the window) are never read, even when
    # they hold NaN.
    slot_read = visible.any(dim=2)[..., None]
    keys = torch.where(slot_read, k_cache.float(), 0.0)
    values = torch.where(slot_read, v_cache.float(), 0.0)
    if softcap is None:
        # SDPA's math in fp32 with a boolean mask is exactly softmax(q k^T * scale) v over the
        # visible keys; GQA query heads h read KV head h // group.
        out = torch.nn.functional.scaled_dot_product_attention(
            q.float(), keys, values, attn_mask=visible, scale=scale, enable_gqa=True
        )
    else:
        group = q.shape[1] // k_cache.shape[1]
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        scores = q.float() @ keys.transpose(-1, -2) * scale
        scores = softcap * torch.tanh(scores / softcap)
        out = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1) @ values
    return torch.where(visible.any(dim=-1, keepdim=True), out, 0.0).to(q.dtype)
