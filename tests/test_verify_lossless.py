"""verify is lossless: the emitted tokens follow the (filtered) target distribution exactly.

A synthetic bigram "language model" over V = 12 tokens gives the target logits of every node
(the row of its token) and the draft model's distribution. For each tree shape and sampling
setting, a large batch of rows (independent draws) goes through one `verify` call; the first
emitted token and the pair of the first two (the second drawn from the exact target when the step
emitted only one) are compared with the exact distributions by a chi-square test. The exact
distributions are computed here in float64, independently of the reference implementation.

Tolerance: a case fails when the chi-square p-value is below 1e-5 (cells with expected count
below 5 are merged). With fixed seeds the outcome is deterministic; a correct sampler passes with
probability 1 - 1e-5 per check, while samplers that always accept or always reject the drafts get
p-values below 1e-30 on the same cases (checked by `test_the_check_rejects_broken_samplers`).
"""

import math
from dataclasses import dataclass

import pytest
import torch

from specdec_fast.kernels import verify

VOCAB = 12
ROOT_TOKEN = 0
P_VALUE_FLOOR = 1e-5
_tables = torch.Generator().manual_seed(2024)
TARGET = torch.randn((VOCAB, VOCAB), generator=_tables, dtype=torch.float64) * 1.5
DRAFT = TARGET + torch.randn((VOCAB, VOCAB), generator=_tables, dtype=torch.float64) * 0.8

CHAIN = (-1, 0, 1, 2, 3)
STAR = (-1, 0, 0, 0, 0, 0)
DEEP = (-1, 0, 0, 1, 1, 2, 3, 3, 4, 6, 9)  # depth 5
WIDE = (-1, 0, 0, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4)


@dataclass(frozen=True)
class Case:
    name: str
    parents: tuple[int, ...]
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    draft_probs: bool = False
    duplicate_sibling: bool = False
    draws: int = 40000
    kernel_draws: int = 0  # also run the interpreted Triton kernels on this many rows

    @property
    def depth(self) -> int:
        depths = [0]
        for parent in self.parents[1:]:
            depths.append(depths[parent] + 1)
        return max(depths)


CASES = [
    Case("chain+probs", CHAIN, draft_probs=True, kernel_draws=6000),
    Case("chain", CHAIN),
    Case("star", STAR, duplicate_sibling=True),
    Case("deep", DEEP, kernel_draws=6000),
    Case("wide T=0.6", WIDE, temperature=0.6),
    Case("wide T=1.3 top-k=4", WIDE, temperature=1.3, top_k=4, kernel_draws=4000),
    Case("deep top-p=0.8", DEEP, top_p=0.8),
    Case("chain+probs T=0.8 top-k=5 top-p=0.9", CHAIN, 0.8, 5, 0.9, draft_probs=True),
]


def target_distribution(context: torch.Tensor, case: Case) -> torch.Tensor:
    """float64 `[..., V]`: the filtered target after each context token, computed directly from
    the definition (temperature, then top-k, then top-p; the random logits have no ties)."""
    logits = TARGET[context] / case.temperature
    order = logits.argsort(dim=-1, descending=True)
    rank = order.argsort(dim=-1)
    kept = rank < case.top_k if 0 < case.top_k < VOCAB else torch.ones_like(rank, dtype=torch.bool)
    probs = torch.where(kept, logits.softmax(dim=-1), 0.0)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    if case.top_p < 1:
        sorted_probs = probs.gather(-1, order)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        probs = torch.where((mass_before < case.top_p).gather(-1, rank), probs, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def draft_distribution(context: torch.Tensor) -> torch.Tensor:
    return DRAFT[context].softmax(dim=-1)


def build_rows(case: Case, draws: int, generator):
    """(logits, draft_tokens, parents, draft_probs) for `draws` rows of one case.

    Deterministic drafts: each node's children carry the draft model's top tokens after the
    node's token, in order (a top-k tree drafter), all rows identical. With draft probabilities
    each row samples its own chain from the draft model.
    """
    num_nodes = len(case.parents)
    parents = torch.tensor(case.parents).expand(draws, num_nodes)
    tokens = torch.full((draws, num_nodes), ROOT_TOKEN, dtype=torch.int64)
    draft_probs = torch.zeros((draws, num_nodes, VOCAB), dtype=torch.float64)
    for node in range(1, num_nodes):
        parent_token = tokens[:, case.parents[node]]
        if case.draft_probs:
            draft_probs[:, node] = draft_distribution(parent_token)
            tokens[:, node] = torch.multinomial(draft_probs[:, node], 1, generator=generator)[:, 0]
            continue
        rank = sum(1 for sibling in range(1, node) if case.parents[sibling] == case.parents[node])
        if case.duplicate_sibling and rank == 2:
            rank = 1
        tokens[:, node] = DRAFT[parent_token].argsort(dim=-1, descending=True)[:, rank]
    logits = TARGET[tokens].float()
    return logits, tokens, parents, draft_probs.float() if case.draft_probs else None


def emitted_pairs(case: Case, result, tokens, generator) -> torch.Tensor:
    """int64 `[draws, 2]`: the first two tokens emitted; when the step emitted only one, the
    second is drawn from the exact filtered target after it."""
    path = result.accepted_nodes.long().clamp(min=0)
    accepted = result.num_accepted.long()
    stream = torch.cat([tokens.gather(1, path)[:, 1:], result.next_tokens[:, None]], dim=1)
    # stream[b, t] is the t-th emitted token for t <= num_accepted (the path, then next_tokens).
    emitted = torch.where(
        torch.arange(stream.shape[1])[None, :] < accepted[:, None],
        stream,
        result.next_tokens[:, None],
    )
    first = emitted[:, 0]
    after_first = torch.multinomial(target_distribution(first, case), 1, generator=generator)[:, 0]
    second = torch.where(accepted >= 1, emitted[:, 1], after_first)
    return torch.stack([first, second], dim=1)


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Upper tail of Pearson's chi-square (Wilson-Hilferty normal approximation, accurate to a
    few percent of the p-value for df >= 5), cells with expected count < 5 merged into one."""
    counts = counts.double().flatten()
    expected = probs.double().flatten() * counts.sum()
    small = expected < 5
    if bool(small.any()):
        counts = torch.cat([counts[~small], counts[small].sum()[None]])
        expected = torch.cat([expected[~small], expected[small].sum()[None]])
    statistic = float(((counts - expected) ** 2 / expected.clamp(min=1e-300)).sum())
    df = counts.numel() - 1
    z = ((statistic / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


def p_values(case: Case, pairs: torch.Tensor) -> tuple[float, float]:
    """p-values of the first token and of the pair against the exact distributions."""
    first = target_distribution(torch.tensor(ROOT_TOKEN), case)
    pair = first[:, None] * target_distribution(torch.arange(VOCAB), case)
    first_counts = torch.bincount(pairs[:, 0], minlength=VOCAB)
    pair_counts = torch.bincount(pairs[:, 0] * VOCAB + pairs[:, 1], minlength=VOCAB * VOCAB)
    return chi_square_p_value(first_counts, first), chi_square_p_value(pair_counts, pair)


def sample_pairs(case: Case, draws: int, seed: int, backend: str, monkeypatch) -> torch.Tensor:
    monkeypatch.setenv("SPECDEC_BACKEND", backend)
    generator = torch.Generator().manual_seed(seed)
    logits, tokens, parents, draft_probs = build_rows(case, draws, generator)
    result = verify(
        logits,
        tokens,
        parents,
        draft_probs,
        temperature=case.temperature,
        top_k=case.top_k,
        top_p=case.top_p,
        seed=seed,
    )
    return emitted_pairs(case, result, tokens, generator), result


@pytest.mark.parametrize("backend", ["torch", "fused"])
@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_reference_and_fused_are_lossless(monkeypatch, case, backend):
    """The reference, and the fused-torch implementation with the same number of draws."""
    pairs, result = sample_pairs(case, case.draws, 100 + CASES.index(case), backend, monkeypatch)
    first, pair = p_values(case, pairs)
    assert first > P_VALUE_FLOOR and pair > P_VALUE_FLOOR, (first, pair)
    # The drafts do get accepted, often more than once (not a plain sampler in disguise).
    assert float((result.num_accepted >= 1).double().mean()) > 0.2
    assert int(result.num_accepted.max()) == case.depth


KERNEL_CASES = [case for case in CASES if case.kernel_draws]


@pytest.mark.parametrize("case", KERNEL_CASES, ids=[case.name for case in KERNEL_CASES])
def test_triton_kernels_are_lossless(monkeypatch, case):
    """Fewer draws under the interpreter (one launch pair for the whole batch)."""
    pairs, _ = sample_pairs(case, case.kernel_draws, 200 + CASES.index(case), "triton", monkeypatch)
    first, pair = p_values(case, pairs)
    assert first > P_VALUE_FLOOR and pair > P_VALUE_FLOOR, (first, pair)


def test_greedy_rows_mixed_with_sampling_rows_stay_greedy(monkeypatch):
    """Half the batch at temperature 0 emits exactly the target's argmax path."""
    monkeypatch.setenv("SPECDEC_BACKEND", "triton")
    case = Case("wide", WIDE)
    generator = torch.Generator().manual_seed(5)
    logits, tokens, parents, _ = build_rows(case, 64, generator)
    temperature = torch.tensor([0.0, 1.0]).repeat(32)
    result = verify(logits, tokens, parents, temperature=temperature, seed=9)
    greedy_first = int(TARGET[ROOT_TOKEN].argmax())
    pairs = emitted_pairs(case, result, tokens, generator)
    assert pairs[0::2, 0].eq(greedy_first).all()
    assert pairs[1::2, 0].unique().numel() > 1


def broken_pairs(case: Case, mode: str, draws: int, generator) -> torch.Tensor:
    """What a sampler that always accepts (emits the first child's token, then the first
    grandchild's or a target sample) or always rejects (emits a draw from the root's residual:
    the target without the children's tokens, or max(0, p - q)) would produce."""
    logits, tokens, parents, draft_probs = build_rows(case, draws, generator)
    children = [node for node in range(1, len(case.parents)) if case.parents[node] == 0]
    root_target = target_distribution(torch.tensor(ROOT_TOKEN), case).expand(draws, VOCAB)
    if mode == "accept":
        first = tokens[:, children[0]]
        grandchildren = [n for n in range(1, len(case.parents)) if case.parents[n] == children[0]]
        follow = torch.multinomial(target_distribution(first, case), 1, generator=generator)[:, 0]
        second = tokens[:, grandchildren[0]] if grandchildren else follow
        return torch.stack([first, second], dim=1)
    if draft_probs is not None:
        residual = (root_target - draft_probs[:, children[0]].double()).clamp(min=0)
    else:
        residual = root_target.clone()
        residual[:, tokens[0, children].unique()] = 0
    # Children covering the whole filtered support leave nothing to reject to: emit uniformly.
    residual[residual.sum(dim=1) == 0] = 1.0
    first = torch.multinomial(residual, 1, generator=generator)[:, 0]
    second = torch.multinomial(target_distribution(first, case), 1, generator=generator)[:, 0]
    return torch.stack([first, second], dim=1)


@pytest.mark.parametrize("mode", ("accept", "reject"))
@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_the_check_rejects_broken_samplers(case, mode):
    """The same check, at the reference's sample size, fails samplers that always accept or
    always reject: the tests above can fail."""
    generator = torch.Generator().manual_seed(7)
    first, pair = p_values(case, broken_pairs(case, mode, case.draws, generator))
    assert min(first, pair) < 1e-30, (first, pair)
