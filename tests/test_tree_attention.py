"""tree_attention: the Triton kernel (interpreted on the CPU) against the plain-torch reference and
against an independent dense-mask computation, over trees, causal runs, ragged batches, GQA groups,
head dims, dtypes, split counts and cache layouts; plus every validation error.

Every case poisons with NaN what must not be read (cache slots past each sequence's live tokens,
padding query rows) and what must be written (the output and the split workspace).
"""

import contextlib
from unittest import mock

import pytest
import torch

from specdec_fast.kernels import pack_tree_mask, tree_attention
from specdec_fast.kernels.fused.tree_attention import tree_attention_fused
from specdec_fast.kernels.reference.tree_attention import (
    tree_attention_reference,
    unpack_tree_mask,
)
from specdec_fast.kernels.tree_attention import (
    MAX_SPLITS,
    MAX_TREE_NODES,
    choose_num_splits,
    kernel_config,
    launch_tree_attention,
)

FP32, FP16, BF16 = torch.float32, torch.float16, torch.bfloat16
# Kernel vs reference: both softmax in fp32; the kernel also rounds P to the input dtype before
# P @ V (as tensor cores do), so they differ by a few units of the input dtype's precision.
REFERENCE_TOL = {FP32: (1e-5, 1e-5), FP16: (2e-3, 2e-3), BF16: (1.6e-2, 1.6e-2)}
# Flash-attention rule: |kernel - fp64 truth| <= 2 |plain torch in the dtype - truth| + ATOL.
ATOL = {FP32: 1e-6, FP16: 1e-3, BF16: 8e-3}


@contextlib.contextmanager
def poisoned_allocations():
    """torch.empty / empty_like return NaN (floats) or -77 (ints): unwritten elements show up."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poison(tensor):
        return tensor.fill_(float("nan") if tensor.is_floating_point() else -77)

    with (
        mock.patch.object(torch, "empty", lambda *a, **k: poison(real_empty(*a, **k))),
        mock.patch.object(torch, "empty_like", lambda *a, **k: poison(real_empty_like(*a, **k))),
    ):
        yield


def random_parents(num_nodes: int, shape: str, generator: torch.Generator) -> list[int]:
    """Parents of a tree in topological order: chain, star, deep, wide or uniformly random."""
    parents = [-1]
    for node in range(1, num_nodes):
        if shape == "chain":
            parent = node - 1
        elif shape == "star":
            parent = 0
        elif shape == "deep":  # mostly a long spine with short side branches
            parent = max(0, node - 1 - int(torch.randint(0, 3, (1,), generator=generator)))
        elif shape == "wide":  # all nodes hang off the first few
            parent = int(torch.randint(0, min(node, 4), (1,), generator=generator))
        else:
            parent = int(torch.randint(0, node, (1,), generator=generator))
        parents.append(parent)
    return parents


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    """Bool [N, N]: node i sees j when j is i or an ancestor of i."""
    mask = torch.zeros(len(parents), len(parents), dtype=torch.bool)
    for node, parent in enumerate(parents):
        if parent >= 0:
            mask[node] = mask[parent]
        mask[node, node] = True
    return mask


def make_cache(batch, num_kv_heads, capacity, head_dim, dtype, layout, generator):
    """K and V caches `[B, Hkv, Lmax, D]` in one of several memory layouts (unit stride on D)."""
    if layout == "contiguous":
        shape = (2, batch, num_kv_heads, capacity, head_dim)
        kv = torch.randn(shape, generator=generator).to(dtype)
        return kv[0], kv[1]
    if layout == "bshd":  # HF-style [B, Lmax, Hkv, D] storage, seen through a transpose
        kv = torch.randn(2, batch, capacity, num_kv_heads, head_dim, generator=generator).to(dtype)
        return kv[0].transpose(1, 2), kv[1].transpose(1, 2)
    # "layered": one layer of the engine's [layers, 2, B, Hkv, Lmax, D] cache tensor
    kv = torch.randn(3, 2, batch, num_kv_heads, capacity, head_dim, generator=generator).to(dtype)
    return kv[1, 0], kv[1, 1]


def dense_attention(q, k_cache, v_cache, allowed, scale, compute_dtype, softcap=None):
    """Independent computation: explicit math over a dense `[B, N, Lmax]` mask in `compute_dtype`.

    Low-precision dtypes mimic plain torch (matmuls in the dtype, softmax in fp32 then rounded);
    fp64 stays fp64 throughout. `softcap` c maps scaled scores s to `c * tanh(s / c)`.
    """
    group = q.shape[1] // k_cache.shape[1]
    slot_read = allowed.any(dim=1)[:, None, :, None]
    keys = torch.where(slot_read, k_cache, 0).to(compute_dtype).repeat_interleave(group, dim=1)
    values = torch.where(slot_read, v_cache, 0).to(compute_dtype).repeat_interleave(group, dim=1)
    softmax_dtype = torch.promote_types(compute_dtype, torch.float32)
    scores = (q.to(compute_dtype) @ keys.transpose(-1, -2)).to(softmax_dtype) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0).to(compute_dtype)
    return probs @ values


def dense_mask(tree, cache_lens, q_lens, num_new, capacity):
    """Bool `[B, N, Lmax]` built slice by slice (independently of the reference's gather)."""
    allowed = torch.zeros(len(cache_lens), num_new, capacity, dtype=torch.bool)
    for b, (prefix, live) in enumerate(zip(cache_lens.tolist(), q_lens.tolist(), strict=True)):
        allowed[b, :live, :prefix] = True
        allowed[b, :live, prefix : prefix + live] = tree[b, :live, :live]
    return allowed


def run_case(
    *,
    num_new,
    head_dim,
    group,
    num_kv_heads,
    prefixes,
    dtype,
    mask_kind,
    padded,
    layout="contiguous",
    num_splits=None,
    packed=True,
    seed=0,
):
    """Build inputs, run the Triton kernel and check it against the reference and the truth."""
    generator = torch.Generator().manual_seed(seed)
    batch = len(prefixes)
    capacity = max(prefixes) + num_new + 5
    num_q_heads = group * num_kv_heads
    cache_lens = torch.tensor(prefixes, dtype=torch.int32)
    live = [max(1, num_new - 2 * b) if padded else num_new for b in range(batch)]
    q_lens = torch.tensor(live, dtype=torch.int32)

    q = torch.randn(batch, num_new, num_q_heads, head_dim, generator=generator).to(dtype)
    q = q.transpose(1, 2)  # [B, Hq, N, D] with HF's strides
    k_cache, v_cache = make_cache(batch, num_kv_heads, capacity, head_dim, dtype, layout, generator)
    for b in range(batch):
        q[b, :, live[b] :] = float("nan")
        k_cache[b, :, prefixes[b] + live[b] :] = float("nan")
        v_cache[b, :, prefixes[b] + live[b] :] = float("nan")

    if mask_kind == "causal":
        tree = torch.ones(num_new, num_new, dtype=torch.bool).tril().expand(batch, -1, -1)
        tree_mask = None
    else:
        masks = [ancestor_mask(random_parents(num_new, mask_kind, generator)) for _ in range(batch)]
        tree = torch.stack(masks)
        tree_mask = pack_tree_mask(tree) if packed else tree
    scale = head_dim**-0.5

    with poisoned_allocations():
        if num_splits is None:
            out = tree_attention(
                q, k_cache, v_cache, cache_lens, tree_mask, q_lens if padded else None
            )
        else:
            packed_mask = None if tree_mask is None else pack_tree_mask(tree)
            out = launch_tree_attention(
                q, k_cache, v_cache, cache_lens, packed_mask, q_lens, scale, num_splits
            )
    reference = tree_attention_reference(q, k_cache, v_cache, cache_lens, tree_mask, q_lens)
    allowed = dense_mask(tree, cache_lens, q_lens, num_new, capacity)
    check_results(out, reference, q, k_cache, v_cache, allowed, live, scale)
    return out


def check_results(out, reference, q, k_cache, v_cache, allowed, live, scale, softcap=None):
    """Kernel output `out` and `reference` for `q`: shape and dtype, no NaN, zero padding rows
    (rows `i >= live[b]`), close to each other, and both within the flash-attention rule of the
    fp64 truth over the dense mask `allowed`: at most twice plain torch's error, plus ATOL."""
    dtype = q.dtype
    assert out.shape == q.shape and out.dtype == dtype
    assert not out.isnan().any()
    for b, rows in enumerate(live):
        assert (out[b, :, rows:] == 0).all(), "padding rows must be zeros"
    rtol, atol = REFERENCE_TOL[dtype]
    torch.testing.assert_close(out, reference, rtol=rtol, atol=atol)

    truth = dense_attention(q, k_cache, v_cache, allowed, scale, torch.float64, softcap)
    plain = dense_attention(q, k_cache, v_cache, allowed, scale, dtype, softcap)
    plain_error = (plain.double() - truth).abs().max().item()
    for name, result in (("kernel", out), ("reference", reference)):
        error = (result.double() - truth).abs().max().item()
        assert error <= 2 * plain_error + ATOL[dtype], (name, error, plain_error)


# name: (N, D, group, Hkv, prefixes of a ragged batch, dtype, mask, padded rows, cache layout)
CASES = {
    "decode": (1, 64, 4, 2, (1000, 1), FP16, "causal", False, "contiguous"),
    "decode-mha-fp32": (1, 32, 1, 2, (0, 127), FP32, "causal", False, "bshd"),
    "chain-bf16": (3, 80, 2, 2, (127, 0), BF16, "chain", True, "layered"),
    "prefill": (17, 96, 3, 1, (0, 1), FP32, "causal", True, "bshd"),
    "star-gqa6": (17, 128, 6, 1, (1, 127), BF16, "star", False, "contiguous"),
    "deep-mqa8": (64, 64, 8, 1, (127, 1000), FP16, "deep", True, "layered"),
    "wide": (64, 32, 2, 2, (1, 0), FP32, "wide", True, "contiguous"),
    "random-128": (128, 64, 4, 1, (1000,), BF16, "random", True, "bshd"),
    "causal-128": (128, 32, 1, 1, (127, 0), FP16, "causal", True, "contiguous"),
    "d256": (3, 256, 2, 1, (127, 1), FP32, "random", False, "layered"),
    "d256-bf16": (17, 256, 3, 1, (1,), BF16, "random", True, "contiguous"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_reference_and_truth(kernel_backend, name):
    num_new, head_dim, group, kv_heads, prefixes, dtype, mask_kind, padded, layout = CASES[name]
    run_case(
        num_new=num_new,
        head_dim=head_dim,
        group=group,
        num_kv_heads=kv_heads,
        prefixes=prefixes,
        dtype=dtype,
        mask_kind=mask_kind,
        padded=padded,
        layout=layout,
    )


@pytest.mark.parametrize(
    ("num_splits", "prefixes", "mask_kind", "dtype"),
    [
        (2, (127, 0), "random", FP32),
        (3, (1000, 1), "causal", BF16),
        (7, (127, 64), "chain", FP16),  # more splits than tiles: empty splits weigh nothing
    ],
)
def test_split_kv_matches(num_splits, prefixes, mask_kind, dtype):
    run_case(
        num_new=17,
        head_dim=32,
        group=2,
        num_kv_heads=1,
        prefixes=prefixes,
        dtype=dtype,
        mask_kind=mask_kind,
        padded=True,
        num_splits=num_splits,
    )


def test_bool_and_packed_masks_agree(kernel_backend):
    common = dict(num_new=33, head_dim=32, group=2, num_kv_heads=1, prefixes=(40, 3))
    common.update(dtype=FP32, mask_kind="random", padded=False, seed=3)
    from_bool = run_case(**common, packed=False)
    from_packed = run_case(**common, packed=True)
    torch.testing.assert_close(from_bool, from_packed, rtol=0, atol=0)


def test_default_backend_on_cpu_is_the_fused_implementation(monkeypatch):
    monkeypatch.delenv("SPECDEC_BACKEND", raising=False)
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(1, 2, 3, 16, generator=generator)
    k_cache, v_cache = torch.randn(2, 1, 1, 9, 16, generator=generator)
    cache_lens = torch.tensor([4], dtype=torch.int32)
    target = "specdec_fast.kernels.tree_attention"
    with (
        mock.patch(f"{target}.launch_tree_attention") as launch,
        mock.patch(f"{target}.tree_attention_reference") as reference,
        mock.patch(f"{target}.tree_attention_fused", wraps=tree_attention_fused) as fused,
    ):
        out = tree_attention(q, k_cache, v_cache, cache_lens, scale=0.3)
    launch.assert_not_called()
    reference.assert_not_called()
    fused.assert_called_once()
    expected = tree_attention_reference(q, k_cache, v_cache, cache_lens, scale=0.3)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def attend_slots(q_rows, k_cache, v_cache, slots):
    """Softmax attention of `q_rows` `[H, D]` to the listed cache slots of `[H, L, D]` caches."""
    scores = q_rows[:, None, :] @ k_cache[:, slots].transpose(-1, -2) * q_rows.shape[-1] ** -0.5
    return (torch.softmax(scores, dim=-1) @ v_cache[:, slots])[:, 0]


@pytest.mark.parametrize("prefix", [0, 6])
def test_rows_without_diagonal_follow_the_mask_literally(kernel_backend, prefix):
    """Row 1 sees only token 0; row 2 sees no new token (only the prefix, or nothing: zeros)."""
    generator = torch.Generator().manual_seed(2)
    q = torch.randn(1, 2, 3, 16, generator=generator)
    k_cache, v_cache = torch.randn(2, 1, 2, prefix + 3, 16, generator=generator)
    cache_lens = torch.tensor([prefix], dtype=torch.int32)
    tree = torch.tensor([[[1, 0, 0], [1, 0, 0], [0, 0, 0]]], dtype=torch.bool)
    out = tree_attention(q, k_cache, v_cache, cache_lens, tree)
    reference = tree_attention_reference(q, k_cache, v_cache, cache_lens, tree)
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)
    row_1 = attend_slots(q[0, :, 1], k_cache[0], v_cache[0], list(range(prefix + 1)))
    torch.testing.assert_close(out[0, :, 1], row_1, rtol=1e-5, atol=1e-5)
    if prefix == 0:
        assert (out[0, :, 2] == 0).all()
    else:
        row_2 = attend_slots(q[0, :, 2], k_cache[0], v_cache[0], list(range(prefix)))
        torch.testing.assert_close(out[0, :, 2], row_2, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "fused", "triton"])
@pytest.mark.parametrize("mask_kind", ["causal", "random"])
def test_strided_lengths_read_like_contiguous_ones(monkeypatch, backend, mask_kind):
    """`cache_lens` and `q_lens` as strided views of larger int32 tensors (every other element,
    the ones between them wrong lengths) give exactly the result of contiguous copies."""
    monkeypatch.setenv("SPECDEC_BACKEND", backend)
    generator = torch.Generator().manual_seed(11)
    prefixes, live, num_new = [5, 11, 2], [3, 1, 2], 3
    q = torch.randn(3, 4, num_new, 16, generator=generator)
    k_cache, v_cache = make_cache(3, 2, 16, 16, FP32, "layered", generator)
    tree = None
    if mask_kind == "random":
        masks = [ancestor_mask(random_parents(num_new, "random", generator)) for _ in prefixes]
        tree = pack_tree_mask(torch.stack(masks))

    def every_other(values):
        spread = torch.full((2 * len(values),), 9, dtype=torch.int32)
        spread[::2] = torch.tensor(values, dtype=torch.int32)
        return spread[::2]

    cache_lens, q_lens = every_other(prefixes), every_other(live)
    assert not cache_lens.is_contiguous() and not q_lens.is_contiguous()
    out = tree_attention(q, k_cache, v_cache, cache_lens, tree, q_lens)
    dense = tree_attention(q, k_cache, v_cache, cache_lens.contiguous(), tree, q_lens.contiguous())
    torch.testing.assert_close(out, dense, rtol=0, atol=0)
    reference = tree_attention_reference(
        q, k_cache, v_cache, cache_lens.contiguous(), tree, q_lens.contiguous()
    )
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)


def test_empty_batch_and_zero_live_rows(kernel_backend):
    k_cache, v_cache = torch.randn(2, 2, 1, 8, 16)
    empty = tree_attention(
        torch.randn(0, 2, 3, 16), k_cache[:0], v_cache[:0], torch.zeros(0, dtype=torch.int32)
    )
    assert empty.shape == (0, 2, 3, 16)
    q = torch.randn(2, 2, 3, 16)
    with poisoned_allocations():
        out = tree_attention(
            q,
            k_cache,
            v_cache,
            torch.tensor([5, 2], dtype=torch.int32),
            q_lens=torch.tensor([0, 3], dtype=torch.int32),
        )
    assert (out[0] == 0).all() and not out[1].isnan().any() and (out[1] != 0).any()


@pytest.mark.parametrize("num_nodes", [1, 31, 32, 33, 128])
def test_pack_tree_mask_round_trip(num_nodes):
    mask = (
        torch.rand(2, num_nodes, num_nodes, generator=torch.Generator().manual_seed(num_nodes))
        < 0.5
    )
    packed = pack_tree_mask(mask)
    assert packed.dtype == torch.int32 and packed.shape == (2, num_nodes, -(-num_nodes // 32))
    assert torch.equal(unpack_tree_mask(packed, num_nodes), mask)


def test_pack_tree_mask_bit_layout():
    mask = torch.zeros(1, 40, 40, dtype=torch.bool)
    mask[0, 0, 0] = mask[0, 0, 31] = mask[0, 0, 33] = True
    packed = pack_tree_mask(mask)
    assert packed[0, 0, 0].item() == 1 - 2**31  # bits 0 and 31 (the sign bit)
    assert packed[0, 0, 1].item() == 2  # bit 33 % 32
    assert (packed[0, 1:] == 0).all()
    with pytest.raises(ValueError, match=r"mask_bool: expected shape \[B, N, N\], got \(1, 2, 3\)"):
        pack_tree_mask(torch.ones(1, 2, 3, dtype=torch.bool))


def test_num_splits_heuristic():
    # Llama-3-8B verify of 64 nodes at B=1: 8 KV heads x 2 row blocks on 132 SMs -> one wave.
    assert choose_num_splits(16, 4096, 64, 132) == 8
    assert choose_num_splits(16, 200, 64, 132) == 1  # a short cache is not worth splitting
    assert choose_num_splits(256, 1 << 20, 64, 132) == 1  # the batch already fills the GPU
    assert choose_num_splits(1, 1 << 20, 64, 132) == MAX_SPLITS
    assert choose_num_splits(0, 0, 64, 132) == 1


@pytest.mark.parametrize("head_dim", [32, 64, 80, 96, 128, 256])
@pytest.mark.parametrize("dtype", [FP32, BF16])
@pytest.mark.parametrize("windowed_or_capped", [False, True])
def test_kernel_config_tiles_are_dot_shaped(head_dim, dtype, windowed_or_capped):
    for group, num_new in [(1, 1), (3, 17), (8, 128)]:
        config = kernel_config(head_dim, group, num_new, dtype, windowed_or_capped)
        for block in (config.block_m, config.block_n, config.block_d):
            assert block >= 16 and block & (block - 1) == 0
        assert config.block_d >= head_dim and config.block_m * config.block_d <= 128 * 128


def valid_args():
    q = torch.randn(2, 4, 3, 16)
    k_cache, v_cache = torch.randn(2, 2, 2, 10, 16)
    cache_lens = torch.tensor([4, 7], dtype=torch.int32)
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, cache_lens=cache_lens)


def tree_args():
    return valid_args() | dict(tree_mask=torch.ones(2, 3, 3, dtype=torch.bool).tril())


def node_depths(values, dtype=torch.int32):
    """`q_depths` for `tree_args`: int32 `[B, N]` unless told otherwise."""
    return torch.tensor(values, dtype=dtype)


BAD_ARGS = {
    "q not a tensor": (dict(q=[1.0]), "q: expected a torch.Tensor"),
    "q 3-d": (dict(q=torch.randn(2, 4, 16)), r"q: expected shape \[B, Hq, N, D\]"),
    "q int": (dict(q=torch.ones(2, 4, 3, 16, dtype=torch.int32)), "q: expected dtype"),
    "q head dim too big": (
        dict(q=torch.randn(2, 4, 3, 257)),
        r"D must be in \[1, 256\], got D = 257",
    ),
    "q D stride": (dict(q=torch.randn(2, 4, 16, 3).transpose(2, 3)), "q: expected unit stride"),
    "k dtype": (dict(k_cache=torch.randn(2, 2, 10, 16, dtype=FP16)), "k_cache: expected dtype"),
    "k batch": (dict(k_cache=torch.randn(3, 2, 10, 16)), r"k_cache: expected shape"),
    "k head dim": (dict(k_cache=torch.randn(2, 2, 10, 8)), r"k_cache: expected shape"),
    "v shape": (dict(v_cache=torch.randn(2, 2, 9, 16)), r"v_cache: expected shape"),
    "k D stride": (
        dict(k_cache=torch.randn(2, 2, 16, 10).transpose(2, 3)),
        "k_cache: expected unit stride",
    ),
    "heads not a multiple": (
        dict(k_cache=torch.randn(2, 3, 10, 16), v_cache=torch.randn(2, 3, 10, 16)),
        "Hq must be a multiple of Hkv",
    ),
    "cache_lens int64": (dict(cache_lens=torch.tensor([4, 7])), "cache_lens: expected dtype"),
    "cache_lens shape": (
        dict(cache_lens=torch.tensor([4], dtype=torch.int32)),
        r"cache_lens: expected shape \[B\]",
    ),
    "cache overflow": (
        dict(cache_lens=torch.tensor([4, 8], dtype=torch.int32)),
        r"cache_lens\[1\] = 8 is out of range: expected 0 <= cache_lens\[1\] <= 7",
    ),
    "negative cache_lens": (
        dict(cache_lens=torch.tensor([-1, 0], dtype=torch.int32)),
        "cache_lens",
    ),
    "q_lens too big": (dict(q_lens=torch.tensor([3, 4], dtype=torch.int32)), r"q_lens\[1\] = 4"),
    "q_lens dtype": (
        dict(q_lens=torch.tensor([3, 3], dtype=torch.int64)),
        "q_lens: expected dtype",
    ),
    "mask N disagrees": (
        dict(tree_mask=torch.ones(2, 4, 4, dtype=torch.bool)),
        r"tree_mask: expected shape \[B, N, N\]",
    ),
    "packed mask words": (
        dict(tree_mask=torch.ones(2, 3, 2, dtype=torch.int32)),
        r"tree_mask: expected shape \[B, N, ceil\(N/32\)\]",
    ),
    "mask dtype": (
        dict(tree_mask=torch.ones(2, 3, 1)),
        r"tree_mask: expected bool \[B, N, N\] or packed int32 \[B, N, ceil\(N/32\)\], got "
        "torch.float32",
    ),
    "mask dtype, a bool mask's shape": (
        dict(tree_mask=torch.ones(2, 3, 3, dtype=torch.int64)),
        r"tree_mask: expected bool .* got torch.int64",
    ),
    "head dim zero": (
        dict(
            q=torch.randn(2, 4, 3, 0),
            k_cache=torch.randn(2, 2, 10, 0),
            v_cache=torch.randn(2, 2, 10, 0),
        ),
        r"q: head dim D must be in \[1, 256\], got D = 0",
    ),
    "scale nan": (dict(scale=float("nan")), "scale: expected a finite float"),
    "scale tensor": (dict(scale=torch.tensor(0.5)), "scale: expected a finite float"),
    "scale bool": (dict(scale=True), "scale: expected a finite float, got True"),
    "softcap zero": (dict(softcap=0.0), "softcap: expected None or a finite float > 0"),
    "softcap negative": (dict(softcap=-5.0), "softcap: expected None or a finite float > 0"),
    "softcap inf": (dict(softcap=float("inf")), "softcap: expected None or a finite float"),
    "softcap nan": (dict(softcap=float("nan")), "softcap: expected None or a finite float"),
    "softcap bool": (dict(softcap=True), "softcap: expected None or a finite float"),
    "softcap tensor": (dict(softcap=torch.tensor(5.0)), "softcap: expected None or a finite"),
    "window zero": (dict(window=0), "window: expected None or an int >= 1, got 0"),
    "window negative": (dict(window=-3), "window: expected None or an int >= 1"),
    "window float": (dict(window=2.5), "window: expected None or an int >= 1"),
    "window bool": (dict(window=True), "window: expected None or an int >= 1"),
    "depths missing": (
        dict(tree_args(), window=2),
        r"q_depths: a sliding window over a tree needs each node's depth, int32 \[B, N\]",
    ),
    "depths without a tree": (
        dict(window=2, q_depths=node_depths([[0, 1, 2]] * 2)),
        "q_depths: only trees take depths",
    ),
    "depths shape": (
        dict(tree_args(), window=2, q_depths=node_depths([[0, 1, 2, 3]] * 2)),
        r"q_depths: expected shape \[B, N\] = \(2, 3\), got \(2, 4\)",
    ),
    "depths dtype": (
        dict(tree_args(), window=2, q_depths=node_depths([[0, 1, 2]] * 2, torch.int64)),
        "q_depths: expected dtype in \\(int32\\), got torch.int64",
    ),
    "depths too deep": (
        dict(tree_args(), window=2, q_depths=node_depths([[0, 1, 2], [0, 1, 3]])),
        r"q_depths.flatten\(\)\[5\] = 3 is out of range: expected 0 <= .* <= 2",
    ),
    "depths negative": (
        dict(tree_args(), q_depths=node_depths([[0, -1, 1], [0, 1, 2]])),
        r"q_depths.flatten\(\)\[1\] = -1 is out of range",
    ),
}


@pytest.mark.parametrize("backend", ["torch", "triton", "fused"])
@pytest.mark.parametrize("name", list(BAD_ARGS))
def test_validation_errors(monkeypatch, backend, name):
    monkeypatch.setenv("SPECDEC_BACKEND", backend)
    changes, message = BAD_ARGS[name]
    args = valid_args() | changes
    with (
        mock.patch("specdec_fast.kernels.tree_attention.launch_tree_attention") as launch,
        pytest.raises(ValueError, match=message),
    ):
        tree_attention(**args)
    launch.assert_not_called()


def test_tree_size_limit():
    num_new = MAX_TREE_NODES + 1
    args = valid_args() | dict(
        q=torch.randn(2, 4, num_new, 16),
        k_cache=torch.randn(2, 2, 200, 16),
        v_cache=torch.randn(2, 2, 200, 16),
        tree_mask=torch.ones(2, num_new, num_new, dtype=torch.bool),
    )
    with pytest.raises(ValueError, match=f"at most {MAX_TREE_NODES} nodes"):
        tree_attention(**args)
    # Causal runs (prefill) have no such limit.
    args["tree_mask"] = None
    assert tree_attention(**args).shape == (2, 4, num_new, 16)


def test_device_mismatch_is_a_clear_error():
    args = valid_args()
    args["cache_lens"] = args["cache_lens"].to("meta")
    with pytest.raises(ValueError, match="cache_lens: expected a tensor on cpu"):
        tree_attention(**args)
    args = tree_args() | dict(window=2, q_depths=node_depths([[0, 1, 2]] * 2).to("meta"))
    with pytest.raises(ValueError, match="q_depths: expected a tensor on cpu"):
        tree_attention(**args)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("batch", "prefix", "num_new", "mask_kind", "dtype"),
    [
        (1, 4096, 64, "random", BF16),
        (3, 1000, 1, "causal", FP16),
        (2, 2048, 32, "chain", FP32),
        (4, 0, 300, "causal", BF16),
    ],
)
def test_compiled_kernel_matches_reference(batch, prefix, num_new, mask_kind, dtype):
    generator = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(batch, 32, num_new, 128, device="cuda", generator=generator).to(dtype)
    k_cache, v_cache = torch.randn(2, batch, 8, prefix + num_new + 7, 128, device="cuda").to(dtype)
    cache_lens = torch.arange(batch, dtype=torch.int32, device="cuda") * -7 + prefix
    cache_lens.clamp_(min=0)
    tree_mask = None
    if mask_kind != "causal":
        masks = [
            ancestor_mask(random_parents(num_new, mask_kind, torch.Generator()))
            for _ in range(batch)
        ]
        tree_mask = pack_tree_mask(torch.stack(masks).cuda())
    out = tree_attention(q, k_cache, v_cache, cache_lens, tree_mask)
    expected = tree_attention_reference(q, k_cache, v_cache, cache_lens, tree_mask)
    rtol, atol = REFERENCE_TOL[dtype]
    torch.testing.assert_close(out, expected, rtol=rtol, atol=atol)


@pytest.mark.gpu
def test_cuda_graph_replay_follows_new_lengths():
    """No host sync inside: the call captures, and a replay reads the lengths of the moment."""
    q = torch.randn(2, 32, 64, 128, device="cuda", dtype=BF16)
    k_cache, v_cache = torch.randn(2, 2, 8, 4200, 128, device="cuda", dtype=BF16)
    cache_lens = torch.tensor([4096, 100], dtype=torch.int32, device="cuda")
    tree_attention(q, k_cache, v_cache, cache_lens)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tree_attention(q, k_cache, v_cache, cache_lens)
    cache_lens.copy_(torch.tensor([17, 3000], dtype=torch.int32))
    graph.replay()
    expected = tree_attention_reference(q, k_cache, v_cache, cache_lens)
    torch.testing.assert_close(out, expected, rtol=1.6e-2, atol=1.6e-2)
