"""verify's GPU schedules under the interpreter: the residual race of a rejected chain node
split over vocabulary slices (several walk programs per sequence, an arrival counter, the last
program merging) gives exactly the reference's result, with any slice count, blocks of several
sequences, filters, the fallback when the residual has no positive weight, and a poisoned
workspace; and the launcher picks the split for batch-1 chains on a GPU.
"""

import pytest
import torch
import triton
from test_tree_attention import poisoned_allocations
from test_verify import assert_same, run_kernel, sampling_case

from specdec_fast.kernels import verify_reference
from specdec_fast.kernels.configs import tuned_configs
from specdec_fast.kernels.verify import (
    MAX_PARALLEL_CHAIN,
    RACE_TILE_CANDIDATES,
    LaunchConfig,
    launch_config,
)


def split_config(race_splits: int, block_seqs: int = 1) -> LaunchConfig:
    """A GPU-like tiling (small tiles, sliced statistics) whose walk splits the residual race."""
    return LaunchConfig(
        block_v=16,
        block_rows=1,
        num_splits=3,
        block_seqs=block_seqs,
        walk_block_v=8,
        search_block_v=8,
        race_splits=race_splits,
    )


SPLIT_CASES = [
    # (batch, num_nodes, vocab, dtype, filters, race_splits, block_seqs)
    (1, 6, 61, torch.float32, False, 8, 1),  # one walk tile per slice
    (5, 6, 61, torch.float32, False, 3, 1),
    (7, 5, 50, torch.bfloat16, False, 2, 4),  # blocks of sequences, a partial last block
    (3, 6, 37, torch.float16, True, 5, 2),  # filters: the kernel stays exact (unused on a GPU)
    (4, 4, 29, torch.float32, False, 16, 1),  # more slices asked than walk tiles: one each
]


@pytest.mark.parametrize(
    ("batch", "num_nodes", "vocab", "dtype", "filters", "race_splits", "block_seqs"),
    SPLIT_CASES,
    ids=[f"B{c[0]}-V{c[2]}-{str(c[3])[6:]}-splits{c[5]}-bb{c[6]}" for c in SPLIT_CASES],
)
def test_split_residual_race_agrees_with_reference(
    batch, num_nodes, vocab, dtype, filters, race_splits, block_seqs
):
    generator = torch.Generator().manual_seed(batch * vocab + race_splits)
    logits, tokens, parents, draft_probs, params = sampling_case(
        "chain+probs", batch, num_nodes, vocab, dtype, generator
    )
    if not filters:
        params.pop("top_k")
        params.pop("top_p")
    config = split_config(race_splits, block_seqs)
    result = run_kernel(logits, tokens, parents, draft_probs, config, **params)
    expected = verify_reference(logits, tokens, parents, draft_probs, **params)
    assert_same(result, expected)
    sampled_chains = (params["temperature"] > 0).sum()
    rejected = (expected.num_accepted < num_nodes - 1) & (params["temperature"] > 0)
    assert sampled_chains == 0 or rejected.any()  # the split race ran


def test_residual_without_positive_weight_falls_back_to_the_node_sample():
    """q(x) = 2 > p(x) = 1 at the only token p allows: half the drafts are rejected, and the
    residual max(0, p - q) is zero everywhere, so the emitted token is the node's own sample."""
    batch, num_nodes, vocab = 5, 3, 24
    generator = torch.Generator().manual_seed(3)
    allowed = torch.randint(0, vocab, (batch, num_nodes), generator=generator)
    logits = torch.full((batch, num_nodes, vocab), float("-inf"))
    logits.scatter_(2, allowed[:, :, None], 0.0)
    tokens = torch.cat([torch.zeros(batch, 1, dtype=torch.int64), allowed[:, :-1]], dim=1)
    draft_probs = torch.zeros(batch, num_nodes, vocab)
    draft_probs.scatter_(2, tokens[:, :, None], 2.0)
    parents = torch.arange(-1, num_nodes - 1).expand(batch, -1).contiguous()
    params = dict(temperature=1.0, seed=torch.arange(batch) * 7919)
    expected = verify_reference(logits, tokens, parents, draft_probs, **params)
    assert (expected.num_accepted < num_nodes - 1).any()
    for config in (split_config(1), split_config(4), split_config(4, block_seqs=4)):
        result = run_kernel(logits, tokens, parents, draft_probs, config, **params)
        assert_same(result, expected)


def test_every_race_cell_is_written_before_it_is_read():
    """The race workspace and the arrival counters come from torch.empty: poisoned (NaN, -77),
    the split walk still agrees with the reference."""
    generator = torch.Generator().manual_seed(14)
    logits, tokens, parents, draft_probs, params = sampling_case(
        "chain+probs", 5, 6, 40, torch.float32, generator
    )
    params.pop("top_k")
    params.pop("top_p")
    with poisoned_allocations():
        result = run_kernel(logits, tokens, parents, draft_probs, split_config(3), **params)
    assert_same(result, verify_reference(logits, tokens, parents, draft_probs, **params))


def test_gpu_launch_config_splits_the_batch1_chain():
    """H200 (132 SMs), V = 128256: a B1 chain races 126 slices of 1024 tokens; B32, slices of
    at most `verify_race_tiles` tiles (32 of 4 tiles by default);
    trees and filtered chains keep one program per sequence; the interpreter never splits."""
    chain_b1 = launch_config(1, 6, 128256, 132, split_residual=True)
    assert (chain_b1.race_splits, chain_b1.walk_block_v, chain_b1.num_splits) == (126, 1024, 63)
    # B32: at least two programs per SM (9 slices), and no slice over the tuned walk tiles.
    race_tiles = tuned_configs()["verify_race_tiles"]
    assert race_tiles in RACE_TILE_CANDIDATES
    b32_splits = launch_config(32, 6, 128256, 132, split_residual=True).race_splits
    assert b32_splits == max(9, triton.cdiv(128256, race_tiles * 1024))
    assert launch_config(1, 64, 128256, 132).race_splits == 1
    assert launch_config(1, 6, 128256, None, split_residual=True).race_splits == 1


@pytest.mark.parametrize("num_nodes", [7, MAX_PARALLEL_CHAIN + 1])
def test_chain_accepted_prefix_decided_at_once_agrees_with_reference(num_nodes):
    """Chains with draft probabilities and no filters of up to MAX_PARALLEL_CHAIN nodes decide
    every node's acceptance at once (the walk's `_accepted_prefix`), longer ones node by node:
    both give the reference's result, on ragged chains with greedy rows mixed in, and drafts
    close to the target so that deep prefixes are accepted (the case checks it)."""
    generator = torch.Generator().manual_seed(num_nodes)
    logits, tokens, parents, draft_probs, params = sampling_case(
        "chain+probs", 5, num_nodes, 29, torch.float32, generator
    )
    params.pop("top_k")
    params.pop("top_p")
    # In even sequences node i's draft is sampled from its parent's target distribution (p / q
    # = 1: accepted); odd ones keep drafts that are rejected somewhere along the chain.
    temperature = params["temperature"]
    scale = torch.where(temperature > 0, temperature, 1.0)[:, None, None]
    target = torch.softmax(logits.float() / scale, dim=-1)
    exact = torch.cat([target[:, :1], target[:, :-1]], dim=1)
    drafted = torch.multinomial(exact.flatten(0, 1), 1, generator=generator).view(tokens.shape)
    even = (torch.arange(len(tokens)) % 2 == 0)[:, None]
    tokens = torch.where(even & (torch.arange(num_nodes) > 0), drafted, tokens)
    draft_probs = torch.where(even[:, :, None], exact, draft_probs)
    expected = verify_reference(logits, tokens, parents, draft_probs, **params)
    sampled = temperature > 0
    assert int(expected.num_accepted[sampled].max()) >= 3
    assert bool((expected.num_accepted[sampled] < (parents >= -1).sum(1)[sampled] - 1).any())
    assert_same(
        run_kernel(logits, tokens, parents, draft_probs, split_config(3), **params), expected
    )
