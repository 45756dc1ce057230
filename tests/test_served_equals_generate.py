"""Served outputs are `generate`'s: both run the same step (`specdec_fast.step`).

For every built-in drafter over the bundled tiny-code target, three requests (two greedy, one
sampled, each with its own seed) go through the `Scheduler` (no HTTP) in one batch, and the same
three prompts through `generate` with the same per-row parameters. Each request's tokens, finish
reason and speculation statistics (steps, drafted and accepted tokens, per-depth counts) equal
`generate`'s row for row: not only the tokens (which plain decoding would give too, when greedy)
but the trees the drafter proposed and what the target accepted of them, step by step.
"""

import pytest
import torch
from built_in_drafters import DRAFTERS, write_untrained_blocks

from specdec_fast import bundled, generate
from specdec_fast.drafters.registry import DrafterSpec
from specdec_fast.loading import load_model, load_tokenizer
from specdec_fast.prompts import load_code_prompts
from specdec_fast.serving import Request, Scheduler

NEW_TOKENS = 16
TEMPERATURES = [0.0, 0.8, 0.0]
SEEDS = [11, 12, 13]
# SequenceStats fields that follow the step's trees and acceptance (timings excluded).
STEP_FIELDS = (
    "prompt_tokens",
    "new_tokens",
    "steps",
    "drafted",
    "accepted",
    "position_offered",
    "position_accepted",
    "finish_reason",
)

pytestmark = pytest.mark.skipif(
    "tiny-code" not in bundled.available(), reason="the bundled checkpoints are not installed"
)


@pytest.fixture(scope="module")
def target():
    return load_model("tiny-code", torch.device("cpu"))


@pytest.fixture(scope="module")
def blocks(target, tmp_path_factory):
    return write_untrained_blocks(target, tmp_path_factory.mktemp("blocks"))


@pytest.fixture(scope="module")
def prompts():
    tokenizer = load_tokenizer("tiny-code")
    return [
        [tokenizer.bos_token_id, *tokenizer.encode(r["prompt"], add_special_tokens=False)][:40]
        for r in load_code_prompts(3)
    ]


def step_stats(stats) -> dict:
    return {name: getattr(stats, name) for name in STEP_FIELDS}


# The built-in drafters, and a block drafter with a lookup grafted on (the demo's grafted DFlash
# head; the stand-in drafts from a draft vocabulary as that head does).
@pytest.mark.parametrize("spec", [*DRAFTERS, "block:{dflash}:8+ngram:8"])
def test_served_requests_equal_generate(target, prompts, blocks, spec):
    make = DrafterSpec.parse(spec.format(**blocks)).factory(target)
    out = generate(
        target,
        prompts,
        drafter=make(),
        max_new_tokens=NEW_TOKENS,
        temperature=TEMPERATURES,
        seed=SEEDS,
        eos_token_id=[],
    )
    # One prefill chunk for every prompt: the three requests join at once, as generate's batch.
    scheduler = Scheduler(target, {"route": make()}, max_batch=3, prefill_chunk=64, eos_token_id=[])
    try:
        handles = [
            scheduler.submit(Request(prompt, NEW_TOKENS, temperature=t, seed=seed, route="route"))
            for prompt, t, seed in zip(prompts, TEMPERATURES, SEEDS, strict=True)
        ]
        scheduler.run_until_idle()
    finally:
        scheduler.close()
    for row, (prompt, handle) in enumerate(zip(prompts, handles, strict=True)):
        completion = handle.completion
        assert completion.tokens == out.sequences[row][len(prompt) :].tolist(), row
        assert step_stats(completion.stats) == step_stats(out.stats.sequences[row]), row
    if spec != "none":
        # The drafter drafted: the statistics compared are the trees', not plain steps'.
        assert out.stats.drafted_tokens > 0
        assert all(handle.completion.speculated for handle in handles)
