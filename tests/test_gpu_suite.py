"""bench/gpu_suite.py fits the device's limits: its dry run plays every part on the CPU with tiny
shapes and writes exactly two files (archive and summary), the quick plan is predicted under 8
minutes and each part's full plan under 4; a part that does not fit what is left of the budget
is skipped, and one that overruns its timeout is killed with its output kept.

The dry run (a minute and a half of subprocesses) starts when collection ends (`start_beside`,
called by conftest), one thread per process, on the core the single-threaded suite leaves idle;
its test waits for it and checks what it wrote."""

import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import pytest
from bench_smoke import BENCH_DIR, import_bench


@pytest.fixture
def suite(monkeypatch):
    return import_bench(monkeypatch, "gpu_suite")


def run_suite(tmp_path, *args):
    out = tmp_path / "out"
    out.mkdir()
    result = subprocess.run(
        [sys.executable, str(BENCH_DIR / "gpu_suite.py"), *args],
        capture_output=True,
        text=True,
        env={**os.environ, "OUT": str(out)},
        check=False,
    )
    return result, out


DRY_RUN_TEST = "test_dry_run_plays_every_part_and_predicts_the_quick_budget"
_beside: dict = {}


def start_beside(names: list[str]) -> None:
    """Start the quick dry run in a folder of its own when its test is selected."""
    if DRY_RUN_TEST not in names or _beside:
        return
    folder = Path(tempfile.mkdtemp(prefix="specdec-dry-run-"))
    (folder / "out").mkdir()
    environment = {**os.environ, "OUT": str(folder / "out"), "OMP_NUM_THREADS": "1"}
    _beside["folder"] = folder
    # Files, not pipes: nothing reads the output until the test runs.
    with (folder / "stdout").open("w") as stdout, (folder / "stderr").open("w") as stderr:
        _beside["process"] = subprocess.Popen(
            [sys.executable, str(BENCH_DIR / "gpu_suite.py"), "--dry-run", "--quick"],
            stdout=stdout,
            stderr=stderr,
            env=environment,
        )


def stop_beside() -> None:
    process = _beside.pop("process", None)
    if process is not None and process.poll() is None:
        process.kill()
        process.wait()
    folder = _beside.pop("folder", None)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


def test_dry_run_plays_every_part_and_predicts_the_quick_budget(suite):
    if "process" not in _beside:  # run on its own, outside a collected session
        start_beside([DRY_RUN_TEST])
    process, folder = _beside["process"], _beside["folder"]
    process.wait(timeout=1800)
    result = subprocess.CompletedProcess(
        process.args,
        process.returncode,
        (folder / "stdout").read_text(),
        (folder / "stderr").read_text(),
    )
    out = folder / "out"
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert sorted(path.name for path in out.iterdir()) == sorted([suite.ARCHIVE, suite.SUMMARY])
    summary = json.loads((out / suite.SUMMARY).read_text())
    assert [part["name"] for part in summary["parts"]] == list(suite.PARTS)
    assert all(part["status"] == "ok" for part in summary["parts"])
    estimates = summary["estimates_s"]
    assert sum(estimates.values()) < suite.QUICK_LIMIT_S
    assert all(0 < seconds < suite.PART_LIMIT_S for seconds in estimates.values())
    # The benchmarks' JSON results travel in the summary; logs and results in the archive.
    results = {name for part in summary["parts"] for name in part.get("results", {})}
    assert {"tree_attention.json", "verify.json", "kv_compact.json", "e2e.json"} <= results
    with tarfile.open(out / suite.ARCHIVE) as archive:
        names = {name.rsplit("/", 1)[-1] for name in archive.getnames()}
    assert {f"{name}.log" for name in suite.PARTS} <= names
    assert "| total (quick) |" in result.stdout and "estimated device s" in result.stdout
    # Rows are printed as cases finish, before each benchmark's closing table.
    assert "| shape | peer | us median (min-max) | floor us |" in result.stdout


def test_every_full_part_is_predicted_under_four_minutes(suite):
    for part in suite.PARTS.values():
        assert 0 < part.estimate(quick=False) < suite.PART_LIMIT_S, part.name


def test_a_part_that_does_not_fit_the_budget_is_skipped(tmp_path, suite):
    result, out = run_suite(tmp_path, "--quick", "--part", "kv_compact", "--budget", "1")
    assert result.returncode == 1
    summary = json.loads((out / suite.SUMMARY).read_text())
    assert summary["parts"][0]["status"].startswith("skipped")
    assert sorted(path.name for path in out.iterdir()) == sorted([suite.ARCHIVE, suite.SUMMARY])


def test_a_part_past_its_timeout_is_killed_and_its_output_kept(tmp_path, suite):
    part = suite.Part("slow", command=None, plan=None)
    command = [sys.executable, "-c", "import time; print('started', flush=True); time.sleep(60)"]
    result = suite.run_part(part, command, tmp_path, timeout=2)
    assert result["status"] == "timed out" and result["seconds"] < 30
    assert result["tail"] == ["started"]
    assert (tmp_path / "slow.log").read_text() == "started\n"
