"""What a `generate` call asks for, once validated (`specdec_fast.arguments`): sampling
parameters per row and the stop rule."""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass

import torch


@dataclass
class Sampling:
    """Per-row sampling parameters, on the host: temperature and top_p float32 `[B]`, top_k and
    seed int64 `[B]` (seeds as `row_seeds` hashed them)."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    seed: torch.Tensor


def row_seeds(seeds: list[int], shared: bool) -> torch.Tensor:
    """int64 `[B]`: each row's seed, a hash of the row's own seed value: the value given for it,
    or for a `shared` seed s, s + r for row r (so `seed=5` over two rows is `seed=[5, 6]`, and a
    row's draws follow its seed whatever batch it runs in). Any Python int hashes. The engine
    then offsets each row's seed by the position of the token it samples."""
    values = [seeds[0] + row for row in range(len(seeds))] if shared else seeds
    return torch.tensor([random.Random(value).getrandbits(62) for value in values])


class StopRule:
    """When a sequence stops: an EOS token, a stop token sequence, or `max_new_tokens`.

    eos: the EOS token ids. stop: stop token sequences (each non-empty). Stops are emitted (kept in
    the output); nothing after them is.
    """

    def __init__(self, eos: Iterable[int], stop: list[list[int]], max_new_tokens: int):
        self.eos = frozenset(eos)
        self.stop = stop
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
