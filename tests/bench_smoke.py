"""Checks shared by the benchmark smoke tests: a bench/bench_<op>.py module runs every case at its
CPU sizes, as a script (table and JSON) and under pytest-benchmark (groups, per-call figures and
the environment in the JSON)."""

import importlib
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import torch

ROOT = Path(__file__).resolve().parents[1]
BENCH_DIR = ROOT / "bench"


def import_bench(monkeypatch, name: str) -> ModuleType:
    """bench/ is not a package: its modules import `common` from their own folder."""
    monkeypatch.syspath_prepend(str(BENCH_DIR))
    return importlib.import_module(name)


def check_every_case_runs(bench: ModuleType, peers) -> None:
    """Every quick CPU case of `bench` builds and times without error; the table has a row per
    shape."""
    common = importlib.import_module("common")
    device = torch.device("cpu")
    cases = bench.cases_for(device, quick=True)
    records = [common.run_case(case, device, reps=2) for case in cases]
    assert [record.error for record in records] == [None] * len(cases)
    assert {record.peer for record in records} == set(peers)
    assert all(record.median_us > 0 and record.floor_us > 0 for record in records)
    table = common.format_peer_table(records)
    assert len(table.splitlines()) == 2 + len(bench.shapes_for(device, quick=True))


def check_script(name: str, tmp_path: Path, header: str) -> None:
    """`python bench/bench_<name>.py --quick --json PATH` prints the table and writes the JSON."""
    path = tmp_path / f"{name}.json"
    result = subprocess.run(
        [sys.executable, str(BENCH_DIR / f"bench_{name}.py"), "--quick", "--json", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert header in result.stdout
    payload = json.loads(path.read_text())
    assert payload["benchmark"] == name
    assert {"date", "gpu", "torch", "triton", "transformers"} <= set(payload["environment"])
    assert payload["environment"]["copy_bandwidth_GBps"] > 0
    assert all(record["error"] is None for record in payload["results"])


def check_pytest_benchmark_mode(name: str, tmp_path: Path, shape: str, num_peers: int) -> None:
    """`pytest bench/bench_<name>.py --benchmark-only -k SHAPE` groups the peers of the shape,
    records per-call medians and the environment, and prints the peer table."""
    path = tmp_path / "pytest_bench.json"
    result = subprocess.run(
        [
            str(Path(sys.executable).with_name("pytest")),
            str(BENCH_DIR / f"bench_{name}.py"),
            "--benchmark-only",
            f"--benchmark-json={path}",
            "-k",
            shape,
            "-q",
            "-p",
            "no:cacheprovider",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "peer table (CPU)" in result.stdout
    payload = json.loads(path.read_text())
    environment = payload["machine_info"]["specdec_bench"]
    assert {"date", "gpu", "torch", "triton", "transformers"} <= set(environment)
    benchmarks = payload["benchmarks"]
    assert len(benchmarks) == num_peers and {entry["group"] for entry in benchmarks} == {shape}
    assert all(entry["extra_info"]["median_us"] > 0 for entry in benchmarks)
