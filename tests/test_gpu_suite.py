"""bench/gpu_suite.py fits the device's limits: its dry run plays every part on the CPU with tiny
shapes (the tuning part's winners written elsewhere) and writes exactly two files (archive and
summary), the quick plan is predicted under QUICK_LIMIT_S (490 s) and each part's full plan
under 4 minutes; a part that does not fit what is left of the budget is skipped, and one that
overruns its timeout is killed with its output kept."""

import json
import os
import subprocess
import sys
import tarfile

import pytest
from bench_smoke import BENCH_DIR, ROOT, import_bench


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
        env={**os.environ, "OUT": str(out), "OMP_NUM_THREADS": "1"},
        check=False,
    )
    return result, out


def test_dry_run_plays_every_part_and_predicts_the_quick_budget(tmp_path, suite, monkeypatch):
    committed = (ROOT / "kernels" / "configs.json").read_text()  # tune_kernels.CONFIG_PATH
    result, out = run_suite(tmp_path, "--dry-run", "--quick")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert sorted(path.name for path in out.iterdir()) == sorted([suite.ARCHIVE, suite.SUMMARY])
    summary = json.loads((out / suite.SUMMARY).read_text())
    assert [part["name"] for part in summary["parts"]] == list(suite.PARTS)
    assert all(part["status"] == "ok" for part in summary["parts"])
    estimates = summary["estimates_s"]
    # The dry run plays the opt-in parts too; a run without --part leaves them out.
    default = [seconds for name, seconds in estimates.items() if suite.PARTS[name].default]
    assert sum(default) < suite.QUICK_LIMIT_S
    assert all(0 < seconds < suite.PART_LIMIT_S for seconds in estimates.values())
    # The benchmarks' JSON results travel in the summary; logs and results in the archive.
    results = {name for part in summary["parts"] for name in part.get("results", {})}
    assert {"tree_attention.json", "verify.json", "kv_compact.json", "e2e.json"} <= results
    assert {"overhead.json", "draft_loop.json"} <= results
    parts = {part["name"]: part for part in summary["parts"]}
    check_lookup_play(parts["lookup"]["results"]["lookup.json"]["results"])
    with tarfile.open(out / suite.ARCHIVE) as archive:
        members = {member.name.rsplit("/", 1)[-1]: member for member in archive.getmembers()}
        assert {f"{name}.log" for name in suite.PARTS} <= members.keys()
        configs = json.load(archive.extractfile(members["configs.json"]))
    assert "| total (quick) |" in result.stdout and "estimated device s" in result.stdout
    # Rows are printed as cases finish, before each benchmark's closing table.
    assert "| shape | peer | us median (min-max) | floor us |" in result.stdout
    (tune,) = [part["results"]["tune.json"] for part in summary["parts"] if part["name"] == "tune"]
    check_tuning_play(tune, configs, import_bench(monkeypatch, "tune_kernels"), committed)


def check_lookup_play(results: list[dict]) -> None:
    """The lookup part's CPU play (`bench_lookup.py --tiny`): plain decoding, then the n-gram
    drafter and EAGLE-3 with it grafted on, each with its lookup on the host and on the device.
    The two lookups draft alike (the script fails otherwise; here: the same tokens per step),
    every output is plain decoding's, and each drafter's host time per step is recorded."""
    by_peer = {r["peer"]: r for r in results}
    lookups = [peer for peer in by_peer if peer.endswith(" lookup")]
    assert len(lookups) == 4 and "ours plain" in by_peer
    assert all(r["identical_to_plain"] for r in results)
    for host in (peer for peer in lookups if "host" in peer):
        device = by_peer[host.replace("host lookup", "device lookup")]
        assert device["tokens_per_step"] == by_peer[host]["tokens_per_step"]
    assert by_peer["ours plain"]["drafter_host_us_per_step"] is None
    assert all(by_peer[peer]["drafter_host_us_per_step"] > 0 for peer in lookups)


def check_tuning_play(result: dict, written: dict, tune, committed: str) -> None:
    """The tuning part's CPU play: every candidate timed, winners among the candidates, written
    to the file asked for (the committed configuration untouched)."""
    attention = tune.attention_candidates()
    assert len(result["rows"]) == len(attention) + 2 * len(tune.verify_candidates())
    assert written["verify_race_tiles"] in tune.RACE_TILE_CANDIDATES
    assert written["verify_stats_programs_per_sm"] in tune.STATS_PROGRAMS_CANDIDATES
    assert any(
        all(written[key] == value for key, value in candidate.items()) for candidate in attention
    )
    assert tune.CONFIG_PATH.read_text() == committed


def test_every_full_part_is_predicted_under_four_minutes(suite):
    for part in suite.PARTS.values():
        assert 0 < part.estimate(quick=False) < suite.PART_LIMIT_S, part.name


def test_a_part_that_does_not_fit_the_budget_is_skipped(tmp_path, suite, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.setenv("OUT", str(out))
    # In this process: the suite's own run, without a part to start.
    assert suite.main(["--quick", "--part", "kv_compact", "--budget", "1"]) == 1
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


def test_a_forked_part_runs_its_script_as_main_with_its_argv_and_environment(tmp_path, suite):
    """The dry run's parts run in forks of the suite: the script as `__main__`, its arguments,
    its folder on the path, the part's environment, its output and exit code kept; killed past
    its timeout."""
    script = tmp_path / "part_script.py"
    script.write_text(
        "import os, sys\n"
        "import part_helper\n"
        "print(__name__, sys.argv[1:], os.environ['PART_FLAG'], part_helper.VALUE, flush=True)\n"
        "print('to stderr', file=sys.stderr, flush=True)\n"
        "if sys.argv[1] == 'sleep':\n"
        "    import time; time.sleep(60)\n"
        "sys.exit(int(sys.argv[1]))\n"
    )
    (tmp_path / "part_helper.py").write_text("VALUE = 'beside'\n")
    part = suite.Part("forked", command=None, plan=None)
    env = {**os.environ, "PART_FLAG": "on"}
    result = suite.run_part(part, [sys.executable, str(script), "3"], tmp_path, 60, env, True)
    assert result["status"] == "failed (3)"
    assert result["tail"] == ["__main__ ['3'] on beside", "to stderr"]
    assert "PART_FLAG" not in os.environ
    result = suite.run_part(part, [sys.executable, str(script), "0"], tmp_path, 60, env, True)
    assert result["status"] == "ok"
    result = suite.run_part(part, [sys.executable, str(script), "sleep"], tmp_path, 2, env, True)
    assert result["status"] == "timed out" and result["seconds"] < 30
    assert (tmp_path / "forked.log").read_text().startswith("__main__ ['sleep'] on beside\n")
