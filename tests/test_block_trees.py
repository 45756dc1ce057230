"""Trees from a block drafter's per-position distributions (`specdec_fast.trees`): the best-first
(DDTree) tree against a brute-force enumeration, its order and padding, the chains, and
losslessness of both through `verify`, in the style of tests/test_verify_lossless.py."""

import itertools
from unittest import mock

import pytest
import torch
from test_verify_lossless import (
    DRAFT,
    P_VALUE_FLOOR,
    ROOT_TOKEN,
    TARGET,
    VOCAB,
    Case,
    emitted_pairs,
    p_values,
)

from specdec_fast.kernels import verify
from specdec_fast.trees import (
    PAD_NODE,
    _best_first_on_host,
    best_first_on_device,
    best_first_tree,
    block_chain,
    sample_draft_tokens,
    sampled_block_chain,
)


def batched_best_first(
    values: torch.Tensor, candidates: torch.Tensor, roots: torch.Tensor, max_nodes: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """An independent form of the best-first pops, the library's until 2026-12-04: batched tensor
    ops over one fixed-slot frontier per row (an argmax a pop, two pushes into fixed slots), no
    heap. The heap must give the same trees, token for token."""
    batch, depth, width = values.shape
    device = values.device
    values, candidates = values.flatten(1), candidates.flatten(1)  # [B, D * K]
    slots = 1 + 2 * (max_nodes - 1)
    score = torch.full((batch, slots), -torch.inf, device=device)
    base = torch.zeros(batch, slots, device=device)  # the parent's score
    level = torch.zeros(batch, slots, dtype=torch.long, device=device)
    rank = torch.zeros_like(level)
    parent = torch.zeros_like(level)
    score[:, 0] = values[:, 0]
    tokens = torch.zeros(batch, max_nodes, dtype=torch.long, device=device)
    parents = torch.full_like(tokens, PAD_NODE)
    tokens[:, 0], parents[:, 0] = roots.long(), -1
    for node in range(1, max_nodes):
        best = score.argmax(dim=1, keepdim=True)
        found = score.gather(1, best) > -torch.inf
        popped = [t.gather(1, best) for t in (score, base, level, rank, parent)]
        best_score, best_base, best_level, best_rank, best_parent = popped
        tokens[:, node : node + 1] = candidates.gather(1, best_level * width + best_rank)
        parents[:, node : node + 1] = torch.where(found, best_parent, PAD_NODE)
        score.scatter_(1, best, -torch.inf)
        child = (
            best_level + 1,
            torch.zeros_like(best_rank),
            torch.full_like(best_parent, node),
            best_score,
            best_level + 1 < depth,
        )
        sibling = (best_level, best_rank + 1, best_parent, best_base, best_rank + 1 < width)
        # Fixed slots per pop: the frontier never needs compacting.
        for slot, push in zip((2 * node - 1, 2 * node), (child, sibling), strict=True):
            new_level, new_rank, new_parent, new_base, allowed = push
            index = new_level.clamp(max=depth - 1) * width + new_rank.clamp(max=width - 1)
            new_score = new_base + values.gather(1, index)
            score[:, slot : slot + 1] = torch.where(found & allowed, new_score, -torch.inf)
            base[:, slot : slot + 1] = new_base
            level[:, slot : slot + 1] = new_level
            rank[:, slot : slot + 1] = new_rank
            parent[:, slot : slot + 1] = new_parent
    return tokens, parents


def paths_of(tokens, parents):
    """Token paths below the root of each existing node, in node order."""
    paths = [()]
    for node in range(1, len(tokens)):
        parent = parents[node]
        paths.append(None if parent == PAD_NODE else (*paths[parent], tokens[node]))
    return [path for path in paths[1:] if path is not None]


def brute_force(log_probs, count, depth_scale=1.0):
    """The `count` best token paths by summed log-probability (positions after the first
    weighted by `depth_scale`) over every rank path of up to D tokens, each position's
    candidates its `count` most likely tokens (plain Python)."""
    depth = log_probs.shape[0]
    ranked = [log_probs[d].topk(min(count, log_probs.shape[1])) for d in range(depth)]
    scored = []
    for length in range(1, depth + 1):
        for ranks in itertools.product(range(len(ranked[0].values)), repeat=length):
            score = sum(
                float(ranked[d].values[r]) * (1.0 if d == 0 else depth_scale)
                for d, r in enumerate(ranks)
            )
            tokens = tuple(int(ranked[d].indices[r]) for d, r in enumerate(ranks))
            scored.append((score, tokens))
    scored.sort(key=lambda item: -item[0])
    return [tokens for _, tokens in scored[:count]]


@pytest.mark.parametrize(("depth", "vocab", "nodes"), [(1, 7, 5), (3, 5, 9), (4, 6, 16), (2, 3, 7)])
def test_best_first_tree_keeps_the_best_paths_in_order(depth, vocab, nodes):
    generator = torch.Generator().manual_seed(depth * 100 + vocab)
    batch = 3
    log_probs = torch.log_softmax(torch.randn(batch, depth, vocab, generator=generator) * 2, -1)
    roots = torch.tensor([4, 0, 2])
    tokens, parents = best_first_tree(log_probs, roots, nodes)
    assert tokens.shape == parents.shape == (batch, nodes)
    assert tokens[:, 0].tolist() == roots.tolist() and parents[:, 0].eq(-1).all()
    for row in range(batch):
        row_tokens, row_parents = tokens[row].tolist(), parents[row].tolist()
        paths = paths_of(row_tokens, row_parents)
        assert set(paths) == set(brute_force(log_probs[row], nodes - 1))
        assert all(0 <= p < i for i, p in enumerate(row_parents[1:], start=1))
        scores = [sum(float(log_probs[row, d, t]) for d, t in enumerate(path)) for path in paths]
        # Pops in decreasing score: siblings most likely first, any prefix is the best subtree.
        assert scores == sorted(scores, reverse=True)
    for smaller in range(2, nodes):
        prefix = best_first_tree(log_probs, roots, smaller)
        assert torch.equal(prefix[0], tokens[:, :smaller])
        assert torch.equal(prefix[1], parents[:, :smaller])


def test_best_first_tree_pads_when_candidates_run_out_and_handles_ties():
    log_probs = torch.log(torch.tensor([[[0.7, 0.3], [0.5, 0.5]]]))
    tokens, parents = best_first_tree(log_probs, torch.tensor([1]), 8)
    # 2 + 4 candidates for 7 draft nodes: the last node is padding.
    assert parents[0].tolist() == [-1, 0, 1, 1, 0, 4, 4, PAD_NODE]
    assert tokens[0].tolist() == [1, 0, 0, 1, 1, 0, 1, 0]
    # Probability 0 (-inf) and uniform rows still give a valid tree.
    flat = torch.full((2, 3, 4), -torch.inf)
    flat[0] = 0.0
    flat[1, :, 0] = 0.0
    tokens, parents = best_first_tree(flat, torch.tensor([3, 3]), 6)
    for row in range(2):
        assert all(0 <= p < i for i, p in enumerate(parents[row, 1:].tolist(), start=1))
    assert parents[1].tolist()[:4] == [-1, 0, 1, 2]  # the one likely path first


@pytest.mark.parametrize("depth_scale", [0.1, 0.5, 2.0])
def test_the_depth_scale_keeps_the_best_scaled_paths_on_host_and_device(depth_scale):
    generator = torch.Generator().manual_seed(7)
    log_probs = torch.log_softmax(torch.randn(2, 3, 5, generator=generator) * 2, -1)
    roots = torch.tensor([1, 3])
    tokens, parents = best_first_tree(log_probs, roots, 9, depth_scale)
    for row in range(2):
        paths = paths_of(tokens[row].tolist(), parents[row].tolist())
        assert set(paths) == set(brute_force(log_probs[row], 8, depth_scale))
    top = log_probs.topk(5, dim=-1)  # K = min(9 - 1, V)
    scaled = torch.cat([top.values[:, :1], top.values[:, 1:] * depth_scale], dim=1)
    device = batched_best_first(scaled, top.indices, roots, 9)
    assert torch.equal(device[0], tokens) and torch.equal(device[1], parents)


def test_a_small_depth_scale_moves_nodes_below_the_likely_token():
    # q_1 = (0.5, 0.3, 0.2), q_2's best 0.4: the plain product keeps depth 1's runner-up (0.3
    # against 0.5 * 0.4); with s = 0.1 the path below the top token scores 0.5 * 0.4 ** 0.1.
    log_probs = torch.log(torch.tensor([[[0.5, 0.3, 0.2], [0.4, 0.35, 0.25]]]))
    plain = best_first_tree(log_probs, torch.tensor([9]), 3)
    assert plain[0][0].tolist() == [9, 0, 1] and plain[1][0].tolist() == [-1, 0, 0]
    scaled = best_first_tree(log_probs, torch.tensor([9]), 3, 0.1)
    assert scaled[0][0].tolist() == [9, 0, 0] and scaled[1][0].tolist() == [-1, 0, 1]


@pytest.mark.parametrize("bad", [0, -0.5, float("nan"), float("inf"), "0.5", True, None])
def test_the_depth_scale_must_be_a_positive_finite_number(bad):
    with pytest.raises(ValueError, match="depth_scale must be a finite number > 0"):
        best_first_tree(torch.zeros(1, 2, 3), torch.tensor([0]), 4, bad)


@pytest.mark.parametrize("seed", range(6))
def test_best_first_tree_on_the_host_equals_the_batched_tensor_form(seed):
    """The heap and the batched form give the same trees, token for token:
    random blocks, blocks of a few distinct values (ties everywhere) and ones with -inf (zero
    probabilities) and NaN, candidates that run out included."""
    generator = torch.Generator().manual_seed(seed)
    batch, depth, vocab = 1 + seed % 3, 2 + seed, 3 + 5 * seed
    log_probs = torch.log_softmax(torch.randn(batch, depth, vocab, generator=generator), -1)
    log_probs[:, 0, 0] = -50.0  # padding repeats the top token of position 1: not token 0
    if seed % 2:
        log_probs = (log_probs * 2).round() / 2  # ties
    if seed >= 3:
        log_probs[0, :, : vocab // 2] = -torch.inf
        log_probs[-1, 0, 0] = torch.nan
    roots = torch.randint(vocab, (batch,), generator=generator)
    for nodes in (2, 5, 16, 40):
        width = min(nodes - 1, vocab)
        top = log_probs.nan_to_num(nan=-1e30).clamp(min=-1e30).topk(width, dim=-1)
        host = _best_first_on_host(top.values, top.indices, roots, nodes)
        device = batched_best_first(top.values, top.indices, roots, nodes)
        assert torch.equal(host[0], device[0]) and torch.equal(host[1], device[1]), nodes
        assert host[0].dtype == host[1].dtype == torch.int64


def forced_ties(generator, batch, depth, vocab):
    """Log-probabilities `[B, D, V]` full of ties: a few distinct values, equal siblings, zero
    log-probabilities (a child as likely as its parent), and rows of -inf (candidates running
    out at different nodes per row)."""
    log_probs = torch.log_softmax(torch.randn(batch, depth, vocab, generator=generator), -1)
    log_probs = (log_probs * 2).round() / 2
    log_probs[:, 1:, 0] = 0.0
    for row in range(0, batch, 2):
        log_probs[row, :, : 1 + row % vocab] = -torch.inf
    return log_probs


@pytest.mark.parametrize("seed", range(4))
def test_best_first_tree_on_the_device_equals_the_heap(seed):
    """The device rounds (`best_first_on_device`, what a compiled block step runs) give the
    heap's trees token for token, over odd sizes (depth 1 to 7, vocabularies smaller and larger
    than the budget, budgets of 2 to 33 nodes), ragged rows whose candidates run out at
    different nodes, forced ties and depth scales."""
    generator = torch.Generator().manual_seed(seed)
    for depth, vocab, nodes in itertools.product((1, 2, 5, 7), (3, 11), (2, 5, 16, 33)):
        batch = 1 + (depth + vocab + seed) % 5
        if (depth + nodes + seed) % 2:
            log_probs = forced_ties(generator, batch, depth, vocab)
        else:
            log_probs = torch.log_softmax(
                3 * torch.randn(batch, depth, vocab, generator=generator), -1
            )
        scale = (1.0, 0.5, 1.7)[(seed + depth) % 3]
        width = min(nodes - 1, vocab)
        top = log_probs.clamp(min=-1e30).topk(width, dim=-1)
        values = torch.cat([top.values[:, :1], top.values[:, 1:] * scale], dim=1)
        roots = torch.randint(vocab, (batch,), generator=generator)
        host = _best_first_on_host(values, top.indices, roots, nodes)
        device = best_first_on_device(values, top.indices, roots, nodes)
        case = (depth, vocab, nodes, batch, scale)
        assert torch.equal(device[0], host[0]) and torch.equal(device[1], host[1]), case
        assert device[0].dtype == device[1].dtype == torch.int64


def test_best_first_tree_under_torch_compile_is_the_device_rounds():
    """Traced by `torch.compile` (as inside a block drafter's compiled step) the tree comes from
    the device rounds, with no read, and equals the heap's; ties and padding included."""
    generator = torch.Generator().manual_seed(5)
    log_probs = forced_ties(generator, 3, 2, 2)  # 2 + 4 paths for 8 draft nodes: padding
    roots = torch.tensor([1, 0, 1])
    want = best_first_tree(log_probs, roots, 9, 0.5)
    with mock.patch("specdec_fast.trees.to_host_array", side_effect=AssertionError("a read")):
        got = torch.compile(best_first_tree, fullgraph=True)(log_probs, roots, 9, 0.5)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert (want[1] == PAD_NODE).any()


@pytest.mark.parametrize("batch", [1, 3])
def test_best_first_tree_on_an_accelerator_reads_the_top_k_once(batch):
    """Off the host (`host_resident` False, as on a GPU) the tree is the host's, the roots
    written on the device, from one read of the packed top-K (`to_host_array`) and no other."""
    generator = torch.Generator().manual_seed(11)
    log_probs = torch.log_softmax(torch.randn(batch, 4, 30, generator=generator) * 3, -1)
    roots = torch.randint(30, (batch,), generator=generator)
    want = best_first_tree(log_probs, roots, 16, 0.7)
    reads = []

    def to_host_array(tensor):
        reads.append(tuple(tensor.shape))
        return tensor.numpy()

    with (
        mock.patch("specdec_fast.trees.host_resident", lambda tensor: False),
        mock.patch("specdec_fast.trees.to_host_array", to_host_array),
    ):
        got = best_first_tree(log_probs, roots, 16, 0.7)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert got[0].dtype == got[1].dtype == torch.int64
    assert reads == [(2, batch, 4, 15)]


@pytest.mark.gpu
def test_best_first_tree_on_cuda_equals_the_hosts():
    generator = torch.Generator().manual_seed(12)
    log_probs = torch.log_softmax(torch.randn(4, 6, 500, generator=generator) * 3, -1)
    roots = torch.randint(500, (4,), generator=generator)
    want = best_first_tree(log_probs, roots, 32)
    got = best_first_tree(log_probs.cuda(), roots.cuda(), 32)
    assert got[0].device.type == got[1].device.type == "cuda"
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])


def test_chains_and_their_draft_probabilities():
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 5, 9, generator=generator)
    roots = torch.tensor([1, 2, 3, 4])
    tokens, parents = block_chain(logits, roots, 3)
    assert tokens[:, 1:].tolist() == logits[:, :3].argmax(-1).tolist()
    assert parents.tolist() == [[-1, 0, 1, 2]] * 4
    temperature = torch.tensor([0.0, 0.7, 1.0, 1.3])
    seed = torch.tensor([10, 11, 12, 13])
    positions = torch.tensor([0, 5, 9, 2])
    sampled = sampled_block_chain(logits, roots, 3, temperature, seed, positions, stream=3)
    again = sampled_block_chain(logits, roots, 3, temperature, seed, positions, stream=3)
    assert all(torch.equal(a, b) for a, b in zip(sampled, again, strict=True))
    tokens, parents, probs = sampled
    assert probs.shape == (4, 4, 9) and probs[:, 0].eq(0).all()
    assert tokens[0, 1:].tolist() == logits[0, :3].argmax(-1).tolist()  # greedy row
    one_hot = torch.nn.functional.one_hot(logits[0, :3].argmax(-1), 9).float()
    assert torch.equal(probs[0, 1:], one_hot)
    for row in range(1, 4):
        expected = torch.softmax(logits[row, :3] / temperature[row], -1)
        torch.testing.assert_close(probs[row, 1:], expected)
    # The noise is keyed by (seed, position, stream): another stream or position draws anew.
    grid = positions[:, None] + 1 + torch.arange(5)
    drawn = sample_draft_tokens(logits, temperature, seed, grid, 3)[0][1:]
    assert not torch.equal(drawn, sample_draft_tokens(logits, temperature, seed, grid, 2)[0][1:])
    assert not torch.equal(
        drawn, sample_draft_tokens(logits, temperature, seed, grid + 1, 3)[0][1:]
    )
    with pytest.raises(ValueError, match=r"num_tokens must be in \[1, D = 5\]"):
        block_chain(logits, roots, 6)
    with pytest.raises(ValueError, match=r"logits: expected shape \[B, D, V\]"):
        block_chain(logits[0], roots, 1)
    with pytest.raises(ValueError, match="max_nodes must be >= 2"):
        best_first_tree(logits, roots, 1)


# --- losslessness through verify ---------------------------------------------------------------

DEPTH = 3


def block_marginals() -> torch.Tensor:
    """float64 `[DEPTH, V]` draft logits per position, independent of the drafted tokens: the
    draft bigram along its own most likely path from the root."""
    rows, token = [], ROOT_TOKEN
    for _ in range(DEPTH):
        rows.append(DRAFT[token])
        token = int(DRAFT[token].argmax())
    return torch.stack(rows)


def run_block_case(case: Case, mode: str, draws: int, seed: int, wrong_probs: bool = False):
    """The first two emitted tokens of `draws` independent rows whose proposals come from the
    block marginals (a best-first tree of `nodes`, or a sampled chain of DEPTH tokens)."""
    generator = torch.Generator().manual_seed(seed)
    logits = block_marginals().float().expand(draws, -1, -1)
    roots = torch.full((draws,), ROOT_TOKEN)
    draft_probs = None
    if mode == "ddtree":
        tokens, parents = best_first_tree(torch.log_softmax(logits, -1), roots, 9)
    else:
        temperature = torch.full((draws,), case.temperature)
        seeds = torch.arange(draws) + seed * draws
        tokens, parents, draft_probs = sampled_block_chain(
            logits, roots, DEPTH, temperature, seeds, torch.zeros(draws, dtype=torch.long), 3
        )
        if wrong_probs:
            draft_probs = torch.full_like(draft_probs, 1.0 / VOCAB)
    result = verify(
        TARGET[tokens].float(),
        tokens,
        parents,
        draft_probs,
        temperature=case.temperature,
        top_k=case.top_k,
        top_p=case.top_p,
        seed=seed,
    )
    return emitted_pairs(case, result, tokens, generator), result


BLOCK_CASES = [
    ("ddtree", Case("ddtree", (-1,), temperature=1.0)),
    ("ddtree", Case("ddtree T=0.7 top-k=5", (-1,), temperature=0.7, top_k=5)),
    ("chain", Case("chain", (-1,), temperature=1.0)),
    ("chain", Case("chain T=0.8 top-p=0.9", (-1,), temperature=0.8, top_p=0.9)),
]


@pytest.mark.parametrize(("mode", "case"), BLOCK_CASES, ids=[c.name for _, c in BLOCK_CASES])
def test_block_proposals_are_lossless(monkeypatch, mode, case):
    monkeypatch.setenv("SPECDEC_BACKEND", "fused")
    pairs, result = run_block_case(case, mode, 40000, 300 + BLOCK_CASES.index((mode, case)))
    first, pair = p_values(case, pairs)
    assert first > P_VALUE_FLOOR and pair > P_VALUE_FLOOR, (first, pair)
    assert float((result.num_accepted >= 1).double().mean()) > 0.2


def test_the_check_rejects_a_chain_with_wrong_draft_probabilities(monkeypatch):
    """The same check fails a sampled chain whose draft probabilities are not those it was drawn
    from: the test above can fail."""
    monkeypatch.setenv("SPECDEC_BACKEND", "fused")
    case = Case("chain", (-1,), temperature=1.0)
    pairs, _ = run_block_case(case, "chain", 40000, 7, wrong_probs=True)
    assert min(p_values(case, pairs)) < 1e-30
