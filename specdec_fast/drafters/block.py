"""Block drafters: one draft forward per step gives the distributions of the next b tokens.

`BlockDrafter` drives two flavours:

- feature-conditioned (DFlash-style, `specdec_fast.drafters.dflash`): a head over the target's
  features with its own KV cache of context entries;
- standalone (PARD-style, `specdec_fast.drafters.pard`): a small causal LM on its own runner and
  cache, trained to fill b - 1 mask tokens after the context.

Either way the per-position distributions become a proposal through `specdec_fast.trees`
(`block_shape.BlockShape`): the DDTree-style best-first tree (`tree="ddtree"`, deterministic, so
lossless through verification's one-hot path when sampling too) or a chain (`tree="chain"`: the
top-1 tokens when greedy, tokens sampled from the draft distributions with their probabilities
otherwise, lossless through verification's draft-probability path). Nothing is read back from
the device, and a step needs nothing of the host but bounds of the rows' lengths (their token
counts, `DraftState.unread` more; a sampled chain's draws take the roots' positions from the
flavour's cache lengths): both flavours follow a step from its device outcome, so trees and
chains read ahead (`Drafter.reads_ahead`).

Either layout may carry our own `ddtree_depth_scale` (top level of `config.json`): the
best-first tree's calibration fitted for that checkpoint (`specdec_fast.trees.best_first_tree`,
`specdec_fast.train.calibrate`); other readers ignore it, and without it the scale is 1 (the
plain product of marginals).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from specdec_fast.heads.block import DFlashHead, is_dflash_config, load_dflash_head
from specdec_fast.heads.checkpoint import read_config, resolve_folder
from specdec_fast.trees import check_depth_scale

from .base import Drafter, DraftState, Proposal, StepOutcome
from .block_shape import TREE_MODES, BlockShape
from .dflash import DFlashBlock
from .pard import PARD_TOKEN_FIELDS, PARD_TYPE, PardBlock, PardDraft, load_pard


def load_block_model(
    name_or_path: str | os.PathLike, target, dtype: torch.dtype | None = None
) -> DFlashHead | PardDraft:
    """A DFlash head or a PARD draft model, told apart by the checkpoint's config, in `dtype`
    (None: each flavour's default, see `load_dflash_head` and `load_pard`)."""
    fields = read_config(resolve_folder(name_or_path))
    if is_dflash_config(fields):
        return load_dflash_head(name_or_path, target, dtype)
    if any(field in fields for field in PARD_TOKEN_FIELDS) or fields.get("spd_type") == PARD_TYPE:
        return load_pard(name_or_path, target, dtype)
    raise ValueError(
        f"{Path(name_or_path)}: config.json is neither a DFlash head's (dflash_config, or a "
        f"DFlash architecture) nor a PARD model's ({' or '.join(PARD_TOKEN_FIELDS)})"
    )


class BlockDrafter(Drafter):
    """Speculation with a block drafter (DFlash-style or PARD-style, see the module doc).

    Args:
        model: a `DFlashHead` (feature-conditioned) or a `PardDraft` (standalone).
        max_nodes: the budget N, tokens verified per step with the root included (>= 2). A
            chain drafts N - 1 tokens, at most the block's positions (b - 1 for DFlash, b for
            PARD); a tree reaches at most that deep.
        tree: "ddtree" (best-first tree by product of marginals) or "chain".
        depth_scale: the best-first tree's calibration (`specdec_fast.trees.best_first_tree`);
            None takes the checkpoint's (`ddtree_depth_scale`, 1 when it has none).
    """

    # Valid trees by construction (tests/test_drafter_checks.py): values go unchecked.
    proposals_valid = True
    reads_ahead = True

    def __init__(
        self,
        model: DFlashHead | PardDraft,
        max_nodes: int = 16,
        tree: str = "ddtree",
        depth_scale: float | None = None,
    ):
        if isinstance(model, DFlashHead):
            self.flavour: DFlashBlock | PardBlock = DFlashBlock(model)
        elif isinstance(model, PardDraft):
            self.flavour = PardBlock(model)
        else:
            raise ValueError(
                f"model: expected a DFlashHead or a PardDraft, got {type(model).__name__}"
            )
        if tree not in TREE_MODES:
            raise ValueError(f"tree: expected one of {TREE_MODES}, got {tree!r}")
        positions = self.flavour.positions
        if tree == "chain" and max_nodes - 1 > positions:
            raise ValueError(
                f"max_nodes={max_nodes}: a chain of {max_nodes - 1} tokens is longer than the "
                f"block's {positions} positions"
            )
        if depth_scale is None:
            depth_scale = model.depth_scale
        check_depth_scale(depth_scale)
        super().__init__(max_nodes, min(positions, max_nodes - 1))
        self.model, self.tree, self.depth_scale = model, tree, depth_scale
        self.hidden_layers = self.flavour.hidden_layers
        self.flavour.shape = BlockShape(tree, max_nodes, self.max_depth, depth_scale)

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str | os.PathLike,
        target,
        dtype: torch.dtype | None = None,
        **kwargs,
    ) -> BlockDrafter:
        """Load a DFlash head or a PARD draft model (told apart by its config) for `target`, in
        `dtype` (None: `load_block_model`'s default); `kwargs` are `max_nodes`, `tree` and
        `depth_scale`."""
        return cls(load_block_model(name_or_path, target, dtype), **kwargs)

    @property
    def flavour_name(self) -> str:
        return "dflash" if isinstance(self.flavour, DFlashBlock) else "pard"

    def __repr__(self) -> str:
        return (
            f"BlockDrafter({self.flavour_name}, b={self.model.block_size}, "
            f"max_nodes={self.max_nodes}, tree={self.tree}, depth_scale={self.depth_scale:g})"
        )

    def attach(self, target, max_cache_len: int) -> None:
        self.flavour.attach(target, max_cache_len, self.max_depth)

    @torch.no_grad()
    def begin(self, state: DraftState) -> None:
        self.flavour.begin(state)

    @torch.no_grad()
    def propose(self, state: DraftState) -> Proposal:
        return Proposal(*self.flavour.propose(state))

    @torch.no_grad()
    def update(self, state: DraftState, outcome: StepOutcome) -> None:
        self.flavour.update(state, outcome)

    def keep(self, rows: list[int]) -> None:
        self.flavour.keep(rows)

    @torch.no_grad()
    def join(self, state: DraftState) -> None:
        self.flavour.join(state)

    def end(self) -> None:
        self.flavour.end()
