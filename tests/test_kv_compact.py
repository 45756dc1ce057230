"""kv_compact: the Triton kernel (interpreted on the CPU) and the torch reference against a naive
per-layer loop, bit for bit, with NaN-poisoned destinations; validation errors; the GPU build.

Every case compares the whole cache through an integer view, so slots that must not change are
checked to be bit-identical and poisoned destinations that stay unwritten fail.
"""

import pytest
import torch

from specdec_fast.kernels import kv_compact, kv_compact_reference
from specdec_fast.kernels.kv_compact import RAW_DTYPES, launch_config

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.float8_e4m3fn)
# (num_layers, B, Hkv, Lmax, D, N): a minimal cache, odd sizes with a partial head block (Hkv=5
# with 4 heads per program), and N = 19 whose paths span three chunks of 8 positions.
SHAPES = ((1, 1, 1, 4, 1, 2), (2, 3, 5, 45, 17, 9), (3, 4, 2, 64, 33, 19))


def raw(kv: torch.Tensor) -> torch.Tensor:
    return kv.view(RAW_DTYPES[kv.element_size()])


def random_cache(shape, dtype, generator) -> torch.Tensor:
    """Random bits, NaN and infinity patterns included: the op must copy bits, never values."""
    numel = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    bits = torch.randint(0, 256, (numel,), dtype=torch.uint8, generator=generator)
    return bits.view(dtype).reshape(shape)


def overlapping_path(num_accepted: int) -> list[int]:
    """[0, 2, 3, ..., num_accepted + 1]: every destination but the first is the source of the
    position before it, the hardest order for a copy that is not sequential."""
    return [0, *range(2, num_accepted + 2)]


def sample_paths(batch: int, num_nodes: int, generator) -> list[list[int]]:
    """Ragged paths: the root alone, a full chain, a maximal overlap, then random subsets."""
    fixed = [[0], list(range(num_nodes))]
    if num_nodes > 2:
        fixed.append(overlapping_path(num_nodes - 2))
    paths = []
    for b in range(batch):
        if b < len(fixed):
            paths.append(fixed[(b + num_nodes) % len(fixed)])
            continue
        size = int(torch.randint(0, num_nodes, (), generator=generator))
        chosen = torch.randperm(num_nodes - 1, generator=generator)[:size] + 1
        paths.append([0, *sorted(chosen.tolist())])
    return paths


def path_tensors(paths: list[list[int]], num_nodes: int):
    accepted_nodes = torch.full((len(paths), num_nodes), -1, dtype=torch.int32)
    for b, path in enumerate(paths):
        accepted_nodes[b, : len(path)] = torch.tensor(path, dtype=torch.int32)
    num_accepted = torch.tensor([len(path) - 1 for path in paths], dtype=torch.int32)
    return accepted_nodes, num_accepted


def random_lens(num_accepted: torch.Tensor, max_len: int, num_nodes: int, generator):
    """Lengths that leave room for the whole tree of N nodes after the prefix."""
    high = max_len - num_nodes + 1
    lens = torch.randint(0, high, num_accepted.shape, generator=generator, dtype=torch.int32)
    return lens


def naive_compact(kv, cache_lens, accepted_nodes, num_accepted) -> None:
    """The eager per-layer loop, reading every source from an untouched copy."""
    original = kv.clone()
    for layer in range(kv.shape[0]):
        for kind in range(2):
            for b in range(kv.shape[2]):
                start = int(cache_lens[b])
                for t in range(int(num_accepted[b]) + 1):
                    source = start + int(accepted_nodes[b, t])
                    kv[layer, kind, b, :, start + t] = original[layer, kind, b, :, source]
    cache_lens += num_accepted + 1


def poison_destinations(kv, cache_lens, paths) -> int:
    """Set every slot that must be overwritten, and is read by no copy, to all-ones bits (NaN in
    every float format); return how many slots were poisoned."""
    poisoned = 0
    for b, path in enumerate(paths):
        start = int(cache_lens[b])
        for t in set(range(len(path))) - set(path):
            raw(kv)[:, :, b, :, start + t] = -1
            poisoned += 1
    return poisoned


def check_against_naive(kv, cache_lens, accepted_nodes, num_accepted, paths, op) -> None:
    poisoned = poison_destinations(kv, cache_lens, paths)
    expected, expected_lens = kv.clone(), cache_lens.clone()
    naive_compact(raw(expected), expected_lens, accepted_nodes, num_accepted)
    if poisoned:
        # Guards the test itself: doing nothing must fail.
        assert not torch.equal(raw(expected), raw(kv))
    op(kv, cache_lens, accepted_nodes, num_accepted)
    torch.testing.assert_close(raw(kv), raw(expected), rtol=0, atol=0)
    torch.testing.assert_close(cache_lens, expected_lens, rtol=0, atol=0)


@pytest.fixture(params=["triton", "fused", "torch"])
def backend(request, monkeypatch) -> str:
    monkeypatch.setenv("SPECDEC_BACKEND", request.param)
    return request.param


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_naive_loop(backend, shape, dtype):
    num_layers, batch, num_heads, max_len, head_dim, num_nodes = shape
    generator = torch.Generator().manual_seed(10 * SHAPES.index(shape) + DTYPES.index(dtype))
    kv = random_cache((num_layers, 2, batch, num_heads, max_len, head_dim), dtype, generator)
    paths = sample_paths(batch, num_nodes, generator)
    accepted_nodes, num_accepted = path_tensors(paths, num_nodes)
    cache_lens = random_lens(num_accepted, max_len, num_nodes, generator)
    check_against_naive(kv, cache_lens, accepted_nodes, num_accepted, paths, kv_compact)


@pytest.mark.parametrize("num_accepted", [1, 7, 8, 9, 16, 17])
def test_overlapping_paths_across_chunks(backend, num_accepted):
    """Every copy's destination is the previous copy's source, inside and across chunks."""
    generator = torch.Generator().manual_seed(num_accepted)
    num_nodes = num_accepted + 2
    kv = random_cache((2, 2, 2, 3, num_nodes + 3, 8), torch.float16, generator)
    paths = [overlapping_path(num_accepted), list(range(num_accepted + 1))]
    accepted_nodes, num_accepted_t = path_tensors(paths, num_nodes)
    cache_lens = torch.tensor([1, 0], dtype=torch.int32)
    check_against_naive(kv, cache_lens, accepted_nodes, num_accepted_t, paths, kv_compact)


def test_reference_matches_naive_loop():
    generator = torch.Generator().manual_seed(7)
    kv = random_cache((2, 2, 5, 3, 30, 5), torch.bfloat16, generator)
    paths = sample_paths(5, 11, generator)
    accepted_nodes, num_accepted = path_tensors(paths, 11)
    cache_lens = random_lens(num_accepted, 30, 11, generator)
    check_against_naive(kv, cache_lens, accepted_nodes, num_accepted, paths, kv_compact_reference)


def test_non_contiguous_inputs(backend):
    """Strided views everywhere; the storage around the views stays bit-identical."""
    generator = torch.Generator().manual_seed(3)
    num_layers, batch, num_heads, max_len, head_dim, num_nodes = 2, 3, 2, 24, 6, 7
    # Batch-major storage permuted to [num_layers, 2, B, ...], every other head, D padded to 9.
    storage = random_cache(
        (batch, num_layers, 2, 2 * num_heads, max_len, head_dim + 3), torch.bfloat16, generator
    )
    kv = storage.permute(1, 2, 0, 3, 4, 5)[:, :, :, ::2, :, :head_dim]
    paths = sample_paths(batch, num_nodes, generator)
    accepted_nodes, num_accepted = path_tensors(paths, num_nodes)
    accepted_nodes = accepted_nodes.t().contiguous().t()
    num_accepted = torch.stack([num_accepted, num_accepted], dim=1)[:, 0]
    lens_storage = torch.zeros(2 * batch, dtype=torch.int32)
    cache_lens = lens_storage[::2]
    cache_lens.copy_(random_lens(num_accepted, max_len, num_nodes, generator))

    def around_the_view() -> torch.Tensor:
        copy = raw(storage).clone()
        copy.permute(1, 2, 0, 3, 4, 5)[:, :, :, ::2, :, :head_dim] = 0
        return copy

    before = around_the_view()
    check_against_naive(kv, cache_lens, accepted_nodes, num_accepted, paths, kv_compact)
    torch.testing.assert_close(around_the_view(), before, rtol=0, atol=0)
    assert lens_storage[1::2].eq(0).all()


def test_empty_batch(backend):
    kv = torch.randn(2, 2, 0, 1, 4, 3)
    cache_lens = torch.zeros(0, dtype=torch.int32)
    nodes = torch.zeros(0, 3, dtype=torch.int32)
    kv_compact(kv, cache_lens, nodes, torch.zeros(0, dtype=torch.int32))


def test_unvalidated_kernel_stays_inside_the_cache(triton_backend):
    """validate=False with sources beyond Lmax (position 3) and, from a path that goes back, a
    destination beyond Lmax (position 4): the kernel skips both; the rest of a larger buffer
    around the cache is untouched."""
    generator = torch.Generator().manual_seed(5)
    storage = random_cache((1, 2, 1, 1, 16, 4), torch.float32, generator)
    kv = storage[:, :, :, :, :8]
    expected = storage.clone()
    # Position 1 (slot 5 <- slot 7) is inside the cache and still happens.
    expected[..., 5, :] = storage[..., 7, :]
    cache_lens = torch.tensor([4], dtype=torch.int32)
    accepted_nodes = torch.tensor([[0, 3, 6, 9, 1]], dtype=torch.int32)
    num_accepted = torch.tensor([4], dtype=torch.int32)
    kv_compact(kv, cache_lens, accepted_nodes, num_accepted, validate=False)
    torch.testing.assert_close(raw(storage), raw(expected), rtol=0, atol=0)


def valid_inputs():
    kv = torch.randn(2, 2, 3, 2, 16, 4)
    cache_lens = torch.tensor([0, 4, 8], dtype=torch.int32)
    accepted_nodes = torch.tensor(
        [[0, 1, 3, -1], [0, -1, -1, -1], [0, 2, 3, -1]], dtype=torch.int32
    )
    num_accepted = torch.tensor([2, 0, 2], dtype=torch.int32)
    return {
        "kv": kv,
        "cache_lens": cache_lens,
        "accepted_nodes": accepted_nodes,
        "num_accepted": num_accepted,
    }


def with_value(name, index, value):
    def change(inputs):
        inputs[name][index] = value

    return change


def replaced(name, tensor_from):
    def change(inputs):
        inputs[name] = tensor_from(inputs[name])

    return change


BAD_INPUTS = {
    "kv rank": (replaced("kv", lambda kv: kv[0]), r"kv: expected shape"),
    "kv not K and V": (replaced("kv", lambda kv: kv[:, :1]), r"kv: expected shape"),
    "kv element size": (
        replaced("kv", lambda kv: kv.to(torch.complex128)),
        r"kv: expected an element size",
    ),
    "kv empty head dim": (replaced("kv", lambda kv: kv[..., :0]), r"kv: num_layers, Hkv"),
    "cache_lens dtype": (replaced("cache_lens", lambda x: x.long()), r"cache_lens: expected dtype"),
    "cache_lens batch": (replaced("cache_lens", lambda x: x[:2]), r"cache_lens: expected shape"),
    "cache_lens device": (
        replaced("cache_lens", lambda x: x.to("meta")),
        r"cache_lens: expected a tensor on cpu",
    ),
    "cache_lens aliased": (
        replaced("cache_lens", lambda x: x[:1].expand(3)),
        r"cache_lens: updated in place",
    ),
    "accepted_nodes dtype": (
        replaced("accepted_nodes", lambda x: x.long()),
        r"accepted_nodes: expected dtype",
    ),
    "accepted_nodes batch": (
        replaced("accepted_nodes", lambda x: x[:, None]),
        r"accepted_nodes: expected shape",
    ),
    "accepted_nodes empty": (
        replaced("accepted_nodes", lambda x: x[:, :0]),
        r"accepted_nodes: expected N >= 1",
    ),
    "num_accepted shape": (
        replaced("num_accepted", lambda x: x[:, None]),
        r"num_accepted: expected shape",
    ),
    "num_accepted too many": (
        with_value("num_accepted", 1, 4),
        r"num_accepted\[1\] = 4 is out of range: expected 0 <= num_accepted\[1\] <= N - 1 = 3",
    ),
    "num_accepted negative": (with_value("num_accepted", 0, -1), r"num_accepted\[0\] = -1"),
    "cache_lens negative": (with_value("cache_lens", 2, -3), r"cache_lens\[2\] = -3"),
    "root": (with_value("accepted_nodes", (0, 0), 1), r"accepted_nodes\[0, 0\] = 1: a path starts"),
    "not increasing": (
        with_value("accepted_nodes", (2, 2), 2),
        r"accepted_nodes\[2, :num_accepted\[2\] \+ 1\] = \[0, 2, 2\]: .* strictly increasing",
    ),
    "node out of range": (
        with_value("accepted_nodes", (2, 2), 4),
        r"\[0, 2, 4\]: node indices must be < N = 4",
    ),
    "overflow": (
        with_value("cache_lens", 2, 14),
        r"cache_lens\[2\] \+ num_accepted\[2\] \+ 1 = 17 would overflow Lmax = 16",
    ),
    "source outside cache": (
        with_value("cache_lens", 2, 13),
        r"source slot cache_lens\[2\] \+ 3 = 16 is outside the cache \(Lmax = 16\)",
    ),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS), ids=str)
def test_bad_input_is_a_clear_error(backend, case):
    change, message = BAD_INPUTS[case]
    inputs = valid_inputs()
    change(inputs)
    kv_before = inputs["kv"].clone()
    lens_before = inputs["cache_lens"].clone()
    with pytest.raises(ValueError, match=message):
        kv_compact(**inputs)
    torch.testing.assert_close(inputs["kv"], kv_before, rtol=0, atol=0, equal_nan=True)
    if inputs["cache_lens"].device.type == "cpu":
        torch.testing.assert_close(inputs["cache_lens"], lens_before, rtol=0, atol=0)


def test_validate_false_skips_value_checks(backend):
    """The engine validates upstream and passes validate=False to stay free of device syncs."""
    inputs = valid_inputs()
    inputs["accepted_nodes"][2, 2] = 2
    kv_compact(**inputs, validate=False)


def test_launch_config_keeps_the_length_bookkeeping_in_int32():
    llama = launch_config((32, 2, 32, 8, 4160, 128), 64)
    assert (llama.block_h, llama.block_t, llama.block_d) == (4, 8, 128)
    assert llama.programs_per_sequence == 128
    assert (llama.programs_per_sequence + 1) << llama.rank_shift <= 2**31
    # 2**21 slots leave 10 bits for arrival ranks: too few for 2 head blocks x 2 x 300 layers.
    deep = launch_config((300, 2, 1, 8, 2**21 - 1, 128), 64)
    assert deep.block_h == 8 and deep.programs_per_sequence == 600
    with pytest.raises(ValueError, match=r"kv: 600 layers with Lmax = 2097151 exceed"):
        launch_config((600, 2, 1, 8, 2**21 - 1, 128), 64)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32, torch.float8_e4m3fn), ids=str)
def test_compiled_kernel_on_overlapping_paths(dtype):
    """Llama-like heads and tiles, every sequence a maximal overlap of its own length (1 to 30
    moved positions: within one chunk and across chunks), plus the random mix."""
    generator = torch.Generator().manual_seed(11)
    num_nodes, batch = 32, 40
    kv = random_cache((3, 2, batch, 8, 200, 128), dtype, generator)
    paths = [overlapping_path(1 + b % 30) for b in range(30)]
    paths += sample_paths(batch - len(paths), num_nodes, generator)
    accepted_nodes, num_accepted = path_tensors(paths, num_nodes)
    cache_lens = random_lens(num_accepted, 200, num_nodes, generator)
    inputs = [tensor.cuda() for tensor in (kv, cache_lens, accepted_nodes, num_accepted)]
    check_against_naive(*inputs, paths, kv_compact)


@pytest.mark.gpu
def test_cuda_graph_replays_compact_again():
    """Captured once (value checks are skipped during capture), replayed twice: each replay
    compacts the next step at the lengths the previous one left on the device."""
    generator = torch.Generator().manual_seed(13)
    num_nodes = 16
    kv = random_cache((2, 2, 6, 4, 96, 64), torch.float16, generator).cuda()
    paths = sample_paths(6, num_nodes, generator)
    accepted_nodes, num_accepted = (tensor.cuda() for tensor in path_tensors(paths, num_nodes))
    cache_lens = torch.randint(0, 48, (6,), dtype=torch.int32, generator=generator).cuda()
    expected, expected_lens = kv.clone(), cache_lens.clone()
    for _ in range(2):
        naive_compact(raw(expected), expected_lens, accepted_nodes, num_accepted)
    kv_compact(kv.clone(), cache_lens.clone(), accepted_nodes, num_accepted)  # compile first
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kv_compact(kv, cache_lens, accepted_nodes, num_accepted)
    graph.replay()
    graph.replay()
    torch.testing.assert_close(raw(kv), raw(expected), rtol=0, atol=0)
    torch.testing.assert_close(cache_lens, expected_lens, rtol=0, atol=0)
