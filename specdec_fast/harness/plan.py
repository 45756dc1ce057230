"""Planning a sweep: whether its steps compile on the CPU, and an ETA from measured cells.

Compiling pays on the CPU only when a sweep decodes long enough to win back the compilation:
every step shape (batch 1 or more, a decode step or a tree, each drafter's own loops) compiles
once per process, about 25 CPU seconds each here, and then runs `CPU_COMPILED_SPEEDUP` times
faster.
`choose_compile` takes the CPU time of an eager plain step on the sweep's first prompt,
extrapolates the eager sweep, and compiles when the time saved beats the compilations it would
need (CPU seconds on both sides: on a shared machine both stretch alike in wall time); the rule and
its figures are printed at the start. A GPU always compiles (its graphs are what make it fast).

`Eta` predicts the rest of a sweep from the cells measured so far, compilation left out: the
median seconds per decoding step of the cells at the same batch size (of any batch size before
one finishes), times the steps the remaining cells will run.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

# Measured on the 2-core CPU with the bundled tiny-code target, plain and n-gram at batch 1 and 4,
# eager and compiled calls in turns in one process (bench/results/harness-cpu-2026-12-05/
# compile-vs-eager.json): each step shape took 33-131 s of wall time to compile with the process
# at about a third of a core (the machine loaded 8x), about 25 CPU s, and compiled calls were
# 1.27-1.48x faster than eager ones.
CPU_COMPILE_S_PER_SHAPE = 25.0
CPU_COMPILED_SPEEDUP = 1.3


def step_shapes(batches: list[int], cells: list[tuple], drafter_kinds: int) -> int:
    """How many step shapes a compiled sweep compiles, roughly: per batch class (1, or 2 and
    more: the compiler keeps size 1 apart), the target's prefill and decode step for plain
    decoding, and again with each drafter kind, plus its tree verify (as measured: a drafter's
    first call recompiled the prefill and decode steps); other sizes reuse those (dynamic
    shapes)."""
    classes = len({min(batch, 2) for batch in batches})
    return classes * (2 + 3 * drafter_kinds) if cells else classes * 2


@dataclass
class CompileChoice:
    """The decision and the figures behind it (the report keeps them)."""

    compile: bool
    rule: str
    eager_estimate_s: float | None = None
    compile_estimate_s: float | None = None


def choose_compile(step_s: float, sweep_steps: int, shapes: int) -> CompileChoice:
    """Compile when the seconds an eager sweep would save by compiling exceed the seconds its
    `shapes` compilations take.

    step_s: measured CPU seconds of one eager plain-decoding step; sweep_steps: the steps of
    the whole sweep (`Eta.total_steps`), every cell counted at that cost."""
    eager = step_s * sweep_steps
    saved = eager * (1.0 - 1.0 / CPU_COMPILED_SPEEDUP)
    cost = shapes * CPU_COMPILE_S_PER_SHAPE
    compile = saved > cost
    rule = (
        f"CPU: compile when an eager sweep's saving at {CPU_COMPILED_SPEEDUP:g}x beats "
        f"{CPU_COMPILE_S_PER_SHAPE:g} CPU s per step shape: eager ~{eager:.0f} CPU s would save "
        f"~{saved:.0f} s, {shapes} shapes cost ~{cost:.0f} s -> "
        f"{'compiled' if compile else 'eager'} (--compile/--no-compile override)"
    )
    return CompileChoice(compile, rule, eager, cost)


def cell_steps(chunk_lengths: list[int], runs: int) -> int:
    """Decoding steps of one cell: each chunk's `max_new_tokens` (an upper bound, as plain
    decoding emits one token a step), once per run."""
    return sum(chunk_lengths) * runs


class Eta:
    """Seconds left in a sweep, from the cells measured so far.

    work: [(batch, steps)] of every cell in the order they run. A cell's time is its measured
    runs (compilation excluded), predicted per step as the median over the finished cells of the
    same batch size (of every batch size until one finishes: a cell slowed by other load on the
    machine does not skew the rest), plus its warm-up, predicted as the mean of the warm-ups so
    far (compilation included: a cell whose shapes are warm skips it)."""

    def __init__(self, work: list[tuple[int, int]]):
        self.work = work
        self.done = 0
        self._rates: dict[int, list[float]] = {}  # batch -> seconds per step of each cell
        self._warmups: list[float] = []

    @property
    def total_steps(self) -> int:
        return sum(steps for _, steps in self.work)

    def finished(self, measured_s: float, warmup_s: float) -> None:
        """The next cell finished: `measured_s` of timed runs, `warmup_s` of warm-up (0: its
        shapes were warm already)."""
        batch, steps = self.work[self.done]
        self._rates.setdefault(batch, []).append(measured_s / max(steps, 1))
        if warmup_s > 0:
            self._warmups.append(warmup_s)
        self.done += 1

    def seconds_left(self, warmups_left: int = 0) -> float | None:
        """Predicted seconds of the cells left, `warmups_left` of them to warm up; None until
        a cell has finished."""
        if not self._rates:
            return None
        overall = statistics.median(r for rates in self._rates.values() for r in rates)
        left = sum(
            steps * (statistics.median(self._rates[batch]) if batch in self._rates else overall)
            for batch, steps in self.work[self.done :]
        )
        if self._warmups:
            left += warmups_left * sum(self._warmups) / len(self._warmups)
        return left
