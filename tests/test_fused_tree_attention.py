"""The fused-torch tree attention's per-step mask plan: reused across a step's layers, never
stale when the metadata changes (the correctness of the results is checked against the
reference and the fp64 truth in test_tree_attention.py and test_tree_attention_window.py)."""

import importlib

import pytest
import torch

from specdec_fast.kernels import pack_tree_mask
from specdec_fast.kernels.fused.tree_attention import tree_attention_fused
from specdec_fast.kernels.reference.tree_attention import tree_attention_reference
from specdec_fast.tree_mask import ancestor_mask

fused_module = importlib.import_module("specdec_fast.kernels.fused.tree_attention")


def inputs(seed: int, batch=2, num_new=5, capacity=32):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, 4, num_new, 16, generator=generator)
    k_cache, v_cache = torch.randn(2, batch, 2, capacity, 16, generator=generator)
    parents = torch.tensor([[-1, 0, 0, 1, 1], [-1, 0, 1, 2, 2]])[:batch, :num_new]
    tree_mask = pack_tree_mask(ancestor_mask(parents))
    cache_lens = torch.tensor([9, 4], dtype=torch.int32)[:batch]
    return q, k_cache, v_cache, cache_lens, tree_mask


def check(q, k_cache, v_cache, cache_lens, tree_mask, q_lens=None):
    out = tree_attention_fused(q, k_cache, v_cache, cache_lens, tree_mask, q_lens)
    want = tree_attention_reference(q, k_cache, v_cache, cache_lens, tree_mask, q_lens)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_layers_of_a_step_share_one_plan():
    q, k_cache, v_cache, cache_lens, tree_mask = inputs(0)
    check(q, k_cache, v_cache, cache_lens, tree_mask)
    plan = fused_module._last_plan
    check(q * 2, k_cache.flip(0), v_cache, cache_lens, tree_mask)  # another layer, same step
    assert fused_module._last_plan is plan


@pytest.mark.parametrize("change", ["lengths in place", "new tree", "new q_lens", "new lengths"])
def test_a_changed_step_gets_a_new_plan(change):
    q, k_cache, v_cache, cache_lens, tree_mask = inputs(1)
    q_lens = torch.tensor([5, 3], dtype=torch.int32)
    check(q, k_cache, v_cache, cache_lens, tree_mask, q_lens)
    if change == "lengths in place":
        cache_lens += 3  # what kv_compact does between steps
    elif change == "new tree":
        tree_mask = pack_tree_mask(ancestor_mask(torch.tensor([[-1, 0, 1, 2, 3]] * 2)))
    elif change == "new q_lens":
        q_lens = torch.tensor([2, 5], dtype=torch.int32)
    else:
        cache_lens = torch.tensor([1, 11], dtype=torch.int32)
    check(q, k_cache, v_cache, cache_lens, tree_mask, q_lens)


def test_inference_mode_tensors_are_planned_too():
    """Inference tensors (no version counter) are compared by value like any other."""
    with torch.inference_mode():
        q, k_cache, v_cache, cache_lens, tree_mask = inputs(2)
        check(q, k_cache, v_cache, cache_lens, tree_mask)
        cache_lens += 2
        check(q, k_cache, v_cache, cache_lens, tree_mask)
