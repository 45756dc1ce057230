"""Our attention for HF models: `tree_attention` behind transformers' `AttentionInterface`.

`register_attention()` adds two entries under `ATTENTION_NAME`: the attention function (to
`AttentionInterface`) and a mask function that builds no mask (to `AttentionMaskInterface`), since
all masking (committed prefix, tree, padding rows) happens in the kernel. A model switched to
`ATTENTION_NAME` gets the per-step `StepMetadata` through the forward kwarg `METADATA_KWARG`, which
HF passes down to the attention function unchanged.

Sliding windows and attention logit soft-capping are applied as the model's own eager attention
applies them (see `layer_window` and `tree_attention_forward`); attention sinks are refused.
"""

from dataclasses import dataclass

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from specdec_fast.kernels.batch_invariant import tree_attention_exact
from specdec_fast.kernels.tree_attention import run_tree_attention

ATTENTION_NAME = "specdec_tree"
METADATA_KWARG = "specdec_metadata"


@dataclass
class StepMetadata:
    """What the attention function needs besides q, k, v for one forward.

    Attributes:
        cache_lens: int32 `[B]`, committed tokens before the new ones.
        tree_mask: None (causal among the new tokens) or packed int32 `[B, N, ceil(N/32)]`.
        q_lens: None or int32 `[B]`; rows `i >= q_lens[b]` are padding.
        max_cache_len: the cache capacity: a sliding window at least this wide never hides a
            key (every position is below it), so it is dropped.
        q_depths: None (causal), or int32 `[B, N]`, each tree node's depth (its position is
            `cache_lens[b] + depth`); sliding windows over a tree need it.
        layer_windows: None, or each decoder layer's sliding window (None for full attention)
            as the config's layer types give it, for layers whose attention call does not pass
            `sliding_window` (see `layer_window`).
        exact: run `tree_attention_exact` (exact mode: each row's result independent of N,
            B and the other rows) instead of the backend's kernel.
    """

    cache_lens: torch.Tensor
    tree_mask: torch.Tensor | None
    q_lens: torch.Tensor | None
    max_cache_len: int
    q_depths: torch.Tensor | None = None
    layer_windows: tuple[int | None, ...] | None = None
    exact: bool = False


def check_attention_features(model_type: str, *, sinks: torch.Tensor | None = None) -> None:
    """Raise ValueError, naming the model type, for attention variants `tree_attention` lacks."""
    if sinks is not None:
        raise ValueError(f"{model_type}: attention sinks are not supported by tree_attention")


def check_model_attention(model: nn.Module) -> None:
    """`check_attention_features` on what `model`'s modules hold (an attention module's
    `sinks`), before any step runs: inside the attention call, the check would run within a
    compiled prefill, where torch's compiler reports the ValueError as an error of its own."""
    model_type = model.config.model_type
    for module in model.modules():
        sinks = getattr(module, "sinks", None)
        if isinstance(sinks, torch.Tensor):
            check_attention_features(model_type, sinks=sinks)


def layer_window(module: nn.Module, metadata: StepMetadata, kwargs: dict) -> int | None:
    """The sliding window of `module`'s layer, or None where the window cannot hide a key.

    Most families pass `sliding_window` to the attention function (the window of that layer's
    mask, which is what eager attention applies); a few (Qwen2-MoE, PhiMoE, Doge) leave it to the
    mask alone, built from the config's layer types: `metadata.layer_windows` by layer index.
    """
    if "sliding_window" in kwargs:
        window = kwargs["sliding_window"]
    elif metadata.layer_windows is not None:
        window = metadata.layer_windows[module.layer_idx]
    else:
        window = None
    if window is None or window >= metadata.max_cache_len:
        return None
    return window


def tree_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The `AttentionInterface` function: `tree_attention` over the whole layer cache, on the
    step metadata that the runner validated.

    Args:
        query: `[B, Hq, N, D]`, the new tokens.
        key, value: `[B, Hkv, Lmax, D]`, the layer's cache views returned by `SpecKVCache.update`
            (the new tokens already written at slots `cache_lens[b] + i`).
        attention_mask: ignored (our mask function builds none).
        kwargs: `METADATA_KWARG` (the `StepMetadata`), and what the model's layer passes:
            `sliding_window`, `softcap` (applied) and `s_aux` (attention sinks: refused).

    Returns:
        `[B, N, Hq, D]` (HF's layout after attention) and no attention weights.
    """
    model_type = module.config.model_type
    metadata = kwargs.get(METADATA_KWARG)
    if metadata is None:
        raise RuntimeError(
            f"{model_type}: attention is switched to {ATTENTION_NAME!r} by an open ModelRunner; "
            "run the model through the runner, or close the runner to get the original attention"
        )
    check_attention_features(model_type, sinks=kwargs.get("s_aux"))
    window = layer_window(module, metadata, kwargs)
    # The runner checked the step's metadata once; every layer runs the kernel unvalidated.
    args = (
        query,
        key,
        value,
        metadata.cache_lens,
        metadata.tree_mask,
        metadata.q_lens,
        query.shape[-1] ** -0.5 if scaling is None else float(scaling),
        # Eager attention soft-caps exactly when it is handed `softcap` (Gemma2 is; Gemma3's
        # config value is never passed, so its eager attention does not cap).
        None if kwargs.get("softcap") is None else float(kwargs["softcap"]),
        window,
        None if window is None else metadata.q_depths,
    )
    if metadata.exact:
        output = tree_attention_exact(*args)
    elif torch.compiler.is_compiling():
        output = torch.ops.specdec_fast.tree_attention(*args)
    else:
        output = run_tree_attention(*args)
    return output.transpose(1, 2), None


def no_mask(*args, **kwargs) -> None:
    """The `AttentionMaskInterface` function: masking happens inside `tree_attention`."""
    return None


def register_attention() -> None:
    """Register our attention and mask functions under `ATTENTION_NAME` (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, tree_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, no_mask)
