"""Tree attention: `tree_attention` against SDPA, FlexAttention and flash-attn, one run, one table.

GPU shapes are ANCHORS.md's (Llama-3-8B: 32 query heads, 8 KV heads, head dim 128, bf16), the
same with one more node (N = 65 and 33: what the engine launches for a 64- or 32-node budget
while budgets leave the root out), a sweep over N at L=4096 and over L at N=64, all at B=1, and
layers that restrict attention:
- `mistral-7b/.../w4096`: Mistral-7B's 4096-token sliding window (Llama's heads) over 16k tokens;
- `gemma3-1b/.../w512`: a local layer of Gemma3-1B (4 query heads, 1 KV head, head dim 256,
  window 512) over 16k tokens, decoding (N=1) and verifying 16 nodes;
- `gemma2-9b/.../cap50`: Gemma2-9B's logit soft-capping at 50 (16 query heads, 8 KV heads,
  head dim 256).
Each case verifies a random N-node tree after a committed prefix of L tokens. The floor reads the
K and V of the prefix that the new tokens see (inside the window, when there is one) once at the
copy bandwidth measured in the same run. Targets on an H200: B1/L4096/N64 <= 15 us,
B1/L16384/N64 <= 30 us, B8/L4096/N64 <= 55 us, B32/L2048/N32 <= 95 us.

Peers:
- `ours tree`: `tree_attention` with the packed tree mask (Triton on CUDA, the configured
  backend elsewhere); `ours causal`: the same call without a mask (chain verification);
- `ours tree, 128-row blocks` (the N + 1 shapes): the Triton launcher forced to 128-row
  blocks, which `row_block` turns down there for 64-row ones;
- `sdpa dense mask`: SDPA over the prefix and the tree with a dense bool mask `[B, 1, N, keys]`;
- `sdpa no mask`: the same attention without a mask (a lower bound for any SDPA tree path);
- `sdpa decode`: SDPA for one new token over the prefix and itself, what a plain decode step
  spends;
- `eager dense mask` (soft-capped shapes): HF's eager attention (what Gemma2 runs), capped
  scores under the dense mask;
- `flex block mask` (CUDA, full runs, on `FLEX_SHAPES` only: each shape costs a compile of
  about a minute): compiled FlexAttention with a block mask built from the tree (and the
  window), soft-capping in a score_mod;
- `flash_attn causal` (CUDA, when flash-attn is importable): `flash_attn_with_kvcache`, causal
  (it has no tree masks), windowed and soft-capped where the shape is, in its own [B, L, H, D]
  cache layout.
With a window, the SDPA and eager peers see only the slots from the first one inside the window
on (what a sliding-window cache holds), the dense mask applying the window within them. SDPA
cannot soft-cap: on soft-capped shapes its rows leave the cap out (lower bounds for a capped
SDPA) and `eager dense mask` is the exact peer. Mask and block-mask construction are not timed.
Inputs are drawn on the device.

Run as `pytest bench/bench_tree_attention.py --benchmark-only` or
`python bench/bench_tree_attention.py` (`--quick`, `--json PATH`). On a CPU it runs the same
code at small sizes.
"""

import dataclasses
import importlib.util
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from common import Case, bench_device, device_generator, main, run_in_pytest

from specdec_fast.kernels import pack_tree_mask, tree_attention
from specdec_fast.kernels.reference.tree_attention import key_visibility
from specdec_fast.kernels.tree_attention import (
    HALF_PRECISION_TILES,
    KernelConfig,
    kernel_config,
    launch_tree_attention,
)
from specdec_fast.tree_mask import ancestor_mask, node_depths


@dataclass(frozen=True)
class Shape:
    batch: int
    prefix: int
    num_new: int
    num_q_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    dtype: torch.dtype = torch.bfloat16
    window: int | None = None
    softcap: float | None = None
    model: str | None = None  # names the heads when they are not Llama-3-8B's
    # Also time 128-row blocks: at N + 1 the launcher takes 64-row blocks (fewer rows of MMA,
    # more K/V reads from L2); the GPU run says which wins.
    compare_rows: bool = False

    @property
    def label(self) -> str:
        parts = [self.model] if self.model else []
        parts.append(f"B{self.batch}/L{self.prefix}/N{self.num_new}")
        if self.window is not None:
            parts.append(f"w{self.window}")
        if self.softcap is not None:
            parts.append(f"cap{self.softcap:g}")
        return "/".join(parts)

    @property
    def first_visible(self) -> int:
        """The lowest cache slot a new token sees: the root, at position L, sees keys above
        L - window."""
        return 0 if self.window is None else max(0, self.prefix - self.window + 1)

    @property
    def prefix_bytes(self) -> int:
        """Bytes of the prefix's K and V that the new tokens see: what any attention over it
        must read at least once."""
        element_size = torch.empty((), dtype=self.dtype).element_size()
        per_token = self.num_kv_heads * self.head_dim * element_size
        return 2 * self.batch * (self.prefix - self.first_visible) * per_token


ANCHOR_SHAPES = [(1, 4096, 64), (1, 16384, 64), (8, 4096, 64), (32, 2048, 32), (1, 4096, 16)]
# The engine's N for the anchors' budgets: the root on top of 64 or 32 nodes.
ENGINE_SHAPES = [(1, 4096, 65), (1, 16384, 65), (8, 4096, 65), (32, 2048, 33)]
QUICK_SHAPES = [ANCHOR_SHAPES[0], ENGINE_SHAPES[0], ANCHOR_SHAPES[1], ANCHOR_SHAPES[2]]
QUICK_SHAPES += [ENGINE_SHAPES[2], ANCHOR_SHAPES[3], ENGINE_SHAPES[3]]
FLEX_SHAPES = ("B1/L4096/N16",)  # where ANCHORS saw it compile
SWEEP_SHAPES = [(1, 4096, n) for n in (1, 4, 32, 128)] + [
    (1, prefix, 64) for prefix in (1024, 32768)
]
GEMMA3_1B_LOCAL = dict(num_q_heads=4, num_kv_heads=1, head_dim=256, window=512, model="gemma3-1b")
FEATURE_SHAPES = [
    Shape(1, 16384, 64, window=4096, model="mistral-7b"),
    Shape(1, 16384, 1, **GEMMA3_1B_LOCAL),
    Shape(1, 16384, 16, **GEMMA3_1B_LOCAL),
    Shape(
        1, 4096, 64, num_q_heads=16, num_kv_heads=8, head_dim=256, softcap=50.0, model="gemma2-9b"
    ),
]


def shapes_for(device: torch.device, quick: bool) -> list[Shape]:
    if device.type == "cuda":
        dims = QUICK_SHAPES if quick else ANCHOR_SHAPES + ENGINE_SHAPES + SWEEP_SHAPES
        # The engine's N + 1 and the decode schedule's anchors run beside the 128-row blocks.
        decode = [dim for dim in ANCHOR_SHAPES if dim[0] <= 8 and dim[2] == 64]
        shapes = [Shape(*dim, compare_rows=dim in ENGINE_SHAPES + decode) for dim in dims]
        return shapes + (FEATURE_SHAPES[:1] if quick else FEATURE_SHAPES)
    small = dict(num_q_heads=4, num_kv_heads=2, head_dim=32, dtype=torch.float32)
    shapes = [
        Shape(1, 64, 9, compare_rows=True, **small),
        Shape(1, 100, 8, window=24, **small),
        Shape(1, 48, 8, softcap=5.0, **small),
    ]
    return shapes if quick else shapes + [Shape(2, 200, 16, **small)]


def make_inputs(shape: Shape, device: torch.device, seed: int = 0):
    """(q, k_cache, v_cache, cache_lens, tree): a random tree of N nodes after the prefix, all
    drawn on `device`.

    `tree` is the bool ancestor mask `[B, N, N]`; the caches hold exactly prefix + N slots.
    """
    draw = dict(generator=device_generator(device, seed), device=device)
    batch, num_new, head_dim = shape.batch, shape.num_new, shape.head_dim
    capacity = shape.prefix + num_new
    q = torch.randn(batch, shape.num_q_heads, num_new, head_dim, dtype=shape.dtype, **draw)
    kv = torch.randn(2, batch, shape.num_kv_heads, capacity, head_dim, dtype=shape.dtype, **draw)
    node = torch.arange(num_new, device=device)
    parents = (torch.rand(batch, num_new, **draw) * node).long()
    parents[:, 0] = -1
    tree = ancestor_mask(parents)
    cache_lens = torch.full((batch,), shape.prefix, dtype=torch.int32, device=device)
    return q, kv[0], kv[1], cache_lens, tree


def dense_tree_mask(tree: torch.Tensor, prefix: int, window: int | None = None) -> torch.Tensor:
    """Bool `[B, 1, N, prefix + N]`: the prefix, then the tree; with a window, only the keys
    whose positions are within it (node i at position prefix + its depth)."""
    batch, num_new, _ = tree.shape
    cache_lens = torch.full((batch,), prefix, dtype=torch.int32, device=tree.device)
    depths = None if window is None else node_depths(tree)
    visible = key_visibility(cache_lens, tree, None, num_new, prefix + num_new, window, depths)
    return visible[:, None]


def eager_attention(q, keys, values, mask, softcap):
    """HF's eager attention: K/V repeated over the GQA group, scores in the input dtype, capped
    (`softcap` c: `c * tanh(s / c)`), masked by bool `mask`, softmax in fp32."""
    group = q.shape[1] // keys.shape[1]
    keys, values = (cache.repeat_interleave(group, dim=1) for cache in (keys, values))
    scores = q @ keys.transpose(-1, -2) * q.shape[-1] ** -0.5
    scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ values


def flex_attention_call(q, k_cache, v_cache, tree, shape: Shape):
    """Compiled FlexAttention with a block mask: the prefix is dense, the tree is looked up, the
    window compares positions; the soft-cap is a score_mod."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    prefix, window, softcap = shape.prefix, shape.window, shape.softcap
    depths = node_depths(tree)

    def visible(b, h, q_idx, kv_idx):
        in_prefix = kv_idx < prefix
        node = (kv_idx - prefix).clamp(min=0)
        sees = in_prefix | tree[b, q_idx, node]
        if window is None:
            return sees
        key_position = torch.where(in_prefix, kv_idx, prefix + depths[b, node])
        return sees & (prefix + depths[b, q_idx] - key_position < window)

    def soft_cap(score, b, h, q_idx, kv_idx):
        return softcap * torch.tanh(score / softcap)

    batch, _, num_new, _ = q.shape
    block_mask = create_block_mask(visible, batch, None, num_new, prefix + num_new, device=q.device)
    compiled = torch.compile(flex_attention, dynamic=False)
    score_mod = None if softcap is None else soft_cap
    return lambda: compiled(
        q, k_cache, v_cache, score_mod=score_mod, block_mask=block_mask, enable_gqa=True
    )


def flash_attn_call(q, k_cache, v_cache, shape: Shape):
    """flash-attn's decode kernel, causal over prefix + N keys, in its [B, L, H, D] layout."""
    from flash_attn import flash_attn_with_kvcache

    q_bshd = q.transpose(1, 2).contiguous()
    k_bshd, v_bshd = (cache.transpose(1, 2).contiguous() for cache in (k_cache, v_cache))
    seqlens = torch.full(
        (q.shape[0],), shape.prefix + q.shape[2], dtype=torch.int32, device=q.device
    )
    # Passed only when used: older flash-attn releases know neither keyword.
    features = {}
    if shape.window is not None:
        features["window_size"] = (shape.window - 1, 0)  # keys in (p - window, p]
    if shape.softcap is not None:
        features["softcap"] = shape.softcap
    return lambda: flash_attn_with_kvcache(
        q_bshd, k_bshd, v_bshd, cache_seqlens=seqlens, causal=True, **features
    )


ROWS_128 = "ours tree, 128-row blocks"


def rows128_config(shape: Shape) -> KernelConfig:
    """`kernel_config`'s tiling with 128-row blocks: what `row_block` turns down at N + 1, and
    what the decode schedule replaces at batch 1 and 8 with N = 64 (its row-block path)."""
    group = shape.num_q_heads // shape.num_kv_heads
    config = kernel_config(shape.head_dim, group, shape.num_new, shape.dtype)
    if shape.dtype == torch.float32:
        return dataclasses.replace(config, block_m=128)
    return HALF_PRECISION_TILES[max(config.block_d, 64), 128][0].config(128, config.block_d)


def _builder(shape: Shape, device: torch.device, peer: str):
    def build():
        q, k_cache, v_cache, cache_lens, tree = make_inputs(shape, device)
        features = dict(window=shape.window, softcap=shape.softcap)
        if peer == "ours tree":
            packed = pack_tree_mask(tree)
            depths = None if shape.window is None else node_depths(tree).to(torch.int32)
            return lambda: tree_attention(
                q, k_cache, v_cache, cache_lens, packed, q_depths=depths, **features
            )
        if peer == ROWS_128:
            config = rows128_config(shape)
            packed = pack_tree_mask(tree)
            scale = shape.head_dim**-0.5
            return lambda: launch_tree_attention(
                q, k_cache, v_cache, cache_lens, packed, None, scale, config=config
            )
        if peer == "ours causal":
            return lambda: tree_attention(q, k_cache, v_cache, cache_lens, **features)
        if peer == "flex block mask":
            return flex_attention_call(q, k_cache, v_cache, tree, shape)
        if peer == "flash_attn causal":
            return flash_attn_call(q, k_cache, v_cache, shape)
        # SDPA and eager read the slots from the first visible one on (all, without a window).
        start = shape.first_visible
        keys, values = k_cache[:, :, start:], v_cache[:, :, start:]
        if peer == "sdpa no mask":
            return lambda: F.scaled_dot_product_attention(q, keys, values, enable_gqa=True)
        if peer == "sdpa decode":
            last = q[:, :, :1]
            keys, values = (
                keys[:, :, : shape.prefix + 1 - start],
                values[:, :, : shape.prefix + 1 - start],
            )
            return lambda: F.scaled_dot_product_attention(last, keys, values, enable_gqa=True)
        mask = dense_tree_mask(tree, shape.prefix, shape.window)[..., start:].contiguous()
        if peer == "eager dense mask":
            return lambda: eager_attention(q, keys, values, mask, shape.softcap)
        return lambda: F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, enable_gqa=True
        )

    return build


def peers_for(shape: Shape, device: torch.device, quick: bool = False) -> list[str]:
    peers = ["ours tree", "ours causal", "sdpa dense mask", "sdpa no mask", "sdpa decode"]
    if shape.compare_rows:
        peers.insert(1, ROWS_128)
    if shape.softcap is not None:
        peers.append("eager dense mask")
    if device.type == "cuda":
        if not quick and shape.label in FLEX_SHAPES:
            peers.append("flex block mask")
        if importlib.util.find_spec("flash_attn") is not None:
            peers.append("flash_attn causal")
    return peers


def cases_for(device: torch.device, quick: bool) -> list[Case]:
    return [
        Case(shape.label, peer, _builder(shape, device, peer), shape.prefix_bytes)
        for shape in shapes_for(device, quick)
        for peer in peers_for(shape, device, quick)
    ]


CASES = cases_for(bench_device(), quick=False)


@pytest.mark.parametrize("case", CASES, ids=[f"{case.shape}-{case.peer}" for case in CASES])
def test_tree_attention(benchmark, case):
    run_in_pytest(benchmark, case)


if __name__ == "__main__":
    main(
        "tree_attention", "Tree attention: tree_attention against SDPA and FlexAttention", cases_for
    )
