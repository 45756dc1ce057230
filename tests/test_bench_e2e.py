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


def test_tiny_acceptance_plot_and_block_comparison(monkeypatch, tmp_path):
    """bench_e2e_tiny's plot of the EAGLE and block drafters at one budget, and the line that
    compares the best block drafter's tokens per step with each EAGLE head's."""
    bench = import_bench(monkeypatch, "bench_e2e_tiny")
    record = import_bench(monkeypatch, "e2e").E2ERecord

    def cell(kind, nodes):
        return bench.Cell(lambda: None, kind, nodes)

    grid = {
        "eagle:tiny-code-eagle N=16": cell("eagle", 16),
        "block:tiny-code-dflash N=16": cell("block", 16),
        "block:tiny-code-pard N=16": cell("block", 16),
        "block:tiny-code-pard N=8": cell("block", 8),
        "medusa:tiny-code-medusa N=16": cell("medusa", 16),
    }
    figures = {
        "eagle:tiny-code-eagle N=16": (3.0, [0.9, 0.6]),
        "block:tiny-code-dflash N=16": (4.2, [0.9, 0.8, 0.7]),
        "block:tiny-code-pard N=16": (3.6, [0.8, 0.7]),
        "block:tiny-code-pard N=8": (9.0, [1.0]),
        "medusa:tiny-code-medusa N=16": (2.0, [0.7]),
    }
    records = [
        record(peer, 1, 10, 1.0, 10.0, tokens_per_step=steps, per_position=positions)
        for peer, (steps, positions) in figures.items()
    ]
    lines = bench.block_vs_eagle(records, grid, 16)
    assert lines == [
        "- block:tiny-code-dflash N=16: 4.20 tokens/step, 1.40x eagle:tiny-code-eagle N=16 (3.00)"
    ]
    path = bench.plot_acceptance(records, grid, 16, tmp_path / "acceptance.png")
    assert path.stat().st_size > 1000
    assert bench.plot_acceptance(records, grid, 32, tmp_path / "none.png") is None
    assert bench.block_vs_eagle(records, grid, 32) == []
