"""Ranks of a tensor-parallel test run: a bounded local launch of N gloo ranks (`run_ranks`) and
the work each rank does over the bundled tiny-code target (`tensor_parallel_work`), whose
results the tests compare with a single-process run."""

import os
import socket
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from specdec_fast.parallel import end_rank


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(work, world: int, timeout: float, folder: Path, *args, gpus: bool = False) -> list:
    """Run `work(*args)` on `world` spawned ranks on this host and return each rank's result
    (what `work` returned, saved by the rank under `folder`): a gloo group on the CPU, or with
    `gpus` an NCCL group of one GPU per rank (`parallel.init_ranks` picks by what the rank
    sees). The ranks are terminated after `timeout` seconds (a hang fails the test instead of
    stalling it); a rank's exception is raised here."""
    port = free_port()
    context = mp.start_processes(
        _rank_main,
        args=(world, port, folder, gpus, work, args),
        nprocs=world,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + timeout
    try:
        while not context.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{world} tensor-parallel ranks ran past {timeout} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.terminate()
                process.join()
    return [torch.load(folder / f"rank{r}.pt", weights_only=False) for r in range(world)]


def _rank_main(rank: int, world: int, port: int, folder: Path, gpus: bool, work, args) -> None:
    if not gpus:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before CUDA initializes: CPU ranks, gloo
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
    )
    torch.set_num_threads(1)
    try:
        result = work(*args)
        torch.save(result, folder / f"rank{rank}.pt")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # As the CLI's ranks end (`parallel.end_rank`): the interpreter's teardown can race gloo's
    # worker threads and abort a rank that did its work (seen once in a loaded suite run). A
    # rank that raised ends through the launcher, which reports the exception.
    end_rank(0)


def tensor_parallel_work(
    specs, blocks, prompts, new_tokens, temperatures, seeds, joining, dtype="float32"
) -> dict:
    """On this rank's shard of tiny-code in `dtype`: `generate_every_drafter` under "generate",
    `rows_leave_and_join` under "cache", and the agreement checks under "disagreement" and
    "lockstep" (one launch: starting ranks costs seconds)."""
    from specdec_fast import generate
    from specdec_fast.parallel import load_target

    target = load_target("tiny-code", dtype)
    return {
        "generate": generate_every_drafter(
            generate, target, specs, blocks, prompts, new_tokens, temperatures, seeds
        ),
        "cache": rows_leave_and_join(target, prompts, joining),
        "disagreement": disagreement(target),
        "lockstep": lockstep_disagreement(),
    }


def disagreement(target) -> str | None:
    """The error `check_agreement` raises when this rank's tokens differ from rank 0's (each
    rank passes its rank as a token), or None when it raises nothing."""
    from specdec_fast.parallel import check_agreement

    try:
        check_agreement([torch.tensor([1, dist.get_rank()])], target.device)
    except RuntimeError as error:
        return str(error)
    return None


def lockstep_disagreement() -> dict:
    """The serving lockstep's check (`serving.lockstep`) on this rank, after a request (key 3)
    finished with the same tokens on every rank ("same"), then with this rank's own token
    ("different"): the error each raised, or None."""
    from specdec_fast.parallel import init_ranks
    from specdec_fast.serving.lockstep import Lockstep

    rank, _ = init_ranks()  # joined already, by load_target
    lockstep = Lockstep(torch.device("cpu"))
    errors = {}
    for case, tokens in (("same", [5, 6]), ("different", [5, 6 + rank])):
        lockstep.finished(3, tokens)
        try:
            lockstep.exchange(make_row=None)  # rank 0 asks for the check: it finished one
            errors[case] = None
        except RuntimeError as error:
            errors[case] = str(error)
    return errors


def generate_every_drafter(
    generate, target, specs, blocks, prompts, new_tokens, temperatures, seeds
) -> dict:
    """`generate` for every drafter spec: per spec, the sequences and the call's accepted-token
    count (the same trees were accepted, not only the same tokens)."""
    from specdec_fast.drafters.registry import DrafterSpec

    results = {}
    for spec in specs:
        drafter = DrafterSpec.parse(spec.format(**blocks)).build(target)
        out = generate(
            target,
            prompts,
            drafter=drafter,
            max_new_tokens=new_tokens,
            temperature=temperatures,
            seed=seeds,
            eos_token_id=[],
        )
        results[spec] = ([s.tolist() for s in out.sequences], out.stats.accepted_tokens)
    return results


def rows_leave_and_join(target, prompts, joining) -> dict:
    """Runner steps with rows leaving and joining (`cache_steps`), with every rank's committed
    lengths after them, all-gathered."""
    logits, lengths, heads = cache_steps(target, prompts, joining)
    gathered = [torch.empty_like(lengths) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, lengths)
    return {"logits": logits, "lengths": [g.cpu() for g in gathered], "kv_heads": heads}


def cache_steps(target, prompts, joining):
    """Prefill `prompts`, verify a chain, keep rows 2 and 0 (in that order), let `joining` join,
    and verify once more. Returns the logits of both verifies (fp32 `[B, N, V]`), the committed
    lengths (int32 `[B]`) and the cache's KV head count."""
    from specdec_fast.engine import _pad_prompts
    from specdec_fast.runner import ModelRunner

    with ModelRunner(target, 128, compile=False, use_cuda_graphs=False) as runner:
        prefill = runner.prefill(*_pad_prompts(prompts, target.device))
        chain = torch.stack([prefill.root_tokens, prefill.root_tokens + 1], dim=1)
        parents = torch.tensor([[-1, 0]], device=target.device).expand(len(prompts), 2)
        first = runner.verify(chain, parents).logits.clone()
        runner.cache.compact(
            torch.tensor([[0, 1]] * len(prompts), dtype=torch.int32, device=target.device),
            torch.ones(len(prompts), dtype=torch.int32, device=target.device),
        )
        runner.keep([2, 0])
        joined = runner.prefill_rows(joining)
        roots = torch.cat([chain[[2, 0], 1], joined.root_tokens])
        root_parents = torch.full((len(roots), 1), -1, device=target.device)
        second = runner.verify(roots[:, None], root_parents).logits.clone()
        lengths = runner.cache.cache_lens.clone()
        return (first.cpu(), second.cpu()), lengths, runner.cache.kv.shape[3]
