"""oneDNN for a float32 model's linear layers on the CPU, while an eager runner is open.

torch's `F.linear` in float32 on the CPU calls MKL's sgemm. On this project's CPU (AMD EPYC,
AVX-512) MKL runs 2-16 rows far below the rate of one row, and a speculative step verifies
exactly that many: the SmolLM2-135M target's forward takes 54 ms at 1 row and 91 ms at 16 through
MKL, 44 ms and 72 ms through oneDNN's linear (`torch.ops.mkldnn._linear_pointwise`, the op
inductor itself emits for CPU linears), on 2 threads (bench/NOTES.md, 2026-12-05). An eager
`ModelRunner` over a float32 CPU model therefore switches its `nn.Linear` layers to oneDNN while
it is open (`switch_onednn`), and puts them back when it closes: HF `generate` and anything else
outside our runner see the model unchanged. Drafters' own heads follow the target's choice
(`follow_target`). Compiled runners leave the layers to inductor, exact mode to its own
batch-invariant linear.

Each layer runs on a copy of its weight that oneDNN packed for its blocked kernels
(`torch.ops.mkldnn._reorder_linear_weight`, as inductor's freezing does): the same results as
the plain weight, and the target's verify forward at 8 and 16 nodes in 57 and 69 ms, where it
took 72 and 82 unpacked (a decode step: 47 ms either way; bench/NOTES.md, 2026-12-06). Packing
the target's 211 layers takes 0.3 s, so the packed copy is kept with the layer
(`packed_weight`) and packed again only when its weight changes (another tensor, or an in-place
update): a float32 model on the CPU holds its linear weights twice once an eager runner has
opened on it.

`SPECDEC_ONEDNN=0` turns the switch off (torch's own linear everywhere).
"""

from __future__ import annotations

import functools
import os
import weakref

import torch
from torch import nn
from transformers import PreTrainedModel

from specdec_fast.compiled import compile_by_default
from specdec_fast.layer_switch import LayerForwards, LayerSwitch

ONEDNN_ENV = "SPECDEC_ONEDNN"
# The row count oneDNN packs weights for: a verify step's usual tree. Packed for 8 rows, the
# target above ran 1, 8 and 16 rows as fast as or faster than packed for 1, 2, 4 or 16.
PACK_ROWS = 8
# Each layer's packed weight, with the (storage, version) of the weight it was packed from.
_PACKED: weakref.WeakKeyDictionary[nn.Linear, tuple[tuple[int, int], torch.Tensor]] = (
    weakref.WeakKeyDictionary()
)


def packed_weight(module: nn.Linear) -> torch.Tensor:
    """`module`'s weight packed by oneDNN, packed on first use and again after the weight
    changed (a new tensor or an in-place update)."""
    weight = module.weight
    key = (weight.data_ptr(), weight._version)
    entry = _PACKED.get(module)
    if entry is None or entry[0] != key:
        with torch.no_grad():
            entry = (key, torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS))
        _PACKED[module] = entry
    return entry[1]


def _onednn_linear(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled() and module.weight.requires_grad:
        # oneDNN's op has no gradient: a forward that trains the layer runs torch's linear.
        return torch.nn.functional.linear(x, module.weight, module.bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight(module), module.bias, "none", [], "")


def onednn_available() -> bool:
    """Whether this torch has oneDNN and its linear and weight-packing ops."""
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def use_onednn(model: PreTrainedModel, compile: bool, exact: bool) -> bool:
    """Whether an open runner of these options switches `model`'s linear layers to oneDNN: a
    float32 model on the CPU, eager, not exact, `SPECDEC_ONEDNN` not 0, oneDNN present."""
    return (
        model.device.type == "cpu"
        and model.dtype == torch.float32
        and not compile
        and not exact
        and os.environ.get(ONEDNN_ENV, "1") != "0"
        and onednn_available()
    )


class OneDNNLinears(LayerForwards):
    """The `nn.Linear` layers (exactly that type) of `model` with plain float32 weights, each with
    a forward through oneDNN's linear. Weights of tensor subclasses (a tensor-parallel plan's
    DTensors) keep torch's linear, which dispatches them."""

    def __init__(self, model: nn.Module):
        super().__init__(
            [
                (module, functools.partial(_onednn_linear, module))
                for module in model.modules()
                if type(module) is nn.Linear
                and type(module.weight.data) is torch.Tensor
                and module.weight.dtype == torch.float32
            ]
        )


# switch_onednn(model, on): oneDNN linears for the first such runner of `model`, off after the last.
switch_onednn = LayerSwitch(OneDNNLinears)


def follow_target(module: nn.Module, target: PreTrainedModel) -> None:
    """A drafter's own layers (an EAGLE head, Medusa heads, a DFlash head) follow the choice the
    target's runner makes for this call: oneDNN while eager on a float32 CPU target, torch's
    linear when compiling (inductor then lowers the layers itself). Called at `attach`."""
    wanted = use_onednn(target, compile_by_default(), exact=False)
    if wanted != switch_onednn.active(module):
        switch_onednn(module, wanted)
