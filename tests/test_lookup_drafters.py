"""The count trie and the lookup drafters (n-gram, suffix) in isolation from any model."""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec_fast.drafters.base import PAD_PARENT, DraftState, StepOutcome, pack_trees
from specdec_fast.drafters.ngram import NGramDrafter
from specdec_fast.drafters.suffix import SuffixDrafter, SuffixIndex, _RequestIndex
from specdec_fast.drafters.trie import CountTrie


def make_state(tokens):
    batch = len(tokens)
    return DraftState(
        tokens=[list(row) for row in tokens],
        temperature=torch.zeros(batch),
        top_k=torch.zeros(batch, dtype=torch.int64),
        top_p=torch.ones(batch),
        seed=torch.zeros(batch, dtype=torch.int64),
        device=torch.device("cpu"),
    )


def paths(tokens, parents):
    """Root-to-node token paths of a tree given as (tokens, parents) with the root as node 0."""
    out = []
    for node, parent in enumerate(parents):
        prefix = () if parent == 0 else out[parent - 1]
        out.append(prefix + (tokens[node],))
    return out


def test_best_tree_ranks_by_frequency_and_keeps_ancestors():
    trie = CountTrie()
    for seq, weight in [([1, 2, 3], 3), ([1, 2, 4], 1), ([5, 6], 2), ([1, 7], 1)]:
        trie.insert(seq, weight)
    tokens, parents = trie.best_tree(max_nodes=6, max_depth=3)  # the root and 5 draft nodes
    assert tokens == [1, 5, 2, 6, 3]
    assert parents == [0, 0, 1, 2, 3]
    tokens, parents = trie.best_tree(max_nodes=11, max_depth=2, min_prob=0.2)
    assert set(paths(tokens, parents)) == {(1,), (5,), (1, 2), (5, 6)}


@settings(max_examples=60, deadline=None)
@given(
    seqs=st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=6), min_size=1, max_size=12),
    max_nodes=st.integers(2, 13),
    max_depth=st.integers(1, 6),
)
def test_best_tree_is_topological_closed_and_optimal(seqs, max_nodes, max_depth):
    trie = CountTrie()
    for seq in seqs:
        trie.insert(seq)
    tokens, parents = trie.best_tree(max_nodes, max_depth)
    prefixes = {tuple(s[:d]) for s in seqs for d in range(1, min(len(s), max_depth) + 1)}
    assert len(tokens) == min(max_nodes - 1, len(prefixes))  # the root counts in max_nodes
    assert all(0 <= p <= i for i, p in enumerate(parents))
    found = paths(tokens, parents)
    assert len(set(found)) == len(found)
    assert all(len(path) <= max_depth for path in found)
    # No unchosen path is strictly more frequent than a chosen one.
    counts = {}
    for seq in seqs:
        for d in range(1, min(len(seq), max_depth) + 1):
            counts[tuple(seq[:d])] = counts.get(tuple(seq[:d]), 0) + 1
    if found:
        worst_chosen = min(counts[p] for p in found)
        assert all(c <= worst_chosen for p, c in counts.items() if p not in set(found))


def test_trie_remove_undoes_insert():
    trie = CountTrie()
    trie.insert([1, 2, 3])
    trie.insert([1, 4])
    trie.remove([1, 2, 3])
    assert trie.descend([1, 2]) is None
    assert trie.descend([1, 4]).count == 1
    assert trie.count == 1


def test_pack_trees_pads_and_validates():
    proposal = pack_trees([7, 8], [([1, 2], [0, 1]), ([], [])], torch.device("cpu"), num_nodes=4)
    assert proposal.tokens.tolist() == [[7, 1, 2, 0], [8, 0, 0, 0]]
    assert proposal.parents.tolist() == [[-1, 0, 1, PAD_PARENT], [-1] + [PAD_PARENT] * 3]
    with pytest.raises(ValueError, match="num_nodes"):
        pack_trees([7], [([1, 2, 3], [0, 1, 2])], torch.device("cpu"), num_nodes=3)


def test_ngram_proposes_all_continuations_as_a_tree():
    drafter = NGramDrafter(max_nodes=6, max_depth=3, min_n=1, max_n=4)
    state = make_state([[1, 2, 3, 4, 1, 2, 3, 5, 1, 2], [9, 8, 7], [5, 6, 5, 6, 5]])
    drafter.begin(state)
    proposal = drafter.propose(state)
    tokens = proposal.tokens.tolist()
    parents = proposal.parents.tolist()
    # Row 0: "1 2" occurred twice, followed by "3 4 1" and "3 5 1": one shared "3", two branches,
    # the most recent ("5") first.
    assert tokens[0][:6] == [2, 3, 5, 4, 1, 1]
    assert parents[0][:6] == [-1, 0, 1, 1, 2, 3]
    # Row 1: nothing repeats.
    assert parents[1] == [-1] + [PAD_PARENT] * 5
    # Row 2: the longest match "5 6 5" continues with "6 5", then runs into the present and goes
    # on with its period of 2: "6".
    assert tokens[2][1:4] == [6, 5, 6]
    assert parents[2][:4] == [-1, 0, 1, 2]


def test_ngram_continues_loops_to_the_full_depth():
    drafter = NGramDrafter(max_nodes=16, max_depth=15)
    state = make_state([[7] * 20, [1, 2, 3] * 6, [4, 5, 6, 9]])
    drafter.begin(state)
    proposal = drafter.propose(state)
    assert proposal.tokens[0, 1:].tolist() == [7] * 15
    assert proposal.parents[0].tolist() == list(range(-1, 15))
    assert proposal.tokens[1, 1:].tolist() == [1, 2, 3] * 5
    assert proposal.parents[1].tolist() == list(range(-1, 15))
    assert proposal.parents[2, 1:].tolist() == [PAD_PARENT] * 15


def test_ngram_follows_history_and_batch_shrink():
    drafter = NGramDrafter(max_nodes=3, max_n=2)
    state = make_state([[1, 2, 3], [4, 5, 6]])
    drafter.begin(state)
    drafter.propose(state)
    state.tokens[0] += [1, 2]
    state.tokens[1] += [4]
    drafter.keep(torch.tensor([0, 1]))
    proposal = drafter.propose(state)
    assert proposal.tokens[0, 1:2].tolist() == [3]
    assert proposal.tokens[1, 1:3].tolist() == [5, 6]
    drafter.keep(torch.tensor([1]))
    proposal = drafter.propose(make_state([state.tokens[1]]))
    assert proposal.tokens[0, 1:3].tolist() == [5, 6]


def test_ngram_matches_brute_force():
    rng = random.Random(0)
    drafter = NGramDrafter(max_nodes=2, max_depth=1, min_n=1, max_n=3, max_matches=1)
    rows = [[rng.randrange(6) for _ in range(rng.randrange(2, 40))] for _ in range(20)]
    state = make_state(rows)
    drafter.begin(state)
    proposal = drafter.propose(state)
    for r, row in enumerate(rows):
        expected = None
        for n in range(3, 0, -1):
            if len(row) <= n:
                continue
            suffix = row[-n:]
            starts = [p for p in range(len(row) - n) if row[p : p + n] == suffix]
            if starts:
                expected = row[starts[-1] + n]
                break
        got = proposal.tokens[r, 1].item() if proposal.parents[r, 1] == 0 else None
        assert got == expected, (row, got, expected)


def test_request_index_equals_batch_index():
    rng = random.Random(1)
    tokens = [rng.randrange(5) for _ in range(300)]
    whole = SuffixIndex(7)
    whole.add(tokens)
    incremental = _RequestIndex(7, tokens[:100])
    incremental.extend(tokens[100:])

    def dump(node, prefix=()):
        out = {prefix: node.count}
        for token, child in node.children.items():
            out.update(dump(child, prefix + (token,)))
        return out

    assert dump(whole.root) == dump(incremental.root)


def test_suffix_uses_request_and_global_store():
    drafter = SuffixDrafter(max_nodes=5, max_depth=3, min_prob=0.0, max_store_tokens=12)
    state = make_state([[1, 2, 3, 1, 2], [9, 8]])
    drafter.begin(state)
    proposal = drafter.propose(state)
    assert proposal.tokens[0, 1].item() == 3
    assert proposal.parents[1, 1].item() == PAD_PARENT
    outcome = StepOutcome(
        proposal=proposal,
        accepted_nodes=torch.zeros(2, 5, dtype=torch.int32),
        num_accepted=torch.zeros(2, dtype=torch.int32),
        next_tokens=torch.tensor([3, 7]),
        emitted=[[3], [7, 6, 5]],
    )
    drafter.update(state, outcome)
    drafter.end()
    assert drafter.stored_tokens == 4  # outputs only: [3] and [7, 6, 5]
    fresh = make_state([[4, 9, 8, 7]])
    drafter.begin(fresh)
    proposal = drafter.propose(fresh)
    assert proposal.tokens[0, 1:3].tolist() == [6, 5]


def test_suffix_store_is_bounded_fifo():
    drafter = SuffixDrafter(max_store_tokens=10)
    for start in range(0, 40, 4):
        drafter.remember(list(range(start, start + 4)))
    assert drafter.stored_tokens <= 10
    assert drafter.store.root.descend([0, 1]) is None
    assert drafter.store.root.descend([36, 37]).count == 1


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_nodes": 1}, "max_nodes must be >= 2"),
        ({"max_nodes": 4, "max_depth": 4}, "max_depth"),
        ({"min_n": 3, "max_n": 2}, "min_n"),
        ({"max_matches": 0}, "max_matches"),
    ],
)
def test_ngram_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        NGramDrafter(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"min_prob": 1.0}, "min_prob"),
        ({"max_match": 0}, "max_match"),
        ({"max_store_tokens": -1}, "max_store_tokens"),
    ],
)
def test_suffix_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SuffixDrafter(**kwargs)
