"""Tree attention: `tree_attention` against SDPA, FlexAttention and flash-attn, one run, one table.

GPU shapes are ANCHORS.md's (Llama-3-8B: 32 query heads, 8 KV heads, head dim 128, bf16) plus a
sweep over N at L=4096 and over L at N=64, all at B=1. Each case verifies a random N-node tree
after a committed prefix of L tokens. The floor reads the prefix's K and V once at the copy
bandwidth measured in the same run. Targets on an H200: B1/L4096/N64 <= 15 us,
B1/L16384/N64 <= 30 us, B8/L4096/N64 <= 55 us, B32/L2048/N32 <= 95 us.

Peers:
- `ours tree`: `tree_attention` with the packed tree mask (Triton on CUDA, the configured
  backend elsewhere); `ours causal`: the same call without a mask (chain verification);
- `sdpa dense mask`: SDPA over the prefix and the tree with a dense bool mask `[B, 1, N, L+N]`;
- `sdpa no mask`: the same attention without a mask (a lower bound for any SDPA tree path);
- `sdpa decode`: SDPA for one new token over L+1 keys, what a plain decode step spends;
- `flex block mask` (CUDA): compiled FlexAttention with a block mask built from the tree;
- `flash_attn causal` (CUDA, when flash-attn is importable): `flash_attn_with_kvcache`, causal
  (it has no tree masks), in its own [B, L, H, D] cache layout.
Mask and block-mask construction are not timed.

Run as `pytest bench/bench_tree_attention.py --benchmark-only` or
`python bench/bench_tree_attention.py` (`--quick`, `--json PATH`). On a CPU it runs the same
code at small sizes.
"""

import importlib.util
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from common import Case, bench_device, main, run_in_pytest

from specdec_fast.kernels import pack_tree_mask, tree_attention
from specdec_fast.tree_mask import ancestor_mask


@dataclass(frozen=True)
class Shape:
    batch: int
    prefix: int
    num_new: int
    num_q_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    dtype: torch.dtype = torch.bfloat16

    @property
    def label(self) -> str:
        return f"B{self.batch}/L{self.prefix}/N{self.num_new}"

    @property
    def prefix_bytes(self) -> int:
        """Bytes of the prefix's K and V: what any attention over it must read at least once."""
        element_size = torch.empty((), dtype=self.dtype).element_size()
        per_token = self.num_kv_heads * self.head_dim * element_size
        return 2 * self.batch * self.prefix * per_token


ANCHOR_SHAPES = [(1, 4096, 64), (1, 16384, 64), (8, 4096, 64), (32, 2048, 32), (1, 4096, 16)]
SWEEP_SHAPES = [(1, 4096, n) for n in (1, 4, 32, 128)] + [
    (1, prefix, 64) for prefix in (1024, 32768)
]


def shapes_for(device: torch.device, quick: bool) -> list[Shape]:
    if device.type == "cuda":
        dims = ANCHOR_SHAPES[:2] if quick else ANCHOR_SHAPES + SWEEP_SHAPES
        return [Shape(*dim) for dim in dims]
    small = dict(num_q_heads=4, num_kv_heads=2, head_dim=32, dtype=torch.float32)
    dims = [(1, 64, 8)] if quick else [(1, 64, 8), (2, 200, 16)]
    return [Shape(*dim, **small) for dim in dims]


def make_inputs(shape: Shape, device: torch.device, seed: int = 0):
    """(q, k_cache, v_cache, cache_lens, tree): a random tree of N nodes after the prefix.

    `tree` is the bool ancestor mask `[B, N, N]`; the caches hold exactly prefix + N slots.
    """
    generator = torch.Generator().manual_seed(seed)
    batch, num_new = shape.batch, shape.num_new
    capacity = shape.prefix + num_new
    q = torch.randn(batch, shape.num_q_heads, num_new, shape.head_dim, generator=generator)
    kv = torch.randn(2, batch, shape.num_kv_heads, capacity, shape.head_dim, generator=generator)
    node = torch.arange(num_new)
    parents = (torch.rand(batch, num_new, generator=generator) * node).long()
    parents[:, 0] = -1
    tree = ancestor_mask(parents)
    cache_lens = torch.full((batch,), shape.prefix, dtype=torch.int32)
    q, kv = q.to(device, shape.dtype), kv.to(device, shape.dtype)
    return q, kv[0], kv[1], cache_lens.to(device), tree.to(device)


def dense_tree_mask(tree: torch.Tensor, prefix: int) -> torch.Tensor:
    """Bool `[B, 1, N, prefix + N]`: the whole prefix, then the tree."""
    batch, num_new, _ = tree.shape
    sees_prefix = torch.ones(batch, num_new, prefix, dtype=torch.bool, device=tree.device)
    return torch.cat([sees_prefix, tree], dim=-1)[:, None]


def flex_attention_call(q, k_cache, v_cache, tree, prefix):
    """Compiled FlexAttention with a block mask: the prefix is dense, the tree is looked up."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def tree_or_prefix(b, h, q_idx, kv_idx):
        in_tree = tree[b, q_idx, (kv_idx - prefix).clamp(min=0)]
        return (kv_idx < prefix) | in_tree

    batch, _, num_new, _ = q.shape
    block_mask = create_block_mask(
        tree_or_prefix, batch, None, num_new, prefix + num_new, device=q.device
    )
    compiled = torch.compile(flex_attention, dynamic=False)
    return lambda: compiled(q, k_cache, v_cache, block_mask=block_mask, enable_gqa=True)


def flash_attn_call(q, k_cache, v_cache, prefix):
    """flash-attn's decode kernel, causal over prefix + N keys, in its [B, L, H, D] layout."""
    from flash_attn import flash_attn_with_kvcache

    q_bshd = q.transpose(1, 2).contiguous()
    k_bshd, v_bshd = (cache.transpose(1, 2).contiguous() for cache in (k_cache, v_cache))
    seqlens = torch.full((q.shape[0],), prefix + q.shape[2], dtype=torch.int32, device=q.device)
    return lambda: flash_attn_with_kvcache(
        q_bshd, k_bshd, v_bshd, cache_seqlens=seqlens, causal=True
    )


def _builder(shape: Shape, device: torch.device, peer: str):
    def build():
        q, k_cache, v_cache, cache_lens, tree = make_inputs(shape, device)
        if peer == "ours tree":
            packed = pack_tree_mask(tree)
            return lambda: tree_attention(q, k_cache, v_cache, cache_lens, packed)
        if peer == "ours causal":
            return lambda: tree_attention(q, k_cache, v_cache, cache_lens)
        if peer == "sdpa dense mask":
            mask = dense_tree_mask(tree, shape.prefix)
            return lambda: F.scaled_dot_product_attention(
                q, k_cache, v_cache, attn_mask=mask, enable_gqa=True
            )
        if peer == "sdpa no mask":
            return lambda: F.scaled_dot_product_attention(q, k_cache, v_cache, enable_gqa=True)
        if peer == "sdpa decode":
            keys, values = k_cache[:, :, : shape.prefix + 1], v_cache[:, :, : shape.prefix + 1]
            last = q[:, :, :1]
            return lambda: F.scaled_dot_product_attention(last, keys, values, enable_gqa=True)
        if peer == "flex block mask":
            return flex_attention_call(q, k_cache, v_cache, tree, shape.prefix)
        return flash_attn_call(q, k_cache, v_cache, shape.prefix)

    return build


def peers_for(device: torch.device) -> list[str]:
    peers = ["ours tree", "ours causal", "sdpa dense mask", "sdpa no mask", "sdpa decode"]
    if device.type == "cuda":
        peers.append("flex block mask")
        if importlib.util.find_spec("flash_attn") is not None:
            peers.append("flash_attn causal")
    return peers


def cases_for(device: torch.device, quick: bool) -> list[Case]:
    return [
        Case(shape.label, peer, _builder(shape, device, peer), shape.prefix_bytes)
        for shape in shapes_for(device, quick)
        for peer in peers_for(device)
    ]


CASES = cases_for(bench_device(), quick=False)


@pytest.mark.parametrize("case", CASES, ids=[f"{case.shape}-{case.peer}" for case in CASES])
def test_tree_attention(benchmark, case):
    run_in_pytest(benchmark, case)


if __name__ == "__main__":
    main(
        "tree_attention", "Tree attention: tree_attention against SDPA and FlexAttention", cases_for
    )
