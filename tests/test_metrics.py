"""Prometheus text export of SpecStats: valid exposition lines, counters equal to the stats,
cumulative histograms, accumulation across calls, and guardrail route states."""

import re

import pytest
import torch
from tiny_models import repetitive_prompts, tiny_llama

from specdec_fast import NGramDrafter, generate
from specdec_fast.guardrails import Guardrails
from specdec_fast.metrics import LATENCY_BUCKETS_S, SpecMetrics, prometheus_text

SAMPLE = re.compile(r'^([a-z_]+)(\{([a-z_]+="(?:[^"\\]|\\.)*",?)*\})? (-?[0-9.e+-]+|\+Inf)$')


@pytest.fixture(scope="module")
def stats():
    model = tiny_llama()
    with torch.no_grad():
        out = generate(
            model,
            repetitive_prompts([20, 31], 96, seed=2),
            drafter=NGramDrafter(max_nodes=4),
            max_new_tokens=24,
        )
    return out.stats


def parse(text):
    """{(name, labels): value} of every sample, checking the line format and HELP/TYPE."""
    samples, typed = {}, set()
    for line in text.strip().splitlines():
        if line.startswith("# TYPE"):
            typed.add(line.split()[2])
            continue
        if line.startswith("# HELP"):
            continue
        match = SAMPLE.match(line)
        assert match, f"not a Prometheus sample line: {line!r}"
        name = match.group(1)
        assert any(name == t or name.startswith(t + "_") for t in typed), name
        labels = line[len(name) : line.rindex(" ")]
        samples[(name, labels)] = float(match.group(4))
    return samples


def test_counters_match_the_stats(stats):
    samples = parse(prometheus_text(stats, route="code"))
    label = '{route="code"}'
    assert samples[("specdec_requests_total", label)] == 2
    assert samples[("specdec_generated_tokens_total", label)] == stats.new_tokens
    assert samples[("specdec_drafted_tokens_total", label)] == stats.drafted_tokens
    assert samples[("specdec_accepted_tokens_total", label)] == stats.accepted_tokens
    assert samples[("specdec_acceptance_rate", label)] == pytest.approx(stats.acceptance_rate)
    assert samples[("specdec_fallbacks_total", label)] == 0
    offered = samples[("specdec_position_offered_total", '{route="code",position="1"}')]
    accepted = samples[("specdec_position_accepted_total", '{route="code",position="1"}')]
    assert accepted / offered == pytest.approx(stats.per_position_acceptance[0])


def test_histograms_are_cumulative_and_complete(stats):
    samples = parse(prometheus_text(stats))
    for name, values in (("ttft", stats.ttft), ("itl", stats.itl), ("tpot", stats.tpot)):
        family = f"specdec_{name}_seconds"
        buckets = [samples[(f"{family}_bucket", f'{{le="{b!r}"}}')] for b in LATENCY_BUCKETS_S]
        assert buckets == sorted(buckets)
        assert buckets == [sum(v <= b for v in values) for b in LATENCY_BUCKETS_S]
        assert samples[(f"{family}_bucket", '{le="+Inf"}')] == len(values)
        assert samples[(f"{family}_count", "")] == len(values)
        assert samples[(f"{family}_sum", "")] == pytest.approx(sum(values))


def test_accumulates_per_label_and_escapes(stats):
    metrics = SpecMetrics()
    metrics.observe(stats, tenant='a"b\\c')
    metrics.observe(stats, tenant='a"b\\c')
    metrics.observe(stats, tenant="other")
    samples = parse(metrics.render())
    assert samples[("specdec_requests_total", '{tenant="a\\"b\\\\c"}')] == 4
    assert samples[("specdec_requests_total", '{tenant="other"}')] == 2


def test_guardrail_route_states():
    guardrails = Guardrails()
    guardrails.route("code").record_quality_regression()  # the default policy allows none
    guardrails.route("qa")
    samples = parse(SpecMetrics().render(guardrails))
    assert samples[("specdec_route_speculating", '{route="code"}')] == 0
    assert samples[("specdec_route_speculating", '{route="qa"}')] == 1
    assert samples[("specdec_route_fallbacks_total", '{route="code"}')] == 1
