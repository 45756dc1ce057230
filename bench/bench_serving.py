"""Issue 18's targets for `specdec-fast serve`, on the bundled tiny-code target on the CPU.

1. Scheduler overhead: at 4 QPS for 60 s (Poisson, seed 0, the shipped held-out code prompts,
   64 new tokens each), the served plain route's TPOT p50 against `generate()`'s at the same
   concurrency: each request's concurrency is the mean number of requests in flight during its
   life (the batch it was decoded in), `generate()`'s TPOT at that batch size is interpolated
   from static batches of the same prompts, and the p50 of those is the reference. Target:
   within 10%. Reported beside it, to tell the causes apart: the server's decode steps against
   `generate()`'s at the same batch sizes, the share of the time spent feeding newcomers'
   prompts (which a static batch never pays), and the same level replayed without HTTP on a
   scheduler in this process (its TPOT at the same concurrency, and its decode steps against
   `generate()`'s: the scheduler's own overhead), once with prompts fed between its steps and
   once beside them (`Scheduler(overlap_prefill=...)`), in turns. The server feeds prompts
   beside its steps (`--serial-prefill`: between them).
2. N-gram speculation: the served `ngram:8` routes' TPOT p50 improvement over the plain route at
   4 QPS against what the offline harness (`specdec_fast.harness.bench`, paired runs) measures
   for `ngram:8` at that concurrency (the plain route's). Target: at least the harness's minus
   10%. Two routes serve `ngram:8`, in turn with the plain one: `default` with `log_only`
   guardrails (no runtime fallback, as the harness runs), and `guarded` with the server's
   default guardrails (a 16-64-step window of acceptance below 0.1 switches it to plain
   decoding for 256 steps). Reported beside each: what the harness predicts for the route
   served at its own concurrency (its plain TPOT at the plain route's concurrency over its
   n-gram TPOT at the route's): under Poisson arrivals a slower route holds more requests at
   once, and each of its steps then costs more, which a fixed-batch harness never sees.
3. Saturation: 1,000 requests (16 new tokens each) arriving at 200 QPS, well above what the
   CPU serves, on the n-gram route with a queue of 256: every request must get exactly one
   complete response or one error (429), none lost or duplicated (client records, the server's
   counters and greedy outputs cross-checked).

The server runs as its own process (`specdec-fast serve`, its engine in a child process of its own
unless `--no-engine-process`, one torch thread, eager steps:
`--no-compile`, which is faster than compiled steps for this 6M-parameter model on a CPU),
the load generator in this one. The 4 QPS level runs in six segments, the plain and the n-gram
routes in turn; between segments, while the server idles, this process times `generate()`'s
steps (eight batch sizes from 1 to 16, one torch thread) and replays the segment's arrivals on
its own scheduler: on a shared machine whose speed drifts, served and offline figures then come
from the same minutes. The harness runs last.

    python bench/bench_serving.py            # ~12 minutes; writes bench/results/serving-cpu-DATE/
    python bench/bench_serving.py --quick    # 10 s at 4 QPS, 200 saturation requests
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx
import numpy
import torch

from specdec_fast import generate
from specdec_fast.compiled import COMPILE_ENV
from specdec_fast.harness import bench, versions
from specdec_fast.harness.prompts import load_prompts
from specdec_fast.loading import load_model, load_tokenizer
from specdec_fast.prompts import CODE_PROMPTS
from specdec_fast.serving import Request, Scheduler
from specdec_fast.serving.loadgen import (
    LoadConfig,
    RequestRecord,
    arrival_times,
    experienced_concurrency,
    run_sweep,
    write_serving_report,
)
from specdec_fast.stats import percentile
from specdec_fast.text import encode_prompt, stop_token_ids

RESULTS = Path(__file__).resolve().parent / "results"
NEW_TOKENS = 64
QPS = 4.0
SATURATION_QPS = 200.0
SATURATION_TOKENS = 16
DRAFTER = "ngram:8"
ROUNDS = 6  # segments of the 4 QPS level, plain and n-gram routes in turn, generate() timed between
MAX_BATCH = 16  # the server's slots
TIMED_BATCHES = (1, 2, 3, 4, 6, 8, 12, 16)  # generate()'s step timed at these, interpolated
PREFILL_MODES = ("serial", "beside")  # prompts fed between the steps, or beside them
GUARDED = "guarded"  # a second `ngram:8` route, with the server's default guardrails
ROUTES_YAML = f'routes:\n  {GUARDED}: {{drafter: "{DRAFTER}"}}\n'
# The harness measures speculation without runtime fallback; the default route likewise (each
# breach is counted, none switches it to plain decoding), the guarded one as the server ships.
GUARDRAILS_YAML = (
    "speculative_decoding_guardrails:\n"
    "  fallback_action: log_only\n"
    f"  routes:\n    {GUARDED}: {{fallback_action: plain_decoding}}\n"
)


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
            "--log-level", "warning", "--no-compile", *args,
        ]  # fmt: skip
        self.command = " ".join(command[2:])
        self.process = subprocess.Popen(command)
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


def step_time(model, prompts: list[list[int]], batch: int) -> float:
    """generate()'s TPOT p50 (plain decoding) for a static batch of `batch` prompts that all run
    NEW_TOKENS steps (no EOS): the time of one decode step at that batch size."""
    out = generate(model, prompts[:batch], drafter=None, max_new_tokens=NEW_TOKENS, eos_token_id=[])
    return percentile(out.stats.tpot, 50)


def replay(scheduler: Scheduler, prompts: list[list[int]], duration: float, seed: int) -> list:
    """The served level without HTTP: the same Poisson arrivals submitted to `scheduler` in
    this process, stepped on this thread; returns each request's `RequestRecord` (send time,
    TPOT, end-to-end latency)."""
    times = arrival_times(QPS, duration, None, seed)
    handles, start = [], time.perf_counter()
    while len(handles) < len(times) or any(h.completion is None for h in handles):
        now = time.perf_counter() - start
        while len(handles) < len(times) and times[len(handles)] <= now:
            index = len(handles)
            handles.append(scheduler.submit(Request(prompts[index % len(prompts)], NEW_TOKENS)))
        if not scheduler.step():
            time.sleep(0.0005)
    return [
        RequestRecord(
            i,
            i % len(prompts),
            "in-process",
            h.completion.arrival - start,
            tpot=h.completion.stats.tpot,
            e2e=h.completion.finished - h.completion.arrival,
        )
        for i, h in enumerate(handles)
    ]


def versus(steps: dict[int, float], served: dict[int, list]) -> float:
    """Decode steps measured in a scheduler ({B: [steps, seconds]}) against `generate()`'s at
    the same batch sizes, weighted by the scheduler's steps: the relative excess."""
    measured = sum(seconds for count, seconds in served.values() if count)
    expected = sum(count * interpolate(steps, b) for b, (count, _) in served.items() if count)
    return measured / expected - 1.0


def interpolate(values: dict[int, float], at: float) -> float:
    """Piecewise-linear through the points (key, value), clamped to the keys' range."""
    keys = sorted(values)
    return float(numpy.interp(at, keys, [values[k] for k in keys]))


def in_process_figures(scheduler: Scheduler, records: list[RequestRecord], steps: dict) -> dict:
    """A replay's TPOT p50 against `generate()`'s at its concurrency, its decode steps against
    `generate()`'s at the same batch sizes, and where its time went."""
    tpot = percentile([r.tpot for r in records if r.tpot is not None], 50)
    expected = percentile([interpolate(steps, c) for c in experienced_concurrency(records)], 50)
    wall = records[-1].sent + records[-1].e2e
    counters = scheduler.counters
    return {
        "requests": len(records),
        "tpot_p50_s": tpot,
        "generate_tpot_p50_s_at_experienced_concurrency": expected,
        "overhead": tpot / expected - 1.0,
        "decode_step_s_by_batch": {
            b: seconds / count for b, (count, seconds) in counters.decode.items()
        },
        "decode_step_overhead": versus(steps, counters.decode),
        "prefill_share_of_wall": counters.prefill_seconds / wall,
        "prefill_beside_share_of_wall": counters.prefill_beside_seconds / wall,
    }


def ngram_figures(plain: dict, route: dict, harness: dict) -> dict:
    """A served n-gram route's TPOT p50 speed-up over the plain route against the harness's
    (`bench`'s report, batches spanning both routes' concurrencies): at the plain route's
    concurrency (the target's reference), and predicted for the route served at its own."""
    at = plain["mean_concurrency"]
    speedups = {c["batch"]: c["speedup_tpot_p50"] for c in harness["cells"]}
    ngram_tpot = {c["batch"]: c["metrics"]["tpot_s"]["p50"] for c in harness["cells"]}
    plain_tpot = {int(b): m["tpot_s"]["p50"] for b, m in harness["baseline"].items()}
    reference = interpolate(speedups, at)
    served = plain["tpot_s"]["p50"] / route["tpot_s"]["p50"]
    return {
        "served_plain_tpot_p50_s": plain["tpot_s"]["p50"],
        "served_ngram_tpot_p50_s": route["tpot_s"]["p50"],
        "served_speedup_tpot_p50": served,
        "served_acceptance_rate": route["acceptance_rate"],
        "served_tokens_per_step": route["mean_accepted_tokens_per_step"],
        "plain_mean_concurrency": at,
        "ngram_mean_concurrency": route["mean_concurrency"],
        "harness_speedup_tpot_p50_by_batch": speedups,
        "harness_speedup_tpot_p50_at_concurrency": reference,
        "harness_predicted_served_speedup": interpolate(plain_tpot, at)
        / interpolate(ngram_tpot, route["mean_concurrency"]),
        "target_met": served >= reference - 0.10,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="10 s levels, 200 requests")
    parser.add_argument("--out", default=None, help="default: bench/results/serving-cpu-DATE")
    parser.add_argument(
        "--serial-prefill",
        action="store_true",
        help="the server feeds prompts between its decode steps (default: beside them)",
    )
    parser.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the server's engine in a child process (default), or on a thread of the server",
    )
    args = parser.parse_args()
    # Eager steps everywhere, as the server's (see the module doc).
    os.environ[COMPILE_ENV] = "0"
    torch.set_num_threads(1)
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    out = Path(args.out or RESULTS / f"serving-cpu-{date}")
    duration = 10.0 if args.quick else 60.0
    saturation = 200 if args.quick else 1000
    records = load_prompts(CODE_PROMPTS)

    model = load_model("tiny-code", torch.device("cpu"))
    tokenizer = load_tokenizer("tiny-code")
    ids = [encode_prompt(tokenizer, r.prompt, chat=False) for r in records]
    generate(model, ids[:2], drafter=None, max_new_tokens=8, eos_token_id=[])  # warm-up
    measured: dict[int, list[float]] = {b: [] for b in TIMED_BATCHES}
    # The scheduler alone, in this process (its own model copy, the model's stop ids), with
    # prompts fed on its thread and beside its steps, in turns.
    local_model = load_model("tiny-code", torch.device("cpu"))
    locals_ = {
        mode: Scheduler(
            local_model,
            None,
            eos_token_id=stop_token_ids(model, tokenizer),
            overlap_prefill=mode == "beside",
        )
        for mode in PREFILL_MODES
    }
    local_records: dict[str, list[RequestRecord]] = {mode: [] for mode in PREFILL_MODES}
    rounds = 2 if args.quick else ROUNDS

    def between(qps, segment) -> None:
        # Between two segments of served traffic, while the server idles: the same minutes.
        for batch, times in measured.items():
            times.append(step_time(model, ids, batch))
        for mode in PREFILL_MODES[:: 1 if segment % 2 else -1]:
            done = local_records[mode]
            records = replay(locals_[mode], ids, duration / rounds, segment)
            offset = done[-1].sent + done[-1].e2e if done else 0.0
            for record in records:
                record.sent += offset
                record.index += len(done)
            done.extend(records)

    load_before = os.getloadavg()
    server_prefill = "serial" if args.serial_prefill else "beside"
    out.mkdir(parents=True, exist_ok=True)
    (out / "guardrails.yaml").write_text(GUARDRAILS_YAML)
    (out / "routes.yaml").write_text(ROUTES_YAML)
    server = ServerProcess(
        "--max-batch",
        str(MAX_BATCH),
        "--max-queue",
        "256",
        "--no-overlap-prefill" if args.serial_prefill else "--overlap-prefill",
        "--engine-process" if args.engine_process else "--no-engine-process",
        "--guardrails",
        str(out / "guardrails.yaml"),
        "--routes",
        str(out / "routes.yaml"),
    )
    try:
        served = run_sweep(
            LoadConfig(
                url=server.url,
                qps=[QPS],
                duration=duration,
                routes=["default", GUARDED],
                max_new_tokens=NEW_TOKENS,
                rounds=rounds,
            ),
            records,
            str(CODE_PROMPTS.name),
            lambda line: print(f"serving: {line}", file=sys.stderr),
            between,
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
        load_after = os.getloadavg()
        server.close()

    level = str(int(QPS))
    plain = served["serving"][level]["plain"]
    ngram = served["serving"][level]["default"]
    requests = [r for r in served["requests"][level]["plain"] if r["error"] is None]
    scheduler = plain["scheduler"]
    steps = {b: statistics.median(times) for b, times in measured.items()}
    # TPOT at the same concurrency: each request's, from the batch it was decoded in.
    concurrency = experienced_concurrency([RequestRecord(**r) for r in requests])
    expected = percentile([interpolate(steps, c) for c in concurrency], 50)
    overhead = plain["tpot_s"]["p50"] / expected - 1.0
    # The scheduler's own step against generate()'s at the same batch sizes, served and alone.
    counts = {int(b): n for b, n in scheduler["decode_steps_by_batch"].items()}
    served_steps = {int(b): t for b, t in scheduler["decode_step_s_by_batch"].items()}
    step_overhead = versus(steps, {b: [counts[b], counts[b] * served_steps[b]] for b in counts})
    in_process = {
        mode: in_process_figures(locals_[mode], local_records[mode], steps)
        for mode in PREFILL_MODES
    }
    for local in locals_.values():
        local.close()
    mean_concurrency = plain["mean_concurrency"]
    # The n-gram routes and their guardrails.
    routes = {
        "default": (ngram, "log_only"),
        GUARDED: (served["serving"][level][GUARDED], "default"),
    }
    spans = [mean_concurrency] + [route["mean_concurrency"] for route, _ in routes.values()]
    batches = sorted(range(max(1, math.floor(min(spans))), max(1, math.ceil(max(spans))) + 1))
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
    ngram_results = {
        name: ngram_figures(plain, route, harness) | {"guardrails": guardrails}
        for name, (route, guardrails) in routes.items()
    }
    checks = saturated["integrity"][str(int(SATURATION_QPS))]["default"]
    results = {
        "date": date,
        "versions": versions(),
        "server": server.command,
        "command": "python bench/bench_serving.py" + (" --quick" if args.quick else ""),
        # The machine's 1, 5 and 15 minute load averages around the served levels (its CPUs:
        # os.cpu_count()); a load above the CPU count slows every figure alike, but it also
        # pushes the served level nearer to saturation.
        "load_average": {"before": load_before, "after": load_after, "cpus": os.cpu_count()},
        "overhead": {
            "qps": QPS,
            "duration_s": duration,
            "mean_concurrency": mean_concurrency,
            "experienced_concurrency": plain["experienced_concurrency"],
            "served_plain_tpot_p50_s": plain["tpot_s"]["p50"],
            "generate_step_s_by_batch": steps,
            "generate_tpot_p50_s_at_experienced_concurrency": expected,
            "overhead": overhead,
            "target_met": overhead <= 0.10,
            "served_decode_step_s_by_batch": served_steps,
            "served_decode_steps_by_batch": counts,
            "decode_step_overhead": step_overhead,
            "server_prefill": server_prefill,
            "server_engine": "process" if args.engine_process else "thread",
            "prefill_share_of_wall": scheduler["prefill_share"],
            "prefill_beside_share_of_wall": scheduler["prefill_beside_share"],
            "decode_share_of_wall": scheduler["decode_share"],
            "in_process": in_process,
        },
        # The target is checked on the route as `serve` runs it by default (guardrails on);
        # the log_only route's figures show the drafter without fallback.
        "ngram": ngram_results | {"target_met": ngram_results[GUARDED]["target_met"]},
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
