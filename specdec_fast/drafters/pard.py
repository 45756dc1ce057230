"""The PARD flavour of `BlockDrafter` (`specdec_fast.drafters.block`): a standalone draft model
trained to fill b - 1 mask tokens after its context, on its own runner and cache.

Its cache holds the tokens up to the previous root; each step feeds, as one ragged chain, the
tokens since then (the accepted drafts, whose cached K/V were computed over masks), the root and
b - 1 masks, and reads the b distributions at the root (depth 1) and at the masks (depths
2 .. b); the fed tokens up to the root are committed.

Layout (AMD-AGI/PARD; vLLM and TensorRT-LLM read the same): an HF causal LM checkpoint whose
`config.json` names the mask token as `pard_token` (or `ptd_token_id`), with `spd_type: "pard"`;
read here from safetensors only. The number of tokens per block is a run-time choice there;
`block_size` in the config, when present, is the one it was trained for (default 8, PARD's
published `para_num`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from specdec_fast.heads.block import DEPTH_SCALE_FIELD
from specdec_fast.heads.checkpoint import (
    SAFETENSORS_INDEX,
    SAFETENSORS_NAME,
    read_config,
    resolve_folder,
)
from specdec_fast.loading import quiet_transformers
from specdec_fast.runner import ModelRunner
from specdec_fast.trees import check_depth_scale

from .base import DraftState, StepOutcome, joined_rows, kept_rows
from .block_shape import BlockShape, block_sampling
from .draft_model import DraftRunnerRows, check_compatible

PARD_TOKEN_FIELDS = ("pard_token", "ptd_token_id")
PARD_TYPE = "pard"
DEFAULT_PARD_BLOCK = 8


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


class PardBlock(DraftRunnerRows):
    """The PARD flavour: a causal LM on its own runner, one chain forward per step.

    What a step feeds is made on the device, in a step of the runner's own (`_feed`): the drafts
    the last step accepted, picked from its verified tree (`update` keeps the outcome's tensors),
    the root and the masks. Only the feed's width comes from the host: the longest accepted
    path, read with the step, or the widest when the step was not read yet (read-ahead,
    `DraftState.unread`) or steps are captured."""

    hidden_layers: tuple[int, ...] = ()

    def __init__(self, draft: PardDraft):
        self.draft = draft
        self.positions = draft.block_size
        self.shape: BlockShape | None = None  # set by the drafter
        self.runner: ModelRunner | None = None
        self._depth = 0  # the deepest accepted path, set at attach
        self._widest = 0  # the widest step's tokens, set at attach
        # The last verified trees' tokens int64 `[B, N]`, accepted nodes int32 `[B, N]` and
        # accepted counts int32 `[B]` (`StepOutcome`'s, on the device); the longest accepted
        # path when the host knows it (None: the step was not read yet).
        self._source: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._longest: int | None = 0

    def attach(self, target, max_cache_len: int, depth: int) -> None:
        # A step feeds the accepted drafts (<= depth), the root and the masks past the cache.
        self._depth = depth
        self._widest = depth + self.draft.block_size
        self.open_runner(self.draft.model, target, max_cache_len + self._widest)

    def begin(self, state: DraftState) -> None:
        super().begin(state)
        self._source, self._longest = self._no_drafts(state, self._depth + 1), 0

    def _no_drafts(self, state: DraftState, width: int) -> tuple[torch.Tensor, ...]:
        """A source of `width` nodes that accepted no draft, for each row of `state`: a new
        row feeds its root alone."""
        batch, device = state.batch_size, state.device
        tokens = torch.zeros((batch, width), dtype=torch.int64, device=device)
        nodes = torch.full((batch, width), -1, dtype=torch.int32, device=device)
        return tokens, nodes, torch.zeros(batch, dtype=torch.int32, device=device)

    def keep(self, rows: list[int]) -> None:
        super().keep(rows)
        self._source = kept_rows(self._source, rows)

    def join(self, state: DraftState) -> None:
        super().join(state)
        newcomers = self._no_drafts(state, self._source[0].shape[1])
        self._source = joined_rows(self._source, newcomers)

    def end(self) -> None:
        super().end()
        self._source = None

    def propose(self, state: DraftState) -> tuple[torch.Tensor, ...]:
        """The proposal's `(tokens, parents, draft_probs)` (`BlockShape.propose`): one forward
        of the draft's runner between two compiled steps of its own, the feed and the tree."""
        size, batch = self.draft.block_size, state.batch_size
        # Under CUDA graphs every step is fed at the widest (one feed, verify and tree graph per
        # batch size, not one per accepted count), and so is a step whose predecessor was not
        # read; rows are padded past their `q_lens`.
        width = self._widest if self._longest is None else self._longest + size
        width = self.runner.verify_width(batch, width, self._widest)
        columns = torch.empty((0, width), device=state.device)  # the feed's width, as a shape
        # Everything the feed reads besides its arguments is in its key (the runner's graphs
        # serve every drafter over this draft model).
        key = ("pard feed", self._depth, self.draft.block_size, self.draft.mask_token_id)
        tokens, parents, q_lens, starts = self.runner.run_step(
            key, f"pard feed B={batch}", PardBlock._feed, self, *self._source, state.roots, columns
        )
        logits = self.runner.verify(tokens, parents, q_lens).logits
        sampling = block_sampling(state, self.shape)
        args = (logits, starts, state.roots, *sampling)
        # The tree step of the draft model's runner, compiled with its own steps and captured
        # with its graphs; it commits the fed tokens up to the root.
        kind = f"pard {self.shape.kind(bool(sampling))} b={size}"
        label = f"{kind} B={batch}"
        proposal = self.runner.run_step((kind, self.shape), label, PardBlock._tree, self, *args)
        self.runner.cache.bound_lengths(state.longest)
        return proposal

    def _feed(
        self,
        tokens: torch.Tensor,
        nodes: torch.Tensor,
        accepted: torch.Tensor,
        roots: torch.Tensor,
        columns: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        """What a step feeds, `columns.shape[1]` tokens per row: the drafts the last step
        accepted (picked from its tree's `tokens` at `nodes`, `accepted` of them), the root
        (`roots` int64 `[B]`), then masks. Returns int64 tokens and parents (a chain) `[B, W]`,
        int32 `q_lens` `[B]` and each row's root node, int64 `[B]`."""
        width, mask = columns.shape[1], self.draft.mask_token_id
        picked = nodes[:, 1 : self._depth + 1].long().clamp(min=0)
        # Padded by the whole width, then cut: a cut at min(width, depth) would compile a graph
        # for widths up to the depth and another for wider ones.
        drafts = F.pad(tokens.gather(1, picked), (0, width), value=mask)[:, :width]
        starts = accepted.long()
        place = torch.arange(width, device=roots.device)
        fed = torch.where(place == starts[:, None], roots[:, None], drafts)
        fed = torch.where(place > starts[:, None], mask, fed)
        parents = (place - 1).expand(roots.shape[0], -1).contiguous()
        return fed, parents, (starts + self.draft.block_size).to(torch.int32), starts

    def _tree(
        self, logits: torch.Tensor, starts: torch.Tensor, roots: torch.Tensor, *sampling
    ) -> tuple[torch.Tensor, ...]:
        """`BlockShape.propose` of the block of each row: fp32 `logits` `[B, W, V]` at rows
        `starts[b]` (int64 `[B]`, the root's node) to `starts[b] + b - 1`. Commits the fed
        tokens up to each root (the root's position is then the cache's length less one); the
        masks' K/V are dropped."""
        index = starts[:, None] + torch.arange(self.draft.block_size, device=logits.device)
        block = logits.gather(1, index[..., None].expand(-1, -1, logits.shape[-1]))
        cache_lens = self.runner.cache.cache_lens
        cache_lens.add_((starts + 1).to(torch.int32))
        return self.shape.propose(block, roots, cache_lens - 1, *sampling)

    def update(self, state: DraftState, outcome: StepOutcome) -> None:
        """Keep the verified tree's tensors: the next step's feed picks the accepted drafts."""
        self._source = (outcome.proposal.tokens, outcome.accepted_nodes, outcome.num_accepted)
        paths = outcome.accepted_paths
        self._longest = None if paths is None else max(map(len, paths), default=0)
