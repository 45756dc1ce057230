"""tree_attention's sliding window and attention logit soft-capping.

The Triton kernel (interpreted on the CPU) and the plain-torch reference are both checked against
an fp64 computation whose mask is built here from positions alone (prefix slot k at position k,
new token i at `cache_lens[b] + depth_i`, depths walked from the parents), over odd sizes, ragged
batches, trees and causal runs, every dtype and split counts. Every case poisons with NaN the
output, the padding rows and every cache slot that no row may read: past each sequence's live
tokens and below its earliest visible position, so a kernel that reads below the window fails.
"""

import itertools
from unittest import mock

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from test_tree_attention import (
    REFERENCE_TOL,
    ancestor_mask,
    check_results,
    make_cache,
    poisoned_allocations,
    random_parents,
    valid_args,
)

import specdec_fast.kernels.jit.tree_attention as jit
from specdec_fast.kernels import pack_tree_mask, tree_attention
from specdec_fast.kernels.jit.tree_attention import _tanh
from specdec_fast.kernels.reference.tree_attention import tree_attention_reference
from specdec_fast.kernels.tree_attention import kernel_config, launch_tree_attention

FP32, FP16, BF16 = torch.float32, torch.float16, torch.bfloat16
DTYPES = (FP32, FP16, BF16)
PREFIXES = (300, 0, 45)  # a ragged batch: a prefix of several tiles, an empty one, a short one
LAYOUTS = ("contiguous", "bshd", "layered")
SHAPES = ("causal", "random", "deep", "chain", "star")
HUGE_WINDOW = 100_000  # wider than any cache here: hides nothing


def depths_of(parents: list[int]) -> list[int]:
    depths = [0]
    for parent in parents[1:]:
        depths.append(depths[parent] + 1)
    return depths


def position_mask(tree, depths, cache_lens, q_lens, capacity, window):
    """Bool `[B, N, Lmax]` from positions: row i of sequence b (live rows only) sees prefix slot
    k when `p_i - k < window`, and new token j when the tree allows it and `p_i - p_j < window`,
    with `p_i = cache_lens[b] + depths[b, i]`."""
    batch, num_new = depths.shape
    allowed = torch.zeros(batch, num_new, capacity, dtype=torch.bool)
    for b in range(batch):
        prefix, live = int(cache_lens[b]), int(q_lens[b])
        key_position = torch.cat([torch.arange(prefix), prefix + depths[b, :live]])
        for i in range(live):
            sees = torch.cat([torch.ones(prefix, dtype=torch.bool), tree[b, i, :live]])
            in_window = prefix + depths[b, i] - key_position < window
            allowed[b, i, : prefix + live] = sees & in_window
    return allowed


def run_window_case(
    *,
    num_new,
    window,
    softcap,
    dtype,
    shape,
    padded,
    layout,
    num_splits,
    group,
    seed,
    backend="triton",
):
    """Build inputs, run the kernel and the reference; check both against the fp64 truth.
    `num_splits` forces the Triton kernel's split count (other backends have none)."""
    generator = torch.Generator().manual_seed(seed)
    batch, num_kv_heads, head_dim = len(PREFIXES), 2, 32 if seed % 2 else 80
    capacity = max(PREFIXES) + num_new + 5
    cache_lens = torch.tensor(PREFIXES, dtype=torch.int32)
    live = [max(1, num_new - 3 * b) if padded else num_new for b in range(batch)]
    q_lens = torch.tensor(live, dtype=torch.int32)
    if shape == "causal":
        parents = [list(range(-1, num_new - 1))] * batch
    else:
        parents = [random_parents(num_new, shape, generator) for _ in range(batch)]
    tree = torch.stack([ancestor_mask(row) for row in parents])
    depths = torch.tensor([depths_of(row) for row in parents], dtype=torch.int32)
    tree_mask = None if shape == "causal" else pack_tree_mask(tree)
    q_depths = None if shape == "causal" else depths

    q = torch.randn(batch, num_new, group * num_kv_heads, head_dim, generator=generator)
    q = q.to(dtype).transpose(1, 2)
    k_cache, v_cache = make_cache(batch, num_kv_heads, capacity, head_dim, dtype, layout, generator)
    allowed = position_mask(tree, depths, cache_lens, q_lens, capacity, window)
    for b in range(batch):
        q[b, :, live[b] :] = float("nan")
        never_read = ~allowed[b].any(dim=0)
        k_cache[b, :, never_read] = float("nan")
        v_cache[b, :, never_read] = float("nan")

    features = dict(softcap=softcap, window=window, q_depths=q_depths)
    scale = head_dim**-0.5
    with poisoned_allocations():
        if num_splits is None or backend != "triton":
            out = tree_attention(
                q, k_cache, v_cache, cache_lens, tree_mask, q_lens if padded else None, **features
            )
        else:
            out = launch_tree_attention(
                q, k_cache, v_cache, cache_lens, tree_mask, q_lens, scale, num_splits, **features
            )
    reference = tree_attention_reference(
        q, k_cache, v_cache, cache_lens, tree_mask, q_lens, **features
    )
    check_results(out, reference, q, k_cache, v_cache, allowed, live, scale, softcap)


def window_cases():
    """N x window x softcap; dtype, tree shape, padding, layout, splits and GQA group rotate
    through the grid so that each value meets every other axis's values."""
    windows = (1, 3, 16, 200, HUGE_WINDOW)
    softcaps = (None, 5.0, 50.0)
    cases = []
    for (i_n, num_new), (i_w, window), (i_s, softcap) in itertools.product(
        enumerate((1, 5, 17)), enumerate(windows), enumerate(softcaps)
    ):
        index = len(cases)
        shape = "causal" if num_new == 1 else SHAPES[(i_w + 2 * i_s + i_n) % len(SHAPES)]
        case = dict(
            num_new=num_new,
            window=window,
            softcap=softcap,
            dtype=DTYPES[(i_n + i_w + i_s) % 3],
            shape=shape,
            padded=(i_w + i_s) % 2 == 0,
            layout=LAYOUTS[(i_n + 2 * i_w + i_s) % 3],
            num_splits=(None, 2, 3)[(2 * i_n + i_w + 2 * i_s) % 3],
            group=(1, 2, 3)[(i_w + i_s + 2 * i_n) % 3],
            seed=index,
        )
        name = f"n{num_new}-w{window}-cap{softcap}-{shape}-{str(case['dtype'])[6:]}"
        cases.append(pytest.param(case, id=name))
    return cases


@pytest.mark.parametrize("case", window_cases())
def test_window_and_softcap_match_reference_and_truth(kernel_backend, case):
    run_window_case(**case, backend=kernel_backend)


def test_reads_stay_inside_the_window():
    """Count the K/V tiles each program attends to: with a 40-token window over a 2000-token
    prefix only the tiles around the window are visited, and the splits share those."""
    num_new, window, prefix, num_splits = 5, 40, 2000, 3
    generator = torch.Generator().manual_seed(5)
    q = torch.randn(1, 2, num_new, 32, generator=generator)
    k_cache, v_cache = torch.randn(2, 1, 1, prefix + num_new, 32, generator=generator)
    cache_lens = torch.tensor([prefix], dtype=torch.int32)
    parents = [-1, 0, 1, 1, 3]
    tree_mask = pack_tree_mask(ancestor_mask(parents)[None])
    q_depths = torch.tensor([depths_of(parents)], dtype=torch.int32)
    k_cache[..., : prefix - window, :] = float("nan")
    v_cache[..., : prefix - window, :] = float("nan")

    def tiles_per_split(window, k_cache, v_cache):
        splits = []
        attend_tile = jit._attend_tile

        def counting_attend_tile(*args):
            splits.append(int(tl.program_id(0)))  # one row block: the program is the split
            return attend_tile(*args)

        with mock.patch.object(jit, "_attend_tile", counting_attend_tile):
            out = launch_tree_attention(
                q,
                k_cache,
                v_cache,
                cache_lens,
                tree_mask,
                None,
                32**-0.5,
                num_splits,
                window=window,
                q_depths=q_depths,
            )
        return [splits.count(split) for split in range(num_splits)], out

    counts, out = tiles_per_split(window, k_cache, v_cache)
    block_n = kernel_config(32, 2, num_new, FP32, windowed_or_capped=True).block_n
    visible_tiles = triton.cdiv(window + num_new, block_n) + 1
    assert sum(counts) <= visible_tiles, counts
    assert min(counts) >= 1, f"the splits must share the visible tiles: {counts}"
    expected = tree_attention_reference(
        q, k_cache, v_cache, cache_lens, tree_mask, window=window, q_depths=q_depths
    )
    assert not out.isnan().any()
    rtol, atol = REFERENCE_TOL[FP32]
    torch.testing.assert_close(out, expected, rtol=rtol, atol=atol)
    # The count can fail: without the window every tile of the prefix is visited.
    unwindowed_counts, _ = tiles_per_split(None, k_cache.nan_to_num(), v_cache.nan_to_num())
    assert sum(unwindowed_counts) >= prefix // kernel_config(32, 2, num_new, FP32).block_n


@pytest.mark.parametrize("backend", ["torch", "triton", "fused"])
def test_defaults_and_harmless_windows_change_nothing(monkeypatch, backend):
    """softcap/window None are today's call; a window as wide as the cache hides no key, and
    the kernel then runs its plain variant: the same bits."""
    monkeypatch.setenv("SPECDEC_BACKEND", backend)
    args = valid_args()
    tree = torch.ones(2, 3, 3, dtype=torch.bool).tril()
    depths = torch.tensor([[0, 1, 2]] * 2, dtype=torch.int32)
    for tree_mask, q_depths in ((None, None), (tree, depths)):
        plain = tree_attention(**args, tree_mask=tree_mask)
        for extra in (
            dict(softcap=None, window=None),
            dict(window=args["k_cache"].shape[2], q_depths=q_depths),
        ):
            out = tree_attention(**args, tree_mask=tree_mask, **extra)
            assert torch.equal(out, plain), extra


def test_window_one_sees_only_itself(kernel_backend):
    """With window 1 every row attends to its own key alone: the output is its own value."""
    generator = torch.Generator().manual_seed(4)
    q = torch.randn(2, 2, 5, 16, generator=generator)
    k_cache, v_cache = torch.randn(2, 2, 1, 20, 16, generator=generator)
    cache_lens = torch.tensor([9, 0], dtype=torch.int32)
    out = tree_attention(q, k_cache, v_cache, cache_lens, window=1, softcap=2.0)
    for b, prefix in enumerate(cache_lens.tolist()):
        own = v_cache[b, 0, prefix : prefix + 5]
        torch.testing.assert_close(out[b], own.expand(2, -1, -1), rtol=1e-6, atol=1e-6)


@triton.jit
def tanh_kernel(x_ptr, out_ptr, size, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offsets, mask=offsets < size)
    tl.store(out_ptr + offsets, _tanh(x), mask=offsets < size)


def test_kernel_tanh_is_accurate_to_a_few_ulp(device):
    """The kernel's own tanh against fp64, near 0 (where the series serves), across the switch
    to the exp form and far out (saturation, no overflow). Interpreted: 4 ulp of fp32 (3 seen).
    Compiled, exp2 is ex2.approx (~2 ulp) and fp32 division approximate: 8 ulp allowed."""
    tiny = torch.logspace(-12, 0, 2000, dtype=torch.float64)
    x = torch.cat([tiny, -tiny, torch.linspace(-30, 30, 6001, dtype=torch.float64)])
    x = torch.cat([x, torch.tensor([0.0, 0.4, -0.4, 1e30, -1e30], dtype=torch.float64)]).float()
    x = x.to(device)
    out = torch.empty_like(x)
    tanh_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCK=1024)
    truth = torch.tanh(x.double()).cpu()
    ulp = torch.from_numpy(np.spacing(truth.abs().float().numpy())).double()
    allowed_ulp = 8 if device.type == "cuda" else 4
    assert ((out.cpu().double() - truth).abs() <= allowed_ulp * ulp).all()


def test_softcap_bounds_the_scores(triton_backend):
    """A tiny cap makes every key nearly equally likely: the output tends to the mean value."""
    generator = torch.Generator().manual_seed(6)
    q = 30 * torch.randn(1, 1, 1, 16, generator=generator)
    k_cache, v_cache = torch.randn(2, 1, 1, 40, 16, generator=generator)
    cache_lens = torch.tensor([39], dtype=torch.int32)
    capped = tree_attention(q, k_cache, v_cache, cache_lens, softcap=1e-3)
    uncapped = tree_attention(q, k_cache, v_cache, cache_lens)
    mean_value = v_cache[0, 0].mean(dim=0)
    torch.testing.assert_close(capped[0, 0, 0], mean_value, rtol=1e-3, atol=1e-3)
    assert (uncapped[0, 0, 0] - mean_value).abs().max() > 0.1


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("prefix", "num_new", "shape", "window", "softcap", "dtype"),
    [
        (16384, 1, "causal", 512, None, BF16),  # Gemma3-1B's local layers, decoding at 16k
        (4096, 64, "random", 4096 - 64, 50.0, BF16),  # Gemma2's local layers verifying a tree
        (8000, 17, "deep", 3, 30.0, FP16),
        (0, 700, "causal", 256, None, BF16),  # a prefill longer than the window
        (3000, 32, "chain", 100, 5.0, FP32),
    ],
)
def test_compiled_windowed_kernel_matches_reference(prefix, num_new, shape, window, softcap, dtype):
    generator = torch.Generator().manual_seed(0)
    batch, head_dim = 2, 256 if dtype == BF16 else 128
    q = torch.randn(batch, 8, num_new, head_dim, generator=generator).to("cuda", dtype)
    k_cache, v_cache = torch.randn(2, batch, 2, prefix + num_new + 7, head_dim).to("cuda", dtype)
    cache_lens = torch.tensor([prefix, prefix // 3], dtype=torch.int32, device="cuda")
    tree_mask = q_depths = None
    if shape != "causal":
        parents = [random_parents(num_new, shape, generator) for _ in range(batch)]
        tree_mask = pack_tree_mask(torch.stack([ancestor_mask(row) for row in parents]).cuda())
        q_depths = torch.tensor([depths_of(row) for row in parents], dtype=torch.int32).cuda()
    features = dict(window=window, softcap=softcap, q_depths=q_depths)
    out = tree_attention(q, k_cache, v_cache, cache_lens, tree_mask, **features)
    expected = tree_attention_reference(q, k_cache, v_cache, cache_lens, tree_mask, **features)
    rtol, atol = REFERENCE_TOL[dtype]
    torch.testing.assert_close(out, expected, rtol=rtol, atol=atol)
