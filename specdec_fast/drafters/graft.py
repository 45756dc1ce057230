"""A lookup branch grafted onto a model drafter's tree: one verification tries both.

A trained head (EAGLE, Medusa) predicts the next few tokens of any text; prompt lookup (n-gram,
suffix) predicts long runs exactly where the answer copies its context: a quoted passage, a
repeated identifier, a JSON key, a loop. Their hits overlap little, so verifying both trees in one
step accepts the longer of the two paths.

`GraftedDrafter(drafter, lookup)` proposes `drafter`'s tree with `lookup`'s tree merged in under
the same root (`graft`): a lookup node whose token is already a child of the node its parent
maps to is that child (its own column stays padding), and every other lookup node becomes a new
node after the tree's. A lookup run that starts along the head's best path thus continues it
instead of competing with it as a duplicate sibling. The merge is a few device ops per lookup
node, with no read (one compiled step in compiled mode); the lookup's tree is built as the
lookup drafter alone builds it. The composite reads ahead when both parts do (an n-gram lookup on
the device, `NGramDrafter(device_lookup=...)`, under EAGLE or Medusa) and neither needs the read
(`Drafter.read`); a lookup on the host's tokens (the suffix lookup, an n-gram lookup on the host)
has it read every step.

Eagerly, the width is the tree's plus the longest lookup tree of the step, known on the host: a
step without a lookup match verifies the head's tree alone. Compiled, every step has the full
width `max_nodes` (a fixed envelope; CUDA graphs pad every step to the widest anyway,
`ModelRunner.verify_width`), and the merge is one compiled step per batch size.
"""

from __future__ import annotations

import torch

from specdec_fast.compiled import CompiledSteps, compile_by_default

from . import base
from .base import PAD_PARENT, Drafter, DraftState, Proposal, StepOutcome, with_roots

# The merge's compiled steps by compile choice, shared by every grafted drafter of the process
# (each `generate` call of a registry spec makes a new one): a shape compiles once.
_MERGE_STEPS: dict[bool, CompiledSteps] = {}


def graft(tree: Proposal, branch: Proposal, steps: CompiledSteps | None = None) -> Proposal:
    """`tree` `[B, N]` with `branch` `[B, M]` merged in under the same roots: `[B, N + M - 1]`.

    Branch node i (in its topological order) maps to the merged node of its parent's children
    with its token when `tree` has one there (column N + i - 1 is then padding); else it is
    column N + i - 1, its parent the merged node of its parent. Trees only: neither may carry
    draft probabilities. `steps` runs the merge as a compiled step when they compile.
    """
    if tree.draft_probs is not None or branch.draft_probs is not None:
        raise ValueError("graft merges deterministic trees: drafts with draft_probs cannot merge")
    if branch.num_nodes == 1:
        return tree
    args = (tree.tokens, tree.parents, branch.tokens, branch.parents)
    if steps is None:
        return Proposal(*_merged(*args))
    label = f"merge B={tree.tokens.shape[0]}"
    return Proposal(*steps.run("merge", label, _merged, *args))


def _merged(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    branch_tokens: torch.Tensor,
    branch_parents: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`graft`'s merge, device ops only: (tokens, parents) of the merged trees."""
    nodes, extra = tokens.shape[1], branch_tokens.shape[1]
    tokens, parents = tokens.long(), parents.long()
    branch_tokens, branch_parents = branch_tokens.long(), branch_parents.long()
    mapped = torch.zeros_like(branch_parents)  # merged index of each branch node (root: 0)
    grafted = []
    for node in range(1, extra):
        parent = branch_parents[:, node]
        under = mapped.gather(1, parent.clamp(min=0)[:, None])  # [B, 1]
        # Padding's parents (-2) and the root's (-1) never equal `under` (>= 0).
        same = (parents == under) & (tokens == branch_tokens[:, node, None])
        found = same.any(dim=1)
        own = torch.full_like(parent, nodes + node - 1)
        mapped[:, node] = torch.where(found, same.int().argmax(dim=1), own)
        grafted.append(torch.where((parent >= 0) & ~found, under[:, 0], PAD_PARENT))
    merged_tokens = torch.cat([tokens, branch_tokens[:, 1:]], dim=1)
    return merged_tokens, torch.cat([parents, torch.stack(grafted, dim=1)], dim=1)


class GraftedDrafter(Drafter):
    """`drafter`'s trees with `lookup`'s grafted on (see the module doc).

    drafter: a tree drafter without draft probabilities, which must follow accepted paths as
        deep as `lookup`'s trees reach (`Drafter.follow_paths_to`): EAGLE and Medusa follow any
        depth; a draft model's tree or a block drafter only its own `max_depth`, so a lookup
        grafted onto one must not reach deeper (a ValueError says so).
    lookup: a lookup drafter (`NGramDrafter`, `SuffixDrafter`).

    max_nodes is the sum of both budgets less the shared root; max_depth the deeper of the two.
    """

    def __init__(self, drafter: Drafter, lookup: Drafter):
        from .ngram import NGramDrafter
        from .suffix import SuffixDrafter

        for name, part in (("drafter", drafter), ("lookup", lookup)):
            if not isinstance(part, Drafter):
                raise TypeError(f"{name}: expected a Drafter, got {type(part).__name__}")
        if not isinstance(lookup, (NGramDrafter, SuffixDrafter)):
            raise TypeError(
                f"lookup: expected a lookup drafter (NGramDrafter, SuffixDrafter), got "
                f"{type(lookup).__name__}"
            )
        drafter.follow_paths_to(lookup.max_depth)
        lookup.follow_paths_to(drafter.max_depth)
        super().__init__(
            drafter.max_nodes + lookup.max_nodes - 1, max(drafter.max_depth, lookup.max_depth)
        )
        self.drafter, self.lookup = drafter, lookup
        self.hidden_layers = tuple(drafter.hidden_layers)
        self.proposals_valid = drafter.proposals_valid and lookup.proposals_valid
        self._steps: CompiledSteps | None = None

    def __repr__(self) -> str:
        return f"GraftedDrafter({self.drafter!r}, {self.lookup!r})"

    @property
    def parts(self) -> tuple[Drafter, Drafter]:
        return self.drafter, self.lookup

    @property
    def reads_ahead(self) -> bool:
        """Both parts read ahead and neither takes the read (see the module doc)."""
        return all(base.reads_ahead(part) and not base.reads_back(part) for part in self.parts)

    def attach(self, target, max_cache_len: int) -> None:
        for part in self.parts:
            part.attach(target, max_cache_len)
        compile = compile_by_default()
        self._steps = _MERGE_STEPS.setdefault(compile, CompiledSteps("graft", compile))

    def begin(self, state: DraftState) -> None:
        for part in self.parts:
            part.begin(state)

    def propose(self, state: DraftState) -> Proposal:
        tree, branch = self.drafter.propose(state), self.lookup.propose(state)
        if self._steps.compile:  # one shape per batch size: the envelope stays fixed
            branch = with_roots(branch, branch.tokens[:, 0], self.lookup.max_nodes)
        return graft(tree, branch, self._steps)

    def update(self, state: DraftState, outcome: StepOutcome) -> None:
        for part in self.parts:
            part.update(state, outcome)

    def keep(self, rows: list[int]) -> None:
        for part in self.parts:
            part.keep(rows)

    def join(self, state: DraftState) -> None:
        for part in self.parts:
            part.join(state)

    def end(self) -> None:
        for part in self.parts:
            part.end()
