"""What tensor parallelism adds to a step beyond its collectives, on the CPU (issue 49's target:
at most 10% of a step of the SmolLM2-shaped model).

A random SmolLM2-135M-shaped Llama (576 hidden, 30 layers, 1536 MLP, 49152 vocabulary; 8 query
and 2 KV heads of 72 instead of SmolLM2's 9 and 3, which two ranks cannot split) decodes
plainly, greedy, one prompt, eager, one thread per rank. Two gloo ranks run, in turns, `--rounds`
times, side by side in the same processes:

- `tp`: the model sharded over both ranks by transformers' `tp_plan`, timing inside each step
  the collectives (`COLLECTIVES`: every all-reduce and all-gather, waited for where issued;
  waiting for the other rank counts as collective time);
- `share`: on each rank alone, a model of one rank's share (4 query heads and 1 KV head, a 768
  MLP, a 24576-row LM head): what a rank computes, without TP;
- `whole`: on each rank alone, the whole model (one process's step; both ranks run it at once,
  so it sees the machine as loaded as `tp` does).

TP's own overhead per step is `tp - collectives - share` (the TP forward wrappers, the gathers'
copies, the sampler over the full vocabulary), given as a share of `whole`. Rank 0's medians
over rounds, ms per step. Times taken on a shared machine are noisy.

    nice -n 10 python bench/bench_tp.py --rounds 5 --tokens 16
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from bench_overhead import SMOLLM2_SHAPE, random_llama

from specdec_fast import generate

# SmolLM2-135M's shape with heads two ranks can split (its 9 query and 3 KV heads cannot).
SHAPE = {**SMOLLM2_SHAPE, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 72}
VOCAB = 49152
# Transformers' row-wise layers all-reduce through torch.distributed at inference; DTensor's
# redistributions (the LM head's gather) go through the functional collectives.
COLLECTIVES = {
    dist: ("all_reduce", "all_gather", "all_gather_into_tensor"),
    funcol: ("all_reduce", "all_gather_tensor", "all_gather_single", "reduce_scatter_tensor"),
}
PROMPT = list(range(5, 37))


def share_model(shards: int):
    """The SmolLM2-shaped model (`shards` 1) or one rank's share of it over `shards` ranks."""
    shape = dict(SHAPE)
    for name in ("intermediate_size", "num_attention_heads", "num_key_value_heads"):
        shape[name] //= shards
    return random_llama(shape, seed=0, vocab=VOCAB // shards)


def ms_per_step(model, tokens: int) -> float:
    start = time.perf_counter()
    with torch.no_grad():
        generate(model, [PROMPT], drafter=None, max_new_tokens=tokens, eos_token_id=[])
    return (time.perf_counter() - start) * 1e3 / tokens


class CollectiveClock:
    """Seconds spent in the collectives of `COLLECTIVES`, each waited for where it is issued (on
    gloo they complete there anyway)."""

    def __init__(self):
        self.seconds = 0.0
        for module, names in COLLECTIVES.items():
            for name in names:
                if hasattr(module, name):
                    setattr(module, name, self._timed(getattr(module, name)))

    def _timed(self, collective):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            out = collective(*args, **kwargs)
            if isinstance(out, funcol.AsyncCollectiveTensor):
                out = out.wait()
            self.seconds += time.perf_counter() - start
            return out

        return timed


def rank_main(folder: str, rounds: int, tokens: int) -> None:
    from specdec_fast.parallel import init_ranks, load_target

    torch.set_num_threads(1)
    rank, _ = init_ranks()
    clock = CollectiveClock()
    models = {
        "tp": load_target(str(Path(folder) / "whole"), "float32"),
        "share": share_model(2),
        "whole": share_model(1),
    }
    times = {name: [] for name in [*models, "collectives"]}
    for model in models.values():
        ms_per_step(model, 2)  # warm-up
    for _ in range(rounds):
        for name, model in models.items():
            clock.seconds = 0.0
            times[name].append(ms_per_step(model, tokens))
            if name == "tp":
                times["collectives"].append(clock.seconds * 1e3 / tokens)
        dist.barrier()  # the next round's TP step starts together
    if rank == 0:
        print("MEDIANS " + json.dumps({k: statistics.median(v) for k, v in times.items()}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--rank-of", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_of is not None:
        return rank_main(args.rank_of, args.rounds, args.tokens)
    with tempfile.TemporaryDirectory() as tmp:
        share_model(1).save_pretrained(Path(tmp) / "whole")
        argv = ["--rank-of", tmp, "--rounds", str(args.rounds), "--tokens", str(args.tokens)]
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        command += ["--nproc-per-node", "2", __file__, *argv]
        ranks = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    if ranks.returncode != 0:
        raise RuntimeError(f"the ranks failed:\n{ranks.stderr[-3000:]}")
    line = next(line for line in ranks.stdout.splitlines() if line.startswith("MEDIANS"))
    ms = json.loads(line.split(maxsplit=1)[1])
    overhead = ms["tp"] - ms["collectives"] - ms["share"]
    print(f"ms per step, rank 0 (medians of {args.rounds} rounds, {args.tokens} tokens)")
    print(f"  whole model, one rank alone      {ms['whole']:8.1f}")
    print(f"  one rank's share, alone          {ms['share']:8.1f}")
    print(
        f"  tp_plan over 2 gloo ranks        {ms['tp']:8.1f}  collectives {ms['collectives']:.1f}"
    )
    share = 100 * overhead / ms["whole"]
    print(f"  TP overhead beyond collectives   {overhead:8.1f}  = {share:.1f}% of the whole step")


if __name__ == "__main__":
    sys.exit(main())
