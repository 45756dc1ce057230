"""Normalizing what a `generate` caller passes: prompts, sampling parameters and stop rules."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch


def prompts_from_input(
    input_ids: torch.Tensor | Sequence[Sequence[int]], attention_mask: torch.Tensor | None
) -> list[list[int]]:
    """The unpadded prompts as lists of token ids.

    input_ids: LongTensor [B, T] (padded on either side, real tokens marked by `attention_mask`) or
        a list of B token lists. attention_mask: [B, T], nonzero at real tokens, or None.
    """
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() != 2:
            raise ValueError(
                f"input_ids: expected a [B, T] tensor, got shape {tuple(input_ids.shape)}"
            )
        if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
            raise ValueError(f"input_ids: expected an integer tensor, got {input_ids.dtype}")
        if attention_mask is None:
            real = torch.ones_like(input_ids, dtype=torch.bool)
        else:
            if attention_mask.shape != input_ids.shape:
                raise ValueError(
                    f"attention_mask: expected shape {tuple(input_ids.shape)} (that of "
                    f"input_ids), got {tuple(attention_mask.shape)}"
                )
            real = attention_mask.to(input_ids.device) != 0
        ids, real = input_ids.cpu().tolist(), real.cpu().tolist()
        prompts = [
            [t for t, keep in zip(row, mask, strict=True) if keep]
            for row, mask in zip(ids, real, strict=True)
        ]
    else:
        if attention_mask is not None:
            raise ValueError("attention_mask: only meaningful with a padded input_ids tensor")
        prompts = [[int(t) for t in row] for row in input_ids]
    if not prompts:
        raise ValueError("input_ids: the batch is empty")
    for row, prompt in enumerate(prompts):
        if not prompt:
            raise ValueError(f"input_ids: prompt {row} has no tokens")
    return prompts


def check_token_ids(prompts: list[list[int]], vocab_size: int) -> None:
    for row, prompt in enumerate(prompts):
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(
                f"input_ids: prompt {row} has token ids outside [0, {vocab_size}): {bad[:5]}"
            )


def _per_row(name: str, value, batch: int, dtype: torch.dtype) -> torch.Tensor:
    tensor = torch.as_tensor(value, dtype=dtype).flatten().cpu()
    if tensor.numel() == 1:
        tensor = tensor.expand(batch).clone()
    if tensor.numel() != batch:
        raise ValueError(f"{name}: expected a scalar or {batch} values, got {tensor.numel()}")
    return tensor


@dataclass
class Sampling:
    """Per-row sampling parameters, on the host (int64/float [B])."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    seed: torch.Tensor

    @classmethod
    def build(cls, batch: int, temperature, top_k, top_p, seed) -> Sampling:
        temperature = _per_row("temperature", temperature, batch, torch.float32)
        top_k = _per_row("top_k", top_k, batch, torch.int64)
        top_p = _per_row("top_p", top_p, batch, torch.float32)
        if not torch.isfinite(temperature).all() or (temperature < 0).any():
            raise ValueError(
                f"temperature: expected finite values >= 0, got {temperature.tolist()}"
            )
        if (top_k < 0).any():
            raise ValueError(f"top_k: expected values >= 0 (0 = off), got {top_k.tolist()}")
        if ((top_p <= 0) | (top_p > 1) | ~torch.isfinite(top_p)).any():
            raise ValueError(f"top_p: expected values in (0, 1] (1 = off), got {top_p.tolist()}")
        if seed is None:
            # Follows torch.manual_seed, like sampling in HF generate.
            seed = int(torch.randint(0, 2**62, (1,)).item())
        return cls(temperature, top_k, top_p, row_seeds(seed, batch))


def row_seeds(seed, batch: int) -> torch.Tensor:
    """int64 `[B]`: each row's seed, a hash of the row's own seed value: the value given for it,
    or for a shared seed s, s + r for row r (so `seed=5` over two rows is `seed=[5, 6]`, and a
    row's draws follow its seed whatever batch it runs in). The engine then offsets each row's
    seed by the position of the token it samples."""
    values = _per_row("seed", seed, batch, torch.int64).tolist()
    if torch.as_tensor(seed).numel() == 1:
        values = [values[0] + row for row in range(batch)]
    return torch.tensor([random.Random(value).getrandbits(62) for value in values])


class StopRule:
    """When a sequence stops: an EOS token, a stop token sequence, or `max_new_tokens`.

    eos_token_id: int, list of ints, or None. stop: token sequences (a flat list of ints counts as
    one sequence). Stops are emitted (kept in the output); nothing after them is.
    """

    def __init__(self, eos_token_id, stop, max_new_tokens: int):
        if isinstance(eos_token_id, int):
            eos_token_id = [eos_token_id]
        self.eos = frozenset(int(t) for t in (eos_token_id or ()))
        if stop and all(isinstance(t, int) for t in stop):
            stop = [stop]
        self.stop = [list(seq) for seq in (stop or ())]
        if any(not seq for seq in self.stop):
            raise ValueError("stop: empty stop sequence")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        self.max_new_tokens = max_new_tokens

    def take(self, generated: list[int], candidates: list[int]) -> tuple[list[int], str | None]:
        """Append `candidates` to `generated` one by one until a stop; return the tokens taken and
        the finish reason ("eos", "stop", "length" or None if the sequence goes on)."""
        taken = []
        for token in candidates:
            generated.append(token)
            taken.append(token)
            if token in self.eos:
                return taken, "eos"
            if any(
                generated[-len(seq) :] == seq for seq in self.stop if len(generated) >= len(seq)
            ):
                return taken, "stop"
            if len(generated) >= self.max_new_tokens:
                return taken, "length"
        return taken, None
