"""Issue 18's targets for `specdec-fast serve`, on the bundled tiny-code target on the CPU.

1. Scheduler overhead: at 4 QPS for 60 s (Poisson, seed 0, the shipped held-out code prompts,
   64 new tokens each), the served plain route's TPOT p50 against `generate()`'s at the same
   concurrency: static batches of the same prompts at the batch sizes around the mean
   concurrency the server saw, interpolated linearly between them. Target: within 10%.
2. N-gram speculation: the served `ngram:8` route's TPOT p50 improvement over the plain route
   at 4 QPS against what the offline harness (`specdec_fast.harness.bench`, paired runs)
   measures for `ngram:8` at that concurrency. Target: at least the harness's minus 10%.
3. Saturation: 1,000 requests (16 new tokens each) arriving at 200 QPS, well above what the
   CPU serves, on the n-gram route with a queue of 256: every request must get exactly one
   complete response or one error (429), none lost or duplicated (client records, the server's
   counters and greedy outputs cross-checked).

The server runs as its own process (`specdec-fast serve`, one torch thread, eager steps:
`SPECDEC_COMPILE=0`, which is faster than compiled steps for this 6M-parameter model on a CPU),
the load generator in this one; the offline runs follow once the server is stopped, with one
torch thread too.

    python bench/bench_serving.py            # ~6 minutes; writes bench/results/serving-cpu-DATE/
    python bench/bench_serving.py --quick    # 10 s levels, 200 saturation requests
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx
import torch

from specdec_fast import generate
from specdec_fast.harness import bench, versions
from specdec_fast.harness.prompts import load_prompts
from specdec_fast.loading import load_model, load_tokenizer
from specdec_fast.prompts import CODE_PROMPTS
from specdec_fast.serving.loadgen import LoadConfig, run_sweep, write_serving_report
from specdec_fast.stats import percentile
from specdec_fast.text import encode_prompt, stop_token_ids

RESULTS = Path(__file__).resolve().parent / "results"
NEW_TOKENS = 64
QPS = 4.0
SATURATION_QPS = 200.0
SATURATION_TOKENS = 16
DRAFTER = "ngram:8"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class ServerProcess:
    """`specdec-fast serve` in a child process, waited for until /health answers."""

    def __init__(self, *args: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [
            sys.executable, "-m", "specdec_fast", "serve", "--model", "tiny-code",
            "--drafter", DRAFTER, "--port", str(self.port), "--threads", "1",
            "--log-level", "warning", *args,
        ]  # fmt: skip
        self.command = " ".join(command[2:])
        env = os.environ | {"SPECDEC_COMPILE": "0"}
        self.process = subprocess.Popen(command, env=env)
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start: {self.command}")
            time.sleep(0.5)

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(60)


def offline_tpot(model, prompts: list[list[int]], batch: int, stops) -> float:
    """generate()'s TPOT p50 (plain decoding) over `prompts` decoded `batch` at a time."""
    tpots = []
    for start in range(0, len(prompts), batch):
        out = generate(
            model,
            prompts[start : start + batch],
            drafter=None,
            max_new_tokens=NEW_TOKENS,
            eos_token_id=stops,
        )
        tpots += out.stats.tpot
    return percentile(tpots, 50)


def interpolate(values: dict[int, float], at: float) -> float:
    low, high = math.floor(at), math.ceil(at)
    if low == high:
        return values[low]
    return values[low] + (values[high] - values[low]) * (at - low)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="10 s levels, 200 requests")
    parser.add_argument("--out", default=None, help="default: bench/results/serving-cpu-DATE")
    args = parser.parse_args()
    torch.set_num_threads(1)
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    out = Path(args.out or RESULTS / f"serving-cpu-{date}")
    duration = 10.0 if args.quick else 60.0
    saturation = 200 if args.quick else 1000
    records = load_prompts(CODE_PROMPTS)

    server = ServerProcess("--max-batch", "16", "--max-queue", "256")
    try:
        served = run_sweep(
            LoadConfig(
                url=server.url,
                qps=[QPS],
                duration=duration,
                routes=["default"],
                max_new_tokens=NEW_TOKENS,
            ),
            records,
            str(CODE_PROMPTS.name),
            lambda line: print(f"serving: {line}", file=sys.stderr),
        )
        write_serving_report(served, out / "qps4")
        saturated = run_sweep(
            LoadConfig(
                url=server.url,
                qps=[SATURATION_QPS],
                duration=None,
                num_requests=saturation,
                routes=[],
                baseline="default",
                max_new_tokens=SATURATION_TOKENS,
            ),
            records,
            str(CODE_PROMPTS.name),
            lambda line: print(f"saturation: {line}", file=sys.stderr),
        )
        write_serving_report(saturated, out / "saturation")
    finally:
        server.close()

    level = str(int(QPS))
    plain = served["serving"][level]["plain"]
    ngram = served["serving"][level]["default"]
    concurrency = plain["mean_concurrency"]
    model = load_model("tiny-code", torch.device("cpu"))
    tokenizer = load_tokenizer("tiny-code")
    stops = stop_token_ids(model, tokenizer)
    ids = [encode_prompt(tokenizer, r.prompt, chat=False) for r in records]
    batches = sorted({max(1, math.floor(concurrency)), max(1, math.ceil(concurrency))})
    generate(model, ids[:2], drafter=None, max_new_tokens=8, eos_token_id=stops)  # warm-up
    offline = {b: offline_tpot(model, ids, b, stops) for b in batches}
    offline_at = interpolate(offline, max(concurrency, 1.0))
    harness = bench(
        model,
        [DRAFTER],
        records,
        out / "harness",
        batch=batches,
        adaptive=False,
        max_new_tokens=NEW_TOKENS,
        tokenizer=tokenizer,
        progress=False,
    )
    harness_speedup = interpolate(
        {c["batch"]: c["speedup_tpot_p50"] for c in harness["cells"]}, max(concurrency, 1.0)
    )
    served_speedup = plain["tpot_s"]["p50"] / ngram["tpot_s"]["p50"]
    overhead = plain["tpot_s"]["p50"] / offline_at - 1.0
    checks = saturated["integrity"][str(int(SATURATION_QPS))]["default"]
    results = {
        "date": date,
        "versions": versions(),
        "server": server.command,
        "command": "python bench/bench_serving.py" + (" --quick" if args.quick else ""),
        "overhead": {
            "qps": QPS,
            "duration_s": duration,
            "mean_concurrency": concurrency,
            "served_plain_tpot_p50_s": plain["tpot_s"]["p50"],
            "generate_tpot_p50_s_by_batch": offline,
            "generate_tpot_p50_s_at_concurrency": offline_at,
            "overhead": overhead,
            "target_met": abs(overhead) <= 0.10,
        },
        "ngram": {
            "served_plain_tpot_p50_s": plain["tpot_s"]["p50"],
            "served_ngram_tpot_p50_s": ngram["tpot_s"]["p50"],
            "served_speedup_tpot_p50": served_speedup,
            "served_acceptance_rate": ngram["acceptance_rate"],
            "harness_speedup_tpot_p50_by_batch": {
                c["batch"]: c["speedup_tpot_p50"] for c in harness["cells"]
            },
            "harness_speedup_tpot_p50_at_concurrency": harness_speedup,
            "target_met": served_speedup >= harness_speedup - 0.10,
        },
        "saturation": checks
        | {
            "qps": SATURATION_QPS,
            "target_met": checks["lost"] == checks["unaccounted"] == checks["wrong_ids"] == 0
            and checks["inconsistent_outputs"] == 0
            and checks["completed"] + checks["errors"] == checks["requests"],
        },
    }
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(results, indent=1))
    return 0 if all(results[k]["target_met"] for k in ("overhead", "ngram", "saturation")) else 1


if __name__ == "__main__":
    sys.exit(main())
