"""Adaptive speculation: proposal trimming, the acceptance estimate, the cost model, the budget
decision, and exactness of greedy output whatever budgets are chosen."""

import pytest
import torch
from tiny_models import repetitive_prompts, tiny_llama

from specdec_fast import DraftModelDrafter, NGramDrafter, SuffixDrafter, generate
from specdec_fast.adaptive import PLAIN, AcceptanceWindow, AdaptiveDrafter, CostModel
from specdec_fast.drafters.base import Drafter, DraftState, Proposal, StepOutcome
from specdec_fast.trees import default_tree
from specdec_fast.wrapping import trim_proposal, widen_outcome

VOCAB = 96
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab_size=VOCAB)


@pytest.fixture(scope="module")
def draft():
    return tiny_llama(vocab_size=VOCAB, hidden_size=32, seed=1)


@pytest.fixture(scope="module")
def prompts():
    return repetitive_prompts([14, 23, 9], VOCAB, seed=5)


@pytest.fixture(scope="module")
def plain(target, prompts):
    with torch.no_grad():
        out = generate(target, prompts, drafter=None, max_new_tokens=NEW_TOKENS)
    return [s.tolist() for s in out.sequences]


def test_trim_and_widen_round_trip():
    tokens = torch.arange(10).reshape(2, 5)
    parents = torch.tensor([[-1, 0, 0, 1, 2], [-1, 0, 1, -2, -2]])
    probs = torch.rand(2, 5, 7)
    full = Proposal(tokens, parents, probs)
    cut = trim_proposal(full, 3)  # three nodes, root included
    assert cut.tokens.tolist() == [[0, 1, 2], [5, 6, 7]]
    assert cut.parents.tolist() == [[-1, 0, 0], [-1, 0, 1]]
    assert torch.equal(cut.draft_probs, probs[:, :3])
    outcome = StepOutcome(
        proposal=cut,
        accepted_nodes=torch.tensor([[0, 2, -1], [0, 1, 2]], dtype=torch.int32),
        num_accepted=torch.tensor([1, 2], dtype=torch.int32),
        next_tokens=torch.tensor([3, 4]),
        emitted=[[2, 3], [6, 7, 4]],
        hidden={-1: torch.randn(2, 3, 4)},
    )
    wide = widen_outcome(outcome, full)
    assert wide.proposal is full
    assert wide.accepted_nodes.tolist() == [[0, 2, -1, -1, -1], [0, 1, 2, -1, -1]]
    assert wide.accepted_nodes.dtype == torch.int32
    assert wide.hidden[-1].shape == (2, 5, 4)
    assert torch.equal(wide.hidden[-1][:, :3], outcome.hidden[-1])
    assert not wide.hidden[-1][:, 3:].any()


def test_acceptance_window_counterfactual_budgets_and_eviction():
    window = AcceptanceWindow(size=2)
    # Trees of 5 nodes; one row accepted nodes 1 then 3 (a path through a branch), one nothing.
    window.add(5, [[0, 1, 3, -1, -1], [0, -1, -1, -1, -1]])
    # Cut to n nodes (root included), the first row keeps the path nodes with index < n:
    # 0, 1, 1, 2, 2 drafts.
    assert [window.expected_tokens(n) for n in (1, 2, 3, 4, 5)] == [1.0, 1.5, 1.5, 2.0, 2.0]
    assert window.expected_tokens(6) is None
    window.add(3, [[0, 1, 2]])  # evicts the first row-step (window of 2)
    assert window.expected_tokens(3) == pytest.approx(1 + (0 + 2) / 2)
    assert window.expected_tokens(5) == 1.0  # only the empty row-step verified 5 nodes


def test_cost_model_interpolates_in_nodes_then_batch():
    model = CostModel()
    for batch, nodes, seconds in [(1, 1, 1.0), (1, 9, 2.0), (8, 1, 2.0), (8, 9, 6.0)]:
        model.observe_verify(batch, nodes, seconds)
    assert model.verify_cost(1, 1) == 1.0
    assert model.verify_cost(1, 5) == pytest.approx(1.5)
    assert model.verify_cost(8, 5) == pytest.approx(4.0)
    assert model.verify_cost(4, 9) == pytest.approx(2.0 + 4.0 * 3 / 7)
    assert model.verify_cost(16, 1) == pytest.approx(2.0 + 8 / 7)  # linear past the last batch
    model.observe_verify(1, 1, 2.0)  # the median of the recent measurements
    assert model.verify_cost(1, 1) == pytest.approx(1.5)
    model.observe_verify(1, 1, 50.0)  # an outlier shifts the median by one sample at most
    assert model.verify_cost(1, 1) == pytest.approx(2.0)
    assert CostModel().verify_cost(1, 1) is None


def steep_cost_model(batches=(1, 64)):
    """Verify costs like a compute-bound GPU at batch 64 and a memory-bound one at batch 1."""
    model = CostModel()
    for nodes in (1, 2, 3, 4, 5, 9):
        model.observe_verify(1, nodes, 1.0 + 0.01 * nodes)
        model.observe_verify(64, nodes, 0.01 + 1.0 * nodes)
    return model


def test_budget_follows_the_cost_model_and_recent_acceptance():
    adaptive = AdaptiveDrafter(NGramDrafter(max_nodes=8), steep_cost_model())
    assert adaptive.budgets == [2, 3, 4, 6, 8]  # tree sizes N, root included
    # Unknown acceptance: look at the full tree.
    assert adaptive.choose_budget(1) == 8
    # Every row-step accepts its first two nodes of a chain.
    adaptive.acceptance.add(8, [[0, 1, 2, -1, -1, -1, -1, -1]] * 20)
    assert adaptive.choose_budget(1) == 3  # 3 tokens per step for ~1.03x the plain cost
    assert adaptive.predicted_speedup(1, 3) == pytest.approx(3 * 1.01 / 1.03)
    assert adaptive.choose_budget(64) == PLAIN  # 3 tokens for 3x the plain cost: no gain
    adaptive.acceptance.add(8, [[0, 1, 2, 3, 4, 5, 6, 7]] * 500)
    assert adaptive.choose_budget(1) == 8
    # Even with every draft accepted, N tokens cost N plain steps at batch 64: no gain.
    assert adaptive.choose_budget(64) == PLAIN


def test_predicted_loss_means_no_drafting_at_all(target, prompts, plain):
    class CountingNGram(NGramDrafter):
        calls = {"begin": 0, "propose": 0}

        def begin(self, state):
            self.calls["begin"] += 1
            super().begin(state)

        def propose(self, state):
            self.calls["propose"] += 1
            return super().propose(state)

    costly = CostModel()
    for batch in (1, 2, 3):
        for nodes in range(1, 10):
            costly.observe_verify(batch, nodes, float(nodes) * 100)
    inner = CountingNGram(max_nodes=8)
    adaptive = AdaptiveDrafter(inner, costly, explore_share=0.0)
    adaptive.acceptance.add(8, [[0, 1, -1, -1, -1, -1, -1, -1]] * 10)
    with torch.no_grad():
        out = generate(target, prompts, drafter=adaptive, max_new_tokens=NEW_TOKENS)
    assert [s.tolist() for s in out.sequences] == plain
    assert inner.calls == {"begin": 0, "propose": 0}
    assert set(adaptive.chosen) == {PLAIN}
    assert out.stats.drafted_tokens == 0


@pytest.mark.parametrize(
    "make",
    [
        lambda draft: NGramDrafter(max_nodes=8),
        lambda draft: SuffixDrafter(max_nodes=8),
        lambda draft: DraftModelDrafter(draft, num_tokens=5),
        lambda draft: DraftModelDrafter(draft, tree=default_tree(10)),
    ],
    ids=["ngram", "suffix", "draft-chain", "draft-tree"],
)
def test_greedy_output_is_exact_whatever_the_budgets(target, draft, prompts, plain, make):
    # A cost model where every budget is cheap, with exploration every other step, so budgets
    # change from step to step; the drafter's own state (draft cache) must follow the trimming.
    cheap = CostModel()
    for batch in (1, 2, 3):
        for nodes in range(1, 11):
            cheap.observe_verify(batch, nodes, 1.0)
    inner = make(draft)
    adaptive = AdaptiveDrafter(inner, cheap, explore_every=2)
    # Every budget known, 3 looking best until the full-tree steps every other step say more.
    adaptive.acceptance.add(inner.max_nodes, [[0, 1, 2, 3] + [-1] * (inner.max_nodes - 4)] * 4)
    with torch.no_grad():
        out = generate(target, prompts, drafter=adaptive, max_new_tokens=NEW_TOKENS)
    assert [s.tolist() for s in out.sequences] == plain
    assert len(set(adaptive.chosen)) >= 2


def test_calibration_measures_every_cell(target):
    model = CostModel().calibrate(target, [1, 2], [1, 3], context_len=8, steps=3)
    assert set(model.verify_s) == {(1, 1), (1, 3), (2, 1), (2, 3)}
    assert all(seconds > 0 for seconds in model.verify_s.values())


class _Chain(Drafter):
    """A fixed chain of draft tokens; learns nothing."""

    def propose(self, state: DraftState) -> Proposal:
        batch, width = state.batch_size, self.max_nodes
        tokens = torch.ones(batch, width, dtype=torch.int64)
        parents = torch.arange(-1, width - 1).expand(batch, -1).contiguous()
        return Proposal(tokens, parents)


def _state(batch: int) -> DraftState:
    return DraftState(
        tokens=[[1, 2, 3, 1, 2]] * batch,
        temperature=torch.zeros(batch),
        top_k=torch.zeros(batch, dtype=torch.int64),
        top_p=torch.ones(batch),
        seed=torch.zeros(batch, dtype=torch.int64),
        device=torch.device("cpu"),
    )


def _run_request(adaptive: AdaptiveDrafter, clock: list[float], steps: int, step_s: float):
    """Drive one request of `steps` steps through the wrapper by hand; each step takes
    `step_s` seconds of the fake clock and every row accepts the first draft node."""
    batch = 64
    state = _state(batch)
    adaptive.begin(state)
    for _ in range(steps):
        proposal = adaptive.propose(state)
        clock[0] += step_s
        accepted = torch.full((batch, proposal.num_nodes), -1, dtype=torch.int32)
        accepted[:, 0] = 0
        if proposal.num_nodes > 1:
            accepted[:, 1] = 1
        emitted = [[1] * int((accepted[0] >= 0).sum())] * batch
        adaptive.update(
            state,
            StepOutcome(
                proposal=proposal,
                accepted_nodes=accepted,
                num_accepted=(accepted >= 0).sum(dim=1).int() - 1,
                next_tokens=torch.ones(batch, dtype=torch.int64),
                emitted=emitted,
                hidden={},
                accepted_paths=[[n for n in row[1:] if n >= 0] for row in accepted.tolist()],
                drafted=[proposal.num_nodes - 1] * batch,
            ),
        )
    adaptive.end()


def test_exploration_costs_at_most_its_share_of_the_plain_time():
    clock = [0.0]
    adaptive = AdaptiveDrafter(
        _Chain(max_nodes=5), steep_cost_model(), explore_share=0.1, clock=lambda: clock[0]
    )
    # Nothing learned yet: the first request explores the full tree at every step.
    _run_request(adaptive, clock, steps=3, step_s=10.0)
    assert adaptive.chosen == [5, 5, 5]
    assert adaptive.explorations == 1
    # 2 tokens per row-step: a loss at batch 64. Each step cost 10 s for 2 tokens that plain
    # decoding makes in 2 x 1.01 s: 7.98 s lost per step, 23.94 s in all, owed from the credit.
    assert adaptive.acceptance.expected_tokens(5) == 2.0
    assert adaptive.choose_budget(64) == PLAIN
    assert adaptive.exploration_cost == pytest.approx(23.94)
    assert adaptive.credit == pytest.approx(-23.94)
    # Plain requests repay 10% of their time: the next exploration is due once the credit
    # covers another 23.94 s, after 474 s of plain decoding (1.01 s steps, 10 per request).
    for _ in range(47):
        _run_request(adaptive, clock, steps=10, step_s=1.01)
        assert adaptive.explorations == 1
    assert set(adaptive.chosen[3:]) == {PLAIN}
    _run_request(adaptive, clock, steps=10, step_s=1.01)  # due at the next request
    assert adaptive.credit == pytest.approx(-23.94 + 48 * 10 * 0.101)
    _run_request(adaptive, clock, steps=3, step_s=10.0)
    assert adaptive.explorations == 2
    assert adaptive.chosen[-3:] == [5, 5, 5]
    assert adaptive.credit == pytest.approx(-2 * 23.94 + 48 * 10 * 0.101)
    # The budgeted exploration's loss stays within 10% of the plain time.
    plain_time = 1.01 * sum(1 for budget in adaptive.chosen if budget == PLAIN)
    assert adaptive.exploration_cost <= 0.1 * plain_time


def test_no_exploration_without_credit():
    adaptive = AdaptiveDrafter(_Chain(max_nodes=5), steep_cost_model(), explore_share=0.0)
    adaptive.acceptance.add(5, [[0, 1, -1, -1, -1]] * 10)  # 2 tokens per step: a loss at 64
    for _ in range(3):
        adaptive.begin(_state(64))
        assert [adaptive.propose(_state(64)).num_nodes for _ in range(2)] == [1, 1]
        adaptive.end()
    assert adaptive.explorations == 0


def test_verify_costs_never_decrease_in_nodes_or_batch():
    model = CostModel()
    for nodes, seconds in [(1, 1.0), (2, 1.4), (3, 1.0), (5, 1.6)]:  # a noisy dip at N=3
        model.observe_verify(1, nodes, seconds)
    assert model.verify_cost(1, 2) == pytest.approx(1.2)  # the dip pooled with its neighbour
    assert model.verify_cost(1, 3) == pytest.approx(1.2)
    assert model.verify_cost(1, 4) == pytest.approx(1.4)
    assert model.verify_cost(1, 5) == pytest.approx(1.6)
    # A larger batch measured cheaper than batch 1: noise again, both pooled to their mean.
    for nodes, seconds in [(1, 0.8), (2, 1.0), (3, 1.0), (5, 1.2)]:
        model.observe_verify(4, nodes, seconds)
    for nodes, pooled in [(1, 0.9), (3, 1.1), (5, 1.4)]:
        assert model.verify_cost(1, nodes) == pytest.approx(pooled)
        assert model.verify_cost(4, nodes) == pytest.approx(pooled)
    model.observe_verify(8, 1, 5.0)  # a costlier batch size
    model.observe_verify(8, 2, 6.0)
    costs = [[model.verify_cost(b, n) for n in range(1, 6)] for b in (1, 2, 4, 6, 8)]
    assert all(row == sorted(row) for row in costs)
    assert all(list(col) == sorted(col) for col in zip(*costs, strict=True))
