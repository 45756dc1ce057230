"""How a block drafter's per-position distributions become a proposal (both flavours,
`specdec_fast.drafters.dflash` and `specdec_fast.drafters.pard`): the DDTree-style best-first
tree or a chain, built on the device inside the flavours' compiled steps."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec_fast.trees import best_first_tree, block_chain, sampled_block_chain

from .base import DraftState

TREE_MODES = ("ddtree", "chain")
# Random stream of the sampled chains' draws (verify uses 0 and 1, draft models 2).
STREAM_BLOCK = 3


@dataclass(frozen=True)
class BlockShape:
    """How a block's distributions become a proposal: `tree` ("ddtree" or "chain"), the budget
    `max_nodes` (root included), the deepest position used `depth` and the best-first tree's
    `depth_scale`. The flavours' compiled steps run it after their forward, so that the tree
    is built in the same graph (the best-first pops as device rounds, no host read); a compiled
    step per shape (`kind`)."""

    tree: str
    max_nodes: int
    depth: int
    depth_scale: float

    def kind(self, sampled: bool) -> str:
        """What a compiled step of this shape is named (and keyed) by."""
        if self.tree == "ddtree":
            return f"ddtree N={self.max_nodes} D={self.depth} s={self.depth_scale:g}"
        return f"{'sampled ' if sampled else ''}chain D={self.depth}"

    def propose(
        self,
        logits: torch.Tensor,
        roots: torch.Tensor,
        root_positions: torch.Tensor,
        temperature: torch.Tensor | None = None,
        seed: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """int64 `(tokens, parents)` `[B, n]` and the chain's draft probabilities `[B, n, V]`
        when sampled (else None) from fp32 block logits `[B, >= depth, V]`, the roots `[B]` and
        their positions (int `[B]`, the flavour's cache lengths: only a sampled chain's draws
        read them, `sampled_block_chain`); a sampled chain takes the rows' temperature `[B]`
        and seed `[B]`, a greedy one or a tree neither."""
        logits = logits[:, : self.depth]
        if self.tree == "ddtree":
            log_probs = torch.log_softmax(logits, dim=-1)
            return (*best_first_tree(log_probs, roots, self.max_nodes, self.depth_scale), None)
        if temperature is None:
            return (*block_chain(logits, roots, self.depth), None)
        return sampled_block_chain(
            logits, roots, self.depth, temperature, seed, root_positions, STREAM_BLOCK
        )


def in_target_vocab(
    proposal: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
    vocab: torch.Tensor,
    vocab_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A proposal (`BlockShape.propose`) from logits over a draft vocabulary (`vocab`: int64
    `[V']`, the target id of each draft id) in the target's ids: the drafted tokens mapped (the
    root, node 0, is a target id already) and a sampled chain's draft probabilities spread over
    the target's `vocab_size` ids (zero off the vocabulary, which the chain never draws)."""
    tokens, parents, draft_probs = proposal
    tokens = torch.cat([tokens[:, :1], vocab[tokens[:, 1:]]], dim=1)
    if draft_probs is not None:
        spread = draft_probs.new_zeros(*draft_probs.shape[:-1], vocab_size)
        draft_probs = spread.index_copy(-1, vocab, draft_probs)
    return tokens, parents, draft_probs


def block_sampling(state: DraftState, shape: BlockShape) -> tuple[torch.Tensor, ...]:
    """What a sampled chain's draws take from the state (`BlockShape.propose`): the rows'
    temperatures and seeds (the flavour's step adds the roots' positions, which it knows on the
    device); nothing for a greedy chain or a tree."""
    if shape.tree == "ddtree" or state.greedy:
        return ()
    return state.temperature, state.seed
