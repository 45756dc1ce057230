"""Inductor's freezing on the CPU, side by side: a target frozen and not, in one process.

Two copies of a target (the bundled tiny-code unless `--model` names another), one whose
runners compile with freezing (`SPECDEC_FREEZE=1` when its runner is made: weights become graph
constants, prepacked for the CPU's GEMMs) and one without (`SPECDEC_FREEZE=0`), decode the same
held-out code prompts with plain decoding and each drafter of `--cells` (greedy, batch 1, no EOS
stop, compiled). Every round runs each cell frozen and not, in turns; the table gives the median
tokens/s of each, the median of the per-round ratios (frozen / not) and whether both outputs
equal plain decoding's.

    python bench/bench_freeze.py                      # default cells, 9 rounds (~6 min)
    python bench/bench_freeze.py --rounds 3 --cells plain,ngram:4
    python bench/bench_freeze.py --model FOLDER --cells plain,ngram:4   # another target

The block cells use the bundled tiny-code heads, so they need the default target.

Writes bench/results/freeze-<device>.json and .md (or `--out STEM`).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from pathlib import Path

import torch
from common import RESULTS_DIR, bench_device, environment, write_results

from specdec_fast import BlockDrafter, NGramDrafter, generate
from specdec_fast.compiled import FREEZE_ENV
from specdec_fast.drafters.block import load_block_model
from specdec_fast.loading import load_model, load_tokenizer
from specdec_fast.prompts import load_code_prompts
from specdec_fast.runner import kept_runner

CELLS = ("plain", "ngram:4", "ngram:6", "dflash:8", "dflash:16", "pard:8")
MODES = ("frozen", "not frozen")


def make_drafter(cell: str, heads: dict):
    kind, _, size = cell.partition(":")
    if kind == "plain":
        return None
    if kind == "ngram":
        return NGramDrafter(max_nodes=int(size))
    return BlockDrafter(heads[kind], max_nodes=int(size))


def decode(target, prompts, cell: str, heads: dict, tokens: int):
    """(seconds, outputs) of greedy decoding of each prompt alone with `cell`'s drafter."""
    outputs, start = [], time.perf_counter()
    with torch.no_grad():
        for prompt in prompts:
            drafter = make_drafter(cell, heads)
            out = generate(
                target,
                [prompt],
                drafter=drafter,
                max_new_tokens=tokens,
                eos_token_id=[],
                compile=True,
            )
            outputs.append(out.sequences[0].tolist())
    return time.perf_counter() - start, outputs


def run(cells, count: int, tokens: int, rounds: int, model: str = "tiny-code") -> list[dict]:
    device = bench_device()
    if device.type != "cpu":
        raise SystemExit("freezing is a CPU runner's option: run this on the CPU")
    # The block drafters' models of the cells that use them, for each target.
    kinds = {cell.partition(":")[0] for cell in cells} & {"dflash", "pard"}
    if kinds and model != "tiny-code":
        raise SystemExit(f"cells {sorted(kinds)} use the tiny-code heads: drop them or the --model")
    base = load_model(model, device)
    targets = {"frozen": base, "not frozen": copy.deepcopy(base)}
    tokenizer = load_tokenizer(model)
    prompts = [
        [tokenizer.bos_token_id, *tokenizer.encode(r["prompt"], add_special_tokens=False)]
        for r in load_code_prompts(count)
    ]
    heads = {
        mode: {kind: load_block_model(f"tiny-code-{kind}", t) for kind in kinds}
        for mode, t in targets.items()
    }
    previous = os.environ.get(FREEZE_ENV)
    seconds = {(cell, mode): [] for cell in cells for mode in MODES}
    outputs = {}
    try:
        # Each target's runners are made (and kept) under its own setting on first use.
        for round_index in range(rounds + 1):
            for cell in cells:
                for mode in MODES:
                    os.environ[FREEZE_ENV] = "1" if mode == "frozen" else "0"
                    took, out = decode(targets[mode], prompts, cell, heads[mode], tokens)
                    if round_index == 0:  # compiles: not timed
                        outputs[cell, mode] = out
                    else:
                        seconds[cell, mode].append(took)
            print(f"round {round_index}/{rounds} done", flush=True)
    finally:
        if previous is None:
            os.environ.pop(FREEZE_ENV, None)
        else:
            os.environ[FREEZE_ENV] = previous
    for mode, target in targets.items():
        runner = kept_runner(target, compile=True)
        if runner is None or runner.freeze != (mode == "frozen"):
            raise RuntimeError(f"the {mode} target's runner did not run as set")
    plain = outputs["plain", "not frozen"] if "plain" in cells else None
    generated = len(prompts) * tokens
    records = []
    for cell in cells:
        frozen, thawed = seconds[cell, "frozen"], seconds[cell, "not frozen"]
        records.append(
            {
                "cell": cell,
                "frozen_tokens_per_s": generated / statistics.median(frozen),
                "not_frozen_tokens_per_s": generated / statistics.median(thawed),
                "paired_ratio": statistics.median(
                    t / f for f, t in zip(frozen, thawed, strict=True)
                ),
                "identical": plain is None or all(outputs[cell, mode] == plain for mode in MODES),
            }
        )
    return records


HEADER = (
    "cell",
    "frozen tokens/s",
    "not frozen tokens/s",
    "frozen / not (paired)",
    "outputs equal plain decoding's",
)


def table(records: list[dict]) -> str:
    rows = [HEADER, ("---",) * len(HEADER)]
    rows += [
        (
            r["cell"],
            f"{r['frozen_tokens_per_s']:.1f}",
            f"{r['not_frozen_tokens_per_s']:.1f}",
            f"{r['paired_ratio']:.3f}x",
            str(r["identical"]),
        )
        for r in records
    ]
    return "\n".join("| " + " | ".join(row) + " |" for row in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", default=",".join(CELLS), help=f"default {','.join(CELLS)}")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--model", default="tiny-code", help="the target: bundled name or folder")
    parser.add_argument("--out", type=Path, default=None, help="output stem")
    args = parser.parse_args()
    cells = args.cells.split(",")
    records = run(cells, args.prompts, args.new_tokens, args.rounds, args.model)
    env = environment(bench_device())
    markdown = (
        f"# Inductor freezing on the CPU, {args.model}, {args.prompts} held-out code prompts x "
        f"{args.new_tokens} tokens, greedy, batch 1, medians of {args.rounds} rounds in turns "
        f"({env['date']}, {torch.get_num_threads()} threads)\n\n{table(records)}\n"
    )
    print(markdown)
    stem = args.out or RESULTS_DIR / f"freeze-{env['device']}"
    Path(f"{stem}.md").write_text(markdown)
    write_results(Path(f"{stem}.json"), "bench_freeze", env, records)


if __name__ == "__main__":
    main()
