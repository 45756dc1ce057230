"""Steps captured as CUDA graphs and replayed: the one home of capture and replay, for the target
runner's verify step and the drafters' draft loops and updates.

A step is a function of tensors (and of whatever persistent device state it reads, such as a KV
cache, which it may update in place). `StepGraphs.run(key, step, *args)` calls it as it is for
the first `warmup` calls of a key (compilation, Triton autotuning and lazy initialisation happen
there, and those calls are real steps: a step that updates its state runs once per call), then
captures it on static copies of its tensor arguments, and from then on copies the arguments into
those copies and replays. A replay returns the same output tensors every time: they hold the
latest call's outputs until the next call of that key.

What a capture fixes, a step must not change between calls of one key: the addresses of the state
it reads (`bind` drops every graph when the caller's state is replaced), the Python values it
branches on, and its non-tensor arguments. A step reads nothing back to the host (a capture fails
on a synchronisation). `capture` is the capture itself and `capturable` says where it works; tests
on the CPU replace both with an emulation that traces the step once (`torch.fx`) and replays the
trace, so that Python runs only at capture there too.

Whether a `generate` call or the scheduler runs drafters' steps as graphs is the choice of the call
in progress (`choice`, set with the target runner's `use_cuda_graphs`), read by drafters when they
attach (`chosen`). A drafter keeps its graphs, with the state they read, on its module between
calls (`resident`), as the target's runner keeps its graphs with its cache on the model.
"""

from __future__ import annotations

import time
import weakref
from collections import Counter
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from specdec_fast.cache import SpecKVCache
from specdec_fast.compiled import kept

# Calls of a key run as they are before its capture: compilation and lazy initialisation (cuBLAS
# workspaces, Triton's autotuning) must not be captured.
GRAPH_WARMUP_CALLS = 2

_CHOICE: ContextVar[bool] = ContextVar("specdec_graphs_choice", default=False)


@contextmanager
def choice(on: bool) -> Iterator[None]:
    """Within the block, `chosen()` answers `on`: drafters attached in it run their steps as CUDA
    graphs (`generate` and the scheduler attach drafters in it, with their runner's choice)."""
    token = _CHOICE.set(on)
    try:
        yield
    finally:
        _CHOICE.reset(token)


def chosen() -> bool:
    """Whether drafters attached now capture their steps (`choice`); False outside one."""
    return _CHOICE.get()


def capturable(device: torch.device) -> bool:
    """Whether steps on `device` can be captured: CUDA's."""
    return device.type == "cuda"


def capturing() -> bool:
    """Whether a step is being captured now: code with a host shortcut off the compiler's path
    (the block drafters' best-first heap) takes its device form then, as when compiling."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def capture(step: Callable, args: tuple, pool: Any) -> tuple[Callable[[], None], Any, Any]:
    """Capture `step(*args)` as a CUDA graph in memory pool `pool` (None: a new one); returns
    `(replay, outputs, pool)`. The capture records the step's kernels without running them."""
    pool = torch.cuda.graph_pool_handle() if pool is None else pool
    graph = torch.cuda.CUDAGraph()
    # A capture synchronises the device (once per key): not a step's sync, which a sync debug
    # mode set to catch those (the `gpu` tests' steady steps) would refuse.
    debug_mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(0)
    try:
        with torch.cuda.graph(graph, pool=pool):
            outputs = step(*args)
    finally:
        torch.cuda.set_sync_debug_mode(debug_mode)
    return graph.replay, outputs, pool


@dataclass
class _Captured:
    replay: Callable[[], None]
    inputs: tuple
    outputs: Any


class StepGraphs:
    """Captured steps by key, with their static inputs and outputs and one memory pool.

    Args:
        what: the owner, for messages ("eagle3", "llama verify").
        on: capture; when False, `run` calls steps as they are.
        warmup: calls of a key that run as they are before it is captured.
        on_capture: told `(label, seconds)` of each capture (a compile log).
    """

    def __init__(
        self,
        what: str,
        on: bool = True,
        warmup: int = GRAPH_WARMUP_CALLS,
        on_capture: Callable[[str, float], None] | None = None,
    ):
        if warmup < 1:
            raise ValueError(f"warmup must be >= 1 (a capture needs a step that ran), got {warmup}")
        self.what = what
        self.on = on
        self.warmup = warmup
        self.on_capture = on_capture
        self._graphs: dict[Hashable, _Captured] = {}
        self._calls: Counter = Counter()
        self._pool = None
        self._bound: weakref.ref | None = None

    def __len__(self) -> int:
        return len(self._graphs)

    def bind(self, state: object) -> None:
        """Declare the state the steps read besides their arguments (a KV cache, whose tensors
        stay in place while it lives): when it is another object than at the last call, every
        graph is dropped (its capture recorded the old one's addresses) and keys warm up anew."""
        if self.on and (self._bound is None or self._bound() is not state):
            self.clear()
            self._bound = weakref.ref(state)

    def clear(self) -> None:
        """Forget every graph and the memory pool: a pool whose graphs are all gone cannot take
        a new capture (the CUDA caching allocator asserts its use count), so the next capture
        starts a fresh one."""
        self._graphs.clear()
        self._calls.clear()
        self._pool = None

    def run(self, key: Hashable, label: str, step: Callable, *args) -> Any:
        """`step(*args)`: as it is when not capturing or during the key's warm-up, else by
        replaying its graph. The
        key names everything the graph fixes that the caller may vary: the step, its tensor
        arguments' shapes and dtypes are added to it here. `label` names the capture in the
        log."""
        if not self.on:
            return step(*args)
        key = (key, *((tuple(a.shape), a.dtype) for a in args if isinstance(a, torch.Tensor)))
        captured = self._graphs.get(key)
        if captured is None:
            if self._calls[key] < self.warmup:
                self._calls[key] += 1
                return step(*args)
            captured = self._capture(key, label, step, args)
        for static, arg in zip(captured.inputs, args, strict=True):
            if isinstance(arg, torch.Tensor):
                static.copy_(arg)
        captured.replay()
        return captured.outputs

    def _capture(self, key: Hashable, label: str, step: Callable, args: tuple) -> _Captured:
        start = time.perf_counter()
        inputs = tuple(arg.clone() if isinstance(arg, torch.Tensor) else arg for arg in args)
        replay, outputs, self._pool = capture(step, inputs, self._pool)
        leaves = tree_flatten(outputs)[0]
        if any(leaf is not None and not isinstance(leaf, torch.Tensor) for leaf in leaves):
            raise TypeError(f"{self.what} {label}: a captured step returns tensors (or None) only")
        captured = self._graphs[key] = _Captured(replay, inputs, outputs)
        if self.on_capture is not None:
            self.on_capture(f"graph {label}", time.perf_counter() - start)
        return captured


# Where a drafter's module (an EAGLE head) keeps its `Resident`s between calls, by envelope.
RESIDENT_ATTRIBUTE = "_specdec_resident"


@dataclass
class Resident:
    """What drafters over one module keep on it between calls, for one envelope (every value the
    steps' capture fixes): the state the steps read (a KV cache) and their captured graphs. A
    later drafter of the envelope (each `generate` call of a registry spec makes a new one)
    replays what an earlier one captured. A drafter holds it from `attach` to `end` (`busy`);
    another drafter of the envelope meanwhile gets one of its own."""

    graphs: StepGraphs
    state: Any = None
    busy: bool = False

    def release(self) -> None:
        self.busy = False

    def cache(
        self, config, batch_size: int, capacity: int, dtype: torch.dtype, device: torch.device
    ) -> SpecKVCache:
        """The kept KV cache (`state`) for `batch_size` new sequences of `capacity` slots: the
        kept one when it fits (its addresses, which the graphs hold, unchanged), else a new one
        (the old storage freed first)."""
        cache = self.state
        if cache is not None and cache.fits(batch_size, capacity, dtype):
            cache.resize(batch_size)
            return cache
        self.state = None
        self.state = SpecKVCache(config, batch_size, capacity, dtype=dtype, device=device)
        return self.state


def resident(
    module: torch.nn.Module,
    key: Hashable,
    what: str,
    on: bool,
    on_capture: Callable[[str, float], None] | None = None,
    previous: Resident | None = None,
) -> Resident:
    """The `Resident` that `module` keeps for envelope `key` (made on first use, or a private
    one while it is held), held by the caller until its `release`; `previous`, the caller's
    earlier one (an attach again without an end), is released first."""
    if previous is not None:
        previous.release()
    held = kept(module, RESIDENT_ATTRIBUTE)
    entry = held.get((key, on))
    if entry is None or entry.busy:
        entry = Resident(StepGraphs(what, on, on_capture=on_capture))
        held.setdefault((key, on), entry)
    entry.busy = True
    return entry
