"""Sampling through `generate` has the target's distribution, for every drafter.

Method: a tiny target (vocabulary 16) and one fixed prompt, repeated over a large batch whose rows
get distinct seeds, so each row is an independent draw of the first two generated tokens. The
empirical distribution of the first token and of the pair is compared with the exact target
distribution (computed from the target's logits with the same temperature/top-k/top-p) by a
chi-square test (cells with expected count < 5 pooled). Tolerance: p-value >= 1e-3 with the fixed
seeds below. The same test rejects a slightly wrong distribution (power check).
"""

import pytest
import torch
from tiny_models import tiny_llama

from specdec_fast import DraftModelDrafter, NGramDrafter, SuffixDrafter, generate
from specdec_fast.trees import default_tree

VOCAB = 16
PROMPT = [3, 7, 3, 7, 3, 7, 3]
DRAWS = 3000
P_MIN = 1e-3


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab_size=VOCAB, initializer_range=0.15, seed=2)


@pytest.fixture(scope="module")
def draft():
    return tiny_llama(vocab_size=VOCAB, hidden_size=32, initializer_range=0.15, seed=3)


def filtered_probs(logits, temperature, top_k, top_p):
    """Sampling distribution of the filtered target: temperature, then top-k, then top-p."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    if top_k:
        kth = probs.topk(top_k).values[-1]
        probs = torch.where(probs >= kth, probs, 0.0)
    if top_p < 1.0:
        ordered, order = probs.sort(descending=True)
        before = ordered.cumsum(0) - ordered
        keep = torch.zeros_like(probs, dtype=torch.bool)
        keep[order] = before < top_p * ordered.sum()
        probs = torch.where(keep, probs, 0.0)
    return probs / probs.sum()


def exact_pair_probs(model, temperature, top_k, top_p):
    with torch.no_grad():
        first = model(torch.tensor([PROMPT])).logits[0, -1]
        p1 = filtered_probs(first, temperature, top_k, top_p)
        prefixes = torch.tensor([PROMPT + [t] for t in range(VOCAB)])
        second = model(prefixes).logits[:, -1]
    p2 = torch.stack([filtered_probs(row, temperature, top_k, top_p) for row in second])
    return p1[:, None] * p2


def chi_square_p(counts, probs):
    """p-value of Pearson's chi-square test, pooling cells with expected count < 5."""
    counts, probs = counts.double().flatten(), probs.double().flatten()
    expected = probs * counts.sum()
    small = expected < 5
    observed = torch.cat([counts[~small], counts[small].sum()[None]])
    expected = torch.cat([expected[~small], expected[small].sum()[None]])
    if expected[-1] == 0:
        assert observed[-1] == 0, "a draw fell where the target has no mass"
        observed, expected = observed[:-1], expected[:-1]
    stat = ((observed - expected) ** 2 / expected).sum()
    dof = torch.tensor(float(len(expected) - 1))
    return float(torch.special.gammaincc(dof / 2, stat / 2))


def sample_pairs(target, drafter, temperature, top_k, top_p, seed):
    out = generate(
        target,
        [PROMPT] * DRAWS,
        drafter=drafter,
        max_new_tokens=2,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=torch.arange(DRAWS) + seed * DRAWS,
        eos_token_id=[],
    )
    counts = torch.zeros(VOCAB, VOCAB)
    for sequence in out.sequences:
        first, second = sequence[len(PROMPT) :].tolist()
        counts[first, second] += 1
    return counts, out.stats


DRAFTERS = {
    "plain": lambda draft: None,
    "ngram": lambda draft: NGramDrafter(max_nodes=5, max_depth=2),
    "suffix": lambda draft: SuffixDrafter(max_nodes=5, max_depth=2, min_prob=0.0),
    "draft-chain": lambda draft: DraftModelDrafter(draft, num_tokens=2),
    "draft-tree": lambda draft: DraftModelDrafter(draft, tree=default_tree(7)),
}
SETTINGS = {"t1": (1.0, 0, 1.0), "t0.7-topk5": (0.7, 5, 1.0), "t1.3-topp0.8": (1.3, 0, 0.8)}


@pytest.mark.slow
@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("name", list(DRAFTERS))
def test_first_two_tokens_follow_the_target(target, draft, name, setting):
    temperature, top_k, top_p = SETTINGS[setting]
    drafter = DRAFTERS[name](draft)
    counts, stats = sample_pairs(target, drafter, temperature, top_k, top_p, seed=11)
    exact = exact_pair_probs(target, temperature, top_k, top_p)
    assert chi_square_p(counts.sum(1), exact.sum(1)) >= P_MIN
    assert chi_square_p(counts, exact) >= P_MIN
    if drafter is not None:
        # The drafts were really tested, and some were accepted: acceptance was exercised.
        assert stats.drafted_tokens > 0
        assert stats.accepted_tokens > 0


def test_the_chi_square_test_has_power(target):
    """Draws from a wrong distribution (temperature 1.4 instead of 1) are rejected."""
    counts, _ = sample_pairs(target, None, 1.4, 0, 1.0, seed=12)
    exact = exact_pair_probs(target, 1.0, 0, 1.0)
    assert chi_square_p(counts, exact) < P_MIN


@pytest.mark.parametrize(
    "make",
    [
        lambda draft: NGramDrafter(max_nodes=6),
        lambda draft: SuffixDrafter(max_nodes=8),
        lambda draft: DraftModelDrafter(draft, tree=default_tree(7)),
    ],
    ids=["ngram", "suffix", "draft-tree"],
)
def test_sampled_speculation_emits_what_plain_sampling_emits(target, draft, make):
    """Random numbers are keyed by (row seed, token position): with drafts that carry no
    probabilities, sampled speculation draws every token from the same numbers as plain sampling
    with the same seeds, so the outputs are identical, token for token (ragged batch, filters)."""
    prompts = [PROMPT, PROMPT[:4] + [1, 2, 3], [5] * 9]
    options = dict(max_new_tokens=24, temperature=0.9, top_k=8, top_p=0.95, seed=[11, 12, 13])
    plain = generate(target, prompts, drafter=None, **options)
    speculative = generate(target, prompts, drafter=make(draft), **options)
    assert [s.tolist() for s in speculative.sequences] == [s.tolist() for s in plain.sequences]
    assert speculative.stats.accepted_tokens > 0  # drafts were taken, not just plain steps
    reseeded = generate(target, prompts, drafter=None, **(options | {"seed": [21, 22, 23]}))
    assert [s.tolist() for s in reseeded.sequences] != [s.tolist() for s in plain.sequences]
