"""Guardrails: the YAML policy loader, online trip / cool-down / re-probe on a route, and the
fallback to plain decoding on drafter errors (outputs must stay identical to plain decoding)."""

import math

import pytest
import torch
from tiny_models import repetitive_prompts, tiny_llama

from specdec_fast import NGramDrafter, generate
from specdec_fast.drafters.base import Drafter, pack_trees
from specdec_fast.guardrails import (
    GuardedDrafter,
    GuardrailPolicy,
    Guardrails,
    RouteGuard,
)
from specdec_fast.wrapping import WrappedDrafter

VOCAB = 96
NEW_TOKENS = 40

VALID = """
speculative_decoding_guardrails:
  min_acceptance_rate: 0.3
  max_tpot_p95_regression: 0.2
  max_error_rate: 0.05
  max_quality_regression_cases: 1
  fallback_action: plain_decoding
  window_steps: 32
  routes:
    code:
      min_acceptance_rate: 0.6
    tenant-batch:
      fallback_action: log_only
"""


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab_size=VOCAB)


@pytest.fixture(scope="module")
def prompts():
    return repetitive_prompts([12, 19, 25], VOCAB, seed=3)


@pytest.fixture(scope="module")
def plain(target, prompts):
    """Plain greedy continuations, long enough for every request in this module."""
    with torch.no_grad():
        out = generate(target, prompts, drafter=None, max_new_tokens=NEW_TOKENS)
    return [s.tolist() for s in out.sequences]


def test_yaml_loads_default_and_route_policies(tmp_path):
    path = tmp_path / "guardrails.yaml"
    path.write_text(VALID)
    guardrails = Guardrails.from_yaml(path)
    assert guardrails.default.min_acceptance_rate == 0.3
    assert guardrails.default.window_steps == 32
    code = guardrails.policy("code")
    # A route overrides only the fields it names; the rest come from the section's defaults.
    assert code.min_acceptance_rate == 0.6 and code.max_error_rate == 0.05
    assert guardrails.policy("tenant-batch").fallback_action == "log_only"
    assert guardrails.policy("unknown-route") == guardrails.default
    assert Guardrails.from_yaml(VALID).policy("code") == code  # YAML text works too


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ("speculative_decoding_guardrails:\n  min_accept_rate: 0.3\n",
         r"speculative_decoding_guardrails\.min_accept_rate: unknown field \(did you mean "
         r"'min_acceptance_rate'\?\)"),
        ("speculative_decoding_guardrails:\n  routes:\n    code: {max_errors: 1}\n",
         r"speculative_decoding_guardrails\.routes\.code\.max_errors: unknown field"),
        ("speculative_decoding_guardrails:\n  min_acceptance_rate: 1.5\n",
         r"min_acceptance_rate: expected a number in \[0, 1\], got 1\.5"),
        ("speculative_decoding_guardrails:\n  max_error_rate: -0.1\n",
         r"max_error_rate: expected a number in \[0, 1\], got -0\.1"),
        ("speculative_decoding_guardrails:\n  max_tpot_p95_regression: -1\n",
         r"max_tpot_p95_regression: expected a number in \[0, inf\)"),
        ("speculative_decoding_guardrails:\n  max_quality_regression_cases: 0.5\n",
         r"max_quality_regression_cases: expected an integer >= 0, got 0\.5"),
        ("speculative_decoding_guardrails:\n  min_acceptance_rate: true\n",
         r"min_acceptance_rate: expected a number"),
        ("speculative_decoding_guardrails:\n  fallback_action: reboot\n",
         r"fallback_action: expected one of plain_decoding, log_only, got 'reboot'"),
        ("speculative_decoding_guardrails:\n  routes:\n    code: {window_steps: 0}\n",
         r"routes\.code\.window_steps: expected an integer >= 1, got 0"),
        ("speculative_decoding_guardrails:\n  window_steps: 8\n  min_window_steps: 9\n",
         r"min_window_steps: expected at most window_steps=8, got 9"),
        ("speculative_decoding_guardrails:\n  routes: [code]\n",
         r"routes: expected a mapping of route names"),
        ("guardrails:\n  min_acceptance_rate: 0.3\n",
         r"expected a top-level 'speculative_decoding_guardrails' mapping"),
    ],
)  # fmt: skip
def test_yaml_rejects_unknown_and_out_of_range_fields(document, message):
    with pytest.raises(ValueError, match=message):
        Guardrails.from_yaml(document)


class CollapsingOracle(Drafter):
    """Proposes the known greedy continuation (always accepted) while `good`, else tokens the
    target never picks (never accepted). `collapse_at` flips it to bad at that propose call."""

    def __init__(self, continuations, max_nodes=4):
        super().__init__(max_nodes)
        self.continuations = continuations
        self.good = True
        self.collapse_at = None
        self.calls = 0

    def propose(self, state):
        self.calls += 1
        if self.collapse_at is not None and self.calls >= self.collapse_at:
            self.good = False
        trees = []
        for tokens in state.tokens:
            full = next(c for c in self.continuations if c[: len(tokens)] == tokens)
            ahead = full[len(tokens) : len(tokens) + self.max_nodes - 1]
            if not self.good:
                ahead = [(t + 1) % VOCAB for t in ahead]
            trees.append((ahead, list(range(len(ahead)))))
        return pack_trees([t[-1] for t in state.tokens], trees, state.device)


def run(target, prompts, drafter, new_tokens=NEW_TOKENS):
    with torch.no_grad():
        out = generate(target, prompts, drafter=drafter, max_new_tokens=new_tokens)
    return [s.tolist() for s in out.sequences], out.stats


def test_route_trips_mid_request_falls_back_and_recovers_after_cooldown(target, prompts, plain):
    # The acceptance bound alone: with the default TPOT bound, the route compares the wall-clock
    # latency of its speculative steps with its own plain ones, and a loaded machine (CI's
    # parallel workers) could trip it again after the re-probe. The TPOT bound is tested on
    # recorded latencies below.
    policy = GuardrailPolicy(
        min_acceptance_rate=0.5,
        max_tpot_p95_regression=math.inf,
        window_steps=8,
        min_window_steps=8,
        cooldown_steps=30,
    )
    guardrails = Guardrails(routes={"code": policy})
    oracle = CollapsingOracle(plain)
    drafter = guardrails.wrap(oracle, "code")
    route = guardrails.route("code")

    # Good drafts, then acceptance collapses mid-request: the route trips within that request,
    # which finishes plainly with exactly the plain output.
    oracle.collapse_at = 4
    sequences, stats = run(target, prompts, drafter)
    assert sequences == plain
    assert route.fallbacks == 1 and not route.speculating
    assert "acceptance rate" in route.last_breach[0]
    assert any("tripped" in event for event in drafter.events)
    assert stats.fallbacks == len(drafter.events) >= 1
    calls_at_trip = oracle.calls

    # While cooling down, requests on the route decode plainly without calling the drafter.
    oracle.collapse_at, oracle.good = None, True
    sequences, stats = run(target, prompts, drafter)
    assert sequences == plain
    assert oracle.calls == calls_at_trip
    assert any("falling back" in event for event in drafter.events)
    assert stats.drafted_tokens == 0

    # The cool-down (30 plain steps) is over after that request: the next one re-probes, the
    # recovered drafter is accepted again, and the route stays on.
    sequences, stats = run(target, prompts, drafter)
    assert sequences == plain
    assert route.probes == 1 and route.speculating and route.fallbacks == 1
    assert oracle.calls > calls_at_trip
    assert stats.acceptance_rate == 1.0 and drafter.events == []


def test_log_only_counts_violations_but_keeps_speculating(target, prompts, plain):
    policy = GuardrailPolicy(
        min_acceptance_rate=0.5, window_steps=4, min_window_steps=4, fallback_action="log_only"
    )
    route = RouteGuard("tenant", policy)
    oracle = CollapsingOracle(plain)
    oracle.good = False
    sequences, _ = run(target, prompts, GuardedDrafter(oracle, route))
    assert sequences == plain
    assert route.speculating and route.fallbacks == 0 and route.violations >= 2


def test_tpot_regression_and_quality_bounds_trip_the_route():
    policy = GuardrailPolicy(
        min_acceptance_rate=0.0, max_tpot_p95_regression=0.2, window_steps=8, min_window_steps=8
    )
    route = RouteGuard("r", policy)
    route.set_plain_tpot_p95(0.010)
    for _ in range(8):
        route.record_speculative_step(drafted=4, accepted=2, token_latency=0.011)
    assert route.speculating  # +10% is within the allowed +20%
    for _ in range(8):
        route.record_speculative_step(drafted=4, accepted=2, token_latency=0.013)
    assert not route.speculating and "TPOT p95 regression" in route.last_breach[0]

    # Without a known baseline, plain latency measured on the route itself is the reference.
    measured = RouteGuard("m", policy)
    for _ in range(8):
        measured.record_plain_step(0.010)
    for _ in range(8):
        measured.record_speculative_step(drafted=4, accepted=2, token_latency=0.015)
    assert not measured.speculating

    quality = RouteGuard("q", GuardrailPolicy(max_quality_regression_cases=1))
    quality.record_quality_regression()
    assert quality.speculating
    quality.record_quality_regression()
    assert not quality.speculating and "quality regressions" in quality.last_breach[0]


class FailingNGram(NGramDrafter):
    """An n-gram drafter that raises in `where` on its `after`-th call there."""

    def __init__(self, where, after=3):
        super().__init__(max_nodes=6)
        self.where, self.after, self.calls = where, after, 0

    def _maybe_fail(self, where):
        if where == self.where:
            self.calls += 1
            if self.calls >= self.after:
                raise RuntimeError(f"injected failure in {where}")

    def attach(self, target, max_cache_len):
        self._maybe_fail("attach")

    def begin(self, state):
        self._maybe_fail("begin")
        super().begin(state)

    def propose(self, state):
        self._maybe_fail("propose")
        if self.where == "shape" and self.calls >= self.after:
            return pack_trees([0], [([1], [0])], state.device)  # one row for a batch of three
        self.calls += self.where == "shape"
        return super().propose(state)

    def update(self, state, outcome):
        self._maybe_fail("update")


@pytest.mark.parametrize(
    ("where", "after"),
    [("attach", 1), ("begin", 1), ("propose", 3), ("update", 2), ("shape", 3)],
)
def test_drafter_error_falls_back_with_identical_output(target, prompts, plain, where, after):
    route = RouteGuard("r", GuardrailPolicy(max_error_rate=1.0))
    drafter = GuardedDrafter(FailingNGram(where, after), route)
    sequences, stats = run(target, prompts, drafter)
    assert sequences == plain
    assert len(drafter.events) == 1 and "drafter error" in drafter.events[0]
    assert stats.fallbacks == 1
    assert route.errors == 1
    # Under another wrapper, `generate` reports the guard's fallbacks alike.
    sequences, stats = run(
        target, prompts, WrappedDrafter(GuardedDrafter(FailingNGram(where, after)))
    )
    assert sequences == plain and stats.fallbacks == 1
    # Without the guard the same failure fails the request.
    if where != "shape":
        with pytest.raises(RuntimeError, match="injected failure"):
            run(target, prompts, FailingNGram(where, after))


def test_error_rate_bound_trips_the_route(target, prompts, plain):
    route = RouteGuard("r", GuardrailPolicy(max_error_rate=0.01, min_window_steps=1))
    drafter = GuardedDrafter(FailingNGram("propose", 1), route)
    sequences, _ = run(target, prompts, drafter)
    assert sequences == plain
    assert not route.speculating and "error rate" in route.last_breach[0]


def test_a_route_that_is_off_leaves_the_draft_model_as_it_was(target, prompts, plain):
    """A route that is off at the start still attached the inner drafter (the draft model's
    runner switched its attention): `end` closes it, so the draft model answers plain calls."""
    from specdec_fast import DraftModelDrafter

    draft = tiny_llama(vocab_size=VOCAB, hidden_size=32, layers=1, seed=5)
    attention = draft.config._attn_implementation
    route = RouteGuard("off", GuardrailPolicy())
    route.speculating, route.cooldown_left = False, 10**6
    drafter = GuardedDrafter(DraftModelDrafter(draft, num_tokens=2), route)
    sequences, _ = run(target, prompts, drafter, new_tokens=8)
    assert sequences == [p[: len(q) + 8] for p, q in zip(plain, prompts, strict=True)]
    assert "falling back" in drafter.events[0]
    assert draft.config._attn_implementation == attention
    with torch.no_grad():
        draft(torch.tensor([prompts[0]]))  # raises if our attention were still switched on


ALIKE_POLICY = GuardrailPolicy(
    min_acceptance_rate=0.5,
    max_tpot_p95_regression=math.inf,  # wall-clock latencies differ between the two runs
    max_error_rate=0.1,
    window_steps=4,
    min_window_steps=2,
    cooldown_steps=1000,  # counts down every plain step after a trip: it shows each one
)


@pytest.mark.parametrize("read_ahead", [False, True], ids=["read each step", "read ahead"])
@pytest.mark.parametrize("case", ["good", "collapse", "propose", "update", "begin"])
def test_a_request_leaves_its_route_alike_through_generate_and_the_server(
    target, prompts, plain, case, read_ahead
):
    """Guardrails keep one account of a step (`RouteGuard.record_step`, `record_error`): one
    request through `generate` with a guarded drafter and through the server's scheduler, on a
    route of the same policy, leaves the route's guard in the same state (its window, errors,
    trips and cool-down), with plain decoding's output both ways. The server reading ahead
    (its plain steps after a trip queue) counts no step twice, nor the one queued past the
    request's end."""
    from specdec_fast.serving.scheduler import Request, Scheduler

    def make():
        if case in ("good", "collapse"):
            oracle = CollapsingOracle(plain)
            oracle.collapse_at = 4 if case == "collapse" else None
            return oracle
        return FailingNGram(case, 1 if case == "begin" else 2)

    through_generate = Guardrails(routes={"r": ALIKE_POLICY})
    drafter = through_generate.wrap(make(), "r")
    with torch.no_grad():
        out = generate(target, prompts[:1], drafter=drafter, max_new_tokens=24, eos_token_id=[])
    assert [s.tolist() for s in out.sequences] == [plain[0][: len(prompts[0]) + 24]]

    served = Guardrails(routes={"r": ALIKE_POLICY})
    scheduler = Scheduler(
        target, {"r": make()}, guardrails=served, eos_token_id=[], read_ahead=read_ahead
    )
    handle = scheduler.submit(Request(prompts[0], 24, route="r"))
    scheduler.run_until_idle()
    assert handle.completion.tokens == plain[0][len(prompts[0]) : len(prompts[0]) + 24]

    want = through_generate.route("r").snapshot()
    assert served.route("r").snapshot() == want
    # The cases reach what they are for: trips (acceptance, error rate), errors, neither. A
    # failed `begin` leaves one error step, short of the window's two: no trip.
    assert (want["fallbacks"], want["errors"]) == {
        "good": (0, 0),
        "collapse": (1, 0),
        "propose": (1, 1),
        "update": (1, 1),
        "begin": (0, 1),
    }[case], want
