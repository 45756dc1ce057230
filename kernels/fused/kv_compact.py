"""Fused-torch `kv_compact` for CPU tensors: move only the path positions that change place.

The reference gathers all N positions of every sequence; here the positions whose source slot is
their destination (the root, a chain's accepted prefix: all of plain decoding) are skipped before
anything is copied, so a step that accepted a chain moves no K/V at all, and one that took a
side branch moves just those tokens, every layer, K and V, in one gather and one scatter.
"""

import torch


def kv_compact_fused(
    kv: torch.Tensor,
    cache_lens: torch.Tensor,
    accepted_nodes: torch.Tensor,
    num_accepted: torch.Tensor,
) -> None:
    """`kv_compact` (same arguments and effect) on validated arguments."""
    num_nodes = accepted_nodes.shape[1]
    if num_nodes == 1:  # plain decoding: the root is already in place
        cache_lens += num_accepted + 1
        return
    steps = torch.arange(num_nodes, device=accepted_nodes.device)
    on_path = steps[None, :] <= num_accepted.long()[:, None]
    moves = on_path & (accepted_nodes.long() != steps[None, :])
    if bool(moves.any()):
        sequence, step = moves.nonzero(as_tuple=True)
        base = cache_lens.long()[sequence]
        source = base + accepted_nodes[sequence, step].long()
        # Advanced indexing gathers every source before the scatter writes any destination.
        kv[:, :, sequence, :, base + step] = kv[:, :, sequence, :, source]
    cache_lens += num_accepted + 1
