"""One blocking host read per step: the emitted tokens, for every bundled drafter.

On a GPU every device-to-host read stalls the host until the device catches up, so the engine
reads once per step (`specdec_fast.transfer.to_host`) and nothing else in the step loop reads
device tensors; a drafter may read once more where host work beats device launches (EAGLE's
trees, and the block drafters' best-first heap when they run eagerly). This machine has no GPU, so
the test patches the transfer points instead: `to_host`, `to_host_array`, and every implicit
read a tensor offers (`tolist`, `item`, `bool(t)`, `int(t)`, ...) when called from the engine
or a drafter (kernel implementations are device work, and reads inside torch or transformers
are theirs, so neither is counted). Reads per step are measured as a difference between a
short and a long generation of the same prompt, so that the once-per-call reads (prompt
lengths at prefill, the sampling parameters) cancel out.
"""

import sys
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import pytest
import torch
import transformers
from drafter_wrappers import AttachedUnder

import specdec_fast
from specdec_fast import BlockDrafter, PardDraft, bundled, generate, transfer
from specdec_fast.drafters.block import load_block_model
from specdec_fast.drafters.registry import DrafterSpec
from specdec_fast.heads.block import DFlashHead
from specdec_fast.loading import load_model, load_tokenizer
from specdec_fast.prompts import load_code_prompts

# Reads made from these are not the engine's: the kernel implementations (device work), the
# transfer module itself (counted as `to_host`), and the libraries underneath.
NOT_ENGINE = tuple(
    Path(module.__file__).resolve().parent for module in (specdec_fast.kernels, torch, transformers)
)
TRANSFER = Path(transfer.__file__).resolve()
IMPLICIT_READS = ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")

# (spec, reads allowed per step beyond the one read-back)
DRAFTERS = [
    ("none", 0),
    ("ngram:8", 0),
    ("suffix:16", 0),
    ("medusa:tiny-code-medusa:8", 0),
    ("draft:tiny-code-draft:4", 0),
    ("draft-tree:tiny-code-draft:8", 0),
    ("eagle:tiny-code-eagle:8", 1),
    ("eagle:tiny-code-eagle3:8", 1),
    # Block drafters over untrained checkpoints in the bundled layouts (written by `blocks`):
    # run eagerly, their best-first trees read the block's top-K once (the heap runs on the
    # host); compiled, they read nothing (`test_compiled_block_trees_read_nothing_more`).
    ("block:{dflash}:8", 1),
    ("block:{pard}:8", 1),
]

pytestmark = pytest.mark.skipif(
    "tiny-code" not in bundled.available(), reason="the bundled checkpoints are not installed"
)


@contextmanager
def counted_reads():
    """Count `to_host`/`to_host_array` calls and implicit tensor reads made by the engine and
    drafters (not by the kernels, torch or transformers); yields the list of (kind, file, line)
    records."""
    reads = []
    originals = {name: getattr(torch.Tensor, name) for name in IMPLICIT_READS}

    def wrap(name, original):
        def method(self, *args, **kwargs):
            frame = sys._getframe(1)
            caller = Path(frame.f_code.co_filename).resolve()
            if caller != TRANSFER and not any(caller.is_relative_to(p) for p in NOT_ENGINE):
                reads.append((name, str(caller), frame.f_lineno))
            return original(self, *args, **kwargs)

        return method

    def to_host(tensor):
        reads.append(("to_host", "transfer.py", 0))
        return originals["tolist"](tensor)

    def to_host_array(tensor):
        reads.append(("to_host_array", "transfer.py", 0))
        return originals["numpy"](originals["cpu"](tensor))

    for name, original in originals.items():
        setattr(torch.Tensor, name, wrap(name, original))
    try:
        # Modules that imported the name hold their own reference.
        # The CPU shortcuts that read tensors in host memory are off: the reads counted are
        # an accelerator's, where those tensors would live on the device.
        with (
            mock.patch.object(transfer, "to_host", to_host),
            mock.patch("specdec_fast.batch.to_host", to_host),
            mock.patch("specdec_fast.trees.to_host_array", to_host_array),
            mock.patch("specdec_fast.trees.host_resident", lambda tensor: False),
        ):
            yield reads
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


@pytest.fixture(scope="module")
def setup():
    target = load_model("tiny-code", torch.device("cpu"))
    tokenizer = load_tokenizer("tiny-code")
    record = load_code_prompts(1)[0]
    prompt = [tokenizer.bos_token_id, *tokenizer.encode(record["prompt"], add_special_tokens=False)]
    return target, prompt


@pytest.fixture(scope="module")
def blocks(setup, tmp_path_factory):
    """Untrained block drafters for the bundled target: a DFlash head, and the bundled draft
    model as a PARD model (its pad token as the mask)."""
    target, _ = setup
    dflash = tmp_path_factory.mktemp("dflash")
    torch.manual_seed(0)
    DFlashHead.for_target(target, num_layers=1, block_size=8).save_pretrained(dflash)
    pard = tmp_path_factory.mktemp("pard")
    draft = load_model("tiny-code-draft", torch.device("cpu"))
    PardDraft(draft, draft.config.pad_token_id).save_pretrained(pard)
    return {"dflash": str(dflash), "pard": str(pard)}


def reads_per_step(target, prompt, make, temperature):
    """Reads per step of `generate` with drafters from `make()` (a short and a long run), and
    the long run's records and steps."""
    counts = []
    for new_tokens in (6, 30):
        with counted_reads() as reads:
            out = generate(
                target,
                [prompt],
                drafter=make(),
                max_new_tokens=new_tokens,
                eos_token_id=[],
                temperature=temperature,
                seed=3,
            )
        counts.append((len(reads), out.stats.steps, reads))
    (short_reads, short_steps, _), (long_reads, long_steps, records) = counts
    assert long_steps > short_steps
    return (long_reads - short_reads) / (long_steps - short_steps), records, long_steps


@pytest.mark.parametrize(("spec", "extra"), DRAFTERS, ids=[spec for spec, _ in DRAFTERS])
@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
def test_one_host_read_per_step(setup, blocks, spec, extra, temperature):
    target, prompt = setup
    make = DrafterSpec.parse(spec.format(**blocks)).factory(target)
    per_step, records, steps = reads_per_step(target, prompt, make, temperature)
    assert per_step <= 1 + extra, records[-20:]
    # The read-back itself happens every step (the count can fail: it is not zero).
    assert sum(1 for kind, _, _ in records if kind == "to_host") >= steps


@pytest.mark.parametrize("flavour", ["dflash", "pard"])
def test_sampled_block_chains_read_nothing_more(setup, blocks, flavour):
    """The sampled chain (the registry's block kind builds trees) draws on the device too."""
    target, prompt = setup
    model = load_block_model(blocks[flavour], target)
    per_step, records, _ = reads_per_step(
        target, prompt, lambda: BlockDrafter(model, max_nodes=5, tree="chain"), 0.8
    )
    assert per_step <= 1, records[-20:]


@pytest.mark.parametrize("flavour", ["dflash", "pard"])
def test_compiled_block_trees_read_nothing_more(setup, blocks, flavour):
    """Compiled, a block drafter's best-first tree is built inside its compiled step (device
    rounds): the step's one read-back is the only read."""
    target, prompt = setup
    model = load_block_model(blocks[flavour], target)
    per_step, records, _ = reads_per_step(
        target, prompt, lambda: AttachedUnder(BlockDrafter(model, max_nodes=8), True), 0.0
    )
    assert per_step <= 1, records[-20:]


def test_the_counter_sees_a_stray_read(setup):
    """A drafter that reads a device tensor each step is caught."""
    target, prompt = setup

    class Reading(specdec_fast.NGramDrafter):
        def update(self, state, outcome):
            super().update(state, outcome)
            outcome.num_accepted.tolist()

    counts = []
    for new_tokens in (6, 30):
        with counted_reads() as reads:
            out = generate(target, [prompt], drafter=Reading(), max_new_tokens=new_tokens)
        counts.append((len(reads), out.stats.steps))
    per_step = (counts[1][0] - counts[0][0]) / (counts[1][1] - counts[0][1])
    assert per_step >= 2
