"""Smoke test of bench/bench_tree_attention.py at its CPU sizes: the dense-mask peer computes what
tree_attention computes, every case runs (ours under the interpreter), the script writes its table
and JSON, and the pytest-benchmark mode records groups, per-call figures and the environment."""

import pytest
import torch
import torch.nn.functional as F
from bench_smoke import (
    check_every_case_runs,
    check_pytest_benchmark_mode,
    check_script,
    import_bench,
)

from specdec_fast.kernels import pack_tree_mask, tree_attention


@pytest.fixture
def bench(monkeypatch):
    return import_bench(monkeypatch, "bench_tree_attention")


def test_dense_mask_peer_computes_tree_attention(bench, triton_backend):
    device = torch.device("cpu")
    shape = bench.shapes_for(device, quick=True)[0]
    q, k_cache, v_cache, cache_lens, tree = bench.make_inputs(shape, device)
    assert not torch.equal(tree, torch.ones_like(tree).tril())  # a branching tree, not a chain
    ours = tree_attention(q, k_cache, v_cache, cache_lens, pack_tree_mask(tree))
    mask = bench.dense_tree_mask(tree, shape.prefix)
    sdpa = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(ours, sdpa, rtol=1e-5, atol=1e-5)


def test_every_case_runs(bench, triton_backend):
    check_every_case_runs(bench, bench.peers_for(torch.device("cpu")))


def test_script_writes_table_and_json(tmp_path):
    header = "| shape | floor us | ours tree us | ours causal us | sdpa dense mask us |"
    check_script("tree_attention", tmp_path, header)


def test_pytest_benchmark_mode_records_groups_and_environment(bench, tmp_path):
    peers = bench.peers_for(torch.device("cpu"))
    check_pytest_benchmark_mode("tree_attention", tmp_path, "B1/L64/N8", len(peers))
