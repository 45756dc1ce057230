"""EAGLE draft heads: EAGLE-1/2 (one decoder layer over token + feature) and EAGLE-3.

Both heads run autoregressively over "entries": entry t pairs the target's feature at position t
with the token at t + 1, sits at position t, and its output predicts the token at t + 2. Deeper
tree levels feed the head's own output in place of the target's feature.

EAGLE-1/2 (`EagleHead`, SafeAILab/EAGLE `cnets1.py`): the feature is the target's final normed
hidden state (the input of its LM head; the head's output goes straight into that LM head, as in
the reference); `fc` maps `cat(embed(token), feature)` (2h -> h) into one decoder layer of the
target's own architecture, whose input norm is absent in the reference layout. Token embeddings and
LM head are the target's. Keys: `fc.weight`, `fc.bias` (optional), `layers.0.*` (an optional
`embed_tokens.weight` is checked against the target's and not used).

EAGLE-3 (`Eagle3Head`, `cnets.py`): the feature fuses three target layers (low, middle, high;
`fc`, 3h -> h, applied to target features only). The reference captures the inputs of decoder
layers 2, L // 2 and L - 3, i.e. the outputs of layers 1, L // 2 - 1 and L - 4 in the runner's
numbering; configs record them as `eagle_aux_hidden_state_layer_ids` (the inputs' numbering, as in
vLLM). The decoder layer (`midlayer`) normalizes the embedding and the hidden state separately and
attends over their concatenation (2h wide projections); the output goes through the head's own
`norm` and `lm_head` over a reduced draft vocabulary, `d2t` mapping draft id i to target id
`i + d2t[i]` (`t2d` marks the target ids that have a draft id). Keys: `fc.weight`, `midlayer.*`,
`norm.weight`, `lm_head.weight`, `d2t`, `t2d` (optional).

Loading: `config.json` and `model.safetensors` or `pytorch_model.bin` (`weights_only=True`); a
config whose architectures name Eagle3, or that has `draft_vocab_size`, is an EAGLE-3 head.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)

from .checkpoint import (
    check_fits,
    layer_shape,
    load_strict,
    read_config,
    read_weights,
    resolve_folder,
    write_checkpoint,
)

WEIGHTS_NAMES = ("model.safetensors", "pytorch_model.bin")
EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"
LAYER_IDS_FIELD = "eagle_aux_hidden_state_layer_ids"
OPTIONAL_KEYS = ("embed_tokens.weight",)


def default_eagle3_layers(num_layers: int) -> tuple[int, int, int]:
    """Low, middle and high target layers (decoder-layer outputs) for EAGLE-3: the reference's
    (1, L // 2 - 1, L - 4) when those are distinct, else (0, L // 2 - 1, L - 2) clipped at 0 (for
    small targets, e.g. (0, 2, 4) for 6 layers)."""
    reference = (1, num_layers // 2 - 1, num_layers - 4)
    if 0 <= reference[0] < reference[1] < reference[2]:
        return reference
    return (0, max(num_layers // 2 - 1, 0), max(num_layers - 2, 0))


def _decoder(target):
    decoder = target.get_decoder()
    layers = getattr(decoder, "layers", None)
    rotary = getattr(decoder, "rotary_emb", None)
    if not isinstance(layers, nn.ModuleList) or rotary is None:
        raise ValueError(
            f"{target.config.model_type}: EAGLE heads need decoder layers at "
            "model.get_decoder().layers and a shared rotary embedding at .rotary_emb"
        )
    return layers, rotary


def head_config(config_class, fields: dict):
    """The head's config: the target architecture's config class over the checkpoint's fields,
    one layer; attention goes through our kernels once a drafter attaches the head."""
    fields = {
        key: value
        for key, value in fields.items()
        if key not in ("architectures", "layer_types", "auto_map")
    }
    return config_class(**{**fields, "num_hidden_layers": 1})


def _target_dims(target) -> tuple[int, int]:
    config = target.config.get_text_config(decoder=True)
    return config.hidden_size, config.vocab_size


class EagleHead(nn.Module):
    """The EAGLE-1/2 head (see the module doc).

    Args:
        config: an HF config of the target's architecture with the head's sizes.
        layer_class, rotary_class: the target's decoder layer and rotary embedding classes.
        input_norm: keep the decoder layer's input norm (the reference layout drops it).
        fc_bias: `fc` has a bias (the reference's default).
    """

    version = 1

    def __init__(
        self,
        config,
        layer_class: type[nn.Module],
        rotary_class: type[nn.Module],
        *,
        input_norm: bool = False,
        fc_bias: bool = True,
    ):
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=fc_bias)
        self.layers = nn.ModuleList([layer_class(config, 0)])
        self.input_norm = input_norm
        if not input_norm:
            self.layers[0].input_layernorm = nn.Identity()
        self.rotary_emb = rotary_class(config=config)
        self.target_layers: tuple[int, ...] = (-1,)

    @classmethod
    def for_target(cls, target, **overrides) -> EagleHead:
        """A freshly initialized head shaped like one layer of `target` (fields in `overrides`
        replace the target's config fields)."""
        layers, rotary = _decoder(target)
        base = target.config.get_text_config(decoder=True)
        config = head_config(type(base), {**base.to_dict(), **overrides})
        return cls(config, type(layers[0]), type(rotary))

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def draft_vocab_size(self) -> int:
        return self.config.vocab_size

    def fuse(self, features: Sequence[torch.Tensor]) -> torch.Tensor:
        """The head's hidden input from target features (one per `target_layers`, `[..., h]`)."""
        return features[0]

    def forward(
        self,
        hidden: torch.Tensor,
        embeds: torch.Tensor,
        position_ids: torch.Tensor,
        past_key_values=None,
        attention_mask: torch.Tensor | None = None,
        **attention_kwargs,
    ) -> torch.Tensor:
        """Outputs `[B, N, h]` of N entries.

        hidden: `[B, N, h]` target features (from `fuse`) or the head's own outputs.
        embeds: `[B, N, h]` the target's embeddings of the entries' tokens.
        position_ids: int64 `[B, N]`.
        past_key_values, attention_mask, attention_kwargs: passed to the decoder layer.
        """
        hidden = self.fc(torch.cat([embeds.to(hidden.dtype), hidden], dim=-1))
        output = self.layers[0](
            hidden,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            position_embeddings=self.rotary_emb(hidden, position_ids),
            **attention_kwargs,
        )
        return output[0] if isinstance(output, tuple) else output

    def logits(self, output: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """Draft logits `[..., vocab]` from head outputs, through the target's LM head."""
        return lm_head(output)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids

    def check_target(self, target) -> None:
        """Raise ValueError when this head cannot serve `target`."""
        hidden, vocab = _target_dims(target)
        check_fits("EAGLE head", "hidden_size", self.config.hidden_size, hidden)
        check_fits("EAGLE head", "vocab_size", self.config.vocab_size, vocab)

    def save_pretrained(self, folder: str | os.PathLike) -> None:
        """Write the public layout: `config.json` and `model.safetensors`."""
        config = {**self.config.to_dict(), "bias": self.fc.bias is not None}
        write_checkpoint(folder, config, self.state_dict(), WEIGHTS_NAMES[0])


class Eagle3Layer(nn.Module):
    """EAGLE-3's decoder layer: attention over `cat(norm(embeds), norm(hidden))` (2h wide)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        hidden = config.hidden_size
        self.self_attn = LlamaAttention(config, layer_idx=0)
        head_dim = self.self_attn.head_dim
        bias = config.attention_bias
        for name, heads in (
            ("q_proj", config.num_attention_heads),
            ("k_proj", config.num_key_value_heads),
            ("v_proj", config.num_key_value_heads),
        ):
            setattr(self.self_attn, name, nn.Linear(2 * hidden, heads * head_dim, bias=bias))
        self.mlp = LlamaMLP(config)
        self.hidden_norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.input_layernorm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)

    def forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        past_key_values,
        **attention_kwargs,
    ) -> torch.Tensor:
        residual = hidden
        both = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        attended, _ = self.self_attn(
            hidden_states=both,
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            past_key_values=past_key_values,
            **attention_kwargs,
        )
        hidden = residual + attended
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Eagle3Head(nn.Module):
    """The EAGLE-3 head (see the module doc).

    Args:
        config: a LlamaConfig with the head's sizes and `draft_vocab_size`.
        target_layers: the three target layers fused (decoder-layer outputs, runner numbering).
    """

    version = 3

    def __init__(self, config: LlamaConfig, target_layers: Sequence[int]):
        super().__init__()
        if len(target_layers) != 3:
            raise ValueError(f"target_layers: expected 3 layers, got {list(target_layers)}")
        self.config = config
        hidden = config.hidden_size
        target_hidden = getattr(config, "target_hidden_size", None) or hidden
        draft_vocab = getattr(config, "draft_vocab_size", None) or config.vocab_size
        self.fc = nn.Linear(3 * target_hidden, hidden, bias=False)
        self.midlayer = Eagle3Layer(config)
        self.norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, draft_vocab, bias=False)
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        self.target_layers = tuple(int(layer) for layer in target_layers)

    @classmethod
    def for_target(
        cls,
        target,
        draft_ids: Sequence[int] | None = None,
        target_layers: Sequence[int] | None = None,
        **overrides,
    ) -> Eagle3Head:
        """A freshly initialized head for `target`: Llama-shaped like one target layer, over the
        draft vocabulary `draft_ids` (target ids, default: the whole vocabulary)."""
        base = target.config.get_text_config(decoder=True)
        num_layers = base.num_hidden_layers
        vocab = base.vocab_size
        draft_ids = list(range(vocab)) if draft_ids is None else list(draft_ids)
        fields = layer_shape(base)
        fields.update(overrides, draft_vocab_size=len(draft_ids))
        head = cls(
            head_config(LlamaConfig, fields),
            default_eagle3_layers(num_layers) if target_layers is None else target_layers,
        )
        head.set_draft_vocab(draft_ids)
        return head

    def set_draft_vocab(self, draft_ids: Sequence[int]) -> None:
        """Fill `d2t` and `t2d` from the target ids of the draft vocabulary (distinct, in draft
        order)."""
        ids = torch.as_tensor(list(draft_ids), dtype=torch.long, device=self.d2t.device)
        if ids.shape != self.d2t.shape or ids.unique().numel() != ids.numel():
            raise ValueError(
                f"draft_ids: expected {self.d2t.numel()} distinct target ids, got {ids.numel()}"
            )
        self.d2t.copy_(ids - torch.arange(ids.numel(), device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def draft_vocab_size(self) -> int:
        return self.lm_head.out_features

    def fuse(self, features: Sequence[torch.Tensor]) -> torch.Tensor:
        return self.fc(torch.cat(list(features), dim=-1))

    def forward(
        self,
        hidden: torch.Tensor,
        embeds: torch.Tensor,
        position_ids: torch.Tensor,
        past_key_values=None,
        attention_mask: torch.Tensor | None = None,
        **attention_kwargs,
    ) -> torch.Tensor:
        """As `EagleHead.forward`; `hidden` is `fuse(...)` of target features or own outputs."""
        return self.midlayer(
            embeds.to(hidden.dtype),
            hidden,
            self.rotary_emb(hidden, position_ids),
            attention_mask,
            past_key_values,
            **attention_kwargs,
        )

    def logits(self, output: torch.Tensor, lm_head: nn.Module | None = None) -> torch.Tensor:
        """Draft-vocabulary logits `[..., draft_vocab]` (the head's own normed LM head)."""
        return self.lm_head(self.norm(output))

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def check_target(self, target) -> None:
        hidden, vocab = _target_dims(target)
        check_fits("EAGLE-3 head", "fc input (3 x hidden_size)", self.fc.in_features, 3 * hidden)
        check_fits("EAGLE-3 head", "hidden_size", self.config.hidden_size, hidden)
        check_fits("EAGLE-3 head", "vocab_size", self.config.vocab_size, vocab)
        num_layers = target.config.get_text_config(decoder=True).num_hidden_layers
        bad = [layer for layer in self.target_layers if not 0 <= layer < num_layers]
        if bad:
            raise ValueError(
                f"EAGLE-3 head: target layers {bad} do not exist in a {num_layers}-layer target"
            )
        mapped = torch.arange(self.draft_vocab_size, device=self.d2t.device) + self.d2t
        if bool((mapped < 0).any() | (mapped >= vocab).any()):
            raise ValueError(f"EAGLE-3 head: d2t maps draft ids outside the target's {vocab} ids")

    def save_pretrained(self, folder: str | os.PathLike) -> None:
        """Write the public layout: `config.json` and `model.safetensors`."""
        config = self.config.to_dict()
        config["architectures"] = [EAGLE3_ARCHITECTURE]
        config["draft_vocab_size"] = self.draft_vocab_size
        config[LAYER_IDS_FIELD] = [layer + 1 for layer in self.target_layers]
        write_checkpoint(folder, config, self.state_dict(), WEIGHTS_NAMES[0])


def is_eagle3_config(config: dict) -> bool:
    architectures = config.get("architectures") or []
    return "draft_vocab_size" in config or any("eagle3" in a.lower() for a in architectures)


def load_eagle_head(name_or_path: str | os.PathLike, target) -> EagleHead | Eagle3Head:
    """An EAGLE-1/2 or EAGLE-3 head from a folder in the public layout (or a bundled name), on
    the target's device and dtype; raises ValueError on missing or mismatched keys and on a head
    that does not fit the target."""
    folder = resolve_folder(name_or_path)
    fields = read_config(folder)
    state = read_weights(folder, WEIGHTS_NAMES)
    hidden, vocab = _target_dims(target)
    for key in OPTIONAL_KEYS:
        if key in state:
            check_fits(f"EAGLE head at {folder}", key, tuple(state.pop(key).shape), (vocab, hidden))
    if is_eagle3_config(fields):
        what = f"EAGLE-3 head at {folder}"
        num_layers = target.config.get_text_config(decoder=True).num_hidden_layers
        ids = fields.get(LAYER_IDS_FIELD)
        layers = default_eagle3_layers(num_layers) if ids is None else [i - 1 for i in ids]
        head = Eagle3Head(head_config(LlamaConfig, fields), layers)
        if "t2d" not in state and "d2t" in state:
            t2d = torch.zeros(head.config.vocab_size, dtype=torch.bool)
            mapped = torch.arange(state["d2t"].numel()) + state["d2t"].long()
            t2d[mapped.clamp(0, head.config.vocab_size - 1)] = True
            state["t2d"] = t2d
    else:
        what = f"EAGLE head at {folder}"
        decoder_layers, rotary = _decoder(target)
        base = target.config.get_text_config(decoder=True)
        model_type = fields.get("model_type", base.model_type)
        if model_type != base.model_type:
            raise ValueError(
                f"{what}: a {model_type} head cannot serve a {base.model_type} target (EAGLE-1/2 "
                "heads are one decoder layer of the target's architecture)"
            )
        head = EagleHead(
            head_config(type(base), fields),
            type(decoder_layers[0]),
            type(rotary),
            input_norm="layers.0.input_layernorm.weight" in state,
            fc_bias="fc.bias" in state,
        )
    load_strict(head, state, what)
    head.check_target(target)
    return head.to(device=target.device, dtype=target.dtype).eval()
