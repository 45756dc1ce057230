"""Drafting with an independent small HF model that runs on our runner with its own KV cache."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from specdec_fast.runner import ModelRunner
from specdec_fast.trees import StaticTree, parse_tree

from .base import Drafter, DraftState, Proposal, StepOutcome

SPECIAL_TOKEN_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")


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


class DraftModelDrafter(Drafter):
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
    node of a path accepted to its full depth) is fed at the next step.

    Args:
        draft_model: an HF causal LM with the target's vocabulary and special tokens.
        num_tokens: chain length k, the tokens drafted per step (chain mode; >= 1).
        tree: a static tree (tree mode); `num_tokens` is then unused.
        draft_tokenizer, target_tokenizer: when given, their vocabularies must be identical.
    """

    def __init__(
        self,
        draft_model: PreTrainedModel,
        num_tokens: int = 4,
        tree: StaticTree | Sequence[Sequence[int]] | str | None = None,
        *,
        draft_tokenizer=None,
        target_tokenizer=None,
    ):
        if tree is not None:
            tree = parse_tree(tree)
        self.tree = tree
        # The chain length k in chain mode, None in tree mode.
        self.num_tokens = num_tokens if tree is None else None
        if tree is None:
            if num_tokens < 1:
                raise ValueError(f"num_tokens must be >= 1 (tokens drafted), got {num_tokens}")
            super().__init__(num_tokens + 1, num_tokens)
        else:
            super().__init__(tree.num_nodes, tree.max_depth)
        self.draft_model = draft_model
        self.draft_tokenizer = draft_tokenizer
        self.target_tokenizer = target_tokenizer
        self.runner: ModelRunner | None = None
        self._cached: list[int] = []  # draft-cached tokens per row (host mirror)
        self._tree_fed = 0  # tree nodes whose K/V the last level's forward wrote
        self._generator = torch.Generator()

    def __repr__(self) -> str:
        mode = f"tree={self.tree.num_nodes} nodes" if self.tree else f"num_tokens={self.num_tokens}"
        return f"DraftModelDrafter({self.draft_model.config.model_type}, {mode})"

    def attach(self, target, max_cache_len: int) -> None:
        check_compatible(self.draft_model, target, self.draft_tokenizer, self.target_tokenizer)
        if self.draft_model.device != target.device:
            raise ValueError(
                f"draft model is on {self.draft_model.device}, the target on {target.device}"
            )
        self.end()
        self.runner = ModelRunner(self.draft_model, max_cache_len)

    def begin(self, state: DraftState) -> None:
        width = max(len(row) for row in state.tokens)
        ids = torch.zeros(state.batch_size, width, dtype=torch.int64)
        mask = torch.zeros_like(ids)
        for row, tokens in enumerate(state.tokens):
            ids[row, : len(tokens)] = torch.as_tensor(tokens)
            mask[row, : len(tokens)] = 1
        self.runner.prefill(ids.to(state.device), mask.to(state.device))
        self._cached = [len(row) - 1 for row in state.tokens]
        self._generator.manual_seed(int(state.seed[0]) if state.batch_size else 0)

    def keep(self, rows: torch.Tensor) -> None:
        self.runner.keep(rows)
        self._cached = [self._cached[r] for r in rows.cpu().tolist()]

    def end(self) -> None:
        if self.runner is not None:
            self.runner.close()
            self.runner = None

    def _commit(self, lengths: list[int], device) -> None:
        self._cached = lengths
        self.runner.cache.commit_lengths(
            torch.tensor(lengths, dtype=torch.int32, device=device), max(lengths)
        )

    def _catch_up(self, state: DraftState) -> None:
        """Feed the tokens before the root that the draft has not seen (ragged, as one chain)."""
        pending = [row[cached:-1] for row, cached in zip(state.tokens, self._cached, strict=True)]
        width = max(len(p) for p in pending)
        if width == 0:
            return
        tokens = torch.zeros(state.batch_size, width, dtype=torch.int64)
        for row, chunk in enumerate(pending):
            tokens[row, : len(chunk)] = torch.as_tensor(chunk, dtype=torch.int64)
        parents = torch.arange(-1, width - 1).expand(state.batch_size, -1)
        q_lens = torch.tensor([len(p) for p in pending], dtype=torch.int32)
        self.runner.verify(
            tokens.to(state.device), parents.to(state.device), q_lens.to(state.device)
        )
        self._commit([len(row) - 1 for row in state.tokens], state.device)

    def propose(self, state: DraftState) -> Proposal:
        self._catch_up(state)
        if self.tree is None:
            return self._propose_chain(state)
        return self._propose_tree(state)

    def _propose_chain(self, state: DraftState) -> Proposal:
        device = state.device
        batch = state.batch_size
        sampled = state.temperature > 0
        any_sampled = bool(sampled.any())
        current = torch.tensor([row[-1] for row in state.tokens], device=device)
        root_parent = torch.full((batch, 1), -1, dtype=torch.int64, device=device)
        tokens, probs = [current], []
        for depth in range(1, self.num_tokens + 1):
            logits = self.runner.verify(current[:, None], root_parent).logits[:, 0]
            greedy_next = logits.argmax(dim=-1)
            if any_sampled:
                scaled = logits / state.temperature.clamp(min=1e-6)[:, None]
                dist = torch.softmax(scaled, dim=-1)
                drawn = torch.multinomial(dist.cpu(), 1, generator=self._generator)[:, 0]
                current = torch.where(sampled, drawn.to(device), greedy_next)
                one_hot = torch.nn.functional.one_hot(greedy_next, dist.shape[-1]).to(dist.dtype)
                probs.append(torch.where(sampled[:, None], dist, one_hot))
            else:
                current = greedy_next
            tokens.append(current)
            if depth < self.num_tokens:
                # Commit the node just fed so the next one attends to it.
                self._commit([c + 1 for c in self._cached], device)
        parents = torch.arange(-1, self.num_tokens, device=device).expand(batch, -1)
        draft_probs = None
        if any_sampled:
            draft_probs = torch.stack([torch.zeros_like(probs[0]), *probs], dim=1)
        return Proposal(torch.stack(tokens, dim=1), parents.contiguous(), draft_probs)

    def _propose_tree(self, state: DraftState) -> Proposal:
        tree, device, batch = self.tree, state.device, state.batch_size
        tokens = torch.zeros(batch, tree.num_nodes, dtype=torch.int64, device=device)
        tokens[:, 0] = torch.tensor([row[-1] for row in state.tokens], device=device)
        parents_row = torch.tensor((-1, *tree.parents), device=device)
        parents = parents_row.expand(batch, -1).contiguous()
        node_depths = (0, *tree.depths)
        ranks = torch.tensor((0, *tree.ranks), device=device)
        for depth in range(1, tree.max_depth + 1):
            fed = sum(1 for d in node_depths if d < depth)
            logits = self.runner.verify(tokens[:, :fed], parents[:, :fed]).logits
            top = logits.topk(tree.max_rank, dim=-1).indices  # [B, fed, R]
            level = [i for i, d in enumerate(node_depths) if d == depth]
            index = torch.tensor(level, device=device)
            chosen = top[:, parents_row[index], ranks[index]]
            tokens[:, index] = chosen
        self._tree_fed = sum(1 for d in node_depths if d < tree.max_depth)
        return Proposal(tokens, parents)

    def update(self, state: DraftState, outcome: StepOutcome) -> None:
        accepted = outcome.num_accepted.cpu().tolist()
        # `state.tokens` already holds the emitted tokens; the root was at len - emitted - 1.
        roots = [
            len(row) - len(e) - 1 for row, e in zip(state.tokens, outcome.emitted, strict=True)
        ]
        if self.tree is None:
            # The chain's nodes are in place: keep the root and the accepted drafts it fed.
            kept = [
                root + 1 + min(a, self.num_tokens - 1)
                for root, a in zip(roots, accepted, strict=True)
            ]
            self._commit(kept, state.device)
            return
        path = outcome.accepted_nodes.cpu()
        fed = self._tree_fed
        # Nodes beyond the last fed level have no K/V in the draft cache: cut the path there.
        in_cache = (path >= 0) & (path < fed)
        num_in_cache = in_cache.sum(dim=1) - 1
        path = torch.where(in_cache, path, torch.full_like(path, -1)).to(torch.int32)
        self.runner.cache.compact(
            path.to(state.device), num_in_cache.to(torch.int32).to(state.device)
        )
        self._cached = [root + 1 + n for root, n in zip(roots, num_in_cache.tolist(), strict=True)]
