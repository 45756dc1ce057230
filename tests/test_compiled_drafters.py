"""Compiled draft steps of the draft-model and Medusa drafters: a draft model's chain or tree
(its whole per-depth loop, one compiled step) and Medusa's heads step (the pick of the last
accepted state, the heads, their top-k and the tree's gather) draft what the eager drafters
draft, and the output stays HF's greedy output. The target runs eagerly (conftest); only the
drafters' steps compile, attached under a compile choice of on. The block drafters' compiled
steps are tests/test_block.py's (`test_compiled_dflash_steps_match_eager_and_compile_once`) and
tests/test_step_budget.py's."""

import pytest
from drafter_wrappers import AttachedUnder
from test_compiled_step import hf_greedy
from test_medusa import HIDDEN, random_heads
from tiny_models import repetitive_prompts, tiny_llama

from specdec_fast import DraftModelDrafter, MedusaDrafter, generate
from specdec_fast.trees import default_tree

VOCAB = 96
NEW_TOKENS = 16

pytestmark = pytest.mark.slow

DRAFTERS = {
    # The draft loops compile as steps of the draft model's runner (labels name its model type).
    # Short ones: a loop unrolls its forwards in the graph, each the same code (a 3-token chain
    # and a 6-node tree took the module's cold compile from 66 to 84 s alone).
    "draft chain": (lambda draft: DraftModelDrafter(draft, num_tokens=2), "llama draft loop chain"),
    "draft tree": (
        lambda draft: DraftModelDrafter(draft, tree=default_tree(5)),
        "llama draft loop tree",
    ),
    "medusa": (lambda draft: MedusaDrafter(random_heads(HIDDEN, VOCAB, num_heads=3)), "medusa"),
}


@pytest.fixture(scope="module")
def models():
    target = tiny_llama(VOCAB, hidden_size=HIDDEN, seed=11)
    return target, tiny_llama(VOCAB, hidden_size=32, layers=1, seed=12)


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_compiled_draft_steps_draft_as_eagerly(models, name):
    target, draft = models
    make, label = DRAFTERS[name]
    prompts = repetitive_prompts([5, 17, 9], VOCAB, seed=1)
    eager = generate(target, prompts, drafter=make(draft), max_new_tokens=NEW_TOKENS)
    compiled = generate(
        target, prompts, drafter=AttachedUnder(make(draft), True), max_new_tokens=NEW_TOKENS
    )
    want = hf_greedy(target, prompts, NEW_TOKENS)
    assert [s.tolist() for s in eager.sequences] == want
    assert [s.tolist() for s in compiled.sequences] == want
    accepted = [[s.accepted for s in out.stats.sequences] for out in (eager, compiled)]
    assert accepted[0] == accepted[1] and sum(accepted[0]) > 0
    assert any(what.startswith(label) for what in compiled.stats.compiled), compiled.stats.compiled
    assert not any(what.startswith(label) for what in eager.stats.compiled)
