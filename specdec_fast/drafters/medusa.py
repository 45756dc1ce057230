"""Medusa: heads on the target's last hidden state fill a static tree of top-k candidates."""

from __future__ import annotations

import os

import torch

from specdec_fast import graphs
from specdec_fast.compiled import CompiledSteps, module_steps
from specdec_fast.heads.medusa import MedusaHeads, load_medusa_heads
from specdec_fast.onednn import follow_target
from specdec_fast.transfer import to_device
from specdec_fast.trees import TreeSpec, default_tree, parse_tree

from .base import Drafter, DraftState, Proposal, StepOutcome, kept_rows
from .features import gather_rows, last_cached_hidden

FINAL_NORM = -1


class MedusaDrafter(Drafter):
    """Speculation with Medusa heads (`specdec_fast.heads.medusa`).

    Each step, head d ranks the tokens d + 1 levels below the root from the target's final normed
    hidden state at the node that produced the root; the static tree's node at depth d with rank
    r receives head d - 1's r-th token. No draft forward beyond the heads themselves: the hidden
    state comes with verification. The pick of that state (the last accepted node, chosen on
    the device from the step's outcome), the heads, their top-k and the tree's gather run as one
    compiled step when the call compiles, kept on the heads (`module_steps`).

    Args:
        heads: Medusa heads for the target.
        tree: a `StaticTree`, `medusa_choices` rank paths or a `speculative_token_tree` string;
            default: `default_tree(16)` capped at the number of heads.
    """

    # Valid trees by construction (tests/test_drafter_checks.py): values go unchecked.
    proposals_valid = True
    # Follows a step from its device outcome alone.
    reads_ahead = True
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
        # Whence the root-producing node's hidden state: the states `[B, M, H]`, the accepted
        # nodes int `[B, M]` and their counts int `[B]` (the node at `nodes[b, counts[b]]`).
        self._source: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._steps: CompiledSteps | None = None
        self._resident: graphs.Resident | None = None

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
        follow_target(self.heads, target)
        self._lm_head = target.get_output_embeddings()
        self._steps = module_steps(self.heads, "medusa")
        # The step's graphs and the tree's index tensors (its `state`), kept on the heads per
        # tree.
        key = (self.tree, self._lm_head.weight.data_ptr(), id(self._steps))
        self._resident = graphs.resident(
            self.heads, key, "medusa", graphs.chosen(), self._steps.record, self._resident
        )
        if self._resident.state is None:
            self._resident.state = tuple(
                to_device(values, target.device)
                for values in (self.tree.depths, self.tree.ranks, self.tree.node_parents)
            )

    def begin(self, state: DraftState) -> None:
        self._source = _cached_source(state)

    @torch.no_grad()
    def propose(self, state: DraftState) -> Proposal:
        label = f"heads B={state.batch_size}"
        args = (self, state.roots, *self._source)
        steps = self._resident.graphs
        return Proposal(
            *steps.run("heads", label, self._steps.run, "heads", label, _medusa_step, *args)
        )

    def follow_paths_to(self, depth: int) -> None:
        """Any depth: `update` keeps the last accepted node's state, wherever the path ran."""

    def update(self, state: DraftState, outcome: StepOutcome) -> None:
        self._source = (outcome.hidden[FINAL_NORM], outcome.accepted_nodes, outcome.num_accepted)

    def keep(self, rows: list[int]) -> None:
        self._source = kept_rows(self._source, rows)

    def join(self, state: DraftState) -> None:
        hidden = torch.cat([_picked(*self._source), _cached_source(state)[0][:, 0]])
        self._source = _single_source(hidden)

    def end(self) -> None:
        self._source = None
        if self._resident is not None:
            self._resident.release()
            self._resident = None


def _picked(hidden: torch.Tensor, nodes: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """`[B, H]`: `hidden[b, nodes[b, counts[b]]]`, the state of each row's last accepted node."""
    last = nodes.long().gather(1, counts.long()[:, None])
    return gather_rows(hidden, last)[:, 0]


def _single_source(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The source (`MedusaDrafter._source`) that picks the states `[B, H]` themselves, as two
    columns of them: a source one column wide would compile the heads' step apart from a tree's
    N columns (the compiler specialises size 1)."""
    nodes = torch.zeros(hidden.shape[0], 2, dtype=torch.int32, device=hidden.device)
    return hidden[:, None].expand(-1, 2, -1), nodes, nodes.new_zeros(hidden.shape[0])


def _cached_source(state: DraftState) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The source of a new batch: each row's last cached prompt token's state."""
    return _single_source(last_cached_hidden(state, FINAL_NORM))


def _medusa_step(
    drafter: MedusaDrafter,
    roots: torch.Tensor,
    hidden: torch.Tensor,
    nodes: torch.Tensor,
    counts: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The static tree filled from the heads: int64 `(tokens, parents)` `[B, N]`, from the
    roots `[B]` and the root-producing states' source (`_picked`)."""
    logits = drafter.heads(_picked(hidden, nodes, counts), drafter._lm_head)  # [B, heads, V]
    top = logits.topk(drafter.tree.max_rank, dim=-1).indices  # [B, heads, R]
    depths, ranks, parents = drafter._resident.state  # the tree's index, on the device
    tokens = torch.cat([roots.long()[:, None], top[:, depths - 1, ranks]], dim=1)
    return tokens, parents.expand(roots.shape[0], -1).contiguous()
