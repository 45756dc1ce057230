"""Smoke test of bench/bench_tree_attention.py at its CPU sizes: on a plain, a windowed and a
soft-capped shape the exact peers (and the 128-row tiling) compute what tree_attention computes,
every case runs (ours under the interpreter), the script writes its table and JSON, and the
pytest-benchmark mode records groups, per-call figures and the environment."""

import dataclasses

import pytest
import torch
from bench_smoke import (
    check_every_case_runs,
    check_pytest_benchmark_mode,
    check_script,
    import_bench,
)

from specdec_fast.kernels import tree_attention

CPU = torch.device("cpu")


@pytest.fixture
def bench(monkeypatch):
    return import_bench(monkeypatch, "bench_tree_attention")


def test_exact_peers_compute_tree_attention(bench, triton_backend):
    """SDPA with the dense mask (over the window's slots, with a window) or, soft-capped, the
    eager path gives `ours tree`'s output on every quick shape."""
    shapes = bench.shapes_for(CPU, quick=True)
    assert {shape.window is None for shape in shapes} == {True, False}
    assert {shape.softcap is None for shape in shapes} == {True, False}
    cases = {(case.shape, case.peer): case for case in bench.cases_for(CPU, quick=True)}
    for shape in shapes:
        tree = bench.make_inputs(shape, CPU)[-1]
        assert not torch.equal(tree, torch.ones_like(tree).tril())  # branching, not a chain
        ours = cases[shape.label, "ours tree"].build()()
        exact = "sdpa dense mask" if shape.softcap is None else "eager dense mask"
        peer = cases[shape.label, exact].build()()
        torch.testing.assert_close(ours, peer, rtol=1e-5, atol=1e-5, msg=shape.label)
        if shape.compare_rows:  # the same kernel on 128-row blocks
            rows128 = cases[shape.label, bench.ROWS_128].build()()
            torch.testing.assert_close(ours, rows128, rtol=1e-5, atol=1e-5, msg=shape.label)
    assert any(shape.compare_rows for shape in shapes)


def test_features_change_the_output_and_the_floor(bench):
    """The tiny window hides keys and the tiny cap changes the scores (the cases measure the
    features), and the floor counts only the prefix keys inside the window."""
    cases = {(case.shape, case.peer): case for case in bench.cases_for(CPU, quick=True)}
    featured = [s for s in bench.shapes_for(CPU, quick=True) if s.window or s.softcap]
    for shape in featured:
        plain = dataclasses.replace(shape, window=None, softcap=None)
        q, k_cache, v_cache, cache_lens, _ = bench.make_inputs(shape, CPU)
        out = cases[shape.label, "ours causal"].build()()
        assert (out - tree_attention(q, k_cache, v_cache, cache_lens)).abs().max() > 1e-3
        visible = shape.prefix if shape.window is None else shape.window - 1
        assert shape.prefix_bytes * shape.prefix == plain.prefix_bytes * visible


def test_every_case_runs(bench, triton_backend):
    shapes = bench.shapes_for(CPU, quick=True)
    check_every_case_runs(bench, {peer for s in shapes for peer in bench.peers_for(s, CPU)})


def test_script_writes_table_and_json(tmp_path):
    header = "| shape | floor us | ours tree us | ours tree, 128-row blocks us | ours causal us |"
    check_script("tree_attention", tmp_path, header)


def test_pytest_benchmark_mode_records_groups_and_environment(bench, tmp_path):
    shape = bench.shapes_for(CPU, quick=False)[0]
    peers = bench.peers_for(shape, CPU)
    check_pytest_benchmark_mode("tree_attention", tmp_path, shape.label, len(peers))
