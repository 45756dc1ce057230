"""Guardrails: switch speculation off for a route where it stops paying, and survive drafter errors.

A `GuardrailPolicy` bounds what speculation may cost on a route (a task type, a tenant, ...). A
`RouteGuard` evaluates it online over a rolling window of speculative steps; when a bound breaks,
the route falls back to plain decoding (counted in `fallbacks`), and after `cooldown_steps` plainly
decoded steps the next request on the route probes speculation again with a fresh window.

`GuardedDrafter(drafter, guard)` applies this inside `generate` without touching the engine: a
route that is off, or an exception anywhere in the drafter, makes it propose the root alone, which
is one step of plain decoding. Greedy outputs are therefore identical with or without fallbacks,
and sampled outputs keep the target's distribution. A drafter that fails, or a route that trips,
is left alone for the rest of that request (its state no longer follows the tokens), so a request
never returns to speculation halfway; the next request starts afresh.

YAML form (`Guardrails.from_yaml`); top-level fields are the default policy, `routes` override
them per route:

    speculative_decoding_guardrails:
      min_acceptance_rate: 0.3
      max_tpot_p95_regression: 0.10
      max_error_rate: 0.01
      max_quality_regression_cases: 0
      fallback_action: plain_decoding
      window_steps: 64
      routes:
        code: {min_acceptance_rate: 0.5}
        tenant-batch: {fallback_action: log_only}
"""

from __future__ import annotations

import difflib
import math
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from specdec_fast.drafters.base import (
    Drafter,
    DraftState,
    Proposal,
    StepOutcome,
    reads_ahead,
    root_only,
)
from specdec_fast.drafters.checks import checked, malformed_error
from specdec_fast.files import FileFormatError, parse_yaml
from specdec_fast.stats import percentile
from specdec_fast.wrapping import WrappedDrafter

SECTION = "speculative_decoding_guardrails"
FALLBACK_ACTIONS = ("plain_decoding", "log_only")
DEFAULT_ROUTE = "default"


def _number(name: str, value, low: float, high: float = math.inf) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        upper = "inf)" if high == math.inf else f"{high:g}]"
        raise ValueError(f"{name}: expected a number in [{low:g}, {upper}, got {value!r}")


def _count(name: str, value, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name}: expected an integer >= {low}, got {value!r}")


@dataclass(frozen=True)
class GuardrailPolicy:
    """Bounds on speculation for one route, evaluated over the last `window_steps` speculative
    steps once at least `min_window_steps` are in.

    min_acceptance_rate: accepted / drafted tokens, in [0, 1].
    max_tpot_p95_regression: allowed relative excess of the p95 per-token latency over plain
        decoding's (0.1 = 10% slower); plain latency comes from `RouteGuard.set_plain_tpot_p95`
        (e.g. a benchmark baseline) or from the route's own plainly decoded steps.
    max_error_rate: drafter errors per speculative step, in [0, 1].
    max_quality_regression_cases: quality regressions reported to the route
        (`RouteGuard.record_quality_regression`) tolerated per probe period.
    fallback_action: "plain_decoding" (turn speculation off, re-probe after the cool-down) or
        "log_only" (count the violation, keep speculating).
    cooldown_steps: plainly decoded steps on the route before speculation is probed again.
    """

    min_acceptance_rate: float = 0.1
    max_tpot_p95_regression: float = 0.1
    max_error_rate: float = 0.01
    max_quality_regression_cases: int = 0
    fallback_action: str = "plain_decoding"
    window_steps: int = 64
    min_window_steps: int = 16
    cooldown_steps: int = 256

    def __post_init__(self) -> None:
        _number("min_acceptance_rate", self.min_acceptance_rate, 0.0, 1.0)
        _number("max_tpot_p95_regression", self.max_tpot_p95_regression, 0.0)
        _number("max_error_rate", self.max_error_rate, 0.0, 1.0)
        _count("max_quality_regression_cases", self.max_quality_regression_cases, 0)
        if self.fallback_action not in FALLBACK_ACTIONS:
            raise ValueError(
                f"fallback_action: expected one of {', '.join(FALLBACK_ACTIONS)}, "
                f"got {self.fallback_action!r}"
            )
        _count("window_steps", self.window_steps, 1)
        _count("min_window_steps", self.min_window_steps, 1)
        if self.min_window_steps > self.window_steps:
            raise ValueError(
                f"min_window_steps: expected at most window_steps={self.window_steps}, "
                f"got {self.min_window_steps}"
            )
        _count("cooldown_steps", self.cooldown_steps, 0)

    @classmethod
    def from_mapping(
        cls, values: Mapping, where: str = SECTION, base: GuardrailPolicy | None = None
    ) -> GuardrailPolicy:
        """A policy from `values` (unknown fields rejected), unset fields taken from `base`.
        Errors name the field by its path from `where`."""
        if not isinstance(values, Mapping):
            raise ValueError(f"{where}: expected a mapping of policy fields, got {values!r}")
        known = [f.name for f in fields(cls)]
        for key in values:
            if key not in known:
                close = difflib.get_close_matches(str(key), known, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ValueError(
                    f"{where}.{key}: unknown field{hint}; known fields: {', '.join(known)}"
                )
        merged = asdict(base or cls()) | dict(values)
        try:
            return cls(**merged)
        except ValueError as error:
            raise ValueError(f"{where}.{error}") from None


def _token_latency(seconds: float, emitted: list[list[int]]) -> float | None:
    """Seconds per emitted token of a row, over the rows that emitted `emitted` in a step of
    `seconds` (None when they emitted nothing): what a guard's latency bound judges."""
    tokens = sum(len(e) for e in emitted)
    return seconds * len(emitted) / tokens if tokens else None


@dataclass
class _Step:
    drafted: int
    accepted: int
    error: bool
    token_latency: float | None  # seconds per emitted token of a row in this step


class RouteGuard:
    """The online state of one route: its window of speculative steps and its fallback state."""

    def __init__(self, name: str, policy: GuardrailPolicy):
        self.name = name
        self.policy = policy
        self.window: deque[_Step] = deque(maxlen=policy.window_steps)
        self.plain_latency: deque[float] = deque(maxlen=policy.window_steps)
        self.plain_tpot_p95: float | None = None
        self.speculating = True
        self.cooldown_left = 0
        self.quality_cases = 0
        self.fallbacks = 0
        self.probes = 0
        self.violations = 0
        self.errors = 0
        self.last_breach: list[str] = []

    def set_plain_tpot_p95(self, seconds: float | None) -> None:
        """A known plain-decoding p95 per-token latency (e.g. from a benchmark baseline)."""
        self.plain_tpot_p95 = seconds

    def allows_speculation(self) -> bool:
        """Whether a request starting now may speculate (re-probes once the cool-down is over)."""
        if not self.speculating and self.cooldown_left <= 0:
            self.speculating = True
            self.probes += 1
            self._reset_window()
        return self.speculating

    def record_speculative_step(
        self, drafted: int, accepted: int, token_latency: float | None, error: bool = False
    ) -> None:
        self.window.append(_Step(drafted, accepted, error, token_latency))
        self.errors += int(error)
        if len(self.window) >= self.policy.min_window_steps:
            self._evaluate()

    def record_step(
        self,
        seconds: float,
        plain: list[list[int]],
        speculated: list[list[int]] | None = None,
        drafted: int = 0,
        accepted: int = 0,
        error: bool = False,
    ) -> bool:
        """One decode step of the route, `seconds` long: the one account of a step for
        `generate`'s guarded drafters and the server's routes alike. `plain` holds the tokens
        its plainly decoded rows emitted (a cool-down counts these steps), `speculated` those of
        its speculating rows (None: none speculated), which drafted `drafted` tokens and had
        `accepted` of them accepted; `error`: the drafter failed in the step after its proposal
        was verified (a malformed proposal, an exception in `update`). Returns whether the
        route still speculates: when not, its rows fall back to plain decoding."""
        if plain:
            self.record_plain_step(_token_latency(seconds, plain))
        if speculated is not None:
            self.record_speculative_step(
                drafted, accepted, _token_latency(seconds, speculated), error
            )
        return self.speculating

    def record_error(self) -> None:
        """A drafter failure outside a verified step (attach, begin, join, propose, keep): an
        error step that drafted nothing."""
        self.record_speculative_step(0, 0, None, error=True)

    def record_plain_step(self, token_latency: float | None) -> None:
        if token_latency is not None:
            self.plain_latency.append(token_latency)
        if not self.speculating:
            self.cooldown_left -= 1

    def record_quality_regression(self, cases: int = 1) -> None:
        """Outputs that failed a quality check that plain decoding passes."""
        self.quality_cases += cases
        self._evaluate()

    def breaches(self) -> list[str]:
        """The bounds the current window breaks, in words (empty when within policy)."""
        policy, out = self.policy, []
        steps = list(self.window)
        drafted = sum(s.drafted for s in steps)
        if drafted:
            rate = sum(s.accepted for s in steps) / drafted
            if rate < policy.min_acceptance_rate:
                out.append(f"acceptance rate {rate:.3f} < {policy.min_acceptance_rate}")
        if steps:
            error_rate = sum(s.error for s in steps) / len(steps)
            if error_rate > policy.max_error_rate:
                out.append(f"error rate {error_rate:.3f} > {policy.max_error_rate}")
        plain = self.plain_tpot_p95
        if plain is None and len(self.plain_latency) >= policy.min_window_steps:
            plain = percentile(list(self.plain_latency), 95)
        latencies = [s.token_latency for s in steps if s.token_latency is not None]
        if plain and len(latencies) >= policy.min_window_steps:
            regression = percentile(latencies, 95) / plain - 1.0
            if regression > policy.max_tpot_p95_regression:
                out.append(
                    f"TPOT p95 regression {regression:+.1%} > {policy.max_tpot_p95_regression:.1%}"
                )
        if self.quality_cases > policy.max_quality_regression_cases:
            out.append(
                f"{self.quality_cases} quality regressions > {policy.max_quality_regression_cases}"
            )
        return out

    def _evaluate(self) -> None:
        if not self.speculating:
            return
        reasons = self.breaches()
        if not reasons:
            return
        self.last_breach = reasons
        self._reset_window()
        if self.policy.fallback_action == "log_only":
            self.violations += 1
            return
        self.speculating = False
        self.cooldown_left = self.policy.cooldown_steps
        self.fallbacks += 1

    def _reset_window(self) -> None:
        self.window.clear()
        self.quality_cases = 0

    def snapshot(self) -> dict:
        """JSON-ready state of the route."""
        return {
            "route": self.name,
            "speculating": self.speculating,
            "fallbacks": self.fallbacks,
            "probes": self.probes,
            "violations": self.violations,
            "errors": self.errors,
            "cooldown_left": max(self.cooldown_left, 0),
            "window_steps": len(self.window),
            "last_breach": self.last_breach,
            "policy": asdict(self.policy),
        }


class Guardrails:
    """Policies by route name (`default` for routes without their own) and their online state."""

    def __init__(
        self,
        default: GuardrailPolicy | None = None,
        routes: Mapping[str, GuardrailPolicy] | None = None,
    ):
        self.default = default or GuardrailPolicy()
        self.policies = dict(routes or {})
        self.routes: dict[str, RouteGuard] = {}

    @classmethod
    def from_mapping(cls, document: Mapping) -> Guardrails:
        """From a parsed config holding a `speculative_decoding_guardrails` section."""
        if not isinstance(document, Mapping) or SECTION not in document:
            raise ValueError(f"guardrails config: expected a top-level {SECTION!r} mapping")
        section = document[SECTION]
        if not isinstance(section, Mapping):
            raise ValueError(f"{SECTION}: expected a mapping, got {section!r}")
        routes = section.get("routes", {})
        if not isinstance(routes, Mapping):
            raise ValueError(f"{SECTION}.routes: expected a mapping of route names, got {routes!r}")
        default = GuardrailPolicy.from_mapping(
            {k: v for k, v in section.items() if k != "routes"}, SECTION
        )
        policies = {
            str(name): GuardrailPolicy.from_mapping(
                values if values is not None else {}, f"{SECTION}.routes.{name}", default
            )
            for name, values in routes.items()
        }
        return cls(default, policies)

    @classmethod
    def from_yaml(cls, source: str | Path) -> Guardrails:
        """From a YAML file path, or YAML text (anything holding a newline, or a colon and
        naming no file). Errors (`FileFormatError`) name the file, and the line of a YAML syntax
        error."""
        text, origin = str(source), "guardrails YAML"
        one_line = "\n" not in text
        if isinstance(source, Path) or (one_line and (":" not in text or Path(text).is_file())):
            origin = str(source)
            try:
                text = Path(source).read_text()
            except (OSError, UnicodeDecodeError) as error:
                raise FileFormatError(f"{origin}: cannot read it: {error}") from None
        document = parse_yaml(text, origin)
        if one_line and not isinstance(source, Path) and not isinstance(document, Mapping):
            # A path that names no file, colon and all, parses as a YAML string.
            raise FileFormatError(f"{text}: no such file, and not YAML holding {SECTION!r}")
        try:
            return cls.from_mapping(document)
        except ValueError as error:
            raise FileFormatError(f"{origin}: {error}") from None

    def policy(self, route: str) -> GuardrailPolicy:
        return self.policies.get(route, self.default)

    def route(self, name: str = DEFAULT_ROUTE) -> RouteGuard:
        if name not in self.routes:
            self.routes[name] = RouteGuard(name, self.policy(name))
        return self.routes[name]

    def wrap(self, drafter: Drafter, route: str = DEFAULT_ROUTE) -> GuardedDrafter:
        return GuardedDrafter(drafter, self.route(route))

    def snapshot(self) -> dict[str, dict]:
        return {name: guard.snapshot() for name, guard in self.routes.items()}


@dataclass
class _Launched:
    """A step of `GuardedDrafter` waiting for its read (read-ahead): whether the inner drafter
    proposed it (and its proposal as made), whether the inner drafter failed on it, and when it
    was proposed."""

    speculated: bool
    drafted: Proposal | None
    failed: bool
    start: float


class GuardedDrafter(WrappedDrafter):
    """Runs `inner` under a route's guard; any failure of `inner` becomes plain decoding.

    `events` lists, for the current (or last) `generate` call, why speculation stopped: the route
    being off when the request started or tripping during it, or a drafter error (with the
    exception), a malformed proposal (`DrafterError`, from the same checks the engine runs)
    included. `guard` None keeps only the error fallback. Its own proposals are the inner
    drafter's after those checks, or the root alone: valid either way.

    It reads ahead when `inner` does (`Drafter.reads_ahead`): the inner drafter is then updated
    at each step's launch, and the guard records the step at its `read`, so a trip takes effect
    one step later than reading every step would (the step queued behind it was proposed
    before), as on the server's routes. A step's seconds run from its proposal, or from the read
    of the step before when that came later.
    """

    proposals_valid = True

    def __init__(
        self,
        inner: Drafter,
        guard: RouteGuard | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ):
        super().__init__(inner)
        self.guard = guard
        self.clock = clock
        self.events: list[str] = []
        self._usable = False  # inner attached for this generate call: inner.end is owed
        self._vocab = 0  # the target's vocabulary size, for the proposal checks
        self._active = False  # inner drafts the current request
        self._speculated = False  # the current step's proposal came from inner
        self._drafted: Proposal | None = None  # that proposal as inner made it
        self._step_start = 0.0
        self._unread: deque[_Launched] = deque()  # steps updated ahead, in launch order
        self._last_read = 0.0

    @property
    def reads_ahead(self) -> bool:
        return reads_ahead(self.inner)

    @property
    def fallbacks(self) -> int:
        """Its `events` of the current or last call (`generate` reports them in
        `stats.fallbacks`)."""
        return len(self.events)

    def _fail(self, where: str, error: Exception, record: bool = True) -> None:
        """Stop drafting for this request; `record` an error step on the route's window."""
        self.events.append(f"drafter error in {where}: {type(error).__name__}: {error}")
        self._active = False
        if record and self.guard is not None:
            self.guard.record_error()

    def attach(self, target, max_cache_len: int) -> None:
        self.events = []
        self._usable = False
        self._unread.clear()
        self._last_read = 0.0
        self._vocab = target.config.get_text_config(decoder=True).vocab_size
        try:
            self.inner.attach(target, max_cache_len)
            self._usable = True
        except Exception as error:  # noqa: BLE001 - any drafter failure falls back
            self._fail("attach", error)

    def begin(self, state: DraftState) -> None:
        allowed = self.guard is None or self.guard.allows_speculation()
        if self._usable and not allowed:
            self.events.append(f"route {self.guard.name!r} is falling back to plain decoding")
        self._active = self._usable and allowed
        if not self._active:
            return
        try:
            self.inner.begin(state)
        except Exception as error:  # noqa: BLE001
            self._fail("begin", error)

    def propose(self, state: DraftState) -> Proposal:
        self._step_start = self.clock()
        if self._active and self.guard is not None and not self.guard.speculating:
            self.events.append(f"route {self.guard.name!r} tripped: {self.guard.last_breach}")
            self._active = False
        self._speculated = False
        if self._active:
            try:
                self._drafted = self.inner.propose(state)
                proposal = checked(self.inner, self._drafted, state, self._vocab)
                self._speculated = True
                return proposal
            except Exception as error:  # noqa: BLE001
                self._fail("propose", error)
        return root_only(state)

    def update(self, state: DraftState, outcome: StepOutcome) -> None:
        step = _Launched(self._speculated, self._drafted, False, self._step_start)
        ahead = outcome.emitted is None  # before the read: `read` follows
        if step.speculated and not ahead and outcome.malformed:
            self._malformed(step)
        elif step.speculated:
            try:
                self.inner.update(state, outcome)
            except Exception as error:  # noqa: BLE001
                # The step itself was verified: it is recorded with it, as an error step.
                self._fail("update", error, record=False)
                step.failed = True
        if ahead:
            self._unread.append(step)
        else:
            self._record(step, outcome)

    def read(self, state: DraftState, outcome: StepOutcome) -> None:
        step = self._unread.popleft()
        inner_read = getattr(self.inner, "read", None)  # an optional member of the protocol
        if step.speculated and not step.failed and outcome.malformed:
            self._malformed(step)
        elif step.speculated and not step.failed and inner_read is not None:
            try:
                inner_read(state, outcome)
            except Exception as error:  # noqa: BLE001
                self._fail("read", error, record=False)
                step.failed = True
        self._record(step, outcome)

    def _malformed(self, step: _Launched) -> None:
        """The screen replaced the step's malformed rows by plain steps (the output is
        unchanged): stop drafting, the step recorded as an error step."""
        step.failed = True
        if self._active:  # with read-ahead, the step after it may be malformed too
            self._fail("propose", malformed_error(self.inner, step.drafted, self._vocab), False)

    def _record(self, step: _Launched, outcome: StepOutcome) -> None:
        """The step on the route's window (`RouteGuard.record_step`), over the rows that were
        still running: with read-ahead, a step queued behind the one where rows finished ran
        for them too, and emitted nothing for them."""
        if self.guard is None:
            return
        now = self.clock()
        seconds = now - max(step.start, self._last_read)
        self._last_read = now
        running = [r for r, tokens in enumerate(outcome.emitted) if tokens]
        if not running:
            return
        emitted = [outcome.emitted[r] for r in running]
        if not step.speculated:
            self.guard.record_step(seconds, emitted)
            return
        drafted = sum(outcome.drafted[r] for r in running)
        accepted = sum(len(outcome.accepted_paths[r]) for r in running)
        self.guard.record_step(seconds, [], emitted, drafted, accepted, error=step.failed)

    def keep(self, rows: list[int]) -> None:
        if not self._active:
            return
        try:
            self.inner.keep(rows)
        except Exception as error:  # noqa: BLE001
            self._fail("keep", error)

    def end(self) -> None:
        # Owed whenever attach succeeded, begun or not (a route that is off still attached a
        # draft model's runner, which only end closes).
        if not self._usable:
            return
        self._usable = False
        try:
            self.inner.end()
        except Exception as error:  # noqa: BLE001
            self.events.append(f"drafter error in end: {type(error).__name__}: {error}")

    def __repr__(self) -> str:
        route = None if self.guard is None else self.guard.name
        return f"GuardedDrafter({self.inner!r}, route={route!r})"
