"""Ancestor masks and depths from parent pointers, against a walk up the tree."""

import pytest
import torch

from specdec_fast.tree_mask import ancestor_mask, node_depths


def random_parents(batch: int, num_nodes: int, generator: torch.Generator) -> torch.Tensor:
    """Random topological trees; about a fifth of the non-root nodes are padding (-2)."""
    parents = torch.full((batch, num_nodes), -1, dtype=torch.long)
    for row in range(batch):
        for node in range(1, num_nodes):
            parents[row, node] = int(torch.randint(node, (1,), generator=generator))
        padded = torch.rand(num_nodes, generator=generator) < 0.2
        padded[0] = False
        parents[row, padded] = -2
        # Children of padded nodes hang from the root instead (a real node's ancestors are real).
        orphans = (parents[row] >= 0) & padded[parents[row].clamp(min=0)]
        parents[row, orphans] = 0
    return parents


def walked_ancestors(parents: torch.Tensor) -> torch.Tensor:
    batch, num_nodes = parents.shape
    mask = torch.zeros(batch, num_nodes, num_nodes, dtype=torch.bool)
    for row in range(batch):
        for node in range(num_nodes):
            walk = node
            mask[row, node, walk] = True
            while parents[row, walk] >= 0:
                walk = int(parents[row, walk])
                mask[row, node, walk] = True
    return mask


@pytest.mark.parametrize("num_nodes", [1, 2, 3, 17, 64])
def test_ancestors_and_depths_match_a_walk(num_nodes):
    parents = random_parents(3, num_nodes, torch.Generator().manual_seed(num_nodes))
    expected = walked_ancestors(parents)
    mask = ancestor_mask(parents)
    assert torch.equal(mask, expected)
    assert torch.equal(node_depths(mask), expected.sum(-1) - 1)


def test_a_chain_is_causal_and_padding_is_isolated():
    parents = torch.tensor([[-1, 0, 1, 2, 3], [-1, 0, 1, -2, -2]], dtype=torch.int32)
    mask = ancestor_mask(parents)
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    assert torch.equal(mask[0], causal)
    assert torch.equal(mask[1, 3:], torch.eye(5, dtype=torch.bool)[3:])
    assert not mask[1, :3, 3:].any()  # no real node sees a padded one
    assert node_depths(mask).tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 0, 0]]
