"""An 8B-shaped target's draft loop against its verify forward (issue 44's GPU target: the draft
loop <= 10% of the verify forward).

A Llama with random bf16 weights in Llama-3-8B's shape (bench_step.LLAMA_8B), an EAGLE-3 head and
a DFlash head (one layer, block 16) freshly initialized for it, at batch 1 over a 512-token
prompt: bench_overhead's step breakdown (ms per step: forward, sampler, compaction, drafter =
`propose` + `update`, engine) for plain decoding and each drafter at N = 8. Random weights accept
at random, so tokens per step come from the bundled pair (`--tau-json`: bench_overhead's JSON,
whose tiny-code EAGLE-3 and DFlash breakdowns at batch 1 measured them); the predicted speed-up
over plain decoding is then tau x plain step / speculative step. Without measured tokens per step,
the break-even tau (speculative step / plain step) is reported.

    python bench/bench_draft_loop.py [--tiny] [--tau-json overhead.json] [--json PATH]

`--tiny` (and any run on the CPU) uses bench_step's tiny shape: the CI smoke run.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from bench_generate import random_prompts
from bench_overhead import Breakdown, Model, breakdown, fmt_breakdown
from bench_step import DTYPE, LLAMA_8B, TINY, build_model
from common import RESULTS_DIR, bench_device, environment, write_results

from specdec_fast import BlockDrafter, EagleDrafter
from specdec_fast.heads.block import DFlashHead
from specdec_fast.heads.eagle import Eagle3Head

# The tree budget of the bundled pair's breakdowns whose tokens per step stand in for acceptance.
NODES = 8
BLOCK_SIZE = 16
PROMPT = {True: 48, False: 512}  # tokens, by --tiny
NEW_TOKENS = {True: 12, False: 48}
# The bundled pair's breakdowns whose tokens per step stand for each drafter's acceptance.
TAU_CONFIGS = {"eagle3": "eagle:tiny-code-eagle3 N=8", "dflash": "dflash N=8"}


@dataclass
class DraftLoop:
    drafter: str
    plain_step_ms: float
    step_ms: float
    forward_ms: float
    drafter_ms: float
    drafter_share_of_forward: float  # the target: <= 0.10
    break_even_tau: float
    tau: float | None
    predicted_speedup: float | None


def measured_tau(path: Path | None) -> dict[str, float]:
    """Tokens per sequence-step of the bundled pair's EAGLE-3 and DFlash breakdowns at batch 1
    in bench_overhead's JSON (none where absent)."""
    if path is None or not path.exists():
        return {}
    records = json.loads(path.read_text()).get("breakdown", [])
    found = {}
    for name, config in TAU_CONFIGS.items():
        for record in records:
            if (record["model"], record["config"], record["batch"]) == ("tiny-code", config, 1):
                found[name] = record["tokens_per_step"]
    return found


def drafters(target: torch.nn.Module) -> dict:
    device = target.device
    torch.manual_seed(0)
    eagle3 = Eagle3Head.for_target(target).to(device, DTYPE).eval()
    vocab = target.config.vocab_size
    dflash = DFlashHead.for_target(target, block_size=BLOCK_SIZE, mask_token_id=vocab - 1)
    dflash = dflash.to(device, DTYPE).eval()
    return {
        "eagle3": lambda: EagleDrafter(eagle3, max_nodes=NODES),
        "dflash": lambda: BlockDrafter(dflash, max_nodes=NODES),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="bench_step's tiny shape (CI)")
    parser.add_argument("--tau-json", type=Path, default=None, help="bench_overhead's JSON")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    device = bench_device()
    tiny = args.tiny or device.type != "cuda"
    config = TINY if tiny else LLAMA_8B
    target = build_model(config, device)
    name = "tiny" if tiny else "Llama-3-8B-shaped"
    setup = Model(name, target, random_prompts(1, PROMPT[tiny], config["vocab_size"]))
    tokens = NEW_TOKENS[tiny]
    records: list[Breakdown] = []
    for label, make in {"plain": lambda: None, **drafters(target)}.items():
        records.append(breakdown(setup, label, make, 1, torch.get_num_threads(), tokens))
        print(fmt_breakdown(records[-1:]).splitlines()[-1], flush=True)
    plain = records[0].ms_per_step["step"]
    for record in records:
        record.vs_plain = record.tokens_per_s / records[0].tokens_per_s
    taus = measured_tau(args.tau_json)
    loops = []
    for record in records[1:]:
        ms = record.ms_per_step
        tau = taus.get(record.config)
        loops.append(
            DraftLoop(
                record.config,
                plain,
                ms["step"],
                ms["forward"],
                ms["drafter"],
                ms["drafter"] / ms["forward"],
                ms["step"] / plain,
                tau,
                None if tau is None else tau * plain / ms["step"],
            )
        )
    print(f"\n## {name}: step breakdown (ms per step, batch 1, N = {NODES})\n")
    print(fmt_breakdown(records))
    print(
        "\n| drafter | drafter ms | forward ms | drafter / forward | target | step / plain step "
        "| tau (bundled pair) | predicted speed-up |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for loop in loops:
        tau = "-" if loop.tau is None else f"{loop.tau:.2f}"
        speedup = "-" if loop.predicted_speedup is None else f"{loop.predicted_speedup:.2f}x"
        print(
            f"| {loop.drafter} | {loop.drafter_ms:.3f} | {loop.forward_ms:.3f} "
            f"| {loop.drafter_share_of_forward:.1%} | <= 10% | {loop.break_even_tau:.2f} "
            f"| {tau} | {speedup} |"
        )
    write_results(
        args.json or RESULTS_DIR / f"draft_loop-{'tiny' if tiny else device.type}.json",
        "bench_draft_loop",
        environment(device),
        [asdict(loop) for loop in loops],
        breakdown=[asdict(record) for record in records],
        model=name,
        new_tokens=tokens,
    )


if __name__ == "__main__":
    main()
