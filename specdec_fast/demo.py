"""`specdec-fast demo`: the bundled models on held-out code, plain decoding against every drafter.

For each drafter it completes the same held-out prompts greedily and prints, side by side with
plain decoding: acceptance rate, mean accepted tokens per step, tokens/s, the speed-up, and whether
the output is identical to plain decoding (it must be: greedy speculation is exact).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specdec_fast import bundled
from specdec_fast.drafters.base import Drafter
from specdec_fast.drafters.registry import bundled_specs
from specdec_fast.engine import generate
from specdec_fast.loading import load_model, load_tokenizer, pick_device
from specdec_fast.prompts import load_code_prompts


@dataclass
class DemoRow:
    name: str
    sequences: list[list[int]]
    seconds: float
    new_tokens: int
    acceptance: float | None
    tokens_per_step: float | None


def demo_drafters(target) -> dict[str, Callable[[], Drafter | None]]:
    """Plain decoding and every registered drafter over the bundled checkpoints installed, at
    its default size, by display name."""
    drafters: dict[str, Callable[[], Drafter | None]] = {"plain": lambda: None}
    for spec in bundled_specs():
        drafters[spec.label()] = spec.factory(target)
    return drafters


def run(prompts: list[list[int]], target, make_drafter, max_new_tokens: int) -> DemoRow:
    start = time.perf_counter()
    with torch.no_grad():
        out = generate(target, prompts, drafter=make_drafter(), max_new_tokens=max_new_tokens)
    seconds = time.perf_counter() - start
    stats = out.stats
    return DemoRow(
        name="",
        sequences=[s.tolist() for s in out.sequences],
        seconds=seconds,
        new_tokens=stats.new_tokens,
        acceptance=stats.acceptance_rate,
        tokens_per_step=stats.mean_accepted_per_step,
    )


def _fmt(value: float | None, spec: str) -> str:
    """`value` formatted with `spec` ("8.1%"), or a dash of the same width."""
    return format(value, spec) if value is not None else "-".rjust(int(spec.split(".")[0]))


def main(num_prompts: int = 4, max_new_tokens: int = 64, device: str | None = None) -> int:
    if "tiny-code" not in bundled.available():
        print(
            "specdec-fast demo: the bundled target 'tiny-code' is missing from this install",
            file=sys.stderr,
        )
        return 2
    device = pick_device(device)
    if device.type == "cpu":
        # The bundled models are tiny: one intra-op thread beats several, whose synchronization
        # costs more than these matmuls (and stalls badly when the machine is shared).
        torch.set_num_threads(1)
    torch.manual_seed(0)
    target = load_model("tiny-code", device)
    tokenizer = load_tokenizer("tiny-code")
    records = load_code_prompts(num_prompts)
    prompts = [
        [tokenizer.bos_token_id, *tokenizer.encode(r["prompt"], add_special_tokens=False)]
        for r in records
    ]
    print(
        f"specdec-fast demo: bundled tiny-code target on {device}, {len(prompts)} held-out "
        f"code prompts, {max_new_tokens} new tokens each, greedy\n"
    )
    rows = []
    for name, make in demo_drafters(target).items():
        # One untimed warm-up run per drafter, so every row is measured warm.
        run(prompts[:1], target, make, 4)
        row = run(prompts, target, make, max_new_tokens)
        row.name = name
        rows.append(row)
        print(f"  ran {name}: {row.seconds:.2f}s", file=sys.stderr)
    baseline = rows[0]
    first = records[0]
    completion = tokenizer.decode(baseline.sequences[0][len(prompts[0]) :])
    print(f"--- prompt 1 ({first['source']}), last lines ---")
    print("\n".join(first["prompt"].rstrip("\n").splitlines()[-4:]))
    print("--- greedy completion (identical for every drafter marked yes) ---")
    print(completion)
    print("---\n")
    width = max(len(row.name) for row in rows) + 2
    header = (
        f"{'drafter':<{width}}{'accept':>8}{'tok/step':>10}{'tok/s':>9}{'speed-up':>10}"
        f"{'identical':>11}"
    )
    print(header)
    print("-" * len(header))
    base_rate = baseline.new_tokens / baseline.seconds
    for row in rows:
        rate = row.new_tokens / row.seconds
        same = "yes" if row.sequences == baseline.sequences else "NO"
        print(
            f"{row.name:<{width}}{_fmt(row.acceptance, '8.1%')}{_fmt(row.tokens_per_step, '10.2f')}"
            f"{rate:9.1f}{rate / base_rate:9.2f}x{same:>11}"
        )
    identical = all(row.sequences == baseline.sequences for row in rows)
    print(
        "\ngreedy speculative output identical to plain decoding:",
        "yes, for every drafter" if identical else "NO",
    )
    return 0 if identical else 1
