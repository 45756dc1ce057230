"""Prompt lookup on the host against on the device, side by side on the bundled tiny-code pair.

The n-gram drafter looks up on the host (numpy; its default on the CPU, reading every step) or
on the device (`NGramDrafter(device_lookup=True)`: the same trees from a token history kept on
the device, compiled steps replayed as CUDA graphs, reading ahead; its default on CUDA when
compiling). Peers, greedy on the same held-out code prompts, in rounds taken in turns
(`e2e.interleave`: medians, per-round ratios): our plain decoding, the n-gram drafter with each
lookup, and EAGLE-3 with each lookup grafted on (`eagle:tiny-code-eagle3:8+ngram:8`). Both
lookups draft the same trees, so their steps, acceptance and outputs must be the same (checked:
a difference fails the run); only the time differs. Each peer also gets the drafter's host time
per step: the wall time of its `propose` and `update` (on a GPU, launching the drafter's device
work, plus the lookup itself where it runs on the host).

    python bench/bench_lookup.py            # batch 1 and 4, 4 prompts x 64 tokens, 3 rounds
    python bench/bench_lookup.py --quick    # batch 1, 2 prompts x 32 tokens, 3 rounds (GPU suite)
    python bench/bench_lookup.py --tiny     # CI's: batch 1, 1 prompt x 8 tokens, 1 round, eager
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from common import RESULTS_DIR, bench_device, environment, write_results
from e2e import compare, format_table, interleave, run_ours

from specdec_fast import NGramDrafter
from specdec_fast.drafters.graft import GraftedDrafter
from specdec_fast.drafters.registry import DrafterSpec

NGRAM_NODES = 16
GRAFT_HEAD = "eagle:tiny-code-eagle3:8"
GRAFT_LOOKUP_NODES = 8
# Peers: plain decoding, then the n-gram drafter and the graft, each with both lookups.
PEERS = 5


@dataclass(frozen=True)
class Size:
    batches: tuple[int, ...]
    prompts: int
    new_tokens: int
    rounds: int


SIZES = {
    "tiny": Size((1,), 1, 8, 1),
    "quick": Size((1,), 2, 32, 3),
    "full": Size((1, 4), 4, 64, 3),
}


class HostTime:
    """Wall time of every drafter's `propose` and `update` by peer, counted per step."""

    def __init__(self):
        self.seconds: Counter = Counter()
        self.steps: Counter = Counter()

    def wrap(self, peer: str, drafter):
        """`drafter` with its `propose` and `update` timed (instance attributes over its
        methods)."""
        for member in ("propose", "update"):
            setattr(drafter, member, self._timed(peer, member, getattr(drafter, member)))
        return drafter

    def _timed(self, peer: str, member: str, method):
        def timed(*args):
            start = time.perf_counter()
            try:
                return method(*args)
            finally:
                self.seconds[peer] += time.perf_counter() - start
                self.steps[peer] += member == "propose"

        return timed

    def per_step_us(self, peer: str) -> float | None:
        steps = self.steps[peer]
        return 1e6 * self.seconds[peer] / steps if steps else None


def peers(target, prompts, new_tokens: int, batch: int, graft: bool, clock: HostTime, options):
    """`interleave`'s peers: plain decoding, then each lookup alone and (with `graft`) under
    EAGLE-3; their timed runs' drafters timed by `clock` (not the warm-up's, which compiles)."""
    makers = {"ours plain": lambda: None}
    for where, on_device in (("host", False), ("device", True)):
        makers[f"ours ngram N={NGRAM_NODES} {where} lookup"] = lambda on_device=on_device: (
            NGramDrafter(NGRAM_NODES, device_lookup=on_device)
        )
    if graft:
        head = DrafterSpec.parse(GRAFT_HEAD).factory(target)
        for where, on_device in (("host", False), ("device", True)):
            makers[f"ours {GRAFT_HEAD}+ngram:{GRAFT_LOOKUP_NODES} {where} lookup"] = (
                lambda on_device=on_device: GraftedDrafter(
                    head(), NGramDrafter(GRAFT_LOOKUP_NODES, device_lookup=on_device)
                )
            )

    def peer(name, make):
        def run(warm_up: bool):
            untimed = [warm_up]  # `run_ours` makes the warm-up's drafter first

            def timed_make():
                drafter = make()
                if untimed:
                    untimed.pop()
                    return drafter
                return drafter if drafter is None else clock.wrap(name, drafter)

            return run_ours(name, target, prompts, timed_make, new_tokens, batch, warm_up, options)

        return run

    return {name: peer(name, make) for name, make in makers.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sizes = parser.add_mutually_exclusive_group()
    sizes.add_argument("--quick", action="store_true", help="batch 1, 2 prompts x 32 tokens")
    sizes.add_argument("--tiny", action="store_true", help="CI's size, eager (module doc)")
    parser.add_argument("--batches", default=None, help="comma-separated batch sizes")
    parser.add_argument("--no-graft", action="store_true", help="the n-gram drafter alone")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    from specdec_fast.loading import load_model, load_tokenizer
    from specdec_fast.prompts import load_code_prompts

    device = bench_device()
    target = load_model("tiny-code", device)
    tokenizer = load_tokenizer("tiny-code")
    size = SIZES["tiny" if args.tiny else "quick" if args.quick else "full"]
    count, new_tokens, rounds = size.prompts, size.new_tokens, size.rounds
    batches = [int(b) for b in args.batches.split(",")] if args.batches else size.batches
    # Compiled by default (`SPECDEC_COMPILE`); the smoke size runs eagerly.
    options = {"compile": False} if args.tiny else {}
    prompts = [
        [tokenizer.bos_token_id, *tokenizer.encode(r["prompt"], add_special_tokens=False)]
        for r in load_code_prompts(count)
    ]
    results = []
    for batch in batches:
        clock = HostTime()
        chosen = peers(target, prompts, new_tokens, batch, not args.no_graft, clock, options)
        records, outputs = interleave(chosen, rounds)
        compare(records, outputs)
        by_peer = {record.peer: record for record in records}
        for host in (name for name in by_peer if name.endswith("host lookup")):
            device_peer = host.replace("host lookup", "device lookup")
            host_drafted, device_drafted = (
                (by_peer[p].acceptance, by_peer[p].tokens_per_step) for p in (host, device_peer)
            )
            if outputs[host] != outputs[device_peer] or host_drafted != device_drafted:
                raise SystemExit(f"{device_peer} drafted otherwise than {host}: a lookup bug")
        print(format_table(records), flush=True)
        for record in records:
            host_us = clock.per_step_us(record.peer)
            results.append({**record.to_dict(), "drafter_host_us_per_step": host_us})
            if host_us is not None:
                print(f"- {record.peer}, batch {batch}: drafter host time {host_us:.0f} us/step")
    env = environment(device)
    path = args.json or RESULTS_DIR / f"lookup-{env['device']}.json"
    setup = {"prompts": count, "max_new_tokens": new_tokens, "rounds": rounds, **options}
    write_results(path, "bench_lookup", env, results, setup=setup)


if __name__ == "__main__":
    main()
