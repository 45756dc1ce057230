"""KV compaction: `kv_compact` (one launch) against eager torch, per layer and all at once.

The GPU shape is ANCHORS.md's: 32 layers, 8 KV heads, head dim 128, bf16, a 64-node tree after a
4096-token prefix, 5 accepted nodes of which none already sits in place (so all 5 move). Target on
an H200: B32 <= 25 us. The floor moves the accepted rows once (read + write) at the measured copy
bandwidth. Inputs are drawn on the device.

Peers:
- `kv_compact`: the public op with `validate=False`, as the engine calls it (Triton on CUDA, the
  configured backend elsewhere);
- `eager per layer`: per layer, K and V, one gather and one scatter of the positions up to the
  longest path (known when the case is built, which spares the peer a host read);
- `torch reference`: `kv_compact_reference`, one gather and one scatter of all N positions;
- `lengths reset`: `cache_lens.copy_(...)` alone. Every peer advances `cache_lens`, so every timed
  call also resets it to keep the work identical from call to call; subtract this column.

Run as `pytest bench/bench_kv_compact.py --benchmark-only` or `python bench/bench_kv_compact.py`
(`--quick`, `--json PATH`). On a CPU it runs the same code at small sizes.
"""

from dataclasses import dataclass

import pytest
import torch
from common import Case, bench_device, device_generator, main, run_in_pytest

from specdec_fast.kernels import kv_compact, kv_compact_reference
from specdec_fast.kernels.reference.kv_compact import path_slots


@dataclass(frozen=True)
class Shape:
    batch: int
    num_layers: int
    num_heads: int
    head_dim: int
    prefix: int
    num_nodes: int
    num_accepted: int
    dtype: torch.dtype = torch.bfloat16

    @property
    def label(self) -> str:
        return f"B{self.batch}/L{self.prefix}/N{self.num_nodes}/acc{self.num_accepted}"

    @property
    def moved_bytes(self) -> int:
        """Bytes read plus written by the accepted rows, every layer, K and V."""
        element_size = torch.empty((), dtype=self.dtype).element_size()
        row = self.num_layers * 2 * self.num_heads * self.head_dim * element_size
        return 2 * self.batch * self.num_accepted * row


def shapes_for(device: torch.device, quick: bool) -> list[Shape]:
    if device.type == "cuda":
        batches = (1, 32) if quick else (1, 8, 32)
        return [Shape(batch, 32, 8, 128, 4096, 64, 5) for batch in batches]
    batches = (3,) if quick else (1, 4)
    return [Shape(batch, 4, 2, 32, 48, 16, 5) for batch in batches]


def make_inputs(shape: Shape, device: torch.device, seed: int = 0):
    """(kv, cache_lens, accepted_nodes, num_accepted), drawn on `device` (B32's cache is 17 GB
    of bf16: drawn on the host it took minutes); the tree's N nodes follow the prefix; each path
    takes num_accepted random nodes from 2..N-1, so no position is already in place."""
    draw = dict(generator=device_generator(device, seed), device=device)
    max_len = shape.prefix + shape.num_nodes
    kv = torch.randn(
        (shape.num_layers, 2, shape.batch, shape.num_heads, max_len, shape.head_dim),
        dtype=shape.dtype,
        **draw,
    )
    cache_lens = torch.full((shape.batch,), shape.prefix, dtype=torch.int32, device=device)
    # num_accepted distinct nodes from 2..N-1 per row, sorted: the lowest random keys' ranks.
    keys = torch.rand(shape.batch, shape.num_nodes - 2, **draw)
    nodes = keys.argsort(dim=1)[:, : shape.num_accepted].sort(dim=1).values + 2
    accepted_nodes = torch.full(
        (shape.batch, shape.num_nodes), -1, dtype=torch.int32, device=device
    )
    accepted_nodes[:, 0] = 0
    accepted_nodes[:, 1 : shape.num_accepted + 1] = nodes.int()
    num_accepted = torch.full((shape.batch,), shape.num_accepted, dtype=torch.int32, device=device)
    return kv, cache_lens, accepted_nodes, num_accepted


def eager_per_layer(kv, cache_lens, accepted_nodes, num_accepted) -> None:
    """The eager peer: 2 x num_layers gathers and scatters of `[B, Hkv, width, D]` rows, where
    width = accepted_nodes.shape[1] (the caller trims it to the longest path)."""
    sequence, target, source = path_slots(cache_lens, accepted_nodes, num_accepted)
    for layer_cache in kv.flatten(0, 1):
        layer_cache[sequence, :, target] = layer_cache[sequence, :, source]
    cache_lens += num_accepted + 1


def _with_reset(compact, kv, cache_lens, accepted_nodes, num_accepted):
    start_lens = cache_lens.clone()

    def step() -> None:
        compact(kv, cache_lens, accepted_nodes, num_accepted)
        cache_lens.copy_(start_lens)

    return step


def _builder(shape: Shape, device: torch.device, peer: str):
    def build():
        kv, cache_lens, accepted_nodes, num_accepted = make_inputs(shape, device)
        if peer == "kv_compact":
            return _with_reset(
                lambda *args: kv_compact(*args, validate=False),
                kv,
                cache_lens,
                accepted_nodes,
                num_accepted,
            )
        if peer == "eager per layer":
            width = shape.num_accepted + 1
            trimmed = accepted_nodes[:, :width]
            return _with_reset(eager_per_layer, kv, cache_lens, trimmed, num_accepted)
        if peer == "torch reference":
            return _with_reset(kv_compact_reference, kv, cache_lens, accepted_nodes, num_accepted)
        start_lens = cache_lens.clone()
        return lambda: cache_lens.copy_(start_lens)

    return build


PEERS = ("kv_compact", "eager per layer", "torch reference", "lengths reset")


def cases_for(device: torch.device, quick: bool) -> list[Case]:
    return [
        Case(shape.label, peer, _builder(shape, device, peer), shape.moved_bytes)
        for shape in shapes_for(device, quick)
        for peer in PEERS
    ]


CASES = cases_for(bench_device(), quick=False)


@pytest.mark.parametrize("case", CASES, ids=[f"{case.shape}-{case.peer}" for case in CASES])
def test_kv_compact(benchmark, case):
    run_in_pytest(benchmark, case)


if __name__ == "__main__":
    main("kv_compact", "KV compaction: kv_compact against eager torch", cases_for)
