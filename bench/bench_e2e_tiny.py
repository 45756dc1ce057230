"""The bundled tiny-code pair on held-out code prompts: every drafter at several tree budgets.

Every registered drafter over the bundled checkpoints (`specdec_fast.drafters.registry`), trees at
N = 8/16/32/64 verified tokens (root included), chains at k = 2/3/4/6 drafted tokens (N = k + 1).
For each drafter and budget: acceptance rate, per-position acceptance, mean accepted tokens per
step, tokens/s, and the speed-up against our plain decoding and HF `generate`; HF assisted
generation (draft model, prompt lookup) runs in the same process on the same prompts. Greedy, batch
1, no EOS stop. Writes JSON and a markdown table (default:
bench/results/e2e_tiny-<device>.json and .md).

Run as `python bench/bench_e2e_tiny.py [--quick]`, or `pytest bench/bench_e2e_tiny.py
--benchmark-only` (needs the bundled models).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from common import RESULTS_DIR, bench_device, environment, write_results
from e2e import E2ERecord, compare, format_table, run_hf, run_ours

from specdec_fast import bundled
from specdec_fast.drafters.base import Drafter
from specdec_fast.drafters.registry import bundled_specs

BUDGETS = (8, 16, 32, 64)
CHAIN_LENGTHS = (2, 3, 4, 6)


def drafter_grid(target, quick: bool) -> dict[str, Callable[[], Drafter | None]]:
    """Every bundled drafter at each budget N (chains at each length k), by display name."""
    grid: dict[str, Callable[[], Drafter | None]] = {"ours plain": lambda: None}
    for spec in bundled_specs():
        make = spec.factory(target)
        sizes = CHAIN_LENGTHS if spec.info.chain else BUDGETS
        for size in sizes[:2] if quick else sizes:
            grid[spec.label(size)] = lambda make=make, size=size: make(size)
    return grid


def load_pair(device: torch.device):
    from specdec_fast.loading import load_model, load_tokenizer
    from specdec_fast.prompts import load_code_prompts

    target = load_model("tiny-code", device)
    draft = load_model("tiny-code-draft", device, target.dtype)
    tokenizer = load_tokenizer("tiny-code")
    return target, draft, tokenizer, load_code_prompts


def run(
    quick: bool, count: int | None = None, new_tokens: int | None = None
) -> tuple[list[E2ERecord], dict]:
    device = bench_device()
    torch.manual_seed(0)
    target, draft, tokenizer, load_prompts = load_pair(device)
    count = count or (2 if quick else 8)
    new_tokens = new_tokens or (32 if quick else 96)
    prompts = [
        [tokenizer.bos_token_id, *tokenizer.encode(r["prompt"], add_special_tokens=False)]
        for r in load_prompts(count)
    ]
    records, outputs = [], {}
    for name, make in drafter_grid(target, quick).items():
        record, out = run_ours(name, target, prompts, make, new_tokens, 1)
        records.append(record)
        outputs[name] = out
        print(f"{record.peer}: {record.tokens_per_s:.1f} tokens/s", flush=True)
    for name, kwargs in (
        ("HF generate", {}),
        ("HF assisted (draft model)", {"assistant_model": draft}),
        ("HF prompt lookup", {"prompt_lookup_num_tokens": 4}),
    ):
        record, out = run_hf(name, target, prompts, new_tokens, **kwargs)
        records.append(record)
        outputs[name] = out
        print(f"{record.peer}: {record.tokens_per_s:.1f} tokens/s", flush=True)
    compare(records, outputs)
    setup = {"prompts": len(prompts), "max_new_tokens": new_tokens, "batch": 1}
    return records, setup


@pytest.mark.skipif("tiny-code" not in bundled.available(), reason="bundled models missing")
def test_e2e_tiny(benchmark):
    benchmark.group = "e2e tiny-code"
    records, _ = benchmark.pedantic(run, args=(True,), rounds=1, iterations=1)
    benchmark.extra_info["records"] = [r.to_dict() for r in records]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="2 prompts, budgets N = 8 and 16, chains k = 2 and 3"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="output stem (default: bench/results/e2e_tiny-<device>)",
    )
    parser.add_argument("--prompts", type=int, default=None, help="default: 8 (2 with --quick)")
    parser.add_argument(
        "--new-tokens", type=int, default=None, help="default: 96 (32 with --quick)"
    )
    args = parser.parse_args()
    records, setup = run(args.quick, args.prompts, args.new_tokens)
    env = environment(bench_device())
    title = (
        f"tiny-code pair, {setup['prompts']} held-out code prompts x "
        f"{setup['max_new_tokens']} new tokens, greedy, batch 1, on "
        f"{env['gpu'] or 'CPU'} ({env['date']})"
    )
    table = format_table(records)
    positions = "\n".join(
        f"- {r.peer}: " + ", ".join(f"{p:.2f}" for p in r.per_position[:8])
        for r in records
        if r.per_position
    )
    markdown = (
        f"# End-to-end, {title}\n\n{table}\n\nPer-position acceptance (depth 1, 2, ...):\n"
        f"{positions}\n"
    )
    print(markdown)
    stem = args.out or RESULTS_DIR / f"e2e_tiny-{env['device']}"
    write_results(
        stem.with_suffix(".json"),
        "bench_e2e_tiny",
        env,
        [r.to_dict() for r in records],
        setup=setup,
    )
    stem.with_suffix(".md").write_text(markdown)
    print(f"wrote {stem.with_suffix('.md')}")


if __name__ == "__main__":
    main()
