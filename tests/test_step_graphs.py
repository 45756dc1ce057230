"""Steps captured as graphs (`specdec_fast.graphs`, issue 44 item 4): `StepGraphs`' warm-up,
capture, replay and binding, the drafters' `Resident` state, and `generate` with the target's
verify and every drafter's device steps replayed, on the CPU under the emulation of
`graph_emulation` (Python runs only at capture, as under a CUDA graph). Greedy runs must give
the same tokens and the same per-row steps and accepted counts as runs without graphs (a stale
graph drafts other trees: the tokens would stay lossless, the counts would not), sampled runs
the same tokens with the same seeds; the `gpu` test repeats it with real CUDA graphs."""

import re

import pytest
import torch
from built_in_drafters import DRAFTERS, write_untrained_blocks
from graph_emulation import emulated_graphs, traced_capture

from specdec_fast import bundled, generate, graphs
from specdec_fast.cache import SpecKVCache
from specdec_fast.compiled import COMPILE_LOG
from specdec_fast.drafters.registry import DrafterSpec
from specdec_fast.graphs import GRAPH_WARMUP_CALLS, StepGraphs
from specdec_fast.loading import load_model, load_tokenizer
from specdec_fast.prompts import load_code_prompts


class Counted:
    """A step over a state tensor that it updates in place, counting its Python runs."""

    def __init__(self):
        self.state = torch.zeros(3)
        self.python_runs = 0

    def step(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.python_runs += 1
        self.state.add_(x)
        return self.state * 2, x + 1


@pytest.fixture
def emulated(monkeypatch):
    monkeypatch.setattr(graphs, "capture", traced_capture)


def test_warm_up_then_one_capture_then_replays(emulated):
    counted, steps = Counted(), StepGraphs("test")
    outputs = []
    for call in range(GRAPH_WARMUP_CALLS + 3):
        x = torch.full((3,), float(call + 1))
        doubled, plus_one = steps.run("k", "step", counted.step, x)
        outputs.append(doubled)
        # Each call's own results, and the state updated once per call.
        expected = sum(range(1, call + 2))
        assert doubled.tolist() == [2.0 * expected] * 3
        assert plus_one.tolist() == [call + 2.0] * 3
        assert x.tolist() == [call + 1.0] * 3  # the caller's argument is not the graph's input
    # Python ran for the warm-up calls and the capture, never for a replay.
    assert counted.python_runs == GRAPH_WARMUP_CALLS + 1
    assert len(steps) == 1
    # A replay returns the captured outputs, rewritten.
    assert outputs[-1] is outputs[-2] is outputs[GRAPH_WARMUP_CALLS]


def test_each_key_and_shape_has_its_graph(emulated):
    counted, steps = Counted(), StepGraphs("test")
    for _ in range(GRAPH_WARMUP_CALLS + 1):
        steps.run("a", "step", counted.step, torch.ones(3))
        steps.run("b", "step", counted.step, torch.ones(3))
        steps.run("a", "step", counted.step, torch.ones(1))
    assert len(steps) == 3


def test_off_runs_every_call(emulated):
    counted, steps = Counted(), StepGraphs("test", on=False)
    for _ in range(GRAPH_WARMUP_CALLS + 3):
        steps.run("k", "step", counted.step, torch.ones(3))
    assert counted.python_runs == GRAPH_WARMUP_CALLS + 3 and len(steps) == 0


def test_another_state_drops_the_graphs(emulated):
    counted, steps = Counted(), StepGraphs("test")
    first, second = Counted(), Counted()
    for _ in range(GRAPH_WARMUP_CALLS + 1):
        steps.bind(first)
        steps.run("k", "step", counted.step, torch.ones(3))
    steps.bind(first)
    assert len(steps) == 1
    steps.bind(second)
    assert len(steps) == 0
    steps.run("k", "step", counted.step, torch.ones(3))
    assert counted.python_runs == GRAPH_WARMUP_CALLS + 2  # warming up anew


def test_captured_steps_return_tensors_only_and_warm_up(emulated):
    steps = StepGraphs("test", warmup=1)
    steps.run("k", "step", lambda x: (x, 3), torch.ones(2))
    with pytest.raises(TypeError, match="returns tensors"):
        steps.run("k", "step", lambda x: (x, 3), torch.ones(2))
    with pytest.raises(ValueError, match="warmup must be >= 1"):
        StepGraphs("test", warmup=0)


def test_captures_are_logged(emulated):
    logged = []
    steps = StepGraphs("test", on_capture=lambda label, seconds: logged.append(label))
    for _ in range(GRAPH_WARMUP_CALLS + 2):
        steps.run("k", "verify B=1", Counted().step, torch.ones(3))
    assert logged == ["graph verify B=1"]


def test_residents_are_kept_by_envelope_and_held_by_one_drafter():
    module = torch.nn.Linear(2, 2)
    first = graphs.resident(module, "envelope", "test", on=True)
    assert graphs.resident(module, "envelope", "test", on=True) is not first  # held: private
    first.release()
    assert graphs.resident(module, "envelope", "test", on=True) is first
    first.release()
    assert graphs.resident(module, "envelope", "test", on=False) is not first
    assert graphs.resident(module, "other", "test", on=True) is not first


def test_not_capturable_on_the_cpu():
    assert not graphs.capturable(torch.device("cpu")) and not graphs.chosen()
    with graphs.choice(True):
        assert graphs.chosen()
    with pytest.raises(ValueError, match="use_cuda_graphs needs a model on CUDA"):
        from specdec_fast.runner import ModelRunner

        ModelRunner(load_model("tiny-code", torch.device("cpu")), 64, use_cuda_graphs=True)


needs_bundled = pytest.mark.skipif(
    "tiny-code" not in bundled.available(), reason="the bundled checkpoints are not installed"
)

# Every drafter with device steps, greedy, and the chains sampled (their draws are the drafting
# code that sampling changes; the trees' drafting is the same, sampled or not). The
# target's verify graphs serve all of them; each drafter's own steps (draft loops, updates, tree
# steps, the draft model's forwards) replay as graphs of their own. EAGLE-1's head runs
# EAGLE-3's drafter class: the test of later drafters covers it. The lookups run on the host on
# the CPU (the n-gram lookup's device steps replay in tests/test_ngram_device.py).
SKIPPED = ("ngram", "suffix", "eagle:tiny-code-eagle:")
CASES = [
    *((spec, 0.0) for spec in DRAFTERS if not spec.startswith(SKIPPED)),
    ("draft:tiny-code-draft:4", 0.8),
    ("block-chain:{dflash}:4", 0.8),
]


@pytest.fixture(scope="module")
def target():
    return load_model("tiny-code", torch.device("cpu"))


@pytest.fixture(scope="module")
def prompts():
    tokenizer = load_tokenizer("tiny-code")
    return [
        [tokenizer.bos_token_id, *tokenizer.encode(r["prompt"], add_special_tokens=False)][:40]
        for r in load_code_prompts(4)
    ]


def _call(target, make, rows, temperature, **options):
    """One call with a new drafter from `make`: its tokens, and each row's steps and accepted
    counts (rows finish at their own steps)."""
    out = generate(
        target,
        rows,
        drafter=make(),
        max_new_tokens=14,
        temperature=temperature,
        seed=5,
        compile=False,
        **options,
    )
    return (
        [s.tolist() for s in out.sequences],
        [(row.steps, row.accepted) for row in out.stats.sequences],
    )


def _runs(target, make, prompts, temperature, **options):
    """Two calls (3 rows each, other prompts) through one drafter factory: the second meets the
    graphs the first captured."""
    return [
        _call(target, make, rows, temperature, **options) for rows in (prompts[:3], prompts[1:])
    ]


@pytest.fixture(scope="module")
def blocks(target, tmp_path_factory):
    return write_untrained_blocks(target, tmp_path_factory.mktemp("blocks"))


@needs_bundled
@pytest.mark.parametrize(("spec", "temperature"), CASES, ids=[f"{s}-{t}" for s, t in CASES])
def test_replayed_steps_give_the_same_outputs(
    target, prompts, blocks, spec, temperature, monkeypatch
):
    make = DrafterSpec.parse(spec.format(**blocks)).factory(target)
    monkeypatch.setenv("SPECDEC_BACKEND", "torch")  # as the emulated runs below
    want = _runs(target, make, prompts, temperature)
    logged = len(COMPILE_LOG)
    with emulated_graphs() as counts:
        got = _runs(target, make, prompts, temperature)
    assert got == want
    # Graphs were replayed, and the drafter captured steps of its own (not only the target's
    # and draft models' verify steps, "graph B=3 N=8"): the check above was not vacuous.
    assert counts()["replays"] >= 10, counts()
    captured = [label for label, _ in COMPILE_LOG[logged:] if " graph " in f" {label}"]
    own = [label for label in captured if not re.search(r"graph B=\d+ N=\d+$", label)]
    assert own or spec == "none", captured


@needs_bundled
def test_a_stale_graph_is_seen(target, prompts, monkeypatch):
    """The check has teeth: with the head's cache replaced at each call and the graphs kept
    (no `bind`), the second call replays draft loops over the first call's cache, and its
    greedy tokens stay the target's while its accepted counts change."""
    make = DrafterSpec.parse("eagle:tiny-code-eagle3:8").factory(target)
    monkeypatch.setenv("SPECDEC_BACKEND", "torch")
    want = _runs(target, make, prompts, 0.0)
    monkeypatch.setattr(SpecKVCache, "fits", lambda *args: False)
    monkeypatch.setattr(StepGraphs, "bind", lambda self, state: None)
    with emulated_graphs():
        got = _runs(target, make, prompts, 0.0)
    assert got[0] == want[0]
    assert got[1][0] == want[1][0] and got[1][1] != want[1][1]


@needs_bundled
def test_later_drafters_replay_the_graphs_of_earlier_ones(target, prompts, monkeypatch):
    """Each call makes a new drafter (as a registry spec's factory does); once the calls' step
    shapes have warmed up and been captured, a later call captures nothing and replays."""
    make = DrafterSpec.parse("eagle:tiny-code-eagle:8").factory(target)
    monkeypatch.setenv("SPECDEC_BACKEND", "torch")
    with emulated_graphs() as counts:
        for _ in range(GRAPH_WARMUP_CALLS + 1):
            _call(target, make, prompts[:3], 0.0)
        before = counts()
        _call(target, make, prompts[:3], 0.0)
        after = counts()
    assert before["captures"] >= 2
    assert after["captures"] == before["captures"] and after["replays"] > before["replays"]


@pytest.mark.gpu
@pytest.mark.parametrize(("spec", "temperature"), CASES, ids=[f"{s}-{t}" for s, t in CASES])
def test_cuda_graphs_give_the_same_outputs(prompts, spec, temperature, tmp_path):
    model = load_model("tiny-code", torch.device("cuda"))
    paths = write_untrained_blocks(model, tmp_path) if "{" in spec else {}
    make = DrafterSpec.parse(spec.format(**paths)).factory(model)
    runs = {
        on: [_runs(model, make, prompts, temperature, use_cuda_graphs=on) for _ in "ab"]
        for on in (False, True)
    }
    assert runs[True] == runs[False]
