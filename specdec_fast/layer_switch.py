"""Per-instance `forward` replacements for a model's layers, switched on while runners are open.

Exact mode (`specdec_fast.exact`) and the CPU's oneDNN linear layers (`specdec_fast.onednn`) each
replace some layers' `forward` on the instance while a runner is open. `LayerForwards` holds the
replacements and installs or removes them as a unit, so a model comes out as it went in;
`LayerSwitch` counts the open runners per model (runners of one thread nest) and installs on the
first, removes on the last.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable

from torch import nn
from transformers import PreTrainedModel

_MISSING = object()


class LayerForwards:
    """`forward` replacements for some layers of a model: `layers` are (module, forward) pairs."""

    def __init__(self, layers: list[tuple[nn.Module, Callable]]):
        self._layers = layers
        self._saved: list[object] = []

    def install(self) -> None:
        """Set each layer's `forward` on the instance to its replacement."""
        self._saved = [module.__dict__.get("forward", _MISSING) for module, _ in self._layers]
        for module, forward in self._layers:
            module.forward = forward

    def remove(self) -> None:
        """Put back each layer's `forward` as it was before `install`."""
        for (module, _), saved in zip(self._layers, self._saved, strict=True):
            if saved is _MISSING:
                del module.__dict__["forward"]
            else:
                module.__dict__["forward"] = saved
        self._saved = []


class LayerSwitch:
    """`switch(model, on)`: install `make(model)`'s forwards when the first runner of `model`
    opens, remove them when the last one closes. `make` may raise (ValueError) to refuse a
    model; nothing is installed then."""

    def __init__(self, make: Callable[[PreTrainedModel], LayerForwards]):
        self._make = make
        self._lock = threading.Lock()
        self._switched: weakref.WeakKeyDictionary[PreTrainedModel, list] = (
            weakref.WeakKeyDictionary()
        )

    def __call__(self, model: PreTrainedModel, on: bool) -> None:
        with self._lock:
            entry = self._switched.get(model)
            if on:
                if entry is None:
                    layers = self._make(model)
                    layers.install()
                    self._switched[model] = [layers, 1]
                else:
                    entry[1] += 1
                return
            entry[1] -= 1
            if entry[1] == 0:
                del self._switched[model]
                entry[0].remove()

    def active(self, model: PreTrainedModel) -> bool:
        """Whether `model`'s layers are switched now."""
        return model in self._switched
