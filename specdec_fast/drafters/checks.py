"""Checking a drafter's proposals before the target runs, and the error that names the drafter.

Every proposal of a `generate` step is checked in two parts, neither of which reads the device
(the step loop keeps its one read-back, tests/test_step_budget.py):

- its form (`check_form`), on host metadata only: tensors of int dtype on the target's device,
  `tokens` and `parents` `[B, N]` with `1 <= N <= max_nodes`, `draft_probs` None or float
  `[B, N, V]` with V the target's vocabulary;
- its values (`screen`), for drafters that do not declare `proposals_valid` (see `Drafter`):
  `verify`'s tree rules (`kernels.validation.tree_problems`: parents topological under one root,
  tokens in the vocabulary, draft probabilities only on chains and each row a distribution) give
  one flag per row, computed on the device. A flagged row is replaced by its root alone (a step
  of plain decoding), so the target never embeds an out-of-vocabulary token nor walks a broken
  tree, and the flags travel with the step's read-back (`Proposal.malformed`). The engine then
  raises `DrafterError` (`malformed_error` words it, reading values on that failure path only);
  `GuardedDrafter`, which screens its inner drafter's proposals itself, falls back to plain
  decoding instead, its output unchanged (the flagged rows took plain steps).

The built-in drafters build valid trees by construction and declare it, so their steps skip the
value screen (tests/test_drafter_checks.py runs them screened). Padded nodes' tokens, which the
target embeds too but whose logits nothing reads, are set to 0 by the screen. Column 0 (the
root's token) is never checked: the engine writes each row's root itself.
"""

from __future__ import annotations

import torch

from specdec_fast.drafters.base import PAD_PARENT, DraftState, Proposal
from specdec_fast.kernels.validation import raise_first_problem, tree_problems

INDEX_DTYPES = (torch.int32, torch.int64)
PROBS_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class DrafterError(RuntimeError):
    """A drafter proposed a tree the target cannot verify; the message names the drafter and
    what is wrong. `GuardedDrafter` treats it like any drafter failure (plain decoding)."""


def _form_problem(
    proposal: Proposal, batch: int, max_nodes: int, vocab: int, device: torch.device
) -> str | None:
    """What is wrong with the proposal's types and shapes, or None."""
    if not isinstance(proposal, Proposal):
        return f"propose() returned {type(proposal).__name__}, expected a Proposal"
    tokens, parents, probs = proposal.tokens, proposal.parents, proposal.draft_probs
    for name, tensor in (("tokens", tokens), ("parents", parents)):
        if not isinstance(tensor, torch.Tensor):
            return f"proposal.{name}: expected a tensor, got {type(tensor).__name__}"
        if tensor.dtype not in INDEX_DTYPES:
            return f"proposal.{name}: expected int32 or int64, got {tensor.dtype}"
        if tensor.device != device:
            return f"proposal.{name}: expected a tensor on {device}, got one on {tensor.device}"
    if tokens.dim() != 2 or tokens.shape[0] != batch or not 1 <= tokens.shape[1] <= max_nodes:
        return (
            f"proposal.tokens: expected shape [B = {batch}, N] with 1 <= N <= max_nodes = "
            f"{max_nodes}, got {tuple(tokens.shape)}"
        )
    if parents.shape != tokens.shape:
        return (
            f"proposal.parents: expected the shape of tokens {tuple(tokens.shape)}, got "
            f"{tuple(parents.shape)}"
        )
    if probs is not None:
        expected = (*tokens.shape, vocab)
        if not isinstance(probs, torch.Tensor) or probs.dtype not in PROBS_DTYPES:
            kind = probs.dtype if isinstance(probs, torch.Tensor) else type(probs).__name__
            return f"proposal.draft_probs: expected a float tensor {expected}, got {kind}"
        if tuple(probs.shape) != expected or probs.device != device:
            return (
                f"proposal.draft_probs: expected shape [B, N, V] = {expected} on {device}, got "
                f"{tuple(probs.shape)} on {probs.device}"
            )
    return None


def check_form(drafter, proposal: Proposal, state: DraftState, vocab: int) -> None:
    """Raise `DrafterError` naming `drafter` when `proposal` (for the rows of `state`) has the
    wrong types or shapes; reads nothing from the device."""
    problem = _form_problem(proposal, state.batch_size, drafter.max_nodes, vocab, state.device)
    if problem is not None:
        raise DrafterError(f"{drafter!r} proposed an invalid tree: {problem}")


def screen(proposal: Proposal, vocab: int) -> Proposal:
    """`proposal` (of a checked form) with every row that breaks a tree rule replaced by its
    root alone, padded nodes' tokens set to 0, and `malformed` (bool `[B]`) flagging the
    replaced rows: device work only, nothing is read."""
    problems = tree_problems(proposal.tokens, proposal.parents, vocab, proposal.draft_probs)
    malformed = torch.stack([bad for bad, _ in problems]).any(dim=0)
    parents = proposal.parents.long()
    node = torch.arange(parents.shape[1], device=parents.device)
    root_alone = torch.where(node == 0, -1, PAD_PARENT)
    parents = torch.where(malformed[:, None], root_alone, parents)
    used = parents != PAD_PARENT
    tokens = torch.where(used, proposal.tokens.long(), 0)
    probs = proposal.draft_probs
    if probs is not None:
        probs = torch.where(used[..., None], probs, 0)
    return Proposal(tokens, parents, probs, malformed)


def checked(drafter, proposal: Proposal, state: DraftState, vocab: int) -> Proposal:
    """`proposal` after `check_form`, passed through `screen` unless `drafter` declares its
    proposals valid: what the target may run."""
    check_form(drafter, proposal, state, vocab)
    return screen(proposal, vocab) if screens_values(drafter) else proposal


def malformed_error(drafter, proposal: Proposal, vocab: int) -> DrafterError:
    """The `DrafterError` for a proposal `screen` flagged (pass the proposal as the drafter
    made it): the first broken rule and row. Reads the values (the failure path)."""
    try:
        raise_first_problem(
            tree_problems(proposal.tokens, proposal.parents, vocab, proposal.draft_probs)
        )
    except ValueError as error:
        return DrafterError(f"{drafter!r} proposed an invalid tree: {error}")
    return DrafterError(f"{drafter!r} proposed an invalid tree")


def screens_values(drafter) -> bool:
    """Whether `drafter`'s proposals need the value screen (it does not declare them valid)."""
    return not getattr(drafter, "proposals_valid", False)
