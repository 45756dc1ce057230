"""Speculation statistics: acceptance, latency and throughput, per sequence and aggregated.

Timing conventions (what a streaming client sees):
- TTFT: from the start of `generate` to the moment the sequence's first new token is known.
- ITL samples: one per emitted token after the first. A step that emits m tokens of a sequence at
  once, `gap` seconds after that sequence's previous emission, contributes m samples of `gap / m`
  (the amortized per-token latency); the raw gaps between emissions are kept as `emission_gaps`.
- TPOT: (time of the last token - time of the first token) / (tokens - 1), per sequence.
- Acceptance: `drafted` counts draft nodes offered (tree nodes except the root), `accepted` the
  draft
  tokens that were emitted. Per-position acceptance at depth d (1-based) is the share of steps that
  offered at least one node at depth d in which a node at depth d was accepted.
- Mean accepted tokens per step counts the bonus/correction token: (accepted + steps) / steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

PERCENTILES = (50, 95, 99)


def percentile(samples: list[float], q: float) -> float | None:
    """Linear-interpolated percentile `q` in [0, 100] of `samples`; None when there are none."""
    if not samples:
        return None
    ordered = sorted(samples)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _percentiles(samples: list[float]) -> dict[str, float | None]:
    return {f"p{q}": percentile(samples, q) for q in PERCENTILES}


def _ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator else None


@dataclass
class SequenceStats:
    """Counters and timings of one sequence of a `generate` call."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    position_offered: list[int] = field(default_factory=list)
    position_accepted: list[int] = field(default_factory=list)
    ttft: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    itl: list[float] = field(default_factory=list)
    emission_gaps: list[float] = field(default_factory=list)
    fallbacks: int = 0
    finish_reason: str | None = None

    def record_step(self, offered_depths: int, drafted: int, accepted: int) -> None:
        """One verify step: `drafted` nodes offered, reaching `offered_depths` levels deep;
        `accepted` of them emitted (the path length, root excluded)."""
        self.steps += 1
        self.drafted += drafted
        self.accepted += accepted
        grow = offered_depths - len(self.position_offered)
        if grow > 0:
            self.position_offered.extend([0] * grow)
            self.position_accepted.extend([0] * grow)
        for depth in range(offered_depths):
            self.position_offered[depth] += 1
        for depth in range(accepted):
            self.position_accepted[depth] += 1

    def record_emission(self, count: int, now: float, start: float) -> None:
        """`count` new tokens of this sequence became known at time `now` (perf_counter)."""
        if count <= 0:
            return
        if self.first_token_time is None:
            self.first_token_time = now
            self.ttft = now - start
            later = count - 1
            gap = 0.0
        else:
            later = count
            gap = now - self.last_token_time
            self.emission_gaps.append(gap)
        self.itl.extend([gap / count] * later)
        self.last_token_time = now
        self.new_tokens += count

    @property
    def tpot(self) -> float | None:
        if self.new_tokens < 2:
            return None
        return (self.last_token_time - self.first_token_time) / (self.new_tokens - 1)

    @property
    def acceptance_rate(self) -> float | None:
        return _ratio(self.accepted, self.drafted)

    @property
    def mean_accepted_per_step(self) -> float | None:
        return _ratio(self.accepted + self.steps, self.steps)

    def to_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "steps": self.steps,
            "drafted_tokens": self.drafted,
            "accepted_tokens": self.accepted,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_tokens_per_step": self.mean_accepted_per_step,
            "per_position_acceptance": [
                a / o for a, o in zip(self.position_accepted, self.position_offered, strict=True)
            ],
            "ttft_s": self.ttft,
            "tpot_s": self.tpot,
            "itl_s": _percentiles(self.itl),
            "fallbacks": self.fallbacks,
            "finish_reason": self.finish_reason,
        }


@dataclass
class SpecStats:
    """Statistics of one `generate` call: aggregates over `sequences` plus wall-clock totals."""

    sequences: list[SequenceStats] = field(default_factory=list)
    wall_time: float = 0.0
    peak_memory_bytes: int | None = None
    memory_device: str = "cpu"
    drafter: str | None = None
    fallbacks: int = 0
    # Step shapes this call compiled (or captured) for the first time, with the seconds their
    # first run took: what compilation cost this call; empty once every shape is warm.
    compiled: dict[str, float] = field(default_factory=dict)

    @property
    def steps(self) -> int:
        """Verify steps of the batch (a step advances every active sequence)."""
        return max((s.steps for s in self.sequences), default=0)

    @property
    def drafted_tokens(self) -> int:
        return sum(s.drafted for s in self.sequences)

    @property
    def accepted_tokens(self) -> int:
        return sum(s.accepted for s in self.sequences)

    @property
    def new_tokens(self) -> int:
        return sum(s.new_tokens for s in self.sequences)

    @property
    def acceptance_rate(self) -> float | None:
        return _ratio(self.accepted_tokens, self.drafted_tokens)

    @property
    def per_position_acceptance(self) -> list[float]:
        depth = max((len(s.position_offered) for s in self.sequences), default=0)
        offered = [0] * depth
        accepted = [0] * depth
        for seq in self.sequences:
            for d, (o, a) in enumerate(
                zip(seq.position_offered, seq.position_accepted, strict=True)
            ):
                offered[d] += o
                accepted[d] += a
        return [a / o for a, o in zip(accepted, offered, strict=True)]

    @property
    def mean_accepted_per_step(self) -> float | None:
        """Tokens emitted per sequence-step, counting the bonus/correction token."""
        sequence_steps = sum(s.steps for s in self.sequences)
        return _ratio(self.accepted_tokens + sequence_steps, sequence_steps)

    @property
    def ttft(self) -> list[float]:
        return [s.ttft for s in self.sequences if s.ttft is not None]

    @property
    def itl(self) -> list[float]:
        return [x for s in self.sequences for x in s.itl]

    @property
    def tpot(self) -> list[float]:
        return [s.tpot for s in self.sequences if s.tpot is not None]

    @property
    def tokens_per_second(self) -> float | None:
        return _ratio(self.new_tokens, self.wall_time)

    @property
    def total_fallbacks(self) -> int:
        return self.fallbacks + sum(s.fallbacks for s in self.sequences)

    def summary(self) -> dict:
        """Headline figures with p50/p95/p99 of TTFT, TPOT and ITL (seconds)."""
        return {
            "drafter": self.drafter,
            "sequences": len(self.sequences),
            "new_tokens": self.new_tokens,
            "steps": self.steps,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_tokens_per_step": self.mean_accepted_per_step,
            "per_position_acceptance": self.per_position_acceptance,
            "ttft_s": _percentiles(self.ttft),
            "tpot_s": _percentiles(self.tpot),
            "itl_s": _percentiles(self.itl),
            "tokens_per_second": self.tokens_per_second,
            "wall_time_s": self.wall_time,
            "peak_memory_bytes": self.peak_memory_bytes,
            "memory_device": self.memory_device,
            "fallbacks": self.total_fallbacks,
            "compiled_steps": self.compiled,
            "compile_seconds": sum(self.compiled.values()),
        }

    def to_dict(self) -> dict:
        """Everything, JSON-ready: the summary plus per-sequence records and raw ITL samples."""
        out = self.summary()
        out["per_sequence"] = [s.to_dict() for s in self.sequences]
        out["itl_samples_s"] = self.itl
        return out

    def one_line(self) -> str:
        """A short human-readable summary for command-line output."""
        parts = [f"{self.new_tokens} tokens in {self.wall_time:.2f}s"]
        if self.tokens_per_second is not None:
            parts.append(f"{self.tokens_per_second:.1f} tok/s")
        if self.acceptance_rate is not None:
            parts.append(f"acceptance {self.acceptance_rate:.1%}")
        if self.mean_accepted_per_step is not None:
            parts.append(f"{self.mean_accepted_per_step:.2f} tokens/step")
        ttft = percentile(self.ttft, 50)
        if ttft is not None:
            parts.append(f"TTFT p50 {ttft * 1e3:.1f} ms")
        tpot = percentile(self.tpot, 50)
        if tpot is not None:
            parts.append(f"TPOT p50 {tpot * 1e3:.1f} ms")
        if self.compiled:
            parts.append(
                f"compiled {len(self.compiled)} step shapes in {sum(self.compiled.values()):.1f}s"
            )
        if self.total_fallbacks:
            parts.append(f"{self.total_fallbacks} fallbacks")
        return ", ".join(parts)
