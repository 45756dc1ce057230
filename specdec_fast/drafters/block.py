"""Block drafters: one draft forward per step gives the distributions of the next b tokens.

Two flavours behind `BlockDrafter`:

- feature-conditioned (DFlash-style, `specdec_fast.heads.block.DFlashHead`): the head's own KV
  cache holds one context entry per token the target verified (its fused target features), the
  same c entries as the target's cache. Each step feeds the block `[root, MASK x (b - 1)]` at
  positions c .. c + b - 1 above the cached context, bidirectional within the block, and reads
  the b - 1 distributions of depths 1 .. b - 1 (block entries are written past the committed
  length and never committed). After verification the accepted path's features (root and
  accepted nodes, positions c .. c + a) enter the context, written by the next step's forward
  before its block: one forward per step.
- standalone (PARD-style, `PardDraft`): a small causal LM on its own runner and cache, trained to
  fill b - 1 mask tokens after the context. Its cache holds the tokens up to the previous root;
  each step feeds, as one ragged chain, the tokens since then (the accepted drafts, whose cached
  K/V were computed over masks), the root and b - 1 masks, and reads the b distributions at the
  root (depth 1) and at the masks (depths 2 .. b); the fed tokens up to the root are committed.

Either way the per-position distributions become a proposal through `specdec_fast.trees`: the
DDTree-style best-first tree (`tree="ddtree"`, deterministic, so lossless through verification's
one-hot path when sampling too) or a chain (`tree="chain"`: the top-1 tokens when greedy, tokens
sampled from the draft distributions with their probabilities otherwise, lossless through
verification's draft-probability path). Nothing is read back from the device: what the drafter
needs on the host (lengths, pending tokens, accepted paths) comes with the state and outcome.

PARD layout (AMD-AGI/PARD; vLLM and TensorRT-LLM read the same): an HF causal LM checkpoint
whose `config.json` names the mask token as `pard_token` (or `ptd_token_id`), with
`spd_type: "pard"`; read here from safetensors only. The number of tokens per block is a
run-time choice there; `block_size` in the config, when present, is the one it was trained
for (default 8, PARD's published `para_num`).

Either layout may carry our own `ddtree_depth_scale` (top level of `config.json`): the
best-first tree's calibration fitted for that checkpoint (`specdec_fast.trees.best_first_tree`,
`specdec_fast.train.calibrate`); other readers ignore it, and without it the scale is 1 (the
plain product of marginals).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary
from transformers import PreTrainedModel

from specdec_fast.cache import SpecKVCache
from specdec_fast.compiled import CompiledSteps, compile_by_default
from specdec_fast.heads.block import (
    DEPTH_SCALE_FIELD,
    DFlashHead,
    is_dflash_config,
    load_dflash_head,
)
from specdec_fast.heads.checkpoint import (
    SAFETENSORS_INDEX,
    SAFETENSORS_NAME,
    read_config,
    resolve_folder,
)
from specdec_fast.kernels import pack_tree_mask
from specdec_fast.kernels.tree_attention import run_tree_attention
from specdec_fast.loading import quiet_transformers
from specdec_fast.runner import ModelRunner
from specdec_fast.transfer import to_device
from specdec_fast.trees import (
    best_first_tree,
    block_chain,
    check_depth_scale,
    sampled_block_chain,
)

from .base import Drafter, DraftState, Proposal, StepOutcome
from .draft_model import check_compatible, open_draft_runner, prefill_draft
from .features import gather_rows

TREE_MODES = ("ddtree", "chain")
PARD_TOKEN_FIELDS = ("pard_token", "ptd_token_id")
PARD_TYPE = "pard"
DEFAULT_PARD_BLOCK = 8
# Random stream of the sampled chains' draws (verify uses 0 and 1, draft models 2).
STREAM_BLOCK = 3
# The DFlash steps' compiled code by signature (a head's config, dtype and device): drafters
# built anew around heads of one shape (a benchmark's cells, a server's routes) share the graphs
# (the steps take the head's weights as inputs, unfrozen).
_DFLASH_STEPS: dict[tuple[str, ...], CompiledSteps] = {}
# Pending context entries per row a DFlash step takes at least (pads past a row's count): the
# compiler keeps width 1 apart from the rest, and a one- or two-token prompt would compile anew.
MIN_CONTEXT_WIDTH = 2


@dataclass
class PardDraft:
    """A PARD-style draft model: an HF causal LM with the target's vocabulary that fills
    `block_size - 1` masks (token `mask_token_id`) after its context in one forward;
    `depth_scale` is its best-first trees' calibration (1: none)."""

    model: PreTrainedModel
    mask_token_id: int
    block_size: int = DEFAULT_PARD_BLOCK
    depth_scale: float = 1.0

    def __post_init__(self):
        vocab = self.model.config.get_text_config(decoder=True).vocab_size
        if not 0 <= self.mask_token_id < vocab:
            raise ValueError(
                f"mask_token_id: expected a token id in [0, {vocab}), got {self.mask_token_id}"
            )
        if self.block_size < 2:
            raise ValueError(
                f"block_size must be >= 2 (the root and a mask), got {self.block_size}"
            )
        check_depth_scale(self.depth_scale)

    def save_pretrained(self, folder: str | os.PathLike) -> None:
        """Write the public layout: the model's HF folder (safetensors), after recording
        `pard_token`, `spd_type`, `block_size` and `ddtree_depth_scale` in the model's config."""
        config = self.model.config
        config.pard_token, config.spd_type, config.block_size = (
            self.mask_token_id,
            PARD_TYPE,
            self.block_size,
        )
        setattr(config, DEPTH_SCALE_FIELD, self.depth_scale)
        self.model.save_pretrained(folder, safe_serialization=True)


def load_pard(
    name_or_path: str | os.PathLike, target, dtype: torch.dtype | None = None
) -> PardDraft:
    """A PARD draft model from a folder in the public layout (or a bundled name), on the
    target's device, in `dtype` (None: the target's; unlike a DFlash head's step, the bundled
    PARD model runs no faster in bfloat16 beside a float32 target on the CPU); raises
    ValueError when the config names no mask token, the weights are not safetensors, or the
    model does not share the target's vocabulary."""
    from transformers import AutoModelForCausalLM

    folder = resolve_folder(name_or_path)
    fields = read_config(folder)
    what = f"PARD draft model at {folder}"
    mask_token_id = next((fields[f] for f in PARD_TOKEN_FIELDS if f in fields), None)
    if mask_token_id is None:
        raise ValueError(f"{what}: config.json has none of {', '.join(PARD_TOKEN_FIELDS)}")
    if not any((folder / name).is_file() for name in (SAFETENSORS_NAME, SAFETENSORS_INDEX)):
        raise ValueError(f"{what}: no {SAFETENSORS_NAME} nor {SAFETENSORS_INDEX}")
    with quiet_transformers():
        model = AutoModelForCausalLM.from_pretrained(
            folder,
            dtype=target.dtype if dtype is None else dtype,
            local_files_only=True,
            trust_remote_code=False,
            use_safetensors=True,
        )
    model = model.to(target.device).eval()
    try:
        check_compatible(model, target)
    except ValueError as error:
        raise ValueError(f"{what}: {error}") from None
    depth_scale = fields.get(DEPTH_SCALE_FIELD)
    try:
        return PardDraft(
            model,
            int(mask_token_id),
            int(fields.get("block_size", DEFAULT_PARD_BLOCK)),
            1.0 if depth_scale is None else depth_scale,
        )
    except ValueError as error:
        raise ValueError(f"{what}: config.json: {error}") from None


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


# Copies of target weights in a head's dtype, by the weight they copy: dtype -> (the weight's
# `_version` when copied, copy). Drafters over one target share them, across `generate` calls;
# an in-place change of the weight (a new `_version`) makes a new copy.
_CAST_COPIES: WeakIdKeyDictionary = WeakIdKeyDictionary()


def cast_copy(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`weight` (detached) in `dtype`: the weight itself when it has that dtype, else a copy
    made once per dtype and weight version (`_CAST_COPIES`)."""
    if weight.dtype == dtype:
        return weight.detach()
    copies = _CAST_COPIES.setdefault(weight, {})
    version, copy = copies.get(dtype, (None, None))
    if version != weight._version:
        copy = weight.detach().to(dtype)
        copies[dtype] = (weight._version, copy)
    return copy


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
        temperature: torch.Tensor | None = None,
        seed: torch.Tensor | None = None,
        root_positions: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """int64 `(tokens, parents)` `[B, n]` and the chain's draft probabilities `[B, n, V]`
        when sampled (else None) from fp32 block logits `[B, >= depth, V]` and the roots
        `[B]`; a sampled chain takes the rows' temperature `[B]`, seed `[B]` and the roots'
        positions `[B]` (`sampled_block_chain`), a greedy one none of them."""
        logits = logits[:, : self.depth]
        if self.tree == "ddtree":
            log_probs = torch.log_softmax(logits, dim=-1)
            return (*best_first_tree(log_probs, roots, self.max_nodes, self.depth_scale), None)
        if temperature is None:
            return (*block_chain(logits, roots, self.depth), None)
        return sampled_block_chain(
            logits, roots, self.depth, temperature, seed, root_positions, STREAM_BLOCK
        )


def _sampling(state: DraftState, shape: BlockShape) -> tuple[torch.Tensor, ...]:
    """What a sampled chain's draws take beyond the logits (`BlockShape.propose`): the rows'
    temperatures and seeds and their roots' positions (uploaded); nothing for a greedy chain
    or a tree."""
    if shape.tree == "ddtree" or state.greedy:
        return ()
    root_positions = to_device([len(row) - 1 for row in state.tokens], state.device)
    return state.temperature, state.seed, root_positions


@dataclass
class _Context:
    """Context entries not yet in the head's cache, picked on the device inside the step that
    takes them: per target layer the features `[B, M, H]` they come from, at columns `index`
    (int `[B, n]`; -1 picks column 0, a pad entry), of which row r's first `counts[r]` are real
    (the rest pads a ragged batch); `last` is `counts - 1` on the device (int32 `[B]`). A step's
    accepted path is such a pick of its verified nodes (no op outside the step)."""

    features: list[torch.Tensor]
    index: torch.Tensor
    last: torch.Tensor
    counts: list[int]

    @classmethod
    def whole(cls, features: list[torch.Tensor], counts: list[int]) -> _Context:
        """Every column of `features`, padded to `MIN_CONTEXT_WIDTH` columns if narrower."""
        pad = MIN_CONTEXT_WIDTH - features[0].shape[1]
        if pad > 0:
            features = [
                torch.cat([f, f.new_zeros(f.shape[0], pad, f.shape[2])], 1) for f in features
            ]
        batch, width, device = features[0].shape[0], features[0].shape[1], features[0].device
        index = torch.arange(width, device=device).expand(batch, -1)
        last = to_device([count - 1 for count in counts], device, torch.int32)
        return cls(features, index, last, counts)

    @property
    def width(self) -> int:
        return self.index.shape[1]

    def rows(self, rows: list[int]) -> _Context:
        index = to_device(rows, self.index.device)
        features = [f[index] for f in self.features]
        return _Context(
            features, self.index[index], self.last[index], [self.counts[r] for r in rows]
        )

    def extended(self, count: int) -> _Context:
        """This context with `count` rows of pad entries after its rows."""
        features = [torch.cat([f, f.new_zeros(count, *f.shape[1:])]) for f in self.features]
        index = torch.cat([self.index, self.index.new_zeros(count, self.width)])
        last = torch.cat([self.last, self.last.new_full((count,), -1)])
        return _Context(features, index, last, self.counts + [0] * count)


def _picked(last: torch.Tensor, index: torch.Tensor, features) -> tuple[torch.Tensor, list]:
    """A `_Context`'s counts (int32 `[B]`) and entries (`[B, n, H]` per layer), on the device."""
    index = index.long().clamp(min=0)
    return last + 1, [gather_rows(f, index) for f in features]


class _FeatureBlock:
    """The DFlash flavour: the head's context cache and one forward per step.

    The context entries of the tokens a step verified are written by the next step's forward,
    before its block, as the reference's draft forward takes the new target features with the
    noise block: a step costs one forward (`_block_step`), not two. Newcomers to a running batch
    (`join`) write theirs at once (`_context_step`), so that the batch's pending entries are not
    padded to the newcomers' prompts, and so do a step's entries when the next one drafts no
    block (an `update` without a `propose` in between).

    Both run through `torch.compile` when runners compile (`SPECDEC_COMPILE`, default on), each
    on its own code per head shape (`_DFLASH_STEPS`): batch size, cache capacity and context
    width are dynamic, so a handful of graphs serve every call of every drafter over heads of
    that shape."""

    def __init__(self, head: DFlashHead):
        self.head = head
        self.positions = head.block_size - 1
        self.shape: BlockShape | None = None  # set by the drafter
        self.hidden_layers = head.hidden_layers
        self._cache: SpecKVCache | None = None
        self._lengths: list[int] = []  # committed context entries per row (host mirror)
        self._pending: _Context | None = None

    def attach(self, target, max_cache_len: int, depth: int) -> None:
        self.head.check_target(target)
        # The head computes in its own dtype (`load_dflash_head`), the target's embeddings and
        # features are cast to it, and its outputs meet the target's LM head in that dtype: a
        # copy of the LM head when the target's dtype differs (one per weight and dtype, shared
        # by every drafter over the target, `cast_copy`; 2 bytes a weight for bfloat16).
        self.head.to(device=target.device).eval()
        dtype = self.head.fc.weight.dtype
        self._embed = target.get_input_embeddings()
        lm_head = target.get_output_embeddings()
        self._lm_weight, self._lm_bias = (
            None if param is None else cast_copy(param, dtype)
            for param in (lm_head.weight, lm_head.bias)
        )
        # Room for the context, a block past it and the pad entries a step writes past the block.
        self._capacity = max_cache_len + self.head.block_size + depth + 1
        self._depth = depth
        self._compile = compile_by_default()
        head = self.head
        self._signature = (
            head.config.to_json_string(),
            str(head.fc.weight.dtype),
            str(target.device),
        )

    def _run(self, kind: str, step, *args):
        """`step(*args)` (a bound method), through its compiled version when compiling, shared
        by every drafter over heads of this shape (`_DFLASH_STEPS`)."""
        if not self._compile:
            return step(*args)
        steps = _DFLASH_STEPS.setdefault(self._signature, CompiledSteps("dflash", True))
        label = f"{kind} B={args[0].shape[0]}"
        return steps.run(kind, label, step.__func__, step.__self__, *args)

    def _prompt_context(self, state: DraftState) -> _Context:
        """The context entries of every row's cached prompt tokens (all but its root)."""
        counts = [len(row) - 1 for row in state.tokens]
        return _Context.whole([state.hidden[layer] for layer in self.hidden_layers], counts)

    def begin(self, state: DraftState) -> None:
        head, device = self.head, state.device
        self._cache = SpecKVCache(
            head.config,
            state.batch_size,
            self._capacity,
            dtype=head.fc.weight.dtype,
            device=device,
        )
        self._lengths = [0] * state.batch_size
        self._pending = self._prompt_context(state)

    def _context_slots(self, counts: torch.Tensor, width: int) -> torch.Tensor:
        """int64 `[B, width]`: where the context entries go, `cache_lens + i`, except that a
        row's pad entries (i >= its count) go past the block, which never reads them."""
        offsets = torch.arange(width, device=counts.device)
        slots = self._cache.cache_lens[:, None].long() + offsets
        return torch.where(offsets < counts[:, None], slots, slots + self.head.block_size)

    def _context_step(self, last: torch.Tensor, index: torch.Tensor, *features) -> None:
        """Write and commit the entries of a `_Context` (`last`, `index`, `features`) past the
        committed ones."""
        head, cache = self.head, self._cache
        counts, features = _picked(last, index, features)
        slots = self._context_slots(counts, index.shape[1])
        cache.write_slots = slots
        for layer, (keys, values) in zip(
            cache.layers, head.context(head.fuse(features), slots), strict=True
        ):
            layer.update(keys, values)
        cache.cache_lens.add_(counts)

    def _take(self, context: _Context, kind: str, step, *args):
        """`step(*args, last, index, *features)` of `context` (compiled as `kind`), which writes
        and commits its entries."""
        cache = self._cache
        cache.bound_lengths(max(self._lengths))
        cache.ensure_room(context.width + self.head.block_size)
        out = self._run(kind, step, *args, context.last, context.index, *context.features)
        self._lengths = [
            length + count for length, count in zip(self._lengths, context.counts, strict=True)
        ]
        return out

    def propose(self, state: DraftState) -> tuple[torch.Tensor, ...]:
        """The proposal's `(tokens, parents, draft_probs)` (`BlockShape.propose`) from one
        forward of the block, the tree built in the same compiled step."""
        pending, batch = self._pending, state.batch_size
        if pending is None:  # nothing verified since the last block: pad entries only
            none = self.head.fc.weight.new_zeros(batch, 0, self.head.config.hidden_size)
            pending = _Context.whole([none] * len(self.hidden_layers), [0] * batch)
        slots = None
        if state.device.type == "cpu":
            # The slots the block's attention reads there: the committed entries, the pending ones
            # and the block (a row's pad entries land past its block, which never reads them).
            span = max(
                length + count for length, count in zip(self._lengths, pending.counts, strict=True)
            )
            slots = torch.arange(span + self.head.block_size, device=state.device)
        sampling = _sampling(state, self.shape)
        kind = f"block {self.shape.kind(bool(sampling))}"
        proposal = self._take(pending, kind, self._proposal_step, state.roots, slots, *sampling)
        self._pending = None
        return proposal

    def _proposal_step(
        self, roots: torch.Tensor, slots: torch.Tensor | None, *args: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        """`_block_step`'s logits made a proposal (`BlockShape.propose`); `args` are a sampled
        chain's `(temperature, seed, root_positions)` if any, then `_block_step`'s context."""
        taken = 2 + len(self.hidden_layers)  # `_take` appends its context's tensors
        sampling, (last, index, *features) = args[:-taken], args[-taken:]
        logits = self._block_step(roots, slots, last, index, *features)
        return self.shape.propose(logits, roots, *sampling)

    def _block_step(
        self,
        roots: torch.Tensor,
        slots: torch.Tensor | None,
        last: torch.Tensor,
        index: torch.Tensor,
        *features: torch.Tensor,
    ) -> torch.Tensor:
        """fp32 logits `[B, b - 1, V]` of the block `[root, MASK x (b - 1)]`, bidirectional
        within the block, above the committed context and the pending entries of a `_Context`
        (`last`, `index`, `features`: written first, then committed); the block is written past
        them and never committed. On the CPU, `slots` (`arange` of the longest row's entries and
        block) bounds what the attention reads, SDPA under a length mask there: the block's
        visibility needs no tree, and the custom op's planning cost more than the attention.
        Elsewhere it is None and the tree-attention kernel reads each row's own span."""
        head, cache = self.head, self._cache
        size, batch = head.block_size, roots.shape[0]
        counts, features = _picked(last, index, features)
        context_slots = self._context_slots(counts, index.shape[1])
        context = head.context(head.fuse(features), context_slots)
        committed = cache.cache_lens + counts
        positions = committed[:, None].long() + torch.arange(size, device=roots.device)
        cache.write_slots = torch.cat([context_slots, positions], dim=1)
        masks = roots.new_full((batch, size - 1), head.mask_token_id)
        tokens = torch.cat([roots[:, None], masks], dim=1).long()
        # Bidirectional within the block; the committed context is always visible.
        if slots is not None:
            span = slots.shape[0]
            visible = (slots < (committed + size)[:, None])[:, None, None]

            def attend(layer: int, queries, keys, values) -> torch.Tensor:
                key_cache, value_cache = self._write_layer(context, layer, keys, values)
                return F.scaled_dot_product_attention(
                    queries,
                    key_cache[:, :, :span],
                    value_cache[:, :, :span],
                    attn_mask=visible,
                    enable_gqa=True,
                )

        else:
            full = torch.ones(batch, size, size, dtype=torch.bool, device=roots.device)
            mask = pack_tree_mask(full)

            def attend(layer: int, queries, keys, values) -> torch.Tensor:
                key_cache, value_cache = self._write_layer(context, layer, keys, values)
                scale = queries.shape[-1] ** -0.5
                args = (queries, key_cache, value_cache, committed, mask, None, scale)
                if torch.compiler.is_compiling():
                    return torch.ops.specdec_fast.tree_attention(*args, None, None, None)
                return run_tree_attention(*args, None, None, None)

        embeds = self._embed(tokens).to(head.fc.weight.dtype)
        outputs = head(embeds, positions, attend)
        cache.cache_lens.add_(counts)
        return F.linear(outputs[:, 1:], self._lm_weight, self._lm_bias).float()

    def _write_layer(self, context, layer: int, keys, values):
        """Write a layer's pending context entries and block into the cache; its whole keys and
        values."""
        context_keys, context_values = context[layer]
        return self._cache.layers[layer].update(
            torch.cat([context_keys, keys], dim=2), torch.cat([context_values, values], dim=2)
        )

    def update(self, state: DraftState, outcome: StepOutcome) -> None:
        if self._pending is not None:  # a step without a block (not the engine's order)
            self._take(self._pending, "context", self._context_step)
        self._pending = _Context(
            [outcome.hidden[layer] for layer in self.hidden_layers],
            outcome.accepted_nodes[:, : self._depth + 1],
            outcome.num_accepted,
            [len(path) + 1 for path in outcome.accepted_paths],
        )

    def keep(self, rows: list[int]) -> None:
        self._cache.select(rows)
        self._lengths = [self._lengths[r] for r in rows]
        if self._pending is not None:
            self._pending = self._pending.rows(rows)

    def join(self, state: DraftState) -> None:
        """The newcomers' context entries go to the storage rows past the batch, through a view
        of them (grown first if they do not fit), which the batch then admits; their pending
        entries are pads, so the batch's pending ones stay as they are."""
        cache, batch, count = self._cache, self._cache.kv.shape[2], state.batch_size
        if batch + count > cache.capacity:
            cache = cache.with_capacity(max(batch + count, 2 * batch))
        lengths = self._lengths
        self._cache, self._lengths = cache.rows(batch, count), [0] * count
        try:
            # A view's rows keep their last occupants' lengths: start them empty.
            zeros = torch.zeros(count, dtype=torch.int32, device=state.device)
            self._cache.commit_lengths(zeros, 0)
            prompt = self._prompt_context(state)
            if max(prompt.counts) > 0:
                self._take(prompt, "context", self._context_step)
            joined = self._lengths
        finally:
            self._cache = cache
            self._lengths = lengths
        cache.admit(batch, count, max(joined))
        self._lengths = lengths + joined
        if self._pending is not None:
            self._pending = self._pending.extended(count)

    def end(self) -> None:
        self._cache = None
        self._pending = None


class _StandaloneBlock:
    """The PARD flavour: a causal LM on its own runner, one chain forward per step."""

    hidden_layers: tuple[int, ...] = ()

    def __init__(self, draft: PardDraft):
        self.draft = draft
        self.positions = draft.block_size
        self.shape: BlockShape | None = None  # set by the drafter
        self.runner: ModelRunner | None = None
        self._cached: list[int] = []  # tokens in the draft's cache per row (host mirror)

    def attach(self, target, max_cache_len: int, depth: int) -> None:
        self.end()
        # A step feeds the accepted drafts (<= depth), the root and the masks past the cache.
        self.runner = open_draft_runner(
            self.draft.model, target, max_cache_len + depth + self.draft.block_size
        )
        self._compile = compile_by_default()

    def begin(self, state: DraftState) -> None:
        self._cached = prefill_draft(self.runner, state)

    def propose(self, state: DraftState) -> tuple[torch.Tensor, ...]:
        """The proposal's `(tokens, parents, draft_probs)` (`BlockShape.propose`): one forward
        of the draft's runner, then the tree from the block's logits in a compiled step of its
        own."""
        size, device = self.draft.block_size, state.device
        # Per row: the tokens after the cache up to the root, then the masks (host data).
        fed = [row[cached:] for row, cached in zip(state.tokens, self._cached, strict=True)]
        width = max(len(chunk) for chunk in fed) + size - 1
        tokens = np.full((state.batch_size, width), self.draft.mask_token_id, dtype=np.int64)
        for row, chunk in enumerate(fed):
            tokens[row, : len(chunk)] = chunk
        parents = np.tile(np.arange(-1, width - 1), (state.batch_size, 1))
        roots = [len(chunk) - 1 for chunk in fed]
        q_lens = [root + size for root in roots]
        logits = self.runner.verify(
            to_device(tokens, device),
            to_device(parents, device),
            to_device(q_lens, device, torch.int32),
        ).logits
        sampling = _sampling(state, self.shape)
        args = (logits, to_device(roots, device), state.roots, *sampling)
        if self._compile:
            # The tree step of the draft model's runner, compiled with its own steps.
            kind = f"pard {self.shape.kind(bool(sampling))} b={size}"
            label = f"{kind} B={args[0].shape[0]}"
            proposal = self.runner.steps.run(kind, label, _StandaloneBlock._tree, self, *args)
        else:
            proposal = self._tree(*args)
        # The root is committed with the tokens before it; the masks' K/V are dropped.
        lengths = [len(row) for row in state.tokens]
        self.runner.cache.commit_lengths(to_device(lengths, device, torch.int32), max(lengths))
        self._cached = lengths
        return proposal

    def _tree(
        self, logits: torch.Tensor, starts: torch.Tensor, roots: torch.Tensor, *sampling
    ) -> tuple[torch.Tensor, ...]:
        """`BlockShape.propose` of the block of each row: fp32 `logits` `[B, W, V]` at rows
        `starts[b]` (int64 `[B]`, the root's node) to `starts[b] + b - 1`."""
        index = starts[:, None] + torch.arange(self.draft.block_size, device=logits.device)
        block = logits.gather(1, index[..., None].expand(-1, -1, logits.shape[-1]))
        return self.shape.propose(block, roots, *sampling)

    def update(self, state: DraftState, outcome: StepOutcome) -> None:
        """Nothing to follow: the next step feeds the accepted drafts."""

    def keep(self, rows: list[int]) -> None:
        self.runner.keep(rows)
        self._cached = [self._cached[r] for r in rows]

    def join(self, state: DraftState) -> None:
        self.runner.prefill_rows(state.tokens)
        self._cached += [len(row) - 1 for row in state.tokens]

    def end(self) -> None:
        if self.runner is not None:
            self.runner.close()
            self.runner = None


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

    def __init__(
        self,
        model: DFlashHead | PardDraft,
        max_nodes: int = 16,
        tree: str = "ddtree",
        depth_scale: float | None = None,
    ):
        if isinstance(model, DFlashHead):
            self.flavour: _FeatureBlock | _StandaloneBlock = _FeatureBlock(model)
        elif isinstance(model, PardDraft):
            self.flavour = _StandaloneBlock(model)
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
        return "dflash" if isinstance(self.flavour, _FeatureBlock) else "pard"

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
