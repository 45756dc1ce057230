"""Compiled steps: `torch.compile` of the runners' and drafters' own step functions, the switch
that turns it on (`SPECDEC_COMPILE`, or the compile choice of the call in progress), the
freezing of CPU runners' weights into their graphs (`SPECDEC_FREEZE`, default on for models of
up to 1 GiB), the log of every compilation in this process and the notice that one has started
(a first call of a step shape compiles for tens of seconds on a CPU before its first step)."""

import gc
import os
import time
import types
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
from torch._dynamo.callback import callback_handler
from torch._prims_common import make_contiguous_strides_for

from specdec_fast.notices import notice

COMPILE_ENV = "SPECDEC_COMPILE"
FREEZE_ENV = "SPECDEC_FREEZE"
# Without SPECDEC_FREEZE, CPU runners freeze models of up to this many bytes of weights.
FREEZE_MAX_BYTES = 1 << 30
# Graphs one compiled step may hold (dynamo's own limit, 8, is for arbitrary code): a runner's
# verify step needs one per pattern of its hooks (each drafter kind captures its own target
# layers), of its tree's mask words (N < 32, N = 32, 33-63, 64) and of batch 1 or more, and a
# process that tries several drafters over one target, as the benchmarks do, met dynamo's limit
# and ran the later drafters' steps eagerly.
STEP_RECOMPILE_LIMIT = 64

# (what compiled, seconds) of every compilation and graph capture in this process, in order:
# `generate` reports the ones its call made (`SpecStats.compiled`), drafters' too.
COMPILE_LOG: list[tuple[str, float]] = []


# What the `CompiledSteps.run` call in progress on this thread would compile ("llama verify B=1
# N=8"), for the notice given when dynamo starts compiling (`_announce`); None outside one.
_RUNNING: ContextVar[str | None] = ContextVar("specdec_compiled_step", default=None)


def _announce(_args) -> None:
    """Dynamo's start-of-compilation callback: say which step compiles, when one of ours does."""
    label = _RUNNING.get()
    if label is not None:
        notice(
            f"compiling {label}: the first call of this step shape compiles it (10-30 s on a "
            "CPU, longer on a loaded one; later calls of the shape reuse it)"
        )


def _announce_compilations() -> None:
    """Register `_announce` with dynamo unless it is registered: `torch._dynamo.reset()` (which
    `torch.compiler.reset()` and inductor's code-inspecting utilities call) clears dynamo's
    callbacks, so a flag set once per process would leave the notices off for good."""
    if _announce not in callback_handler.start_callbacks:
        callback_handler.register_start_callback(_announce)


# The compile choice of the `generate` call or scheduler attaching drafters (`compile_choice`).
_CHOICE: ContextVar[bool | None] = ContextVar("specdec_compile_choice", default=None)


@contextmanager
def compile_choice(compile: bool | None) -> Iterator[None]:
    """Within the block, `compile_by_default()` answers `compile` (None changes nothing):
    `generate(compile=...)` and the scheduler attach drafters in it, so that drafters' own
    models and steps follow the call's choice."""
    token = _CHOICE.set(compile if compile is not None else _CHOICE.get())
    try:
        yield
    finally:
        _CHOICE.reset(token)


def _switch(name: str, default: str) -> bool:
    value = os.environ.get(name, default).strip().lower()
    if value not in ("0", "1", "false", "true", "no", "yes", "off", "on", ""):
        raise ValueError(f"{name} must be 0 or 1, got {value!r}")
    return value in ("1", "true", "yes", "on", "")


def compile_by_default() -> bool:
    """Whether runners and drafters compile their steps when not told: the choice of the call
    in progress (`compile_choice`), else `SPECDEC_COMPILE` (default on)."""
    chosen = _CHOICE.get()
    if chosen is not None:
        return chosen
    return _switch(COMPILE_ENV, "1")


def freeze_by_default(weight_bytes: int) -> bool:
    """Whether a runner on the CPU over `weight_bytes` of weights compiles its steps with
    inductor's freezing (`CompiledStep`'s `weights`): `SPECDEC_FREEZE` when set (0 or 1), else
    for models of up to `FREEZE_MAX_BYTES`. Freezing keeps a prepacked copy of every linear
    weight beside the model's own, so larger models keep their memory unless asked; on the
    bundled pair it made speculative decoding 1.16-1.28x faster (multi-row GEMMs on prepacked
    weights) and plain decoding 1.07x (bench/results/freeze-cpu.md)."""
    if not os.environ.get(FREEZE_ENV, "").strip():
        return weight_bytes <= FREEZE_MAX_BYTES
    return _switch(FREEZE_ENV, "0")


def weights_fingerprint(weights: Iterable[torch.Tensor]) -> tuple:
    """What changes when a weight is replaced, moved or changed in place (its storage and its
    version counter; a change through `.data` bumps neither and goes unseen)."""
    return tuple((weight.data_ptr(), weight._version) for weight in weights)


def graphs_compiled() -> int:
    """Graphs dynamo has compiled in this process so far."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def compile_own_copy(step: Callable) -> Callable:
    """`torch.compile(step, fullgraph=True)` of a function or bound method, on its own copy of the
    code.

    Dynamo keeps graphs (and counts them against its recompile limit) per code object: with a
    copy each, runners of different models, or of one model's prefill and verify, and drafters'
    own steps neither evict nor exhaust each other's graphs.
    """
    function = getattr(step, "__func__", step)
    own_code = types.FunctionType(
        function.__code__.replace(),
        function.__globals__,
        function.__name__,
        function.__defaults__,
        function.__closure__,
    )
    owner = getattr(step, "__self__", None)
    return torch.compile(own_code if owner is None else own_code.__get__(owner), fullgraph=True)


def record_compile(label: str, seconds: float) -> None:
    """Log a compilation or graph capture (`COMPILE_LOG`), then collect and freeze the heap."""
    COMPILE_LOG.append((label, seconds))
    # Compiling leaves millions of long-lived objects (graphs, guards, generated code); each
    # full collection of the garbage collector walked them all, a 250 ms pause in the middle
    # of a later call. Frozen, they are skipped (vLLM's engine freezes its startup heap too).
    gc.collect()
    gc.freeze()


def _plain(arg: Any) -> Any:
    """`arg` as a graph's input should be: a tensor with the strides of a new one of its shape
    (else a copy), not a view (else a detached alias). A graph guards on its inputs' strides,
    size-1 dimensions' included, and on views' bases: a step's outcome cut to a drafter's tree,
    or the cached part of a padded prompt, would compile graphs of their own beside the one for
    whole tensors."""
    if not isinstance(arg, torch.Tensor) or (arg._base is None and arg.is_contiguous()):
        return arg
    if arg.stride() != make_contiguous_strides_for(arg.shape):
        return arg.clone(memory_format=torch.contiguous_format)
    return arg.detach()


def _tensor_shapes(args: tuple) -> tuple:
    return tuple(tuple(arg.shape) if isinstance(arg, torch.Tensor) else None for arg in args)


class CompiledStep:
    """`step` through `torch.compile` on its own code (`compile_own_copy`), compiled on first use.

    A step reads its tensor arguments and never writes them (a captured graph's replay copies them
    into buffers of its own): a view is passed as a detached alias, and a tensor strided otherwise
    than a new one of its shape as a copy (`_plain`), so that neither compiles a graph of its own.
    Every dimension of the tensor arguments is dynamic, except that the compiler keeps sizes 0 and 1
    apart: a step has a graph per pattern of such sizes (batch 1 or 2+, a decode step or a tree).
    The dimensions are marked at every call (about 6 us a step): a graph recompiled for another
    reason (a guard on the runner's hooks or a drafter's attributes) must come out dynamic too, or
    the next new size would compile once more. A call that compiled a graph returns the seconds it
    took. A step holds up to `recompile_limit` graphs (`STEP_RECOMPILE_LIMIT`; once it holds nearly
    as many as dynamo's global limit allows, its calls run under its own); past that limit a shape
    runs eagerly from then on, with a warning naming `what`.

    `weights`, when given, lists the module weights the step reads: the step then compiles with
    inductor's freezing (the weights become constants of the graph, prepacked for the CPU's
    GEMMs, linears that share an input concatenated). A replaced weight fails the identity
    guards dynamo puts on frozen parameters and recompiles; a moved or updated one changes
    `weights_fingerprint` of the list taken when the step last compiled, and the step compiles
    anew on a fresh copy of its code: old constants are never served. The list is taken once per
    compilation (walking a model's modules costs 170 us), the fingerprint each call (10 us for
    60 weights).
    """

    def __init__(
        self,
        step: Callable,
        what: str,
        weights: Callable[[], Iterable[torch.Tensor]] | None = None,
        recompile_limit: int = STEP_RECOMPILE_LIMIT,
    ):
        if recompile_limit < 1:
            raise ValueError(f"recompile_limit must be >= 1, got {recompile_limit}")
        self.step = step
        self.what = what
        self.weights = weights
        self.recompile_limit = recompile_limit
        self._compiled: Callable | None = None
        self._weight_list: list[torch.Tensor] | None = None
        self._fingerprint: tuple | None = None
        self._eager_shapes: set[tuple] = set()
        self._graphs = 0

    def __call__(self, *args) -> tuple[Any, float | None]:
        """`(step(*args), seconds)`; `seconds` is None unless this call compiled a graph."""
        # The shapes tuple costs a few us a step: built only once a shape has run eagerly.
        if self._eager_shapes and _tensor_shapes(args) in self._eager_shapes:
            return self.step(*args), None
        if self.weights is not None and (
            self._weight_list is None or weights_fingerprint(self._weight_list) != self._fingerprint
        ):
            self._take_weights()
            self._compiled = None
        if self._compiled is None:
            self._compiled = compile_own_copy(self.step)
            self._graphs = 0  # graphs of this code copy
        args = tuple(_plain(arg) for arg in args)
        for tensor in args:
            if isinstance(tensor, torch.Tensor):
                for dim in range(tensor.dim()):
                    torch._dynamo.maybe_mark_dynamic(tensor, dim)
        graphs_before = graphs_compiled()
        start = time.perf_counter()
        try:
            out = self._call_compiled(args)
        except torch._dynamo.exc.FailOnRecompileLimitHit:
            shapes = _tensor_shapes(args)
            warnings.warn(
                f"specdec-fast: {self.what} met torch.compile's recompile limit; shape "
                f"{next((shape for shape in shapes if shape is not None), ())} runs eagerly",
                stacklevel=3,
            )
            self._eager_shapes.add(shapes)
            return self.step(*args), None
        if graphs_compiled() > graphs_before:
            self._graphs += graphs_compiled() - graphs_before
            if self.weights is not None:
                self._take_weights()  # a recompilation may have met replaced weights
            return out, time.perf_counter() - start
        return out, None

    def _call_compiled(self, args: tuple) -> Any:
        limit = torch._dynamo.config.recompile_limit
        if self._graphs + 1 < limit or self.recompile_limit <= limit:
            return self._call_frozen(args)
        # Near dynamo's limit, the step's own: patching costs 16 us a call, paid only by a step
        # holding that many graphs.
        with torch._dynamo.config.patch(recompile_limit=self.recompile_limit):
            return self._call_frozen(args)

    def _call_frozen(self, args: tuple) -> Any:
        if self.weights is None:
            return self._compiled(*args)
        # Dynamo reads the switch when it traces (parameters become static inputs, guarded by
        # identity), inductor when it compiles: `options=` alone reaches only inductor.
        with torch._inductor.config.patch(freezing=True):
            return self._compiled(*args)

    def _take_weights(self) -> None:
        self._weight_list = list(self.weights())
        self._fingerprint = weights_fingerprint(self._weight_list)


class KeptSteps(dict):
    """What a module keeps between calls, by options: a model its runners (by device, compile,
    CUDA graphs, exact), a draft head its compiled steps (`module_steps`). A copied or pickled
    module starts with none (compiled steps belong to their module)."""

    def __deepcopy__(self, memo) -> "KeptSteps":
        return KeptSteps()

    def __reduce__(self):
        return (KeptSteps, ())


def kept(module: torch.nn.Module, attribute: str) -> KeptSteps:
    """The `KeptSteps` that `module` holds under `attribute`, made on first use: in the
    instance dict, not through `nn.Module.__setattr__` (what it keeps are no submodules)."""
    held = module.__dict__.get(attribute)
    if not isinstance(held, KeptSteps):
        held = module.__dict__[attribute] = KeptSteps()
    return held


# Where a draft head keeps its compiled steps between calls (as a model keeps its runners).
STEPS_ATTRIBUTE = "_specdec_steps"


def module_steps(module: torch.nn.Module, name: str) -> "CompiledSteps":
    """The compiled steps of a drafter's own module (an EAGLE head, Medusa heads) for the compile
    choice of the call in progress, kept on the module: a later drafter over the same module
    (each `generate` call of a registry spec makes a new one) compiles nothing. On the CPU the
    module's weights are frozen into the graphs as a runner's are (`freeze_by_default`); the
    target's weights that the steps read too (embeddings, LM head) are guarded by identity."""
    compile = compile_by_default()
    first = next(module.parameters())
    size = sum(w.numel() * w.element_size() for w in module.parameters())
    freeze = compile and first.device.type == "cpu" and freeze_by_default(size)
    steps = kept(module, STEPS_ATTRIBUTE)
    key = (str(first.device), first.dtype, compile, freeze)
    if key not in steps:

        def weights() -> Iterator[torch.Tensor]:
            yield from module.parameters()
            yield from module.buffers()

        steps[key] = CompiledSteps(name, compile, weights if freeze else None)
    return steps[key]


class CompiledSteps:
    """One model's steps by kind (a prefill, a verify, a draft loop, ...), each through its own
    `CompiledStep`, made on first use: the compile cache that the target's `ModelRunner` and the
    drafters' heads share.

    Args:
        model: what the steps run, for labels and warnings (e.g. "llama").
        compile: run the steps through `torch.compile`; when False, `run` calls them as they are.
        weights: the weights the steps read, for inductor's freezing (`CompiledStep`'s
            `weights`); None compiles unfrozen.

    `compile_seconds` maps each label passed to `run` whose call compiled a graph to the
    seconds it took; every compilation is also logged (`record_compile`), and its start is told
    (`specdec_fast.notices`): "compiling MODEL LABEL ...".
    """

    def __init__(
        self,
        model: str,
        compile: bool,
        weights: Callable[[], Iterable[torch.Tensor]] | None = None,
    ):
        self.model = model
        self.compile = compile
        self.weights = weights
        self.compile_seconds: dict[str, float] = {}
        self._steps: dict[str, CompiledStep] = {}

    def run(self, kind: str, label: str, step: Callable, *args) -> Any:
        """`step(*args)` with no grad, through the compiled step of `kind` when compiling; a call
        that compiled a graph is logged under `label`."""
        with torch.no_grad():
            if not self.compile:
                return step(*args)
            compiled = self._steps.get(kind)
            if compiled is None:
                what = f"the {kind} step of this {self.model} model"
                compiled = self._steps[kind] = CompiledStep(step, what, self.weights)
            _announce_compilations()
            running = _RUNNING.set(f"{self.model} {label}")
            try:
                out, seconds = compiled(*args)
            finally:
                _RUNNING.reset(running)
        if seconds is not None:
            self.record(label, seconds)
        return out

    def record(self, label: str, seconds: float) -> None:
        """Log a compilation or graph capture of this model's steps."""
        self.compile_seconds[label] = seconds
        record_compile(f"{self.model} {label}", seconds)
