"""Tensor-parallel targets (`specdec_fast.parallel`): two gloo ranks on this host, each holding
half of the bundled tiny-code target's heads (transformers' `tp_plan="auto"`), generate what
one process generates, token for token, for every built-in drafter, greedy and sampled rows in
one batch of prompts of different lengths; the ranks' caches stay consistent when rows leave
and join; what TP does not support is refused with a ValueError.

The ranks are spawned and bounded (`tensor_parallel_ranks.run_ranks`): a hang fails the test.
"""

import json
import os
import subprocess
import sys
from functools import partial

import pytest
import torch
from built_in_drafters import DRAFTERS, missing_kinds, write_untrained_blocks
from tensor_parallel_ranks import (
    cache_steps,
    generate_every_drafter,
    run_ranks,
    tensor_parallel_work,
)

from specdec_fast import bundled, generate, parallel
from specdec_fast.cache import local_heads
from specdec_fast.cli import main
from specdec_fast.drafters.registry import DrafterSpec
from specdec_fast.loading import load_model
from specdec_fast.parallel import check_tensor_parallel, sequences_digest
from specdec_fast.serving import Scheduler

WORLD = 2
NEW_TOKENS = 12
# Rows 0 and 2 greedy, row 1 sampled with its own seed.
TEMPERATURES = [0.0, 0.8, 0.0]
SEEDS = [11, 12, 13]
TIMEOUT = 120
JOINING = [[5, 6, 7, 8, 9, 10, 11], [12, 13]]

pytestmark = pytest.mark.skipif(
    "tiny-code" not in bundled.available(), reason="the bundled checkpoints are not installed"
)


@pytest.fixture(scope="module")
def target():
    return load_model("tiny-code", torch.device("cpu"))


@pytest.fixture(scope="module")
def prompts():
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(3, 4096, (n,), generator=generator).tolist() for n in (9, 17, 5)]


def test_every_built_in_drafter_is_covered():
    assert missing_kinds(DRAFTERS) == set()


@pytest.fixture(scope="module")
def blocks(target, tmp_path_factory):
    return write_untrained_blocks(target, tmp_path_factory.mktemp("blocks"))


@pytest.fixture(scope="module")
def ranks(blocks, prompts, tmp_path_factory):
    """What each of the two ranks returned (`tensor_parallel_work`)."""
    arguments = (DRAFTERS, blocks, prompts, NEW_TOKENS, TEMPERATURES, SEEDS, JOINING)
    folder = tmp_path_factory.mktemp("ranks")
    return run_ranks(tensor_parallel_work, WORLD, TIMEOUT, folder, *arguments)


def test_every_drafter_generates_under_tp_what_one_process_does(target, prompts, blocks, ranks):
    ranks = [rank["generate"] for rank in ranks]
    # Compared with a single-process run of the same function over the whole model.
    # The ranks never disagree: every rank's every sequence is rank 0's.
    assert all(rank == ranks[0] for rank in ranks[1:])
    single = generate_every_drafter(
        generate, target, DRAFTERS, blocks, prompts, NEW_TOKENS, TEMPERATURES, SEEDS
    )
    for spec in DRAFTERS:
        assert ranks[0][spec] == single[spec], spec


def test_caches_stay_consistent_when_rows_leave_and_join(target, prompts, ranks):
    logits, lengths, heads = cache_steps(target, prompts, JOINING)
    check_caches(ranks, logits, lengths, heads)


def check_caches(ranks, logits, lengths, heads):
    """Each rank holds its half of the KV heads, every rank's committed lengths are the single
    process's, and so are its logits up to the row-wise layers' reduction order."""
    assert heads == 2 and all(rank["cache"]["kv_heads"] == heads // WORLD for rank in ranks)
    for rank in (rank["cache"] for rank in ranks):
        assert all(torch.equal(length, lengths) for length in rank["lengths"])
        for tp, single in zip(rank["logits"], logits, strict=True):
            # The row-wise layers sum two partial products: reduction order only.
            torch.testing.assert_close(tp, single, rtol=1e-4, atol=1e-4)
    assert lengths.tolist() == [6, 10, 6, 1]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < WORLD, reason="needs two or more CUDA devices")
def test_nccl_ranks_generate_what_one_gpu_does(prompts, tmp_path):
    """The same checks on GPUs: two NCCL ranks, one GPU each, against one process on GPU 0,
    every built-in drafter, in float32 (bfloat16's reductions would part near-ties)."""
    target = load_model("tiny-code", torch.device("cuda", 0), "float32")
    blocks = write_untrained_blocks(target, tmp_path / "blocks")
    arguments = (DRAFTERS, blocks, prompts, NEW_TOKENS, TEMPERATURES, SEEDS, JOINING, "float32")
    ranks = run_ranks(tensor_parallel_work, WORLD, TIMEOUT, tmp_path, *arguments, gpus=True)
    generated = [rank["generate"] for rank in ranks]
    assert all(rank == generated[0] for rank in generated[1:])
    single = generate_every_drafter(
        partial(generate, compile=False, use_cuda_graphs=False),
        target,
        DRAFTERS,
        blocks,
        prompts,
        NEW_TOKENS,
        TEMPERATURES,
        SEEDS,
    )
    assert generated[0] == single
    logits, lengths, heads = cache_steps(target, prompts, JOINING)
    check_caches(ranks, logits, lengths.cpu(), heads)


def test_ranks_that_disagree_raise(ranks):
    for rank in ranks:
        assert "ranks [1] generated other tokens than rank 0" in rank["disagreement"]


def test_serving_ranks_whose_finished_requests_differ_raise(ranks):
    """The check the serving lockstep runs after steps that finished requests: rank 1 finished
    other tokens than rank 0, and every rank raises; the same tokens pass."""
    for rank in (rank["lockstep"] for rank in ranks):
        assert rank["same"] is None
        assert "ranks [1] generated other tokens than rank 0" in rank["different"]


def test_unsupported_cases_are_refused(target, monkeypatch):
    with pytest.raises(ValueError, match="divisible by 4, the model has 8 query and 2 KV heads"):
        local_heads(target.config, 4)
    for option in ("compile", "use_cuda_graphs"):
        options = {"compile": None, "use_cuda_graphs": None, option: True}
        with pytest.raises(ValueError, match=f"{option}: a tensor-parallel target runs eagerly"):
            check_tensor_parallel(target, None, **options, exact=False)
    with pytest.raises(ValueError, match="exact mode"):
        check_tensor_parallel(target, None, compile=None, use_cuda_graphs=None, exact=True)
    with monkeypatch.context() as sharded:
        # The scheduler serves a sharded target (tests/test_parallel_serving.py), eagerly and
        # with its prompts fed between the steps.
        sharded.setattr(target, "_tp_size", WORLD)
        with pytest.raises(ValueError, match="compile: a tensor-parallel target runs eagerly"):
            Scheduler(target, compile=True)
        with pytest.raises(ValueError, match="overlap_prefill: a tensor-parallel target feeds"):
            Scheduler(target, overlap_prefill=True)
        with pytest.raises(ValueError, match="read_ahead: a tensor-parallel target reads each"):
            Scheduler(target, read_ahead=True)
    # A draft model that is itself sharded (as transformers records it) is refused.
    drafter = DrafterSpec.parse("draft:tiny-code-draft:4").build(target)
    monkeypatch.setattr(drafter.draft_model, "_tp_size", WORLD)
    with pytest.raises(ValueError, match="drafters run replicated"):
        check_tensor_parallel(target, drafter, compile=None, use_cuda_graphs=None, exact=False)


def test_sequences_digest_tells_outputs_apart():
    one = sequences_digest([torch.tensor([1, 2, 3]), torch.tensor([4])])
    assert torch.equal(one, sequences_digest([torch.tensor([1, 2, 3]), torch.tensor([4])]))
    for other in ([[1, 2], [3, 4]], [[1, 2, 3, 4]], [[1, 2, 3], [5]], [[4], [1, 2, 3]]):
        assert not torch.equal(one, sequences_digest([torch.tensor(s) for s in other])), other


def test_generate_command_launches_ranks_that_print_what_one_process_does(capfd, monkeypatch):
    """`specdec-fast generate --tensor-parallel 2` starts two ranks through
    torch.distributed.run; rank 0 alone prints, the completion one process prints."""
    monkeypatch.setattr(parallel, "launch", partial(parallel.launch, timeout=TIMEOUT))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # CPU ranks (gloo), also on a GPU machine
    command = ["generate", "--model", "tiny-code", "--prompt", "def fib(n):", "--json"]
    command += ["--device", "cpu"]
    command += ["--max-new-tokens", "12", "--drafter", "ngram"]
    assert main([*command, "--tensor-parallel", str(WORLD)]) == 0
    printed = capfd.readouterr().out.splitlines()
    records = [json.loads(line) for line in printed if line.startswith("{")]
    assert len(records) == 1 and records[0]["tensor_parallel"] == WORLD
    assert main(command) == 0
    single = json.loads(capfd.readouterr().out)
    assert records[0]["completion"] == single["completion"]
    assert records[0]["stats"]["accepted_tokens"] == single["stats"]["accepted_tokens"]


def test_a_rank_ends_with_its_code_and_its_output_flushed():
    """A rank (WORLD_SIZE set) ends without the interpreter's teardown (`parallel.end_rank`):
    its exit code is the command's, and what it printed into a pipe (block-buffered) arrives,
    the completion on stdout and an error's line on stderr."""
    environment = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    environment |= {"WORLD_SIZE": "1", "CUDA_VISIBLE_DEVICES": ""}
    command = [sys.executable, "-m", "specdec_fast", "generate", "--device", "cpu"]
    command += ["--max-new-tokens", "3", "--prompt", "def fib(n):"]
    done = subprocess.run(
        [*command, "--model", "tiny-code"],
        env=environment, capture_output=True, text=True, timeout=TIMEOUT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("def fib(n):") and "tokens/step" in done.stdout
    failed = subprocess.run(
        [*command, "--model", "/nonexistent/model"],
        env=environment, capture_output=True, text=True, timeout=TIMEOUT,
    )  # fmt: skip
    assert failed.returncode == 2 and "specdec-fast generate: error:" in failed.stderr
