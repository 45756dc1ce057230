"""The end-to-end benchmarks run on the CPU at small sizes (random models), so CI keeps them
working (the GPU suite: test_gpu_suite.py)."""

import torch
from bench_smoke import import_bench


def test_bench_generate_compares_every_peer(monkeypatch):
    bench = import_bench(monkeypatch, "bench_generate")
    setup = bench.make_setup(quick=True, random=True, target=None, draft=None)
    setup.prompts = setup.prompts[:1]
    records = bench.run_all(setup)
    by_peer = {r.peer: r for r in records}
    assert set(by_peer) == set(bench.PEER_NAMES)
    # Every peer, ours and HF's, produced the same greedy tokens.
    assert all(r.identical for r in records)
    assert by_peer["ours plain"].speedup_vs_plain == 1.0
    assert by_peer["HF generate"].speedup_vs_hf == 1.0
    assert all(r.tokens_per_s > 0 for r in records)
    assert by_peer["ours draft k=4 (N=5)"].acceptance is not None
    table = import_bench(monkeypatch, "e2e").format_table(records)
    assert len(table.splitlines()) == 2 + len(records)


def test_random_prompts_are_deterministic(monkeypatch):
    bench = import_bench(monkeypatch, "bench_generate")
    assert bench.random_prompts(2, 10, 50) == bench.random_prompts(2, 10, 50)
    assert torch.tensor(bench.random_prompts(3, 10, 50)).max() < 50
