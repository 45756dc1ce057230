"""Tree structure from parent pointers, computed on the device without reading anything back.

A tree of N nodes is given as `parents [B, N]` in topological order (`parents[b, i] < i`): the root
has parent -1 and a padded node (one that does not exist) has parent -2. Both functions are a fixed
number of batched tensor ops for a given N, so they can be captured in a CUDA graph.
"""

import math

import torch

# Enough squarings for trees of up to 2**7 = 128 levels (tree_attention's node limit).
MAX_SQUARINGS = 7


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """Bool `[B, N, N]`: entry `[b, i, j]` says node j is node i itself or one of its ancestors.

    Args:
        parents: integer `[B, N]`; -1 marks the root, -2 a padded node (which then sees only itself
            and is seen by nobody).
    """
    num_nodes = parents.shape[-1]
    node = torch.arange(num_nodes, device=parents.device)
    # One step up the tree plus the node itself; negative parents match no column.
    reach = ((parents[..., :, None] == node) | (node[:, None] == node)).float()
    # Repeated squaring doubles the path length covered: ceil(log2 N) products reach every ancestor.
    # A compiled step squares a fixed number of times, so that one graph serves every N.
    squarings = math.ceil(math.log2(num_nodes)) if num_nodes > 1 else 0
    if torch.compiler.is_compiling():
        squarings = MAX_SQUARINGS
    for _ in range(squarings):
        reach = (reach @ reach).clamp_(max=1.0)
    return reach.bool()


def node_depths(ancestors: torch.Tensor) -> torch.Tensor:
    """int64 `[B, N]`: the depth of each node (root 0), from the mask of `ancestor_mask`."""
    return ancestors.sum(dim=-1) - 1
