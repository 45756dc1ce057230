"""The step's budget outside compiled graphs (issue 44): for plain decoding and every built-in
drafter, at batch 1 and 8 in compiled mode, one blocking host read per steady-state step (the
emitted tokens) and at most `MAX_EAGER_OPS` operators dispatched outside compiled graphs, each a
kernel launch on a GPU. Counted on the CPU as an accelerator would run the step
(`bench/step_ops.py`: our kernels count as their launches, `to_device` as its copy, the
host-resident shortcuts off); on CUDA the `gpu` tests run steady-state steps under
`torch.cuda.set_sync_debug_mode("error")`, `generate`'s and the server scheduler's reading ahead,
which catches the syncs hidden inside torch operators (`nonzero`, boolean indexing) that no
count on the CPU sees.

Cost: each drafter compiles its step shapes once per batch class (1, 2+); the target's compiled
steps are kept on the module's model and shared by every drafter with the same hooks, a
drafter's models by its batch sizes and temperatures (one factory each). Dynamo captures the
graphs as `generate(compile=True)` does, and its `eager` backend runs them as captured
(`graphs_without_codegen`): the module costs about 200 CPU seconds (with `aot_eager` 1.8x that,
with inductor 49 minutes, the same counts). The target is the bundled one cut to its first two
layers (what runs outside the graphs does not depend on the depth inside them; dynamo's capture
costs each layer), the draft models (the bundled draft and PARD's) to their first layer (their
loops compile as one region at any depth). EAGLE-3's bundled head reads the full target's
layers 1, 3 and 5: an untrained EAGLE-3 head for the cut target (its layers 0, 1 and 1, a
reduced draft vocabulary as the bundled one's) stands in for it. The counted runs are short (6
and 20 new tokens, 48-token prompts).
"""

import functools
import sys
from unittest import mock

import numpy as np
import pytest
import torch
from bench_smoke import BENCH_DIR
from built_in_drafters import DRAFTERS, write_untrained_blocks
from tiny_models import first_layers

import specdec_fast
from specdec_fast import NGramDrafter, bundled, generate, transfer
from specdec_fast.drafters.registry import DrafterSpec
from specdec_fast.heads.eagle import Eagle3Head
from specdec_fast.loading import load_model, load_tokenizer
from specdec_fast.prompts import load_code_prompts
from specdec_fast.serving import Request, Scheduler

sys.path.insert(0, str(BENCH_DIR))
from step_ops import (  # noqa: E402
    LONG,
    MAX_EAGER_OPS,
    MAX_READS,
    PROMPT_TOKENS,
    SHORT,
    counting,
    eager_ops,
    step_counts,
)

BATCHES = [1, 8]
# The built-in drafters, and a block drafter with a lookup grafted on (the real-model demo's);
# the EAGLE graft is among the built-ins, and both go through one `GraftedDrafter`.
BUDGETED = [*DRAFTERS, "block:{dflash}:8+ngram:8"]

pytestmark = pytest.mark.skipif(
    "tiny-code" not in bundled.available(), reason="the bundled checkpoints are not installed"
)


@pytest.fixture(scope="module", autouse=True)
def graphs_without_codegen():
    """Compiled mode, dynamo's graphs run as captured (its `eager` backend) rather than by
    inductor: which operators run inside a compiled region and which outside is dynamo's
    capture (graph breaks, guards, the regions' boundaries), the same for any backend.
    Inductor's code generation, most of a compile's 10-25 s per step shape on this CPU, and
    `aot_eager`'s AOT tracing (44% of the CPU time of plain decoding's and the n-gram
    drafter's cases) would only make the regions faster."""
    with mock.patch.object(torch, "compile", functools.partial(torch.compile, backend="eager")):
        yield


SHALLOW_LAYERS = 2
DRAFT_LAYERS = 1


@pytest.fixture(scope="module")
def target():
    return first_layers(load_model("tiny-code", torch.device("cpu")), SHALLOW_LAYERS)


@pytest.fixture(scope="module")
def prompts():
    tokenizer = load_tokenizer("tiny-code")
    return [
        [tokenizer.bos_token_id, *tokenizer.encode(r["prompt"], add_special_tokens=False)][
            :PROMPT_TOKENS
        ]
        for r in load_code_prompts(max(BATCHES))
    ]


@pytest.fixture(scope="module")
def checkpoints(target, tmp_path_factory):
    """The `{dflash}`/`{pard}` spec fields, and `{draft}`/`{eagle3}`: what stands in for the
    bundled draft model (cut to its first layer) and EAGLE-3 head (untrained, for the cut
    target)."""
    folder = tmp_path_factory.mktemp("checkpoints")
    draft, eagle3 = folder / "draft", folder / "eagle3"
    first_layers(load_model("tiny-code-draft", torch.device("cpu")), DRAFT_LAYERS).save_pretrained(
        draft
    )
    blocks = write_untrained_blocks(target, folder, DRAFT_LAYERS)  # seeds torch
    vocab = target.config.vocab_size
    draft_ids = torch.randperm(vocab)[: 2 * vocab // 3].tolist()
    Eagle3Head.for_target(target, draft_ids, target_layers=(0, 1, 1)).save_pretrained(eagle3)
    return {**blocks, "draft": str(draft), "eagle3": str(eagle3)}


@pytest.fixture(scope="module")
def factories(target, checkpoints):
    """One factory per drafter for the module: its models load once, and their compiled steps
    serve both batch sizes."""
    cache = {}

    def factory(spec):
        if spec not in cache:
            stand_ins = spec.replace("tiny-code-draft", "{draft}")
            parsed = stand_ins.replace("tiny-code-eagle3", "{eagle3}").format(**checkpoints)
            cache[spec] = DrafterSpec.parse(parsed).factory(target)
        return cache[spec]

    return factory


def compiled_run(target, make, prompts, batch, temperature=0.0):
    def run(new_tokens):
        return generate(
            target,
            prompts[:batch],
            drafter=make(),
            max_new_tokens=new_tokens,
            eos_token_id=[],
            temperature=temperature,
            seed=3,
            compile=True,
        )

    return run


def counted(run):
    # Compiles every step shape the counted runs meet: rows that finish at other steps in the
    # short run than in the long one leave other batch sizes.
    run(SHORT)
    run(LONG)
    return step_counts(run)


@pytest.mark.parametrize("batch", BATCHES, ids=[f"B{b}" for b in BATCHES])
@pytest.mark.parametrize("spec", BUDGETED)
def test_one_read_and_few_eager_ops_per_step(target, prompts, factories, spec, batch):
    counts = counted(compiled_run(target, factories(spec), prompts, batch))
    assert counts.compiled == {}, "a counted run compiled: the warm-up missed a shape"
    # The read-back itself happens every step (the read count can fail: it is not zero).
    read_backs = sum(n for site, n in counts.reads.items() if site.startswith("to_host "))
    assert read_backs >= counts.steps, counts.reads.most_common()
    # Both limits in one check: a failure shows both counts, the top operators and the reads.
    within = counts.reads_per_step <= MAX_READS and counts.ops_per_step <= MAX_EAGER_OPS
    assert within, f"{spec} B={batch}: ops | reads | top ops | read sites: {counts.row()}"


@pytest.mark.parametrize(
    "spec", ["draft:tiny-code-draft:4", "block:{dflash}:8", "block-chain:{dflash}:4"]
)
def test_sampled_steps_read_once(target, prompts, factories, spec):
    """Sampled steps draw on the device too (the draft model's and the block drafter's chains
    their drafts at the roots' positions, the block drafter's tree its verify), in the compiled
    steps the greedy test warmed."""
    counts = counted(compiled_run(target, factories(spec), prompts, 8, temperature=0.8))
    assert counts.reads_per_step <= MAX_READS, counts.reads.most_common()


@pytest.mark.parametrize("batch", BATCHES, ids=[f"B{b}" for b in BATCHES])
def test_the_device_lookup_reads_once_and_drafts_as_the_host_lookup(target, prompts, batch):
    """The n-gram drafter's device lookup (its default on CUDA when compiling, where the
    registry's `ngram` specs and grafts use it), compiled: within both limits, and the host
    lookup's tokens and steps."""
    run = compiled_run(target, lambda: NGramDrafter(8, device_lookup=True), prompts, batch)
    counts = counted(run)
    within = counts.reads_per_step <= MAX_READS and counts.ops_per_step <= MAX_EAGER_OPS
    assert within, f"device n-gram B={batch}: {counts.row()}"
    compiled = run(LONG)
    host = NGramDrafter(8, device_lookup=False)
    eager = generate(target, prompts[:batch], drafter=host, max_new_tokens=LONG, eos_token_id=[])
    assert [s.tolist() for s in compiled.sequences] == [s.tolist() for s in eager.sequences]
    steps = [[s.steps, s.drafted, s.accepted] for s in compiled.stats.sequences]
    assert steps == [[s.steps, s.drafted, s.accepted] for s in eager.stats.sequences]


class StrayLoop(specdec_fast.NGramDrafter):
    """An n-gram drafter whose update reads the accepted counts and loops over them eagerly."""

    def update(self, state, outcome):
        super().update(state, outcome)
        for count in outcome.num_accepted.tolist():
            outcome.num_accepted.add(count)
        outcome.num_accepted.clamp(min=0).sum().item()
        for _ in range(MAX_EAGER_OPS):
            outcome.next_tokens.add(1)


def test_the_counter_sees_a_stray_loop_and_its_reads(target, prompts):
    """Over the n-gram drafter's compiled steps, a drafter that adds two reads and B + 32
    operators a step fails both limits."""
    stray = counted(compiled_run(target, lambda: StrayLoop(max_nodes=8), prompts, 8))
    assert stray.reads_per_step >= 1 + 2
    assert stray.ops_per_step >= MAX_EAGER_OPS + 8 + 2


def test_launches_count_as_on_a_gpu():
    """Inside `counting`: an upload counts as its one copy however the host builds it, our
    verify kernel as its two launches whatever its CPU implementation dispatches, and reads
    through the transfer module or a tensor are recorded with their line."""
    logits = torch.randn(2, 3, 11)
    tokens = torch.tensor([[0, 4, 5], [0, 1, 2]])
    parents = torch.tensor([[-1, 0, 1], [-1, 0, 0]])
    verify = sys.modules["specdec_fast.kernels.verify"]
    params = verify.SamplingParams(torch.tensor([0.0, 0.9]), 0, 1.0, 5)

    def step():
        uploaded = transfer.to_device(np.arange(12, dtype=np.int32).reshape(3, 4), logits.device)
        verify.run_verify(logits, tokens, parents, None, params)
        transfer.to_host(uploaded)
        return uploaded.sum().item()

    with counting() as reads:
        ops, _ = eager_ops(step)
    assert dict(ops) == {
        "specdec_fast::launch.to_device": 1,
        "specdec_fast::launch.run_verify": 2,
        "aten::sum": 1,
    }
    assert [read.kind for read in reads] == ["to_host", "item"]
    assert all(read.where.startswith("test_step_budget.py:") for read in reads)
    # Outside `counting` the same step is counted by its CPU operators.
    plain, _ = eager_ops(step)
    assert "specdec_fast::launch.run_verify" not in plain and sum(plain.values()) > 3


@pytest.mark.gpu
@pytest.mark.parametrize("batch", BATCHES, ids=[f"B{b}" for b in BATCHES])
@pytest.mark.parametrize("spec", DRAFTERS)
def test_steady_steps_never_sync_but_for_the_read_back(spec, batch, tmp_path, monkeypatch):
    """After the first step, every device sync but the step's read-back (`to_host`, counted by
    the CPU test above) raises: the steps run under `set_sync_debug_mode("error")`. Eager
    forwards under CUDA graphs (compiling every shape would cost the GPU run minutes); the
    host work between graphs is the same code."""
    device = torch.device("cuda")
    model = load_model("tiny-code", device)
    paths = write_untrained_blocks(model, tmp_path) if "{" in spec else {}
    make = DrafterSpec.parse(spec.format(**paths)).factory(model)
    tokenizer = load_tokenizer("tiny-code")
    prompts = [
        [tokenizer.bos_token_id, *tokenizer.encode(r["prompt"], add_special_tokens=False)]
        for r in load_code_prompts(batch)
    ]
    armed = []
    arm_after_read_backs(monkeypatch, armed)
    generate(model, prompts, drafter=make(), max_new_tokens=24, eos_token_id=[])  # graphs
    armed.append(True)
    try:
        out = generate(model, prompts, drafter=make(), max_new_tokens=24, eos_token_id=[])
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert out.stats.steps > 2


def arm_after_read_backs(monkeypatch, armed: list) -> None:
    """Every step's read-back (`transfer.to_host`) runs with sync checks off; once `armed` holds
    anything, each read-back leaves them on ("error"): any other sync of a step then raises."""
    original = transfer.to_host

    def read_back(tensor, landed=None):
        torch.cuda.set_sync_debug_mode(0)
        try:
            return original(tensor, landed)
        finally:
            if armed:
                torch.cuda.set_sync_debug_mode("error")

    for module in [m for name, m in sys.modules.items() if name.startswith("specdec_fast")]:
        if getattr(module, "to_host", None) is original:
            monkeypatch.setattr(module, "to_host", read_back)


@pytest.mark.gpu
@pytest.mark.parametrize("spec", ["none", "eagle:tiny-code-eagle3:8", "block:tiny-code-dflash:8"])
def test_served_steady_steps_never_sync_but_for_the_read_back(spec, monkeypatch):
    """The server's scheduler, reading ahead (its default on CUDA), with four requests decoding:
    once they have joined, every device sync but the steps' read-backs raises, until they have
    left; the second wave's outputs are the first's (which compiled and captured)."""
    device = torch.device("cuda")
    model = load_model("tiny-code", device)
    drafter = None if spec == "none" else DrafterSpec.parse(spec).build(model)
    tokenizer = load_tokenizer("tiny-code")
    prompts = [
        [tokenizer.bos_token_id, *tokenizer.encode(r["prompt"], add_special_tokens=False)][:40]
        for r in load_code_prompts(4)
    ]
    scheduler = Scheduler(model, {"route": drafter}, max_batch=4, eos_token_id=[], compile=False)
    assert scheduler.read_ahead
    armed = []
    arm_after_read_backs(monkeypatch, armed)
    try:
        waves = []
        for wave in range(2):
            handles = [scheduler.submit(Request(p, 24, route="route")) for p in prompts]
            while len(scheduler.rows) < len(prompts):  # the prompts fed, the rows joined
                scheduler.step()
            if wave:
                armed.append(True)
            try:
                scheduler.run_until_idle()
            finally:
                armed.clear()
                torch.cuda.set_sync_debug_mode(0)
            waves.append([handle.completion.tokens for handle in handles])
    finally:
        scheduler.close()
    assert waves[0] == waves[1] and scheduler.counters.queued > 0
