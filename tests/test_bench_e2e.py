"""The end-to-end benchmarks run on the CPU at small sizes (random models), so CI keeps them
working (the GPU suite: test_gpu_suite.py)."""

import os

import pytest
import torch
from bench_smoke import import_bench
from tiny_models import first_layers, repetitive_prompts, tiny_llama

from specdec_fast import NGramDrafter, bundled
from specdec_fast.loading import load_model, load_tokenizer


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


def test_interleave_runs_peers_in_turns_and_keeps_medians(monkeypatch):
    """Rounds run every peer once, in an order rotated by one each round; only a peer's first
    call warms up; a record keeps the median round's figures and every round's tokens/s, and is
    not repeatable when a round emitted other tokens."""
    e2e = import_bench(monkeypatch, "e2e")
    calls = []
    speeds = {"a": iter([10.0, 30.0, 20.0]), "b": iter([5.0, 4.0, 6.0]), "c": iter([1.0] * 3)}
    emitted = {"a": iter([[[1]]] * 3), "b": iter([[[1]]] * 3), "c": iter([[[1]], [[2]], [[1]]])}

    def peer(name):
        def run(warm_up):
            calls.append((name, warm_up))
            speed = next(speeds[name])
            return e2e.E2ERecord(name, 1, 100, 100 / speed, speed), next(emitted[name])

        return run

    records, outputs = e2e.interleave({n: peer(n) for n in "abc"}, 3, lambda line: None)
    assert [name for name, _ in calls] == list("abcbcacab")
    assert [warm for _, warm in calls] == [True] * 3 + [False] * 6
    a, b, c = records
    assert (a.peer, a.tokens_per_s, a.seconds, a.round_tokens_per_s) == (
        "a",
        20.0,
        5.0,
        [10, 30, 20],
    )
    assert (b.tokens_per_s, b.round_tokens_per_s) == (5.0, [5.0, 4.0, 6.0])
    assert a.repeatable and b.repeatable and not c.repeatable
    assert outputs == {"a": [[1]], "b": [[1]], "c": [[1]]}
    e2e.compare(records, outputs | {"ours plain": [[1]]})
    assert a.identical and b.identical and not c.identical
    assert a.identical_to_plain and not c.identical_to_plain
    # c is repeatable in neither sense, yet its first round's tokens equal the reference's.
    assert a.first_difference is None and c.first_difference is None
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        e2e.interleave({"a": peer("a")}, 0)


def test_first_difference_over_prompts(monkeypatch):
    e2e = import_bench(monkeypatch, "e2e")
    reference = [[1, 2, 3, 4], [5, 6, 7]]
    assert e2e.first_difference(reference, reference) is None
    assert e2e.first_difference([[1, 2, 9, 4], [5, 6, 7]], reference) == 2
    assert e2e.first_difference([[1, 2, 9, 4], [5, 0, 7]], reference) == 1
    assert e2e.first_difference([[1, 2, 3], [5, 6, 7]], reference) == 3  # stopped early
    assert e2e.first_difference([[1, 2, 3, 4, 8], [5, 6, 7]], reference) == 4


def test_speedups_are_medians_of_paired_round_ratios(monkeypatch):
    """A slow round slows both sides of its ratio: the median of per-round ratios, not the ratio
    of medians (which would read 1.5x here, against 2x in every round)."""
    e2e = import_bench(monkeypatch, "e2e")

    def record(peer, rounds):
        return e2e.E2ERecord(peer, 1, 10, 1.0, 0.0, round_tokens_per_s=rounds)

    fast, plain = record("fast", [20.0, 40.0, 60.0]), record("ours plain", [10.0, 20.0, 30.0])
    fast.tokens_per_s, plain.tokens_per_s = 60.0, 20.0  # medians of other rounds' order
    assert e2e.paired_ratio(fast, plain) == 2.0
    single = e2e.E2ERecord("one", 1, 10, 1.0, 30.0)
    assert single.round_tokens_per_s == [30.0]
    assert e2e.paired_ratio(single, plain) == 1.5


def test_tiny_ranks_the_fastest_block_drafter_against_the_others(monkeypatch):
    bench = import_bench(monkeypatch, "bench_e2e_tiny")
    record = import_bench(monkeypatch, "e2e").E2ERecord
    grid = {
        "ours plain": bench.Cell(lambda: None, None, 1),
        "ngram N=8": bench.Cell(lambda: None, "ngram", 8),
        "eagle N=16": bench.Cell(lambda: None, "eagle", 16),
        "block:pard N=16": bench.Cell(lambda: None, "block", 16),
        "block:dflash N=8": bench.Cell(lambda: None, "block", 8),
    }
    speeds = {
        "ours plain": [100.0, 90.0],
        "ngram N=8": [80.0, 90.0],
        "eagle N=16": [50.0, 50.0],
        "block:pard N=16": [88.0, 72.0],
        "block:dflash N=8": [60.0, 60.0],
        "HF generate": [200.0, 200.0],
    }
    records = [
        record(peer, 1, 10, 1.0, sum(tps) / 2, round_tokens_per_s=tps)
        for peer, tps in speeds.items()
    ]
    assert bench.block_vs_other_drafters(records, grid) == [
        "- block:pard N=16: 80.0 tokens/s, 0.95x the fastest other drafter, ngram N=8 (85.0)",
        "- block:pard N=16: 0.84x ours plain (95.0); ngram N=8: 0.90x",
    ]
    assert bench.block_vs_other_drafters(records[:3], grid) == []


@pytest.mark.skipif(
    "tiny-code-dflash" not in bundled.available(), reason="needs the bundled DFlash head"
)
def test_tiny_grid_adds_float32_dflash_heads_beside_the_default(monkeypatch):
    """`--float32-heads`: each DFlash head again, computing in float32, beside its default."""
    bench = import_bench(monkeypatch, "bench_e2e_tiny")
    target = load_model("tiny-code", torch.device("cpu"))
    grid = bench.drafter_grid(target, True, (8,), ["block"], float32_heads=True)
    ablation = grid["block:tiny-code-dflash N=8 [float32 head]"]
    assert ablation.kind == "block" and ablation.nodes == 8
    assert ablation.make().model.fc.weight.dtype == torch.float32
    assert not any("pard" in name and "float32" in name for name in grid)
    assert bench.drafter_grid(target, True, (8,), ["block"]).keys() < grid.keys()


@pytest.mark.slow
@pytest.mark.skipif("tiny-code" not in bundled.available(), reason="needs the bundled target")
def test_bench_freeze_runs_both_settings_side_by_side(monkeypatch, tmp_path):
    """bench_freeze: the frozen and unfrozen targets' runners run as set (it raises otherwise),
    their outputs equal plain decoding's, and each cell gets its paired ratio."""
    bench = import_bench(monkeypatch, "bench_freeze")
    monkeypatch.delenv("SPECDEC_FREEZE", raising=False)
    # Frozen compiles are slow: plain decoding and one drafter, on one prompt, over the bundled
    # target cut to its first layer (`--model`: each layer's graph lowers on its own).
    first_layers(load_model("tiny-code", torch.device("cpu")), 1).save_pretrained(tmp_path)
    load_tokenizer("tiny-code").save_pretrained(tmp_path)
    records = bench.run(["plain", "ngram:4"], 1, 6, 1, model=str(tmp_path))
    assert [r["cell"] for r in records] == ["plain", "ngram:4"]
    assert all(r["identical"] and r["paired_ratio"] > 0 for r in records)
    assert "SPECDEC_FREEZE" not in os.environ
    with pytest.raises(SystemExit, match="tiny-code heads"):
        bench.run(["plain", "dflash:8"], 1, 6, 1, model=str(tmp_path))
    assert len(bench.table(records).splitlines()) == 2 + len(records)


def test_served_runs_give_our_outputs_and_statistics(monkeypatch):
    """`run_served` (the scheduler, one request at a time, with and without read-ahead) gives
    `run_ours`'s tokens and per-step figures for the same drafter."""
    e2e = import_bench(monkeypatch, "e2e")
    target = tiny_llama(vocab_size=96)
    prompts = repetitive_prompts([5, 9], 96, seed=1)
    make = lambda: NGramDrafter(max_nodes=4)  # noqa: E731
    ours, outputs = e2e.run_ours("ours", target, prompts, make, 12, 1, warm_up=False)
    for read_ahead in (True, False):
        record, served = e2e.run_served(
            "served", target, prompts, make, 12, options={"read_ahead": read_ahead}
        )
        assert served == outputs
        assert (record.new_tokens, record.tokens_per_step) == (24, ours.tokens_per_step)
        assert record.batch == 1 and record.tokens_per_s > 0
