"""The engine's KV cache: one `[num_layers, 2, B, Hkv, Lmax, D]` tensor behind HF's `Cache` API.

Each layer's keys and values are views into the one tensor, so `kv_compact` moves the accepted path
of every layer in one launch. `cache_lens` (int32 `[B]`, on the device) counts the committed tokens
of each sequence; a forward writes its N new tokens at slots `cache_lens[b] + i` without advancing
`cache_lens`: only `compact` (after verification) or the runner's prefill commit tokens. Slots past
`cache_lens[b]` hold uncommitted data that the attention masks never expose.

Sliding-window layers are stored like full ones (all tokens are kept); enforcing the window is the
attention function's job. Layer kinds that are not softmax attention over every token (linear or
chunked attention, KV shared across layers) are refused with an error naming the model type.
"""

from collections.abc import Sequence

import torch
from transformers import PreTrainedConfig
from transformers.cache_utils import Cache, CacheLayerMixin

from specdec_fast.kernels.kv_compact import kv_compact, run_kv_compact
from specdec_fast.transfer import to_device

SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")


def attention_windows(config: PreTrainedConfig) -> list[int | None]:
    """The sliding window of each decoder layer (None for full attention), as HF configures it.

    Raises ValueError, naming the model type, for layer kinds this cache cannot hold.
    """
    model_type = config.model_type
    num_layers = config.num_hidden_layers
    sliding_window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        # As in HF (cache_utils.get_layer_types_and_kwargs): a config-wide window slides all layers.
        if getattr(config, "attention_chunk_size", None) is not None:
            layer_types = ["chunked_attention"] * num_layers
        else:
            kind = "full_attention" if sliding_window is None else "sliding_attention"
            layer_types = [kind] * num_layers
    unsupported = sorted(set(layer_types) - set(SUPPORTED_LAYER_TYPES))
    if unsupported:
        raise ValueError(
            f"{model_type}: layer types {unsupported} are not supported; the specdec-fast KV cache "
            f"holds only {list(SUPPORTED_LAYER_TYPES)} layers"
        )
    if getattr(config, "num_kv_shared_layers", None):
        raise ValueError(f"{model_type}: layers that share KV with other layers are not supported")
    return [sliding_window if kind == "sliding_attention" else None for kind in layer_types]


def kv_shape(
    config: PreTrainedConfig, batch_size: int, max_cache_len: int, shards: int = 1
) -> tuple[int, ...]:
    """`[num_layers, 2, B, Hkv, Lmax, D]`: the shape of a `SpecKVCache` for a config (raises
    ValueError, like `attention_windows`, for layer kinds the cache cannot hold). `shards`: the
    tensor-parallel world size of the model; each rank's cache holds its `Hkv / shards` KV heads
    (`specdec_fast.parallel`), and a head count it does not divide raises ValueError."""
    text_config = config.get_text_config(decoder=True)
    num_kv_heads = local_heads(text_config, shards)
    head_dim = (
        getattr(text_config, "head_dim", None)
        or text_config.hidden_size // text_config.num_attention_heads
    )
    num_layers = len(attention_windows(text_config))
    return (num_layers, 2, batch_size, num_kv_heads, max_cache_len, head_dim)


def model_shards(model: torch.nn.Module) -> int:
    """The tensor-parallel world size a model was loaded over (transformers' `tp_size`, set by
    `from_pretrained(..., tp_plan=...)`); 1 for a model on one device."""
    return getattr(model, "tp_size", None) or 1


def local_heads(config: PreTrainedConfig, shards: int) -> int:
    """The KV heads one of `shards` tensor-parallel ranks holds: the config's (query heads
    without GQA) divided by `shards`. Raises ValueError, naming the model type and the counts,
    when `shards` divides neither the KV nor the query heads (the plan shards both by head)."""
    text_config = config.get_text_config(decoder=True)
    query_heads = text_config.num_attention_heads
    kv_heads = getattr(text_config, "num_key_value_heads", None) or query_heads
    if shards < 1 or kv_heads % shards or query_heads % shards:
        raise ValueError(
            f"{text_config.model_type}: tensor parallelism over {shards} ranks needs head counts "
            f"divisible by {shards}, the model has {query_heads} query and {kv_heads} KV heads"
        )
    return kv_heads // shards


class SpecKVLayer(CacheLayerMixin):
    """One decoder layer's view of a `SpecKVCache`: `keys` and `values` are `[B, Hkv, Lmax, D]`."""

    is_compileable = True
    supports_early_init = False

    def __init__(self, cache: "SpecKVCache", layer_idx: int, sliding_window: int | None):
        super().__init__()
        self.cache = cache
        self.layer_idx = layer_idx
        self._layer_index = torch.tensor(layer_idx, device=cache._kv_storage.device)
        # Views of `cache.kv` for eager readers, rebound by the cache to its live rows. Compiled
        # code never touches them (see `update`).
        self.keys = cache._kv_storage[layer_idx, 0]
        self.values = cache._kv_storage[layer_idx, 1]
        self.is_sliding = sliding_window is not None
        self.sliding_window = sliding_window
        self.batch_size = cache._kv_storage.shape[2]
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to do: the storage is allocated with the cache."""

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the N new tokens (`[B, Hkv, N, D]` each) at slots `cache_lens[b] + i`.

        Returns the whole layer, `[B, Hkv, Lmax, D]` keys and values, for the attention function.
        """
        cache, slots = self.cache, self.cache.write_slots
        storage, batch = cache._kv_storage, cache.batch_index.shape[0]
        expected = (batch, storage.shape[3], slots.shape[1], storage.shape[5])
        for name, states in (("key_states", key_states), ("value_states", value_states)):
            if tuple(states.shape) != expected or states.dtype != storage.dtype:
                raise ValueError(
                    f"{cache.model_type}: {name}: expected shape [B, Hkv, N, D] = {expected} "
                    f"and dtype {storage.dtype}, got {tuple(states.shape)} and {states.dtype}"
                )
        # One index_put_ on the storage itself, indexed (layer, K/V, row, head, slot) in full:
        # torch.compile writes that in place, whereas a write through a view of the storage (or
        # through the per-layer views, which alias each other) copies the whole storage back at
        # every layer. The live rows are the storage's first B.
        index = (
            self._layer_index,
            cache.kv_select,
            cache.batch_index[:, :, None],
            cache.head_index,
            slots[:, None, :],
        )
        storage.index_put_(index, torch.stack((key_states, value_states)))
        # The storage's rows are unbacked (`SpecKVCache._bind`): told that the batch fits, the
        # compiler sizes the slices B rather than min(B, rows).
        torch._check(batch <= storage.shape[2])
        return storage[self.layer_idx, 0, :batch], storage[self.layer_idx, 1, :batch]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """The whole capacity, as for HF's static cache (the mask built from it is never used)."""
        return self.cache._kv_storage.shape[4], 0

    def get_seq_length(self) -> torch.Tensor:
        """The longest committed length, as a 0-dim device tensor so that no host read happens.

        Per-sequence lengths are `SpecKVCache.cache_lens`.
        """
        return self.cache.cache_lens.max()

    def get_max_length(self) -> int:
        return self.cache._kv_storage.shape[4]


class SpecKVCache(Cache):
    """A static, ragged KV cache for tree verification.

    Hkv and D come from the config and are the same for every layer; a model whose layers disagree
    (or whose keys and values differ in width) fails at its first write, naming the model type.

    The storage is allocated once for `batch_size` sequences of `max_cache_len` slots and then
    reused: `resize` takes any smaller batch, `select` moves the kept sequences to the front in
    place. So the tensors' addresses never change while the storage lasts, which is what lets a
    captured CUDA graph be replayed by later calls, and a compiled step sees the same layout.
    Sequences join a running batch (continuous batching) in the rows past its end: filled
    through a `rows` view, then taken in by `admit`.

    Attributes:
        kv: `[num_layers, 2, B, Hkv, Lmax, D]` in the model's dtype (a view of the storage's first
            B sequences); layer l's K is `kv[l, 0]`. Under tensor parallelism over `shards`
            ranks, Hkv is the rank's own `Hkv / shards` heads.
        cache_lens: int32 `[B]`, committed tokens per sequence, on the cache's device.
        write_slots: int64 `[B, N]`, the slots the current forward writes (set by `prepare_write`).
    """

    def __init__(
        self,
        config: PreTrainedConfig,
        batch_size: int,
        max_cache_len: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        shards: int = 1,
    ):
        text_config = config.get_text_config(decoder=True)
        self.model_type = text_config.model_type
        windows = attention_windows(text_config)
        if batch_size < 1 or max_cache_len < 1:
            raise ValueError(
                f"batch_size and max_cache_len must be positive, got {batch_size} and "
                f"{max_cache_len}"
            )
        shape = kv_shape(text_config, batch_size, max_cache_len, shards)
        # Zeros, not empty: unwritten slots are masked out, but NaN garbage would survive 0 * NaN.
        self._setup(
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(batch_size, dtype=torch.int32, device=device),
            windows,
        )

    def _setup(
        self, kv_storage: torch.Tensor, lens_storage: torch.Tensor, windows: Sequence[int | None]
    ) -> None:
        """Serve `kv_storage` (`[layers, 2, rows, Hkv, Lmax, D]`) and `lens_storage` (int32
        `[rows]`), bound to all their rows: the body of `__init__`, shared by `rows` and
        `with_capacity`."""
        batch_size = kv_storage.shape[2]
        device = kv_storage.device
        self._kv_storage = kv_storage
        self._lens_storage = lens_storage
        self._index_storage = torch.arange(batch_size, device=device)[:, None]
        # Broadcast indices of a layer's write: K/V `[2, 1, 1, 1]`, KV head `[Hkv, 1]`.
        self.kv_select = torch.arange(2, device=device)[:, None, None, None]
        self.head_index = torch.arange(kv_storage.shape[3], device=device)[:, None]
        self.write_slots = torch.zeros(batch_size, 0, dtype=torch.long, device=device)
        # Host-side upper bound of max(cache_lens): room checks read the device only near capacity.
        self._len_bound = 0
        super().__init__(layers=[SpecKVLayer(self, i, window) for i, window in enumerate(windows)])
        self._bind(batch_size)

    def _sibling(self, kv_storage: torch.Tensor, lens_storage: torch.Tensor) -> "SpecKVCache":
        """A cache of this one's kind (model type, layer windows) over other storage."""
        sibling = object.__new__(type(self))
        sibling.model_type = self.model_type
        sibling._setup(kv_storage, lens_storage, [layer.sliding_window for layer in self.layers])
        return sibling

    @property
    def max_cache_len(self) -> int:
        return self.kv.shape[4]

    @property
    def capacity(self) -> int:
        """Sequences the storage holds (the largest batch `resize` accepts)."""
        return self._kv_storage.shape[2]

    def _bind(self, batch_size: int) -> None:
        """Point `kv`, `cache_lens` and every layer at the storage's first `batch_size` rows."""
        self.kv = self._kv_storage[:, :, :batch_size]
        self.cache_lens = self._lens_storage[:batch_size]
        self.batch_index = self._index_storage[:batch_size]
        for index, layer in enumerate(self.layers):
            layer.keys, layer.values = self.kv[index, 0], self.kv[index, 1]
            layer.batch_size = batch_size
        # Batch size and capacity vary between calls: compiled steps treat them as symbols.
        for tensor, dims in (
            (self.cache_lens, (0,)),
            (self.batch_index, (0,)),
            (self._kv_storage, (4,)),
        ):
            for dim in dims:
                torch._dynamo.maybe_mark_dynamic(tensor, dim)
        # The storage's rows too, but unbacked: a backed size is specialised when it is 1, so a
        # batch-1 step compiled over a one-row storage compiled again over the rows that a wider
        # call left (tens of seconds on a CPU, per step kind). Steps slice the live rows after
        # `torch._check`ing that they fit (`SpecKVLayer.update`).
        torch._dynamo.decorators.mark_unbacked(self._kv_storage, 2)

    def fits(self, batch_size: int, max_cache_len: int, dtype: torch.dtype) -> bool:
        """Whether `resize(batch_size)` can serve sequences of `max_cache_len` slots in `dtype`."""
        return (
            batch_size <= self.capacity
            and max_cache_len <= self.max_cache_len
            and dtype == self._kv_storage.dtype
        )

    def resize(self, batch_size: int) -> None:
        """Serve `batch_size` (<= `capacity`) new sequences: every length is reset to zero."""
        if not 1 <= batch_size <= self.capacity:
            raise ValueError(f"batch_size: expected 1 to {self.capacity}, got {batch_size}")
        self._bind(batch_size)
        self.reset()

    def ensure_room(self, num_new: int) -> None:
        """Check that every sequence has room for `num_new` more tokens; raise ValueError if not.

        Call it before a forward that writes `num_new` tokens per sequence: it raises before any
        write. It assumes the committed lengths then grow by at most `num_new` (a verify step
        followed by one compaction does), which keeps the host-side bound valid without a sync.
        """
        if self._len_bound + num_new > self.max_cache_len:
            self._len_bound = int(self.cache_lens.max())
            if self._len_bound + num_new > self.max_cache_len:
                raise ValueError(
                    f"KV cache overflow: {num_new} new tokens on top of {self._len_bound} cached "
                    f"ones exceed the capacity max_cache_len = {self.max_cache_len}"
                )
        self._len_bound += num_new

    def has_room(self, num_new: int) -> bool:
        """Whether `ensure_room(num_new)` passes on the host-side bound alone (no device read)."""
        return self._len_bound + num_new <= self.max_cache_len

    def bound_lengths(self, max_length: int) -> None:
        """Tell the cache the longest committed length, known on the host (the engine tracks
        every row's length): room checks then never need to read the device."""
        self._len_bound = max_length

    def prepare_write(self, num_new: int) -> None:
        """Set `write_slots` to `cache_lens[b] + i`, i < `num_new` (device ops only)."""
        offsets = torch.arange(num_new, device=self.cache_lens.device)
        self.write_slots = self.cache_lens[:, None].long() + offsets

    def commit_lengths(self, lengths: torch.Tensor, max_length: int) -> None:
        """Set `cache_lens` (in place) to `lengths` (int `[B]`), whose maximum is `max_length`."""
        self.cache_lens.copy_(lengths)
        self._len_bound = max_length

    def compact(
        self, accepted_nodes: torch.Tensor, num_accepted: torch.Tensor, *, validate: bool = True
    ) -> None:
        """Keep the accepted path of the last verify step and advance `cache_lens` (on the device).

        Args:
            accepted_nodes: int32 `[B, N]`, the accepted node indices, root first, then -1.
            num_accepted: int32 `[B]`, accepted non-root nodes.
            validate: check the path values (a device read on CUDA). The engine passes False for
                paths that `kernels.verify` made, and then skips the argument checks too.
        """
        if validate:
            kv_compact(self.kv, self.cache_lens, accepted_nodes, num_accepted)
        else:
            run_kv_compact(self.kv, self.cache_lens, accepted_nodes, num_accepted)

    def select(self, rows: Sequence[int]) -> None:
        """Keep only the sequences `rows` (indices into the batch, in that order), moved to the
        front of the storage in place.

        Only the rows whose position changes move, and only their first `_len_bound` slots
        (the host's bound of every committed length): a row leaving a batch of long contexts
        costs a copy of what the rows behind it hold, not of the whole storage.
        """
        rows = [int(row) for row in rows]
        count = len(rows)
        first = next((i for i, row in enumerate(rows) if row != i), count)
        if first < count:
            moving = to_device(rows[first:], self.kv.device)
            held = min(self._len_bound, self.max_cache_len)
            # The gather copies before the assignment writes, so overlapping moves are safe.
            self._kv_storage[:, :, first:count, :, :held] = self.kv[:, :, moving, :, :held]
            self._lens_storage[first:count] = self.cache_lens[moving]
            self.write_slots = self.write_slots[to_device(rows, self.kv.device)]
        else:
            self.write_slots = self.write_slots[:count]
        self._bind(count)

    def rows(self, start: int, count: int) -> "SpecKVCache":
        """A cache over the storage rows `[start, start + count)`, sharing this cache's storage:
        a forward through it writes those rows, and its `cache_lens` are theirs.

        Continuous batching fills sequences that join a running batch this way, in rows past the
        batch's end (`start >= B`), while the batch's own rows keep their contents; `admit` then
        takes them into the batch. The view's length bound starts at 0: commit its lengths
        (`commit_lengths`) before a forward over it."""
        if start < 0 or count < 1 or start + count > self.capacity:
            raise ValueError(
                f"rows: expected 0 <= start and 1 <= count with start + count <= capacity = "
                f"{self.capacity}, got start={start}, count={count}"
            )
        return self._sibling(
            self._kv_storage[:, :, start : start + count], self._lens_storage[start : start + count]
        )

    def admit(self, start: int, count: int, max_length: int) -> None:
        """The storage rows `[start, start + count)` (filled through `rows`) join the batch at its
        end, in order, with their committed lengths; rows past the batch's end are moved down
        first (only their `max_length` committed slots are copied). `max_length`: the longest
        of their committed lengths, known on the host."""
        batch = self.kv.shape[2]
        if start < batch or count < 1 or start + count > self.capacity:
            raise ValueError(
                f"admit: expected rows past the batch of {batch} within the capacity "
                f"{self.capacity}, got start={start}, count={count}"
            )
        if start > batch:
            source = slice(start, start + count)
            # A copy of the source first: the two ranges may overlap.
            moved = self._kv_storage[:, :, source, :, :max_length].clone()
            self._kv_storage[:, :, batch : batch + count, :, :max_length] = moved
            self._lens_storage[batch : batch + count] = self._lens_storage[source].clone()
        self.write_slots = self.write_slots.new_zeros(batch + count, 0)
        self._bind(batch + count)
        self._len_bound = max(self._len_bound, max_length)

    def with_capacity(self, rows: int) -> "SpecKVCache":
        """A cache with storage for `rows` sequences (at least the batch's B) that holds this
        cache's batch (K/V and lengths copied): for a batch that outgrows its storage."""
        batch = self.kv.shape[2]
        if rows < max(batch, 1):
            raise ValueError(f"rows: expected at least the batch size {max(batch, 1)}, got {rows}")
        shape = list(self._kv_storage.shape)
        shape[2] = rows
        grown = self._sibling(self._kv_storage.new_zeros(shape), self._lens_storage.new_zeros(rows))
        grown._kv_storage[:, :, :batch] = self.kv
        grown._lens_storage[:batch] = self.cache_lens
        grown.select(list(range(batch)))
        grown._len_bound = self._len_bound
        return grown

    def reset(self) -> None:
        """Forget every committed token (the storage is kept as it is)."""
        self.cache_lens.zero_()
        self._len_bound = 0
