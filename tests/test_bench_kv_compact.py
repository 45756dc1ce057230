"""Smoke test of bench/bench_kv_compact.py at its CPU sizes: the eager peer computes what the
reference computes, every case runs (kv_compact under the interpreter), the script writes its
table and JSON, and the pytest-benchmark mode records its groups."""

import pytest
import torch
from bench_smoke import (
    check_every_case_runs,
    check_pytest_benchmark_mode,
    check_script,
    import_bench,
)

from specdec_fast.kernels import kv_compact_reference


@pytest.fixture
def bench(monkeypatch):
    return import_bench(monkeypatch, "bench_kv_compact")


def test_eager_peer_matches_the_reference(bench):
    shape = bench.shapes_for(torch.device("cpu"), quick=True)[0]
    kv, cache_lens, accepted_nodes, num_accepted = bench.make_inputs(shape, torch.device("cpu"))
    expected, expected_lens = kv.clone(), cache_lens.clone()
    kv_compact_reference(expected, expected_lens, accepted_nodes, num_accepted)
    assert not torch.equal(expected, kv)
    width = shape.num_accepted + 1
    bench.eager_per_layer(kv, cache_lens, accepted_nodes[:, :width], num_accepted)
    torch.testing.assert_close(kv, expected, rtol=0, atol=0)
    torch.testing.assert_close(cache_lens, expected_lens, rtol=0, atol=0)


def test_every_case_runs(bench, triton_backend):
    check_every_case_runs(bench, bench.PEERS)


def test_script_writes_table_and_json(tmp_path):
    check_script("kv_compact", tmp_path, "| shape | floor us | kv_compact us | eager per layer")


def test_pytest_benchmark_mode(bench, tmp_path):
    shape = bench.shapes_for(torch.device("cpu"), quick=False)[0]
    check_pytest_benchmark_mode("kv_compact", tmp_path, shape.label, len(bench.PEERS))
