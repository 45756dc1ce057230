"""Adaptive speculation: proposal trimming, the acceptance estimate, the cost model, the budget
decision, and exactness of greedy output whatever budgets are chosen."""

import pytest
import torch
from tiny_models import repetitive_prompts, tiny_llama

from specdec_fast import DraftModelDrafter, NGramDrafter, SuffixDrafter, generate
from specdec_fast.adaptive import AcceptanceWindow, AdaptiveDrafter, CostModel
from specdec_fast.drafters.base import DraftState, Proposal, StepOutcome
from specdec_fast.trees import default_tree
from specdec_fast.wrapping import TrimmedDrafter, trim_proposal, widen_outcome

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
    cut = trim_proposal(full, 2)
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
    # Budget 4; one row accepted nodes 1 then 3 (a path through a branch), one accepted nothing.
    window.add(4, [[0, 1, 3, -1, -1], [0, -1, -1, -1, -1]])
    # Cut to n nodes, the first row keeps the path nodes with index <= n: 1, 1, 2, 2 tokens.
    assert [window.expected_tokens(n) for n in (1, 2, 3, 4)] == [1.5, 1.5, 2.0, 2.0]
    assert window.expected_tokens(5) is None
    window.add(2, [[0, 1, 2]])  # evicts the first row-step (window of 2)
    assert window.expected_tokens(2) == pytest.approx(1 + (0 + 2) / 2)
    assert window.expected_tokens(4) == 1.0  # only the empty row-step verified 4 nodes


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
        model.observe_verify(64, nodes, 1.0 * nodes)
    return model


def test_budget_follows_the_cost_model_and_recent_acceptance():
    adaptive = AdaptiveDrafter(NGramDrafter(max_nodes=8), steep_cost_model())
    assert adaptive.budgets == [1, 2, 3, 5, 8]
    # Unknown acceptance: look at the full tree.
    assert adaptive.choose_budget(1) == 8
    # Every row-step accepts its first two nodes of a chain.
    adaptive.acceptance.add(8, [[0, 1, 2, -1, -1, -1, -1, -1, -1]] * 20)
    assert adaptive.choose_budget(1) == 2  # 3 tokens per step for ~1.03x the plain cost
    assert adaptive.predicted_speedup(1, 2) == pytest.approx(3 * 1.01 / 1.03)
    assert adaptive.choose_budget(64) == 0  # 3 tokens for 3x the plain cost: no gain
    adaptive.acceptance.add(8, [[0, 1, 2, 3, 4, 5, 6, 7, 8]] * 500)
    assert adaptive.choose_budget(1) == 8
    # Even with every draft accepted, n + 1 tokens cost n + 1 plain steps at batch 64: no gain.
    assert adaptive.choose_budget(64) == 0


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
    adaptive = AdaptiveDrafter(inner, costly, explore_every=10_000)
    adaptive.acceptance.add(8, [[0, 1, -1, -1, -1, -1, -1, -1, -1]] * 10)
    with torch.no_grad():
        out = generate(target, prompts, drafter=adaptive, max_new_tokens=NEW_TOKENS)
    assert [s.tolist() for s in out.sequences] == plain
    assert inner.calls == {"begin": 0, "propose": 0}
    assert set(adaptive.chosen) == {0}
    assert out.stats.drafted_tokens == 0


@pytest.mark.parametrize(
    "make",
    [
        lambda draft: NGramDrafter(max_nodes=8),
        lambda draft: SuffixDrafter(max_nodes=8),
        lambda draft: DraftModelDrafter(draft, num_tokens=5),
        lambda draft: DraftModelDrafter(draft, tree=default_tree(9)),
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
    adaptive = AdaptiveDrafter(
        make(draft), cheap, explore_every=2, max_explore_every=2, probe_steps=0
    )
    adaptive.acceptance.add(3, [[0, 1, 2, 3]] * 4)  # budgets 1-3 look best until explored
    with torch.no_grad():
        out = generate(target, prompts, drafter=adaptive, max_new_tokens=NEW_TOKENS)
    assert [s.tolist() for s in out.sequences] == plain
    assert len(set(adaptive.chosen)) >= 2


def test_trimmed_drafter_caps_the_tree(target, draft, prompts, plain):
    drafter = TrimmedDrafter(DraftModelDrafter(draft, tree=default_tree(9)), budget=3)
    assert drafter.max_nodes == 3 and drafter.max_depth <= 3
    with torch.no_grad():
        out = generate(target, prompts, drafter=drafter, max_new_tokens=NEW_TOKENS)
    assert [s.tolist() for s in out.sequences] == plain
    assert out.stats.drafted_tokens <= 3 * sum(s.steps for s in out.stats.sequences)


def test_calibration_measures_every_cell(target):
    model = CostModel().calibrate(target, [1, 2], [1, 3], context_len=8, steps=3)
    assert set(model.verify_s) == {(1, 1), (1, 3), (2, 1), (2, 3)}
    assert all(seconds > 0 for seconds in model.verify_s.values())


def test_exploration_probes_the_full_tree_then_backs_off():
    adaptive = AdaptiveDrafter(
        NGramDrafter(max_nodes=4),
        steep_cost_model(),
        explore_every=4,
        max_explore_every=16,
        probe_steps=2,
    )
    adaptive.acceptance.add(4, [[0, 1, -1, -1, -1]] * 10)  # 2 tokens per step: a loss at 64
    batch = 64
    state = DraftState(
        tokens=[[1, 2, 3, 1, 2]] * batch,
        temperature=torch.zeros(batch),
        top_k=torch.zeros(batch, dtype=torch.int64),
        top_p=torch.ones(batch),
        seed=torch.zeros(batch, dtype=torch.int64),
        device=torch.device("cpu"),
    )
    adaptive.begin(state)  # predicted loss, no exploration due: plain, the drafter not started
    assert [adaptive.propose(state).num_nodes for _ in range(4)] == [1, 1, 1, 1]
    adaptive.begin(state)  # 4 steps later an exploration is due: probe the full tree twice
    assert adaptive.explore_every == 8
    assert [adaptive.choose_budget(batch) for _ in range(3)] == [4, 4, 0]
    for expected in (16, 16):  # each exploration that finds a loss doubles the interval
        adaptive._since_explore = adaptive.explore_every
        adaptive.begin(state)
        assert adaptive.explore_every == expected
