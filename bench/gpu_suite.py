"""The one prepared GPU script (shared GPU.md): every device check, sized for the lease.

Parts, in order (`--part NAME`, repeatable), issue 44's first (shared GPU.md): a run without
`--part` runs the default ones (e2e, overhead, draft_loop: about 8 minutes, one device command);
the opt-in ones follow by name in a second command.
    e2e             bench/bench_e2e_tiny.py (the bundled pair at N = 16, three rounds)
    overhead        bench/bench_overhead.py on the bundled pair: per drafter (all built-in ones
                    and EAGLE-3 with the n-gram lookup grafted on at batch 1, --quick leaving
                    out the suffix lookup; plain, n-gram and DFlash at 1 and 8), the split into
                    forward, sampler, compaction, drafter and engine, the host's share, tokens/s
                    against plain decoding, eager operators and host reads per step; ours against
                    HF's peers
    draft_loop      bench/bench_draft_loop.py: the 8B-shaped target with an EAGLE-3 head and a
                    DFlash head, over the whole vocabulary and over a 32K draft vocabulary
                    (random weights), the draft loop against the verify forward, and the
                    speed-up the bundled pair's tokens per step (the overhead part's) would give
    chains          opt-in: bench/bench_e2e_tiny.py over the block chains (DFlash's and PARD's
                    chains of 3 and 5 tokens from their one forward) on the bundled pair,
                    against our plain decoding and HF's modes
    lookup          opt-in: bench/bench_lookup.py: the n-gram lookup on the host against on the
                    device (its default there), alone and grafted under EAGLE-3, side by side
    tune            opt-in: bench/tune_kernels.py: every candidate of kernels/configs.json timed
                    on issue 46's target shapes (tree attention B1/B8 N64, the stochastic
                    chain B1/B32), the table printed, the winners written into
                    kernels/configs.json (its copy comes back in tune.json: commit it)
    exact           opt-in: bench/bench_exact.py --device cuda: exact mode's CUDA path (bf16),
                    every bundled drafter's and the SmolLM2-shaped model's drafters' greedy
                    output against plain decoding of the same mode (target: 0 differing), and
                    its speed cost against the default mode
    tests           opt-in: versions and the GPU, then the `gpu`-marked tests (compiled kernels
                    against their references, CUDA graphs, steady steps without syncs)
    tree_attention  opt-in: bench/bench_tree_attention.py (peers side by side; N = 64/65, 32/33)
    verify          opt-in: bench/bench_verify.py
    kv_compact      opt-in: bench/bench_kv_compact.py
    step            opt-in: bench/bench_step.py (8B-shaped Llama decode and verify steps, our
                    eager steps under CUDA graphs; HF's compiled decode in the full plan)
    compiled_step   opt-in: bench/bench_step.py --compile (our compiled steps under CUDA graphs)
`--quick` runs each part's quick plan (the default parts predicted under 490 s); without it
each part runs its full plan (each predicted under 4 minutes, so run them one `--part` at a time).

Each part runs in its own process (in the dry run, a fork of the suite's, which has imported
torch, transformers and the library once for all parts) under a timeout (twice its estimate, at
most PART_LIMIT_S), its output streamed as it comes (the benchmarks print a row per finished
case). The suite starts no part whose estimate exceeds what is left of `--budget` (default:
under the device's 10-minute command limit). Everything a part writes, and its log, goes to a
work folder that is packed after every part into $OUT/gpu_suite.tar.gz, beside
$OUT/gpu_suite.json (versions, the plan with its estimates, per part: status, seconds, the last
lines and the JSON results it wrote): two files, however the run ends.

`--dry-run` plays the same plan on the CPU with tiny shapes (each benchmark at its CPU sizes,
the GPU tests collected only, without the packages the GPU image lacks, `DEVICE_IMAGE_LACKS`;
every step eager: compiling each tiny shape would cost the CPU minutes, and
tests/test_compiled_step.py tests the compiled steps) and prints the estimated
device time per part, from each part's GPU plan and the cost model `COSTS` (seconds per unit of
work on the H200 machine: leads, set before any GPU run; bench/NOTES.md has the arithmetic).
CI runs it.

    python3 -m pip install -e . --no-deps --no-build-isolation
    python3 bench/gpu_suite.py --quick
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import runpy
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import partial
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
ARCHIVE = "gpu_suite.tar.gz"
SUMMARY = "gpu_suite.json"
PART_LIMIT_S = 240
# The default parts' quick plans together (8 minutes, then 490 s once the n-gram lookup moved to
# the device and compiles on a GPU): under the default budget with the machine's start (about 30
# s) and room for a second, shorter command in a 15-minute session.
QUICK_LIMIT_S = 490
# The device runs one command for at most 10 minutes: leave time to pack and exit.
DEFAULT_BUDGET_S = 570
TAIL_LINES = 25

# Seconds per unit of work on the H200 machine (16 cores), corrected by its first run
# (2026-12-04, bench/results/gpu-2026-12-04-h200: each part's seconds against its estimate,
# bench/NOTES.md); the others are still leads.
COSTS = {
    "process": 10.0,  # python start, torch/triton/transformers imports, CUDA context, probes
    "case": 0.5,  # inputs drawn on the device, warm-up, a 10-call graph captured, timed
    "triton_compile": 1.0,  # the first launch of one of our kernel variants
    "flex_compile": 60.0,  # FlexAttention's torch.compile for one shape
    "inductor_first": 40.0,  # torch.compile (inductor) of one eager peer function
    "inductor_case": 2.0,  # the same, each later shape (dynamic shapes: guards, rare recompiles)
    "model_build": 5.0,  # an 8B-shaped Llama with random bf16 weights drawn on the device
    "runner_graph": 5.0,  # our runner capturing one (B, N) step of 32 layers
    "runner_compile": 35.0,  # inductor compiling one of our runner's step graphs, 32 layers
    "hf_compile": 60.0,  # HF's static-cache decode compiled (reduce-overhead) for one shape
    "gpu_test": 2.0,  # one gpu-marked test, its kernel compiles included
    "e2e_run": 12.0,  # one drafter (or HF mode) on the tiny pair: compiles, graphs, first round
    "e2e_token": 0.004,  # each generated token of the tiny pair in a later round
    # inductor compiling the n-gram drafter's device lookup and append for one batch class (1,
    # 2+): two small graphs, its default on CUDA when compiling since 2026-12-06 (lead)
    "lookup_compile": 5.0,
    "step_8b": 0.02,  # one speculative step of the 8B-shaped target with its host work (lead)
    "eager_token": 0.03,  # one eager step (lead: exact mode, 30 layers, host-bound)
}


@dataclass
class Part:
    """One part of the suite: its command (given the work folder and the mode) and its GPU
    plan's estimated seconds, itemized."""

    name: str
    command: Callable[[Path, bool, bool], list[str]]
    plan: Callable[[bool], dict[str, float]]
    result_files: Callable[[Path], list[Path]] = field(default=lambda work: [])
    # Whether a run without --part runs it; an opt-in part runs when named (a dry run plays
    # every part).
    default: bool = True

    def estimate(self, quick: bool) -> float:
        return sum(self.plan(quick).values())


def _bench_module(name: str):
    """A benchmark module of bench/ (they import `common` from their own folder)."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module(name)


CUDA = torch.device("cuda")
PYTHON = sys.executable
# The serve extra's packages that the GPU machine's image lacks (its package list as the device
# tool gives it, read on 2026-11-17; it has prometheus-client, httpx, pyyaml and uvloop). The dry
# run's spawned commands cannot import them either (bench/device_image/sitecustomize.py): a GPU
# test module that needs one fails its collection here, as it would on the device.
DEVICE_IMAGE_LACKS = ("fastapi", "starlette", "pydantic", "uvicorn", "httptools", "openai")


def kernel_bench_plan(module_name: str, inductor_peer: str | None = None):
    """Plan of a kernel microbenchmark: every case, a compile for each of ours, FlexAttention
    and inductor compiles for the peers that need them."""

    def plan(quick: bool) -> dict[str, float]:
        cases = _bench_module(module_name).cases_for(CUDA, quick)
        ours = [case for case in cases if case.peer.startswith(("ours", "verify", "kv_compact"))]
        flex = [case for case in cases if case.peer == "flex block mask"]
        inductor = [case for case in cases if case.peer == inductor_peer]
        items = {
            "process": COSTS["process"],
            f"{len(cases)} cases": len(cases) * COSTS["case"],
            f"{len(ours)} first launches of ours": len(ours) * COSTS["triton_compile"],
        }
        if flex:
            items[f"{len(flex)} FlexAttention compiles"] = len(flex) * COSTS["flex_compile"]
        if inductor:
            kinds = {case.shape.split("/")[0] for case in inductor}
            items[f"{len(inductor)} torch.compile cases"] = (
                len(kinds) * COSTS["inductor_first"]
                + (len(inductor) - len(kinds)) * COSTS["inductor_case"]
            )
        return items

    return plan


GPU_MARK = "pytest.mark.gpu"


def gpu_test_files() -> list[str]:
    """The test modules that hold `gpu`-marked tests: collecting the whole suite costs a CPU
    half a minute (every module imported), and the server's test modules import packages the
    device image lacks."""
    tests = sorted((ROOT / "tests").glob("test_*.py"))
    return [str(path.relative_to(ROOT)) for path in tests if GPU_MARK in path.read_text()]


def tests_plan(quick: bool) -> dict[str, float]:
    collected = subprocess.run(
        [PYTHON, "-m", "pytest", *gpu_test_files(), "-m", "gpu", "--collect-only", "-q"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    count = next(
        int(line.split("/")[0]) for line in collected.splitlines() if "tests collected" in line
    )
    return {"process": COSTS["process"], f"{count} gpu tests": count * COSTS["gpu_test"]}


def step_plan(quick: bool, compiled: bool = False) -> dict[str, float]:
    _, points, _ = _bench_module("bench_step").plan(tiny=False, quick=quick, compiled=compiled)
    steps = sum(len(point.nodes) for point in points)
    hf = sum(point.hf for point in points)
    if compiled:
        # One graph per step kind (decode, tree) and batch class (1, 2+), compiled once.
        graphs = {(point.batch > 1, nodes > 1) for point in points for nodes in point.nodes}
        return {
            "process": COSTS["process"],
            "model": COSTS["model_build"],
            f"{len(graphs)} compiles": len(graphs) * COSTS["runner_compile"],
            f"{steps} step graphs": steps * (COSTS["runner_graph"] + COSTS["case"]),
        }
    return {
        "process": COSTS["process"],
        "model": COSTS["model_build"],
        f"{steps} step graphs": steps * (COSTS["runner_graph"] + COSTS["case"]),
        f"{hf} HF compiles": hf * (COSTS["hf_compile"] + COSTS["case"]),
    }


# The tiny pair's runs on the GPU, of the registry's kinds for benchmarks (`e2e_kinds`): one
# budget (the block drafters' targets' N = 16) and three rounds, so that each peer's median skips
# the round that compiles and captures its graphs.
E2E_SIZE = {True: (2, 32), False: (4, 56)}  # prompts, new tokens (2 x 32 is --quick's)
E2E_ROUNDS = 3
HF_MODES = 3  # generate, assisted, prompt lookup


def e2e_kinds(quick: bool) -> tuple[str, ...]:
    """The drafter kinds of the tiny pair's runs (the registry's `kinds_for_benchmarks`)."""
    from specdec_fast.drafters.registry import kinds_for_benchmarks

    return kinds_for_benchmarks(quick)


def e2e_plan(quick: bool) -> dict[str, float]:
    from specdec_fast.drafters.registry import bundled_specs

    kinds = e2e_kinds(quick)
    drafters = sum(spec.kind in kinds for spec in bundled_specs())
    return tiny_pair_plan(drafters, 2, quick) | {
        "the n-gram lookup's compiles (batch 1)": COSTS["lookup_compile"]
    }


def tiny_pair_plan(drafters: int, reread: int, quick: bool) -> dict[str, float]:
    """bench_e2e_tiny.py's estimate: our plain decoding, HF's modes and `drafters` drafters in
    `E2E_ROUNDS` rounds, and `reread` peers (plain decoding and an EAGLE drafter) run three
    times more. Each peer's first round compiles (its first batch, one prompt, untimed); HF's
    runs, counted the same, err high. The three more: read the other way round (on the steps
    they compiled), and served with and without read-ahead (the scheduler's target steps,
    whose shapes are dynamic, compile once per peer: about half a peer's first round, the
    drafter's steps being reused)."""
    peers = 1 + HF_MODES + drafters
    prompts, tokens = E2E_SIZE[quick]
    rounds = E2E_ROUNDS * (prompts + 1) * tokens * COSTS["e2e_token"]
    return {
        "process": COSTS["process"],
        f"{peers} peers x {E2E_ROUNDS} rounds": peers * (COSTS["e2e_run"] + rounds),
        f"{3 * reread} reruns x {E2E_ROUNDS} rounds": 3 * reread * rounds,
        f"{reread} served peers' compiles (half a first round each)": reread * COSTS["e2e_run"] / 2,
    }


# A breakdown's runs after its first: timed, untimed, and the step counts' short and long runs.
BREAKDOWN_RUNS = 4


def overhead_plan(quick: bool) -> dict[str, float]:
    """bench_overhead.py on the bundled pair: each breakdown's first run compiles and captures
    like a tiny-pair peer; each comparison runs both sides 1 + repeats times."""
    bench = _bench_module("bench_overhead")
    # Plain, n-gram and DFlash at each batch, the other drafters at the GPU's batches.
    specs = len(bench.gpu_specs(quick))
    breakdowns = 3 * len(bench.BATCHES) + specs * len(bench.GPU_BATCHES)
    # Plain against HF generate at each batch, n-gram against prompt lookup, the draft chain.
    comparisons = len(bench.BATCHES) + len(bench.NGRAM_VS_LOOKUP) + 1
    repeats, tokens = bench.run_size(tiny=False, quick=quick)
    runs = comparisons * 2 * (1 + repeats) + breakdowns * BREAKDOWN_RUNS
    return {
        "process": COSTS["process"],
        f"{breakdowns} breakdowns": breakdowns * COSTS["e2e_run"],
        f"{runs} timed runs": runs * tokens * COSTS["e2e_token"],
        # Both steps at batch 1 (the n-gram's and the graft's) and 8; the lookup alone (half)
        # for each other tree shape against HF's prompt lookup.
        "the n-gram lookup's compiles": COSTS["lookup_compile"]
        * (2 + 0.5 * (len(bench.NGRAM_VS_LOOKUP) - 1)),
    }


def draft_loop_plan(quick: bool) -> dict[str, float]:
    """bench_draft_loop.py: the 8B-shaped target, a compile for its decode step and for each
    drafter's hooked verify step (and the DFlash heads' block steps), every breakdown's runs."""
    bench = _bench_module("bench_draft_loop")
    configs = 1 + len(bench.TAU_CONFIGS)
    compiles = configs - len(bench.SHARED_TARGET_STEPS)
    tokens = bench.QUICK_TOKENS if quick else bench.NEW_TOKENS[False]
    steps = configs * (1 + BREAKDOWN_RUNS) * tokens
    counted = len(bench.TAU_CONFIGS) * (bench.WEIGHT_TOKENS + 1)
    return {
        "process": COSTS["process"],
        "model and heads": COSTS["model_build"],
        f"{compiles} compiles": compiles * COSTS["runner_compile"],
        "the DFlash heads' one-layer steps": 2 * COSTS["runner_graph"],
        f"{steps} steps": steps * COSTS["step_8b"],
        f"{counted} eager steps counting weight reads": counted * COSTS["step_8b"],
    }


def lookup_plan(quick: bool) -> dict[str, float]:
    """bench_lookup.py on the bundled pair: its peers at each batch, each peer's first round
    compiling and capturing like a tiny-pair peer, and the device lookup's compiles per batch
    class."""
    bench = _bench_module("bench_lookup")
    size = bench.SIZES["quick" if quick else "full"]
    peers = bench.PEERS * len(size.batches)
    rounds = size.rounds * (size.prompts + 1) * size.new_tokens * COSTS["e2e_token"]
    classes = len({batch > 1 for batch in size.batches})
    return {
        "process": COSTS["process"],
        f"{peers} peers x {size.rounds} rounds": peers * (COSTS["e2e_run"] + rounds),
        "the device lookup's compiles": classes * COSTS["lookup_compile"],
    }


def lookup_command(work: Path, quick: bool, dry_run: bool) -> list[str]:
    size = ["--tiny"] if dry_run else _mode(quick)
    return [PYTHON, "bench/bench_lookup.py", *size, "--json", str(work / "lookup.json")]


def draft_loop_command(work: Path, quick: bool, dry_run: bool) -> list[str]:
    size = ["--tiny"] if dry_run else ["--quick"] if quick else []
    paths = ["--tau-json", str(work / "overhead.json"), "--json", str(work / "draft_loop.json")]
    return [PYTHON, "bench/bench_draft_loop.py", *size, *paths]


def overhead_command(work: Path, quick: bool, dry_run: bool) -> list[str]:
    size = ["--tiny", "--threads", "1"] if dry_run else ["--models", "tiny-code", *_mode(quick)]
    json_path = str(work / "overhead.json")
    return [PYTHON, "bench/bench_overhead.py", *size, "--json", json_path]


def _mode(quick: bool) -> list[str]:
    return ["--quick"] if quick else []


def bench_command(script: str, json_name: str, *options: str):
    def command(work: Path, quick: bool, dry_run: bool) -> list[str]:
        return [PYTHON, f"bench/{script}", *options, *_mode(quick), "--json", str(work / json_name)]

    return command


def tests_command(work: Path, quick: bool, dry_run: bool) -> list[str]:
    command = [PYTHON, "-m", "pytest", *gpu_test_files(), "-m", "gpu", "-q"]
    command += ["-p", "no:cacheprovider"]
    return command + (["--collect-only"] if dry_run else [f"--junitxml={work / 'gpu_tests.xml'}"])


def e2e_command(work: Path, quick: bool, dry_run: bool) -> list[str]:
    kinds = ["--kinds", ",".join(e2e_kinds(quick)), "--budgets", "16"]
    return tiny_pair_command(work / "e2e", quick, dry_run, kinds)


def tiny_pair_command(out: Path, quick: bool, dry_run: bool, grid: list[str]) -> list[str]:
    """bench_e2e_tiny.py over the drafters `grid` selects (its --kinds and sizes), writing to
    `out`: one prompt of 8 tokens in one round in a dry run, else `E2E_SIZE` in `E2E_ROUNDS`."""
    prompts, tokens = (1, 8) if dry_run else E2E_SIZE[quick]
    size = ["--prompts", str(prompts), "--new-tokens", str(tokens)]
    rounds = ["--rounds", str(1 if dry_run else E2E_ROUNDS)]
    return [PYTHON, "bench/bench_e2e_tiny.py", "--out", str(out), *size, *grid, *rounds]


# The block chains' lengths of the `chains` part: DFlash's published way of drafting (a chain
# from the block's one forward), one step's forward against the trees' best-first rounds.
CHAIN_LENGTHS = (3, 5)


def chains_plan(quick: bool) -> dict[str, float]:
    """The tiny pair's block chains (`chains`, the quick size always): each bundled block
    drafter's chain at `CHAIN_LENGTHS`; plain decoding reread (no EAGLE drafter here)."""
    from specdec_fast.drafters.registry import bundled_specs

    chains = sum(spec.kind == "block-chain" for spec in bundled_specs()) * len(CHAIN_LENGTHS)
    return tiny_pair_plan(chains, 1, True)


def chains_command(work: Path, quick: bool, dry_run: bool) -> list[str]:
    lengths = ",".join(map(str, CHAIN_LENGTHS))
    grid = ["--kinds", "block-chain", "--chain-lengths", lengths]
    return tiny_pair_command(work / "chains", True, dry_run, grid)


def tune_plan(quick: bool) -> dict[str, float]:
    bench = _bench_module("tune_kernels")
    attention = len(bench.attention_candidates()) * len(bench.attention_shapes(CUDA))
    race = len(bench.verify_candidates()) * len(bench.verify_shapes(CUDA))
    return {
        "process": COSTS["process"],
        f"{attention + race} cases": (attention + race) * COSTS["case"],
        f"{attention + race} first launches": (attention + race) * COSTS["triton_compile"],
    }


def tune_command(work: Path, quick: bool, dry_run: bool) -> list[str]:
    # The dry run leaves the committed configuration alone.
    out = ["--tiny", "--config-out", str(work / "configs.json")] if dry_run else []
    return [PYTHON, "bench/tune_kernels.py", *out, "--json", str(work / "tune.json")]


# bench_exact.py on the GPU: 4 prompts at batch 1 and 4, 3 speed repeats of 32 tokens.
EXACT_SIZE = dict(prompts=4, batches=(1, 4), repeats=3, speed_tokens=32)


def exact_plan(quick: bool) -> dict[str, float]:
    """Both models' equality runs (plain and each drafter, both modes, every batch: eager, exact
    mode compiles nothing) and the speed cells (plain and n-gram at each batch, both modes, a
    warm-up and the repeats), each step at COSTS["eager_token"] (steps <= tokens)."""
    bench = _bench_module("bench_exact")
    from specdec_fast.drafters.registry import bundled_specs

    batches = EXACT_SIZE["batches"]
    calls = sum(-(-EXACT_SIZE["prompts"] // batch) for batch in batches)
    steps = 0
    for model, drafters in ((bench.BUNDLED, len(bundled_specs())), (bench.SMOL, 4)):
        steps += 2 * (drafters + 1) * calls * bench.EQUALITY_TOKENS[model]
    speed = 2 * len(batches) * 2 * (1 + EXACT_SIZE["repeats"]) * EXACT_SIZE["speed_tokens"]
    return {
        "process": COSTS["process"],
        f"{steps} equality steps": steps * COSTS["eager_token"],
        f"{speed} speed steps": speed * COSTS["eager_token"],
    }


def exact_command(work: Path, quick: bool, dry_run: bool) -> list[str]:
    if dry_run:
        size = ["--prompts", "1", "--batches", "1", "--repeats", "1", "--speed-tokens", "2"]
        size += ["--equality-tokens", "2", "--device", "cpu", "--threads", "1", "--tiny"]
    else:
        size = ["--prompts", str(EXACT_SIZE["prompts"]), "--device", "cuda"]
        size += ["--batches", ",".join(map(str, EXACT_SIZE["batches"]))]
        size += ["--repeats", str(EXACT_SIZE["repeats"])]
        size += ["--speed-tokens", str(EXACT_SIZE["speed_tokens"])]
    paths = ["--out", str(work / "exact"), "--json", str(work / "exact.json")]
    return [PYTHON, "bench/bench_exact.py", *size, *paths]


def _json_files(*names: str):
    return lambda work: [work / name for name in names]


# In the order of shared GPU.md: what only a GPU can show first (each drafter's step split and
# tokens/s against plain decoding, then the 8B-shaped draft loop against its verify forward, which
# reads the bundled pair's tokens per step from the overhead part's JSON), then the rest.
PARTS = {
    part.name: part
    for part in (
        Part("e2e", e2e_command, e2e_plan, _json_files("e2e.json")),
        Part("overhead", overhead_command, overhead_plan, _json_files("overhead.json")),
        Part("draft_loop", draft_loop_command, draft_loop_plan, _json_files("draft_loop.json")),
        Part("chains", chains_command, chains_plan, _json_files("chains.json"), default=False),
        Part("lookup", lookup_command, lookup_plan, _json_files("lookup.json"), default=False),
        Part("tune", tune_command, tune_plan, _json_files("tune.json"), default=False),
        Part("exact", exact_command, exact_plan, _json_files("exact.json"), default=False),
        Part("tests", tests_command, tests_plan, default=False),
        Part(
            "tree_attention",
            bench_command("bench_tree_attention.py", "tree_attention.json"),
            kernel_bench_plan("bench_tree_attention"),
            _json_files("tree_attention.json"),
            default=False,
        ),
        Part(
            "verify",
            bench_command("bench_verify.py", "verify.json"),
            kernel_bench_plan("bench_verify", inductor_peer="torch.compile"),
            _json_files("verify.json"),
            default=False,
        ),
        Part(
            "kv_compact",
            bench_command("bench_kv_compact.py", "kv_compact.json"),
            kernel_bench_plan("bench_kv_compact"),
            _json_files("kv_compact.json"),
            default=False,
        ),
        Part(
            "step",
            bench_command("bench_step.py", "bench_step.json"),
            step_plan,
            _json_files("bench_step.json"),
            default=False,
        ),
        Part(
            "compiled_step",
            bench_command("bench_step.py", "bench_step_compiled.json", "--compile"),
            partial(step_plan, compiled=True),
            _json_files("bench_step_compiled.json"),
            default=False,
        ),
    )
}


def versions() -> dict:
    import transformers
    import triton

    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "transformers": transformers.__version__,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "sm_count": (
            torch.cuda.get_device_properties(0).multi_processor_count
            if torch.cuda.is_available()
            else None
        ),
    }


def device_image_env(env: dict) -> dict:
    """What `env` needs for the dry run's spawned commands to import as on the GPU image
    (`DEVICE_IMAGE_LACKS`)."""
    path = [str(BENCH / "device_image"), *filter(None, [env.get("PYTHONPATH")])]
    return {
        "PYTHONPATH": os.pathsep.join(path),
        "SPECDEC_DEVICE_IMAGE_LACKS": ",".join(DEVICE_IMAGE_LACKS),
    }


def run_part(
    part: Part,
    command: list[str],
    work: Path,
    timeout: float,
    env: dict | None = None,
    forked: bool = False,
) -> dict:
    """Run one part in its own process group (environment `env`, default ours), streaming its
    output to stdout and its log; on timeout the whole group is killed and the part recorded
    as timed out. `forked` (the dry run's scripts): the process is a fork of this one, which
    has imported torch, transformers and the library already, instead of a new interpreter
    that imports them again (seconds of CPU per part); `python -m` commands (the GPU tests'
    pytest) always start afresh."""
    print(f"\n=== {part.name}: {' '.join(command)} (timeout {timeout:.0f} s)", flush=True)
    log_path = work / f"{part.name}.log"
    start = time.perf_counter()
    lines = []
    with log_path.open("w") as log:
        script = command[1] != "-m"
        pid, output = _fork(command, env) if forked and script else _spawn(command, env)
        timer = _Deadline(pid, timeout)
        with output:
            for line in output:
                print(line, end="", flush=True)
                log.write(line)
                lines.append(line.rstrip("\n"))
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        timer.cancel()
    status = "timed out" if timer.fired else ("ok" if code == 0 else f"failed ({code})")
    return {
        "name": part.name,
        "command": command,
        "status": status,
        "returncode": code,
        "seconds": round(time.perf_counter() - start, 1),
        "log": log_path.name,
        "tail": lines[-TAIL_LINES:],
    }


def _spawn(command: list[str], env: dict | None):
    """(pid, its output as text lines) of `command` in a new interpreter and session."""
    process = subprocess.Popen(
        command,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env=env,
    )
    return process.pid, process.stdout


def _fork(command: list[str], env: dict | None):
    """(pid, its output as text lines) of `command` (`PYTHON script args...`) run by a fork of
    this process, in a new session."""
    read_end, write_end = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.setsid()
        os.close(read_end)
        os.dup2(write_end, 1)
        os.dup2(write_end, 2)
        os.close(write_end)
        # Whatever this process's sys.stdout was (a capture, a terminal's), the child's is fd 1.
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        os._exit(_run_in_child(command, env))
    os.close(write_end)
    return pid, os.fdopen(read_end)


def _run_in_child(command: list[str], env: dict | None) -> int:
    """Run the script of `command` as its interpreter would (`__main__`, its argv, its folder
    first on the path, `env`): the exit code."""
    code = 0
    try:
        os.chdir(ROOT)
        if env is not None:
            os.environ.clear()
            os.environ.update(env)
        script = ROOT / command[1]
        sys.argv = [str(script), *command[2:]]
        sys.path.insert(0, str(script.parent))
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exit_:
        if exit_.code is None or isinstance(exit_.code, int):
            code = exit_.code or 0
        else:  # sys.exit("message"): the message on stderr and status 1, as the interpreter does
            print(exit_.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    return code


class _Deadline:
    """Kills a process group after `timeout` seconds unless cancelled."""

    def __init__(self, pid: int, timeout: float):
        self.pid, self.fired = pid, False
        self.timer = threading.Timer(timeout, self._kill)
        self.timer.start()

    def _kill(self) -> None:
        self.fired = True
        os.killpg(self.pid, signal.SIGKILL)

    def cancel(self) -> None:
        self.timer.cancel()


def write_outputs(out_dir: Path, work: Path, summary: dict) -> None:
    """The two files: the summary JSON and the archive of the work folder (logs, results)."""
    (out_dir / SUMMARY).write_text(json.dumps(summary, indent=1) + "\n")
    with tarfile.open(out_dir / ARCHIVE, "w:gz") as archive:
        archive.add(work, arcname=work.name)


def format_plan(estimates: dict[str, dict[str, float]], quick: bool) -> str:
    lines = ["| part | estimated device s | limit s | itemized |", "|---|---|---|---|"]
    for name, items in estimates.items():
        itemized = ", ".join(f"{what} {seconds:.0f}" for what, seconds in items.items())
        total = sum(items.values())
        label = name if PARTS[name].default else f"{name} (opt-in)"
        lines.append(f"| {label} | {total:.0f} | {PART_LIMIT_S} | {itemized} |")
    # The total is that of a run without --part: the opt-in parts are left out.
    grand = sum(sum(items.values()) for name, items in estimates.items() if PARTS[name].default)
    limit = QUICK_LIMIT_S if quick else "-"
    lines.append(f"| total ({'quick' if quick else 'full'}) | {grand:.0f} | {limit} | |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", action="append", choices=list(PARTS), help="repeatable")
    parser.add_argument("--quick", action="store_true", help="each part's quick plan")
    parser.add_argument(
        "--dry-run", action="store_true", help="on the CPU, tiny shapes; print the estimates"
    )
    parser.add_argument(
        "--budget", type=float, default=DEFAULT_BUDGET_S, help="seconds for the whole run"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H%M")
    out_dir = Path(os.environ.get("OUT") or BENCH / "results" / f"gpu-{stamp}")
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu_suite-")) / f"gpu_suite-{stamp}"
    work.mkdir()
    chosen = args.part or [name for name, part in PARTS.items() if part.default or args.dry_run]
    parts = [PARTS[name] for name in chosen]
    info = versions()
    print(json.dumps(info, indent=1), flush=True)
    estimates = {part.name: part.plan(args.quick) for part in parts}
    plan_table = format_plan(estimates, args.quick)
    print(plan_table, flush=True)
    summary = {
        "versions": info,
        "date": stamp,
        "quick": args.quick,
        "dry_run": args.dry_run,
        "estimates_s": {name: round(sum(items.values()), 1) for name, items in estimates.items()},
        "costs": COSTS,
        "parts": [],
    }
    for part in parts:
        estimate = sum(estimates[part.name].values())
        left = args.budget - (time.perf_counter() - start)
        if not args.dry_run and estimate > left:
            result = {"name": part.name, "status": f"skipped ({left:.0f} s left)", "seconds": 0}
        else:
            timeout = min(2 * estimate, PART_LIMIT_S, max(left, 1.0))
            env = None
            if args.dry_run:
                timeout = PART_LIMIT_S  # the CPU plays tiny shapes, at its own pace
                # Compiling every step shape would take the CPU minutes: it plays them eagerly,
                # those of a benchmark that asks for compiled steps too (TORCHDYNAMO_DISABLE:
                # bench_step.py --compile alone compiled for two of the dry run's five minutes).
                env = {**os.environ, "SPECDEC_COMPILE": "0", "TORCHDYNAMO_DISABLE": "1"}
                env |= device_image_env(env)
            command = part.command(work, args.quick, args.dry_run)
            result = run_part(part, command, work, timeout, env, forked=args.dry_run)
            result["results"] = {
                path.name: json.loads(path.read_text())
                for path in part.result_files(work)
                if path.exists()
            }
        result["estimate_s"] = round(estimate, 1)
        summary["parts"].append(result)
        write_outputs(out_dir, work, summary)
    print(f"\n{plan_table}\n\n| part | status | seconds | estimated s |\n|---|---|---|---|")
    for result in summary["parts"]:
        print(
            f"| {result['name']} | {result['status']} | {result['seconds']} "
            f"| {result['estimate_s']} |"
        )
    shutil.rmtree(work.parent)
    print(f"{ARCHIVE} and {SUMMARY} in {out_dir}")
    return 0 if all(result["status"] == "ok" for result in summary["parts"]) else 1


if __name__ == "__main__":
    sys.exit(main())
