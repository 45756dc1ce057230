"""Drafter wrappers: a drafter that delegates to an inner one, and proposal trimming.

A wrapper may verify less than the inner drafter proposed: the first `n` nodes of a tree in node
order, root included (a topological order, so the prefix is itself a tree), down to the root
alone (n = 1), which is exactly one step of plain decoding. The inner drafter is then told about
the step as if its whole proposal had been verified: the accepted path only uses kept nodes, so
padding the result with "not accepted" describes a valid verification of the full tree, and
drafters with their own caches (draft models) stay in step.
"""

from __future__ import annotations

import torch

from specdec_fast.drafters.base import Drafter, DraftState, Proposal, StepOutcome, fallbacks


def trim_proposal(proposal: Proposal, num_nodes: int) -> Proposal:
    """The first `num_nodes` nodes of each tree, root included: tokens/parents [B, N] become
    [B, min(N, num_nodes)] (draft_probs [B, N, V] likewise)."""
    width = min(num_nodes, proposal.num_nodes)
    probs = proposal.draft_probs
    return Proposal(
        tokens=proposal.tokens[:, :width],
        parents=proposal.parents[:, :width],
        draft_probs=None if probs is None else probs[:, :width],
    )


def _pad_nodes(tensor: torch.Tensor, width: int, value: float) -> torch.Tensor:
    """Pad dim 1 of tensor [B, n, ...] to `width` with `value`."""
    missing = width - tensor.shape[1]
    if missing <= 0:
        return tensor
    pad = tensor.new_full((tensor.shape[0], missing, *tensor.shape[2:]), value)
    return torch.cat([tensor, pad], dim=1)


def widen_outcome(outcome: StepOutcome, full: Proposal) -> StepOutcome:
    """The outcome of a trimmed proposal, restated for the `full` proposal it was cut from.

    accepted_nodes int32 [B, n] -> [B, N] padded with -1; hidden {layer: [B, n, H]} -> [B, N, H]
    padded with zeros (no accepted node reads them)."""
    width = full.num_nodes
    return StepOutcome(
        proposal=full,
        accepted_nodes=_pad_nodes(outcome.accepted_nodes, width, -1),
        num_accepted=outcome.num_accepted,
        next_tokens=outcome.next_tokens,
        emitted=outcome.emitted,
        hidden={layer: _pad_nodes(h, width, 0.0) for layer, h in outcome.hidden.items()},
        accepted_paths=outcome.accepted_paths,
        drafted=outcome.drafted,
    )


class WrappedDrafter(Drafter):
    """Delegates every protocol member to `inner`; subclasses override what they change."""

    def __init__(self, inner: Drafter):
        self.inner = inner

    @property
    def max_nodes(self) -> int:
        return self.inner.max_nodes

    @property
    def max_depth(self) -> int:
        return self.inner.max_depth

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        return tuple(getattr(self.inner, "hidden_layers", ()))

    @property
    def fallbacks(self) -> int:
        return fallbacks(self.inner)

    @property
    def proposals_valid(self) -> bool:
        """The inner drafter's declaration: a trimmed valid tree is a valid tree."""
        return bool(getattr(self.inner, "proposals_valid", False))

    def attach(self, target, max_cache_len: int) -> None:
        self.inner.attach(target, max_cache_len)

    def begin(self, state: DraftState) -> None:
        self.inner.begin(state)

    def propose(self, state: DraftState) -> Proposal:
        return self.inner.propose(state)

    def update(self, state: DraftState, outcome: StepOutcome) -> None:
        self.inner.update(state, outcome)

    def keep(self, rows: list[int]) -> None:
        self.inner.keep(rows)

    def end(self) -> None:
        self.inner.end()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r})"
