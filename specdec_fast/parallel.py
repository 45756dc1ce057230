"""Tensor-parallel targets: speculative `generate` over a target sharded across ranks.

Launched as N ranks of `torch.distributed` (`torchrun --nproc-per-node N`, or
`specdec-fast generate|bench --tensor-parallel N`, which starts them through
`torch.distributed.run`), each rank:

- loads its shard of the target with transformers' own tensor parallelism
  (`from_pretrained(..., tp_plan="auto")`: DTensor weights, the model's plan: q/k/v and the MLP's
  gate/up column-wise, o and down row-wise with an all-reduce, the LM head column-wise with its
  output gathered), over the gloo backend on the CPU and NCCL on GPUs (`load_target`);
- holds its `Hkv / N` KV heads in its `SpecKVCache` (`cache.local_heads`): the attention layers
  see their local heads only, and our attention and `tree_attention` run on them unchanged;
- reads full-vocabulary logits (the LM head's gathered output) and full hidden states (each
  decoder layer's output is all-reduced), so the sampler and the drafters see what a
  single-process run sees;
- runs the drafter replicated (drafters are small: each rank holds a whole copy) and the same
  engine, `specdec_fast.step`, step for step: `generate` on a sharded target
  (`cache.model_shards`) checks what TP supports (`check_tensor_parallel`), runs eagerly, and
  checks after the call that the ranks agree (`check_agreement`).

How the ranks agree on accept/reject: each rank runs the sampler itself, on the same logits with
the same seeds. The gathered logits are the same bytes on every rank (an all-gather copies; the
all-reduces of NCCL and gloo hand every rank the same reduced bytes), the drafters are replicated
and deterministic, and sampling seeds are derived on the device from each row's seed and each
node's position, so every rank's verify kernel reaches the same decisions without a collective
of its own. The alternative, rank 0 deciding and broadcasting the accepted paths, adds one
blocking broadcast to every step, on the critical path, for a guarantee the data already give.
`generate` checks the guarantee after each call on a sharded target: the ranks' outputs are
compared through one all-gather of a digest (`check_agreement`), and a disagreement raises
RuntimeError naming the ranks instead of passing silently.

What is not supported under tensor parallelism (a ValueError says so before anything runs):
compiled steps and CUDA graphs (the target runs eagerly), exact mode (it replaces the linear
layers' forwards that the plan's hooks wrap), head counts the world size does not divide, and
drafters whose own models are sharded (`check_drafter`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist
from transformers import AutoConfig, PreTrainedModel

from specdec_fast.cache import local_heads, model_shards
from specdec_fast.drafters.base import Drafter
from specdec_fast.loading import load_model, resolve_model

# A prime below 2**31: each product of the digest stays below 2**62 and each term is reduced
# modulo it before the sum, so the int64 arithmetic cannot overflow.
DIGEST_PRIME = 2_147_483_629


def init_ranks() -> tuple[int, int]:
    """Join the process group that the launcher describes (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`,
    `MASTER_PORT`, as `torchrun` sets them), unless already joined: NCCL when CUDA is available
    (each rank on GPU `LOCAL_RANK`), else gloo. Returns (rank, world size)."""
    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            dist.init_process_group("nccl")
        else:
            dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


def leave_ranks() -> None:
    """Leave the process group, if joined (a rank that stops alone; `finish_ranks` when they
    stop together)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def finish_ranks() -> None:
    """Leave the process group together after a command that every rank completed (`generate`,
    `bench`, a server's stop): a barrier, so that no rank closes its connections while another
    still reads the last collective, then the group destroyed."""
    if dist.is_initialized():
        dist.barrier()
    leave_ranks()


def end_rank(code: int) -> NoReturn:
    """End a rank's process with `code` once its command has returned, its output flushed,
    without the interpreter's teardown. The target's device mesh keeps the gloo group alive
    past `destroy_process_group`, and its worker threads release a finished collective's
    tensors on their own time: one doing so while the interpreter finalizes cannot take the
    GIL and aborts the process ("terminate called without an active exception", seen in a
    core dump of a server's rank 1, about 1 exit in 8 on a loaded 2-core machine)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def in_ranks() -> bool:
    """Whether this process is a rank that a launcher started (`WORLD_SIZE` is set)."""
    return "WORLD_SIZE" in os.environ


def launched_rank() -> int:
    """This process's rank as its launcher set it (`RANK`), without joining the group."""
    return int(os.environ.get("RANK", 0))


def launch(ranks: int, argv: Sequence[str], timeout: float | None = None) -> int:
    """Run `specdec-fast argv` as `ranks` local ranks through `torch.distributed.run` (a
    standalone rendezvous on this host) and return its exit status: 0 when every rank
    succeeded. The ranks run the same command; rank 0 prints and writes.

    SIGTERM or SIGINT to this process is passed on to the ranks as SIGTERM (a server's rank 0
    drains and stops the others, `serving.lockstep`) and the call waits for them. The launcher
    runs in a process group of its own, which is ended (SIGTERM: the launcher ends its ranks)
    on an interrupt or after `timeout` seconds (then TimeoutError): no rank outlives the
    call."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", str(ranks), "-m", "specdec_fast", *argv]
    process = subprocess.Popen(command, start_new_session=True)
    try:
        with _signals_to_ranks(process.pid):
            return process.wait(timeout)
    except subprocess.TimeoutExpired:
        raise TimeoutError(f"{ranks} ranks of specdec-fast ran past {timeout} s") from None
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait()


@contextlib.contextmanager
def _signals_to_ranks(launcher: int):
    """While in the block (on the main thread), SIGTERM and SIGINT go to the ranks that the
    launcher `launcher` started, as SIGTERM: each rank decides how it stops. The launcher itself
    would end them too, but counts the stop as its own failure."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def forward(signum, frame) -> None:
        children = Path(f"/proc/{launcher}/task/{launcher}/children")
        ranks = [int(pid) for pid in children.read_text().split()] if children.exists() else []
        for pid in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        if not ranks:  # no /proc: the launcher ends them
            with contextlib.suppress(ProcessLookupError):
                os.killpg(launcher, signal.SIGTERM)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def rank_device() -> torch.device:
    """This rank's device: its GPU (`LOCAL_RANK`) under CUDA, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def load_target(
    name_or_path: str, dtype: torch.dtype | str | None = None, ranks: int | None = None
) -> PreTrainedModel:
    """This rank's shard of the target (a folder, a `.gguf` file or a bundled name), sharded over
    every rank of the process group (joined first, `init_ranks`) by transformers' plan.

    Raises ValueError, naming the model type and the counts, when the world size divides neither
    the query nor the KV heads (checked on the config, before any weight is read), and when it is
    not `ranks` (the ranks a command was told to use)."""
    _, world = init_ranks()
    if ranks is not None and world != ranks:
        raise ValueError(f"--tensor-parallel: {ranks} given, the launcher started {world} ranks")
    folder, gguf_file = resolve_model(name_or_path)
    extra = {} if gguf_file is None else {"gguf_file": gguf_file}
    local_heads(AutoConfig.from_pretrained(folder, local_files_only=True, **extra), world)
    return load_model(name_or_path, rank_device(), dtype, tp_size=world)


def check_drafter(drafter: Drafter | None) -> None:
    """Raise ValueError, naming the drafter, for one that does not run replicated: a drafter
    whose own model (a draft model, a PARD model) is itself sharded over ranks. Drafters are
    small, and their steps (their own caches, compiled loops, host-side trees) are built for a
    whole model on the rank's device."""
    if drafter is None:
        return
    for value in vars(drafter).values():
        if isinstance(value, PreTrainedModel) and model_shards(value) > 1:
            raise ValueError(
                f"{drafter!r}: under tensor parallelism drafters run replicated on every rank; "
                "load its model whole on each rank (without tp_plan)"
            )


def check_tensor_parallel(
    model: PreTrainedModel,
    drafter: Drafter | None,
    *,
    compile: bool | None,
    use_cuda_graphs: bool | None,
    exact: bool,
) -> None:
    """Raise ValueError for what a tensor-parallel target does not support (module doc)."""
    for name, value in (("compile", compile), ("use_cuda_graphs", use_cuda_graphs)):
        if value:
            raise ValueError(
                f"{name}: a tensor-parallel target runs eagerly; pass {name}=False (or leave it "
                "unset)"
            )
    if exact:
        raise ValueError("exact: exact mode is not supported on a tensor-parallel target")
    local_heads(model.config, model_shards(model))
    check_drafter(drafter)


def sequences_digest(sequences: Sequence[torch.Tensor]) -> torch.Tensor:
    """int64 `[2]` on the CPU: the token count and a position-weighted sum modulo `DIGEST_PRIME`
    of every sequence in order, each followed by a -1 (so that lengths count too)."""
    end = torch.tensor([-1])
    flat = torch.cat([part for s in sequences for part in (s.reshape(-1).long(), end)] + [end])
    weights = torch.arange(1, flat.numel() + 1, dtype=torch.long)
    total = ((flat % DIGEST_PRIME) * weights % DIGEST_PRIME).sum() % DIGEST_PRIME
    return torch.stack((torch.tensor(flat.numel()), total))


def check_agreement(sequences: Sequence[torch.Tensor], device: torch.device) -> None:
    """All-gather every rank's digest of `sequences` (`sequences_digest`; one collective) and
    raise RuntimeError, naming the ranks, when any differs from rank 0's."""
    digest = sequences_digest(sequences).to(device)
    gathered = [torch.empty_like(digest) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, digest)
    differ = [r for r, d in enumerate(gathered) if not torch.equal(d, gathered[0])]
    if differ:
        raise RuntimeError(
            f"tensor parallelism: ranks {differ} generated other tokens than rank 0; the ranks' "
            "accept/reject decisions diverged (docs/PARALLEL.md)"
        )
