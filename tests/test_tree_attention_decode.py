"""Tree attention's decode schedule (batch <= 8, N <= 64, more than 128 rows per KV head: all
of a GQA group's rows in one 256-row program, the prefix split over the GPU) under the
interpreter: the launcher picks it where it should, and over a grid of shapes (odd head dims,
ragged batches with empty prefixes and padded rows, trees and causal runs, GQA 2 to 16, fp16,
bf16 and fp32 forced, split or not, poisoned outputs and workspaces) it matches the reference and
the fp64 truth. The wave model's split counts for the target shapes are checked too.
"""

import pytest
import torch
from test_tree_attention_tiles import TiledShape, run_tiled_case

from specdec_fast.kernels.tree_attention import (
    DECODE_ROWS,
    DECODE_TILE_CANDIDATES,
    choose_num_splits,
    decode_tile,
    kernel_config,
)

FP32, FP16, BF16 = torch.float32, torch.float16, torch.bfloat16


def test_decode_schedule_is_picked_for_batch_1_and_8_only():
    """Llama-3-8B verifying 64 nodes (D 128, GQA 4: 256 rows) at B1 and B8 takes one 256-row
    program on 16 warps; B32, an unknown batch, a window or soft-cap, fp32, GQA 7, 65 nodes and
    128 rows or fewer keep the row-block tiles."""
    decode = kernel_config(128, 4, 64, BF16, batch=1)
    tile = decode_tile(128)
    assert tile in DECODE_TILE_CANDIDATES[128]
    assert (decode.block_m, decode.block_n, decode.num_warps) == (DECODE_ROWS, tile.block_n, 16)
    assert decode.programs_per_sm == 1 and decode.max_registers == 128
    assert kernel_config(128, 4, 64, FP16, batch=8) == decode
    assert kernel_config(128, 8, 32, BF16, batch=1).block_m == DECODE_ROWS  # GQA 8, N 32
    assert kernel_config(64, 4, 64, BF16, batch=1).block_n == decode_tile(64).block_n
    for kept in (
        kernel_config(128, 4, 64, BF16, batch=32),
        kernel_config(128, 4, 64, BF16),
        kernel_config(128, 4, 64, BF16, True, batch=1),
        kernel_config(128, 4, 64, FP32, batch=1),
        kernel_config(128, 7, 32, BF16, batch=1),
        kernel_config(128, 4, 65, BF16, batch=1),
        kernel_config(128, 4, 32, BF16, batch=1),
        kernel_config(256, 2, 64, BF16, batch=1),
    ):
        assert kept.block_m <= 128, kept


def test_decode_split_counts_fill_the_gpu():
    """One program per SM on an H200's 132 SMs: B1 (8 KV heads) over 4096 or 16384 keys in
    32-key tiles splits 16 ways (128 programs, one wave); B8 (64 programs) splits 2 ways."""
    assert choose_num_splits(8, 4096, 32, 132) == 16
    assert choose_num_splits(8, 16384, 32, 132) == 16
    assert choose_num_splits(64, 4096, 32, 132) == 2


DECODE_CASES = {
    # name: (dtype, shape, splits); the launcher's own config unless fp32 (which it never gives
    # the decode schedule: the config is forced to exercise the kernel with exact dots).
    "target-bf16": (
        BF16,
        TiledShape(64, 4, 1, ((2, 7), (0, 0), (4, 1)), (0, 14, 63), head_dim_short=8),
        3,
    ),
    "gqa8-causal-fp16": (
        FP16,
        TiledShape(17, 8, 2, ((3, 0), (1, 31)), (0, 5), tree=False, head_dim_short=56),
        1,
    ),
    "d64-fp16": (FP16, TiledShape(33, 4, 1, ((0, 3),), (2,), head_dim_short=24, block_d=64), 2),
    "gqa16-chain-bf16": (
        BF16,
        TiledShape(9, 16, 1, ((1, 1), (0, 0)), (0, 8), tree=False, block_d=64),
        4,
    ),
    "gqa4-fp32": (FP32, TiledShape(40, 4, 1, ((1, 3), (0, 0)), (1, 0), head_dim_short=40), 2),
}


@pytest.mark.parametrize("name", list(DECODE_CASES))
def test_decode_schedule_matches_reference_and_truth(name):
    dtype, shape, splits = DECODE_CASES[name]
    batch = len(shape.prefixes)
    config = None
    if dtype == FP32:
        config = kernel_config(shape.block_d, shape.group, shape.num_new, BF16, batch=batch)
    else:
        picked = kernel_config(shape.block_d, shape.group, shape.num_new, dtype, batch=batch)
        assert picked.block_m == DECODE_ROWS
    run_tiled_case(dtype, False, config, splits, seed=len(name), shape=shape)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("head_dim", sorted(DECODE_TILE_CANDIDATES))
def test_every_decode_candidate_compiles_and_matches_on_cuda(batch, head_dim):
    """Each tile the tuning part may pick, compiled: a 64-node random tree at GQA 4 over ragged
    prefixes up to 4096 (bf16), split as the launcher splits it, against the reference."""
    from test_tree_attention import REFERENCE_TOL, ancestor_mask, random_parents

    from specdec_fast.kernels import pack_tree_mask
    from specdec_fast.kernels.reference.tree_attention import tree_attention_reference
    from specdec_fast.kernels.tree_attention import launch_tree_attention

    generator = torch.Generator(device="cuda").manual_seed(batch)
    draw = dict(device="cuda", generator=generator)
    q = torch.randn(batch, 32, 64, head_dim, **draw).to(BF16)
    k_cache, v_cache = torch.randn(2, batch, 8, 4096 + 64, head_dim, **draw).to(BF16)
    cache_lens = (4096 - torch.arange(batch, device="cuda") * 509).to(torch.int32)
    trees = [ancestor_mask(random_parents(64, "random", torch.Generator())) for _ in range(batch)]
    packed = pack_tree_mask(torch.stack(trees).cuda())
    expected = tree_attention_reference(q, k_cache, v_cache, cache_lens, packed)
    for tile in DECODE_TILE_CANDIDATES[head_dim]:
        config = tile.config(DECODE_ROWS, head_dim)
        out = launch_tree_attention(
            q, k_cache, v_cache, cache_lens, packed, None, head_dim**-0.5, config=config
        )
        torch.testing.assert_close(
            out, expected, rtol=REFERENCE_TOL[BF16][0], atol=REFERENCE_TOL[BF16][1]
        )
