"""The one prepared GPU script (see the GPU notes shared with the project).

In one call: versions and the GPU; the `gpu`-marked tests (compiled Triton kernels against their
references, CUDA graphs); the kernel microbenchmarks against their peers; the end-to-end benchmarks
(`bench_step.py` when present, the bundled tiny-code pair); a short table last. Every part's
output and JSON land under $OUT (or bench/results/gpu-<date>/), plus `suite.json` with what ran,
how long it took and whether it passed. `--quick` keeps the whole run under about 4 minutes.

    python3 -m pip install -e . --no-deps --no-build-isolation
    python3 bench/gpu_suite.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
KERNEL_BENCHES = ("bench_tree_attention", "bench_verify", "bench_kv_compact")


def versions() -> dict:
    import torch
    import transformers
    import triton

    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "transformers": transformers.__version__,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def _text(stream: bytes | str | None) -> str:
    if stream is None:
        return ""
    return stream if isinstance(stream, str) else stream.decode(errors="replace")


def run_step(name: str, command: list[str], out_dir: Path, timeout: int) -> dict:
    """Run one part, teeing its output to `<name>.log`; never let one failure stop the suite."""
    print(f"\n=== {name}: {' '.join(command)}", flush=True)
    start = time.perf_counter()
    log_path = out_dir / f"{name}.log"
    try:
        result = subprocess.run(
            command, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False
        )
        output, code = result.stdout + result.stderr, result.returncode
    except subprocess.TimeoutExpired as error:
        output = _text(error.stdout) + _text(error.stderr) + f"\n[timed out after {timeout}s]"
        code = -1
    log_path.write_text(output)
    tail = "\n".join(output.rstrip().splitlines()[-25:])
    print(tail, flush=True)
    return {
        "name": name,
        "command": command,
        "returncode": code,
        "seconds": round(time.perf_counter() - start, 1),
        "log": log_path.name,
        "tail": tail.splitlines()[-3:],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="under about 4 minutes")
    args = parser.parse_args()
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H%M")
    out_dir = Path(os.environ.get("OUT") or BENCH / "results" / f"gpu-{stamp}")
    out_dir.mkdir(parents=True, exist_ok=True)
    info = versions()
    print(json.dumps(info, indent=1), flush=True)
    python = sys.executable
    quick = ["--quick"] if args.quick else []
    steps = [
        (
            "gpu-tests",
            [python, "-m", "pytest", "tests", "-m", "gpu", "-q", "-x", "-p", "no:cacheprovider"],
            150 if args.quick else 600,
        )
    ]
    for bench in KERNEL_BENCHES:
        if (BENCH / f"{bench}.py").exists():
            steps.append(
                (
                    bench,
                    [python, f"bench/{bench}.py", *quick, "--json", str(out_dir / f"{bench}.json")],
                    120 if args.quick else 600,
                )
            )
    if (BENCH / "bench_step.py").exists():
        steps.append(
            (
                "bench_step",
                [python, "bench/bench_step.py", *quick, "--json", str(out_dir / "bench_step.json")],
                300,
            )
        )
    steps.append(
        (
            "bench_e2e_tiny",
            [python, "bench/bench_e2e_tiny.py", *quick, "--out", str(out_dir / "e2e_tiny")],
            300,
        )
    )
    results = [run_step(name, command, out_dir, timeout) for name, command, timeout in steps]
    summary = {"versions": info, "quick": args.quick, "date": stamp, "steps": results}
    (out_dir / "suite.json").write_text(json.dumps(summary, indent=2) + "\n")
    print("\n| part | status | seconds |\n|---|---|---|")
    for step in results:
        status = "ok" if step["returncode"] == 0 else f"FAILED ({step['returncode']})"
        print(f"| {step['name']} | {status} | {step['seconds']} |")
    print(f"results in {out_dir}")
    return 0 if all(step["returncode"] == 0 for step in results) else 1


if __name__ == "__main__":
    sys.exit(main())
