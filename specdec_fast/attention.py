"""Our attention for HF models: `tree_attention` behind transformers' `AttentionInterface`.

`register_attention()` adds two entries under `ATTENTION_NAME`: the attention function (to
`AttentionInterface`) and a mask function that builds no mask (to `AttentionMaskInterface`), since
all masking (committed prefix, tree, padding rows) happens in the kernel. A model switched to
`ATTENTION_NAME` gets the per-step `StepMetadata` through the forward kwarg `METADATA_KWARG`, which
HF passes down to the attention function unchanged.
"""

from dataclasses import dataclass

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from specdec_fast.kernels import tree_attention

ATTENTION_NAME = "specdec_tree"
METADATA_KWARG = "specdec_metadata"


@dataclass
class StepMetadata:
    """What the attention function needs besides q, k, v for one forward.

    Attributes:
        cache_lens: int32 `[B]`, committed tokens before the new ones.
        tree_mask: None (causal among the new tokens) or packed int32 `[B, N, ceil(N/32)]`.
        q_lens: None or int32 `[B]`; rows `i >= q_lens[b]` are padding.
        max_cache_len: the cache capacity, to decide whether a sliding window can matter.
        key_bound: None, or a host-side upper bound of `cache_lens[b] + N`: slots at or past it
            are never visible, so the attention reads only the first `key_bound` slots (eager
            runs; a captured graph must not depend on it and passes None).
    """

    cache_lens: torch.Tensor
    tree_mask: torch.Tensor | None
    q_lens: torch.Tensor | None
    max_cache_len: int
    key_bound: int | None = None


def check_attention_features(
    model_type: str,
    max_cache_len: int,
    *,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> None:
    """Raise ValueError, naming the model type, for attention variants `tree_attention` lacks.

    A sliding window at least as wide as the cache never hides a key (HF lets position p see keys
    p - window < k <= p, and every position is below `max_cache_len`), so it is plain attention.
    """
    if softcap is not None:
        raise ValueError(
            f"{model_type}: attention logit soft-capping (attn_logit_softcapping = {softcap}) is "
            "not supported by tree_attention"
        )
    if sliding_window is not None and sliding_window < max_cache_len:
        raise ValueError(
            f"{model_type}: sliding-window attention with window {sliding_window} < max_cache_len "
            f"= {max_cache_len} is not supported by tree_attention; use max_cache_len <= "
            f"{sliding_window}"
        )
    if sinks is not None:
        raise ValueError(f"{model_type}: attention sinks are not supported by tree_attention")


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
    """The `AttentionInterface` function: `tree_attention` over the whole layer cache.

    Args:
        query: `[B, Hq, N, D]`, the new tokens.
        key, value: `[B, Hkv, Lmax, D]`, the layer's cache views returned by `SpecKVCache.update`
            (the new tokens already written at slots `cache_lens[b] + i`).
        attention_mask: ignored (our mask function builds none).

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
    check_attention_features(
        model_type,
        metadata.max_cache_len,
        sliding_window=kwargs.get("sliding_window"),
        softcap=kwargs.get("softcap"),
        sinks=kwargs.get("s_aux"),
    )
    if metadata.key_bound is not None:
        # Views, not copies: the kernel only needs unit stride on D.
        key, value = key[:, :, : metadata.key_bound], value[:, :, : metadata.key_bound]
    output = tree_attention(
        query,
        key,
        value,
        metadata.cache_lens,
        tree_mask=metadata.tree_mask,
        q_lens=metadata.q_lens,
        scale=scaling,
    )
    return output.transpose(1, 2), None


def no_mask(*args, **kwargs) -> None:
    """The `AttentionMaskInterface` function: masking happens inside `tree_attention`."""
    return None


def register_attention() -> None:
    """Register our attention and mask functions under `ATTENTION_NAME` (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, tree_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, no_mask)
