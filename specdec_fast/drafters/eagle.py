"""EAGLE: a one-layer draft head over the target's features grows a dynamic tree (EAGLE-2).

The head (`specdec_fast.heads.eagle`, EAGLE-1/2 or EAGLE-3) runs on its own one-layer KV cache
through our attention kernels. Its entry t pairs the target's feature at position t with the
token at t + 1 (see the heads' module doc). With the target's cache holding c tokens, the head's
cache holds its c entries 0..c-1, all computed from the target's own features, and the output of
entry c - 1 (which pairs the last cached token's feature with the root) ranks the root's
children.

One step:
- `propose`: the root's top-k children start the tree; for each further level the frontier's
  entries (and their ancestors, refed so the attention sees them) go through the head above the
  committed entries with a tree mask, and `DynamicTreeBuilder` keeps the best k of their top-k
  children by cumulative log-probability; the best `max_nodes - 1` candidates form the tree. These
  entries are written past the committed length and never committed.
- `update`: the accepted path's a + 1 entries (the root's and each accepted node's target
  features with the next token of the path, the last one paired with the sampled next token)
  are fed as a ragged chain and committed, so the head's cache stays in step with the target's;
  the last entry's output ranks the next root's children.

Each of the two is one step function of device work only, with every shape fixed by the
envelope (B, top_k, depth, max_nodes) chosen at attach: the tree levels are fed at widths
k, 2k, ..., (depth - 1) k, the update at depth + 1 (deeper when a grafted lookup branch reaches
further, `follow_paths_to`) with the accepted counts masking the rest, and
the tree is built by `DynamicTreeBuilder` on the device (a dynamic tree is dynamic in its
contents only). In compiled mode each runs as one graph per batch size through the head's
`CompiledSteps` (the machinery of the target's `ModelRunner`), so a step dispatches nothing of
the drafter's outside them; the head's lengths live on the device and are bounded on the host
from the token counts, so the drafter reads nothing back.
"""

from __future__ import annotations

import os

import torch

from specdec_fast import graphs
from specdec_fast.arguments import CACHE_BLOCK
from specdec_fast.attention import METADATA_KWARG
from specdec_fast.cache import SpecKVCache
from specdec_fast.compiled import CompiledSteps, module_steps
from specdec_fast.heads.eagle import Eagle3Head, EagleHead, load_eagle_head
from specdec_fast.kernels import pack_tree_mask
from specdec_fast.kernels.tree_attention import MAX_TREE_NODES
from specdec_fast.onednn import follow_target
from specdec_fast.runner import step_metadata, switch_attention
from specdec_fast.transfer import to_device
from specdec_fast.trees import DynamicTreeBuilder, check_dynamic_tree, dynamic_tree_shape

from .base import Drafter, DraftState, Proposal, StepOutcome
from .features import gather_rows


class EagleDrafter(Drafter):
    """Speculation with an EAGLE-1/2 or EAGLE-3 head and EAGLE-2 dynamic trees.

    Args:
        head: an `EagleHead` or `Eagle3Head` for the target.
        max_nodes: the tree budget N, tokens verified per step with the root included (>= 2).
        depth, top_k: tree depth and children per expanded node; default from
            `specdec_fast.trees.dynamic_tree_shape(max_nodes)`.
    """

    # Valid trees by construction (tests/test_drafter_checks.py): values go unchecked.
    proposals_valid = True
    # Follows a step from its device outcome, token counts taken as bounds (`_bound_lengths`).
    reads_ahead = True

    def __init__(
        self,
        head: EagleHead | Eagle3Head,
        max_nodes: int = 16,
        depth: int | None = None,
        top_k: int | None = None,
    ):
        default_depth, default_top_k = dynamic_tree_shape(max_nodes)
        # A tree of max_nodes nodes is at most max_nodes - 1 deep: deeper levels are never kept.
        depth = min(default_depth if depth is None else depth, max_nodes - 1)
        top_k = default_top_k if top_k is None else top_k
        check_dynamic_tree(top_k, depth, max_nodes)
        super().__init__(max_nodes, depth)
        if top_k * (depth - 1) > MAX_TREE_NODES:
            raise ValueError(
                f"top_k * (depth - 1) = {top_k * (depth - 1)} head entries per level exceed the "
                f"{MAX_TREE_NODES} tree nodes tree_attention supports"
            )
        if top_k > head.draft_vocab_size:
            raise ValueError(f"top_k={top_k} exceeds the head's {head.draft_vocab_size} tokens")
        self.head = head
        self.depth, self.top_k = depth, top_k
        self.follow_depth = depth  # the deepest accepted path `update` feeds
        self.hidden_layers = head.target_layers
        self._embed = self._lm_head = None
        self._cache: SpecKVCache | None = None
        self._outputs: torch.Tensor | None = None  # [B, h]: output of each row's last entry
        self._attached = False
        self._steps: CompiledSteps | None = None
        self._resident: graphs.Resident | None = None

    @classmethod
    def from_pretrained(cls, name_or_path: str | os.PathLike, target, **tree_args) -> EagleDrafter:
        """Load an EAGLE-1/2 or EAGLE-3 head (told apart by its config) for `target`;
        `tree_args` are `max_nodes`, `depth`, `top_k`."""
        return cls(load_eagle_head(name_or_path, target), **tree_args)

    def __repr__(self) -> str:
        return (
            f"EagleDrafter(eagle{self.head.version}, max_nodes={self.max_nodes}, "
            f"depth={self.depth}, top_k={self.top_k})"
        )

    def follow_paths_to(self, depth: int) -> None:
        """Feed accepted paths up to `depth` nodes deep in `update` (from the next `attach`):
        the update's chain is `max(depth, self.depth) + 1` entries wide."""
        self.follow_depth = max(depth, self.depth)

    def attach(self, target, max_cache_len: int) -> None:
        """Check the head against `target`, switch it to our attention, and fix the step's
        envelope: every tensor of `propose` and `update` is shaped by (B, top_k, depth,
        max_nodes), so each batch size runs one compiled draft graph and one update graph."""
        self.head.check_target(target)
        self.head.to(device=target.device, dtype=target.dtype).eval()
        follow_target(self.head, target)
        self._embed = target.get_input_embeddings()
        self._lm_head = target.get_output_embeddings()
        if not self._attached:
            switch_attention(self.head, on=True)
            self._attached = True
        self._steps = module_steps(self.head, f"eagle{self.head.version}")
        # Entries past the committed length: the refed tree levels, or the accepted-path chain.
        self._draft_width = max(self.top_k * (self.depth - 1), 1)
        needed = max_cache_len + max(self._draft_width, self.follow_depth + 1)
        # In whole blocks, as the target's storage: the compiled steps know the capacity as a
        # constant, and calls of similar lengths then share their graphs.
        self._capacity = -(-needed // CACHE_BLOCK) * CACHE_BLOCK
        # The head's cache and captured steps, kept on the head for the envelope: everything
        # the steps read besides their arguments is in the key, or is that cache.
        envelope = (
            self.top_k,
            self.depth,
            self.follow_depth,
            self.max_nodes,
            self._capacity,
            id(self._steps),
        )
        targets = (self._embed.weight.data_ptr(), self._lm_head.weight.data_ptr())
        what = f"eagle{self.head.version}"
        self._resident = graphs.resident(
            self.head,
            (envelope, targets),
            what,
            graphs.chosen(),
            self._steps.record,
            self._resident,
        )

    def end(self) -> None:
        """Leave the head's cache (kept on the head for the next drafter of the envelope,
        `graphs.resident`) and give the head its own attention back."""
        self._cache = self._outputs = None
        if self._resident is not None:
            self._resident.release()
            self._resident = None
        if self._attached:
            switch_attention(self.head, on=False)
            self._attached = False

    def _forward(
        self,
        hidden: torch.Tensor,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        tree_mask: torch.Tensor | None = None,
        q_lens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Head outputs `[B, N, h]` for N entries written at slots `cache_lens[b] + i` of the
        head's cache (device ops only): hidden `[B, N, h]`, tokens and positions int64 `[B, N]`,
        tree_mask packed int32 `[B, N, words]` or None (causal), q_lens int32 `[B]` or None."""
        cache = self._cache
        # The capacity as the host knows it: a compiled step reading `cache.kv`'s shape would
        # guard on its batch size.
        metadata = step_metadata(cache, tokens.shape[1], tree_mask, q_lens, self._capacity)
        return self.head(
            hidden,
            self._embed(tokens),
            positions,
            past_key_values=cache,
            **{METADATA_KWARG: metadata},
        )

    def _run(self, kind: str, step, *args):
        """`step(self, *args)` through the head's compiled steps (`CompiledSteps`, the
        machinery of the target's runner), or as it is when not compiling; replayed as a CUDA
        graph per batch size when the call captures graphs (`StepGraphs`, bound to the head's
        cache; both kept on the head, `graphs.resident`)."""
        label = f"{kind} B={args[0].shape[0]}"
        captured = self._resident.graphs
        captured.bind(self._cache)
        return captured.run(kind, label, self._compiled, kind, label, step, *args)

    def _compiled(self, kind: str, label: str, step, *args):
        return self._steps.run(kind, label, step, self, *args)

    def _bound_lengths(self, state: DraftState, num_new: int) -> None:
        """Bound the head's committed lengths from the host's token counts (a row's head holds
        one entry per cached token, fewer than its tokens, unread ones included) and check
        room for `num_new` more: no device read."""
        self._cache.bound_lengths(state.longest)
        self._cache.ensure_room(num_new)

    @torch.no_grad()
    def begin(self, state: DraftState) -> None:
        self._cache = self._resident.cache(
            self.head.config,
            state.batch_size,
            self._capacity,
            self.head.fc.weight.dtype,
            state.device,
        )
        self._outputs = self._fill(state)

    @torch.no_grad()
    def join(self, state: DraftState) -> None:
        cache, batch = self._cache, self._cache.kv.shape[2]
        if batch + state.batch_size > cache.capacity:
            cache = cache.with_capacity(max(batch + state.batch_size, 2 * batch))
            self._resident.state = cache
        # The newcomers' entries go to the rows past the batch, through a view of them.
        self._cache = cache.rows(batch, state.batch_size)
        try:
            outputs = self._fill(state)
        finally:
            self._cache = cache
        cache.admit(batch, state.batch_size, max(len(row) - 1 for row in state.tokens))
        self._outputs = torch.cat([self._outputs, outputs])

    def _fill(self, state: DraftState) -> torch.Tensor:
        """Feed the rows' prompt entries into the head's cache (`self._cache`, one row per row of
        `state`) and commit them; returns the output of each row's last entry `[B, h]` (zeros
        for a one-token prompt). Once per row, eagerly: prompt widths vary."""
        device, batch = state.device, state.batch_size
        lengths = [len(row) - 1 for row in state.tokens]
        width = max(lengths)
        last_outputs = torch.zeros(
            batch, self.head.hidden_size, dtype=self.head.fc.weight.dtype, device=device
        )
        self._cache.commit_lengths(torch.zeros(batch, dtype=torch.int32, device=device), 0)
        if width > 0:
            tokens = torch.zeros(batch, width, dtype=torch.int64)
            for row, (ids, length) in enumerate(zip(state.tokens, lengths, strict=True)):
                tokens[row, :length] = torch.as_tensor(ids[1 : length + 1])
            hidden = self.head.fuse([state.hidden[layer] for layer in self.hidden_layers])
            q_lens = to_device(lengths, device, torch.int32)
            positions = torch.arange(width, device=device).expand(batch, -1)
            self._cache.ensure_room(width)
            outputs = self._forward(hidden, tokens.to(device), positions, None, q_lens)
            last = gather_rows(outputs, (q_lens.long() - 1).clamp(min=0)[:, None])[:, 0]
            last_outputs = torch.where((q_lens > 0)[:, None], last, last_outputs)
        self._cache.commit_lengths(to_device(lengths, device, torch.int32), width)
        return last_outputs

    def _top_k(self, outputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probabilities (float32) and target ids (int64) of the top-k next tokens after
        head outputs `[..., h]`: each `[..., k]`."""
        log_probs = torch.log_softmax(self.head.logits(outputs, self._lm_head).float(), dim=-1)
        best = log_probs.topk(self.top_k, dim=-1)
        return best.values, self.head.to_target_ids(best.indices)

    @torch.no_grad()
    def propose(self, state: DraftState) -> Proposal:
        self._bound_lengths(state, self._draft_width)
        return Proposal(*self._run("draft", EagleDrafter._draft_step, self._outputs, state.roots))

    def _draft_step(
        self, outputs: torch.Tensor, roots: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole draft loop, one compiled graph per batch size: the root's top-k children,
        then per further level the head over every fed entry (the tree's levels so far, above
        the committed entries, under their ancestor mask), the frontier's top-k children and
        the builder's choice of the next frontier; then the builder's final selection.

        outputs: `[B, h]`, each row's last committed entry's output; roots: int64 `[B]`.
        Returns int64 `(tokens, parents)` `[B, max_nodes]`.
        """
        batch, k, device = outputs.shape[0], self.top_k, outputs.device
        builder = DynamicTreeBuilder(k, self.depth, self.max_nodes)
        fed_tokens = builder.start(*self._top_k(outputs))
        fed_hidden = outputs[:, None].expand(-1, k, -1)
        # Entries are fed level by level, k per level: an entry's position is the committed
        # length plus its level, and it sees its ancestors (one per earlier level) and itself.
        own = torch.eye(k, dtype=torch.bool, device=device).expand(batch, -1, -1)
        ancestors = own
        for level in range(1, self.depth):
            levels = torch.arange(level, device=device).repeat_interleave(k)
            positions = self._cache.cache_lens[:, None].long() + levels
            fed = self._forward(fed_hidden, fed_tokens, positions, pack_tree_mask(ancestors))
            frontier = fed[:, -k:]
            new_tokens, source = builder.expand(*self._top_k(frontier))
            parent_rows = gather_rows(ancestors, source + (level - 1) * k)
            ancestors = torch.cat(
                [
                    torch.cat([ancestors, ancestors.new_zeros(batch, level * k, k)], dim=2),
                    torch.cat([parent_rows, own], dim=2),
                ],
                dim=1,
            )
            fed_tokens = torch.cat([fed_tokens, new_tokens], dim=1)
            fed_hidden = torch.cat([fed_hidden, gather_rows(frontier, source)], dim=1)
        return builder.finish(roots)

    @torch.no_grad()
    def update(self, state: DraftState, outcome: StepOutcome) -> None:
        self._bound_lengths(state, self.follow_depth + 1)
        hidden = [outcome.hidden[layer] for layer in self.hidden_layers]
        self._outputs = self._run(
            "update",
            EagleDrafter._update_step,
            outcome.proposal.tokens,
            outcome.accepted_nodes,
            outcome.num_accepted,
            outcome.next_tokens,
            *hidden,
        )

    def _update_step(
        self,
        tokens: torch.Tensor,
        accepted_nodes: torch.Tensor,
        num_accepted: torch.Tensor,
        next_tokens: torch.Tensor,
        *hidden: torch.Tensor,
    ) -> torch.Tensor:
        """Feed and commit the accepted path's entries at full width (follow_depth + 1, the rows'
        accepted counts masking the rest on the device), one compiled graph per batch size.

        tokens: int64 `[B, N]`, the verified tree's tokens; accepted_nodes: int32 `[B, N]`;
        num_accepted: int32 `[B]`; next_tokens: int64 `[B]`; hidden: the target's features of
        the verified nodes, `[B, N, H]` per `hidden_layers`. Returns the output of each row's
        last accepted entry, `[B, h]` (it ranks the next root's children).
        """
        width = self.follow_depth + 1  # the root and at most `follow_depth` accepted nodes
        accepted = num_accepted.long()
        nodes = accepted_nodes[:, :width].long().clamp(min=0)
        if nodes.shape[1] < width:  # a step's tree narrower than the deepest path followed
            nodes = torch.nn.functional.pad(nodes, (0, width - nodes.shape[1]))
        path_tokens = tokens.gather(1, nodes)
        step = torch.arange(width, device=nodes.device)
        following = torch.cat([path_tokens[:, 1:], next_tokens[:, None]], dim=1)
        entry_tokens = torch.where(step < accepted[:, None], following, next_tokens[:, None])
        features = self.head.fuse([gather_rows(layer, nodes) for layer in hidden])
        positions = self._cache.cache_lens[:, None].long() + step
        q_lens = (accepted + 1).to(torch.int32)
        outputs = self._forward(features, entry_tokens, positions, None, q_lens)
        self._cache.cache_lens.add_(q_lens)
        return gather_rows(outputs, accepted[:, None])[:, 0]

    def keep(self, rows: list[int]) -> None:
        self._cache.select(rows)
        self._outputs = self._outputs[to_device(rows, self._outputs.device)]
