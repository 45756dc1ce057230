"""Plain-torch reference of `kv_compact`: one gather and one scatter over every layer, K and V.

It never reads values back to the host, so it also runs under CUDA graph capture. It gathers all N
path positions of every sequence (off-path positions copy the root slot onto itself), which costs
`N / (num_accepted + 1)` times the bytes the kernel moves: fine for tests, the CPU backend and small
models.
"""

import torch


def path_slots(
    cache_lens: torch.Tensor, accepted_nodes: torch.Tensor, num_accepted: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Int64 `[B, N]` index tensors (sequence, destination slot, source slot) of every path
    position; positions past `num_accepted[b]` copy the root slot onto itself (a no-op)."""
    batch, num_nodes = accepted_nodes.shape
    device = accepted_nodes.device
    steps = torch.arange(num_nodes, device=device)
    on_path = steps[None, :] <= num_accepted.long()[:, None]
    base = cache_lens.long()[:, None]
    source = base + torch.where(on_path, accepted_nodes.long(), 0)
    target = base + torch.where(on_path, steps[None, :], 0)
    sequence = torch.arange(batch, device=device)[:, None].expand(batch, num_nodes)
    return sequence, target, source


def kv_compact_reference(
    kv: torch.Tensor,
    cache_lens: torch.Tensor,
    accepted_nodes: torch.Tensor,
    num_accepted: torch.Tensor,
) -> None:
    """Move each sequence's accepted path to the slots right after its committed prefix, in place.

    Args:
        kv: `[num_layers, 2, B, Hkv, Lmax, D]`, any dtype; layer l's K is `kv[l, 0]`, V `kv[l, 1]`.
        cache_lens: int32 `[B]`, committed tokens; advanced by `num_accepted + 1` in place.
        accepted_nodes: int32 `[B, N]`, the accepted path as node indices, root (0) first, strictly
            increasing up to position `num_accepted[b]`; later entries are ignored.
        num_accepted: int32 `[B]`, accepted non-root nodes, in `[0, N)`.

    Slot `cache_lens[b] + t` receives slot `cache_lens[b] + accepted_nodes[b, t]` for
    t in `[0, num_accepted[b]]`, for every layer, K and V.
    """
    sequence, target, source = path_slots(cache_lens, accepted_nodes, num_accepted)
    # The gather copies every source before the scatter writes anything, so a destination that is
    # also a later position's source (overlapping paths) is read before it is overwritten.
    kv[:, :, sequence, :, target] = kv[:, :, sequence, :, source]
    cache_lens += num_accepted + 1
