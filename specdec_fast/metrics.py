"""Prometheus text exposition of `SpecStats`, for a service embedding the engine (/metrics).

`SpecMetrics` accumulates the stats of every `generate` call (optionally labelled, e.g. by route
or tenant) and renders counters, gauges and histograms in the Prometheus text format 0.0.4;
`prometheus_text(stats)` does the same for one call. Guardrail route states (`Guardrails`) can be
rendered alongside.

    metrics = SpecMetrics()
    out = generate(...); metrics.observe(out.stats, route="code")
    body = metrics.render(guardrails)   # text/plain; version=0.0.4
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from dataclasses import dataclass, field

from specdec_fast.stats import SpecStats

LATENCY_BUCKETS_S = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip

Labels = tuple[tuple[str, str], ...]

_COUNTERS = {
    "requests_total": "Sequences generated.",
    "generated_tokens_total": "Tokens emitted.",
    "steps_total": "Verify steps, summed over sequences.",
    "drafted_tokens_total": "Draft tokens offered for verification.",
    "accepted_tokens_total": "Draft tokens accepted.",
    "fallbacks_total": "Fallbacks to plain decoding (guardrails or drafter errors).",
}
_HISTOGRAMS = {
    "ttft_seconds": "Time to first token.",
    "itl_seconds": "Inter-token latency (amortized over tokens emitted together).",
    "tpot_seconds": "Time per output token after the first, per sequence.",
}


@dataclass
class _Histogram:
    buckets: list[int] = field(default_factory=lambda: [0] * len(LATENCY_BUCKETS_S))
    total: float = 0.0
    count: int = 0

    def observe(self, value: float) -> None:
        index = bisect.bisect_left(LATENCY_BUCKETS_S, value)
        if index < len(self.buckets):
            self.buckets[index] += 1
        self.total += value
        self.count += 1


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(labels: Labels, extra: Labels = ()) -> str:
    pairs = labels + extra
    if not pairs:
        return ""
    return "{" + ",".join(f'{key}="{_escape(value)}"' for key, value in pairs) + "}"


def _number(value: float) -> str:
    return repr(float(value)) if isinstance(value, float) else str(value)


class SpecMetrics:
    """Cumulative counters and latency histograms over observed `SpecStats`, by label set."""

    def __init__(self, prefix: str = "specdec"):
        self.prefix = prefix
        self.counters: dict[str, dict[Labels, float]] = defaultdict(lambda: defaultdict(int))
        self.positions: dict[Labels, dict[int, list[int]]] = defaultdict(dict)
        self.histograms: dict[str, dict[Labels, _Histogram]] = defaultdict(
            lambda: defaultdict(_Histogram)
        )

    def observe(self, stats: SpecStats, **labels: str) -> None:
        """Add one `generate` call's stats under `labels` (e.g. route="code")."""
        key: Labels = tuple(sorted((k, str(v)) for k, v in labels.items()))
        sequences = stats.sequences
        values = {
            "requests_total": len(sequences),
            "generated_tokens_total": stats.new_tokens,
            "steps_total": sum(s.steps for s in sequences),
            "drafted_tokens_total": stats.drafted_tokens,
            "accepted_tokens_total": stats.accepted_tokens,
            "fallbacks_total": stats.total_fallbacks,
        }
        for name, value in values.items():
            self.counters[name][key] += value
        positions = self.positions[key]
        for seq in sequences:
            for depth, (offered, accepted) in enumerate(
                zip(seq.position_offered, seq.position_accepted, strict=True), start=1
            ):
                counts = positions.setdefault(depth, [0, 0])
                counts[0] += offered
                counts[1] += accepted
        for name, samples in (
            ("ttft_seconds", stats.ttft),
            ("itl_seconds", stats.itl),
            ("tpot_seconds", stats.tpot),
        ):
            histogram = self.histograms[name][key]
            for value in samples:
                histogram.observe(value)

    def render(self, guardrails=None) -> str:
        """The Prometheus text format of everything observed, plus guardrail route states."""
        p, lines = self.prefix, []

        def family(name: str, kind: str, help_text: str) -> None:
            lines.append(f"# HELP {p}_{name} {help_text}")
            lines.append(f"# TYPE {p}_{name} {kind}")

        for name, help_text in _COUNTERS.items():
            family(name, "counter", help_text)
            for labels, value in sorted(self.counters[name].items()):
                lines.append(f"{p}_{name}{_labels(labels)} {_number(value)}")
        family("acceptance_rate", "gauge", "Accepted over drafted tokens, cumulative.")
        for labels, drafted in sorted(self.counters["drafted_tokens_total"].items()):
            if drafted:
                rate = self.counters["accepted_tokens_total"][labels] / drafted
                lines.append(f"{p}_acceptance_rate{_labels(labels)} {_number(rate)}")
        for index, (name, help_text) in enumerate(
            (
                ("position_offered_total", "Steps that offered a draft node at this depth."),
                ("position_accepted_total", "Steps that accepted a draft node at this depth."),
            )
        ):
            family(name, "counter", help_text)
            for labels, positions in sorted(self.positions.items()):
                for depth, counts in sorted(positions.items()):
                    extra = (("position", str(depth)),)
                    lines.append(f"{p}_{name}{_labels(labels, extra)} {counts[index]}")
        for name, help_text in _HISTOGRAMS.items():
            family(name, "histogram", help_text)
            for labels, histogram in sorted(self.histograms[name].items()):
                cumulative = 0
                for bound, count in zip(LATENCY_BUCKETS_S, histogram.buckets, strict=True):
                    cumulative += count
                    extra = (("le", repr(bound)),)
                    lines.append(f"{p}_{name}_bucket{_labels(labels, extra)} {cumulative}")
                inf = (("le", "+Inf"),)
                lines.append(f"{p}_{name}_bucket{_labels(labels, inf)} {histogram.count}")
                lines.append(f"{p}_{name}_sum{_labels(labels)} {_number(histogram.total)}")
                lines.append(f"{p}_{name}_count{_labels(labels)} {histogram.count}")
        if guardrails is not None:
            lines.extend(_guardrail_lines(p, guardrails))
        return "\n".join(lines) + "\n"


# Guardrail route states: (name, kind, help, value of a `RouteGuard`); the serving metrics
# (`specdec_fast.serving.metrics`) export the same families.
ROUTE_FAMILIES = (
    (
        "route_speculating",
        "gauge",
        "1 while the route speculates, 0 while it falls back.",
        lambda g: int(g.speculating),
    ),
    (
        "route_fallbacks_total",
        "counter",
        "Times the route's guardrails switched it to plain decoding.",
        lambda g: g.fallbacks,
    ),
    (
        "route_probes_total",
        "counter",
        "Times the route probed speculation again after a cool-down.",
        lambda g: g.probes,
    ),
    (
        "route_drafter_errors_total",
        "counter",
        "Drafter errors on the route.",
        lambda g: g.errors,
    ),
)


def _guardrail_lines(prefix: str, guardrails) -> list[str]:
    routes = sorted(guardrails.routes.items())
    out = []
    for name, kind, help_text, value_of in ROUTE_FAMILIES:
        out.append(f"# HELP {prefix}_{name} {help_text}")
        out.append(f"# TYPE {prefix}_{name} {kind}")
        for route, guard in routes:
            out.append(f"{prefix}_{name}{_labels((('route', route),))} {value_of(guard)}")
    return out


def prometheus_text(stats: SpecStats, guardrails=None, prefix: str = "specdec", **labels) -> str:
    """The Prometheus text format of one call's `SpecStats` (see `SpecMetrics`)."""
    metrics = SpecMetrics(prefix)
    metrics.observe(stats, **labels)
    return metrics.render(guardrails)
