"""The bundled tiny-code pair on held-out code prompts: every drafter at several tree budgets.

Every registered drafter over the bundled checkpoints (`specdec_fast.drafters.registry`), trees at
N = 8/16/32/64 verified tokens (root included), chains at k = 2/3/4/6 drafted tokens (N = k + 1).
For each drafter and budget: acceptance rate, per-position acceptance, mean accepted tokens per
step, tokens/s, and the speed-up against our plain decoding and HF `generate`; HF assisted
generation (draft model, prompt lookup) runs in the same process on the same prompts. Greedy, batch
1, no EOS stop. Writes JSON and a markdown table (default:
bench/results/e2e_tiny-<device>.json and .md), and a PNG of the per-position acceptance of the
EAGLE and block drafters at one budget (`--plot-budget`, default 16; needs matplotlib) with, in
the table's notes, the tokens per step of the best block drafter against each EAGLE head's.
`--budgets`, `--chain-lengths` and `--kinds` narrow the sweep (e.g. `--budgets 16 --kinds
eagle,block`, or `--kinds block-chain --chain-lengths 3,5`);
`--float32-heads` adds each DFlash head computing in float32 beside its default dtype (bfloat16
on CPUs with bfloat16 units, `loading.drafter_dtype`).
Plain decoding and one EAGLE drafter (EAGLE-3's at N = 16 when in the grid) run once more with
`generate(read_ahead=...)` the other way round from the device's default (on for CUDA): what
queuing each step before reading the one before is worth; and twice more through the server's
scheduler (`..., served`, one request at a time, with and without its read-ahead): what the
server's loop costs beside `generate`'s.

Speed is measured over `--rounds` rounds (default 3, 1 with `--quick`) in which every peer runs
once in turn (`e2e.interleave`): tokens/s is the median of the rounds, each speed-up the median of
the per-round ratios, and the table gives each peer's min-max over the rounds. The notes rank the
fastest block drafter against the fastest other drafter at batch 1 (the issue's speed target).

Run as `python bench/bench_e2e_tiny.py [--quick]`, or `pytest bench/bench_e2e_tiny.py
--benchmark-only` (needs the bundled models).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from common import RESULTS_DIR, bench_device, environment, write_results
from e2e import (
    E2ERecord,
    compare,
    format_table,
    interleave,
    paired_ratio,
    run_hf,
    run_ours,
    run_served,
)

from specdec_fast import BlockDrafter, bundled
from specdec_fast.drafters.base import Drafter
from specdec_fast.drafters.block import load_block_model
from specdec_fast.drafters.registry import bundled_specs
from specdec_fast.heads.block import is_dflash_config
from specdec_fast.heads.checkpoint import read_config, resolve_folder

BUDGETS = (8, 16, 32, 64)
CHAIN_LENGTHS = (2, 3, 4, 6)
# The drafters of the acceptance plot: EAGLE-2/EAGLE-3 heads and the block drafters.
PLOTTED_KINDS = ("eagle", "block")


@dataclass(frozen=True)
class Cell:
    """A drafter of the grid: how to make it, its registry kind and its budget N."""

    make: Callable[[], Drafter | None]
    kind: str | None
    nodes: int


def drafter_grid(
    target,
    quick: bool,
    budgets: Sequence[int] = BUDGETS,
    kinds: Sequence[str] | None = None,
    float32_heads: bool = False,
    chain_lengths: Sequence[int] = CHAIN_LENGTHS,
) -> dict[str, Cell]:
    """Every bundled drafter (of `kinds`, default all) at each budget N (chains at each length
    k of `chain_lengths`), by display name; `float32_heads` adds each DFlash head again
    computing in float32 (the target's dtype on the CPU, `load_dflash_head(dtype=...)`) beside
    its default dtype."""
    grid = {"ours plain": Cell(lambda: None, None, 1)}
    for spec in bundled_specs():
        if kinds is not None and spec.kind not in kinds:
            continue
        make = spec.factory(target)
        sizes = chain_lengths if spec.info.chain else budgets
        for size in sizes[:2] if quick else sizes:
            grid[spec.label(size)] = Cell(
                lambda make=make, size=size: make(size), spec.kind, spec.nodes(size)
            )
        dflash = spec.kind == "block" and is_dflash_config(read_config(resolve_folder(spec.path)))
        if float32_heads and dflash:
            head = load_block_model(spec.path, target, torch.float32)
            for size in sizes[:2] if quick else sizes:
                grid[f"{spec.label(size)} [float32 head]"] = Cell(
                    lambda head=head, size=size: BlockDrafter(head, max_nodes=size),
                    spec.kind,
                    spec.nodes(size),
                )
    return grid


def read_ahead_peer(grid: dict[str, Cell]) -> str | None:
    """The grid's last EAGLE drafter (EAGLE-3's, bundled after EAGLE-1's) at the largest budget
    up to 16 nodes, a drafter that reads ahead; None without one."""
    eagles = [(cell.nodes, name) for name, cell in grid.items() if cell.kind == "eagle"]
    fitting = [(nodes, name) for nodes, name in eagles if nodes <= 16] or eagles
    return max(reversed(fitting), key=lambda pair: pair[0])[1] if fitting else None


def plot_acceptance(
    records: Sequence[E2ERecord], grid: dict[str, Cell], budget: int, path: Path
) -> Path | None:
    """A PNG of the per-position acceptance of the EAGLE and block drafters at `budget` nodes;
    None without matplotlib or without such a drafter."""
    series = [
        r
        for r in records
        if r.peer in grid and grid[r.peer].kind in PLOTTED_KINDS and grid[r.peer].nodes == budget
    ]
    if not series:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot skipped: matplotlib is not installed (pip install 'specdec-fast[plot]')")
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for record in series:
        depths = range(1, len(record.per_position) + 1)
        label = f"{record.peer} ({record.tokens_per_step:.2f} tokens/step)"
        ax.plot(depths, record.per_position, marker="o", label=label)
    ax.set(
        xlabel="draft position (depth)",
        ylabel="acceptance",
        ylim=(0, 1),
        title=f"Per-position acceptance, N = {budget} (root included)",
    )
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def block_vs_eagle(records: Sequence[E2ERecord], grid: dict[str, Cell], budget: int) -> list[str]:
    """Lines comparing the best block drafter's tokens per step at `budget` with each EAGLE
    head's (the issue's target: >= 1.3x EAGLE-2's at 16 nodes)."""
    at_budget = [r for r in records if r.peer in grid and grid[r.peer].nodes == budget]
    blocks = [r for r in at_budget if grid[r.peer].kind == "block" and r.tokens_per_step]
    eagles = [r for r in at_budget if grid[r.peer].kind == "eagle" and r.tokens_per_step]
    if not blocks:
        return []
    best = max(blocks, key=lambda r: r.tokens_per_step)
    return [
        f"- {best.peer}: {best.tokens_per_step:.2f} tokens/step, "
        f"{best.tokens_per_step / eagle.tokens_per_step:.2f}x {eagle.peer} "
        f"({eagle.tokens_per_step:.2f})"
        for eagle in eagles
    ]


def block_vs_other_drafters(records: Sequence[E2ERecord], grid: dict[str, Cell]) -> list[str]:
    """Lines comparing the fastest block drafter's tokens/s at batch 1 with the fastest other
    drafter's and plain decoding's (`paired_ratio`; the issue's target: above every other)."""
    drafters = [r for r in records if r.peer in grid and grid[r.peer].kind is not None]
    blocks = [r for r in drafters if grid[r.peer].kind == "block"]
    others = [r for r in drafters if grid[r.peer].kind != "block"]
    if not blocks or not others:
        return []
    block = max(blocks, key=lambda r: r.tokens_per_s)
    other = max(others, key=lambda r: r.tokens_per_s)
    lines = [
        f"- {block.peer}: {block.tokens_per_s:.1f} tokens/s, {paired_ratio(block, other):.2f}x "
        f"the fastest other drafter, {other.peer} ({other.tokens_per_s:.1f})"
    ]
    plain = next((r for r in records if r.peer == "ours plain"), None)
    if plain is not None:
        lines.append(
            f"- {block.peer}: {paired_ratio(block, plain):.2f}x ours plain "
            f"({plain.tokens_per_s:.1f}); {other.peer}: {paired_ratio(other, plain):.2f}x"
        )
    return lines


def load_pair(device: torch.device):
    from specdec_fast.loading import load_model, load_tokenizer
    from specdec_fast.prompts import load_code_prompts

    target = load_model("tiny-code", device)
    draft = load_model("tiny-code-draft", device, target.dtype)
    tokenizer = load_tokenizer("tiny-code")
    return target, draft, tokenizer, load_code_prompts


def run(
    quick: bool,
    count: int | None = None,
    new_tokens: int | None = None,
    budgets: Sequence[int] = BUDGETS,
    kinds: Sequence[str] | None = None,
    rounds: int | None = None,
    float32_heads: bool = False,
    chain_lengths: Sequence[int] = CHAIN_LENGTHS,
) -> tuple[list[E2ERecord], dict, dict[str, Cell]]:
    device = bench_device()
    torch.manual_seed(0)
    target, draft, tokenizer, load_prompts = load_pair(device)
    count = count or (2 if quick else 8)
    new_tokens = new_tokens or (32 if quick else 96)
    rounds = rounds or (1 if quick else 3)
    prompts = [
        [tokenizer.bos_token_id, *tokenizer.encode(r["prompt"], add_special_tokens=False)]
        for r in load_prompts(count)
    ]
    grid = drafter_grid(target, quick, budgets, kinds, float32_heads, chain_lengths)
    peers = {
        name: lambda warm_up, name=name, make=cell.make: run_ours(
            name, target, prompts, make, new_tokens, 1, warm_up
        )
        for name, cell in grid.items()
    }
    # Plain decoding and an EAGLE drafter (`Drafter.reads_ahead`) the other way round from the
    # device's default (`generate(read_ahead=...)`: on for CUDA, off elsewhere): what queuing
    # each step before the read is worth.
    # The same two served by the scheduler, reading ahead and each step (`Scheduler`'s
    # `read_ahead`): the server's cost per step beside `generate`'s.
    read_ahead = device.type != "cuda"
    mode = "read ahead" if read_ahead else "read each step"
    for name in ("ours plain", read_ahead_peer(grid)):
        if name is None:
            continue
        other = f"{name} [{mode}]"
        make = grid[name].make
        peers[other] = lambda warm_up, other=other, make=make: run_ours(
            other, target, prompts, make, new_tokens, 1, warm_up, {"read_ahead": read_ahead}
        )
        for ahead, served_mode in ((True, "read ahead"), (False, "read each step")):
            served = f"{name}, served [{served_mode}]"
            options = {"read_ahead": ahead}
            peers[served] = lambda warm_up, served=served, make=make, options=options: run_served(
                served, target, prompts, make, new_tokens, warm_up, options
            )
    for name, kwargs in (
        ("HF generate", {}),
        ("HF assisted (draft model)", {"assistant_model": draft}),
        ("HF prompt lookup", {"prompt_lookup_num_tokens": 4}),
    ):
        peers[name] = lambda warm_up, name=name, kwargs=kwargs: run_hf(
            name, target, prompts, new_tokens, warm_up, **kwargs
        )
    records, outputs = interleave(peers, rounds, lambda line: print(line, flush=True))
    compare(records, outputs)
    setup = {"prompts": len(prompts), "max_new_tokens": new_tokens, "batch": 1, "rounds": rounds}
    return records, setup, grid


@pytest.mark.skipif("tiny-code" not in bundled.available(), reason="bundled models missing")
def test_e2e_tiny(benchmark):
    benchmark.group = "e2e tiny-code"
    records, _, _ = benchmark.pedantic(run, args=(True,), rounds=1, iterations=1)
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
    parser.add_argument(
        "--budgets", type=_ints, default=BUDGETS, help="tree budgets N (default 8,16,32,64)"
    )
    parser.add_argument(
        "--chain-lengths",
        type=_ints,
        default=CHAIN_LENGTHS,
        help="chain lengths k of the chain kinds (default 2,3,4,6)",
    )
    parser.add_argument("--kinds", type=_names, help="registry kinds only (default: all)")
    parser.add_argument(
        "--plot-budget", type=int, default=16, help="budget N of the acceptance plot"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="timed rounds per peer (default: 3, 1 with --quick)",
    )
    parser.add_argument(
        "--float32-heads",
        action="store_true",
        help="also run each DFlash head computing in float32, beside its default dtype",
    )
    args = parser.parse_args()
    records, setup, grid = run(
        args.quick,
        args.prompts,
        args.new_tokens,
        args.budgets,
        args.kinds,
        args.rounds,
        args.float32_heads,
        args.chain_lengths,
    )
    env = environment(bench_device())
    title = (
        f"tiny-code pair, {setup['prompts']} held-out code prompts x "
        f"{setup['max_new_tokens']} new tokens, greedy, batch 1, median of {setup['rounds']} "
        f"rounds in turns, on {env['gpu'] or 'CPU'} ({env['date']}, "
        f"{torch.get_num_threads()} threads)"
    )
    table = format_table(records)
    positions = "\n".join(
        f"- {r.peer}: " + ", ".join(f"{p:.2f}" for p in r.per_position[:8])
        for r in records
        if r.per_position
    )
    stem = args.out or RESULTS_DIR / f"e2e_tiny-{env['device']}"
    plot = plot_acceptance(records, grid, args.plot_budget, Path(f"{stem}-acceptance.png"))
    comparison = "\n".join(block_vs_eagle(records, grid, args.plot_budget))
    speed = "\n".join(block_vs_other_drafters(records, grid))
    markdown = (
        f"# End-to-end, {title}\n\n{table}\n\nPer-position acceptance (depth 1, 2, ...):\n"
        f"{positions}\n"
        + (
            f"\nBlock drafters against EAGLE at N = {args.plot_budget}:\n{comparison}\n"
            if comparison
            else ""
        )
        + (f"\nThe fastest block drafter at batch 1:\n{speed}\n" if speed else "")
        + (f"\n![per-position acceptance]({plot.name})\n" if plot else "")
    )
    print(markdown)
    write_results(
        stem.with_suffix(".json"),
        "bench_e2e_tiny",
        env,
        [r.to_dict() for r in records],
        setup=setup,
    )
    stem.with_suffix(".md").write_text(markdown)
    print(f"wrote {stem.with_suffix('.md')}")


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(","))


def _names(text: str) -> tuple[str, ...]:
    return tuple(part for part in text.split(",") if part)


if __name__ == "__main__":
    main()
