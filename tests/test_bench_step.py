"""bench/bench_step.py: the floor arithmetic on the 8B shape (built on the meta device, nothing
allocated), the target verdicts, and the script's tiny CPU run end to end (table and JSON)."""

import json
import math
import subprocess
import sys

import pytest
import torch
from bench_smoke import BENCH_DIR, import_bench
from transformers import LlamaForCausalLM

LLAMA_8B_BYTES = 16_060_522_496  # ANCHORS.md: 16.06 GB of bf16 weights
EMBEDDING_BYTES = 128256 * 4096 * 2


@pytest.fixture
def bench(monkeypatch):
    return import_bench(monkeypatch, "bench_step")


def meta_model(bench, **overrides) -> LlamaForCausalLM:
    with torch.device("meta"):
        config = bench.llama_config({**bench.LLAMA_8B, **overrides})
        return LlamaForCausalLM._from_config(config, dtype=torch.bfloat16)


def test_floor_counts_the_8b_shape(bench):
    fp = bench.footprint(meta_model(bench))
    # Every weight but the input embedding, which a step reads B * N rows of.
    assert fp.fixed_bytes == LLAMA_8B_BYTES - EMBEDDING_BYTES
    assert fp.row_bytes == 4096 * 2
    norms = 32 * 2 * 4096 + 4096
    assert fp.matmul_params == (LLAMA_8B_BYTES - EMBEDDING_BYTES) // 2 - norms
    assert fp.kv_token_bytes == 32 * 2 * 8 * 128 * 2

    cost = fp.step(batch=8, context=4096, nodes=64)
    tokens = 8 * 64
    assert cost.weight_bytes == fp.fixed_bytes + tokens * 8192
    assert cost.kv_bytes == 8 * (4096 + 64) * 32 * 2 * 8 * 128 * 2
    assert cost.logits_bytes == tokens * 128256 * 4
    assert cost.flops == 2 * fp.matmul_params * tokens + 4 * tokens * 32 * 128 * 4096 * 32
    assert cost.total_bytes == cost.weight_bytes + cost.kv_bytes + cost.logits_bytes
    # The decode floor of ANCHORS.md, less the embedding: 15.01 GB, 3.80 ms at 3.95 TB/s.
    assert fp.step(1, 0, 1).weight_bytes / 3.95e12 == pytest.approx(3.80e-3, rel=1e-3)


def test_tied_embedding_is_read_whole(bench):
    fp = bench.footprint(meta_model(bench, tie_word_embeddings=True))
    assert fp.fixed_bytes == LLAMA_8B_BYTES - EMBEDDING_BYTES  # lm_head is the embedding
    assert fp.row_bytes == 0


def record(bench, nodes: int, median_ms: float, floor_ms: float):
    cost = bench.StepCost(weight_bytes=1, kv_bytes=0, logits_bytes=0, flops=0)
    return bench.StepRecord(
        bench.OURS, 1, 1024, nodes, cost, floor_ms, floor_ms, 0.0, median_ms, median_ms, median_ms
    )


@pytest.mark.parametrize(
    ("decode_ms", "verify_ms", "verify_floor_ms", "verdicts"),
    [
        (4.5, 5.5, 4.0, ("pass", "pass")),
        (5.0, 6.5, 4.0, ("fail", "fail")),
        (4.5, 9.0, 8.0, ("pass", "unreachable (floor 8.00 ms > 1.25 x 4.50 ms)")),
    ],
)
def test_target_verdicts(bench, decode_ms, verify_ms, verify_floor_ms, verdicts):
    records = [record(bench, 1, decode_ms, 4.0), record(bench, 64, verify_ms, verify_floor_ms)]
    bench.compare(records)
    assert records[1].vs_decode == pytest.approx(verify_ms / decode_ms)
    targets = bench.check_targets(records)
    assert [t["target"] for t in targets] == [
        "decode <= 1.2x floor",
        "verify N=64 <= 1.25x decode",
    ]
    assert tuple(t["verdict"] for t in targets) == verdicts


def test_tiny_run_writes_table_and_json(tmp_path):
    path = tmp_path / "step.json"
    result = subprocess.run(
        [sys.executable, str(BENCH_DIR / "bench_step.py"), "--tiny", "--json", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "these numbers mean nothing" in result.stdout
    assert "| target | shape | ratio | verdict |" in result.stdout
    payload = json.loads(path.read_text())
    assert payload["benchmark"] == "bench_step"
    environment = payload["environment"]
    assert {"date", "gpu", "torch", "triton", "transformers"} <= set(environment)
    assert environment["copy_bandwidth_GBps"] > 0
    assert payload["setup"]["tiny"] and payload["setup"]["units"] == "milliseconds per step"
    results = payload["results"]
    peers = [(r["peer"], r["batch"], r["nodes"]) for r in results]
    hf = "HF static cache, eager"
    assert peers == [
        ("ours", 1, 1),
        ("ours", 1, 8),
        (hf, 1, 1),
        ("ours", 3, 1),
        ("ours", 3, 8),
        (hf, 3, 1),
    ]
    for r in results:
        assert r["error"] is None
        times = (r["min_ms"], r["median_ms"], r["max_ms"])
        assert all(math.isfinite(t) and t > 0 for t in times) and sorted(times) == list(times)
        assert r["floor_ms"] > 0 and r["weights_floor_ms"] > 0 and r["vs_floor"] > 0
        assert r["cost"]["flops"] > 0
    assert all(r["hf_vs_ours"] > 0 for r in results if r["peer"] == hf)
    assert all(r["vs_decode"] > 0 for r in results if r["nodes"] == 8)
    assert [t["verdict"] in ("pass", "fail") for t in payload["targets"]] == [True] * 4
