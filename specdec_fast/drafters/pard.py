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

import numpy as np
import torch
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
from specdec_fast.transfer import to_device
from specdec_fast.trees import check_depth_scale

from .base import DraftState, StepOutcome
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
    """The PARD flavour: a causal LM on its own runner, one chain forward per step."""

    hidden_layers: tuple[int, ...] = ()

    def __init__(self, draft: PardDraft):
        self.draft = draft
        self.positions = draft.block_size
        self.shape: BlockShape | None = None  # set by the drafter
        self.runner: ModelRunner | None = None
        self._cached: list[int] = []  # tokens in the draft's cache per row (host mirror)
        self._widest = 0  # the widest step's tokens, set at attach

    def attach(self, target, max_cache_len: int, depth: int) -> None:
        # A step feeds the accepted drafts (<= depth), the root and the masks past the cache.
        self._widest = depth + self.draft.block_size
        self.open_runner(self.draft.model, target, max_cache_len + self._widest)

    def propose(self, state: DraftState) -> tuple[torch.Tensor, ...]:
        """The proposal's `(tokens, parents, draft_probs)` (`BlockShape.propose`): one forward
        of the draft's runner, then the tree from the block's logits in a compiled step of its
        own."""
        size, device = self.draft.block_size, state.device
        # Per row: the tokens after the cache up to the root, then the masks (host data).
        fed = [row[cached:] for row, cached in zip(state.tokens, self._cached, strict=True)]
        # Under CUDA graphs every step is fed at the widest (one verify and one tree graph per
        # batch size, not one per accepted count); pad rows past each row's `q_lens`.
        width = max(len(chunk) for chunk in fed) + size - 1
        width = self.runner.verify_width(state.batch_size, width, self._widest)
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
        sampling = block_sampling(state, self.shape)
        args = (logits, to_device(roots, device), state.roots, *sampling)
        # The tree step of the draft model's runner, compiled with its own steps and captured
        # with its graphs.
        kind = f"pard {self.shape.kind(bool(sampling))} b={size}"
        label = f"{kind} B={args[0].shape[0]}"
        proposal = self.runner.run_step((kind, self.shape), label, PardBlock._tree, self, *args)
        # The root is committed with the tokens before it; the masks' K/V are dropped.
        lengths = [len(row) for row in state.tokens]
        self._commit(to_device(lengths, device, torch.int32), lengths)
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
