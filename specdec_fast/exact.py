"""Exact mode: a model's row-wise layers switched to batch-invariant forms while a runner is open.

In exact mode (`generate(..., exact=True)`) every target forward computes each token's logits
in an order that depends on neither the number of tokens in the call nor the batch, so
speculative output equals plain output of the same mode bit for bit, for every drafter:

- every `nn.Linear` (projections, MLP, `lm_head`) runs the custom op
  `specdec_fast::linear_exact` (registered with `torch.library`): fixed row tiles on the CPU, a
  one-tile-shape Triton matmul without split-K on CUDA;
- norms (`*RMSNorm`, `nn.LayerNorm`) and MLP blocks (`*MLP`) run on fixed row tiles
  (`row_tiled`), so their reductions over the hidden size and their elementwise kernels see one
  shape in every call;
- attention runs `tree_attention_exact` (the runner flags the step metadata).

Everything else in a decoder forward is elementwise (residual adds, rotary embeddings) or a
gather (embeddings), which does not depend on the batch. Models that route tokens to experts
(mixture-of-experts layers group a batch's tokens by expert) are refused.

`ExactLayers(model)` finds the layers (raising ValueError for models exact mode cannot serve);
`install()` sets each layer's `forward` on the instance and `remove()` puts back exactly what
was there, so the model comes out as it went in. Runners open and close it through
`switch_exact` (counted per model: runners of one thread nest).
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from transformers import PreTrainedModel

from specdec_fast.kernels.batch_invariant import linear_exact, row_tiled
from specdec_fast.layer_switch import LayerForwards, LayerSwitch

ROW_WISE_SUFFIXES = ("RMSNorm", "MLP")
EXPERT_MARKERS = ("moe", "expert")


def _exact_linear_forward(module: nn.Linear, x):
    # The custom op while compiling; eager calls skip the dispatcher's cost, same code.
    if torch.compiler.is_compiling():
        return torch.ops.specdec_fast.linear_exact(x, module.weight, module.bias)
    return linear_exact(x, module.weight, module.bias)


def _row_tiled_forward(forward, x, *args, **kwargs):
    return row_tiled(lambda tile: forward(tile, *args, **kwargs), x)


class ExactLayers(LayerForwards):
    """The layers of `model` that exact mode switches, with their batch-invariant forwards.

    Raises:
        ValueError: naming the model type, for mixture-of-experts models and for linear layers
            of other kinds than `nn.Linear` (quantized ones), whose reduction order exact mode
            cannot fix.
    """

    def __init__(self, model: PreTrainedModel):
        model_type = model.config.model_type
        layers: list[tuple[nn.Module, object]] = []
        for name, module in model.named_modules():
            kind = type(module).__name__
            if any(marker in kind.lower() for marker in EXPERT_MARKERS):
                raise ValueError(
                    f"exact: {model_type} routes tokens to experts ({name}: {kind}), which "
                    "groups a batch's tokens by expert; exact mode supports dense models only"
                )
            if isinstance(module, nn.Linear):
                if type(module) is not nn.Linear:
                    raise ValueError(
                        f"exact: {model_type} has a linear layer of kind {kind} ({name}); "
                        "exact mode supports plain nn.Linear layers only"
                    )
                layers.append((module, functools.partial(_exact_linear_forward, module)))
            elif isinstance(module, nn.LayerNorm) or kind.endswith(ROW_WISE_SUFFIXES):
                layers.append(
                    (
                        module,
                        functools.partial(_row_tiled_forward, type(module).forward.__get__(module)),
                    )
                )

        super().__init__(layers)


# switch_exact(model, on): exact mode on for the first exact runner of `model`, off after the last.
switch_exact = LayerSwitch(ExactLayers)
