"""What a server's Python costs the decode loop beside it: in the same process, or in another.

The scheduler decodes a static batch of the shipped held-out code prompts (64 new tokens each,
no EOS, one torch thread, eager steps) on the bundled tiny-code target, three ways in turns:
alone; with a thread of this process doing Python (JSON encoding in 1 ms bursts, a quarter of
the time, as an event loop streaming tokens does); with the same work in another process. The
figure is the decode step's median over the repeats, and its ratio to the step alone. The
first is how `specdec-fast serve --no-engine-process` runs (the HTTP side on the engine's
interpreter), the second how it runs by default (`ProcessEngine`).

    python bench/bench_interpreter_lock.py    # ~3 minutes; results/interpreter_lock-cpu.{md,json}
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import threading
import time
from pathlib import Path

import torch

from specdec_fast.compiled import COMPILE_ENV
from specdec_fast.harness import versions
from specdec_fast.harness.prompts import load_prompts
from specdec_fast.loading import load_model, load_tokenizer
from specdec_fast.prompts import CODE_PROMPTS
from specdec_fast.serving import Request, Scheduler
from specdec_fast.text import encode_prompt

RESULTS = Path(__file__).resolve().parent / "results"
DUTY, BURST_S = 0.25, 0.001
NEW_TOKENS = 64
MODES = ("alone", "thread", "process")


def python_work(stop) -> None:
    """JSON encoding in BURST_S bursts, DUTY of the time, until `stop` is set."""
    payload = {"id": "cmpl-0", "choices": [{"index": 0, "text": "abc"}], "n": list(range(20))}
    while not stop.is_set():
        start = time.perf_counter()
        while time.perf_counter() - start < BURST_S:
            json.dumps(payload)
        time.sleep(BURST_S * (1 - DUTY) / DUTY)


def decode_step(model, prompts: list[list[int]]) -> float:
    """The mean decode step of one static batch of `prompts` in a scheduler."""
    scheduler = Scheduler(model, max_batch=len(prompts), overlap_prefill=False)
    for prompt in prompts:
        scheduler.submit(Request(prompt, NEW_TOKENS, eos_token_id=[]))
    scheduler.run_until_idle()
    count, seconds = scheduler.counters.decode[len(prompts)]
    return seconds / count


def measure(model, prompts, mode: str) -> float:
    spawn = multiprocessing.get_context("spawn")
    stop = spawn.Event() if mode == "process" else threading.Event()
    worker = None
    if mode == "thread":
        worker = threading.Thread(target=python_work, args=(stop,))
    elif mode == "process":
        worker = spawn.Process(target=python_work, args=(stop,))
    if worker is not None:
        worker.start()
        time.sleep(1.0 if mode == "process" else 0.1)  # the child imports first
    try:
        return decode_step(model, prompts)
    finally:
        stop.set()
        if worker is not None:
            worker.join()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7, help="turns of the three modes (7)")
    parser.add_argument("--batch", type=int, default=4, help="rows decoded together (4)")
    parser.add_argument("--out", default=str(RESULTS / "interpreter_lock-cpu"))
    args = parser.parse_args()
    os.environ[COMPILE_ENV] = "0"
    torch.set_num_threads(1)
    model = load_model("tiny-code", torch.device("cpu"))
    tokenizer = load_tokenizer("tiny-code")
    records = load_prompts(CODE_PROMPTS)[: args.batch]
    prompts = [encode_prompt(tokenizer, r.prompt, chat=False) for r in records]
    decode_step(model, prompts[:1])  # warm-up
    steps: dict[str, list[float]] = {mode: [] for mode in MODES}
    for repeat in range(args.repeats):
        for mode in MODES:
            steps[mode].append(measure(model, prompts, mode))
        print(f"repeat {repeat + 1}/{args.repeats}", flush=True)
    medians = {mode: statistics.median(values) for mode, values in steps.items()}
    result = {
        "versions": versions(),
        "command": "python bench/bench_interpreter_lock.py",
        "batch": args.batch,
        "duty": DUTY,
        "burst_s": BURST_S,
        "cpus": os.cpu_count(),
        "load_average_after": os.getloadavg(),
        "decode_step_s": steps,
        "median_step_s": medians,
        "ratio_to_alone": {mode: medians[mode] / medians["alone"] for mode in MODES},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [
        "# Python beside the decode loop: in its process or in another",
        "",
        f"`{result['command']}`: decode steps of a batch of {args.batch} on the bundled "
        f"tiny-code target (one torch thread, eager), medians of {args.repeats} turns, while "
        f"Python runs {DUTY:.0%} of the time in {BURST_S * 1e3:.0f} ms bursts.",
        "",
        "| Python work | decode step ms | ratio to alone |",
        "|---|---|---|",
    ]
    labels = {"alone": "none", "thread": "a thread of this process", "process": "another process"}
    for mode in MODES:
        ratio = result["ratio_to_alone"][mode]
        lines.append(f"| {labels[mode]} | {medians[mode] * 1e3:.2f} | {ratio:.2f}x |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
