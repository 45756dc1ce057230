"""Every GPU tiling of tree_attention runs under the interpreter: each distinct `KernelConfig`
that `kernel_config` can pick (per dtype, plain or windowed/soft-capped) is forced on a small
ragged case and checked against the reference and the fp64 truth, with and without splits.

The cases are odd-sized (head dims below the K/V width, N and prefixes off the tile sizes,
padded rows), poison the output and the split workspace with NaN, and every cache slot no row
may read. The row-block rule and the split and combine heuristics are checked on their own.
"""

import itertools
from dataclasses import dataclass

import pytest
import torch
import triton
from test_tree_attention import (
    ancestor_mask,
    check_results,
    make_cache,
    poisoned_allocations,
    random_parents,
)
from test_tree_attention_window import depths_of, position_mask

from specdec_fast.kernels import pack_tree_mask
from specdec_fast.kernels.reference.tree_attention import tree_attention_reference
from specdec_fast.kernels.tree_attention import (
    COMBINE_WAVES,
    HALF_PRECISION_TILES,
    KernelConfig,
    choose_num_splits,
    combine_block_t,
    kernel_config,
    launch_tree_attention,
    row_block,
)

FP32, FP16, BF16 = torch.float32, torch.float16, torch.bfloat16
HEAD_DIMS = (64, 80, 96, 128, 192, 256)
GROUPS = (1, 2, 3, 4, 7, 8)
NUM_NEW = (1, 16, 17, 32, 33, 64, 65, 97, 128)


def every_config() -> dict[tuple, KernelConfig]:
    """(dtype, windowed or capped, K/V width) -> config, for every config kernel_config picks."""
    configs = {}
    for dtype, variant, head_dim, group, num_new in itertools.product(
        (FP16, BF16, FP32), (False, True), HEAD_DIMS, GROUPS, NUM_NEW
    ):
        config = kernel_config(head_dim, group, num_new, dtype, variant)
        configs.setdefault((dtype, variant, config), head_dim)
    return configs


CONFIGS = every_config()


def config_id(key) -> str:
    dtype, variant, config = key
    name = f"{str(dtype)[6:]}-m{config.block_m}n{config.block_n}d{config.block_d}"
    return name + f"w{config.num_warps}s{config.num_stages}" + ("-variant" if variant else "")


@dataclass(frozen=True)
class TiledShape:
    """The shape of `run_tiled_case`: N nodes (a random tree, or causal), the GQA group and KV
    heads, the prefixes of the ragged batch (in K/V tiles plus extra keys; 0 tiles and 0 extra:
    an empty prefix), the padded rows of each sequence (q_lens = N minus those), and how far D
    sits below the K/V width (`block_d`: that width where the launcher picks the config)."""

    num_new: int = 11
    group: int = 3
    num_kv_heads: int = 2
    prefixes: tuple = ((3, 5), (0, 0))
    padded: tuple = (0, 4)
    tree: bool = True
    head_dim_short: int = 16
    block_d: int = 128


def run_tiled_case(dtype, variant, config, num_splits, seed, shape=TiledShape()):
    """A ragged batch (by default 2: a prefix of several tiles and an empty one), N = 11 nodes of
    a random tree (GQA 3, so rows cross block boundaries at 16 and 32), D just below the K/V
    width. `config` None: the launcher's own choice (`kernel_config` for this batch), whose
    tiles size the case."""
    generator = torch.Generator().manual_seed(seed)
    num_new, group, num_kv_heads = shape.num_new, shape.group, shape.num_kv_heads
    batch = len(shape.prefixes)
    tiles = config
    if config is None:
        tiles = kernel_config(shape.block_d, group, num_new, dtype, variant, batch)
    head_dim = tiles.block_d - shape.head_dim_short if tiles.block_d >= 64 else tiles.block_d
    prefixes = [count * tiles.block_n + extra for count, extra in shape.prefixes]
    capacity = max(prefixes) + num_new + 3
    window, softcap = (2 * tiles.block_n + 1, 7.0) if variant else (None, None)
    cache_lens = torch.tensor(prefixes, dtype=torch.int32)
    live = [num_new - padded for padded in shape.padded]
    q_lens = torch.tensor(live, dtype=torch.int32)
    parents = [
        random_parents(num_new, "random" if shape.tree else "chain", generator)
        for _ in range(batch)
    ]
    tree = torch.stack([ancestor_mask(row) for row in parents])
    depths = torch.tensor([depths_of(row) for row in parents], dtype=torch.int32)

    q = torch.randn(batch, num_new, group * num_kv_heads, head_dim, generator=generator)
    q = q.to(dtype).transpose(1, 2)
    k_cache, v_cache = make_cache(
        batch, num_kv_heads, capacity, head_dim, dtype, "layered", generator
    )
    allowed = position_mask(tree, depths, cache_lens, q_lens, capacity, window or capacity + 1)
    for b in range(batch):
        q[b, :, live[b] :] = float("nan")
        never_read = ~allowed[b].any(dim=0)
        k_cache[b, :, never_read] = float("nan")
        v_cache[b, :, never_read] = float("nan")
    packed = pack_tree_mask(tree) if shape.tree else None
    depths = depths if variant and shape.tree else None
    features = dict(softcap=softcap, window=window, q_depths=depths)
    scale = head_dim**-0.5
    with poisoned_allocations():
        out = launch_tree_attention(
            q,
            k_cache,
            v_cache,
            cache_lens,
            packed,
            q_lens,
            scale,
            num_splits,
            config=config,
            **features,
        )
    reference = tree_attention_reference(
        q, k_cache, v_cache, cache_lens, packed, q_lens, **features
    )
    check_results(out, reference, q, k_cache, v_cache, allowed, live, scale, softcap)


@pytest.mark.parametrize("key", list(CONFIGS), ids=[config_id(key) for key in CONFIGS])
def test_every_tiling_matches_reference_and_truth(key):
    dtype, variant, config = key
    index = list(CONFIGS).index(key)
    run_tiled_case(dtype, variant, config, num_splits=(1, 2, 3)[index % 3], seed=index)


def test_every_half_precision_config_is_reachable_and_known():
    """The table has no dead entries, and every config picked is one of its tiles."""
    picked = {
        (c.block_d if c.block_d > 64 else 64, c.block_m) for (d, _, c) in CONFIGS if d != FP32
    }
    assert picked == set(HALF_PRECISION_TILES)
    for dtype, variant, config in CONFIGS:
        if dtype == FP32:
            continue
        plain, windowed = HALF_PRECISION_TILES[max(config.block_d, 64), config.block_m]
        tile = windowed if variant else plain
        assert tile is not None, (variant, config)
        expected = (tile.block_n, tile.num_warps, tile.num_stages, tile.max_registers)
        assert (config.block_n, config.num_warps, config.num_stages, config.max_registers) == (
            expected
        )


@pytest.mark.parametrize(
    ("group", "num_new", "variant", "expected"),
    [
        (4, 1, False, 16),  # decode at GQA 4
        (1, 33, False, 64),
        (4, 32, False, 128),  # B32/N32 at GQA 4: one full block
        (4, 33, False, 64),  # N + 1: 3 x 64 rows, not 2 x 128 with 4 live rows in one
        (4, 64, False, 128),
        (4, 65, False, 64),  # 5 x 64 = 320 rows of MMA, not 3 x 128 = 384
        (8, 64, False, 128),  # GQA 8
        (8, 65, False, 64),  # GQA 8, N + 1: 9 x 64, not 5 x 128 with 8 live rows in one
        (2, 50, False, 128),  # 2 x 128: the last block more than half full
        (4, 64, True, 64),  # windowed / soft-capped variants keep 64 rows
        (4, 97, False, 64),  # trees over 96 nodes: 4 mask words per row
        (7, 64, False, 64),  # GQA 7 (Qwen2.5-7B): 7 x 64 exactly, and 128 rows spill
    ],
)
def test_row_blocks_avoid_mostly_empty_blocks(group, num_new, variant, expected):
    assert row_block(group, num_new, 128, variant) == expected
    rows = group * num_new
    assert triton.cdiv(rows, expected) * expected - rows < 64  # no block is mostly padding


def test_llama3_verify_tiles():
    """Llama-3-8B verifying (D 128, GQA 4): 64 nodes take 128-row blocks of 32 keys, 8 warps
    capped at 128 registers (two programs per SM); the engine's 65 take 64-row blocks."""
    assert kernel_config(128, 4, 64, BF16) == KernelConfig(
        128, 32, 128, num_warps=8, num_stages=3, max_registers=128, programs_per_sm=2
    )
    assert kernel_config(128, 4, 65, BF16) == KernelConfig(
        64, 64, 128, num_warps=4, num_stages=2, max_registers=255, programs_per_sm=2
    )


def test_splits_follow_the_wave_model():
    # Llama-3-8B, B1/L4096/N64: 8 KV heads x 2 row blocks on 132 SMs x 2 programs per SM.
    assert choose_num_splits(16, 4096, 32, 264) == 16
    # The engine's N = 65: 8 x 5 row blocks of 64.
    assert choose_num_splits(40, 4096, 64, 264) == 6
    # B8/L4096/N64: 128 programs fill half the slots.
    assert choose_num_splits(128, 4096, 32, 264) == 2
    # B8/L4096/N65: 320 programs, 1.2 waves unsplit (2 x 66 tiles); 4 splits make 5 waves of
    # 18 tiles plus the combine.
    assert choose_num_splits(320, 4096, 64, 264) == 4
    # B32/L2048/N32: 256 programs fill one wave; B32/N33: 768 are 3 waves either way.
    assert choose_num_splits(256, 2048, 32, 264) == 1
    assert choose_num_splits(768, 2048, 64, 264) == 1


def test_combine_fills_the_gpu():
    # B1, 32 query heads, 64 tokens, D 128 on 132 SMs: blocks of 4 tokens (512 programs).
    block_t = combine_block_t(32, 64, 128, 132)
    assert block_t == 4 and 32 * triton.cdiv(64, block_t) >= COMBINE_WAVES * 132
    assert combine_block_t(32 * 32, 64, 128, 132) == 32  # B32: the widest block already fills
    assert combine_block_t(4, 5, 256, 1) == 8  # the interpreter: one block per head
