"""Drafting with an independent small HF model that runs on our runner with its own KV cache."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from transformers import PreTrainedModel

from specdec_fast import graphs
from specdec_fast.arguments import CACHE_BLOCK
from specdec_fast.kernels.tree_attention import MAX_TREE_NODES
from specdec_fast.runner import ModelRunner
from specdec_fast.transfer import to_device
from specdec_fast.trees import StaticTree, parse_tree, sample_draft_tokens

from .base import (
    Drafter,
    DraftState,
    Proposal,
    StepOutcome,
    joined_rows,
    kept_rows,
    require_int,
)

SPECIAL_TOKEN_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")
# Random stream of the draft's own samples (verify uses 0 and 1, block drafters 3).
STREAM_DRAFT = 2
DEFAULT_CHAIN = 4  # tokens a chain drafts per step when neither `num_tokens` nor `tree` is given


def _special_tokens(model: PreTrainedModel) -> dict[str, object]:
    config = getattr(model, "generation_config", None) or model.config
    return {name: getattr(config, name, None) for name in SPECIAL_TOKEN_FIELDS}


def check_compatible(draft, target, draft_tokenizer=None, target_tokenizer=None) -> None:
    """Raise ValueError naming what differs between a draft and a target model: vocabulary size,
    special token ids, or (when both tokenizers are given) tokenizer contents."""
    draft_vocab = draft.config.get_text_config(decoder=True).vocab_size
    target_vocab = target.config.get_text_config(decoder=True).vocab_size
    if draft_vocab != target_vocab:
        raise ValueError(
            f"draft and target vocabularies differ in size: draft {draft_vocab}, "
            f"target {target_vocab}"
        )
    draft_special, target_special = _special_tokens(draft), _special_tokens(target)
    for name in SPECIAL_TOKEN_FIELDS:
        if draft_special[name] != target_special[name]:
            raise ValueError(
                f"draft and target disagree on {name}: draft {draft_special[name]}, "
                f"target {target_special[name]}"
            )
    if (draft_tokenizer is None) != (target_tokenizer is None):
        raise ValueError("give both tokenizers (draft_tokenizer and target_tokenizer) or neither")
    if draft_tokenizer is not None:
        draft_map, target_map = draft_tokenizer.get_vocab(), target_tokenizer.get_vocab()
        differing = sorted(
            token
            for token in draft_map.keys() | target_map.keys()
            if draft_map.get(token) != target_map.get(token)
        )
        if differing:
            raise ValueError(
                f"draft and target tokenizers differ on {len(differing)} tokens, e.g. "
                + ", ".join(
                    f"{t!r}: draft {draft_map.get(t)} / target {target_map.get(t)}"
                    for t in differing[:3]
                )
            )


class DraftRunnerRows:
    """A draft model's runner kept row for row with the target's batch: the draft model drafter's
    and the PARD block flavour's. `runner` (None until `open_runner`) caches every row's tokens
    but the current root after `begin`. A subclass sets it to None in its `__init__`."""

    runner: ModelRunner | None

    def open_runner(
        self, draft_model, target, max_cache_len: int, draft_tokenizer=None, target_tokenizer=None
    ) -> None:
        """Close any runner, then open the draft model's runner for sequences of `max_cache_len`
        tokens, after checking that it can draft for `target` (`check_compatible`, same device).
        Its cache is sized in whole `CACHE_BLOCK`s, as the target's storage is: calls of similar
        lengths then share one cache shape, and the compiled draft loops, which see it, compile
        once for them."""
        self.end()
        check_compatible(draft_model, target, draft_tokenizer, target_tokenizer)
        if draft_model.device != target.device:
            raise ValueError(
                f"draft model is on {draft_model.device}, the target on {target.device}"
            )
        capacity = -(-max_cache_len // CACHE_BLOCK) * CACHE_BLOCK
        # Its forwards replay as CUDA graphs when the call's target's do (`graphs.choice`).
        self.runner = ModelRunner.for_model(draft_model, capacity, use_cuda_graphs=graphs.chosen())

    def begin(self, state: DraftState) -> None:
        """Prefill the draft's cache with every row's tokens but the last (the root)."""
        width = max(len(row) for row in state.tokens)
        ids = np.zeros((state.batch_size, width), dtype=np.int64)
        mask = np.zeros_like(ids)
        for row, tokens in enumerate(state.tokens):
            ids[row, : len(tokens)] = tokens
            mask[row, : len(tokens)] = 1
        self.runner.prefill(to_device(ids, state.device), to_device(mask, state.device))

    def keep(self, rows: list[int]) -> None:
        self.runner.keep(rows)

    def join(self, state: DraftState) -> None:
        self.runner.prefill_rows(state.tokens)

    def end(self) -> None:
        if self.runner is not None:
            self.runner.close()
            self.runner = None


class DraftModelDrafter(DraftRunnerRows, Drafter):
    """Speculation with a small draft model sharing the target's tokenizer.

    Chain mode (`tree=None`): the draft proposes `num_tokens` = k tokens one after another,
    greedily for greedy rows and sampled from its own distribution (at the row's temperature) for
    sampled rows; the draft probabilities go to verification, which keeps sampling lossless. A
    chain is sized by the tokens it drafts: k drafted tokens are verified with the root, N = k + 1
    (`max_nodes`).
    Tree mode (`tree` = a `StaticTree`, `medusa_choices`-style rank paths, or a token-tree string):
    deterministic top-k expansion level by level, node i's rank-r child being the draft's r-th most
    likely token after node i's path; one draft forward per level over the tree so far. N is the
    tree's node count, root included (`default_tree(16)` verifies 16 tokens).

    The draft's cache holds every token but the current root, like the target's; after
    verification it is compacted to the accepted path, and a token the draft never saw (the last
    node of a path accepted to its full depth) is fed at the next step, beside the root in the
    loop's first forward. Both are device work on the outcome's tensors, so the drafter reads
    ahead (`Drafter.reads_ahead`): `update` runs before the step is read back.

    Args:
        draft_model: an HF causal LM with the target's vocabulary and special tokens.
        num_tokens: chain length k, the tokens drafted per step (chain mode; >= 1; default 4).
        tree: a static tree (tree mode), instead of `num_tokens` (not with it).
        draft_tokenizer, target_tokenizer: when given, their vocabularies must be identical.
    """

    # Valid trees by construction (tests/test_drafter_checks.py): values go unchecked.
    proposals_valid = True
    reads_ahead = True

    def __init__(
        self,
        draft_model: PreTrainedModel,
        num_tokens: int | None = None,
        tree: StaticTree | Sequence[Sequence[int]] | str | None = None,
        *,
        draft_tokenizer=None,
        target_tokenizer=None,
    ):
        if not isinstance(draft_model, torch.nn.Module):
            raise TypeError(
                f"draft_model: expected a loaded model (specdec_fast.loading.load_model reads a "
                f"folder or a bundled name), got {type(draft_model).__name__}"
            )
        if tree is not None and num_tokens is not None:
            raise ValueError("num_tokens and tree: give one (a chain of num_tokens, or a tree)")
        if tree is not None:
            tree = parse_tree(tree)
        elif num_tokens is None:
            num_tokens = DEFAULT_CHAIN
        self.tree = tree
        # The chain length k in chain mode, None in tree mode.
        self.num_tokens = num_tokens
        if tree is None:
            require_int("num_tokens", num_tokens)
            if not 1 <= num_tokens < MAX_TREE_NODES:
                raise ValueError(
                    f"num_tokens must be in [1, {MAX_TREE_NODES - 1}] (tokens drafted; with the "
                    f"root, tree attention verifies at most {MAX_TREE_NODES}), got {num_tokens}"
                )
            super().__init__(num_tokens + 1, num_tokens)
        else:
            super().__init__(tree.num_nodes, tree.max_depth)
        self.draft_model = draft_model
        self.draft_tokenizer = draft_tokenizer
        self.target_tokenizer = target_tokenizer
        self.runner: ModelRunner | None = None
        # Per row, int64 `[B]` on the device: the token before the root that the draft's cache
        # lacks, and whether it lacks one (1) or not (0); fed by the next draft loop.
        self._behind: tuple[torch.Tensor, torch.Tensor] | None = None
        self._tree_index: _TreeIndex | None = None

    def __repr__(self) -> str:
        mode = f"tree={self.tree.num_nodes} nodes" if self.tree else f"num_tokens={self.num_tokens}"
        return f"DraftModelDrafter({self.draft_model.config.model_type}, {mode})"

    def attach(self, target, max_cache_len: int) -> None:
        self.open_runner(
            self.draft_model, target, max_cache_len, self.draft_tokenizer, self.target_tokenizer
        )

    def end(self) -> None:
        super().end()
        self._behind = None
        self._tree_index = None

    def begin(self, state: DraftState) -> None:
        super().begin(state)
        self._behind = self._none_behind(state)

    def _none_behind(self, state: DraftState) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows whose draft cache lacks nothing before the root (a prefilled row's): two
        tensors, not one twice (the compiled loop guards on its arguments' aliasing)."""
        zeros = torch.zeros(state.batch_size, dtype=torch.int64, device=state.device)
        return zeros, zeros.clone()

    def keep(self, rows: list[int]) -> None:
        super().keep(rows)
        self._behind = kept_rows(self._behind, rows)

    def join(self, state: DraftState) -> None:
        super().join(state)
        self._behind = joined_rows(self._behind, self._none_behind(state))

    def propose(self, state: DraftState) -> Proposal:
        """The chain or tree from one run of the draft loop (`_chain_loop`, `_tree_loop`): one
        compiled call when the runner compiles, no read. The cache's room is checked on the
        host's bound of its lengths: every row's tokens but the root, unread ones included."""
        cache = self.runner.cache
        cache.bound_lengths(state.longest - 1)
        if self.tree is None:
            # The token behind the root and the chain's k fed nodes.
            cache.ensure_room(self.num_tokens + 1)
            sampling = () if state.greedy else (state.temperature, state.seed)
            return Proposal(*self._run("loop", _chain_loop, state.roots, *self._behind, *sampling))
        if self._tree_index is None:
            self._tree_index = _TreeIndex.build(self.tree, state.device)
        cache.ensure_room(self._tree_index.fed[-1] + 1)
        return Proposal(*self._run("loop", _tree_loop, state.roots, *self._behind))

    def _run(self, kind: str, step, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """`step(self, *args)` under no grad: the chain's or tree's whole draft loop, or its
        update, as one step of the draft model's runner, compiled (and its weights frozen) as
        the runner's own, and replayed as a CUDA graph kept with the runner's when it captures
        (`run_step`; the tree's index tensors are made once per tree, `_TreeIndex.build`)."""
        mode = "tree" if self.tree is not None else "chain"
        what = f"tree N={self.tree.num_nodes}" if self.tree else f"chain k={self.num_tokens}"
        label = f"draft {kind} {what} B={args[0].shape[0]}"
        key = (f"{mode} {kind}", self.tree, self.num_tokens)
        return self.runner.run_step(key, label, step, self, *args)

    def update(self, state: DraftState, outcome: StepOutcome) -> None:
        """Keep the accepted path's fed nodes in the draft's cache and note its last node where
        it was not fed (`_update`: a step of the runner's own over the outcome's tensors; a
        tree's path is then compacted, as the engine compacts the target's)."""
        tensors = (outcome.proposal.tokens, outcome.accepted_nodes, outcome.num_accepted)
        token, behind, path, num_in_cache = self._run("update", _update, *tensors)
        self._behind = (token, behind)
        if self.tree is not None:
            self.runner.cache.compact(path, num_in_cache, validate=False)
        # The host's bound: every row's tokens but the new root (no device read).
        self.runner.cache.bound_lengths(state.longest - 1)


def _update(
    drafter: DraftModelDrafter,
    tokens: torch.Tensor,
    accepted_nodes: torch.Tensor,
    num_accepted: torch.Tensor,
) -> tuple[torch.Tensor | None, ...]:
    """The draft cache after a verified step (`tokens` int64 `[B, N]`, `accepted_nodes` int32
    `[B, N]`, `num_accepted` int32 `[B]`), device ops only. Returns each row's last accepted
    token and whether the cache lacks it (int64 `[B]` both: a path accepted past the last fed
    node), then a chain's None, None (its accepted nodes kept in place here, the cache's
    lengths advanced) or what a tree keeps, for `cache.compact`: the accepted path cut at the
    last fed node (int32 `[B, N]`) and the count of its nodes after the root (int32 `[B]`)."""
    accepted = num_accepted.long()
    last = accepted_nodes.gather(1, accepted[:, None]).long()
    token = tokens.gather(1, last)[:, 0]
    if drafter.tree is None:
        # The chain committed the root and its first k - 1 drafts: keep the accepted ones.
        cache, last_fed = drafter.runner.cache, drafter.num_tokens - 1
        kept = accepted.clamp(max=last_fed) + (1 - last_fed)
        # The cache's own tensor, not an argument: a captured graph's replay copies its
        # arguments into buffers of its own, and would advance those.
        cache.cache_lens += kept.to(cache.cache_lens.dtype)
        return token, (accepted > last_fed).long(), None, None
    fed = drafter._tree_index.fed[-1]
    # Nodes beyond the last fed level have no K/V in the draft cache: cut the path there.
    in_cache = (accepted_nodes >= 0) & (accepted_nodes < fed)
    num_in_cache = (in_cache.sum(dim=1) - 1).to(torch.int32)
    path = torch.where(in_cache, accepted_nodes, -1)
    return token, (last[:, 0] >= fed).long(), path, num_in_cache


def _root_logits(
    runner: ModelRunner, roots: torch.Tensor, token: torch.Tensor, behind: torch.Tensor
) -> torch.Tensor:
    """The draft loop's first forward: per row, the token before the root that the cache lacks
    (`token`, where `behind` int64 `[B]` is 1) and the root, as a two-node chain (a row lacking
    none feeds its root twice, the second one written past the cache and dropped). Commits the
    token behind; returns the root's fp32 logits `[B, 1, V]`."""
    tokens = torch.stack([torch.where(behind.bool(), token, roots), roots], dim=1)
    parents = torch.arange(-1, 1, device=roots.device).expand(roots.shape[0], -1)
    logits = runner.tree_logits(tokens, parents.contiguous())
    runner.cache.cache_lens += behind.to(runner.cache.cache_lens.dtype)
    return logits.gather(1, behind[:, None, None].expand(-1, 1, logits.shape[-1]))


def _chain_loop(
    drafter: DraftModelDrafter,
    roots: torch.Tensor,
    token: torch.Tensor,
    behind: torch.Tensor,
    temperature: torch.Tensor | None = None,
    seed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """The chain's k draft forwards (the first one with the token behind the root,
    `_root_logits`), one token each: int64 `(tokens, parents)` `[B, k + 1]` and, when sampling
    (`temperature`, `seed` `[B]`), the draft probabilities `[B, k + 1, V]` (row 0 zeros), else
    None. Each fed node but the last is committed to the draft cache so that the next one
    attends to it (device ops only)."""
    runner, k = drafter.runner, drafter.num_tokens
    cache = runner.cache
    current = roots.long()
    root_parent = torch.full_like(current[:, None], -1)
    tokens, probs = [current], []
    for depth in range(1, k + 1):
        if depth == 1:
            logits = _root_logits(runner, current, token, behind)
        else:
            logits = runner.tree_logits(current[:, None], root_parent)
        # The draft token drawn here sits at the fed token's position + 1.
        position = cache.cache_lens.long() + 1
        if temperature is None:
            current = logits[:, 0].argmax(dim=-1)
        else:
            drawn, dist = sample_draft_tokens(
                logits, temperature, seed, position[:, None], STREAM_DRAFT
            )
            current = drawn[:, 0]
            probs.append(dist[:, 0])
        tokens.append(current)
        if depth < k:
            cache.cache_lens += 1
    parents = torch.arange(-1, k, device=roots.device).expand(roots.shape[0], -1)
    draft_probs = None
    if probs:
        draft_probs = torch.stack([torch.zeros_like(probs[0]), *probs], dim=1)
    return torch.stack(tokens, dim=1), parents.contiguous(), draft_probs


def _tree_loop(
    drafter: DraftModelDrafter, roots: torch.Tensor, token: torch.Tensor, behind: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """The static tree's level-by-level expansion: per depth, one draft forward over the tree
    so far (written past the cache, not committed; the root's with the token behind it,
    `_root_logits`), its top-R, then the level's tokens. Returns int64 `(tokens, parents)`
    `[B, N]` and None (no draft probabilities)."""
    tree, index, runner = drafter.tree, drafter._tree_index, drafter.runner
    batch = roots.shape[0]
    parents = index.parents.expand(batch, -1)
    tokens = roots.long()[:, None].expand(batch, tree.num_nodes)
    for fed, level in zip(index.fed, index.levels, strict=True):
        if fed == 1:
            logits = _root_logits(runner, roots.long(), token, behind)
        else:
            logits = runner.tree_logits(tokens[:, :fed], parents[:, :fed].contiguous())
        top = logits.topk(tree.max_rank, dim=-1).indices  # [B, fed, R]
        drawn = top[:, index.parents[level], index.ranks[level]]  # [B, level's nodes]
        tokens = tokens.index_copy(1, level, drawn)
    return tokens, parents.contiguous(), None


@dataclass(frozen=True)
class _TreeIndex:
    """A static tree's index tensors on the device, for level-by-level expansion.

    parents: int64 `[N]`, -1 for the root; ranks: int64 `[N]`, each node's rank among the draft's
    candidates; levels: per depth d >= 1, the node indices at depth d; fed: per depth, how many
    nodes (all shallower ones) are fed to draw that level.
    """

    parents: torch.Tensor
    ranks: torch.Tensor
    levels: tuple[torch.Tensor, ...]
    fed: tuple[int, ...]

    @classmethod
    @functools.cache
    def build(cls, tree: StaticTree, device: torch.device) -> _TreeIndex:
        """The index of `tree` on `device`, made once: captured draft loops keep reading the
        same tensors."""
        depths = (0, *tree.depths)
        levels, fed = [], []
        for depth in range(1, tree.max_depth + 1):
            levels.append(to_device([i for i, d in enumerate(depths) if d == depth], device))
            fed.append(sum(1 for d in depths if d < depth))
        return cls(
            to_device([-1, *tree.parents], device),
            to_device([0, *tree.ranks], device),
            tuple(levels),
            tuple(fed),
        )
