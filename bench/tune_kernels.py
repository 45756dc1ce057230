"""The kernels' tuning part (bench/gpu_suite.py --part tune): time every candidate configuration
of kernels/configs.json on the target shapes of issue 46, print the table, write the winners.

Knobs and their candidates (each compiled for sm_90 in bench/results/sm90_compile_table.md):
- tree attention's decode schedule: off (`tree_attention_decode_max_batch` 0: the row-block
  tiles) or on up to batch 8, with each tile of DECODE_TILE_CANDIDATES for D 128; timed on
  Llama-3-8B's B1/L4096/N64, B1/L16384/N64 and B8/L4096/N64 (bf16); the winner minimizes the
  sum of their medians;
- verify's residual race slices (`verify_race_tiles`, RACE_TILE_CANDIDATES) with its statistics
  slices (`verify_stats_programs_per_sm`, STATS_PROGRAMS_CANDIDATES), every pair timed on the
  stochastic chain K=5 at B1 and B32 over V = 128256 (fp32 logits).
Times are medians of CUDA-graph replays (bench/common.py's Timer). On the GPU the winners go into
kernels/configs.json (commit it); `--tiny` plays the same sweep on the CPU with the CPU shapes of
the benchmarks, writing to `--config-out` (the GPU suite's dry run: seconds).

    python3 bench/tune_kernels.py --json tune.json          # on the GPU, about a minute
"""

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
from bench_tree_attention import Shape as AttentionShape
from bench_tree_attention import make_inputs as attention_inputs
from bench_verify import Shape as VerifyShape
from bench_verify import make_inputs as verify_inputs
from common import Timer, bench_device

from specdec_fast.kernels import pack_tree_mask, tree_attention, verify
from specdec_fast.kernels.configs import CONFIG_PATH, overridden, write_configs
from specdec_fast.kernels.tree_attention import DECODE_TILE_CANDIDATES, MAX_DECODE_BATCH
from specdec_fast.kernels.verify import RACE_TILE_CANDIDATES, STATS_PROGRAMS_CANDIDATES

REPS = 30


def attention_shapes(device: torch.device) -> list[AttentionShape]:
    if device.type == "cuda":
        return [AttentionShape(b, prefix, 64) for b, prefix in ((1, 4096), (1, 16384), (8, 4096))]
    return [AttentionShape(1, 40, 64, num_q_heads=8, num_kv_heads=2, head_dim=32)]


def verify_shapes(device: torch.device) -> list[VerifyShape]:
    vocab = 128256 if device.type == "cuda" else 300
    return [VerifyShape("chain", batch, 6, vocab) for batch in (1, 32)]


def attention_candidates() -> list[dict]:
    """Off, then on with each D-128 tile (the D-64 choice stays)."""
    off = [{"tree_attention_decode_max_batch": 0}]
    return off + [
        {
            "tree_attention_decode_max_batch": MAX_DECODE_BATCH,
            "tree_attention_decode_tile": {"64": 0, "128": index},
        }
        for index in range(len(DECODE_TILE_CANDIDATES[128]))
    ]


def verify_candidates() -> list[dict]:
    return [
        {"verify_race_tiles": tiles, "verify_stats_programs_per_sm": programs}
        for tiles, programs in itertools.product(RACE_TILE_CANDIDATES, STATS_PROGRAMS_CANDIDATES)
    ]


def attention_call(shape: AttentionShape, device: torch.device):
    q, k_cache, v_cache, cache_lens, tree = attention_inputs(shape, device)
    packed = pack_tree_mask(tree)
    return lambda: tree_attention(q, k_cache, v_cache, cache_lens, packed)


def verify_call(shape: VerifyShape, device: torch.device):
    inputs = verify_inputs(shape, device)
    args = (inputs["logits"], inputs["draft_tokens"], inputs["parents"], inputs["draft_probs"])
    return lambda: verify(*args, temperature=1.0, seed=inputs["seed"], validate=False)


def sweep(knob: str, candidates, shapes, call, device) -> list[dict]:
    """One row per (candidate, shape): the candidate's entries, the shape, the median in us.
    Each candidate's graphs are captured under its entries (they fix the launches)."""
    rows = []
    for candidate, shape in itertools.product(candidates, shapes):
        with overridden(candidate):
            timer = Timer(call(shape, device), device)
            median, low, high = timer.measure(REPS)
        row = dict(knob=knob, candidate=candidate, shape=shape.label, median_us=median)
        print(f"| {knob} | {json.dumps(candidate)} | {shape.label} | {median:.1f} |", flush=True)
        rows.append(row)
    return rows


def winner(rows: list[dict]) -> dict:
    """The candidate with the least sum of medians over the shapes."""
    totals = {}
    for row in rows:
        key = json.dumps(row["candidate"], sort_keys=True)
        totals[key] = totals.get(key, 0.0) + row["median_us"]
    return json.loads(min(totals, key=totals.get))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="the CPU's shapes (dry run)")
    parser.add_argument("--json", type=Path, help="write the rows and winners here")
    parser.add_argument(
        "--config-out", type=Path, default=CONFIG_PATH, help="where the winners are written"
    )
    args = parser.parse_args(argv)
    device = bench_device()
    if device.type != "cuda" and not args.tiny:
        parser.error("without a GPU only --tiny runs")
    torch.manual_seed(0)
    print("| knob | candidate | shape | us median |\n|---|---|---|---|", flush=True)
    attention = sweep(
        "tree_attention", attention_candidates(), attention_shapes(device), attention_call, device
    )
    race = sweep("verify", verify_candidates(), verify_shapes(device), verify_call, device)
    winners = {**winner(attention), **winner(race)}
    written = write_configs(winners, args.config_out)
    print(f"winners: {json.dumps(winners)}; {args.config_out} now holds {json.dumps(written)}")
    if args.json:
        args.json.write_text(json.dumps(dict(rows=attention + race, winners=winners), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
