"""Compiled steps: `generate(compile=True)` gives HF's greedy output, compiles each step kind once,
and a later call (other prompts, lengths, batch size) compiles nothing; the model comes out of
every call, errors included, with its own attention; past the recompile limit a step runs
eagerly.

The other engine tests run eagerly (conftest sets SPECDEC_COMPILE=0); these compile tiny models
with inductor, a few seconds per graph.
"""

import gc
import warnings

import pytest
import torch
from tiny_models import repetitive_prompts, tiny_llama

from specdec_fast import DraftModelDrafter, NGramDrafter, generate
from specdec_fast.compiled import (
    COMPILE_ENV,
    FREEZE_ENV,
    FREEZE_MAX_BYTES,
    STEP_RECOMPILE_LIMIT,
    CompiledStep,
    compile_by_default,
    compile_choice,
    freeze_by_default,
    graphs_compiled,
)
from specdec_fast.runner import kept_runner

VOCAB = 96
NEW_TOKENS = 20

pytestmark = pytest.mark.slow


def hf_greedy(model, prompts, max_new_tokens=NEW_TOKENS):
    with torch.no_grad():
        return [
            model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=max_new_tokens)[
                0
            ].tolist()
            for p in prompts
        ]


@pytest.fixture(scope="module")
def models():
    return tiny_llama(VOCAB, seed=11), tiny_llama(VOCAB, hidden_size=32, layers=1, seed=12)


class HiddenNGram(NGramDrafter):
    """The n-gram drafter asking for hidden states, as EAGLE and Medusa do: the runner's hooks
    then run inside the compiled steps."""

    hidden_layers = (0, -1)


def test_compiled_generate_equals_hf_greedy_and_recompiles_nothing(models):
    """Plain decoding: a batch of 3, then one of 2 with other prompts and lengths (no new
    graph), then two single prompts (the compiler keeps batch size 1 apart: at most the first
    compiles). Every output equals HF's greedy decoding. Drafters over compiled targets: n-gram
    trees at every batch size, compiling once, in tests/test_continuous_batching.py
    (`test_compiled_steps_serve_joins_...`) and below (rows finishing early); EAGLE-3's in
    tests/test_eagle.py; every built-in drafter's graphs, by dynamo's capture, in
    tests/test_step_budget.py and below (a batch of one after a wider one, first steps)."""
    target, _ = models
    calls = [
        repetitive_prompts([5, 17, 9], VOCAB, seed=1),
        repetitive_prompts([12, 3], VOCAB, seed=2),
        repetitive_prompts([7], VOCAB, seed=3),
        repetitive_prompts([14], VOCAB, seed=4),
    ]
    compiled = []
    for prompts in calls:
        before = graphs_compiled()
        out = generate(target, prompts, drafter=None, max_new_tokens=NEW_TOKENS, compile=True)
        assert [s.tolist() for s in out.sequences] == hf_greedy(target, prompts)
        compiled.append(graphs_compiled() - before)
        # The call reports what it compiled (its first runs of new graphs), nothing else.
        assert bool(out.stats.compiled) == (compiled[-1] > 0), out.stats.compiled
    assert compiled[0] > 0 and compiled[1] == 0 and compiled[3] == 0, compiled
    runner = kept_runner(target, compile=True)
    assert runner.compile and runner.compile_seconds  # the first calls' compilations
    assert target.config._attn_implementation != "specdec_tree"


def test_steps_with_hidden_state_hooks_compile_once(capture_only):
    """A drafter reading hidden states (hooks inside the compiled steps): a second call with the
    same prompts compiles nothing (the hooks' dict used to make it compile prefill again). The
    compilation's objects leave the garbage collector's generations (frozen), so its full
    collections stop walking them. Dynamo's capture alone (its `eager` backend, over a target
    of its own): the guards decide what compiles, and the freezing is ours."""
    target = tiny_llama(VOCAB, seed=11)
    prompts = repetitive_prompts([5, 17, 9], VOCAB, seed=1)
    want = hf_greedy(target, prompts)
    compiled = []
    gc.unfreeze()
    for _ in range(2):
        before = graphs_compiled()
        out = generate(
            target, prompts, drafter=HiddenNGram(max_nodes=6), max_new_tokens=NEW_TOKENS,
            compile=True,
        )  # fmt: skip
        assert [s.tolist() for s in out.sequences] == want
        compiled.append(graphs_compiled() - before)
    assert compiled[0] > 0 and compiled[1] == 0, compiled
    assert gc.get_freeze_count() > 0


def test_compiled_rows_that_finish_early_shrink_the_batch(models):
    """Rows stopping at different steps (an EOS token, max tokens) shrink the batch down to one
    row, with the compiled step serving each batch size."""
    target, _ = models
    prompts = repetitive_prompts([4, 11, 6, 8], VOCAB, seed=3)
    expected = hf_greedy(target, prompts, 24)
    eos = expected[2][len(prompts[2]) + 5]  # row 2 stops at its 6th new token at the latest

    def cut(sequence, prompt):
        generated = sequence[len(prompt) :]
        return sequence[: len(prompt) + generated.index(eos) + 1] if eos in generated else sequence

    out = generate(
        target,
        prompts,
        drafter=NGramDrafter(max_nodes=5),
        max_new_tokens=24,
        eos_token_id=eos,
        compile=True,
    )
    assert [s.tolist() for s in out.sequences] == [
        cut(sequence, prompt) for sequence, prompt in zip(expected, prompts, strict=True)
    ]
    assert len({len(s) for s in out.sequences}) > 1  # the rows did finish at different steps


def test_a_batch_of_one_after_a_wider_one_compiles_nothing(capture_only):
    """The cache keeps the storage rows of the widest call so far. Batches of 1, 3, then 1:
    the last reuses the batch-1 graphs that the first compiled over a one-row storage (whose
    row count is unbacked, `SpecKVCache._bind`; dynamo specialised it at 1, and the last call
    compiled every batch-1 step again), for the target's steps and a DFlash drafter's (whose
    SDPA over its own cache checks the rows). Dynamo's capture alone (its `eager` backend):
    the guards are what decide. Outputs equal HF's greedy decoding."""
    from test_block import dflash_head

    from specdec_fast import BlockDrafter

    target = tiny_llama(VOCAB, layers=4, seed=13)
    head = dflash_head(target)
    calls = [
        repetitive_prompts([9], VOCAB, seed=5),
        repetitive_prompts([6, 13, 4], VOCAB, seed=6),
        repetitive_prompts([11], VOCAB, seed=7),
    ]
    for make in (lambda: None, lambda: BlockDrafter(head, max_nodes=4)):
        compiled = []
        for prompts in calls:
            out = generate(target, prompts, drafter=make(), max_new_tokens=12, compile=True)
            assert [s.tolist() for s in out.sequences] == hf_greedy(target, prompts, 12)
            compiled.append(sorted(out.stats.compiled))
        assert compiled[0] and compiled[1] and not compiled[2], compiled


def test_a_calls_first_steps_meet_the_drafters_graphs_of_its_later_ones(capture_only):
    """A drafter's first step of a call starts from the prompt, the later ones from a verify
    step's outcome; given other dtypes or sizes there, the first step compiled a graph of its
    own, in every process: DFlash's prompt context picked by int64 columns (an outcome's nodes
    are int32), Medusa's source one column wide (an outcome's N; the compiler specialises size
    1), PARD's feed cut to its accepted drafts' depth (a graph for feeds up to it, another past
    it). Batch-1 calls with other prompt lengths: no step of the target's or the drafters'
    fails a guard (dynamo's capture only, its `eager` backend). A target each (its steps
    compile per pattern of the drafter's hooks)."""
    from test_block import dflash_head, pard_draft
    from test_medusa import random_heads

    from specdec_fast import BlockDrafter, MedusaDrafter

    drafters = {
        "dflash": lambda target: BlockDrafter(dflash_head(target), max_nodes=8),
        "pard": lambda target: BlockDrafter(pard_draft(VOCAB), max_nodes=8),
        "medusa": lambda target: MedusaDrafter(random_heads(48, VOCAB, num_heads=3)),
    }
    failures = torch._dynamo.utils.guard_failures
    for name, make in drafters.items():
        target = tiny_llama(VOCAB, layers=4, seed=13)
        before = {code: len(reasons) for code, reasons in failures.items()}
        for length in (9, 14):
            prompts = repetitive_prompts([length], VOCAB, seed=length)
            out = generate(target, prompts, drafter=make(target), max_new_tokens=16, compile=True)
            assert [s.tolist() for s in out.sequences] == hf_greedy(target, prompts, 16)
        failed = {
            code.co_name: reasons[before.get(code, 0) :]
            for code, reasons in failures.items()
            if len(reasons) > before.get(code, 0)
        }
        assert failed == {}, (name, failed)


def scaled(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    return x * factor + 1


def test_a_step_past_the_recompile_limit_runs_eagerly_and_keeps_its_graphs():
    """Each dtype needs a graph of its own: with a limit of two the third dtype warns and runs
    eagerly (the right result, every later call too, without compiling), while the first two
    stay compiled. One graph serves every size of a dimension (dynamic from the first call)."""
    # config.patch, not monkeypatch: undoing a setattr breaks the config module's aliases.
    with torch._dynamo.config.patch(recompile_limit=2):
        _recompile_limit_of_two()


def test_a_step_holds_more_graphs_than_dynamos_limit():
    """A step's own limit (`STEP_RECOMPILE_LIMIT`) lets it compile past dynamo's: with dynamo's
    limit at two, four dtypes all compile, none warns, and each later call reuses its graph."""
    step = CompiledStep(scaled, "the test step")
    assert step.recompile_limit == STEP_RECOMPILE_LIMIT > 4
    dtypes = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
    with torch._dynamo.config.patch(recompile_limit=2), warnings.catch_warnings():
        warnings.simplefilter("error")
        for dtype in dtypes:
            out, seconds = step(torch.ones(3, 5, dtype=dtype), torch.tensor(3.0, dtype=dtype))
            assert seconds is not None and torch.equal(out, torch.full((3, 5), 4.0, dtype=dtype))
        before = graphs_compiled()
        for dtype in dtypes:
            out, seconds = step(torch.ones(6, 2, dtype=dtype), torch.tensor(3.0, dtype=dtype))
            assert seconds is None and torch.equal(out, torch.full((6, 2), 4.0, dtype=dtype))
        assert graphs_compiled() == before


def test_views_and_strided_arguments_compile_no_graph_of_their_own():
    """A step's arguments as callers hand them: a view of a whole tensor, the left part of a
    wider one (a step's outcome cut to a drafter's tree), a row of a wider padded row (stride
    of a size-1 dimension), an expanded row. After one graph per pattern of sizes 1 (batch 1,
    batch 2+), none compiles another, and each gives what the eager step gives."""
    step = CompiledStep(scaled, "the test step")
    factor = torch.tensor(3.0)
    wide = torch.arange(48.0).view(4, 12)
    calls = [
        torch.ones(4, 7),
        torch.ones(1, 7),
        wide[:3],
        wide[:, :5],
        wide[:1, :9],
        torch.arange(6.0).expand(3, -1),
        torch.arange(6.0).expand(1, -1),
        wide.t(),
    ]
    compiled = [step(x, factor)[1] is not None for x in calls]
    assert compiled == [True, True] + [False] * (len(calls) - 2)
    for x in calls:
        assert torch.equal(step(x, factor)[0], scaled(x, factor))


def test_recompile_limits_below_one_are_refused():
    with pytest.raises(ValueError, match="recompile_limit must be >= 1"):
        CompiledStep(scaled, "the test step", recompile_limit=0)


def _recompile_limit_of_two():
    step = CompiledStep(scaled, "the test step", recompile_limit=2)
    factor = torch.tensor(3.0)
    first = [step(torch.ones(3, 5), factor), step(torch.ones(4, 7), factor)]
    assert first[0][1] is not None and first[1][1] is None  # the second size compiles nothing
    assert torch.equal(first[1][0], torch.full((4, 7), 4.0))
    out, seconds = step(torch.ones(3, 5, dtype=torch.float64), factor.double())
    assert seconds is not None
    with pytest.warns(UserWarning, match="the test step met torch.compile's recompile limit"):
        out, seconds = step(torch.ones(3, 5, dtype=torch.float16), factor.half())
    assert seconds is None and torch.equal(out, torch.full((3, 5), 4.0, dtype=torch.float16))
    before = graphs_compiled()
    for _ in range(2):
        out, seconds = step(torch.ones(3, 5, dtype=torch.float16), factor.half())
        assert torch.equal(out, torch.full((3, 5), 4.0, dtype=torch.float16))
    out, seconds = step(torch.ones(6, 2), factor)
    assert torch.equal(out, torch.full((6, 2), 4.0))
    assert graphs_compiled() == before


def test_the_calls_compile_choice_reaches_the_drafters_models(models, monkeypatch):
    """`generate(compile=False)` with SPECDEC_COMPILE on: the draft model's runner runs eagerly
    too (it used to follow the variable) and nothing compiles. `compile_choice` overrides the
    variable within its block only, None leaves it, and the innermost choice wins."""
    monkeypatch.setenv(COMPILE_ENV, "1")
    target, _ = models
    draft = tiny_llama(VOCAB, hidden_size=32, layers=1, seed=13)  # no runners kept yet
    prompts = repetitive_prompts([6, 9], VOCAB, seed=4)
    before = graphs_compiled()
    out = generate(
        target, prompts, drafter=DraftModelDrafter(draft, num_tokens=2), max_new_tokens=8,
        compile=False,
    )  # fmt: skip
    assert [s.tolist() for s in out.sequences] == hf_greedy(target, prompts, 8)
    assert graphs_compiled() == before and out.stats.compiled == {}
    assert kept_runner(draft, compile=False) is not None
    assert kept_runner(draft, compile=True) is None
    with compile_choice(False):
        assert not compile_by_default()
        with compile_choice(None):
            assert not compile_by_default()
        with compile_choice(True):
            assert compile_by_default()
        assert not compile_by_default()
    assert compile_by_default()


def test_freezing_is_on_for_small_models_unless_told(monkeypatch):
    monkeypatch.delenv(FREEZE_ENV, raising=False)
    assert freeze_by_default(FREEZE_MAX_BYTES) and not freeze_by_default(FREEZE_MAX_BYTES + 1)
    monkeypatch.setenv(FREEZE_ENV, "0")
    assert not freeze_by_default(10)
    monkeypatch.setenv(FREEZE_ENV, "1")
    assert freeze_by_default(FREEZE_MAX_BYTES + 1)
    monkeypatch.setenv(FREEZE_ENV, "maybe")
    with pytest.raises(ValueError, match="SPECDEC_FREEZE must be 0 or 1"):
        freeze_by_default(10)


@pytest.mark.parametrize("freeze", ["1", "0"])
def test_frozen_steps_follow_weights_changed_in_place(monkeypatch, freeze):
    """A CPU runner with freezing (the default for small models) takes the weights into its
    graphs as constants: its output is HF's greedy, and after an in-place change of a weight
    the next call compiles anew and follows the changed model (the old constants would not)."""
    monkeypatch.setenv(FREEZE_ENV, freeze)
    target = tiny_llama(VOCAB, seed=21)
    # One prompt, plain decoding: two graphs (prefill, decode) keep the frozen compiles few.
    prompts = repetitive_prompts([5], VOCAB, seed=5)
    out = generate(target, prompts, drafter=None, max_new_tokens=NEW_TOKENS, compile=True)
    assert [s.tolist() for s in out.sequences] == hf_greedy(target, prompts)
    runner = kept_runner(target, compile=True)
    assert runner.freeze == (freeze == "1")
    with torch.no_grad():
        target.model.layers[0].mlp.down_proj.weight.mul_(-3.0)
        target.lm_head.weight.add_(0.5 * torch.randn_like(target.lm_head.weight))
    changed = hf_greedy(target, prompts)
    assert changed != [s.tolist() for s in out.sequences]  # the change shows in the output
    before = graphs_compiled()
    again = generate(target, prompts, drafter=None, max_new_tokens=NEW_TOKENS, compile=True)
    assert [s.tolist() for s in again.sequences] == changed
    if freeze == "1":
        assert graphs_compiled() > before
