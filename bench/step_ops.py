"""Eager operators outside compiled graphs: what a step would launch one by one on a GPU.

A compiled step (inductor's graph, or a CUDA graph replay on a GPU) costs one dispatch; every
aten operator called outside one costs a kernel launch (5-10 us on a GPU) unless it only
reshapes metadata. `eager_ops(fn)` profiles one call of `fn` and counts the top-level operators
outside `Torch-Compiled Region`s whose call tree does work (a copy, arithmetic, an allocation
that fills memory); views, detaches and no-op conversions are free and not counted.
`ops_per_step` takes the difference between a short and a long `generate` so that the
once-per-call work (prefill, the drafter's attach and begin, argument checks) cancels out.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from torch.profiler import ProfilerActivity, profile

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


def _does_work(event) -> bool:
    if event.name not in NO_KERNEL:
        return True
    return any(
        _does_work(child)
        for child in event.cpu_children
        if child.name.startswith(OPERATOR_PREFIXES)
    )


def _outside_compiled(event) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith(OPERATOR_PREFIXES) or parent.name.startswith(COMPILED_REGION):
            return False
        parent = parent.cpu_parent
    return True


def eager_ops(fn: Callable[[], object]) -> tuple[Counter, object]:
    """Operators that `fn()` dispatches outside compiled graphs and that do work, by name, and
    `fn`'s result."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        result = fn()
    counts: Counter = Counter()
    for event in prof.events():
        if (
            event.name.startswith(OPERATOR_PREFIXES)
            and _outside_compiled(event)
            and _does_work(event)
        ):
            counts[event.name] += 1
    return counts, result


def ops_per_step(
    run: Callable[[int], object], short: int = 6, long: int = 30
) -> tuple[float, Counter]:
    """Eager operators per steady-state step of `run(max_new_tokens)` (which returns a
    `GenerateOutput`), from a short and a long run; and the long run's counts less the short's,
    by name."""
    short_counts, short_out = eager_ops(lambda: run(short))
    long_counts, long_out = eager_ops(lambda: run(long))
    steps = long_out.stats.steps - short_out.stats.steps
    if steps <= 0:
        raise ValueError("the long run took no more steps than the short one")
    difference = long_counts - short_counts
    total = sum(long_counts.values()) - sum(short_counts.values())
    return total / steps, difference
