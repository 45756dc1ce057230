"""Picking target hidden states out of prefill and verify outputs (for Medusa and EAGLE)."""

from __future__ import annotations

import torch

from specdec_fast.transfer import to_device

from .base import DraftState


def gather_rows(hidden: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`hidden[b, index[b, j]]`: hidden `[B, N, H]`, index int `[B, W]` -> `[B, W, H]`."""
    return hidden.gather(1, index.long()[..., None].expand(-1, -1, hidden.shape[-1]))


def last_cached_hidden(state: DraftState, layer: int) -> torch.Tensor:
    """`[B, H]`: the hidden state of each row's last cached prompt token (the one whose next
    token is the first root), zeros for a row whose prompt is a single token."""
    hidden = state.hidden[layer]
    batch, width, size = hidden.shape
    cached = to_device([len(row) - 1 for row in state.tokens], hidden.device)
    if width == 0:
        return hidden.new_zeros(batch, size)
    last = gather_rows(hidden, (cached - 1).clamp(min=0)[:, None])[:, 0]
    return torch.where((cached > 0)[:, None], last, torch.zeros_like(last))
