"""What one steady-state step would launch one by one, and read back, on a GPU: counted on the CPU.

A compiled step (inductor's graph, or a CUDA graph replay on a GPU) costs one dispatch; every
operator called outside one costs a kernel launch (5-10 us on a GPU) unless it only reshapes
metadata, and every blocking device-to-host read drains the device's queue. This machine has no
GPU, so `counting()` runs `generate` as an accelerator would and counts:

- **Eager operators**: the top-level aten operators outside `Torch-Compiled Region`s whose call
  tree does work (a copy, arithmetic, an allocation that fills memory); views, detaches and
  no-op conversions are free and not counted. Three substitutions make the CPU's count what a
  GPU step launches:
  * our kernels called eagerly count as their Triton launches (`LAUNCHES`: verify's statistics
    and walk kernels, kv_compact's one), not as the aten operators of their CPU implementations;
  * `transfer.to_device` counts as one operator, the host-to-device copy, whatever the CPU
    dispatches to build the host tensor (there, the host tensor is the result, no copy);
  * the CPU shortcuts that read host-resident tensors (`transfer.host_resident`) are off, so
    the step takes the accelerator's path.
- **Blocking host reads**: `transfer.to_host` and `to_host_array`, and every implicit read a
  tensor offers (`tolist`, `item`, `bool(t)`, `int(t)`, ...) when made by the engine or a
  drafter; reads inside our kernels (device work on a GPU), torch or transformers are theirs,
  and those of a compiled graph's own code are inside its region (not counted, as operators).

`step_counts(run)` takes the difference between a short and a long `generate` so that the
once-per-call work (prefill, the drafter's attach and begin, argument checks) cancels out.
tests/test_step_budget.py holds every built-in drafter to one read and `MAX_EAGER_OPS` per step.

    python bench/step_ops.py 1 none ngram:8 eagle:tiny-code-eagle:8     # compiled, batch 1

prints the guard's counts (its prompts and runs) with each drafter's top operators and read sites.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from functools import wraps
from pathlib import Path
from unittest import mock

import torch
import transformers
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

import specdec_fast
from specdec_fast import transfer

# The limits of issue 44 for every built-in drafter, at batch 1 and 8 in compiled mode.
MAX_READS = 1
MAX_EAGER_OPS = 30
# The guard's runs: code prompts cut to PROMPT_TOKENS, short and long runs of new tokens.
PROMPT_TOKENS = 48
SHORT, LONG = 6, 20

# Operators that launch no kernel: views, aliases, metadata and allocation without a fill.
NO_KERNEL = frozenset(
    f"aten::{name}"
    for name in (
        "to",
        "view",
        "_unsafe_view",
        "reshape",
        "_reshape_alias",
        "unsqueeze",
        "squeeze",
        "select",
        "slice",
        "expand",
        "expand_as",
        "alias",
        "detach",
        "detach_",
        "lift_fresh",
        "resolve_conj",
        "resolve_neg",
        "as_strided",
        "t",
        "transpose",
        "permute",
        "unbind",
        "split",
        "chunk",
        "narrow",
        "empty",
        "empty_like",
        "empty_strided",
        "contiguous",
        "numpy_T",
        "view_as",
        "flatten",
        "unflatten",
        "movedim",
        "diagonal",
        "split_with_sizes",
        "is_nonzero",
        "item",
        "_local_scalar_dense",
        "set_",
        "result_type",
        "is_same_size",
    )  # fmt: skip
)
COMPILED_REGION = "Torch-Compiled Region"
OPERATOR_PREFIXES = ("aten::", "specdec_fast::")
# Functions that a GPU step runs as a fixed number of device operations, whatever their CPU
# implementation dispatches: (module, name) -> operators counted per call.
LAUNCHES = {
    ("specdec_fast.kernels.verify", "run_verify"): 2,  # statistics kernel, walk kernel
    ("specdec_fast.kernels.kv_compact", "run_kv_compact"): 1,
    ("specdec_fast.kernels.tree_attention", "run_tree_attention"): 1,
    ("specdec_fast.transfer", "to_device"): 1,  # the host-to-device copy
}
LAUNCH_PREFIX = "specdec_fast::launch."
# Reads made from these are not the engine's: our kernels (device work), the transfer module
# (its reads are counted as `to_host`), and the libraries underneath.
NOT_ENGINE = tuple(
    Path(module.__file__).resolve().parent for module in (specdec_fast.kernels, torch, transformers)
)
TRANSFER = Path(transfer.__file__).resolve()
# The code of a compiled graph that dynamo's `eager` backend runs as captured (an FX module's
# generated `forward`): its reads are operators inside the compiled region, as they are under
# any other backend (`aot_eager` and inductor run them as the graph's `_local_scalar_dense`).
GRAPH_CODE_PREFIX = "<eval_with_key>"
IMPLICIT_READS = ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


@dataclass
class Read:
    """One blocking host read: its kind (`to_host`, `tolist`, ...) and the calling line."""

    kind: str
    where: str


class _Event:
    """A CPU event of the profiler's trace and the events it encloses."""

    __slots__ = ("name", "start", "end", "children")

    def __init__(self, name: str, start: int, end: int):
        self.name, self.start, self.end = name, start, end
        self.children: list[_Event] = []


def _event_trees(raw_events) -> list[_Event]:
    """The roots of the trace's CPU events nested by enclosure on each thread (one event is
    another's child when it lies inside it), as `torch.autograd.profiler_util.EventList`
    nests them; built from kineto's raw events, without the per-event `FunctionEvent`s that
    `prof.events()` makes (seconds for the 100k events of a compiled run's graphs)."""
    threads: dict[int, list[_Event]] = {}
    for raw in raw_events:
        if raw.device_type() == DeviceType.CPU and not raw.is_async():
            event = _Event(raw.name(), raw.start_ns(), raw.end_ns())
            threads.setdefault(raw.start_thread_id(), []).append(event)
    roots: list[_Event] = []
    for events in threads.values():
        events.sort(key=lambda event: (event.start, -event.end))
        stack: list[_Event] = []
        for event in events:
            while stack and (event.start >= stack[-1].end or event.end > stack[-1].end):
                stack.pop()
            (stack[-1].children if stack else roots).append(event)
            stack.append(event)
    return roots


def _does_work(event: _Event) -> bool:
    if event.name not in NO_KERNEL:
        return True
    return any(
        _does_work(child) for child in event.children if child.name.startswith(OPERATOR_PREFIXES)
    )


def _outermost_operators(roots: list[_Event]) -> Iterator[_Event]:
    """The operators that no operator and no compiled region encloses."""
    pending = list(reversed(roots))
    while pending:
        event = pending.pop()
        if event.name.startswith(OPERATOR_PREFIXES):
            yield event
        elif not event.name.startswith(COMPILED_REGION):
            pending.extend(reversed(event.children))


def _library_modules() -> list:
    """Loaded modules of the library (kernels included), whose globals may hold a function that
    `counting` replaces."""
    return [
        module
        for name, module in list(sys.modules.items())
        if module is not None and name.split(".")[0] == "specdec_fast"
    ]


def patch_everywhere(stack: ExitStack, original, replacement) -> None:
    """Replace `original` in every library module that holds it (a module that imported the
    name holds its own reference)."""
    for module in _library_modules():
        for attribute, value in list(vars(module).items()):
            if value is original:
                stack.enter_context(mock.patch.object(module, attribute, replacement))


def _as_launch(function, name: str):
    @wraps(function)
    def launch(*args, **kwargs):
        with record_function(LAUNCH_PREFIX + name):
            return function(*args, **kwargs)

    return launch


@contextmanager
def counting() -> Iterator[list[Read]]:
    """Run the library as on an accelerator (the substitutions of the module docstring) and
    record its blocking host reads; yields the list of `Read`s, filled as they happen. Eager
    operators are counted by `eager_ops` around the call."""
    reads: list[Read] = []
    originals = {name: getattr(torch.Tensor, name) for name in IMPLICIT_READS}

    def implicit(name, original):
        def method(self, *args, **kwargs):
            frame = sys._getframe(1)
            caller = Path(frame.f_code.co_filename).resolve()
            engine = caller != TRANSFER and not any(caller.is_relative_to(p) for p in NOT_ENGINE)
            if engine and not frame.f_code.co_filename.startswith(GRAPH_CODE_PREFIX):
                reads.append(Read(name, f"{caller.name}:{frame.f_lineno}"))
            return original(self, *args, **kwargs)

        return method

    def explicit(name, convert):
        def read(tensor, *_):
            frame = sys._getframe(1)
            reads.append(Read(name, f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno}"))
            return convert(tensor)

        return read

    with ExitStack() as stack:
        for name, original in originals.items():
            stack.enter_context(mock.patch.object(torch.Tensor, name, implicit(name, original)))
        for (module, name), _ in LAUNCHES.items():
            function = getattr(sys.modules[module], name)
            patch_everywhere(stack, function, _as_launch(function, name))
        patch_everywhere(
            stack, transfer.to_host, explicit("to_host", lambda t: originals["tolist"](t))
        )
        patch_everywhere(
            stack,
            transfer.to_host_array,
            explicit("to_host_array", lambda t: originals["numpy"](originals["cpu"](t))),
        )
        patch_everywhere(stack, transfer.host_resident, lambda tensor: False)
        yield reads


def _weight(name: str) -> int:
    if not name.startswith(LAUNCH_PREFIX):
        return 1
    short = name.removeprefix(LAUNCH_PREFIX)
    return next(count for (_, function), count in LAUNCHES.items() if function == short)


def eager_ops(fn: Callable[[], object]) -> tuple[Counter, object]:
    """Operators that `fn()` dispatches outside compiled graphs and that do work, by name (a
    `LAUNCHES` function by its name, weighted by its launches), and `fn`'s result."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        result = fn()
    counts: Counter = Counter()
    for event in _outermost_operators(_event_trees(prof.profiler.kineto_results.events())):
        if _does_work(event):
            counts[event.name] += _weight(event.name)
    return counts, result


@dataclass
class StepCounts:
    """Per steady-state step: eager operators and blocking host reads (means over the steps
    the long run took beyond the short one), the operators by name and the reads by calling
    line (long run less short run), the steps they are spread over, and what compiled during
    the counted runs (nothing, once the runs were warmed)."""

    ops_per_step: float
    reads_per_step: float
    ops: Counter
    reads: Counter
    steps: int
    compiled: dict

    def row(self) -> str:
        steps = self.steps
        top = ", ".join(f"{name} {count / steps:.1f}" for name, count in self.ops.most_common(6))
        sites = ", ".join(f"{where} {count / steps:.1f}" for where, count in self.reads.items())
        return f"{self.ops_per_step:.1f} | {self.reads_per_step:.2f} | {top} | {sites}"


def step_counts(run: Callable[[int], object], short: int = SHORT, long: int = LONG) -> StepCounts:
    """Eager operators and host reads per steady-state step of `run(max_new_tokens)` (which
    returns a `GenerateOutput`), counted as on an accelerator (`counting`)."""
    measured = []
    for new_tokens in (short, long):
        with counting() as reads:
            ops, out = eager_ops(lambda n=new_tokens: run(n))
        measured.append((ops, Counter(f"{r.kind} {r.where}" for r in reads), out))
    (short_ops, short_reads, short_out), (long_ops, long_reads, long_out) = measured
    steps = long_out.stats.steps - short_out.stats.steps
    if steps <= 0:
        raise ValueError("the long run took no more steps than the short one")
    return StepCounts(
        (sum(long_ops.values()) - sum(short_ops.values())) / steps,
        (sum(long_reads.values()) - sum(short_reads.values())) / steps,
        long_ops - short_ops,
        long_reads - short_reads,
        steps,
        {**short_out.stats.compiled, **long_out.stats.compiled},
    )


def main(argv: list[str]) -> None:
    from specdec_fast import generate
    from specdec_fast.drafters.registry import DrafterSpec
    from specdec_fast.loading import load_model, load_tokenizer
    from specdec_fast.prompts import load_code_prompts

    torch.set_num_threads(1)
    batch, specs = int(argv[0]), argv[1:]
    target = load_model("tiny-code", torch.device("cpu"))
    tokenizer = load_tokenizer("tiny-code")
    prompts = [
        [tokenizer.bos_token_id, *tokenizer.encode(r["prompt"], add_special_tokens=False)]
        for r in load_code_prompts(batch)
    ]
    prompts = [prompt[:PROMPT_TOKENS] for prompt in prompts]
    print(f"| drafter (B={batch}) | eager ops | reads | top ops per step | read sites per step |")
    print("|---|---|---|---|---|")
    for spec in specs:
        make = (lambda: None) if spec == "none" else DrafterSpec.parse(spec).factory(target)

        def run(new_tokens, make=make):
            return generate(
                target,
                prompts,
                drafter=make(),
                max_new_tokens=new_tokens,
                eos_token_id=[],
                compile=True,
            )

        run(LONG)  # compiles
        print(f"| {spec} | {step_counts(run).row()} |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
