"""Medusa-1 heads: extra decoding heads on the target's last hidden state.

Head d (0-based) reads the target's final normed hidden state at the node whose next token is the
root, and predicts the token d + 1 levels below the root. Each head is `num_layers` residual
blocks `x + SiLU(Linear(x))` followed by a vocabulary projection of its own (Medusa-1), or, in the
smaller variant, by the target's own LM head (`shared_lm_head=True`: no projection is stored).

Checkpoint layout (FasterDecoding/Medusa): `config.json` with `medusa_num_heads` and
`medusa_num_layers`, and `medusa_lm_head.safetensors` (or `medusa_lm_head.pt`, read with
`weights_only=True`) whose keys are `{head}.{layer}.linear.weight|bias` and, with a projection of
its own, `{head}.{num_layers}.weight` `[vocab, hidden]`. We add `hidden_size`, `vocab_size` and
`medusa_shared_lm_head` to the config; public checkpoints without them are read from the weights.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from .checkpoint import (
    check_fits,
    load_strict,
    read_config,
    read_weights,
    resolve_folder,
    write_checkpoint,
)

WEIGHTS_NAMES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt", "model.safetensors")


class ResBlock(nn.Module):
    """`x + SiLU(Linear(x))`; the linear layer starts at zero, so a new block is the identity."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.linear(x))


class MedusaHeads(nn.Module):
    """`num_heads` Medusa heads; `heads` holds them in the public key layout.

    Args:
        hidden_size, vocab_size: the target's.
        num_heads: heads, i.e. the deepest tree level they can fill.
        num_layers: residual blocks per head.
        shared_lm_head: finish each head with the target's LM head instead of its own projection.
    """

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        num_heads: int = 4,
        num_layers: int = 1,
        shared_lm_head: bool = False,
    ):
        super().__init__()
        if num_heads < 1 or num_layers < 0:
            raise ValueError(
                f"num_heads must be >= 1 and num_layers >= 0, got {num_heads} and {num_layers}"
            )
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.num_heads, self.num_layers = num_heads, num_layers
        self.shared_lm_head = shared_lm_head
        self.heads = nn.ModuleList(
            nn.Sequential(
                *[ResBlock(hidden_size) for _ in range(num_layers)],
                *([] if shared_lm_head else [nn.Linear(hidden_size, vocab_size, bias=False)]),
            )
            for _ in range(num_heads)
        )

    def forward(self, hidden: torch.Tensor, lm_head: nn.Module | None = None) -> torch.Tensor:
        """Logits `[..., num_heads, vocab]` from hidden states `[..., hidden]` (model dtype).

        lm_head: the target's LM head; needed when `shared_lm_head`.
        """
        if self.shared_lm_head and lm_head is None:
            raise ValueError("lm_head: these Medusa heads reuse the target's LM head; pass it")
        outputs = [head(hidden) for head in self.heads]
        if self.shared_lm_head:
            outputs = [lm_head(output) for output in outputs]
        return torch.stack(outputs, dim=-2)

    def config_dict(self) -> dict:
        return {
            "medusa_num_heads": self.num_heads,
            "medusa_num_layers": self.num_layers,
            "medusa_shared_lm_head": self.shared_lm_head,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
        }

    def save_pretrained(self, folder: str | os.PathLike) -> None:
        """Write the public layout: `config.json` and `medusa_lm_head.safetensors`."""
        write_checkpoint(folder, self.config_dict(), self.heads.state_dict(), WEIGHTS_NAMES[0])

    def check_target(self, target) -> None:
        """Raise ValueError when these heads cannot serve `target` (hidden size, vocabulary)."""
        config = target.config.get_text_config(decoder=True)
        check_fits("Medusa heads", "hidden_size", self.hidden_size, config.hidden_size)
        check_fits("Medusa heads", "vocab_size", self.vocab_size, config.vocab_size)


def load_medusa_heads(
    name_or_path: str | os.PathLike,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> MedusaHeads:
    """Medusa heads from a folder in the public layout (or a bundled name)."""
    folder = resolve_folder(name_or_path)
    config = read_config(folder)
    what = f"Medusa heads at {folder}"
    for field in ("medusa_num_heads", "medusa_num_layers"):
        if field not in config:
            raise ValueError(f"{what}: config.json has no {field}")
        value = config[field]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(
                f"{what}: config.json's {field}: expected an integer >= 1, got {value!r}"
            )
    num_heads, num_layers = config["medusa_num_heads"], config["medusa_num_layers"]
    # Checkpoints saved from a whole Medusa model prefix the heads' keys with `medusa_head.`.
    state = {
        key.removeprefix("medusa_head."): value
        for key, value in read_weights(folder, WEIGHTS_NAMES).items()
    }
    first_block = state.get("0.0.linear.weight")
    projection = state.get(f"0.{num_layers}.weight")
    hidden_size = config.get("hidden_size")
    if hidden_size is None:
        source = first_block if first_block is not None else projection
        if source is None:
            raise ValueError(f"{what}: cannot tell the hidden size (no 0.0.linear.weight)")
        hidden_size = source.shape[-1]
    shared = config.get("medusa_shared_lm_head", projection is None)
    vocab_size = config.get("vocab_size")
    if vocab_size is None:
        if projection is None:
            raise ValueError(f"{what}: config.json has no vocab_size and the heads no projection")
        vocab_size = projection.shape[0]
    heads = MedusaHeads(int(hidden_size), int(vocab_size), num_heads, num_layers, bool(shared))
    load_strict(heads.heads, state, what)
    return heads.to(device=device, dtype=dtype).eval()
