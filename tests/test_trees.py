"""Tree shapes: static trees in every spelling, their utilities and validation, and the EAGLE-2
dynamic tree builder against a plain-Python reference."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec_fast.tree_mask import ancestor_mask as device_ancestor_mask
from specdec_fast.trees import (
    DEFAULT_BUDGETS,
    DYNAMIC_TREE_SHAPES,
    DynamicTreeBuilder,
    StaticTree,
    check_dynamic_tree,
    default_tree,
    dynamic_tree_shape,
    parse_tree,
)


@st.composite
def parent_lists(draw, max_nodes=40):
    """Parent pointers of a random tree, root included: node i > 0 hangs from a node < i."""
    count = draw(st.integers(1, max_nodes))
    return [-1] + [draw(st.integers(0, node - 1)) for node in range(1, count + 1)]


def check_structure(tree: StaticTree) -> None:
    parents = tree.node_parents
    assert parents[0] == -1
    assert all(0 <= parents[i] < i for i in range(1, len(parents)))
    depths = tree.positions
    assert all(depths[i] == depths[parents[i]] + 1 for i in range(1, len(parents)))
    # Canonical order: by depth, then rank path.
    assert list(tree.paths) == sorted(tree.paths, key=lambda path: (len(path), path))
    for node, path in enumerate(tree.paths, start=1):
        parent = parents[node]
        assert path[:-1] == (tree.paths[parent - 1] if parent else ())


@settings(max_examples=60, deadline=None)
@given(parent_lists())
def test_every_spelling_gives_the_same_tree(parents):
    tree = StaticTree.from_parents(parents)
    check_structure(tree)
    assert tree.num_nodes == len(parents) == len(tree.paths) + 1  # the root counts
    assert StaticTree.from_choices(tree.to_choices()) == tree
    assert StaticTree.from_token_tree_string(tree.to_token_tree_string()) == tree
    assert StaticTree.from_parents(tree.node_parents) == tree
    assert parse_tree(tree.to_choices()) == parse_tree(tree.to_token_tree_string()) == tree


@settings(max_examples=40, deadline=None)
@given(parent_lists())
def test_ancestor_mask_and_leaf_paths_follow_the_parents(parents):
    tree = StaticTree.from_parents(parents)
    mask = tree.ancestor_mask()
    on_device = device_ancestor_mask(torch.tensor([tree.node_parents]))[0]
    assert torch.equal(mask, on_device)
    assert mask.shape == (tree.num_nodes, tree.num_nodes)
    assert mask.sum(dim=1).tolist() == [depth + 1 for depth in tree.positions]
    leaves = tree.leaf_paths()
    has_child = set(tree.parents)
    assert sorted(path[-1] for path in leaves) == [
        node for node in range(1, tree.num_nodes) if node not in has_child
    ]
    for path in leaves:
        assert path[0] == 0
        assert all(tree.node_parents[b] == a for a, b in zip(path, path[1:], strict=False))


def test_medusa_choices_and_vllm_string_spellings():
    choices = [[0], [0, 0], [1], [0, 1], [2], [0, 0, 0]]
    tree = parse_tree(choices)
    assert tree.node_parents == (-1, 0, 0, 0, 1, 1, 4)
    assert tree.positions == (0, 1, 1, 1, 2, 2, 3)
    assert tree.to_token_tree_string() == "[(0,), (1,), (2,), (0, 0), (0, 1), (0, 0, 0)]"
    assert parse_tree("[(0,), (1,), (2,), (0, 0), (0, 1), (0, 0, 0)]") == tree
    assert parse_tree(tree) is tree


@pytest.mark.parametrize(
    "spec, message",
    [
        ([[0], [0]], "duplicate path"),
        ([[0], [1, 0]], "no parent path"),
        ([[0], [0, 0, 0]], "no parent path"),
        ([], "at least one path"),
        ([[0], []], "empty path"),
        ([[0], [-1]], "negative rank"),
        ("[(0,), (1,)", "cannot parse"),
        ("[(0,), 'a']", "list of tuples of ints"),
    ],
)
def test_malformed_trees_are_refused(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_tree(spec)


def test_over_budget_and_bad_parents_are_refused():
    # Budgets count the root: three draft nodes make a tree of 4 nodes.
    assert parse_tree([[0], [1], [2]], max_nodes=4).num_nodes == 4
    with pytest.raises(ValueError, match="4 nodes \\(root included\\), over the budget of 3"):
        parse_tree([[0], [1], [2]], max_nodes=3)
    with pytest.raises(ValueError, match="over the budget of 7"):
        parse_tree(default_tree(8), max_nodes=7)
    with pytest.raises(ValueError, match="num_nodes must be >= 2"):
        default_tree(1)
    with pytest.raises(ValueError, match="-1 \\(the root\\) first"):
        StaticTree.from_parents([0, 0])
    with pytest.raises(ValueError, match="node 2 has parent 2"):
        StaticTree.from_parents([-1, 0, 2])


@pytest.mark.parametrize("budget", DEFAULT_BUDGETS)
def test_default_trees_fill_their_budget(budget):
    tree = default_tree(budget)
    check_structure(tree)
    assert tree.num_nodes == budget == len(tree.node_parents)  # verify costs exactly N tokens
    assert default_tree(budget, max_depth=3).max_depth <= 3
    # The most likely path is always in, as a chain from the root.
    assert all((0,) * depth in tree.paths for depth in range(1, tree.max_depth + 1))


# --- dynamic trees ---------------------------------------------------------------------------


def reference_dynamic_tree(root_scores, root_tokens, level_scores, level_tokens, draft_nodes):
    """EAGLE-2 in plain Python for one row: candidates are (score, depth, order, token path);
    returns the token paths of the best `draft_nodes` in (depth, best first) order."""
    k = len(root_scores)
    candidates = [(root_scores[i], 1, i, (root_tokens[i],)) for i in range(k)]
    frontier = candidates[:]
    for scores, tokens in zip(level_scores, level_tokens, strict=True):
        frontier = sorted(frontier, key=lambda c: -c[0])[:k] if len(frontier) > k else frontier
        level = []
        for i, parent in enumerate(frontier):
            for j in range(k):
                order = len(candidates) + len(level)
                level.append(
                    (parent[0] + scores[i][j], parent[1] + 1, order, (*parent[3], tokens[i][j]))
                )
        candidates += level
        frontier = level
    best = sorted(candidates, key=lambda c: (-c[0], c[2]))[:draft_nodes]
    return [c[3] for c in sorted(best, key=lambda c: (c[1], -c[0], c[2]))]


def token_paths(tokens, parents):
    paths = [()]
    for node in range(1, len(tokens)):
        paths.append((*paths[parents[node]], tokens[node]))
    return paths[1:]


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 3),
    st.integers(1, 4),
    st.integers(1, 4),
    st.integers(0, 2**31 - 1),
    st.data(),
)
def test_dynamic_tree_matches_the_python_reference(batch, top_k, depth, seed, data):
    candidates = top_k + (depth - 1) * top_k * top_k
    max_nodes = data.draw(st.integers(2, candidates + 1))
    generator = torch.Generator().manual_seed(seed)
    vocab = 50

    def draft(shape):
        """Top-k log-probabilities and (distinct) tokens of random draft distributions."""
        log_probs = torch.log_softmax(torch.randn(*shape, vocab, generator=generator) * 2, -1)
        best = log_probs.topk(top_k, dim=-1)
        return best.values, best.indices

    builder = DynamicTreeBuilder(top_k, depth, max_nodes)
    root_scores, root_tokens = draft((batch,))
    frontier = builder.start(root_scores, root_tokens)
    assert torch.equal(frontier, root_tokens)
    levels = []
    for _ in range(depth - 1):
        scores, tokens = draft((batch, top_k))
        frontier, source = builder.expand(scores, tokens)
        assert frontier.shape == source.shape == (batch, top_k)
        assert bool(((source >= 0) & (source < top_k)).all())
        # Each frontier token is one of the children of the node it hangs from.
        children = tokens.gather(1, source[..., None].expand(-1, -1, top_k))
        assert bool((children == frontier[..., None]).any(dim=-1).all())
        levels.append((scores, tokens))
    roots = torch.arange(batch) + 100
    tokens, parents = builder.finish(roots)
    assert tokens.shape == parents.shape == (batch, max_nodes)
    for row in range(batch):
        row_parents = parents[row].tolist()
        assert row_parents[0] == -1 and tokens[row, 0] == roots[row]
        assert all(0 <= row_parents[i] < i for i in range(1, max_nodes))
        expected = reference_dynamic_tree(
            root_scores[row].tolist(),
            root_tokens[row].tolist(),
            [s[row].tolist() for s, _ in levels],
            [t[row].tolist() for _, t in levels],
            max_nodes - 1,
        )
        assert token_paths(tokens[row].tolist(), row_parents) == expected


def oracle_dynamic_tree(root_scores, root_tokens, level_scores, level_tokens, root, max_nodes):
    """EAGLE-2 for one row on the host, node for node: (tokens, parents) lists of the tree of
    `max_nodes` nodes, root included, as `DynamicTreeBuilder` lays it out. Scores are summed in
    float32 as on the device, and every tie goes to the earlier candidate. NaN ranks last: it
    counts as -inf, and -inf as the lowest finite float32 (`torch.nan_to_num`'s defaults)."""

    def clean(score):
        score = np.float32(score)
        if np.isnan(score):
            return np.float32(-np.inf)
        return max(min(score, np.float32(0.0)), np.finfo(np.float32).min)

    k = len(root_scores)
    # (cumulative score, depth, parent candidate or -1, token); the index is the candidate order
    candidates = [(clean(root_scores[i]), 1, -1, root_tokens[i]) for i in range(k)]
    frontier = list(range(k))
    for scores, tokens in zip(level_scores, level_tokens, strict=True):
        first = len(candidates)
        for i, parent in enumerate(frontier):
            base, depth = candidates[parent][:2]
            for j in range(k):
                cumulative = np.float32(base + clean(scores[i][j]))
                candidates.append((cumulative, depth + 1, parent, tokens[i][j]))
        level = range(first, len(candidates))
        frontier = sorted(level, key=lambda c: (-candidates[c][0], c))[:k]
    chosen = sorted(range(len(candidates)), key=lambda c: (-candidates[c][0], c))[: max_nodes - 1]
    chosen = sorted(chosen, key=lambda c: candidates[c][1])  # stable: best first per depth
    node_of = {candidate: node for node, candidate in enumerate(chosen, start=1)}
    tokens = [root] + [candidates[c][3] for c in chosen]
    parents = [-1] + [node_of.get(candidates[c][2], 0) for c in chosen]
    return tokens, parents


TIE_VALUES = (0.0, -0.5, -1.0, -1.5, -math.inf, math.nan)


def grow_tree(builder, root_scores, root_tokens, level_scores, level_tokens, roots):
    """The device builder over given scores: start, one expand per level, finish."""
    builder.start(root_scores, root_tokens)
    for scores, tokens in zip(level_scores, level_tokens, strict=True):
        builder.expand(scores, tokens)
    return builder.finish(roots)


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("top_k, depth", [(1, 1), (1, 4), (2, 1), (2, 3), (3, 4), (4, 5), (6, 6)])
def test_device_tree_builder_equals_the_host_oracle_with_ties(batch, top_k, depth):
    """Scores from a handful of values (-inf and NaN included), so that cumulative scores tie
    across frontier slots, levels and depths; every budget the shape allows, node for node."""
    generator = torch.Generator().manual_seed(top_k * 10 + depth + batch)
    values = torch.tensor(TIE_VALUES)

    def tied(*shape):
        return values[torch.randint(len(TIE_VALUES), shape, generator=generator)]

    candidates = top_k + (depth - 1) * top_k * top_k
    for max_nodes in sorted(
        {2, min(3, candidates + 1), max(candidates // 2 + 1, 2), candidates + 1}
    ):
        for _ in range(3):
            root = (tied(batch, top_k), torch.randint(100, (batch, top_k), generator=generator))
            levels = [
                (tied(batch, top_k, top_k), torch.randint(100, (batch, top_k, top_k)))
                for _ in range(depth - 1)
            ]
            level_scores = [s for s, _ in levels]
            level_tokens = [t for _, t in levels]
            roots = torch.arange(batch) + 1000
            builder = DynamicTreeBuilder(top_k, depth, max_nodes)
            tokens, parents = grow_tree(builder, *root, level_scores, level_tokens, roots)
            for row in range(batch):
                expected = oracle_dynamic_tree(
                    root[0][row].tolist(),
                    root[1][row].tolist(),
                    [s[row].tolist() for s in level_scores],
                    [t[row].tolist() for t in level_tokens],
                    1000 + row,
                    max_nodes,
                )
                assert (tokens[row].tolist(), parents[row].tolist()) == expected


def test_compiled_tree_builder_equals_the_host_oracle_with_ties():
    """The builder inside a compiled graph (as the EAGLE draft step runs it) keeps the same
    ties: one shape, all-tied scores."""
    top_k, depth, max_nodes, batch = 3, 3, 12, 2

    def build(root_scores, root_tokens, level_scores, level_tokens, roots):
        builder = DynamicTreeBuilder(top_k, depth, max_nodes)
        return grow_tree(builder, root_scores, root_tokens, level_scores, level_tokens, roots)

    compiled = torch.compile(build, fullgraph=True, dynamic=False)
    generator = torch.Generator().manual_seed(5)
    values = torch.tensor(TIE_VALUES[:3])
    root_scores = values[torch.randint(3, (batch, top_k), generator=generator)]
    level_scores = [values[torch.randint(3, (batch, top_k, top_k), generator=generator)]] * 2
    root_tokens = torch.arange(batch * top_k).view(batch, top_k)
    level_tokens = [
        torch.arange(batch * top_k * top_k).view(batch, top_k, top_k) + 50 * i for i in (1, 2)
    ]
    roots = torch.tensor([7, 8])
    tokens, parents = compiled(root_scores, root_tokens, level_scores, level_tokens, roots)
    for row in range(batch):
        expected = oracle_dynamic_tree(
            root_scores[row].tolist(),
            root_tokens[row].tolist(),
            [s[row].tolist() for s in level_scores],
            [t[row].tolist() for t in level_tokens],
            7 + row,
            max_nodes,
        )
        assert (tokens[row].tolist(), parents[row].tolist()) == expected


def test_dynamic_tree_with_tied_scores_keeps_every_parent():
    """All-equal (and -inf) scores: ties go to the shallower candidate, so parents are kept."""
    for fill in (0.0, -math.inf, math.nan):
        builder = DynamicTreeBuilder(top_k=3, depth=4, max_nodes=21)
        builder.start(torch.full((2, 3), fill), torch.arange(6).view(2, 3))
        for _ in range(3):
            builder.expand(torch.full((2, 3, 3), fill), torch.arange(18).view(2, 3, 3))
        tokens, parents = builder.finish(torch.zeros(2, dtype=torch.long))
        depths = [0]
        for node in range(1, 21):
            assert 0 <= parents[0, node] < node
            depths.append(depths[parents[0, node]] + 1)
        assert depths == sorted(depths)


def test_dynamic_tree_arguments_are_checked():
    check_dynamic_tree(top_k=2, depth=3, max_nodes=11)  # 10 draft nodes out of 10 candidates
    with pytest.raises(ValueError, match="over the 10 candidates"):
        check_dynamic_tree(top_k=2, depth=3, max_nodes=12)
    with pytest.raises(ValueError, match="must be >= 1"):
        check_dynamic_tree(top_k=0, depth=3, max_nodes=4)
    with pytest.raises(ValueError, match="max_nodes >= 2"):
        check_dynamic_tree(top_k=2, depth=3, max_nodes=1)
    builder = DynamicTreeBuilder(2, 2, 3)
    with pytest.raises(RuntimeError, match="call start first"):
        builder.expand(torch.zeros(1, 2, 2), torch.zeros(1, 2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"expected shape \[B, 2\]"):
        builder.start(torch.zeros(1, 3), torch.zeros(1, 3, dtype=torch.long))
    builder.start(torch.zeros(1, 2), torch.zeros(1, 2, dtype=torch.long))
    builder.expand(torch.zeros(1, 2, 2), torch.zeros(1, 2, 2, dtype=torch.long))
    with pytest.raises(RuntimeError, match="at most depth - 1"):
        builder.expand(torch.zeros(1, 2, 2), torch.zeros(1, 2, 2, dtype=torch.long))


@pytest.mark.parametrize("budget", [2, 5, *DYNAMIC_TREE_SHAPES, 100])
def test_dynamic_tree_shapes_fit_their_budget(budget):
    depth, top_k = dynamic_tree_shape(budget)
    assert 1 <= depth <= budget - 1
    check_dynamic_tree(top_k, depth, budget)
