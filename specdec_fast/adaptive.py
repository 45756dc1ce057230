"""Adaptive speculation: each step's tree budget from a cost model, or no speculation at all.

Budgets are tree sizes N, root included: a step with budget N verifies exactly N tokens per row,
and N = 1 (the root alone) is plain decoding. Speculating with budget N at batch size B pays off
when

    E(N) / (D(B) + V(B, N))  >  1 / V(B, 1)

where V(B, N) is the measured time of a verify step of N nodes per row, D(B) the drafter's time
per step, and E(N) the expected tokens a row emits per step (accepted drafts + 1) when only the
first N nodes of the drafter's tree are verified. E(N) comes from recent steps: node indices grow
along any root-to-leaf path, so the accepted path of a verified tree, cut to the nodes with index
< N, is the path a tree cut to its first N nodes would have accepted. Every verified step thus
measures E for all smaller budgets at once.

`AdaptiveDrafter` wraps any drafter: before each step it picks the budget that maximizes the
predicted speed and proposes the inner tree cut to it. When no budget beats plain decoding by
`margin`, the request continues plainly without calling the inner drafter again (a drafter's
state cannot skip steps and resume), so plain decoding does not pay for drafting; every request
starts with a fresh decision, and one predicted to lose does not start the drafter at all.
Estimates are refreshed by exploring requests (the full tree at every step of a whole request,
an unbiased sample of acceptance), whose losses are paid from a credit that grows with the time
decoded plainly: exploration costs at most `explore_share` of it, whatever the drafter's start-up
cost. Within speculating requests, a full-tree step every `explore_every` steps keeps the larger
budgets' estimates fresh.

`CostModel.calibrate` times verify steps of the target over a grid of (B, N); the wrapper refines
the table with the steps it measures online.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable, Iterable

import torch

from specdec_fast.drafters.base import Drafter, DraftState, Proposal, StepOutcome, root_only
from specdec_fast.engine import generate
from specdec_fast.wrapping import WrappedDrafter, trim_proposal, widen_outcome

# Budgets N (root included) the wrapper chooses among besides plain decoding (N = 1): few distinct
# tree widths keep the number of captured CUDA graphs (one per (B, N)) small. 2-6 are chains of
# 1-5 drafted tokens; the trees fill whole 8/16/32/64-row blocks of the verify kernels.
BUDGETS = (2, 3, 4, 6, 8, 16, 32, 64)
PLAIN = 1


def _interpolate(x: float, points: list[tuple[float, float]]) -> float:
    """Piecewise-linear through sorted (x, y) points, extended linearly past both ends."""
    if len(points) == 1:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:], strict=False):
        if x <= x1 or (x1, y1) == points[-1]:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    raise AssertionError("unreachable")


def _nondecreasing(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The closest non-decreasing fit (least squares, pool adjacent violators) to sorted (x, y):
    more nodes or rows never cost less, so a dip is measurement noise, averaged away."""
    blocks: list[list[float]] = []  # [sum of y, count]
    for _, y in points:
        blocks.append([y, 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    fitted = [total / count for total, count in blocks for _ in range(int(count))]
    return [(x, y) for (x, _), y in zip(points, fitted, strict=True)]


class CostModel:
    """Seconds per verify step V(B, N) and per drafting step D(B), measured and interpolated.

    Each (B, N) keeps the median of its last `samples` measurements, which ignores the odd step
    slowed by something else on the machine. Predictions fit the medians with curves that never
    decrease in N (along each measured batch size), then in B, and interpolate linearly between
    the points.
    """

    def __init__(self, samples: int = 9):
        if samples < 1:
            raise ValueError(f"samples must be >= 1, got {samples}")
        self.samples = samples
        self.verify_s: dict[tuple[int, int], float] = {}
        self.draft_s: dict[int, float] = {}
        self._recent: dict[tuple, deque[float]] = {}
        self._fitted: list[tuple[int, list[tuple[float, float]]]] | None = None

    def _record(self, table: dict, key, seconds: float) -> None:
        recent = self._recent.setdefault((id(table), key), deque(maxlen=self.samples))
        recent.append(seconds)
        table[key] = statistics.median(recent)
        self._fitted = None

    def observe_verify(self, batch: int, nodes: int, seconds: float) -> None:
        self._record(self.verify_s, (batch, nodes), seconds)

    def observe_draft(self, batch: int, seconds: float) -> None:
        self._record(self.draft_s, batch, seconds)

    def _curves(self) -> list[tuple[int, list[tuple[float, float]]]]:
        """Per batch size, the non-decreasing fit of its verify costs in N (cached until the
        next measurement)."""
        if self._fitted is None:
            curves: dict[int, list[tuple[float, float]]] = {}
            for (b, n), seconds in sorted(self.verify_s.items()):
                curves.setdefault(b, []).append((n, seconds))
            # A batch size measured at one width says nothing about the slope in N.
            shaped = {b: c for b, c in curves.items() if len(c) > 1}
            curves = shaped or curves
            self._fitted = [(b, _nondecreasing(c)) for b, c in sorted(curves.items())]
        return self._fitted

    def verify_cost(self, batch: int, nodes: int) -> float | None:
        """Predicted seconds of a verify step with `nodes` nodes per row (root included)."""
        curves = self._curves()
        if not curves:
            return None
        at_batch = [(b, _interpolate(nodes, curve)) for b, curve in curves]
        return max(_interpolate(batch, _nondecreasing(at_batch)), 0.0)

    def draft_cost(self, batch: int) -> float:
        if not self.draft_s:
            return 0.0
        return max(_interpolate(batch, sorted(self.draft_s.items())), 0.0)

    def calibrate(
        self,
        model,
        batch_sizes: Iterable[int],
        node_counts: Iterable[int],
        context_len: int = 64,
        steps: int = 6,
    ) -> CostModel:
        """Measure whole engine steps of `model` (verify, acceptance, compaction, bookkeeping:
        what the wrapper times online) for every (B, N), drafting random chains that are almost
        always rejected."""
        vocab = model.config.get_text_config(decoder=True).vocab_size
        generator = torch.Generator().manual_seed(0)
        for batch in sorted(set(batch_sizes)):
            prompts = torch.randint(vocab, (batch, context_len), generator=generator).tolist()
            for nodes in sorted(set(node_counts) | {1}):
                drafter = _RandomChain(nodes, vocab) if nodes > 1 else None
                with torch.no_grad():
                    out = generate(
                        model, prompts, drafter=drafter, max_new_tokens=steps, eos_token_id=[]
                    )
                for gap in out.stats.sequences[0].emission_gaps:
                    self.observe_verify(batch, nodes, gap)
        return self

    def to_dict(self) -> dict:
        return {
            "verify_s": {f"{b}x{n}": s for (b, n), s in sorted(self.verify_s.items())},
            "draft_s": {str(b): s for b, s in sorted(self.draft_s.items())},
        }


class _RandomChain(Drafter):
    """Chains of random tokens: the verify cost of N = max_nodes without acceptance."""

    # Valid trees by construction (tests/test_drafter_checks.py): values go unchecked.
    proposals_valid = True

    def __init__(self, max_nodes: int, vocab_size: int):
        super().__init__(max_nodes)
        self.vocab_size = vocab_size
        self.generator = torch.Generator().manual_seed(1)

    def propose(self, state: DraftState) -> Proposal:
        batch, width = state.batch_size, self.max_nodes
        tokens = torch.randint(self.vocab_size, (batch, width), generator=self.generator)
        tokens[:, 0] = torch.tensor([row[-1] for row in state.tokens])
        parents = torch.arange(-1, width - 1).expand(batch, -1)
        return Proposal(tokens.to(state.device), parents.contiguous().to(state.device))


class AcceptanceWindow:
    """Recent verified row-steps: for each, how many of the accepted path's draft nodes have
    index < n, for every tree size n up to the one verified (running sums per n)."""

    def __init__(self, size: int = 512):
        self.records: deque[list[int]] = deque()
        self.size = size
        self._sums: list[int] = []
        self._counts: list[int] = []

    def _apply(self, accepted_within: list[int], sign: int) -> None:
        grow = len(accepted_within) - len(self._sums)
        if grow > 0:
            self._sums.extend([0] * grow)
            self._counts.extend([0] * grow)
        for n, accepted in enumerate(accepted_within):
            self._sums[n] += sign * accepted
            self._counts[n] += sign

    def add(self, num_nodes: int, accepted_paths: list[list[int]]) -> None:
        """One verified step of trees of `num_nodes` nodes (root included): per row, the
        accepted path's node indices after the root."""
        for path in accepted_paths:
            nodes = [node for node in path if node > 0]
            within = [sum(1 for node in nodes if node < n) for n in range(1, num_nodes + 1)]
            self.records.append(within)
            self._apply(within, 1)
            if len(self.records) > self.size:
                self._apply(self.records.popleft(), -1)

    def expected_tokens(self, num_nodes: int) -> float | None:
        """Mean tokens emitted per row-step (drafts + 1) had only nodes 0..num_nodes-1 been
        verified; None without a step that verified that many."""
        if num_nodes > len(self._counts) or not self._counts[num_nodes - 1]:
            return None
        return 1.0 + self._sums[num_nodes - 1] / self._counts[num_nodes - 1]


class AdaptiveDrafter(WrappedDrafter):
    """Speculates with the budget the cost model predicts fastest, or not at all (module doc).

    cost_model: the target's verify costs, shareable between drafters of one target (e.g.
        calibrated once); drafting costs are measured per wrapper (`draft_costs`).
    margin: a budget must beat plain decoding by this predicted fraction to be used.
    explore_every: within a request that speculates, every this many steps one step verifies the
        full tree, so that the estimates of larger budgets stay fresh.
    explore_share: the most that exploring requests may cost, as a share of the time spent
        decoding plainly by decision (see `begin`).
    window: row-steps of acceptance history.
    """

    def __init__(
        self,
        inner: Drafter,
        cost_model: CostModel | None = None,
        margin: float = 0.05,
        explore_every: int = 32,
        explore_share: float = 0.03,
        window: int = 512,
        clock: Callable[[], float] = time.perf_counter,
    ):
        super().__init__(inner)
        if explore_every < 1:
            raise ValueError(f"explore_every must be >= 1, got {explore_every}")
        if not 0.0 <= explore_share < 1.0:
            raise ValueError(f"explore_share must be in [0, 1), got {explore_share}")
        # Verify costs are the target's and may be shared; drafting costs are this drafter's.
        self.cost_model = cost_model or CostModel()
        self.draft_costs = CostModel()
        self.acceptance = AcceptanceWindow(window)
        self.margin = margin
        self.explore_every = explore_every
        self.explore_share = explore_share
        self.clock = clock
        self.budgets = [b for b in BUDGETS if b < inner.max_nodes] + [inner.max_nodes]
        self.chosen: list[int] = []  # budget N of every step (1 = plain), for reports
        # Exploration accounting, in seconds: `credit` grows by `explore_share` of every step
        # decoded plainly by decision and shrinks by what each exploring request cost beyond
        # plain decoding of the same tokens (`exploration_cost` is the last such cost).
        self.credit = 0.0
        self.exploration_cost = 0.0
        self.explorations = 0
        self._attached = False
        self._active = False
        self._exploring = False
        self._extra = 0.0
        self._since_explore = 0
        self._full: Proposal | None = None
        self._budget = PLAIN
        self._nodes = 1
        self._draft_s = 0.0
        self._verify_start = 0.0

    def attach(self, target, max_cache_len: int) -> None:
        self.inner.attach(target, max_cache_len)
        self._attached = True

    def begin(self, state: DraftState) -> None:
        """Decide how this request starts.

        - Plain decoding's cost at this batch size unknown: plain, measuring it.
        - Some budget's prediction unknown (nothing learned yet): explore.
        - Some budget predicted to win: speculate, choosing the budget step by step.
        - Every budget predicted to lose: plain, without starting the drafter, unless the
          exploration credit covers another exploring request.

        An exploring request verifies the full tree at every step to its end: acceptance early
        in a request (little context to draft from) is often lower than later, so only whole
        requests estimate it without bias. The credit rule keeps the exploring requests' losses
        within `explore_share` of the plain time, however costly the drafter's start (a draft
        model's prefill) and however short the requests.
        """
        batch = state.batch_size
        if self.cost_model.verify_cost(batch, PLAIN) is None:
            self._active = self._exploring = False
            return
        best, known = self._best(batch)
        losing = known and best == PLAIN
        affordable = self.credit > 0.0 and self.credit >= self.exploration_cost
        self._exploring = not known or (losing and affordable)
        self._active = not losing or self._exploring
        self._extra = 0.0
        if self._active:
            start = self.clock()
            self.inner.begin(state)
            self._extra += self.clock() - start

    def predicted_speedup(self, batch: int, budget: int) -> float | None:
        """Predicted tokens/s with trees of `budget` nodes (root included) over plain tokens/s;
        None if unknown."""
        plain = self.cost_model.verify_cost(batch, PLAIN)
        verify = self.cost_model.verify_cost(batch, budget)
        tokens = self.acceptance.expected_tokens(budget)
        if plain is None or verify is None or tokens is None:
            return None
        return tokens * plain / (self.draft_costs.draft_cost(batch) + verify)

    def _best(self, batch: int) -> tuple[int, bool]:
        """(the budget predicted fastest, PLAIN if none beats plain by `margin`; whether every
        budget's prediction is known)."""
        best, best_speedup, known = PLAIN, 1.0 + self.margin, True
        for budget in self.budgets:
            speedup = self.predicted_speedup(batch, budget)
            if speedup is None:
                known = False
            elif speedup > best_speedup:
                best, best_speedup = budget, speedup
        return best, known

    def choose_budget(self, batch: int) -> int:
        """The budget N for the next step at batch size `batch` (PLAIN = 1: plain decoding)."""
        if self._exploring:
            return self.budgets[-1]
        if self.cost_model.verify_cost(batch, PLAIN) is None:
            return PLAIN
        best, known = self._best(batch)
        if best == PLAIN and not known:
            return self.budgets[-1]  # nothing known beats plain yet: look at the full tree
        if best != PLAIN and self._since_explore >= self.explore_every:
            self._since_explore = 0
            return self.budgets[-1]
        return best

    def propose(self, state: DraftState) -> Proposal:
        self._since_explore += 1
        self._budget = self.choose_budget(state.batch_size) if self._active else PLAIN
        if self._budget == PLAIN:
            # Plain by decision: the rest of the request decodes plainly, without drafting.
            self._active = False
            proposal = root_only(state)
        else:
            start = self.clock()
            self._full = self.inner.propose(state)
            self._draft_s = self.clock() - start
            proposal = trim_proposal(self._full, self._budget)
        self.chosen.append(self._budget)
        self._nodes = proposal.num_nodes
        self._verify_start = self.clock()
        return proposal

    def update(self, state: DraftState, outcome: StepOutcome) -> None:
        now = self.clock()
        batch = len(outcome.emitted)
        verify_s = now - self._verify_start
        self.cost_model.observe_verify(batch, self._nodes, verify_s)
        if self._budget == PLAIN:
            self.credit += self.explore_share * verify_s
            return
        self.acceptance.add(self._budget, outcome.accepted_paths)
        self.inner.update(state, widen_outcome(outcome, self._full))
        draft_s = self._draft_s + self.clock() - now
        self.draft_costs.observe_draft(batch, draft_s)
        if self._exploring:
            emitted = sum(len(tokens) for tokens in outcome.emitted) / batch
            plain = self.cost_model.verify_cost(batch, PLAIN) or 0.0
            self._extra += draft_s + verify_s - emitted * plain

    def keep(self, rows: list[int]) -> None:
        if self._active:
            self.inner.keep(rows)

    def end(self) -> None:
        if self._exploring:
            self.explorations += 1
            self.credit -= self._extra
            self.exploration_cost = max(self._extra, 0.0)
        self._active = self._exploring = False
        if self._attached:
            self._attached = False
            self.inner.end()

    def __repr__(self) -> str:
        return f"AdaptiveDrafter({self.inner!r})"
