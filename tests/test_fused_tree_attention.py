"""The fused-torch tree attention's per-step mask plan: reused across a step's layers, never
stale when the metadata changes (the correctness of the results is checked against the
reference and the fp64 truth in test_tree_attention.py and test_tree_attention_window.py)."""

import importlib

import pytest
import torch

from specdec_fast.kernels import pack_tree_mask
from specdec_fast.kernels.fused.tree_attention import tree_attention_fused
from specdec_fast.kernels.reference.tree_attention import (
    key_visibility,
    tree_attention_reference,
)
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


@pytest.mark.parametrize("batch", [3, fused_module.PER_ROW_MAX_BATCH + 1])
@pytest.mark.parametrize("num_new", [1, 5])
def test_ragged_batches_row_by_row_and_masked(batch, num_new):
    """A ragged batch up to PER_ROW_MAX_BATCH rows attends row by row over each row's own span;
    a larger one takes one masked call. Both match the reference, with NaN in every slot a row
    does not own (past its tokens) that must not leak into its result."""
    generator = torch.Generator().manual_seed(batch * 10 + num_new)
    capacity = 24
    q = torch.randn(batch, 4, num_new, 16, generator=generator)
    k_cache, v_cache = torch.randn(2, batch, 2, capacity, 16, generator=generator)
    cache_lens = torch.randint(0, capacity - num_new, (batch,), generator=generator)
    cache_lens = cache_lens.to(torch.int32)
    cache_lens[0], cache_lens[1] = 0, capacity - num_new  # an empty prefix, a full cache
    for b, length in enumerate(cache_lens.tolist()):
        k_cache[b, :, length + num_new :] = float("nan")
        v_cache[b, :, length + num_new :] = float("nan")
    parents = torch.full((batch, num_new), -1)
    parents[:, 1:] = torch.arange(num_new - 1)  # chains
    tree_mask = pack_tree_mask(ancestor_mask(parents))
    check(q, k_cache, v_cache, cache_lens, tree_mask)
    plan = fused_module._last_plan[1]
    assert (plan.rows is not None) == (batch <= fused_module.PER_ROW_MAX_BATCH)
    assert [row.span for row in plan.rows or ()] == [
        length + num_new for length in cache_lens.tolist()
    ][: len(plan.rows or ())]
    check(q, k_cache, v_cache, cache_lens, None)  # causal (decode when num_new is 1)


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("num_new", [1, 7, 33])
@pytest.mark.parametrize("lengths", ["shared", "ragged"])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("mask", ["tree", "causal"])
@pytest.mark.parametrize("window", [None, 5])
def test_host_plan_matches_the_reference_visibility(batch, num_new, lengths, padded, mask, window):
    """The plan's visibility, built in numpy (one-length slices or the general arrays), is the
    reference's `key_visibility` over the span it reads, for every row, slot and query; the
    capacity cuts the span of a full row."""
    generator = torch.Generator().manual_seed(batch * 1000 + num_new * 10 + padded)
    capacity = 50
    if lengths == "shared":
        cache_lens = torch.full((batch,), capacity - num_new - 3, dtype=torch.int32)
    else:
        cache_lens = torch.randint(0, capacity - num_new, (batch,), generator=generator)
        cache_lens = cache_lens.to(torch.int32)
        cache_lens[0] = capacity - num_new  # a full row: its span reaches the capacity
    parents = torch.full((batch, num_new), -1)
    for node in range(1, num_new):
        parents[:, node] = torch.randint(0, node, (batch,), generator=generator)
    ancestors = ancestor_mask(parents)
    tree_mask = pack_tree_mask(ancestors) if mask == "tree" else None
    q_lens = None
    if padded:
        q_lens = torch.randint(0, num_new + 1, (batch,), generator=generator).to(torch.int32)
    depths = ancestors.sum(-1).to(torch.int32) - 1 if mask == "tree" else None
    q_depths = depths if window is not None else None
    plan = fused_module._make_plan(
        cache_lens,
        cache_lens.tolist(),
        tree_mask,
        q_lens,
        num_new,
        capacity,
        window,
        q_depths,
    )
    want = key_visibility(cache_lens, tree_mask, q_lens, num_new, capacity, window, q_depths)
    rows = plan.rows or [plan] * batch
    for b, row in enumerate(rows):
        if row.visible is None:  # a decode step at one length: every slot of the span
            got = torch.ones(num_new, row.span, dtype=torch.bool)
        else:
            visible = row.visible[:, 0]
            got = visible[b if visible.shape[0] > 1 else 0]
            if row.empty is not None:  # rows that see nothing are let see everything
                got = got & ~row.empty[b if row.empty.shape[0] > 1 else 0, 0]
        assert torch.equal(got, want[b, :, : row.span]), f"row {b}"
        assert not want[b, :, row.span :].any()
