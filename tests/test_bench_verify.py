"""Smoke test of bench/bench_verify.py at its CPU sizes: the eager peers follow the contract
(checked at a temperature so low that sampling is greedy), every case runs, the script writes its
table, summary and JSON, and the pytest-benchmark mode records its groups."""

import json

import pytest
import torch
from bench_smoke import (
    check_every_case_runs,
    check_pytest_benchmark_mode,
    check_script,
    import_bench,
)

from specdec_fast.kernels import verify


@pytest.fixture
def bench(monkeypatch):
    return import_bench(monkeypatch, "bench_verify")


@pytest.mark.parametrize("kind", ("chain", "tree"))
def test_eager_peers_are_greedy_at_low_temperature(bench, kind):
    shape = next(s for s in bench.shapes_for(torch.device("cpu"), quick=True) if s.kind == kind)
    inputs = bench.make_inputs(shape, torch.device("cpu"))
    logits, tokens, parents = inputs["logits"], inputs["draft_tokens"], inputs["parents"]
    if kind == "chain":  # sampled drafts rarely match the argmax: make the first two match
        tokens[:, 1:3] = logits[:, :2].argmax(dim=-1)
    expected = verify(logits, tokens, parents)
    assert int(expected.num_accepted.max()) >= 1
    if kind == "chain":
        got = bench.eager_chain(logits, tokens, inputs["draft_probs"], 1e-4)
    else:
        got = bench.eager_tree(logits, tokens, parents, 1e-4, shape.depth)
    for value, want in zip(got, expected, strict=True):
        assert torch.equal(value.long(), want.long())


def test_every_case_runs(bench):
    shapes = bench.shapes_for(torch.device("cpu"), quick=True)
    check_every_case_runs(
        bench, {peer for s in shapes for peer in bench.peers_for(s, torch.device("cpu"))}
    )


def test_script_writes_table_summary_and_json(tmp_path):
    check_script("verify", tmp_path, "| shape | floor us | verify us | eager torch us")
    summary = json.loads((tmp_path / "verify.json").read_text())["summary"]
    assert {row["shape"] for row in summary} == {"chain/K3/B2/V500", "tree/N16/B2/V500"}
    assert all(row["speedup"]["eager torch"] > 0 for row in summary)


def test_pytest_benchmark_mode(bench, tmp_path):
    shape = bench.shapes_for(torch.device("cpu"), quick=False)[0]
    check_pytest_benchmark_mode("verify", tmp_path, shape.label, len(bench.PEERS))
