"""verify: the Triton kernels (interpreted on the CPU) against the torch reference and against a
brute-force greedy walk; the shared random numbers; the top-k/top-p tie rule; validation errors.
Distributional (losslessness) checks are in test_verify_lossless.py; the sm_90 build of every
launch in test_sm90_compile.py.
"""

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from specdec_fast.kernels import VerifyResult, rng, verify, verify_reference
from specdec_fast.kernels.jit.rng import gumbel, stream_key, uniform
from specdec_fast.kernels.reference import verify as reference
from specdec_fast.kernels.verify import LaunchConfig, launch_verify, sampling_params

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# A GPU-like tiling (one row per statistics program, vocabulary split in slices, one sequence per
# walk program, small tiles so that loops over V take several steps), run by the interpreter.
GPU_LIKE = LaunchConfig(
    block_v=16, block_rows=1, num_splits=3, block_seqs=1, walk_block_v=16, search_block_v=8
)


def random_trees(batch: int, num_nodes: int, generator, chain: bool = False) -> torch.Tensor:
    """int64 `[B, N]` parents: ragged trees (padding anywhere, never under a real node) or ragged
    chains (padding last). Row 0 is always full."""
    parents = torch.full((batch, num_nodes), -2, dtype=torch.int64)
    for b in range(batch):
        size = (
            num_nodes if b == 0 else int(torch.randint(1, num_nodes + 1, (), generator=generator))
        )
        if chain:
            parents[b, :size] = torch.arange(-1, size - 1)
            continue
        chosen = torch.randperm(num_nodes - 1, generator=generator)[: size - 1] + 1
        real = [0, *sorted(chosen.tolist())]
        parents[b, 0] = -1
        for position, node in enumerate(real[1:], start=1):
            parents[b, node] = real[int(torch.randint(0, position, (), generator=generator))]
    return parents


def drafts_like_target(logits, parents, generator, hit_rate: float = 0.6) -> torch.Tensor:
    """int64 `[B, N]` draft tokens: the parent's argmax with probability `hit_rate` (so greedy
    walks go deep), else a random token (duplicate siblings included)."""
    batch, num_nodes, vocab = logits.shape
    tokens = torch.randint(0, vocab, (batch, num_nodes), generator=generator)
    parent_rows = logits.float().gather(1, parents.clamp(min=0)[:, :, None].expand(-1, -1, vocab))
    hits = torch.rand((batch, num_nodes), generator=generator) < hit_rate
    return torch.where(hits, parent_rows.argmax(dim=-1), tokens)


def brute_force_greedy(logits, draft_tokens, parents) -> VerifyResult:
    """The greedy contract in plain Python: from the root, follow the first child (node order)
    whose token is the argmax (lowest id among ties) of the current node's logits."""
    batch, num_nodes, _ = logits.shape
    accepted_nodes = torch.full((batch, num_nodes), -1, dtype=torch.int32)
    num_accepted = torch.zeros(batch, dtype=torch.int32)
    next_tokens = torch.zeros(batch, dtype=torch.int64)
    for b in range(batch):
        path = [0]
        while True:
            row = logits[b, path[-1]].float().tolist()
            best = row.index(max(row))
            children = [
                i
                for i in range(path[-1] + 1, num_nodes)
                if int(parents[b, i]) == path[-1] and int(draft_tokens[b, i]) == best
            ]
            if not children:
                break
            path.append(children[0])
        accepted_nodes[b, : len(path)] = torch.tensor(path, dtype=torch.int32)
        num_accepted[b] = len(path) - 1
        next_tokens[b] = best
    return VerifyResult(accepted_nodes, num_accepted, next_tokens)


def assert_same(result: VerifyResult, expected: VerifyResult) -> None:
    assert result.accepted_nodes.dtype == torch.int32
    assert result.num_accepted.dtype == torch.int32
    assert result.next_tokens.dtype == torch.int64
    for got, want in zip(result, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def run_kernel(logits, tokens, parents, draft_probs=None, config=None, **params):
    """The Triton launcher (interpreted) with the public defaults for missing parameters."""
    batch = logits.shape[0]
    values = sampling_params(
        batch,
        logits.shape[1],
        logits.device,
        params.get("temperature"),
        params.get("top_k"),
        params.get("top_p"),
        params.get("seed", 0),
    )
    return launch_verify(logits, tokens, parents, draft_probs, values, config)


# ------------------------------------------------------------------------------------------------
# Random numbers


@triton.jit
def _draw_kernel(seed_ptr, sequence_ptr, node_ptr, counter_ptr, uniform_ptr, gumbel_ptr, STREAM):
    offsets = tl.arange(0, 64)
    key = stream_key(
        tl.load(seed_ptr + offsets),
        tl.load(sequence_ptr + offsets),
        tl.load(node_ptr + offsets),
        STREAM,
    )
    counter = tl.load(counter_ptr + offsets)
    tl.store(uniform_ptr + offsets, uniform(key, counter))
    tl.store(gumbel_ptr + offsets, gumbel(key, counter))


@pytest.mark.parametrize("stream", (0, 1))
def test_kernel_random_numbers_match_the_torch_mirror_bit_for_bit(stream):
    generator = torch.Generator().manual_seed(0)
    seed = torch.randint(-(2**62), 2**62, (64,), generator=generator)
    seed[:4] = torch.tensor([0, -1, 2**32 + 5, -(2**63)])
    sequence = torch.randint(0, 70000, (64,), generator=generator)
    node = torch.randint(0, 1024, (64,), generator=generator)
    counter = torch.randint(0, 262144, (64,), generator=generator)
    drawn_uniform = torch.full((64,), float("nan"))
    drawn_gumbel = torch.full((64,), float("nan"))
    _draw_kernel[(1,)](seed, sequence, node, counter, drawn_uniform, drawn_gumbel, stream)
    key = rng.stream_key(seed, sequence, node, stream)
    want = rng.uniform(key, counter)
    assert torch.equal(drawn_uniform, want)
    # log() may differ by an ulp between numpy, torch and libdevice: the noise agrees to rounding.
    torch.testing.assert_close(drawn_gumbel, rng.gumbel(key, counter), rtol=1e-6, atol=1e-6)
    assert bool(((want > 0) & (want < 1)).all())


def test_uniforms_are_uniform_and_streams_differ():
    """Chi-square over 64 bins, 2**16 draws of one stream (99.99% quantile of chi2(63) is 116),
    and neighbouring keys (node, stream, sequence) give unrelated values."""
    counter = torch.arange(2**16)
    draws = rng.uniform(rng.stream_key(torch.tensor(7), 3, 5, 0), counter)
    expected = draws.numel() / 64
    chi2 = ((torch.bincount((draws * 64).long(), minlength=64) - expected) ** 2 / expected).sum()
    assert float(chi2) < 116
    keys = [(3, 5, 0), (3, 6, 0), (3, 5, 1), (4, 5, 0)]
    streams = torch.stack(
        [rng.uniform(rng.stream_key(torch.tensor(7), *key), counter) for key in keys]
    )
    correlation = torch.corrcoef(streams)
    assert float((correlation - torch.eye(len(keys))).abs().max()) < 0.03


# ------------------------------------------------------------------------------------------------
# Greedy


@pytest.mark.parametrize(
    ("batch", "num_nodes", "vocab"), [(1, 1, 1), (3, 5, 3), (17, 17, 127), (2, 128, 33)]
)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", ("torch", "triton", "fused"))
def test_greedy_matches_brute_force_walk(monkeypatch, backend, dtype, batch, num_nodes, vocab):
    """Random ragged trees, integer logits in [-2, 2] so that ties are everywhere (exact in every
    dtype), drafts that often hit the argmax, non-contiguous inputs."""
    monkeypatch.setenv("SPECDEC_BACKEND", backend)
    generator = torch.Generator().manual_seed(batch * 1000 + num_nodes)
    wide = torch.randint(-2, 3, (batch, num_nodes, 2 * vocab), generator=generator).to(dtype)
    logits = wide[..., ::2]
    parents = random_trees(batch, num_nodes, generator)
    tokens = drafts_like_target(logits, parents, generator)
    result = verify(logits, tokens.T.contiguous().T, parents.int(), seed=1)
    assert_same(result, brute_force_greedy(logits, tokens, parents))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_greedy_kernel_with_gpu_like_tiling(dtype):
    generator = torch.Generator().manual_seed(5)
    logits = torch.randint(-3, 4, (3, 9, 45), generator=generator).to(dtype)
    parents = random_trees(3, 9, generator)
    tokens = drafts_like_target(logits, parents, generator, hit_rate=0.8)
    result = run_kernel(logits, tokens, parents, config=GPU_LIKE, temperature=0.0)
    assert_same(result, brute_force_greedy(logits, tokens, parents))


# ------------------------------------------------------------------------------------------------
# Sampling: kernel and reference draw the same numbers, so they agree exactly


def sampling_case(kind: str, batch: int, num_nodes: int, vocab: int, dtype, generator):
    """Inputs for one agreement case: (logits, tokens, parents, draft_probs, params)."""
    logits = (torch.randn((batch, num_nodes, vocab), generator=generator) * 2).to(dtype)
    chain = kind.startswith("chain")
    parents = random_trees(batch, num_nodes, generator, chain=chain)
    temperature = torch.rand(batch, generator=generator) * 1.5 + 0.2
    draft_probs = None
    if kind == "chain+probs":
        # A draft close to the target at the row's temperature, so that chains get accepted.
        noise = torch.randn(logits.shape, generator=generator) * 0.3
        draft_logits = (logits.float() + noise) / temperature[:, None, None]
        draft_probs = torch.softmax(draft_logits, dim=-1).to(dtype)
        tokens = torch.multinomial(draft_probs.float().flatten(0, 1), 1, generator=generator)
        tokens = tokens.view(batch, num_nodes)
        draft_probs = draft_probs.transpose(0, 1).contiguous().transpose(0, 1)  # node-major
    else:
        tokens = drafts_like_target(logits, parents, generator, hit_rate=0.7)
    temperature[::3] = 0.0  # greedy rows mixed in
    params = {
        "temperature": temperature,
        "top_k": torch.randint(0, 6, (batch,), generator=generator),
        "top_p": torch.where(
            torch.rand(batch, generator=generator) < 0.5,
            torch.rand(batch, generator=generator) * 0.8 + 0.1,
            1.0,
        ),
        "seed": torch.randint(0, 2**40, (batch,), generator=generator),
    }
    return logits, tokens, parents, draft_probs, params


AGREEMENT_CASES = [
    # (kind, batch, num_nodes, vocab, dtype, filters, config)
    ("tree", 17, 13, 61, torch.float32, False, None),
    ("tree", 17, 13, 61, torch.bfloat16, True, None),
    ("tree", 3, 7, 37, torch.float16, True, GPU_LIKE),
    ("chain", 9, 6, 50, torch.float32, True, None),
    ("chain+probs", 33, 6, 50, torch.float32, False, None),
    ("chain+probs", 33, 6, 50, torch.bfloat16, True, None),
    ("chain+probs", 4, 5, 29, torch.float32, True, GPU_LIKE),
]


@pytest.mark.parametrize(
    ("kind", "batch", "num_nodes", "vocab", "dtype", "filters", "config"),
    AGREEMENT_CASES,
    ids=[
        f"{c[0]}-B{c[1]}-{str(c[4])[6:]}-{'filters' if c[5] else 'T'}-{c[6] and 'gpu_like'}"
        for c in AGREEMENT_CASES
    ],
)
def test_sampling_kernel_agrees_with_reference(
    kind, batch, num_nodes, vocab, dtype, filters, config
):
    generator = torch.Generator().manual_seed(batch + num_nodes + vocab)
    logits, tokens, parents, draft_probs, params = sampling_case(
        kind, batch, num_nodes, vocab, dtype, generator
    )
    if not filters:
        params.pop("top_k")
        params.pop("top_p")
    result = run_kernel(logits, tokens, parents, draft_probs, config, **params)
    expected = verify_reference(logits, tokens, parents, draft_probs, **params)
    assert_same(result, expected)
    assert filters or batch < 8 or int(result.num_accepted.max()) >= 2  # walks go deep


@pytest.mark.parametrize("seeds", ["per-row", "per-node"])
@pytest.mark.parametrize(
    ("kind", "batch", "num_nodes", "vocab", "dtype"),
    [
        ("tree", 17, 13, 61, torch.float32),
        ("tree", 5, 9, 33, torch.bfloat16),
        ("tree", 3, 7, 37, torch.float16),
        ("chain", 9, 6, 50, torch.float32),
        ("tree", 1, 1, 29, torch.float32),
    ],
)
def test_fused_host_walk_draws_what_the_reference_draws(
    kind, batch, num_nodes, vocab, dtype, seeds
):
    """The fused backend's sampled walk of deterministic trees (draws at the visited nodes only)
    against the reference (draws at every node), filters on and off, greedy rows mixed in."""
    from specdec_fast.kernels.fused.verify import verify_fused

    generator = torch.Generator().manual_seed(batch * num_nodes + vocab)
    logits, tokens, parents, _, params = sampling_case(
        kind, batch, num_nodes, vocab, dtype, generator
    )
    if seeds == "per-node":
        params["seed"] = params["seed"][:, None] + torch.arange(num_nodes)
    deep = 0
    for filters in (False, True):
        case = dict(params) if filters else {**params, "top_k": 0, "top_p": 1.0}
        result = verify_fused(logits, tokens, parents, None, **case)
        assert_same(result, verify_reference(logits, tokens, parents, None, **case))
        deep = max(deep, int(result.num_accepted.max()))
    assert num_nodes < 6 or deep >= 2  # the walks go past the first level


@pytest.mark.parametrize("kind", ["tree", "chain+probs"])
def test_per_node_seeds_agree_across_backends(monkeypatch, kind):
    """int64 [B, N] seeds (the engine's row seed + node position): the kernel, the reference and
    the fused implementation draw the same numbers, and the numbers do depend on the seeds."""
    generator = torch.Generator().manual_seed(71)
    logits, tokens, parents, draft_probs, params = sampling_case(
        kind, 9, 6, 40, torch.float32, generator
    )
    params["seed"] = params["seed"][:, None] + torch.arange(6)  # a position per node
    results = {}
    for backend in ("torch", "fused", "triton"):
        monkeypatch.setenv("SPECDEC_BACKEND", backend)
        results[backend] = verify(logits, tokens, parents, draft_probs, **params)
    assert_same(results["fused"], results["torch"])
    assert_same(results["triton"], results["torch"])
    params["seed"] = params["seed"] + 1
    other = verify(logits, tokens, parents, draft_probs, **params)
    assert not torch.equal(other.next_tokens, results["torch"].next_tokens)


def test_every_output_and_workspace_cell_is_written_before_it_is_read(monkeypatch):
    """Outputs and the statistics workspace come from torch.empty: poison it (NaN, and -7 for
    integers) and compare with the reference under the GPU-like tiling, padding included."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        tensor = empty(*args, **kwargs)
        return tensor.fill_(float("nan") if tensor.is_floating_point() else -7)

    generator = torch.Generator().manual_seed(12)
    logits, tokens, parents, draft_probs, params = sampling_case(
        "chain+probs", 5, 6, 40, torch.float32, generator
    )
    monkeypatch.setattr(torch, "empty", poisoned)
    result = run_kernel(logits, tokens, parents, draft_probs, GPU_LIKE, **params)
    monkeypatch.undo()
    assert_same(result, verify_reference(logits, tokens, parents, draft_probs, **params))


@pytest.mark.parametrize("temperature", (0.0, 1.0))
def test_largest_vocabulary(temperature):
    """V = 262144 in bf16: a greedy tree and a sampled chain whose draft is rejected, so that the
    walk's residual pass covers the whole row."""
    generator = torch.Generator().manual_seed(14)
    vocab = 262144
    logits = (torch.randn((2, 3, vocab), generator=generator) * 4).bfloat16()
    parents = torch.tensor([[-1, 0, 1], [-1, 0, 0]])
    tokens = logits.float().argmax(dim=-1)[:, [0, 0, 1]]
    draft_probs = torch.softmax(torch.randn((2, 3, vocab), generator=generator), dim=-1)
    probs = draft_probs if temperature > 0 else None
    if temperature > 0:
        parents = torch.tensor([[-1, 0, 1], [-1, 0, -2]])
        tokens[1, 1] = int(draft_probs[1, 1].argmax())
    result = run_kernel(logits, tokens, parents, probs, temperature=temperature, seed=3)
    assert_same(result, verify_reference(logits, tokens, parents, probs, temperature, seed=3))


def test_scalar_parameters_equal_broadcast_tensors():
    generator = torch.Generator().manual_seed(3)
    logits, tokens, parents, _, _ = sampling_case("tree", 6, 9, 40, torch.float32, generator)
    scalars = {"temperature": 0.8, "top_k": 4, "top_p": 0.9}
    tensors = {name: torch.tensor([value] * 6) for name, value in scalars.items()}
    assert_same(
        run_kernel(logits, tokens, parents, **scalars, seed=2**35 + 1),
        verify_reference(logits, tokens, parents, **tensors, seed=2**35 + 1),
    )


@pytest.mark.parametrize("backend", ("torch", "triton", "fused"))
def test_per_sequence_seeds_do_not_depend_on_the_batch_slot(monkeypatch, backend):
    """Permuting the rows (and their seeds) permutes the results; an int seed mixes the slot in,
    so identical rows still draw independently."""
    monkeypatch.setenv("SPECDEC_BACKEND", backend)
    generator = torch.Generator().manual_seed(6)
    logits, tokens, parents, draft_probs, params = sampling_case(
        "chain+probs", 12, 5, 30, torch.float32, generator
    )
    params.pop("top_p")
    result = verify(logits, tokens, parents, draft_probs, **params)
    order = torch.randperm(12, generator=generator)
    permuted = verify(
        logits[order],
        tokens[order],
        parents[order],
        draft_probs[order],
        **{name: value[order] for name, value in params.items()},
    )
    assert_same(permuted, VerifyResult(*(tensor[order] for tensor in result)))
    same_rows = logits[:1].expand(64, -1, -1)
    shared = verify(
        same_rows, tokens[:1].expand(64, -1), parents[:1].expand(64, -1), temperature=1.0, seed=4
    )
    assert shared.next_tokens.unique().numel() > 1


def test_numpy_scalars_are_the_numbers_they_hold(monkeypatch):
    """np.float32 / np.int64 sampling parameters and seeds (as a caller's arrays give them)
    draw what the Python numbers draw; a bool is no number."""
    monkeypatch.setenv("SPECDEC_BACKEND", "triton")
    generator = torch.Generator().manual_seed(5)
    logits, tokens, parents, _, _ = sampling_case("tree", 8, 5, 20, torch.float32, generator)
    python = verify(logits, tokens, parents, temperature=0.7, top_k=5, top_p=0.9, seed=3)
    numpy = verify(
        logits, tokens, parents, temperature=np.float32(0.7), top_k=np.int64(5),
        top_p=np.float32(0.9), seed=np.int64(3),
    )  # fmt: skip
    assert_same(numpy, python)
    with pytest.raises(ValueError, match="top_k: expected an int >= 0"):
        verify(logits, tokens, parents, temperature=0.7, top_k=np.float64(5.0), seed=3)
    with pytest.raises(ValueError, match="seed: expected an int64"):
        verify(logits, tokens, parents, temperature=0.7, seed=np.bool_(True))


def test_same_seed_same_result_and_none_follows_torch_manual_seed(monkeypatch):
    monkeypatch.setenv("SPECDEC_BACKEND", "triton")
    generator = torch.Generator().manual_seed(4)
    logits, tokens, parents, _, _ = sampling_case("tree", 64, 5, 20, torch.float32, generator)
    first = verify(logits, tokens, parents, temperature=1.0, seed=11)
    assert_same(verify(logits, tokens, parents, temperature=1.0, seed=11), first)
    other = verify(logits, tokens, parents, temperature=1.0, seed=12)
    assert not torch.equal(other.next_tokens, first.next_tokens)
    torch.manual_seed(123)
    drawn = verify(logits, tokens, parents, temperature=1.0)
    torch.manual_seed(123)
    assert_same(verify(logits, tokens, parents, temperature=1.0), drawn)


def test_duplicate_siblings_accept_the_first():
    """Two children with the target's only possible token: the first in node order is taken."""
    logits = torch.full((1, 4, 8), float("-inf"))
    logits[0, :, 5] = 0.0
    parents = torch.tensor([[-1, 0, 0, 0]])
    tokens = torch.tensor([[0, 3, 5, 5]])
    for temperature in (0.0, 1.0):
        result = run_kernel(logits, tokens, parents, temperature=temperature)
        assert result.accepted_nodes.tolist() == [[0, 2, -1, -1]]
        assert result.next_tokens.tolist() == [5]


# ------------------------------------------------------------------------------------------------
# Filters


def kept_by_definition(logits, scaled, top_k: int, top_p: float) -> list[bool]:
    """The tie rule of reference/verify.py, token by token: top-k keeps v iff fewer than k
    logits are strictly larger; top-p keeps v iff the renormalized mass of strictly larger
    logits among the top-k survivors is < top_p."""
    values = logits.tolist()
    weights = scaled.double().exp().tolist()
    vocab = len(values)
    k_kept = [
        not 0 < top_k < vocab or sum(other > value for other in values) < top_k for value in values
    ]
    total = sum(w for w, kept in zip(weights, k_kept, strict=True) if kept)
    return [
        k_kept[v]
        and (
            top_p >= 1
            or sum(
                w
                for w, other, kept in zip(weights, values, k_kept, strict=True)
                if kept and other > values[v]
            )
            < top_p * total
        )
        for v in range(vocab)
    ]


def test_kept_tokens_follow_the_tie_rule():
    generator = torch.Generator().manual_seed(8)
    logits = torch.randint(-2, 3, (6, 5, 12), generator=generator).float()
    logits[0, 0, :6] = float("-inf")
    temperature = torch.rand(6, generator=generator) + 0.5
    top_k = torch.tensor([0, 1, 3, 7, 12, 4])
    top_p = torch.tensor([0.3, 1.0, 0.6, 0.95, 0.5, 0.75])
    scaled = (logits - logits.amax(-1, keepdim=True)) / temperature[:, None, None]
    kept = reference.kept_tokens(logits, scaled, top_k, top_p)
    for b in range(6):
        for n in range(5):
            want = kept_by_definition(logits[b, n], scaled[b, n], int(top_k[b]), float(top_p[b]))
            assert kept[b, n].tolist() == want, (b, n)


@pytest.mark.parametrize("backend", ("torch", "triton", "fused"))
def test_filtered_samples_cover_exactly_the_kept_set(monkeypatch, backend):
    """Root-only trees: next_tokens are draws from the filtered root distribution. Tied logits
    in [-2, 1] and a high temperature make every kept token likely (p > 1.5%: missed in 1000
    draws with probability < 1e-6): the set of drawn tokens must equal the kept set."""
    monkeypatch.setenv("SPECDEC_BACKEND", backend)
    generator = torch.Generator().manual_seed(9)
    rows = torch.randint(-2, 2, (5, 1, 24), generator=generator).float()
    top_k = torch.tensor([3, 0, 8, 2, 24])
    top_p = torch.tensor([1.0, 0.5, 0.7, 0.9, 0.2])
    copies = 1000
    logits = rows.repeat_interleave(copies, dim=0)
    temperature = torch.full((5 * copies,), 4.0)
    result = verify(
        logits,
        torch.zeros((5 * copies, 1), dtype=torch.int64),
        torch.full((5 * copies, 1), -1),
        temperature=temperature,
        top_k=top_k.repeat_interleave(copies),
        top_p=top_p.repeat_interleave(copies),
        seed=torch.arange(5 * copies),
    )
    scaled = (rows - rows.amax(-1, keepdim=True)) / 4.0
    for b in range(5):
        want = kept_by_definition(rows[b, 0], scaled[b, 0], int(top_k[b]), float(top_p[b]))
        drawn = set(result.next_tokens[b * copies : (b + 1) * copies].tolist())
        assert drawn == {v for v in range(24) if want[v]}, b


# ------------------------------------------------------------------------------------------------
# Validation


def valid_inputs(batch: int = 3, num_nodes: int = 5, vocab: int = 11, chain: bool = False):
    generator = torch.Generator().manual_seed(21)
    logits = torch.randn((batch, num_nodes, vocab), generator=generator)
    parents = random_trees(batch, num_nodes, generator, chain=chain)
    return {
        "logits": logits,
        "draft_tokens": torch.randint(0, vocab, (batch, num_nodes), generator=generator),
        "parents": parents,
    }


def _set(name, index, value):
    def change(inputs):
        inputs[name] = inputs[name].clone()
        inputs[name][index] = value

    return change


def _put(**values):
    return lambda inputs: inputs.update(values)


INVALID = [
    (_set("parents", (1, 0), 0), r"parents\[1, 0\] = 0: the root must be node 0, with parent -1"),
    (_set("parents", (0, 3), 3), r"parents\[0, 3\] = 3: expected -2 \(padding\) or a parent in"),
    (_set("parents", (0, 2), 4), r"parents\[0, 2\] = 4: expected -2 \(padding\) or a parent in"),
    (_set("parents", (0, 1), -1), r"parents\[0, 1\] = -1: expected -2 \(padding\) or a parent"),
    (_set("draft_tokens", (0, 4), 11), r"draft_tokens\[0, 4\] = 11 is outside the vocabulary"),
    (_set("draft_tokens", (0, 2), -3), r"draft_tokens\[0, 2\] = -3 is outside the vocabulary"),
    (_put(temperature=-0.5), r"temperature: expected 0 or a finite number >= 1.18e-38, got -0.5"),
    (_put(temperature=float("nan")), r"temperature: expected 0 or a finite number"),
    (_put(temperature=1e-45), r"temperature: expected 0 or a finite number"),
    (
        _put(temperature=torch.tensor([0.5, 1e-40, 1.0])),
        r"temperature\[1\] = 9.9999.*e-41: expected 0 or",
    ),
    (_put(temperature=torch.tensor([0.5, -1.0, 1.0])), r"temperature\[1\] = -1.0: expected"),
    (_put(temperature=torch.tensor([0.5, 1.0])), r"temperature: expected shape \[B\] = \(3,\)"),
    (_put(top_p=0.0), r"top_p: expected a number in \(0, 1\] \(1: off\), got 0.0"),
    (_put(top_p=1.5), r"top_p: expected a number in \(0, 1\]"),
    (_put(top_p=torch.tensor([0.5, 1.0, float("nan")])), r"top_p\[2\] = nan: expected"),
    (_put(top_k=-1), r"top_k: expected an int >= 0 \(0: off\), got -1"),
    (_put(top_k=2.5), r"top_k: expected an int >= 0"),
    (_put(top_k=torch.tensor([0, -2, 3])), r"top_k\[1\] = -2: expected an int >= 0"),
    (_put(top_k=torch.tensor([0.0, 2.0, 3.0])), r"top_k: expected dtype in \(int32, int64\)"),
    (_put(seed="7"), r"seed: expected an int64, an int \[B\] tensor or an int64 \[B, N\] tensor"),
    (_set("logits", (2, 3, 4), float("nan")), r"logits\[2, 3\]: expected finite values .* 1 NaN"),
    (_set("logits", (0, 0, 1), float("inf")), r"logits\[0, 0\]: expected finite .* 1 \+inf"),
    (_set("logits", (1, 0), float("-inf")), r"logits\[1, 0\]: expected .* 11 -inf of V = 11"),
    (_put(logits=torch.randn(3, 5)), r"logits: expected shape \[B, N, V\]"),
    (_put(logits=torch.randn(3, 5, 11).double()), r"logits: expected dtype in \(float32"),
    (_put(parents=torch.zeros(3, 4, dtype=torch.int64)), r"parents: expected shape \[B, N\]"),
    (_put(draft_tokens=torch.zeros(3, 5)), r"draft_tokens: expected dtype in \(int32, int64\)"),
    (_put(draft_probs=torch.rand(3, 5, 11)), r"draft_probs: only chains take draft prob"),
    (_put(draft_probs=torch.rand(3, 5, 12)), r"draft_probs: expected shape \[B, N, V\]"),
]


@pytest.mark.parametrize(("change", "message"), INVALID, ids=[m[:40] for _, m in INVALID])
@pytest.mark.parametrize("backend", ("torch", "triton", "fused"))
def test_invalid_inputs_are_clear_errors(monkeypatch, backend, change, message):
    monkeypatch.setenv("SPECDEC_BACKEND", backend)
    inputs = valid_inputs()
    inputs["parents"] = torch.tensor([[-1, 0, 1, 2, 1], [-1, 0, 0, 1, 1], [-1, 0, 0, 2, -2]])
    inputs.setdefault("seed", 0)
    change(inputs)
    with pytest.raises(ValueError, match=message):
        verify(**inputs)


def _chain_probs(change):
    """A chain's valid draft probabilities (the root's row unused: zeros), then `change`."""

    def apply(inputs):
        probs = torch.softmax(torch.randn(inputs["logits"].shape), dim=-1)
        probs[:, 0] = 0.0
        change(probs)
        inputs["draft_probs"] = probs

    return apply


def _entry(index, value):
    return lambda probs: probs.__setitem__(index, value)


BAD_DRAFT_PROBS = [
    (_entry((1, 2, 4), -0.25), r"draft_probs\[1, 2\]: expected finite, >= 0 .* 1 negative"),
    (_entry((0, 3, 0), float("nan")), r"draft_probs\[0, 3\]: expected .* got 1 NaN"),
    (_entry((2, 1, 5), float("inf")), r"draft_probs\[2, 1\]: expected finite"),
    (lambda probs: probs[0, 4].mul_(1.5), r"draft_probs\[0, 4\]: expected .* sum 1.5"),
    (lambda probs: probs[0, 1].zero_(), r"draft_probs\[0, 1\]: expected .* sum 0"),
]


@pytest.mark.parametrize(("change", "message"), BAD_DRAFT_PROBS, ids=range(len(BAD_DRAFT_PROBS)))
@pytest.mark.parametrize("backend", ("torch", "triton", "fused"))
def test_draft_probs_must_be_distributions(monkeypatch, backend, change, message):
    """Negative or NaN draft probabilities would make every draft pass `u * q < p` (no longer
    lossless): rows of existing nodes after the root are checked, on every backend."""
    monkeypatch.setenv("SPECDEC_BACKEND", backend)
    inputs = valid_inputs(chain=True)
    _chain_probs(change)(inputs)
    with pytest.raises(ValueError, match=message):
        verify(**inputs, temperature=0.8, seed=1)


def test_draft_probs_tolerance_admits_16_bit_rounding():
    inputs = valid_inputs(chain=True)
    _chain_probs(lambda probs: None)(inputs)
    inputs["draft_probs"] = inputs["draft_probs"].to(torch.bfloat16)
    inputs["logits"] = inputs["logits"].to(torch.bfloat16)
    inputs["draft_probs"][:, 1:, 0] += 0.005  # within bf16's 1e-2
    verify(**inputs, temperature=0.8, seed=1)
    inputs["draft_probs"][:, 1:, 0] += 0.02
    with pytest.raises(ValueError, match=r"draft_probs\[0, 1\]: expected"):
        verify(**inputs, temperature=0.8, seed=1)


@pytest.mark.parametrize("temperature", (0.9, 0.0))
@pytest.mark.parametrize("backend", ("torch", "triton", "fused"))
def test_padded_nodes_are_never_checked_or_read(monkeypatch, backend, temperature):
    monkeypatch.setenv("SPECDEC_BACKEND", backend)
    inputs = valid_inputs(chain=True)
    inputs["parents"][1] = torch.tensor([-1, 0, -2, -2, -2])
    inputs["logits"][1, 2:] = float("nan")
    inputs["draft_tokens"][1, 2:] = -7
    inputs["draft_probs"] = torch.softmax(torch.randn(inputs["logits"].shape), dim=-1)
    result = verify(**inputs, temperature=temperature, seed=2)
    assert int(result.num_accepted[1]) <= 1
    assert result.accepted_nodes[1, 2:].eq(-1).all()


@pytest.mark.parametrize("temperature", (0.7, 0.0))
@pytest.mark.parametrize("backend", ("torch", "triton", "fused"))
def test_without_validation_an_unusable_row_gives_minus_one_never_a_token(
    monkeypatch, backend, temperature
):
    """Sampled and greedy (the fused backend's host walk): a NaN at a real node, a root of -inf."""
    monkeypatch.setenv("SPECDEC_BACKEND", backend)
    inputs = valid_inputs(batch=4)
    inputs["logits"][2, int((inputs["parents"][2] != -2).nonzero()[-1])] = float("nan")
    inputs["logits"][3, 0] = float("-inf")
    expected = verify(**{k: v[:2] for k, v in inputs.items()}, temperature=temperature, seed=3)
    result = verify(**inputs, temperature=temperature, seed=3, validate=False)
    assert result.next_tokens[2:].tolist() == [-1, -1]
    assert result.num_accepted[2:].tolist() == [0, 0]
    assert result.accepted_nodes[2:, 1:].eq(-1).all()
    assert_same(VerifyResult(*(tensor[:2] for tensor in result)), expected)


def test_empty_batch():
    inputs = valid_inputs()
    result = verify(**{k: v[:0] for k, v in inputs.items()}, temperature=1.0)
    assert result.accepted_nodes.shape == (0, 5) and result.next_tokens.shape == (0,)


# ------------------------------------------------------------------------------------------------
# Compiled kernels (CUDA)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ("tree", "chain+probs"))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32), ids=str)
def test_compiled_kernels_agree_with_reference_at_llama3_vocab(kind, dtype):
    generator = torch.Generator().manual_seed(31)
    logits, tokens, parents, draft_probs, params = sampling_case(
        kind, 8, 9 if kind == "tree" else 6, 128256, dtype, generator
    )
    inputs = [logits, tokens, parents, draft_probs]
    cuda = [None if tensor is None else tensor.cuda() for tensor in inputs]
    cuda_params = {name: value.cuda() for name, value in params.items()}
    result = verify(*cuda, **cuda_params)
    expected = verify_reference(*inputs, **params)
    # Same random numbers; only float rounding at near-ties could differ (none at this seed).
    assert_same(VerifyResult(*(tensor.cpu() for tensor in result)), expected)


@pytest.mark.gpu
def test_two_launches_and_cuda_graph_replay():
    generator = torch.Generator().manual_seed(32)
    logits, tokens, parents, _, params = sampling_case(
        "tree", 4, 16, 32000, torch.float32, generator
    )
    cuda = [tensor.cuda() for tensor in (logits, tokens, parents)]
    seed = params["seed"].cuda()
    verify(*cuda, temperature=0.8, seed=seed)  # compile outside the capture
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        verify(*cuda, temperature=0.8, seed=seed, validate=False)
        torch.cuda.synchronize()
    kernels = [event for event in profile.events() if event.device_type.name == "CUDA"]
    assert len(kernels) == 2, [event.name for event in kernels]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = verify(*cuda, temperature=0.8, seed=seed)
    for step in range(3):
        seed.add_(step)
        graph.replay()
        eager = verify(*cuda, temperature=0.8, seed=seed)
        assert_same(captured, eager)
