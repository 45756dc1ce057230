"""SpecKVCache: HF's Cache API over one [num_layers, 2, B, Hkv, Lmax, D] tensor."""

import pytest
import torch
from transformers import (
    Gemma2Config,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3NextConfig,
)
from transformers.cache_utils import Cache

from specdec_fast.cache import SpecKVCache, attention_windows

LAYERS, KV_HEADS, HEAD_DIM, CAPACITY = 3, 2, 8, 16
CONFIG = LlamaConfig(
    hidden_size=32,
    num_hidden_layers=LAYERS,
    num_attention_heads=4,
    num_key_value_heads=KV_HEADS,
    head_dim=HEAD_DIM,
)


def make_cache(lengths: list[int], dtype: torch.dtype = torch.float32) -> SpecKVCache:
    cache = SpecKVCache(CONFIG, len(lengths), CAPACITY, dtype=dtype, device="cpu")
    # Fresh random contents everywhere, so that a write to a wrong slot shows.
    cache.kv.copy_(torch.randn(cache.kv.shape))
    cache.commit_lengths(torch.tensor(lengths, dtype=torch.int32), max(lengths))
    return cache


def test_layout_and_hf_cache_api():
    cache = make_cache([3, 0, 5])
    assert isinstance(cache, Cache)
    assert cache.kv.shape == (LAYERS, 2, 3, KV_HEADS, CAPACITY, HEAD_DIM)
    assert len(cache) == LAYERS
    assert cache.batch_size == 3
    assert cache.get_max_length() == CAPACITY
    assert int(cache.get_seq_length()) == 5
    for index, layer in enumerate(cache.layers):
        assert layer.keys.data_ptr() == cache.kv[index, 0].data_ptr()
        assert layer.values.data_ptr() == cache.kv[index, 1].data_ptr()
    cache.reset()
    assert not cache.cache_lens.any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_new", [1, 3])
def test_update_writes_at_ragged_slots(dtype, num_new):
    lengths = [0, 4, 1, CAPACITY - num_new]
    cache = make_cache(lengths, dtype)
    before = cache.kv.clone()
    keys = torch.randn(len(lengths), KV_HEADS, num_new, HEAD_DIM).to(dtype)
    # Non-contiguous values, as HF's q/k/v projections produce them.
    values = torch.randn(len(lengths), num_new, KV_HEADS, HEAD_DIM).to(dtype).transpose(1, 2)
    cache.prepare_write(num_new)
    layer_keys, layer_values = cache.update(keys, values, 1)
    assert layer_keys.data_ptr() == cache.kv[1, 0].data_ptr()
    assert layer_values.data_ptr() == cache.kv[1, 1].data_ptr()
    expected = before.clone()
    for b, length in enumerate(lengths):
        expected[1, 0, b, :, length : length + num_new] = keys[b]
        expected[1, 1, b, :, length : length + num_new] = values[b]
    assert torch.equal(cache.kv, expected)
    assert cache.cache_lens.tolist() == lengths  # writing commits nothing


def test_update_rejects_mismatched_states():
    cache = make_cache([1, 2])
    cache.prepare_write(2)
    good = torch.randn(2, KV_HEADS, 2, HEAD_DIM)
    with pytest.raises(ValueError, match=r"llama: key_states: expected shape \[B, Hkv, N, D\]"):
        cache.update(torch.randn(2, KV_HEADS, 2, HEAD_DIM + 1), good, 0)
    with pytest.raises(ValueError, match="value_states: .*dtype torch.float32"):
        cache.update(good, good.half(), 0)


@pytest.mark.parametrize("backend", ["torch_backend", "triton_backend", "fused_backend"])
def test_compact_keeps_the_accepted_path(backend, request):
    request.getfixturevalue(backend)
    lengths = [2, 5, 0]
    cache = make_cache(lengths)
    before = cache.kv.clone()
    accepted_nodes = torch.tensor([[0, 2, 3, -1], [0, -1, -1, -1], [0, 1, 2, 3]], dtype=torch.int32)
    num_accepted = torch.tensor([2, 0, 3], dtype=torch.int32)
    cache.compact(accepted_nodes, num_accepted)
    assert cache.cache_lens.tolist() == [5, 6, 4]
    for b, length in enumerate(lengths):
        path = accepted_nodes[b, : int(num_accepted[b]) + 1]
        kept = before[:, :, b][..., length + path.long(), :]
        assert torch.equal(cache.kv[:, :, b, :, length : length + len(path)], kept)
        assert torch.equal(cache.kv[:, :, b, :, :length], before[:, :, b, :, :length])


def test_room_is_checked_without_reading_the_device_until_near_capacity():
    cache = make_cache([2, 2])
    cache.ensure_room(7)
    cache.ensure_room(7)  # bound 16 = capacity: still no read needed
    cache.ensure_room(7)  # bound would pass capacity: reads the true lengths (2) and fits
    cache.commit_lengths(torch.tensor([12, 2], dtype=torch.int32), 12)
    cache.ensure_room(4)
    cache.commit_lengths(torch.tensor([16, 2], dtype=torch.int32), 16)
    with pytest.raises(ValueError, match="overflow: 1 new tokens on top of 16 cached ones"):
        cache.ensure_room(1)


@pytest.mark.parametrize("keep", [[0, 1, 2, 3], [0, 2, 3], [3, 1], [1, 0, 2], []])
def test_select_moves_the_committed_slots_of_the_rows_that_shift(keep):
    """`select` keeps each kept row's committed K/V and length, in the order asked. It copies
    only rows whose position changes, and only the slots below the host's length bound: the
    rows in front and everything past the bound are left as they were (poisoned here)."""
    lengths = [3, 0, 5, 2]
    cache = make_cache(lengths)
    before = cache._kv_storage.clone()
    cache.select(keep)
    assert cache.batch_size == len(keep)
    assert cache.cache_lens.tolist() == [lengths[r] for r in keep]
    for slot, row in enumerate(keep):
        held = lengths[row]
        assert torch.equal(cache.kv[:, :, slot, :, :held], before[:, :, row, :, :held])
    first = next((i for i, row in enumerate(keep) if row != i), len(keep))
    assert torch.equal(cache._kv_storage[:, :, :first], before[:, :, :first])
    bound = max(lengths)
    assert torch.equal(cache._kv_storage[..., bound:, :], before[..., bound:, :])
    assert torch.equal(cache._kv_storage[:, :, len(keep) :], before[:, :, len(keep) :])


@pytest.mark.parametrize(
    ("config", "windows"),
    [
        (CONFIG, [None] * LAYERS),
        (MistralConfig(num_hidden_layers=2, sliding_window=64), [64, 64]),
        (
            Qwen2Config(
                num_hidden_layers=3, use_sliding_window=True, sliding_window=32, max_window_layers=1
            ),
            [None, 32, 32],
        ),
        (Gemma2Config(num_hidden_layers=2, sliding_window=48), [48, None]),
    ],
    ids=["llama", "mistral", "qwen2-mixed", "gemma2-alternating"],
)
def test_sliding_and_mixed_layers(config, windows):
    assert attention_windows(config) == windows
    cache = SpecKVCache(config, 1, 8, dtype=torch.float32, device="cpu")
    assert cache.is_sliding == [window is not None for window in windows]


def test_unsupported_layers_are_refused():
    with pytest.raises(ValueError, match=r"qwen3_next: layer types \['linear_attention'\]"):
        SpecKVCache(Qwen3NextConfig(num_hidden_layers=4), 1, 8, dtype=torch.float32, device="cpu")


def write_every_layer(cache, keys, values):
    """Each layer's `update` with its own values; a sum of what the layers return. Compiled,
    the float32 sum is reduced in inductor's order: within `SUM_ATOL` of the eager one (at most
    1.5e-5 apart over 200 seeds; a write to a wrong slot moves it by about 1), while the written
    storage is compared exactly."""
    total = 0
    for index, layer in enumerate(cache.layers):
        layer_keys, layer_values = layer.update(keys + index, values - index)
        total = total + layer_keys[:, :, 0].sum() + layer_values[:, :, 1].sum()
    return total


SUM_ATOL = 1e-4


def test_compiled_writes_go_in_place_without_copying_the_storage():
    """Every layer's `update` under torch.compile is one in-place index_put_ on the storage, on
    live rows fewer than the capacity: writing through views of the storage (as the per-layer
    views alias each other) makes inductor copy the whole storage back at each layer, which
    cost a batch-8 SmolLM2-shaped decode step about 15% of its time. The copies show as `copy_`
    in the generated code. The written values equal an eager cache's."""
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(4)  # the data, whichever tests ran before on this worker
    eager, compiled = make_cache([3, 0, 5, 2]), make_cache([3, 0, 5, 2])
    compiled.kv.copy_(eager.kv)
    for cache in (eager, compiled):
        cache.select([2, 0, 1])
        cache.prepare_write(2)
    keys, values = torch.randn(2, 3, KV_HEADS, 2, HEAD_DIM)

    want = write_every_layer(eager, keys, values)
    compiled_write = torch.compile(write_every_layer, fullgraph=True)
    got, code = run_and_get_code(compiled_write, compiled, keys, values)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=SUM_ATOL)
    assert torch.equal(compiled.kv, eager.kv)
    assert "copy_" not in "\n".join(code)


def test_compiled_writes_through_a_rows_view_go_in_place():
    """The same for a `rows` view (continuous batching feeds newcomers' prompts through one):
    its storage is a slice of the parent's, written in place, the batch's rows untouched."""
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(5)
    eager, compiled = make_cache([3, 0, 5, 2]), make_cache([3, 0, 5, 2])
    compiled.kv.copy_(eager.kv)
    views = []
    for cache in (eager, compiled):
        cache.select([0, 1])
        view = cache.rows(2, 2)
        view.commit_lengths(torch.tensor([4, 1], dtype=torch.int32), 4)
        view.prepare_write(2)
        views.append(view)
    batch_rows = compiled._kv_storage[:, :, :2].clone()
    keys, values = torch.randn(2, 2, KV_HEADS, 2, HEAD_DIM)

    want = write_every_layer(views[0], keys, values)
    compiled_write = torch.compile(write_every_layer, fullgraph=True)
    got, code = run_and_get_code(compiled_write, views[1], keys, values)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=SUM_ATOL)
    assert torch.equal(compiled._kv_storage, eager._kv_storage)
    assert torch.equal(compiled._kv_storage[:, :, :2], batch_rows)
    assert "copy_" not in "\n".join(code)
