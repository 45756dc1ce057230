"""The kernels as torch.library custom ops: schemas, fake kernels and compiled graphs.

`torch.library.opcheck` checks each op's schema (mutations declared), its fake implementation
against the real one (shapes, dtypes, strides), and that `torch.compile` (AOT dispatch, dynamic
shapes included) gives the eager results. Then the public functions run inside
`torch.compile(fullgraph=True)`: no graph break, same results as eager, on every backend.
"""

import pytest
import torch

from specdec_fast.kernels import kv_compact, pack_tree_mask, tree_attention, verify
from specdec_fast.tree_mask import ancestor_mask


def tree_attention_args(generator, tree: bool, q_lens: bool, window: int | None):
    batch, kv_heads, group, num_new, head_dim, capacity = 2, 2, 3, 5, 16, 24
    q = torch.randn(batch, kv_heads * group, num_new, head_dim, generator=generator)
    k_cache, v_cache = torch.randn(2, batch, kv_heads, capacity, head_dim, generator=generator)
    cache_lens = torch.tensor([7, 11], dtype=torch.int32)
    parents = torch.tensor([[-1, 0, 0, 1, 2], [-1, 0, 1, 2, 3]])
    ancestors = ancestor_mask(parents)
    packed = pack_tree_mask(ancestors) if tree else None
    depths = (ancestors.sum(-1) - 1).int() if tree else None
    lens = torch.tensor([5, 3], dtype=torch.int32) if q_lens else None
    return (q, k_cache, v_cache, cache_lens, packed, lens, head_dim**-0.5, None, window, depths)


def verify_args(generator, sampling: bool, chain_probs: bool):
    batch, num_nodes, vocab = 3, 4, 11
    logits = torch.randn(batch, num_nodes, vocab, generator=generator)
    tokens = torch.randint(0, vocab, (batch, num_nodes), generator=generator)
    parents = (
        torch.tensor([[-1, 0, 1, 2]] * batch)
        if chain_probs
        else torch.tensor([[-1, 0, 0, 1], [-1, 0, 1, -2], [-1, 0, 1, 2]])
    )
    probs = torch.softmax(torch.randn(batch, num_nodes, vocab, generator=generator), -1)
    temperature = torch.tensor([0.0, 0.7, 1.3]) if sampling else None
    seed = torch.tensor([3, 5, 7])
    return (
        logits,
        tokens,
        parents,
        probs if chain_probs else None,
        temperature,
        0.0,
        None,
        3 if sampling else 0,
        None,
        0.9 if sampling else 1.0,
        seed,
        0,
    )


def kv_compact_args(generator):
    kv = torch.randn(3, 2, 2, 2, 16, 8, generator=generator)
    cache_lens = torch.tensor([3, 6], dtype=torch.int32)
    accepted_nodes = torch.tensor([[0, 2, 4, -1, -1], [0, 1, 2, 3, -1]], dtype=torch.int32)
    num_accepted = torch.tensor([2, 3], dtype=torch.int32)
    return (kv, cache_lens, accepted_nodes, num_accepted)


@pytest.mark.parametrize("backend", ["torch", "fused", "triton"])
def test_opcheck(monkeypatch, backend):
    monkeypatch.setenv("SPECDEC_BACKEND", backend)
    generator = torch.Generator().manual_seed(0)
    cases = [
        (torch.ops.specdec_fast.tree_attention, tree_attention_args(generator, *flags))
        for flags in ((False, False, None), (True, True, None), (True, False, 4))
    ]
    cases += [
        (torch.ops.specdec_fast.verify, verify_args(generator, *flags))
        for flags in ((False, False), (True, False), (True, True))
    ]
    cases.append((torch.ops.specdec_fast.kv_compact, kv_compact_args(generator)))
    for op, args in cases:
        torch.library.opcheck(op, args)


def step(*tensors):
    """A miniature engine step through the public functions."""
    q, k_cache, v_cache, cache_lens, tree_mask, kv, accepted_nodes, num_accepted = tensors[:8]
    logits, tokens, parents = tensors[8:]
    out = tree_attention(q, k_cache, v_cache, cache_lens, tree_mask=tree_mask)
    result = verify(logits * out.mean(), tokens, parents, temperature=0.8, seed=11)
    kv_compact(kv, cache_lens, accepted_nodes, num_accepted)
    return out, result


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["fused", "torch"])
def test_public_functions_compile_without_graph_breaks(monkeypatch, backend):
    monkeypatch.setenv("SPECDEC_BACKEND", backend)
    generator = torch.Generator().manual_seed(1)
    q, k_cache, v_cache, cache_lens, packed = tree_attention_args(generator, True, False, None)[:5]
    kv, _, accepted_nodes, num_accepted = kv_compact_args(generator)
    logits, tokens, parents = verify_args(generator, True, False)[:3]
    inputs = [q, k_cache, v_cache, cache_lens, packed, kv, accepted_nodes, num_accepted]
    inputs += [logits, tokens, parents]
    eager_inputs = [t.clone() for t in inputs]
    expected_out, expected_result = step(*eager_inputs)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    out, result = compiled(*inputs)
    torch.testing.assert_close(out, expected_out, rtol=1e-5, atol=1e-5)
    for got, want in zip(result, expected_result, strict=True):
        assert torch.equal(got, want)
    # kv_compact's mutations of its inputs survive compilation.
    assert torch.equal(inputs[3], eager_inputs[3]) and torch.equal(inputs[5], eager_inputs[5])
