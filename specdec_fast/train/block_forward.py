"""The training forwards of the block drafters: every block of a window in one pass, each
seeing exactly what it sees at inference (`train.block`'s module doc). The training loss and the
tree calibration (`train.calibrate`) draft through them."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specdec_fast.heads.block import DFlashHead


def dflash_block_outputs(head: DFlashHead, target, features: dict, rows, anchors) -> torch.Tensor:
    """Head outputs `[B, A, b, h]` of the blocks anchored at `anchors` (int64 `[B, A]`) in token
    rows `[B, L]`, each over the context entries before its anchor (see the module doc)."""
    batch, length = rows.shape
    size = head.block_size
    device = rows.device
    fused = head.fuse([features[layer] for layer in head.hidden_layers])
    context = head.context(fused, torch.arange(length, device=device).expand(batch, -1))
    count = anchors.shape[1]
    offsets = torch.arange(size, device=device)
    tokens = torch.full((batch, count, size), head.mask_token_id, device=device)
    tokens[..., 0] = rows.gather(1, anchors)
    positions = (anchors[..., None] + offsets).flatten(1)
    with torch.no_grad():
        embeds = target.get_input_embeddings()(tokens.flatten(1))
    query_anchor = anchors.repeat_interleave(size, dim=1)  # [B, A b]
    sees_context = torch.arange(length, device=device) < query_anchor[..., None]
    block_of = torch.arange(count, device=device).repeat_interleave(size)
    sees_block = (block_of[:, None] == block_of[None, :]).expand(batch, -1, -1)
    mask = torch.cat([sees_context, sees_block], dim=2)[:, None]

    def attend(layer: int, queries, keys, values):
        context_keys, context_values = context[layer]
        return F.scaled_dot_product_attention(
            queries,
            torch.cat([context_keys, keys], dim=2),
            torch.cat([context_values, values], dim=2),
            attn_mask=mask,
            enable_gqa=True,
        )

    return head(embeds.to(fused.dtype), positions, attend).unflatten(1, (count, size))


def pard_block_logits(draft: nn.Module, mask_token_id: int, block_size: int, rows, anchors):
    """(logits `[B, L, V]` at the window's tokens, logits `[B, A, b - 1, V]` at the masks of the
    blocks anchored at `anchors` (int64 `[B, A]`)) of a PARD model (see the module doc)."""
    batch, length = rows.shape
    count, masks = anchors.shape[1], block_size - 1
    device = rows.device
    offsets = torch.arange(1, block_size, device=device)
    tokens = torch.cat([rows, rows.new_full((batch, count * masks), mask_token_id)], dim=1)
    mask_positions = (anchors[..., None] + offsets).flatten(1)
    positions = torch.cat(
        [torch.arange(length, device=device).expand(batch, -1), mask_positions], 1
    )
    causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    real_rows = torch.cat(
        [
            causal.expand(batch, -1, -1),
            torch.zeros(batch, length, count * masks, dtype=torch.bool, device=device),
        ],
        dim=2,
    )
    anchor_of = anchors.repeat_interleave(masks, dim=1)  # [B, A (b - 1)]
    sees_real = torch.arange(length, device=device) <= anchor_of[..., None]
    block_of = torch.arange(count, device=device).repeat_interleave(masks)
    order = offsets.repeat(count)
    own_earlier = (block_of[:, None] == block_of[None, :]) & (order[None, :] <= order[:, None])
    mask_rows = torch.cat([sees_real, own_earlier.expand(batch, -1, -1)], dim=2)
    mask = torch.cat([real_rows, mask_rows], dim=1)[:, None]
    logits = draft(input_ids=tokens, position_ids=positions, attention_mask=mask).logits
    return logits[:, :length], logits[:, length:].unflatten(1, (count, masks))
