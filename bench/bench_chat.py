"""The demo's figures on held-out prompts: SmolLM2-135M-Instruct with the drafters trained for it.

Batch 1, on held-out chat prompts (`train.chat_data.chat_prompts("heldout", ...)`: made from
the docstrings of held-out standard-library modules, never trained on), through the target's
chat template, stopping at its end of turn:

1. **Greedy**: HF `generate`, our plain decoding and each drafter answer every prompt, in turns
   over `--rounds` rounds (round r starts at contender r); median tokens/s, speed-ups against HF
   and plain, tokens per step, acceptance per depth, and whether each output equals HF's.
2. **Sampled** at temperature 0.7 (seeded): plain sampling against each drafter, in turns the
   same way (lossless: the same distribution, not the same tokens for drafters that sample their
   drafts).
3. **Step breakdown** of each drafter (ms per step: forward, sampler, compaction, drafter,
   engine), from `bench_overhead.breakdown` on the first prompt.

`--acceptance-only` measures only each drafter's tokens per step, greedy and sampled, untimed,
so that it can run over many more prompts (`--prompts 24 --max-new-tokens 64`).

    python bench/bench_chat.py --threads 2 --out bench/results/chat-smollm2-cpu-DATE
"""

from __future__ import annotations

import argparse
import os
import statistics
from dataclasses import asdict
from pathlib import Path

import torch
from bench_overhead import Model, breakdown, fmt_breakdown
from common import environment, write_results
from e2e import add_per_depth

from specdec_fast.demo_chat import (
    CHAT_DRAFTERS,
    CHAT_TARGET,
    PLAIN,
    Contender,
    engine_contender,
    hf_contender,
)
from specdec_fast.drafters.registry import DrafterSpec
from specdec_fast.engine import generate
from specdec_fast.loading import load_model, load_tokenizer
from specdec_fast.text import encode_prompt, stop_token_ids
from specdec_fast.train.chat_data import chat_prompts

TEMPERATURE, SEED = 0.7, 1234


def in_turns(contenders: list[Contender], prompts, rounds: int) -> None:
    for index in range(rounds):
        shift = index % len(contenders)
        for contender in contenders[shift:] + contenders[:shift]:
            contender.run_round(prompts)
            print(
                f"round {index + 1} {contender.name}: {contender.rates[-1]:.1f} tok/s", flush=True
            )


def per_depth(target, make, prompts, tokens: int, stop) -> list[float]:
    """Acceptance per tree depth over `prompts` (greedy, batch 1)."""
    offered, taken = [], []
    for ids in prompts:
        with torch.no_grad():
            out = generate(target, [ids], drafter=make(), max_new_tokens=tokens, eos_token_id=stop)
        for seq in out.stats.sequences:
            add_per_depth(offered, taken, seq)
    return [round(a / o, 4) if o else 0.0 for a, o in zip(taken, offered, strict=True)]


def tokens_per_step(target, make, prompts, tokens: int, stop, temperature: float) -> dict:
    """Tokens per step of a drafter over `prompts` (batch 1, seeded per prompt), untimed."""
    made = steps = 0
    for index, ids in enumerate(prompts):
        sampling = {"temperature": temperature, "seed": SEED + index}
        new, taken = engine_contender("", target, make, tokens, stop, **sampling).answer(ids)
        made, steps = made + len(new), steps + taken
    return {"temperature": temperature, "tokens": made, "tokens_per_step": made / steps}


def table(contenders: list[Contender], reference: Contender) -> list[dict]:
    plain = next(c for c in contenders if c.name == PLAIN)
    rows = []
    for c in contenders:
        rows.append(
            {
                "name": c.name,
                "tokens_per_step": c.tokens_per_step,
                "tokens_per_s": c.median_rate,
                "rounds_tokens_per_s": c.rates,
                "vs_hf": c.median_rate / reference.median_rate if reference is not plain else None,
                "vs_plain": c.median_rate / plain.median_rate,
                "identical": c.outputs == reference.outputs,
            }
        )
    return rows


def fmt(rows: list[dict]) -> str:
    lines = [
        "| contender | tok/step | tok/s (median) | vs HF | vs plain | identical |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        per_step = f"{r['tokens_per_step']:.2f}" if r["tokens_per_step"] else "-"
        vs_hf = f"{r['vs_hf']:.2f}x" if r["vs_hf"] is not None else "-"
        lines.append(
            f"| {r['name']} | {per_step} | {r['tokens_per_s']:.1f} | {vs_hf} | "
            f"{r['vs_plain']:.2f}x | {'yes' if r['identical'] else 'NO'} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--dtype", default="float32", help="the demo's default: float32")
    parser.add_argument("--drafter", action="append", help=f"default: {CHAT_DRAFTERS}")
    parser.add_argument("--no-sampled", action="store_true")
    parser.add_argument(
        "--compile", action="store_true", help="compiled steps (default: eager, as the demo)"
    )
    parser.add_argument(
        "--acceptance-only",
        action="store_true",
        help="only each drafter's tokens per step, greedy and sampled (untimed: many prompts)",
    )
    parser.add_argument("--out", type=Path, required=True, help="results folder")
    args = parser.parse_args()
    os.environ["SPECDEC_COMPILE"] = "1" if args.compile else "0"
    torch.set_num_threads(args.threads)
    device = torch.device("cpu")
    target = load_model(CHAT_TARGET, device, args.dtype)
    tokenizer = load_tokenizer(CHAT_TARGET)
    stop = stop_token_ids(target, tokenizer)
    prompts = [
        encode_prompt(tokenizer, messages=m, chat=True)
        for m in chat_prompts("heldout", args.prompts)
    ]
    specs = [DrafterSpec.parse(s) for s in args.drafter or CHAT_DRAFTERS]
    factories = {spec.label(): spec.factory(target) for spec in specs}
    tokens = args.max_new_tokens
    env = {**environment(device), "threads": args.threads, "dtype": str(target.dtype)}
    if args.acceptance_only:
        rows = []
        for name, make in factories.items():
            for temperature in (0.0, TEMPERATURE):
                row = tokens_per_step(target, make, prompts, tokens, stop, temperature)
                rows.append({"name": name, **row})
                print(f"{name} at {temperature}: {row['tokens_per_step']:.3f} tokens/step")
        write_results(args.out / "results.json", "chat-acceptance", env, rows, prompts=len(prompts))
        return

    greedy = [
        hf_contender(target, tokens, stop),
        engine_contender(PLAIN, target, lambda: None, tokens, stop),
        *(engine_contender(n, target, f, tokens, stop) for n, f in factories.items()),
    ]
    in_turns(greedy, prompts, args.rounds)
    greedy_rows = table(greedy, greedy[0])
    for row in greedy_rows[2:]:
        row["acceptance_per_depth"] = per_depth(
            target, factories[row["name"]], prompts, tokens, stop
        )
    print("\n## Greedy\n\n" + fmt(greedy_rows))

    sampled_rows = []
    if not args.no_sampled:
        sampling = {"temperature": TEMPERATURE, "seed": SEED}
        sampled = [
            engine_contender(PLAIN, target, lambda: None, tokens, stop, **sampling),
            *(
                engine_contender(n, target, f, tokens, stop, **sampling)
                for n, f in factories.items()
            ),
        ]
        in_turns(sampled, prompts, args.rounds)
        sampled_rows = table(sampled, sampled[0])
        print(f"\n## Sampled, temperature {TEMPERATURE}\n\n" + fmt(sampled_rows))

    setup = Model(CHAT_TARGET, target, prompts)
    steps = [breakdown(setup, n, f, 1, args.threads, tokens) for n, f in factories.items()]
    steps.insert(0, breakdown(setup, PLAIN, lambda: None, 1, args.threads, tokens))
    print("\n## Step breakdown (ms per step, first prompt)\n\n" + fmt_breakdown(steps))

    write_results(
        args.out / "results.json",
        "chat",
        env,
        greedy_rows,
        sampled=sampled_rows,
        breakdown=[asdict(b) for b in steps],
        prompts=len(prompts),
        max_new_tokens=tokens,
        rounds=args.rounds,
        median_of_hf=statistics.median(greedy[0].rates),
    )


if __name__ == "__main__":
    main()
