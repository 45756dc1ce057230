"""The n-gram drafter's device lookup (`specdec_fast.drafters.ngram_device`,
`NGramDrafter(device_lookup=True)`): the same trees as the host lookup, its oracle, ties and
padding included, over random and looping histories; the device history appended from step
outcomes; and through `generate` and the server the same tokens and steps as the host lookup,
reading ahead (two steps unread at once), alone and grafted under EAGLE. Compiled, its steps
are counted in tests/test_step_budget.py; on CUDA (its default there when compiling) in the
`gpu` tests."""

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from graph_emulation import emulated_graphs
from test_read_ahead import code_case, code_prompts, count_unread, needs_bundled, run, serve
from test_step_budget import arm_after_read_backs
from tiny_models import tiny_llama

from specdec_fast import NGramDrafter, generate, graphs
from specdec_fast.compiled import COMPILE_LOG, compile_choice
from specdec_fast.drafters.base import PAD_PARENT, DraftState, reads_ahead, with_roots
from specdec_fast.drafters.graft import GraftedDrafter
from specdec_fast.drafters.ngram_device import append_step, lookup_trees
from specdec_fast.drafters.registry import DrafterSpec
from specdec_fast.loading import load_model


@pytest.fixture(scope="module")
def code():
    return code_case()


def host_trees(drafter: NGramDrafter, rows: list[list[int]]):
    """The host lookup's proposal for `rows`, widened with padding nodes to `max_nodes` (the
    device lookup's width)."""
    proposal = drafter.propose(DraftState(rows, None, None, None, None, torch.device("cpu")))
    assert proposal.num_nodes <= drafter.max_nodes
    widened = with_roots(proposal, proposal.tokens[:, 0], drafter.max_nodes)
    return widened.tokens, widened.parents


def device_trees(drafter: NGramDrafter, rows: list[list[int]], spare: int):
    history = torch.zeros((len(rows), max(map(len, rows)) + spare), dtype=torch.int64)
    for index, row in enumerate(rows):
        history[index, : len(row)] = torch.tensor(row)
    lengths = torch.tensor([len(row) for row in rows])
    return lookup_trees(drafter.lookup_shape, history, lengths)


def random_rows(rng: random.Random, batch: int) -> list[list[int]]:
    """Ragged rows of 1-70 tokens over 2-20 symbols, a third of them loops of period 1-5 (with
    a stray token or not), so that many suffixes recur, counts tie and continuations run into
    the present."""
    vocab = rng.choice([2, 3, 5, 20])
    rows = []
    for _ in range(batch):
        length = rng.randint(1, 70)
        if rng.random() < 0.35:
            motif = [rng.randrange(vocab) for _ in range(rng.randint(1, 5))]
            row = [motif[i % len(motif)] for i in range(length)]
            if rng.random() < 0.5:
                row[rng.randrange(length)] = rng.randrange(vocab)
        else:
            row = [rng.randrange(vocab) for _ in range(length)]
        rows.append(row)
    return rows


@pytest.mark.parametrize("seed", range(4))
def test_device_trees_equal_the_host_lookups(seed):
    """400 random cases per seed (budgets 2-40 nodes, depths 1-9, n in 1-5, 1-9 matches,
    batches of 1-5, `max_matches` + 0-3 spare columns past the longest row): the device
    lookup's tokens and parents equal the host lookup's widened to the same width, exactly.
    The cases reach the trees' difficult parts, counted: nodes with several children (whose
    order is the ranking's, count ties broken by first insertion over 2-20 symbols) and
    budgets filled (where the ranking decides what is cut)."""
    rng = random.Random(seed)
    branched = full = 0
    for _ in range(400):
        max_nodes = rng.choice([2, 3, 5, 8, 16, 33, 40])
        max_depth = rng.randint(1, min(max_nodes - 1, 9))
        min_n = rng.randint(1, 3)
        drafter = NGramDrafter(
            max_nodes, max_depth, min_n, rng.randint(min_n, 5), rng.randint(1, 9)
        )
        rows = random_rows(rng, rng.randint(1, 5))
        expected = host_trees(drafter, rows)
        got = device_trees(drafter, rows, spare=rng.randint(0, 3) + drafter.max_matches)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1]), (
            drafter.lookup_shape,
            rows,
        )
        parents = expected[1][:, 1:]
        real = parents >= 0
        siblings = (parents[:, :, None] == parents[:, None, :]) & real[:, None, :]
        branched += int(((siblings.sum(-1) > 1) & real).any())
        full += int((parents[:, -1] != PAD_PARENT).any())
    assert branched > 100 and full > 100, (branched, full)


def test_a_step_appends_its_accepted_path_and_next_token():
    """Rows of 3 and 9 tokens (width 12, the last column for writes past the end): the first
    row takes its two accepted drafts (nodes 2 and 4 of the tree) and the next token; the
    second, four accepted drafts and the next token, of which the two columns left take the
    first two, its length stopping at 11. The history passed in is left as it was (the
    results are new tensors: a captured step's outputs)."""
    history = torch.zeros((2, 12), dtype=torch.int64)
    history[0, :3] = torch.tensor([5, 6, 7])
    history[1, :9] = torch.arange(10, 19)
    before = history.clone()
    tokens = torch.tensor([[7, 20, 21, 22, 23], [18, 30, 31, 32, 33]])
    accepted = torch.tensor([[0, 2, 4, -1, -1], [0, 1, 2, 3, 4]], dtype=torch.int32)
    appended, lengths = append_step(
        history,
        torch.tensor([3, 9]),
        tokens,
        accepted,
        torch.tensor([2, 4], dtype=torch.int32),
        torch.tensor([40, 41]),
    )
    assert lengths.tolist() == [6, 11]
    assert appended[0, :6].tolist() == [5, 6, 7, 21, 23, 40]
    assert appended[1, :11].tolist() == [*range(10, 19), 30, 31]
    assert torch.equal(history, before)


def test_where_the_lookup_runs():
    """Asked for, on the device (reading ahead) or on the host; by default on the device only
    for a CUDA target whose call compiles (captured graphs or not), on the host for a CPU target
    whatever the call does. (An object that says it is on CUDA stands in for the CUDA target:
    attaching touches no device.)"""
    targets = {"cpu": tiny_llama(), "cuda": SimpleNamespace(device=torch.device("cuda"))}
    chosen, expected = {}, {}
    for where, target in targets.items():
        for compile, captures in ((False, False), (True, False), (False, True)):
            with compile_choice(compile), graphs.choice(captures):
                for device_lookup in (None, True, False):
                    drafter = NGramDrafter(8, device_lookup=device_lookup)
                    assert not reads_ahead(drafter)  # decided when attached
                    drafter.attach(target, 64)
                    key = (where, compile, captures, device_lookup)
                    chosen[key] = reads_ahead(drafter)
                    default = where == "cuda" and compile
                    expected[key] = default if device_lookup is None else device_lookup
    assert chosen == expected
    with pytest.raises(ValueError, match="device_lookup must be None or a bool"):
        NGramDrafter(8, device_lookup="cuda")


@needs_bundled
def test_generate_with_the_device_lookup_equals_the_host_lookup(code, monkeypatch):
    """Four bundled code prompts, greedy with an EOS stopping a row mid-answer and sampled:
    reading ahead with the device lookup (two steps unread at once), every row's tokens, steps
    (so the accepted lengths) and streamed tokens equal the host lookup's, read every step; the
    lookup's drafts are accepted (fewer steps than tokens)."""
    target, prompts, eos = code
    unread, most = count_unread(monkeypatch)
    for kwargs in ({"eos_token_id": eos}, {"temperature": 0.8, "seed": [1, 2, 3, 4]}):
        runs = {}
        for device_lookup in (True, False):
            unread[0] = most[0] = 0
            drafter = NGramDrafter(8, device_lookup=device_lookup)
            runs[device_lookup] = run(target, prompts, True, drafter=drafter, **kwargs)
            assert most[0] == (2 if device_lookup else 1), (device_lookup, kwargs)
        assert runs[True] == runs[False], kwargs
        stats = runs[True][1]
        assert sum(steps for _, steps, _ in stats) < sum(new for new, _, _ in stats), stats


@needs_bundled
def test_grafted_under_eagle_the_device_lookup_reads_ahead(code, monkeypatch):
    """`eagle:tiny-code-eagle:8+ngram:8` with the n-gram lookup on the device: two steps unread
    at once, and the tokens and steps of the registry's graft (its lookup on the host)."""
    target, prompts, eos = code
    spec = DrafterSpec.parse("eagle:tiny-code-eagle:8")
    unread, most = count_unread(monkeypatch)
    grafted = GraftedDrafter(spec.build(target), NGramDrafter(8, device_lookup=True))
    ahead = run(target, prompts, True, drafter=grafted, eos_token_id=eos)
    assert most[0] == 2
    unread[0] = most[0] = 0
    host = DrafterSpec.parse("eagle:tiny-code-eagle:8+ngram:8").build(target)
    assert ahead == run(target, prompts, True, drafter=host, eos_token_id=eos)
    assert most[0] == 1


def host_lookup_run(target, request: dict):
    """A request run alone by `generate()` with the host lookup: its tokens, and its steps with
    what they drafted and accepted, by depth."""
    out = generate(
        target,
        [request["prompt"]],
        drafter=NGramDrafter(8, device_lookup=False),
        max_new_tokens=request["max_new_tokens"],
        temperature=request["temperature"],
        seed=request["seed"],
        eos_token_id=[],
    )
    return out.sequences[0][len(request["prompt"]) :].tolist(), drafting(out.stats.sequences[0])


def drafting(stats) -> tuple:
    return stats.steps, stats.drafted, stats.position_offered, stats.position_accepted


@needs_bundled
def test_served_requests_with_the_device_lookup_equal_generate(code, monkeypatch):
    """Six requests into three slots at scripted steps, one cancelled mid-answer, greedy and
    sampled, on a device-lookup route: the scheduler queues steps behind unread ones, the
    drafter's rows leave and join on the device, and each request's tokens, steps and drafts
    accepted by depth equal those of `generate()` with the host lookup on that request alone
    (the trees of a row depend on its tokens only)."""
    target, prompts, _ = code
    routes = {"ngram": NGramDrafter(8, device_lookup=True)}
    script = [(0, 30, False), (0, 24, True), (2, 16, False), (4, 20, False), (9, 12, True)]
    script += [(14, 18, False)]
    arrivals = [
        (at, {"prompt": prompts[i % len(prompts)][: 12 + 5 * i], "max_new_tokens": new,
              "temperature": 0.8 if sampled else 0.0, "seed": i, "route": "ngram"})
        for i, (at, new, sampled) in enumerate(script)
    ]  # fmt: skip
    unread, most = count_unread(monkeypatch)
    completions, queued = serve(target, routes, arrivals, True, {0: 9})
    assert most[0] == 2 and queued > 10, (most[0], queued)
    assert completions[0].finish_reason == "cancelled"
    for index, (_, request) in enumerate(arrivals[1:], 1):
        served = completions[index]
        assert (served.tokens, drafting(served.stats)) == host_lookup_run(target, request), index
    assert any(c.stats.accepted for c in completions[1:])


@needs_bundled
def test_replayed_lookup_steps_draft_the_same_trees(code, monkeypatch):
    """Under the CPU emulation of CUDA graphs (tests/graph_emulation.py: Python runs only at
    capture, a replay rewrites the captured outputs) the lookup and the append replay: greedy
    and sampled calls through new drafters give every row's tokens, steps and accepted counts
    (so the trees) of the steps run as they are; the lookup's own graphs were captured."""
    target, prompts, eos = code
    monkeypatch.setenv("SPECDEC_BACKEND", "torch")  # as the emulated runs

    def calls():
        outputs = []
        # Greedy over four rows, then sampled over three (its graphs captured anew).
        sampled = {"temperature": 0.8, "seed": 7}
        for rows, kwargs in ((prompts, {"eos_token_id": eos}), (prompts[1:], sampled)):
            drafter = NGramDrafter(8, device_lookup=True)
            out = generate(target, rows, drafter=drafter, max_new_tokens=24, **kwargs)
            counts = [(row.steps, row.accepted) for row in out.stats.sequences]
            outputs.append(([s.tolist() for s in out.sequences], counts))
        return outputs

    want = calls()
    logged = len(COMPILE_LOG)
    with emulated_graphs() as counted:
        got = calls()
    assert got == want
    captured = {label.split(" B=")[0] for label, _ in COMPILE_LOG[logged:]}
    assert {"ngram graph lookup", "ngram graph append"} <= captured, captured
    assert counted()["replays"] > 20, counted()
    assert any(accepted for _, counts in want for _, accepted in counts)


def test_a_prompt_longer_than_the_attached_cache_is_refused():
    drafter = NGramDrafter(4, device_lookup=True)
    drafter.attach(tiny_llama(), 8)
    seeds = torch.zeros(1, dtype=torch.int64)
    state = DraftState([list(range(10))], seeds, seeds, seeds, seeds, torch.device("cpu"))
    with pytest.raises(ValueError, match="a row of 10 tokens is longer than the cache"):
        drafter.begin(state)
    fits = DraftState([list(range(9))], seeds, seeds, seeds, seeds, torch.device("cpu"))
    drafter.begin(fits)
    assert np.array_equal(drafter.propose(fits).tokens[0, :1].numpy(), [8])


@pytest.mark.gpu
def test_on_cuda_the_device_lookup_never_syncs_and_drafts_as_the_host():
    """On CUDA, once warm (its steps captured as graphs: these tests run uncompiled), the device
    lookup's steps never sync but for each step's read-back (`set_sync_debug_mode("error")`,
    `arm_after_read_backs`), alone and grafted under EAGLE, at batch 1 and 4; its tokens, steps
    and accepted counts are the host lookup's."""
    model = load_model("tiny-code", torch.device("cuda"))
    prompts = code_prompts()
    eagle = DrafterSpec.parse("eagle:tiny-code-eagle:8").factory(model)
    makers = {
        "ngram": lambda on: NGramDrafter(8, device_lookup=on),
        "graft": lambda on: GraftedDrafter(eagle(), NGramDrafter(8, device_lookup=on)),
    }
    with pytest.MonkeyPatch.context() as patch:
        armed = []
        arm_after_read_backs(patch, armed)
        for name, make in makers.items():
            for rows in (prompts[:1], prompts):
                host = drafted(model, rows, make(False))
                drafted(model, rows, make(True))  # warm-up: the lookup's graphs captured
                armed.append(True)
                try:
                    on_device = drafted(model, rows, make(True))
                finally:
                    armed.clear()
                    torch.cuda.set_sync_debug_mode(0)
                assert on_device == host, (name, len(rows))


def drafted(model, rows, drafter):
    """A greedy call's tokens, and each row's steps and accepted counts."""
    out = generate(model, rows, drafter=drafter, max_new_tokens=24, eos_token_id=[])
    counts = [(row.steps, row.accepted) for row in out.stats.sequences]
    return [s.tolist() for s in out.sequences], counts
