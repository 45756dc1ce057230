"""Medusa: heads on the target's last hidden state fill a static tree of top-k candidates."""

from __future__ import annotations

import os

import torch

from specdec_fast.heads.medusa import MedusaHeads, load_medusa_heads
from specdec_fast.transfer import to_device
from specdec_fast.trees import TreeSpec, default_tree, parse_tree

from .base import Drafter, DraftState, Proposal, StepOutcome
from .features import last_accepted_hidden, last_cached_hidden

FINAL_NORM = -1


class MedusaDrafter(Drafter):
    """Speculation with Medusa heads (`specdec_fast.heads.medusa`).

    Each step, head d ranks the tokens d + 1 levels below the root from the target's final normed
    hidden state at the node that produced the root; the static tree's node at depth d with rank
    r receives head d - 1's r-th token. No draft forward beyond the heads themselves: the hidden
    state comes with verification.

    Args:
        heads: Medusa heads for the target.
        tree: a `StaticTree`, `medusa_choices` rank paths or a `speculative_token_tree` string;
            default: `default_tree(16)` capped at the number of heads.
    """

    # Valid trees by construction (tests/test_drafter_checks.py): values go unchecked.
    proposals_valid = True
    hidden_layers = (FINAL_NORM,)

    def __init__(self, heads: MedusaHeads, tree: TreeSpec | None = None):
        tree = default_tree(16, max_depth=heads.num_heads) if tree is None else parse_tree(tree)
        if tree.max_depth > heads.num_heads:
            raise ValueError(
                f"tree: depth {tree.max_depth} needs that many heads, these have {heads.num_heads}"
            )
        if tree.max_rank > heads.vocab_size:
            raise ValueError(
                f"tree: rank {tree.max_rank - 1} is beyond the vocabulary of {heads.vocab_size}"
            )
        super().__init__(tree.num_nodes, tree.max_depth)
        self.heads = heads
        self.tree = tree
        self._lm_head = None
        self._hidden: torch.Tensor | None = None  # [B, H], the root-producing node's state
        # The tree's depths, ranks and parents on the device, uploaded once per call.
        self._tree_index: tuple[torch.Tensor, ...] | None = None

    @classmethod
    def from_pretrained(
        cls, name_or_path: str | os.PathLike, target, tree: TreeSpec | None = None
    ) -> MedusaDrafter:
        """Load heads in the public Medusa layout (a folder or a bundled name) for `target`."""
        heads = load_medusa_heads(name_or_path, target.device, target.dtype)
        heads.check_target(target)
        return cls(heads, tree)

    def __repr__(self) -> str:
        return f"MedusaDrafter(heads={self.heads.num_heads}, tree={self.tree.num_nodes} nodes)"

    def attach(self, target, max_cache_len: int) -> None:
        self.heads.check_target(target)
        self.heads.to(device=target.device, dtype=target.dtype).eval()
        self._lm_head = target.get_output_embeddings()

    def begin(self, state: DraftState) -> None:
        self._hidden = last_cached_hidden(state, FINAL_NORM)

    @torch.no_grad()
    def propose(self, state: DraftState) -> Proposal:
        tree, device, batch = self.tree, state.device, state.batch_size
        logits = self.heads(self._hidden, self._lm_head)  # [B, heads, V]
        top = logits.topk(tree.max_rank, dim=-1).indices  # [B, heads, R]
        if self._tree_index is None:
            self._tree_index = tuple(
                to_device(values, device) for values in (tree.depths, tree.ranks, tree.node_parents)
            )
        depths, ranks, parents = self._tree_index
        tokens = torch.cat([state.roots[:, None], top[:, depths - 1, ranks]], dim=1)
        return Proposal(tokens, parents.expand(batch, -1).contiguous())

    def update(self, state: DraftState, outcome: StepOutcome) -> None:
        self._hidden = last_accepted_hidden(outcome, FINAL_NORM)

    def keep(self, rows: list[int]) -> None:
        self._hidden = self._hidden[to_device(rows, self._hidden.device)]

    def join(self, state: DraftState) -> None:
        self._hidden = torch.cat([self._hidden, last_cached_hidden(state, FINAL_NORM)])

    def end(self) -> None:
        self._hidden = None
        self._tree_index = None
