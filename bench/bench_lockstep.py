"""What serving a tensor-parallel target adds to each scheduler step on the CPU: the lockstep's
collectives (`specdec_fast.serving.lockstep`: an empty plan's broadcast and the step seconds'
all-reduce), side by side with one all-reduce of a SmolLM2-sized hidden state (`[1, 1, 576]`
fp32; a SmolLM2-shaped step runs 60 of them). Two gloo ranks, one thread each, in turns,
`--rounds` times; rank 0's median over `--repeats` calls, in microseconds. Times taken on a
shared machine are noisy.

    nice -n 10 python bench/bench_lockstep.py --rounds 3 --repeats 200
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from specdec_fast.serving.lockstep import Lockstep

HIDDEN = 576


def _rank(rank: int, port: int, rounds: int, repeats: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    lockstep = Lockstep(torch.device("cpu"))
    hidden = torch.zeros(1, 1, HIDDEN)

    def plan() -> None:
        lockstep.exchange(make_row=None)
        lockstep.slowest(0.01)

    def all_reduce() -> None:
        dist.all_reduce(hidden)

    medians: dict[str, list[float]] = {"plan": [], "all_reduce": []}
    for _ in range(rounds):
        for name, call in (("plan", plan), ("all_reduce", all_reduce)):
            for _ in range(repeats // 10):  # warm-up
                call()
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                call()
                times.append(time.perf_counter() - start)
            medians[name].append(statistics.median(times) * 1e6)
    if rank == 0:
        for name, values in medians.items():
            rounded = ", ".join(f"{v:.0f}" for v in values)
            print(f"{name}: {statistics.median(values):.0f} us per step (rounds: {rounded})")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(port, args.rounds, args.repeats), nprocs=2)


if __name__ == "__main__":
    main()
