"""bench/bench_commits.py: two trees side by side. Run with this tree as both (one round, plain
decoding and n-gram, eager), its records pair the trees' runs and find equal outputs."""

import json

from bench_smoke import import_bench


def test_a_tree_against_itself_gives_equal_outputs(monkeypatch, tmp_path, capsys):
    bench = import_bench(monkeypatch, "bench_commits")
    tree = bench.Path(bench.__file__).resolve().parents[1]
    out = tmp_path / "commits.json"
    bench.main(
        ["--old", str(tree), "--new", str(tree), "--drafter", "none", "--drafter", "ngram:8",
         "--rounds", "2", "--tokens", "8", "--eager", "--json", str(out)]
    )  # fmt: skip
    records = json.loads(out.read_text())["records"]
    assert [r["drafter"] for r in records] == ["none", "ngram:8"]
    for record in records:
        assert record["outputs_equal"] and record["ratio"] > 0
        assert record["ratio_min"] <= record["ratio"] <= record["ratio_max"]
    assert records[1]["equals_plain"] is True
    assert "new/old" in capsys.readouterr().out


def test_sampled_runs_reach_the_workers(monkeypatch):
    """`--temperature` reaches a worker: plain decoding's outputs at temperature 1.5 differ from
    a greedy worker's, and the n-gram drafter's (deterministic proposals, the same seed) equal
    them."""
    bench = import_bench(monkeypatch, "bench_commits")
    tree = bench.Path(bench.__file__).resolve().parents[1]
    outputs = {}
    for temperature in (0.0, 1.5):
        args = ["--old", str(tree), "--tokens", "8", "--eager", "--temperature", str(temperature)]
        worker = bench.Worker(tree, bench.parse_args(args))
        try:
            outputs[temperature] = [worker.time(spec)["outputs"] for spec in ("none", "ngram:8")]
        finally:
            worker.close()
    assert outputs[0.0][0] != outputs[1.5][0]
    assert outputs[1.5][1] == outputs[1.5][0]
