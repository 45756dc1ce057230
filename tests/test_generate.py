"""The engine's promise: greedy output equals the target's own greedy output, for every drafter.

Rule used here: bitwise equality with HF `model.generate(do_sample=False)`. The tiny models use a
wide initializer so that their logits are peaked; the test models were checked to have no
near-ties (< 1e-5) on these prompts, so argmax decisions are stable across attention numerics.
"""

import pytest
import torch
from drafter_wrappers import OracleChain
from tiny_models import repetitive_prompts, tiny_llama, tiny_mistral

from specdec_fast import DraftModelDrafter, NGramDrafter, SuffixDrafter, generate
from specdec_fast.drafters.base import Drafter, Proposal, pack_trees
from specdec_fast.trees import default_tree

NEW_TOKENS = 64
VOCAB = 96


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab_size=VOCAB)


@pytest.fixture(scope="module")
def draft():
    return tiny_llama(vocab_size=VOCAB, hidden_size=32, seed=1)


def hf_greedy(model, prompts, max_new_tokens=NEW_TOKENS):
    return [
        model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=max_new_tokens)[
            0
        ].tolist()
        for p in prompts
    ]


class WrongDrafter(Drafter):
    """Proposes a wide tree of tokens the target never picks (always wrong)."""

    def __init__(self, avoid, max_nodes=7):
        super().__init__(max_nodes, 2)
        self.avoid = avoid

    def propose(self, state) -> Proposal:
        trees = []
        for tokens in state.tokens:
            full = next(c for c in self.avoid if c[: len(tokens)] == tokens)
            right = full[len(tokens)] if len(full) > len(tokens) else -1
            wrong = [t for t in range(VOCAB) if t != right][:3]
            trees.append((wrong + [wrong[0]] * 3, [0, 0, 0, 1, 1, 2]))
        return pack_trees([t[-1] for t in state.tokens], trees, state.device)


DRAFTERS = {
    "plain": lambda draft: None,
    "ngram": lambda draft: NGramDrafter(max_nodes=8),
    "suffix": lambda draft: SuffixDrafter(max_nodes=8),
    "draft-chain": lambda draft: DraftModelDrafter(draft, num_tokens=3),
    "draft-tree": lambda draft: DraftModelDrafter(draft, tree=default_tree(8)),
}


@pytest.mark.parametrize(
    ("name", "nodes"), [("draft-chain", 4), ("draft-tree", 8)], ids=["chain-k3", "tree-N8"]
)
def test_a_budget_of_n_nodes_verifies_exactly_n_tokens(target, draft, name, nodes):
    """The root counts: a tree of N nodes and a chain of k = N - 1 tokens verify N tokens."""
    widths = []
    hook = target.register_forward_pre_hook(
        lambda module, args, kwargs: widths.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    drafter = DRAFTERS[name](draft)
    try:
        generate(target, [[5, 6, 7, 5, 6]], drafter=drafter, max_new_tokens=12, eos_token_id=[])
    finally:
        hook.remove()
    assert drafter.max_nodes == nodes
    assert set(widths[1:]) == {nodes}  # every forward after the prefill is a verify step


@pytest.mark.parametrize("lengths", [[13], [5, 17, 1, 30, 9]], ids=["batch1", "ragged5"])
@pytest.mark.parametrize("name", list(DRAFTERS))
def test_greedy_equals_hf_generate(target, draft, name, lengths):
    prompts = repetitive_prompts(lengths, VOCAB, seed=len(lengths))
    expected = hf_greedy(target, prompts)
    out = generate(target, prompts, drafter=DRAFTERS[name](draft), max_new_tokens=NEW_TOKENS)
    assert [s.tolist() for s in out.sequences] == expected
    assert out.stats.new_tokens == NEW_TOKENS * len(lengths)


@pytest.mark.parametrize("name", [*DRAFTERS, "oracle"])
def test_a_full_cache_stops_every_drafter_where_plain_decoding_stops(target, draft, name):
    """With `max_cache_len` below what the rows need, each row stops for its cache with plain
    decoding's tokens, reading every step or reading ahead: the trees verified near the
    capacity write into the storage's slots for one tree beyond it and are cut at it. The
    oracle's 15-token chains are accepted whole, so that its steps cross the capacity."""
    prompts = repetitive_prompts([10, 23, 17], VOCAB, seed=5)
    ahead = generate(target, prompts, drafter=None, max_new_tokens=48, eos_token_id=[])
    full = [s.tolist() for s in ahead.sequences]
    capped = {"max_new_tokens": 48, "max_cache_len": 40, "eos_token_id": []}
    want = generate(target, prompts, drafter=None, **capped)
    assert [s.finish_reason for s in want.stats.sequences] == ["cache"] * 3
    for read_ahead in (False, True):
        if name == "oracle":
            drafter = OracleChain(lambda t: next(f[len(t) :] for f in full if f[: len(t)] == t), 16)
        else:
            drafter = DRAFTERS[name](draft)
        out = generate(target, prompts, drafter=drafter, read_ahead=read_ahead, **capped)
        assert [s.tolist() for s in out.sequences] == [s.tolist() for s in want.sequences]
        assert [s.finish_reason for s in out.stats.sequences] == ["cache"] * 3


def test_padded_tensor_input_equals_list_input(target):
    prompts = repetitive_prompts([4, 11, 7], VOCAB, seed=3)
    width = max(map(len, prompts))
    ids = torch.zeros(3, width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):  # left padding
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    as_tensor = generate(
        target, ids, attention_mask=mask, drafter=NGramDrafter(), max_new_tokens=20
    )
    as_lists = generate(target, prompts, drafter=None, max_new_tokens=20)
    assert [s.tolist() for s in as_tensor.sequences] == [s.tolist() for s in as_lists.sequences]


def test_always_wrong_drafter_is_exact_but_accepts_nothing(target):
    prompts = repetitive_prompts([6, 15], VOCAB, seed=5)
    expected = hf_greedy(target, prompts, 24)
    out = generate(target, prompts, drafter=WrongDrafter(expected), max_new_tokens=24)
    assert [s.tolist() for s in out.sequences] == expected
    assert out.stats.accepted_tokens == 0
    assert out.stats.mean_accepted_per_step == 1.0


def test_oracle_drafter_gets_every_node_accepted(target):
    prompts = repetitive_prompts([6, 15], VOCAB, seed=6)
    expected = hf_greedy(target, prompts, 30)

    def continuation_of(tokens):
        return next(c for c in expected if c[: len(tokens)] == tokens)[len(tokens) :]

    out = generate(target, prompts, drafter=OracleChain(continuation_of, 6), max_new_tokens=30)
    assert [s.tolist() for s in out.sequences] == expected
    assert out.stats.acceptance_rate == 1.0
    assert out.stats.steps == 5  # 30 tokens, 6 per step (5 drafts + the bonus token)


@pytest.mark.parametrize("read_ahead", [False, True], ids=["read", "read-ahead"])
@pytest.mark.parametrize("tree", [None, default_tree(8)], ids=["chain", "tree"])
def test_self_drafting_accepts_every_path_to_its_full_depth(target, tree, read_ahead):
    """The target as its own draft model: every step accepts a path to the draft's full depth,
    whose last token the draft never fed, so each next loop must feed it beside the root (on the
    device, also when the step was not read yet): any token missed or fed twice shifts the
    draft's cache and costs acceptance."""
    prompts = repetitive_prompts([9, 14], VOCAB, seed=7)
    drafter = DraftModelDrafter(target, tree=tree) if tree else DraftModelDrafter(target, 4)
    out = generate(target, prompts, drafter=drafter, max_new_tokens=25, read_ahead=read_ahead)
    assert [s.tolist() for s in out.sequences] == hf_greedy(target, prompts, 25)
    per_step = (4 if tree is None else tree.max_depth) + 1
    assert [row.steps for row in out.stats.sequences] == [-(-25 // per_step)] * 2
    if tree is None:
        assert out.stats.acceptance_rate == 1.0


WINDOWED_DRAFTERS = {
    "plain": lambda target: None,
    "ngram": lambda target: NGramDrafter(max_nodes=8),
    # Self-drafting gets most nodes accepted, so compaction runs under the window too.
    "self-draft-tree": lambda target: DraftModelDrafter(target, tree=default_tree(8)),
}


@pytest.mark.parametrize("name", list(WINDOWED_DRAFTERS))
def test_narrow_sliding_window_equals_hf_greedy(name):
    """A Mistral with an 8-token window, far narrower than its contexts (up to 78 tokens): the
    engine applies the window in prefill, tree verification and compaction exactly as HF does
    (no near-ties: the smallest top-2 logit gap along these paths is 8e-4)."""
    target = tiny_mistral(sliding_window=8)
    prompts = repetitive_prompts([5, 17, 1, 30, 9], VOCAB, seed=2)
    expected = hf_greedy(target, prompts, 48)
    # The window matters: without it the greedy continuations differ.
    assert expected != hf_greedy(tiny_mistral(sliding_window=4096), prompts, 48)
    out = generate(target, prompts, drafter=WINDOWED_DRAFTERS[name](target), max_new_tokens=48)
    assert [s.tolist() for s in out.sequences] == expected
