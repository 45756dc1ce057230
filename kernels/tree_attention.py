"""Tree attention: N new tokens (a causal run or a tree) attend to a cached prefix and each other.

Public entry points: `tree_attention` (validation, backend choice) and `pack_tree_mask`.
"""

import math
from dataclasses import dataclass
from functools import cache

import torch
import triton

from . import interpreter_compat  # noqa: F401  (interpreted kernels need it before launch)
from .backend import backend_for, sm_count
from .configs import tuned_configs
from .fused.tree_attention import tree_attention_fused
from .jit.tree_attention import tree_attention_combine_kernel, tree_attention_kernel
from .ops import define_op
from .reference.tree_attention import tree_attention_reference
from .validation import (
    check_ranges,
    check_tensor,
    check_unit_stride,
    is_number,
    values_checkable,
)

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
MAX_TREE_NODES = 128
MAX_SPLITS = 64
# A split must own a few K/V tiles, or its prologue and the combine cost more than it saves.
MIN_TILES_PER_SPLIT = 4
# The split heuristic's costs, in K/V tiles of one program: a program's prologue and epilogue
# (Q and the first tiles loaded, the output written), and the combine launch (its gap and its
# read of the partials).
SPLIT_PROLOGUE_TILES = 2
COMBINE_TILES = 4
SPLIT_GAIN = 0.9
# The combine launch takes small token blocks until its programs fill the GPU this many times over
# (at B1, 32 heads x 64 tokens in blocks of 32 would be 64 programs on 132 SMs).
COMBINE_WAVES = 2
LOG2_E = 1.4426950408889634


def pack_tree_mask(mask_bool: torch.Tensor) -> torch.Tensor:
    """Pack a bool tree mask `[B, N, N]` into int32 `[B, N, ceil(N/32)]`.

    Bit `j % 32` of word `j // 32` of row i is set when new token i sees new token j.
    """
    check_tensor("mask_bool", mask_bool, shape=(-1, -1, -1), dims="[B, N, N]", dtypes=(torch.bool,))
    batch, num_rows, num_nodes = mask_bool.shape
    if num_rows != num_nodes:
        raise ValueError(f"mask_bool: expected shape [B, N, N], got {tuple(mask_bool.shape)}")
    num_words = math.ceil(num_nodes / 32)
    padded = torch.zeros(
        batch, num_rows, num_words * 32, dtype=torch.int64, device=mask_bool.device
    )
    padded[:, :, :num_nodes] = mask_bool
    weights = torch.bitwise_left_shift(
        torch.ones(32, dtype=torch.int64, device=mask_bool.device),
        torch.arange(32, device=mask_bool.device),
    )
    words = (padded.view(batch, num_rows, num_words, 32) * weights).sum(dim=-1)
    # Bit 31 is the int32 sign bit: wrap the unsigned word into int32's range explicitly.
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32)


def _check_softcap_and_window(softcap, window):
    """Check the scalar feature switches of `tree_attention`; return softcap as a float."""
    if softcap is not None:
        if not is_number(softcap) or not math.isfinite(softcap) or softcap <= 0:
            raise ValueError(f"softcap: expected None or a finite float > 0, got {softcap!r}")
        softcap = float(softcap)
    if window is not None and (
        isinstance(window, bool) or not isinstance(window, int) or window < 1
    ):
        raise ValueError(f"window: expected None or an int >= 1, got {window!r}")
    return softcap


def _validate(q, k_cache, v_cache, cache_lens, tree_mask, q_lens, scale, softcap, window, q_depths):
    """Check every argument of `tree_attention`; return the mask packed (or None), the scale and
    the softcap (a float or None)."""
    check_tensor("q", q, shape=(-1, -1, -1, -1), dims="[B, Hq, N, D]", dtypes=SUPPORTED_DTYPES)
    batch, num_q_heads, num_new, head_dim = q.shape
    device = q.device
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"q: head dim D must be in [1, {MAX_HEAD_DIM}], got D = {head_dim}")
    check_tensor(
        "k_cache",
        k_cache,
        shape=(batch, -1, -1, head_dim),
        dims="[B, Hkv, Lmax, D]",
        dtypes=(q.dtype,),
        device=device,
    )
    num_kv_heads, capacity = k_cache.shape[1], k_cache.shape[2]
    check_tensor(
        "v_cache",
        v_cache,
        shape=tuple(k_cache.shape),
        dims="[B, Hkv, Lmax, D] of k_cache",
        dtypes=(q.dtype,),
        device=device,
    )
    if num_kv_heads == 0 or num_q_heads % num_kv_heads != 0:
        raise ValueError(
            f"q / k_cache: Hq must be a multiple of Hkv, got Hq = {num_q_heads}, "
            f"Hkv = {num_kv_heads}"
        )
    for name, tensor in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_unit_stride(name, tensor)
    if num_new > capacity:
        raise ValueError(f"q: N = {num_new} new tokens do not fit a cache of Lmax = {capacity}")
    check_tensor(
        "cache_lens", cache_lens, shape=(batch,), dims="[B]", dtypes=(torch.int32,), device=device
    )
    if q_lens is not None:
        check_tensor(
            "q_lens", q_lens, shape=(batch,), dims="[B]", dtypes=(torch.int32,), device=device
        )
    if tree_mask is not None:
        check_tensor("tree_mask", tree_mask, device=device)
        if num_new > MAX_TREE_NODES:
            raise ValueError(
                f"tree_mask: trees of at most {MAX_TREE_NODES} nodes are supported, "
                f"got N = {num_new}"
            )
        if tree_mask.dtype not in (torch.bool, torch.int32):
            raise ValueError(
                f"tree_mask: expected bool [B, N, N] or packed int32 [B, N, ceil(N/32)], got "
                f"{tree_mask.dtype}"
            )
        if tree_mask.dtype == torch.bool:
            check_tensor(
                "tree_mask",
                tree_mask,
                shape=(batch, num_new, num_new),
                dims="[B, N, N]",
                device=device,
            )
            tree_mask = pack_tree_mask(tree_mask)
        else:
            check_tensor(
                "tree_mask",
                tree_mask,
                shape=(batch, num_new, math.ceil(num_new / 32)),
                dims="[B, N, ceil(N/32)]",
                dtypes=(torch.int32,),
                device=device,
            )
    if q_depths is not None:
        if tree_mask is None:
            raise ValueError(
                "q_depths: only trees take depths (tree_mask given); causal rows sit at depth i"
            )
        check_tensor(
            "q_depths",
            q_depths,
            shape=(batch, num_new),
            dims="[B, N]",
            dtypes=(torch.int32,),
            device=device,
        )
    elif window is not None and tree_mask is not None:
        raise ValueError(
            "q_depths: a sliding window over a tree needs each node's depth, int32 [B, N]"
        )
    if scale is None:
        scale = head_dim**-0.5
    if not is_number(scale) or not math.isfinite(scale):
        raise ValueError(f"scale: expected a finite float, got {scale!r}")
    softcap = _check_softcap_and_window(softcap, window)
    if values_checkable(cache_lens):
        bounds = [("cache_lens", cache_lens, 0, capacity - num_new)]
        if q_lens is not None:
            bounds.append(("q_lens", q_lens, 0, num_new))
        if q_depths is not None:
            bounds.append(("q_depths.flatten()", q_depths.flatten(), 0, num_new - 1))
        check_ranges(bounds)
    return tree_mask, float(scale), softcap


@dataclass(frozen=True)
class Tile:
    """How one row block walks the keys: keys per tile, warps, pipeline stages, and ptxas's
    per-thread register cap (None: ptxas picks one, and may spill to fit more programs per SM).
    `programs_per_sm` is how many such programs an sm_90 SM holds at once, as compiled
    (tests/sm90_compile.py checks every launch against it); the split heuristic fills that many."""

    block_n: int
    num_warps: int
    num_stages: int
    max_registers: int | None = None
    programs_per_sm: int = 2

    def config(self, block_m: int, block_d: int) -> "KernelConfig":
        """The launch of this tile for `block_m` rows of K/V width `block_d`."""
        return KernelConfig(
            block_m,
            self.block_n,
            block_d,
            self.num_warps,
            self.num_stages,
            self.max_registers,
            self.programs_per_sm,
        )


@dataclass(frozen=True)
class KernelConfig:
    block_m: int
    block_n: int
    block_d: int
    num_warps: int
    num_stages: int
    max_registers: int | None = None
    programs_per_sm: int = 1


# fp16/bf16 launch shapes per (K/V width BLOCK_D, row block BLOCK_M): (the plain kernel's tile,
# the windowed or soft-capped one's). Every launch the launcher makes with them over the model
# sweep compiles for sm_90 without spilling (bench/results/sm90_compile_table.md lists each,
# tests/test_sm90_compile.py enforces it), at `programs_per_sm` programs per SM or more:
# - 128 rows: 8 warps capped at 128 registers (two programs per SM: one's softmax overlaps the
#   other's MMA) on 32-key tiles (64 keys at D 64); wider tiles spill under the cap, and so do
#   the variants' per-row state, GQA groups that are not powers of two and trees of more than
#   96 nodes (four mask words per row): those take 64-row blocks.
# - 64 rows and fewer: one warpgroup (4 warps), allowed all 255 registers (left to itself ptxas
#   stopped at 128 and spilled); any count keeps two programs per SM.
# - D 256: 32-key tiles on 4 warps (252-255 registers). The windowed or soft-capped variant
#   (every layer of Gemma2) spills on 4 warps with 16- or 32-key tiles and under a 128-register
#   cap on 8 warps: it runs 8 warps at one program per SM.
HALF_PRECISION_TILES = {
    (64, 16): (Tile(64, 4, 3, 255), Tile(32, 4, 3, 255)),
    (64, 32): (Tile(64, 4, 3, 255), Tile(32, 4, 3, 255)),
    (64, 64): (Tile(64, 4, 3, 255), Tile(32, 4, 3, 255)),
    (64, 128): (Tile(64, 8, 3, 128), None),
    (128, 16): (Tile(64, 4, 3, 255), Tile(64, 4, 3, 255)),
    (128, 32): (Tile(64, 4, 3, 255), Tile(32, 4, 3, 255)),
    (128, 64): (Tile(64, 4, 2, 255), Tile(32, 4, 2, 255)),
    (128, 128): (Tile(32, 8, 3, 128), None),
    (256, 16): (Tile(32, 4, 2, 255), Tile(32, 4, 2, 255)),
    (256, 64): (Tile(32, 4, 2, 255), Tile(32, 8, 2, 255, programs_per_sm=1)),
}
# Trees deeper than this many nodes keep four mask words per row: too many for 128 rows under
# the 128-register cap.
MAX_NODES_FOR_128_ROWS = 96

# The decode schedule (batch <= MAX_DECODE_BATCH, trees and chains of at most MAX_DECODE_NODES,
# no window or soft-cap, fp16/bf16, a power-of-two group, D <= 128): all GROUP * N rows of a KV
# head in one program (up to DECODE_ROWS), so each K/V tile of the prefix is read once per KV
# head, as a split-KV decode kernel reads it, and the prefix is split over the GPU by
# `choose_num_splits`. Four warpgroups of 64 rows (16 warps) under a 128-register cap: one
# program per SM, spill-free on sm_90 (bench/results/sm90_compile_table.md). Without it a
# 64-node tree at GQA 4 (256 rows) took two 128-row blocks, each reading the whole prefix.
# The tiles per K/V width are the tuned ones (`configs.json`, written by the GPU suite's tuning
# part) among DECODE_TILE_CANDIDATES.
MAX_DECODE_BATCH = 8
MAX_DECODE_NODES = 64
DECODE_ROWS = 256
DECODE_TILE_CANDIDATES = {
    64: (Tile(64, 16, 2, 128, programs_per_sm=1), Tile(32, 16, 2, 128, programs_per_sm=1)),
    128: (Tile(32, 16, 2, 128, programs_per_sm=1), Tile(32, 16, 3, 128, programs_per_sm=1)),
}


def decode_tile(block_d: int) -> Tile:
    """The decode schedule's tile for K/V width `block_d` (64 or 128): the tuned candidate."""
    chosen = tuned_configs()["tree_attention_decode_tile"][str(block_d)]
    return DECODE_TILE_CANDIDATES[block_d][chosen]


def uses_decode_schedule(
    batch: int | None, group: int, num_new: int, block_d: int, dtype, windowed_or_capped: bool
) -> bool:
    """Whether `kernel_config` picks the decode schedule (see DECODE_ROWS) for this shape: only
    where it changes the rows of a program (more than 128 rows: fewer already fit one block)."""
    rows = group * num_new
    return (
        batch is not None
        and batch <= min(MAX_DECODE_BATCH, tuned_configs()["tree_attention_decode_max_batch"])
        and num_new <= MAX_DECODE_NODES
        and 128 < rows <= DECODE_ROWS
        and block_d <= 128
        and group & (group - 1) == 0
        and dtype != torch.float32
        and not windowed_or_capped
    )


def row_block(group: int, num_new: int, head_dim_block: int, windowed_or_capped: bool) -> int:
    """Query rows per program for GROUP * N rows per KV head (fp16/bf16).

    Up to 64 rows, the next power of two (16 at least; at D 256, 16 or 64). Beyond, 128-row
    blocks unless the last one would be at most half full: then 64-row blocks, so no block is
    mostly padding. A 65-node tree at GQA 4 (260 rows) takes 5 blocks of 64 (320 rows of MMA)
    rather than 3 of 128 (384) with a third holding 4 live rows. The variants, groups that are
    not powers of two and trees over 96 nodes always take 64 (see HALF_PRECISION_TILES).
    """
    rows = group * num_new
    if head_dim_block > 128:
        return 16 if rows <= 16 else 64
    if rows <= 64:
        return max(16, triton.next_power_of_2(rows))
    half_full_tail = triton.cdiv(rows, 64) % 2 == 1
    odd_group = group & (group - 1) != 0
    if windowed_or_capped or num_new > MAX_NODES_FOR_128_ROWS or half_full_tail or odd_group:
        return 64
    return 128


def kernel_config(
    head_dim: int,
    group: int,
    num_new: int,
    dtype: torch.dtype,
    windowed_or_capped: bool = False,
    batch: int | None = None,
) -> KernelConfig:
    """Tile sizes and launch shape for GROUP * N query rows per KV head (`batch` sequences; None:
    any batch, which never takes the decode schedule).

    fp16/bf16 take the decode schedule where `uses_decode_schedule` says so (DECODE_ROWS rows,
    the tuned `decode_tile`), else `row_block`'s rows and `HALF_PRECISION_TILES`' tile. fp32
    (exact dots on CUDA cores, a correctness path) takes 16-row tiles; from D = 128 on, ptxas
    may use every register rather than spill a few bytes for a second program per SM (no tile
    or warp count avoids it there).
    """
    block_d = max(16, triton.next_power_of_2(head_dim))
    if dtype == torch.float32:
        narrow = block_d <= 64
        block_n = 32 if narrow and not windowed_or_capped else 16
        if narrow:
            return KernelConfig(16, block_n, block_d, num_warps=4, num_stages=2)
        return KernelConfig(16, block_n, block_d, num_warps=8, num_stages=1, max_registers=255)
    if uses_decode_schedule(batch, group, num_new, block_d, dtype, windowed_or_capped):
        return decode_tile(max(block_d, 64)).config(DECODE_ROWS, block_d)
    block_m = row_block(group, num_new, block_d, windowed_or_capped)
    plain, variant = HALF_PRECISION_TILES[max(block_d, 64), block_m]
    return (variant if windowed_or_capped else plain).config(block_m, block_d)


@cache
def choose_num_splits(programs: int, max_prefix: int, block_n: int, slots: int) -> int:
    """How many ways to split the prefix for `programs` (B * Hkv * row blocks) on a GPU of
    `slots` (SMs x programs per SM).

    The count minimizing a wave model: waves (`programs * splits / slots`, rounded up) times the
    tiles of a split plus SPLIT_PROLOGUE_TILES, plus COMBINE_TILES for the combine launch when
    split; ties go to fewer splits, and a split must save 10% (SPLIT_GAIN). Each split keeps at
    least MIN_TILES_PER_SPLIT tiles of the longest possible visible prefix (`max_prefix`, known
    on the host without reading the lengths: the capacity, or the window); shorter prefixes are
    divided on the device. So a batch that fills one wave is not split, and one that spills a
    little past a wave (B8 with a 65-node tree: 320 programs on 264 slots) is split into several
    shorter waves. One slot (the interpreter) never splits.
    """
    tiles = triton.cdiv(max_prefix, block_n)
    most = max(1, min(tiles // MIN_TILES_PER_SPLIT, MAX_SPLITS))

    def cost(splits: int) -> int:
        waves = triton.cdiv(max(programs, 1) * splits, slots)
        combine = COMBINE_TILES if splits > 1 else 0
        return waves * (triton.cdiv(tiles, splits) + SPLIT_PROLOGUE_TILES) + combine

    best = min(range(1, most + 1), key=cost)
    # Splitting writes and reads partials the model does not count: only for a clear gain.
    return best if cost(best) <= SPLIT_GAIN * cost(1) else 1


def combine_block_t(batch_heads: int, num_new: int, block_d: int, slots: int) -> int:
    """Tokens per combine program: as many as fit 4096 partial elements, halved until the
    `batch_heads * cdiv(N, tokens)` programs make COMBINE_WAVES waves of the GPU's `slots`."""
    block_t = max(1, min(triton.next_power_of_2(num_new), 4096 // block_d))
    while block_t > 1 and batch_heads * triton.cdiv(num_new, block_t) < COMBINE_WAVES * slots:
        block_t //= 2
    return block_t


def launch_tree_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_lens: torch.Tensor,
    packed_mask: torch.Tensor | None,
    q_lens: torch.Tensor | None,
    scale: float,
    num_splits: int | None = None,
    *,
    softcap: float | None = None,
    window: int | None = None,
    q_depths: torch.Tensor | None = None,
    config: KernelConfig | None = None,
) -> torch.Tensor:
    """Run the Triton kernels on arguments that `tree_attention` has validated.

    `packed_mask` is the int32 `[B, N, ceil(N/32)]` form or None (causal). `num_splits` overrides
    the split heuristic and `config` the tiles of `kernel_config` (tests run every GPU tiling
    under the interpreter with it). Returns `[B, Hq, N, D]`, dtype of q.

    Split partials are kept in the dtype of q (fp32 for fp32): each is a normalized output, a
    convex combination of V rows, so it fits V's dtype, and half the bytes of fp32 cross memory
    twice (written, then read by the combine). Their log2-sum-exps stay fp32.
    """
    batch, num_q_heads, num_new, head_dim = q.shape
    num_kv_heads, capacity = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    # Positions stay below the capacity, so a window at least that wide hides nothing: such
    # calls run the plain kernel.
    if window is not None and window >= capacity:
        window = None
    tree_depths = q_depths if window is not None and packed_mask is not None else None
    # The kernel indexes the lengths as dense [B] arrays (a no-op for the cache's own tensors).
    cache_lens = cache_lens.contiguous()
    q_lens = None if q_lens is None else q_lens.contiguous()
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if out.numel() == 0:
        return out
    if config is None:
        config = kernel_config(
            head_dim, group, num_new, q.dtype, window is not None or softcap is not None, batch
        )
    row_blocks = triton.cdiv(group * num_new, config.block_m)
    # The interpreter counts as one program slot: it splits only when asked.
    sms = sm_count(q.device)
    slots = 1 if sms is None else sms * config.programs_per_sm
    if num_splits is None:
        num_splits = choose_num_splits(
            batch * num_kv_heads * row_blocks,
            capacity - num_new if window is None else min(capacity - num_new, window),
            config.block_n,
            slots,
        )
    if num_splits > 1:
        part_out = torch.empty(
            (num_splits, batch, num_q_heads, num_new, head_dim), dtype=q.dtype, device=q.device
        )
        part_lse = torch.empty(part_out.shape[:-1], dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out
    mask = cache_lens if packed_mask is None else packed_mask  # unread when causal
    tree_attention_kernel[(row_blocks * num_splits, batch * num_kv_heads)](
        q,
        k_cache,
        v_cache,
        out,
        cache_lens,
        cache_lens if q_lens is None else q_lens,
        mask,
        cache_lens if tree_depths is None else tree_depths,  # unread unless a windowed tree
        part_out,
        part_lse,
        *q.stride()[:3],
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        *out.stride()[:3],
        *(packed_mask.stride() if packed_mask is not None else (0, 0, 0)),
        *(tree_depths.stride() if tree_depths is not None else (0, 0)),
        batch,
        num_kv_heads,
        num_new,
        capacity,
        num_splits,
        scale * LOG2_E,
        (softcap or 1.0) * LOG2_E,
        window or 0,
        HEAD_DIM=head_dim,
        GROUP=group,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_D=config.block_d,
        IS_TREE=packed_mask is not None,
        MASK_WORDS=triton.cdiv(num_new, 32) if packed_mask is not None else 0,
        HAS_Q_LENS=q_lens is not None,
        HAS_SOFTCAP=softcap is not None,
        HAS_WINDOW=window is not None,
        WRITE_PARTIAL=num_splits > 1,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        DOT_UPCAST=q.device.type == "cpu" and q.dtype == torch.bfloat16,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        maxnreg=config.max_registers,
    )
    if num_splits > 1:
        block_t = combine_block_t(batch * num_q_heads, num_new, config.block_d, sms or 1)
        tree_attention_combine_kernel[(batch * num_q_heads, triton.cdiv(num_new, block_t))](
            part_out,
            part_lse,
            out,
            *out.stride()[:3],
            batch * num_q_heads * num_new,
            num_q_heads,
            num_new,
            head_dim,
            num_splits,
            BLOCK_T=block_t,
            BLOCK_D=config.block_d,
        )
    return out


def tree_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_lens: torch.Tensor,
    tree_mask: torch.Tensor | None = None,
    q_lens: torch.Tensor | None = None,
    scale: float | None = None,
    *,
    softcap: float | None = None,
    window: int | None = None,
    q_depths: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of N new tokens per sequence over a KV cache that already holds their K/V.

    Args:
        q: `[B, Hq, N, D]`, fp16/bf16/fp32, unit stride on D, D <= 256.
        k_cache, v_cache: `[B, Hkv, Lmax, D]`, dtype and device of q, any strides with unit stride
            on D, `Hq % Hkv == 0`. New token i's K/V sit in slot `cache_lens[b] + i`.
        cache_lens: int32 `[B]`, any stride, committed tokens before the new ones;
            `cache_lens[b] + N <= Lmax`.
        tree_mask: None for causal among the new tokens (prefill, decode, chain verification), or
            bool `[B, N, N]` / packed int32 `[B, N, ceil(N/32)]` (see `pack_tree_mask`), N <= 128.
            Entry `[b, i, j]` means new token i sees new token j, taken literally: a row without its
            own diagonal does not see itself.
        q_lens: optional int32 `[B]` in [0, N], any stride: rows `i >= q_lens[b]` are padding
            (zeros out) and new tokens `j >= q_lens[b]` are never read as keys.
        scale: softmax scale, `D ** -0.5` by default.
        softcap: None, or c > 0: the scaled scores s become `c * tanh(s / c)` before the mask
            and the softmax (Gemma2's attention logit soft-capping, in HF's eager order).
        window: None, or a sliding window w >= 1 as in HF: a query at position p sees only keys
            at positions k with `p - w < k <= p` (on top of the causal or tree mask). Positions:
            prefix slot k holds position k; new token i sits at `cache_lens[b] + depth_i`, with
            depth_i = i when causal and `q_depths[b, i]` in a tree, for queries and keys alike,
            so the window is exact among tree nodes too. Tiles below a row block's earliest
            visible key are never read (a 512-token window over a 16k prefix reads ~512 keys).
        q_depths: int32 `[B, N]` in [0, N), each node's depth in its tree (the root's is 0);
            required with a window and a tree_mask, accepted with a tree_mask alone (unused
            then), refused without a tree_mask.

    Returns:
        `[B, Hq, N, D]` in the dtype of q (softmax in fp32). Without a window every live row
        sees the whole prefix `[0, cache_lens[b])`; a row that sees no key at all (empty prefix
        and empty mask row) gives zeros.

    Raises:
        ValueError: on shapes, dtypes, devices or strides that disagree, lengths or depths out of
        range, a softcap that is not a finite float > 0, a window that is not an int >= 1, or a
        windowed tree without q_depths. Length and depth values are checked on the CPU, and on
        CUDA outside graph capture at the cost of one host read; under capture they are not, and
        the kernel clamps lengths to stay inside the cache (bad depths move only the window).
    """
    packed_mask, scale, softcap = _validate(
        q, k_cache, v_cache, cache_lens, tree_mask, q_lens, scale, softcap, window, q_depths
    )
    args = (q, k_cache, v_cache, cache_lens, packed_mask, q_lens, scale, softcap, window, q_depths)
    if torch.compiler.is_compiling():
        return torch.ops.specdec_fast.tree_attention(*args)
    return run_tree_attention(*args)


def run_tree_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_lens: torch.Tensor,
    packed_mask: torch.Tensor | None,
    q_lens: torch.Tensor | None,
    scale: float,
    softcap: float | None,
    window: int | None,
    q_depths: torch.Tensor | None,
) -> torch.Tensor:
    """The backend's implementation (see `backend.py`) on arguments `tree_attention` validated:
    `packed_mask` None or int32 `[B, N, ceil(N/32)]`, `scale` a float. What the custom op
    `specdec_fast::tree_attention` runs, and what the engine calls once a step is validated."""
    # Positions stay below the capacity, so a window at least that wide hides nothing.
    if window is not None and window >= k_cache.shape[2]:
        window = None
    features = dict(softcap=softcap, window=window, q_depths=q_depths)
    backend = backend_for(q.device)
    if backend == "triton":
        return launch_tree_attention(
            q, k_cache, v_cache, cache_lens, packed_mask, q_lens, scale, **features
        )
    implementation = tree_attention_fused if backend == "fused" else tree_attention_reference
    return implementation(q, k_cache, v_cache, cache_lens, packed_mask, q_lens, scale, **features)


def _tree_attention_fake(q: torch.Tensor, *args) -> torch.Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@define_op(
    "tree_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cache_lens, "
    "Tensor? tree_mask, Tensor? q_lens, float scale, float? softcap, int? window, "
    "Tensor? q_depths) -> Tensor",
    _tree_attention_fake,
)
def tree_attention_op(
    q, k_cache, v_cache, cache_lens, tree_mask, q_lens, scale, softcap, window, q_depths
) -> torch.Tensor:
    """`specdec_fast::tree_attention`: `run_tree_attention`, contiguous (the fake's layout)."""
    out = run_tree_attention(
        q, k_cache, v_cache, cache_lens, tree_mask, q_lens, scale, softcap, window, q_depths
    )
    return out.contiguous()
