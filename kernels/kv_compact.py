"""KV-cache compaction after verification: the accepted path's K/V join the committed prefix.

Public entry point: `kv_compact` (validation, backend choice, launcher). The Triton kernel is in
`jit/kv_compact.py`, the plain-torch reference in `reference/kv_compact.py`.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton

from .backend import backend_for
from .fused.kv_compact import kv_compact_fused
from .jit.kv_compact import kv_compact_kernel
from .ops import define_op
from .reference.kv_compact import kv_compact_reference
from .validation import check_tensor, values_checkable

# The kernel copies raw bits, so any element width with a same-width integer type works.
RAW_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# Elements per program tile (heads x path positions x head dim): 32 per thread at 4 warps.
TILE_ELEMENTS = 4096
# Path positions per chunk: accepted paths rarely exceed 8 nodes, so one chunk usually suffices.
MAX_PATH_CHUNK = 8
NUM_WARPS = 4


def _check_shapes(kv, cache_lens, accepted_nodes, num_accepted) -> None:
    """Shape, dtype and device checks: free, so they always run."""
    check_tensor("kv", kv, shape=(-1, 2, -1, -1, -1, -1), dims="[num_layers, 2, B, Hkv, Lmax, D]")
    if kv.element_size() not in RAW_DTYPES:
        raise ValueError(
            f"kv: expected an element size in {sorted(RAW_DTYPES)} bytes, got {kv.dtype} "
            f"({kv.element_size()} bytes)"
        )
    num_layers, _, batch, num_heads, max_len, head_dim = kv.shape
    if min(num_layers, num_heads, max_len, head_dim) < 1:
        raise ValueError(
            f"kv: num_layers, Hkv, Lmax and D must be >= 1, got shape {tuple(kv.shape)} "
            "= [num_layers, 2, B, Hkv, Lmax, D]"
        )
    for name, tensor, shape, dims in (
        ("cache_lens", cache_lens, (batch,), "[B]"),
        ("accepted_nodes", accepted_nodes, (batch, -1), "[B, N]"),
        ("num_accepted", num_accepted, (batch,), "[B]"),
    ):
        check_tensor(name, tensor, shape=shape, dims=dims, dtypes=(torch.int32,), device=kv.device)
    if accepted_nodes.shape[1] < 1:
        raise ValueError("accepted_nodes: expected N >= 1 nodes (the root at least), got N = 0")
    if batch > 1 and cache_lens.stride(0) == 0:
        raise ValueError("cache_lens: updated in place, so its elements must not alias (stride 0)")


def _check_values(kv, cache_lens, accepted_nodes, num_accepted) -> None:
    """Checks that read the paths and lengths: one host read, more only to word an error."""
    num_nodes = accepted_nodes.shape[1]
    max_len = kv.shape[4]
    lens = cache_lens.long()
    accepted = num_accepted.long()
    nodes = accepted_nodes.long()
    after_root = torch.arange(1, num_nodes, device=kv.device)[None, :] <= accepted[:, None]
    last_node = nodes.gather(1, accepted.clamp(0, num_nodes - 1)[:, None])[:, 0]

    def path(b: int) -> list[int]:
        return accepted_nodes[b, : int(num_accepted[b]) + 1].tolist()

    problems = [
        (
            (accepted < 0) | (accepted >= num_nodes),
            lambda b: (
                f"num_accepted[{b}] = {int(num_accepted[b])} is out of range: expected "
                f"0 <= num_accepted[{b}] <= N - 1 = {num_nodes - 1}"
            ),
        ),
        (lens < 0, lambda b: f"cache_lens[{b}] = {int(cache_lens[b])}: expected >= 0"),
        (
            nodes[:, 0] != 0,
            lambda b: (
                f"accepted_nodes[{b}, 0] = {int(accepted_nodes[b, 0])}: a path starts "
                "at the root, node 0"
            ),
        ),
        (
            (after_root & (nodes[:, 1:] <= nodes[:, :-1])).any(dim=1),
            lambda b: (
                f"accepted_nodes[{b}, :num_accepted[{b}] + 1] = {path(b)}: node indices "
                "along a path must be strictly increasing"
            ),
        ),
        (
            last_node >= num_nodes,
            lambda b: (
                f"accepted_nodes[{b}, :num_accepted[{b}] + 1] = {path(b)}: node indices "
                f"must be < N = {num_nodes}"
            ),
        ),
        (
            lens + accepted + 1 > max_len,
            lambda b: (
                f"cache_lens[{b}] + num_accepted[{b}] + 1 = "
                f"{int(cache_lens[b]) + int(num_accepted[b]) + 1} would overflow Lmax = {max_len}"
            ),
        ),
        (
            lens + last_node >= max_len,
            lambda b: (
                f"accepted_nodes[{b}] = {path(b)}: source slot cache_lens[{b}] + "
                f"{int(last_node[b])} = {int(cache_lens[b]) + int(last_node[b])} is outside the "
                f"cache (Lmax = {max_len})"
            ),
        ),
    ]
    flags = torch.stack([bad for bad, _ in problems]).cpu()
    for (_, describe), bad in zip(problems, flags, strict=True):
        if bool(bad.any()):
            raise ValueError(describe(int(bad.nonzero()[0, 0])))


@dataclass(frozen=True)
class LaunchConfig:
    """Tile sizes and grid of the Triton kernel for one cache shape."""

    block_h: int
    block_t: int
    block_d: int
    rank_shift: int
    programs_per_sequence: int


def launch_config(kv_shape: Sequence[int], num_nodes: int) -> LaunchConfig:
    """Tiles of about TILE_ELEMENTS: the whole head dim, up to MAX_PATH_CHUNK path positions, then
    as many heads as fit.

    The kernel keeps each program's arrival rank above the length bits of cache_lens (see the
    kernel), so `(programs_per_sequence + 1) * 2**rank_shift` must fit int32; when it does not,
    one program takes all heads of a layer's K or V, and failing that the shape is refused.
    """
    num_layers, _, _, num_heads, max_len, head_dim = kv_shape
    block_d = triton.next_power_of_2(head_dim)
    block_t = min(
        triton.next_power_of_2(max(num_nodes - 1, 1)),
        MAX_PATH_CHUNK,
        max(1, TILE_ELEMENTS // block_d),
    )
    rank_shift = max_len.bit_length()
    widest = triton.next_power_of_2(num_heads)
    for block_h in (min(widest, max(1, TILE_ELEMENTS // (block_t * block_d))), widest):
        programs = 2 * num_layers * triton.cdiv(num_heads, block_h)
        if (programs + 1) << rank_shift <= 2**31:
            return LaunchConfig(block_h, block_t, block_d, rank_shift, programs)
    raise ValueError(
        f"kv: {num_layers} layers with Lmax = {max_len} exceed the Triton kernel's length "
        f"bookkeeping: need (2 * num_layers + 1) * 2**{rank_shift} <= 2**31"
    )


def _launch(kv, cache_lens, accepted_nodes, num_accepted) -> None:
    config = launch_config(kv.shape, accepted_nodes.shape[1])
    _, _, batch, num_heads, max_len, head_dim = kv.shape
    kv_raw = kv.view(RAW_DTYPES[kv.element_size()])
    kv_compact_kernel[(config.programs_per_sequence, batch)](
        kv_raw,
        cache_lens,
        accepted_nodes,
        num_accepted,
        num_heads,
        max_len,
        head_dim,
        config.programs_per_sequence,
        *kv_raw.stride(),
        cache_lens.stride(0),
        *accepted_nodes.stride(),
        num_accepted.stride(0),
        RANK_SHIFT=config.rank_shift,
        BLOCK_H=config.block_h,
        BLOCK_T=config.block_t,
        BLOCK_D=config.block_d,
        num_warps=NUM_WARPS,
    )


def kv_compact(
    kv: torch.Tensor,
    cache_lens: torch.Tensor,
    accepted_nodes: torch.Tensor,
    num_accepted: torch.Tensor,
    *,
    validate: bool = True,
) -> None:
    """Compact each sequence's KV cache to its accepted path, for every layer, K and V, in place.

    For each sequence b, slot `cache_lens[b] + t` receives slot
    `cache_lens[b] + accepted_nodes[b, t]` for t in `[0, num_accepted[b]]`; then
    `cache_lens[b] += num_accepted[b] + 1` on the device. On CUDA this is one kernel launch; copies
    whose source is their destination (a chain's accepted prefix, always the root) move nothing.

    Args:
        kv: `[num_layers, 2, B, Hkv, Lmax, D]`, the whole cache (layer l's K is `kv[l, 0]`, its V
            `kv[l, 1]`), any dtype of 1, 2, 4 or 8 bytes (bits are copied verbatim), any strides.
        cache_lens: int32 `[B]` on kv's device, committed tokens per sequence; advanced in place.
            The tree's nodes sit at slots `cache_lens[b] + i`.
        accepted_nodes: int32 `[B, N]`, the accepted path as node indices: the root (0) first, then
            strictly increasing indices < N; entries after position `num_accepted[b]` are ignored
            (`verify` pads them with -1).
        num_accepted: int32 `[B]`, accepted non-root nodes, in `[0, N)`.
        validate: check the values (paths increasing and in range, lengths within Lmax). Reading
            them synchronizes a CUDA device, so callers that validated upstream pass False to stay
            sync-free; the checks are skipped during CUDA graph capture either way. Shape, dtype
            and device checks always run; the Triton kernel never touches slots outside the cache.

    Raises:
        ValueError: on shapes, dtypes or devices that disagree, and (when validating) on paths that
        do not start at the root, do not increase or leave the tree, and on lengths that would
        overflow Lmax.
    """
    _check_shapes(kv, cache_lens, accepted_nodes, num_accepted)
    if validate and values_checkable(cache_lens):
        _check_values(kv, cache_lens, accepted_nodes, num_accepted)
    if torch.compiler.is_compiling():
        torch.ops.specdec_fast.kv_compact(kv, cache_lens, accepted_nodes, num_accepted)
    else:
        run_kv_compact(kv, cache_lens, accepted_nodes, num_accepted)


def _kv_compact_fake(kv, cache_lens, accepted_nodes, num_accepted) -> None:
    return None


@define_op(
    "kv_compact(Tensor(a!) kv, Tensor(b!) cache_lens, Tensor accepted_nodes, "
    "Tensor num_accepted) -> ()",
    _kv_compact_fake,
)
def run_kv_compact(
    kv: torch.Tensor,
    cache_lens: torch.Tensor,
    accepted_nodes: torch.Tensor,
    num_accepted: torch.Tensor,
) -> None:
    """The backend's implementation (see `backend.py`) on arguments `kv_compact` validated: what
    the custom op `specdec_fast::kv_compact` runs, and what the engine calls after `verify`."""
    if kv.shape[2] == 0:
        return
    backend = backend_for(kv.device)
    if backend == "triton":
        _launch(kv, cache_lens, accepted_nodes, num_accepted)
    elif backend == "fused":
        kv_compact_fused(kv, cache_lens, accepted_nodes, num_accepted)
    else:
        kv_compact_reference(kv, cache_lens, accepted_nodes, num_accepted)
