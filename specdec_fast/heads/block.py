"""The DFlash draft head: a block drafter conditioned on the target's hidden states.

DFlash (z-lab/dflash, `DFlashDraftModel` in `dflash/model.py`; the same layout is read by SGLang's
and vLLM's DFlash proposers) drafts a block of b tokens in one forward. Its input is the block
`[last token, MASK x (b - 1)]` embedded by the target's own embeddings, at the positions the
tokens would have; its context is a fused projection of several target layers' hidden states,
one entry per token already verified: `hidden_norm(fc(cat(h_l1, h_l2, ...)))`. Each decoder layer
(Qwen3-shaped: q/k RMS norms, rotary positions) attends from the block's positions to the keys
and values of the context entries (projected by that layer's own `k_proj`/`v_proj` from the fused
context, not from the layer's input) and of the whole block, bidirectionally. The output at block
position j (after the final `norm`, through the target's LM head) is the draft distribution of
the token j places after the last one, for j = 1 .. b - 1.

Only the block needs a forward per step: a context entry's keys and values depend on the fused
target features alone, so each verified token's entry is projected once and cached.

Layout: `config.json` holds a Qwen3 config of the head (`num_hidden_layers` = draft layers,
`hidden_size` = the target's), `architectures: ["DFlashDraftModel"]`, `num_target_layers`, and
`dflash_config: {block_size, mask_token_id, target_layer_ids}` (older checkpoints put
`block_size` at the top level; without `target_layer_ids` the reference spaces them evenly, see
`default_target_layers`). `target_layer_ids` number decoder-layer outputs as HF's
`hidden_states[i + 1]`; the last layer's entry there is the final normed state. Weights,
safetensors only (`model.safetensors` or a sharded `model.safetensors.index.json`):
`fc.weight` [h, K h], `hidden_norm.weight`, `norm.weight`, and per layer
`layers.{i}.input_layernorm.weight`, `post_attention_layernorm.weight`,
`self_attn.{q,k,v,o}_proj.weight` (and biases with `attention_bias`), `self_attn.{q,k}_norm.weight`,
`mlp.{gate,up,down}_proj.weight`. No embeddings and no LM head: those are the target's.
Our own optional `ddtree_depth_scale` (top level) is the best-first tree's calibration fitted for
the checkpoint (`specdec_fast.trees.best_first_tree`); without it the scale is 1. Our own optional
draft vocabulary: `draft_vocab_size` (top level) and a `d2t` tensor in the weights, as EAGLE-3's
(draft id i is target id `i + d2t[i]`): the head drafts from those rows of the target's LM head
only (the target's most frequent tokens, `specdec_fast.train.calibrate`), a fraction of the
whole head's read per step; without it the head drafts from the whole vocabulary.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import torch
from huggingface_hub.errors import StrictDataclassError
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    rotate_half,
)

from specdec_fast.loading import drafter_dtype
from specdec_fast.trees import check_depth_scale

from .checkpoint import (
    SAFETENSORS_NAME,
    check_fits,
    layer_shape,
    load_strict,
    read_config,
    read_safetensors,
    resolve_folder,
    write_checkpoint,
)

DFLASH_ARCHITECTURE = "DFlashDraftModel"
DFLASH_FIELD = "dflash_config"
# The published block size ("-b16" checkpoints), the reference's default.
DEFAULT_BLOCK_SIZE = 16
# Config fields that describe the checkpoint rather than the head's Qwen3 shape.
DEPTH_SCALE_FIELD = "ddtree_depth_scale"
NON_SHAPE_FIELDS = (
    "architectures",
    "auto_map",
    DFLASH_FIELD,
    "block_size",
    "num_target_layers",
    DEPTH_SCALE_FIELD,
    "draft_vocab_size",
)

# attend(layer index, q [B, Hq, n, D], k [B, Hkv, n, D], v [B, Hkv, n, D]) -> [B, Hq, n, D]: the
# attention of the block's n queries over the context and the block (written by the caller).
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def default_target_layers(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The reference's default target layers (`build_target_layer_ids`): the middle layer for a
    one-layer head, else `num_draft_layers` layers spaced evenly from 1 to L - 3."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    if end < start:
        raise ValueError(
            f"num_target_layers: DFlash's default layers need a target of >= 4 layers, got "
            f"{num_target_layers}; give target_layers"
        )
    span = end - start
    return [round(start + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def _rotate(states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary positions on `[B, H, n, D]` states; cos, sin `[B, n, D]`."""
    return states * cos[:, None] + rotate_half(states) * sin[:, None]


class DFlashAttention(nn.Module):
    """DFlash's attention projections (queries from the block, keys and values from the context
    or the block, q/k RMS norms per head); the attention itself is the caller's."""

    def __init__(self, config: Qwen3Config):
        super().__init__()
        hidden, head_dim = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * head_dim, hidden, bias=bias)
        self.q_norm = Qwen3RMSNorm(head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(head_dim, eps=config.rms_norm_eps)

    def _heads(self, states: torch.Tensor, count: int) -> torch.Tensor:
        return states.unflatten(-1, (count, self.head_dim)).transpose(1, 2)

    def keys_values(self, states, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values `[B, Hkv, n, D]` of `[B, n, h]` states at positions given by cos, sin."""
        keys = self.k_norm(self._heads(self.k_proj(states), self.num_kv_heads))
        return _rotate(keys, cos, sin), self._heads(self.v_proj(states), self.num_kv_heads)

    def queries(self, states, cos, sin) -> torch.Tensor:
        """Queries `[B, Hq, n, D]` of `[B, n, h]` states."""
        return _rotate(self.q_norm(self._heads(self.q_proj(states), self.num_heads)), cos, sin)


class DFlashLayer(nn.Module):
    """One DFlash decoder layer (pre-norm attention and MLP, residual)."""

    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.self_attn = DFlashAttention(config)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class DFlashHead(nn.Module):
    """The DFlash draft head (see the module doc).

    Args:
        config: a Qwen3Config with the head's sizes (`hidden_size` the target's) and its extra
            fields: `block_size`, `mask_token_id`, `target_layer_ids`, `num_target_layers`,
            and optionally `ddtree_depth_scale` (the best-first trees' calibration, default 1)
            and `draft_vocab_size` (a draft vocabulary of that many target ids, `d2t`; filled
            by `set_draft_vocab` or a checkpoint).
    """

    def __init__(self, config: Qwen3Config):
        super().__init__()
        for name in ("block_size", "mask_token_id", "target_layer_ids", "num_target_layers"):
            if getattr(config, name, None) is None:
                raise ValueError(f"config: the DFlash head needs {name}")
        if config.block_size < 2:
            raise ValueError(
                f"block_size must be >= 2 (the root and a mask), got {config.block_size}"
            )
        check_depth_scale(config_depth_scale(config))
        windowed = [kind for kind in config.layer_types if kind != "full_attention"]
        if windowed:
            raise ValueError(
                f"config: layer_types: DFlash heads of {windowed} layers are not supported"
            )
        self.config = config
        hidden = config.hidden_size
        self.target_layers = tuple(int(layer) for layer in config.target_layer_ids)
        self.layers = nn.ModuleList([DFlashLayer(config) for _ in range(config.num_hidden_layers)])
        self.fc = nn.Linear(len(self.target_layers) * hidden, hidden, bias=False)
        self.hidden_norm = Qwen3RMSNorm(hidden, eps=config.rms_norm_eps)
        self.norm = Qwen3RMSNorm(hidden, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config=config)
        draft_vocab = getattr(config, "draft_vocab_size", None)
        if draft_vocab is not None:
            if not 1 <= draft_vocab <= config.vocab_size:
                raise ValueError(
                    f"draft_vocab_size must be in [1, {config.vocab_size}] (the vocabulary), "
                    f"got {draft_vocab}"
                )
            self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long))

    @classmethod
    def for_target(
        cls,
        target,
        num_layers: int = 1,
        block_size: int = DEFAULT_BLOCK_SIZE,
        mask_token_id: int | None = None,
        target_layers: Sequence[int] | None = None,
        **overrides,
    ) -> DFlashHead:
        """A freshly initialized head of `num_layers` layers shaped like the target's layers
        (fields in `overrides` replace them); the mask token defaults to the target's pad token,
        the target layers to `default_target_layers`."""
        base = target.config.get_text_config(decoder=True)
        num_target_layers = base.num_hidden_layers
        mask_token_id = base.pad_token_id if mask_token_id is None else mask_token_id
        if mask_token_id is None:
            raise ValueError(
                "mask_token_id: the target has no pad token to draft masks with; give one"
            )
        fields = layer_shape(base)
        layers = target_layers or default_target_layers(num_target_layers, num_layers)
        fields.update(
            overrides,
            num_hidden_layers=num_layers,
            block_size=block_size,
            mask_token_id=mask_token_id,
            target_layer_ids=[int(layer) for layer in layers],
            num_target_layers=num_target_layers,
        )
        return cls(Qwen3Config(**fields))

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    @property
    def depth_scale(self) -> float:
        """The best-first trees' calibration fitted for this head (1: none)."""
        return config_depth_scale(self.config)

    @property
    def draft_ids(self) -> torch.Tensor | None:
        """int64 `[draft_vocab_size]`: the target ids the head drafts from, in draft order; None
        when it drafts from the whole vocabulary."""
        if getattr(self.config, "draft_vocab_size", None) is None:
            return None
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    def set_draft_vocab(self, draft_ids: Sequence[int] | torch.Tensor | None) -> None:
        """Draft from the target ids `draft_ids` only (distinct, in draft order; see the module
        doc), or from the whole vocabulary (None)."""
        if draft_ids is None:
            self.config.draft_vocab_size = None
            if "d2t" in self._buffers:
                del self.d2t
            return
        d2t = draft_vocab_offsets(draft_ids, self.config.vocab_size)
        self.config.draft_vocab_size = d2t.numel()
        self.register_buffer("d2t", d2t.to(self.fc.weight.device))

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        """The target layers in the runner's numbering (`ModelRunner.capture_hidden`): the same
        decoder-layer outputs, except that the last layer's entry is the final normed state, as
        in HF's `hidden_states`."""
        last = self.config.num_target_layers - 1
        return tuple(-1 if layer == last else layer for layer in self.target_layers)

    def fuse(self, features: Sequence[torch.Tensor]) -> torch.Tensor:
        """Context entries `[..., h]` from target features, one `[..., h]` per target layer (in
        the target's dtype, which may differ from the head's)."""
        return self.hidden_norm(self.fc(torch.cat(list(features), dim=-1).to(self.fc.weight.dtype)))

    def context(
        self, fused: torch.Tensor, positions: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the keys and values `[B, Hkv, n, D]` of n context entries `[B, n, h]` (from
        `fuse`) at int64 `positions` `[B, n]`."""
        cos, sin = self.rotary_emb(fused, positions)
        return [layer.self_attn.keys_values(fused, cos, sin) for layer in self.layers]

    def forward(
        self, embeds: torch.Tensor, positions: torch.Tensor, attend: Attend
    ) -> torch.Tensor:
        """Normed outputs `[B, n, h]` of a block: embeds `[B, n, h]` (the target's embeddings of
        `[last token, MASK, ...]`), int64 `positions` `[B, n]`; `attend` does each layer's
        attention over the context and the block."""
        hidden = embeds
        cos, sin = self.rotary_emb(hidden, positions)
        for index, layer in enumerate(self.layers):
            states = layer.input_layernorm(hidden)
            attention = layer.self_attn
            keys, values = attention.keys_values(states, cos, sin)
            attended = attend(index, attention.queries(states, cos, sin), keys, values)
            hidden = hidden + attention.o_proj(attended.transpose(1, 2).flatten(2))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return self.norm(hidden)

    def check_target(self, target) -> None:
        """Raise ValueError when this head cannot serve `target`."""
        config = target.config.get_text_config(decoder=True)
        what = "DFlash head"
        check_fits(what, "hidden_size", self.config.hidden_size, config.hidden_size)
        check_fits(what, "vocab_size", self.config.vocab_size, config.vocab_size)
        check_fits(
            what, "num_target_layers", self.config.num_target_layers, config.num_hidden_layers
        )
        num_layers = config.num_hidden_layers
        bad = [layer for layer in self.target_layers if not 0 <= layer < num_layers]
        if bad:
            raise ValueError(
                f"{what}: target layers {bad} do not exist in a {num_layers}-layer target"
            )
        if not 0 <= self.mask_token_id < config.vocab_size:
            raise ValueError(
                f"{what}: mask_token_id {self.mask_token_id} is outside the target's "
                f"{config.vocab_size} token ids"
            )
        if self.draft_ids is not None:
            try:
                draft_vocab_offsets(self.draft_ids, config.vocab_size)
            except ValueError:
                raise ValueError(
                    f"{what}: d2t maps draft ids outside the target's {config.vocab_size} token "
                    "ids, or two onto one"
                ) from None

    def save_pretrained(self, folder: str | os.PathLike) -> None:
        """Write the public layout: `config.json` and `model.safetensors`."""
        config = {
            key: value
            for key, value in self.config.to_dict().items()
            if key not in ("mask_token_id", "target_layer_ids")
            and not (key == "draft_vocab_size" and value is None)
        }
        config["architectures"] = [DFLASH_ARCHITECTURE]
        config[DFLASH_FIELD] = {
            "block_size": self.block_size,
            "mask_token_id": self.mask_token_id,
            "target_layer_ids": list(self.target_layers),
        }
        write_checkpoint(folder, config, self.state_dict(), SAFETENSORS_NAME)


def draft_vocab_offsets(draft_ids: Sequence[int] | torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The layout's `d2t` (int64, on the CPU) of a draft vocabulary: the target ids `draft_ids`
    (distinct, in draft order, each below `vocab_size`); ValueError otherwise."""
    ids = torch.as_tensor(draft_ids, dtype=torch.long).flatten().cpu()
    if ids.numel() == 0 or ids.unique().numel() != ids.numel():
        raise ValueError(f"draft_ids: expected distinct target ids, got {ids.numel()} ids")
    if bool(((ids < 0) | (ids >= vocab_size)).any()):
        raise ValueError(f"draft_ids: ids outside the vocabulary's {vocab_size}")
    return ids - torch.arange(ids.numel())


def config_depth_scale(config) -> float:
    """A head config's `ddtree_depth_scale`, 1 when it has none."""
    value = getattr(config, DEPTH_SCALE_FIELD, None)
    return 1.0 if value is None else value


def is_dflash_config(fields: dict) -> bool:
    architectures = fields.get("architectures") or []
    return DFLASH_FIELD in fields or any("dflash" in name.lower() for name in architectures)


def load_dflash_head(
    name_or_path: str | os.PathLike, target, dtype: torch.dtype | None = None
) -> DFlashHead:
    """A DFlash head from a folder in the public layout (or a bundled name), on the target's
    device, in `dtype` (None: `loading.drafter_dtype`, the checkpoint's 16-bit dtype where the
    device computes in it natively, else the target's); raises ValueError on a config or weights
    that do not match the layout, and on a head that does not fit the target (hidden size,
    vocabulary, layers, mask token)."""
    folder = resolve_folder(name_or_path)
    fields = read_config(folder)
    what = f"DFlash head at {folder}"
    architectures = fields.get("architectures") or []
    unsupported = [name for name in architectures if name != DFLASH_ARCHITECTURE]
    if unsupported:
        raise ValueError(
            f"{what}: architectures {unsupported} are not supported (only "
            f"{DFLASH_ARCHITECTURE}: DFlash-2's convolutions and candidate selector are not)"
        )
    extra = fields.get(DFLASH_FIELD) or {}
    target_config = target.config.get_text_config(decoder=True)
    num_draft_layers = fields.get("num_hidden_layers")
    num_target_layers = fields.get("num_target_layers", target_config.num_hidden_layers)
    layers = extra.get("target_layer_ids")
    if layers is None:
        layers = default_target_layers(num_target_layers, num_draft_layers)
    block_size = extra.get("block_size", fields.get("block_size", DEFAULT_BLOCK_SIZE))
    mask_token_id = extra.get("mask_token_id")
    if mask_token_id is None:
        raise ValueError(f"{what}: config.json has no {DFLASH_FIELD}.mask_token_id")
    shape = {key: value for key, value in fields.items() if key not in NON_SHAPE_FIELDS}
    try:
        config = Qwen3Config(
            **shape,
            block_size=int(block_size),
            mask_token_id=int(mask_token_id),
            target_layer_ids=[int(layer) for layer in layers],
            num_target_layers=int(num_target_layers),
            draft_vocab_size=fields.get("draft_vocab_size"),
            **{DEPTH_SCALE_FIELD: fields.get(DEPTH_SCALE_FIELD, 1.0)},
        )
        head = DFlashHead(config)
    except (TypeError, ValueError, StrictDataclassError) as error:
        raise ValueError(f"{what}: config.json: {error}") from None
    state = read_safetensors(folder)
    load_strict(head, state, what)
    head.check_target(target)
    if dtype is None:
        stored = state["fc.weight"].dtype
        dtype = drafter_dtype(target.device, stored, target.dtype)
    return head.to(device=target.device, dtype=dtype).eval()
