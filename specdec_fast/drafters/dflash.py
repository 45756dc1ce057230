"""The DFlash flavour of `BlockDrafter` (`specdec_fast.drafters.block`): a feature-conditioned
block head (`specdec_fast.heads.block.DFlashHead`) over its own KV cache.

The head's cache holds one context entry per token the target verified (its fused target
features), the same c entries as the target's cache. Each step feeds the block
`[root, MASK x (b - 1)]` at positions c .. c + b - 1 above the cached context, bidirectional
within the block, and reads the b - 1 distributions of depths 1 .. b - 1 (block entries are
written past the committed length and never committed). After verification the accepted path's
features (root and accepted nodes, positions c .. c + a) enter the context, written by the next
step's forward before its block: one forward per step.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils.weak import WeakIdKeyDictionary

from specdec_fast import graphs
from specdec_fast.cache import SpecKVCache
from specdec_fast.compiled import CompiledSteps, compile_by_default, record_compile
from specdec_fast.heads.block import DFlashHead
from specdec_fast.kernels import pack_tree_mask
from specdec_fast.kernels.tree_attention import run_tree_attention
from specdec_fast.onednn import follow_target
from specdec_fast.transfer import to_device

from .base import DraftState, StepOutcome
from .block_shape import BlockShape, block_sampling, in_target_vocab
from .features import gather_rows

# The DFlash steps' compiled code by signature (a head's config, dtype and device): drafters
# built anew around heads of one shape (a benchmark's cells, a server's routes) share the graphs
# (the steps take the head's weights as inputs, unfrozen).
_DFLASH_STEPS: dict[tuple[str, ...], CompiledSteps] = {}
# Pending context entries per row a DFlash step takes at least (pads past a row's count): the
# compiler keeps width 1 apart from the rest, and a one- or two-token prompt would compile anew.
MIN_CONTEXT_WIDTH = 2


# Copies of target weights in a head's dtype, by the weight they copy: dtype -> (the weight's
# `_version` when copied, copy). Drafters over one target share them, across `generate` calls;
# an in-place change of the weight (a new `_version`) makes a new copy.
_CAST_COPIES: WeakIdKeyDictionary = WeakIdKeyDictionary()


def cast_copy(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`weight` (detached) in `dtype`: the weight itself when it has that dtype, else a copy
    made once per dtype and weight version (`_CAST_COPIES`). A weight sharded over ranks (a
    `DTensor` of a tensor-parallel target, `specdec_fast.parallel`) is gathered whole into the
    copy (a collective, on every rank alike): the drafter runs replicated."""
    sharded = isinstance(weight, DTensor)
    if weight.dtype == dtype and not sharded:
        return weight.detach()
    copies = _CAST_COPIES.setdefault(weight, {})
    version, copy = copies.get(dtype, (None, None))
    if version != weight._version:
        copy = (weight.detach().full_tensor() if sharded else weight.detach()).to(dtype)
        copies[dtype] = (weight._version, copy)
    return copy


# A head's draft vocabulary on the device, with its rows of the target's LM head in the head's
# dtype, by head: (what they were made from, ids, weight rows, bias rows or None). Drafters over
# one head and target share them, so a step captured for them reads the same tensors.
_DRAFT_ROWS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def draft_rows(head: DFlashHead, lm_head, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """(the head's draft ids, the LM head's weight rows for them, its bias's or None) on the
    head's device, in `dtype` (detached; a sharded weight gathered whole, as `cast_copy`);
    made once per head, vocabulary, weights and their versions."""
    params = [p for p in (lm_head.weight, lm_head.bias) if p is not None]
    known = _DRAFT_ROWS.get(head)
    if known is not None:
        (d2t, refs, versions, made_dtype), made = known
        if (
            d2t is head.d2t
            and made_dtype == dtype
            and len(refs) == len(params)
            and all(ref() is param for ref, param in zip(refs, params, strict=True))
            and versions == [p._version for p in (head.d2t, *params)]
        ):
            return made
    ids = head.draft_ids

    def rows(param):
        if param is None:
            return None
        whole = param.detach().full_tensor() if isinstance(param, DTensor) else param.detach()
        return whole[ids.to(whole.device)].to(device=ids.device, dtype=dtype)

    made = (ids, rows(lm_head.weight), rows(lm_head.bias))
    # The weights by weak reference: the cache keeps no target alive.
    versions = [p._version for p in (head.d2t, *params)]
    _DRAFT_ROWS[head] = ((head.d2t, [weakref.ref(p) for p in params], versions, dtype), made)
    return made


@dataclass
class _Context:
    """Context entries not yet in the head's cache, picked on the device inside the step that
    takes them: per target layer the features `[B, M, H]` they come from, at columns `index`
    (int32 `[B, n]`; -1 picks column 0, a pad entry), of which row r's first `last[r] + 1` are
    real (the rest pads a ragged batch; `last` int32 `[B]` on the device). A step's accepted
    path is such a pick of its verified nodes (no op outside the step, no host value)."""

    features: list[torch.Tensor]
    index: torch.Tensor
    last: torch.Tensor

    @classmethod
    def whole(cls, features: list[torch.Tensor], counts: list[int]) -> _Context:
        """Every column of `features`, padded to `MIN_CONTEXT_WIDTH` columns if narrower, of
        which row r's first `counts[r]` are real."""
        pad = MIN_CONTEXT_WIDTH - features[0].shape[1]
        if pad > 0:
            features = [
                torch.cat([f, f.new_zeros(f.shape[0], pad, f.shape[2])], 1) for f in features
            ]
        batch, width, device = features[0].shape[0], features[0].shape[1], features[0].device
        # int32, as a step's accepted nodes are: a graph guards on its inputs' dtypes.
        index = torch.arange(width, dtype=torch.int32, device=device).expand(batch, -1)
        last = to_device([count - 1 for count in counts], device, torch.int32)
        return cls(features, index, last)

    @property
    def width(self) -> int:
        return self.index.shape[1]

    def rows(self, rows: list[int]) -> _Context:
        index = to_device(rows, self.index.device)
        features = [f[index] for f in self.features]
        return _Context(features, self.index[index], self.last[index])

    def extended(self, count: int) -> _Context:
        """This context with `count` rows of pad entries after its rows."""
        features = [torch.cat([f, f.new_zeros(count, *f.shape[1:])]) for f in self.features]
        index = torch.cat([self.index, self.index.new_zeros(count, self.width)])
        last = torch.cat([self.last, self.last.new_full((count,), -1)])
        return _Context(features, index, last)


def _picked(last: torch.Tensor, index: torch.Tensor, features) -> tuple[torch.Tensor, list]:
    """A `_Context`'s counts (int32 `[B]`) and entries (`[B, n, H]` per layer), on the device."""
    index = index.long().clamp(min=0)
    return last + 1, [gather_rows(f, index) for f in features]


class DFlashBlock:
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
        self._resident: graphs.Resident | None = None
        self._pending: _Context | None = None

    def attach(self, target, max_cache_len: int, depth: int) -> None:
        self.head.check_target(target)
        # The head computes in its own dtype (`load_dflash_head`), the target's embeddings and
        # features are cast to it, and its outputs meet the target's LM head in that dtype: a
        # copy of the LM head when the target's dtype differs (one per weight and dtype, shared
        # by every drafter over the target, `cast_copy`; 2 bytes a weight for bfloat16), or
        # of its draft vocabulary's rows (`draft_rows`) when the head has one.
        self.head.to(device=target.device).eval()
        follow_target(self.head, target)
        dtype = self.head.fc.weight.dtype
        self._embed = target.get_input_embeddings()
        lm_head = target.get_output_embeddings()
        self._vocab_size = lm_head.weight.shape[0]
        if self.head.draft_ids is None:
            self._vocab = None
            self._lm_weight, self._lm_bias = (
                None if param is None else cast_copy(param, dtype)
                for param in (lm_head.weight, lm_head.bias)
            )
        else:
            self._vocab, self._lm_weight, self._lm_bias = draft_rows(self.head, lm_head, dtype)
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
        # The head's cache and captured steps, kept on the head for the envelope: everything
        # the steps read besides their arguments is in the key, or is that cache.
        targets = (
            self._embed.weight.data_ptr(),
            self._lm_weight.data_ptr(),
            None if self._vocab is None else self._vocab.data_ptr(),
        )
        envelope = (self._signature, self._capacity, depth, self.shape, self._compile, targets)
        self._resident = graphs.resident(
            head, envelope, "dflash", graphs.chosen(), record_compile, self._resident
        )

    def _run(self, kind: str, step, *args, captured: bool = True):
        """`step(*args)` (a bound method), through its compiled version when compiling, shared
        by every drafter over heads of this shape (`_DFLASH_STEPS`); replayed as a CUDA graph
        when the call captures graphs and `captured` (`StepGraphs`, bound to the head's cache;
        both kept on the head, `graphs.resident`). A step over a view of the cache's rows (a
        join's) runs as it is."""
        label = f"{kind} B={args[0].shape[0]}"
        if not captured:
            return self._compiled(kind, label, step, *args)
        steps = self._resident.graphs
        steps.bind(self._cache)
        return steps.run(kind, label, self._compiled, kind, label, step, *args)

    def _compiled(self, kind: str, label: str, step, *args):
        if not self._compile:
            return step(*args)
        steps = _DFLASH_STEPS.setdefault(self._signature, CompiledSteps("dflash", True))
        return steps.run(kind, label, step.__func__, step.__self__, *args)

    def _prompt_context(self, state: DraftState) -> _Context:
        """The context entries of every row's cached prompt tokens (all but its root)."""
        counts = [len(row) - 1 for row in state.tokens]
        return _Context.whole([state.hidden[layer] for layer in self.hidden_layers], counts)

    def begin(self, state: DraftState) -> None:
        self._cache = self._resident.cache(
            self.head.config,
            state.batch_size,
            self._capacity,
            self.head.fc.weight.dtype,
            state.device,
        )
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

    def _take(self, context: _Context, bound: int, kind: str, step, *args, captured: bool = True):
        """`step(*args, last, index, *features)` of `context` (compiled as `kind`), which writes
        and commits its entries above committed ones that number at most `bound` per row."""
        cache = self._cache
        cache.bound_lengths(bound)
        cache.ensure_room(context.width + self.head.block_size)
        tensors = (context.last, context.index, *context.features)
        return self._run(kind, step, *args, *tensors, captured=captured)

    def propose(self, state: DraftState) -> tuple[torch.Tensor, ...]:
        """The proposal's `(tokens, parents, draft_probs)` (`BlockShape.propose`) from one
        forward of the block, the tree built in the same compiled step."""
        pending, batch = self._pending, state.batch_size
        if pending is None:  # nothing verified since the last block: pad entries only
            none = self.head.fc.weight.new_zeros(batch, 0, self.head.config.hidden_size)
            pending = _Context.whole([none] * len(self.hidden_layers), [0] * batch)
        # The committed entries and the pending ones: one per cached token (all but the root).
        entries = state.longest - 1
        slots = None
        if state.device.type == "cpu" and not self._resident.graphs.on:
            # The slots the block's attention reads there: the entries and the block (a row's
            # pad entries land past its block, which never reads them). Not for a captured
            # step, whose shapes stay fixed (CUDA's; the CPU's in tests).
            slots = torch.arange(entries + self.head.block_size, device=state.device)
        sampling = block_sampling(state, self.shape)
        kind = f"block {self.shape.kind(bool(sampling))}"
        args = (state.roots, slots, *sampling)
        proposal = self._take(pending, entries, kind, self._proposal_step, *args)
        self._pending = None
        return proposal

    def _proposal_step(
        self, roots: torch.Tensor, slots: torch.Tensor | None, *args: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        """`_block_step`'s logits made a proposal (`BlockShape.propose`), in target ids when the
        head drafts from a vocabulary of its own (`in_target_vocab`); `args` are a sampled
        chain's `(temperature, seed)` if any, then `_block_step`'s context. The roots' positions
        are the cache's lengths after the step: an entry per token before the root."""
        taken = 2 + len(self.hidden_layers)  # `_take` appends its context's tensors
        sampling, (last, index, *features) = args[:-taken], args[-taken:]
        logits = self._block_step(roots, slots, last, index, *features)
        proposal = self.shape.propose(logits, roots, self._cache.cache_lens, *sampling)
        if self._vocab is None:
            return proposal
        return in_target_vocab(proposal, self._vocab, self._vocab_size)

    def _block_step(
        self,
        roots: torch.Tensor,
        slots: torch.Tensor | None,
        last: torch.Tensor,
        index: torch.Tensor,
        *features: torch.Tensor,
    ) -> torch.Tensor:
        """fp32 logits `[B, b - 1, V]` (V: the draft vocabulary's size where the head has one) of
        the block `[root, MASK x (b - 1)]`, bidirectional within the block, above the committed
        context and the pending entries of a `_Context` (`last`, `index`, `features`: written
        first, then committed); the block is written past them and never committed. On the CPU,
        `slots` (`arange` of the longest row's entries and block) bounds what the attention
        reads, SDPA under a length mask there: the block's visibility needs no tree, and the
        custom op's planning cost more than the attention. Elsewhere it is None and the
        tree-attention kernel reads each row's own span."""
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
        # The LM head as one 2-D product: a slice of the 3-D outputs took `matmul`'s batched
        # path on the CPU, which copied the whole LM head transposed at every step (a 135M
        # target's 49152 x 576 bfloat16 head: 90 ms a step at batch 1 on one thread, against
        # 11 ms).
        drafted = outputs[:, 1:].reshape(batch * (size - 1), outputs.shape[-1])
        logits = F.linear(drafted, self._lm_weight, self._lm_bias)
        return logits.view(batch, size - 1, -1).float()

    def _write_layer(self, context, layer: int, keys, values):
        """Write a layer's pending context entries and block into the cache; its whole keys and
        values."""
        context_keys, context_values = context[layer]
        return self._cache.layers[layer].update(
            torch.cat([context_keys, keys], dim=2), torch.cat([context_values, values], dim=2)
        )

    def update(self, state: DraftState, outcome: StepOutcome) -> None:
        if self._pending is not None:  # a step without a block (not the engine's order)
            self._take(self._pending, state.longest - 1, "context", self._context_step)
        self._pending = _Context(
            [outcome.hidden[layer] for layer in self.hidden_layers],
            outcome.accepted_nodes[:, : self._depth + 1],
            outcome.num_accepted,
        )

    def keep(self, rows: list[int]) -> None:
        self._cache.select(rows)
        if self._pending is not None:
            self._pending = self._pending.rows(rows)

    def join(self, state: DraftState) -> None:
        """The newcomers' context entries go to the storage rows past the batch, through a view
        of them (grown first if they do not fit), which the batch then admits; their pending
        entries are pads, so the batch's pending ones stay as they are."""
        cache, batch, count = self._cache, self._cache.kv.shape[2], state.batch_size
        if batch + count > cache.capacity:
            cache = cache.with_capacity(max(batch + count, 2 * batch))
            self._resident.state = cache
        self._cache = cache.rows(batch, count)
        try:
            # A view's rows keep their last occupants' lengths: start them empty.
            zeros = torch.zeros(count, dtype=torch.int32, device=state.device)
            self._cache.commit_lengths(zeros, 0)
            if state.longest > 1:
                prompt = self._prompt_context(state)
                self._take(prompt, 0, "context", self._context_step, captured=False)
        finally:
            self._cache = cache
        cache.admit(batch, count, state.longest - 1)
        if self._pending is not None:
            self._pending = self._pending.extended(count)

    def end(self) -> None:
        self._cache = None
        self._pending = None
        if self._resident is not None:
            self._resident.release()
            self._resident = None
