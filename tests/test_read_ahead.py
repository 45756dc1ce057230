"""`generate`'s read-ahead: plain decoding, and drafters that read ahead (draft models, Medusa,
EAGLE, block drafters), queue each step before they read the step before (`step.launch` /
`step.finish`). Outputs, statistics and streamed tokens equal those of reading every step at
once, whatever stops the rows (EOS, stop sequences, length, a full cache, sampled or greedy;
unusable logits in tests/test_generate_edges.py); the queued step really is queued (two steps
unread at once); other drafters' steps are read at once. The server's scheduler reads ahead the
same way while its batch is settled, and reads the queued step before rows join or leave:
served requests arriving and cancelled at scripted steps equal `generate()` (guardrail trips
under read-ahead in tests/test_continuous_batching.py)."""

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from test_continuous_batching import expected_output, run_scripted
from test_generate import hf_greedy
from tiny_models import repetitive_prompts, tiny_llama

from specdec_fast import NGramDrafter, bundled, engine, generate, step
from specdec_fast.arguments import CACHE_BLOCK
from specdec_fast.cache import SpecKVCache
from specdec_fast.drafters.graft import GraftedDrafter
from specdec_fast.drafters.registry import DrafterSpec
from specdec_fast.guardrails import GuardedDrafter, GuardrailPolicy, RouteGuard
from specdec_fast.loading import load_model, load_tokenizer
from specdec_fast.prompts import load_code_prompts
from specdec_fast.serving import Request, Scheduler, scheduler
from specdec_fast.serving.metrics import ServingMetrics
from specdec_fast.transfer import HostCopy

VOCAB = 96
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab_size=VOCAB)


@pytest.fixture(scope="module")
def prompts():
    return repetitive_prompts([5, 9, 14, 3, 11, 7], VOCAB, seed=4)


def run(target, prompts, read_ahead, **kwargs):
    """(sequences, per-row (new tokens, steps, finish reason), streamed tokens per row)."""
    streamed = defaultdict(list)
    out = generate(
        target,
        prompts,
        drafter=kwargs.pop("drafter", None),
        max_new_tokens=kwargs.pop("max_new_tokens", NEW_TOKENS),
        read_ahead=read_ahead,
        on_tokens=lambda row, tokens: streamed[row].extend(tokens),
        **kwargs,
    )
    stats = [(s.new_tokens, s.steps, s.finish_reason) for s in out.stats.sequences]
    return [s.tolist() for s in out.sequences], stats, dict(streamed)


def rare_token(sequences, prompts, row):
    """A token of row `row`'s answer, from its fifth on, that some other row's never holds."""
    answers = [set(s[len(p) :]) for s, p in zip(sequences, prompts, strict=True)]
    return next(
        token
        for token in sequences[row][len(prompts[row]) + 4 :]
        if any(token not in answer for answer in answers)
    )


@pytest.fixture(scope="module")
def free(target, prompts):
    """Each row's greedy answer with no stop but the length."""
    return run(target, prompts, False, eos_token_id=[])[0]


def test_greedy_with_eos_equals_reading_every_step_and_hf(target, prompts, free):
    eos = [rare_token(free, prompts, 0)]
    ahead = run(target, prompts, True, eos_token_id=eos)
    assert ahead == run(target, prompts, False, eos_token_id=eos)
    reasons = [reason for _, _, reason in ahead[1]]
    assert "eos" in reasons and "length" in reasons, reasons
    # Cut HF's greedy answers at their first EOS: the same tokens.
    for row, sequence in enumerate(hf_greedy(target, prompts, NEW_TOKENS)):
        answer = sequence[len(prompts[row]) :]
        stop = next((i + 1 for i, t in enumerate(answer) if t in eos), len(answer))
        assert ahead[0][row] == prompts[row] + answer[:stop], row


def test_stop_sequences_and_sampling_equal_reading_every_step(target, prompts, free):
    made = free[1][len(prompts[1]) :]
    stop = [made[9:11]]
    kwargs = {"eos_token_id": [], "stop": stop}
    ahead = run(target, prompts, True, **kwargs)
    assert ahead == run(target, prompts, False, **kwargs)
    assert "stop" in [reason for _, _, reason in ahead[1]]
    sampled = {"eos_token_id": [7, 11], "temperature": 0.9, "seed": list(range(len(prompts)))}
    ahead = run(target, prompts, True, **sampled)
    assert ahead == run(target, prompts, False, **sampled)
    assert len({reason for _, _, reason in ahead[1]}) == 2, ahead[1]


def test_a_full_cache_stops_rows_as_reading_every_step_does(prompts, monkeypatch):
    """Rows stop for their cache at different steps, and no queued step writes beyond it: on
    a fresh model the cache holds exactly `max_cache_len` (a multiple of its block) slots.
    The host's bound of the lengths always shows the room (no device read): a row that left
    with its cache full no longer counts."""
    reads = []
    ensure_room = SpecKVCache.ensure_room

    def checked(cache, num_new):
        reads.extend([num_new] * (not cache.has_room(num_new)))
        return ensure_room(cache, num_new)

    monkeypatch.setattr(SpecKVCache, "ensure_room", checked)
    kwargs = {"eos_token_id": [], "max_cache_len": CACHE_BLOCK, "max_new_tokens": CACHE_BLOCK}
    ahead = run(tiny_llama(vocab_size=VOCAB), prompts, True, **kwargs)
    assert ahead == run(tiny_llama(vocab_size=VOCAB), prompts, False, **kwargs)
    assert reads == []
    assert {reason for _, _, reason in ahead[1]} == {"cache"}
    assert len({new for new, _, _ in ahead[1]}) > 1, ahead[1]


def count_unread(monkeypatch) -> tuple[list[int], list[int]]:
    """`[unread]`, `[most]`: the launched steps not finished yet, now and at most (reset them
    between runs), in `generate` and in the scheduler (a queued step is launched in `step`)."""
    unread, most = [0], [0]
    launch, finish = step.launch, step.finish

    def counted_launch(*args, **kwargs):
        unread[0] += 1
        most[0] = max(most[0], unread[0])
        return launch(*args, **kwargs)

    def counted_finish(*args, **kwargs):
        unread[0] -= 1
        return finish(*args, **kwargs)

    for module in (engine, step, scheduler):
        monkeypatch.setattr(module, "launch", counted_launch)
        monkeypatch.setattr(module, "finish", counted_finish)
    return unread, most


def test_the_next_step_is_queued_before_the_read(target, prompts, monkeypatch):
    """With read-ahead two launched steps are unread at once; without, never; with a drafter
    that does not read ahead (read-ahead asked for) never, and the output is the same."""
    unread, most = count_unread(monkeypatch)
    for read_ahead, drafter, expected in ((True, None, 2), (False, None, 1), (True, "ngram", 1)):
        unread[0] = most[0] = 0
        make = (lambda: NGramDrafter(max_nodes=8)) if drafter else (lambda: None)
        sequences = run(target, prompts, read_ahead, drafter=make(), eos_token_id=[])[0]
        assert (most[0], unread[0]) == (expected, 0), (read_ahead, drafter)
        assert sequences == hf_greedy(target, prompts, NEW_TOKENS)


def code_prompts() -> list[list[int]]:
    """Four of the bundled code prompts for the tiny-code family, cut at 40 tokens."""
    tokenizer = load_tokenizer("tiny-code")
    return [
        [tokenizer.bos_token_id, *tokenizer.encode(r["prompt"], add_special_tokens=False)][:40]
        for r in load_code_prompts(4)
    ]


needs_bundled = pytest.mark.skipif(
    "tiny-code" not in bundled.available(), reason="the bundled checkpoints are not installed"
)


def code_case():
    """The bundled target, four code prompts and an EOS that stops the first row mid-answer
    (from plain greedy output, which every drafter's greedy output equals)."""
    target, prompts = load_model("tiny-code", torch.device("cpu")), code_prompts()
    free = run(target, prompts, False, eos_token_id=[])[0]
    return target, prompts, [rare_token(free, prompts, 0)]


@pytest.fixture(scope="module")
def code():
    return code_case()


@needs_bundled
@pytest.mark.parametrize(
    "spec, sampled",
    [
        ("draft:tiny-code-draft:4", True),
        ("draft-tree:tiny-code-draft:8", False),
        ("medusa:tiny-code-medusa:8", False),
        ("eagle:tiny-code-eagle:8", False),
        ("eagle:tiny-code-eagle3:8", True),
        ("block:tiny-code-dflash:8", False),
        ("block:tiny-code-pard:8", True),
        ("block-chain:tiny-code-dflash:4", True),
        ("block-chain:tiny-code-pard:4", True),
    ],
)
def test_drafters_that_read_ahead_equal_reading_every_step(code, spec, sampled, monkeypatch):
    """The drafter follows each step from its device outcome before the step is read, and the
    next step is queued behind it: the same tokens, per-row steps (so the same trees), finish
    reasons and streamed tokens as reading every step, with rows stopping for EOS and for
    length at different steps; sampled too for a draft chain, one head, one block tree (trees
    are drafted alike either way, the verify draws by position) and the block chains, whose
    draws take the roots' positions from their flavour's cache on the device."""
    target, prompts, eos = code
    make = DrafterSpec.parse(spec).factory(target)
    unread, most = count_unread(monkeypatch)
    options = [{}, {"temperature": 0.8, "seed": list(range(len(prompts)))}][: 1 + sampled]
    for kwargs in options:
        runs = {}
        for read_ahead in (True, False):
            unread[0] = most[0] = 0
            runs[read_ahead] = run(
                target, prompts, read_ahead, drafter=make(), eos_token_id=eos, **kwargs
            )
            assert (most[0], unread[0]) == (2 if read_ahead else 1, 0), (read_ahead, kwargs)
        assert runs[True] == runs[False], kwargs
        stats = runs[True][1]
        assert sum(steps for _, steps, _ in stats) < NEW_TOKENS * len(prompts), stats  # drafted
        if not kwargs:
            assert {reason for _, _, reason in stats} == {"eos", "length"}, stats


# Routes whose drafters read ahead, plain decoding among them.
SERVED = [
    "none",
    "medusa:tiny-code-medusa:8",
    "eagle:tiny-code-eagle3:8",
    "block:tiny-code-dflash:8",
]


def serve(target, routes, arrivals, read_ahead, cancel_after=None):
    """The completions of `arrivals` (`run_scripted`) and the steps queued, as /metrics has it.
    Each route's counters hold what its requests' statistics hold: nothing of a step queued
    past a row's end."""
    scheduler = Scheduler(
        target, routes, max_batch=3, prefill_chunk=16, eos_token_id=[], read_ahead=read_ahead
    )
    try:
        handles = run_scripted(scheduler, arrivals, cancel_after)
    finally:
        scheduler.close()
    router = SimpleNamespace(canary_speculating={}, shadow={}, routes={})
    text = ServingMetrics(scheduler, router, "m").render().decode()
    queued = [
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "specdec_decode_steps_queued_total"
    ]
    assert queued == [scheduler.counters.queued]
    completions = [handle.completion for handle in handles]
    for name, lane in scheduler.lanes.items():
        stats = [c.stats for c in completions if c.route == name and c.speculated]
        counted = (lane.counters.draft_tokens, lane.counters.accepted_tokens)
        assert counted == (sum(s.drafted for s in stats), sum(s.accepted for s in stats)), name
    return completions, scheduler.counters.queued


@needs_bundled
def test_served_requests_with_read_ahead_equal_generate(code, monkeypatch):
    """Nine requests on routes that read ahead, greedy or sampled, arriving at scripted steps
    into three slots, one cancelled while it decodes: with read-ahead the scheduler queues steps
    while its batch is settled (two unread at once) and reads them before rows join or leave;
    each request's tokens are `generate()`'s (greedy: plain decoding's; sampled: the same
    drafter's), as without read-ahead. A route whose drafter does not read ahead (n-gram) is
    read every step."""
    target, prompts, _ = code
    routes = {spec: DrafterSpec.parse(spec).build(target) for spec in SERVED}
    # (arrival step, new tokens, route, sampled): the first request is cancelled at its eighth
    # token, from the first batch position, in a settled batch (the fourth waits for a slot);
    # the third arrives with a slot free while two rows decode, its prompt fed in one chunk.
    script = [
        (0, 30, 0, False), (0, 24, 1, False), (5, 16, 2, True), (6, 12, 3, False),
        (7, 10, 0, False), (12, 14, 1, True), (15, 8, 2, False), (20, 18, 3, False),
        (30, 9, 0, True),
    ]  # fmt: skip
    requests = [
        {
            "prompt": prompts[i % len(prompts)][: 10 + 3 * i],
            "max_new_tokens": new,
            "temperature": 0.8 if sampled else 0.0,
            "seed": i,
            "route": SERVED[route],
        }
        for i, (_, new, route, sampled) in enumerate(script)
    ]
    arrivals = [(at, request) for (at, *_), request in zip(script, requests, strict=True)]
    unread, most = count_unread(monkeypatch)
    served = {}
    for read_ahead in (True, False):
        unread[0] = most[0] = 0
        served[read_ahead] = serve(target, routes, arrivals, read_ahead, {0: 8})
        assert (most[0], unread[0]) == (2 if read_ahead else 1, 0), read_ahead
    (completions, queued), (each_step, none_queued) = served[True], served[False]
    assert queued > 10 and none_queued == 0, (queued, none_queued)
    assert completions[0].finish_reason == "cancelled"
    assert 8 <= len(completions[0].tokens) < requests[0]["max_new_tokens"]
    for index, request in enumerate(requests[1:], 1):
        assert completions[index].finish_reason == "length", index
        assert completions[index].tokens == each_step[index].tokens, index
        assert completions[index].tokens == expected_output(target, request["route"], request)
    assert any(c.speculated for c in completions if c.route != "none")
    ngram = {"route": NGramDrafter(max_nodes=8)}
    arrivals = [
        (0, {"prompt": p, "max_new_tokens": 12, "temperature": 0.0, "seed": 0, "route": "route"})
        for p in prompts[:3]
    ]
    unread[0] = most[0] = 0
    completions, queued = serve(target, ngram, arrivals, True)
    assert (most[0], queued) == (1, 0)
    for (_, request), completion in zip(arrivals, completions, strict=True):
        assert completion.tokens == expected_output(target, "none", request)


@needs_bundled
@pytest.mark.parametrize("case", ["good", "trip", "update"])
def test_a_guarded_drafter_reads_ahead_when_its_inner_drafter_does(code, monkeypatch, case):
    """`GuardedDrafter` over Medusa reads ahead (two steps unread at once) and records each step
    on its route at the step's read (`Drafter.read`), with the output of reading every step.
    Its guard ends in the same state, with the same steps in its window (an error in the inner
    `update` included; not the queued step's part for the row that the EOS stopped at the step
    before, which emitted nothing), but for a trip:
    the step queued behind the one that trips it was proposed before, so it speculates one
    step more (seven drafted nodes a row) and counts down one plain step less."""
    target, prompts, eos = code
    make = DrafterSpec.parse("medusa:tiny-code-medusa:8").factory(target)
    policy = GuardrailPolicy(
        min_acceptance_rate=0.99 if case == "trip" else 0.0,
        max_tpot_p95_regression=math.inf,  # wall-clock latencies differ between the runs
        max_error_rate=1.0,
        window_steps=64,  # every step of the run: the windows are compared
        min_window_steps=2,
        cooldown_steps=1000,
    )
    unread, most = count_unread(monkeypatch)
    runs = {}
    for read_ahead in (True, False):
        inner = make()
        if case == "update":
            update, calls = inner.update, []

            def failing(state, outcome, update=update, calls=calls):
                calls.append(outcome.emitted is None)
                if len(calls) == 3:
                    raise RuntimeError("injected failure in update")
                update(state, outcome)

            inner.update = failing
        route = RouteGuard("r", policy)
        drafter = GuardedDrafter(inner, route)
        unread[0] = most[0] = 0
        out = generate(
            target, prompts, drafter=drafter, max_new_tokens=40, eos_token_id=eos,
            read_ahead=read_ahead,
        )  # fmt: skip
        assert (most[0], unread[0]) == (2 if read_ahead else 1, 0), read_ahead
        if case == "update":
            assert calls == [read_ahead] * 3, calls
        snapshot = route.snapshot() | {
            "steps": [(step.drafted, step.accepted, step.error) for step in route.window]
        }
        runs[read_ahead] = ([s.tolist() for s in out.sequences], snapshot, out.stats, drafter)
    (ahead, guard, stats, drafter), (each, want, each_stats, each_drafter) = runs[True], runs[False]
    assert ahead == each
    assert drafter.events == each_drafter.events
    if case == "trip":
        assert (guard["fallbacks"], want["fallbacks"]) == (1, 1)
        assert "tripped" in drafter.events[0]
        extra = stats.drafted_tokens - each_stats.drafted_tokens
        assert extra == 7 * len(prompts), (stats.drafted_tokens, each_stats.drafted_tokens)
        assert guard["cooldown_left"] == want["cooldown_left"] + 1
    else:
        assert guard == want
        assert stats.drafted_tokens == each_stats.drafted_tokens
        assert (want["errors"], len(drafter.events)) == ((1, 1) if case == "update" else (0, 0))


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "beside"])
def test_steps_stay_queued_while_a_newcomers_prompt_is_fed(target, prompts, overlap):
    """A long prompt fed in chunks beside two decoding rows (on this thread, or the prefill
    thread's) leaves the batch settled: every decode step while the chunks go in is queued
    behind the one before; the queued step is read before the newcomer joins. Every request's
    tokens are `generate()`'s, greedy and sampled."""
    scheduler = Scheduler(
        target, prefill_chunk=4, eos_token_id=[], read_ahead=True, overlap_prefill=overlap
    )
    long_prompt = [token for prompt in prompts for token in prompt][:37]
    requests = [
        {"prompt": prompts[1], "max_new_tokens": 40, "temperature": 0.0, "seed": 0},
        {"prompt": prompts[2], "max_new_tokens": 40, "temperature": 0.8, "seed": 5},
        {"prompt": long_prompt, "max_new_tokens": 12, "temperature": 0.8, "seed": 6},
    ]
    handles = [scheduler.submit(Request(**request)) for request in requests[:2]]
    while len(scheduler.rows) < 2 or scheduler.counters.queued < 2:
        scheduler.step()
    handles.append(scheduler.submit(Request(**requests[2])))
    beside = []  # per step while the newcomer's chunks go in: (chunks fed, steps queued)
    while len(scheduler.rows) < 3:
        before = (scheduler.counters.prefill_chunks, scheduler.counters.queued)
        scheduler.step()
        after = (scheduler.counters.prefill_chunks, scheduler.counters.queued)
        beside.append((after[0] - before[0], after[1] - before[1]))
    scheduler.run_until_idle()
    scheduler.close()
    # 36 prompt tokens before the root, 4 a chunk: the last chunk joins the newcomer.
    assert sum(chunks for chunks, _ in beside) == 9, beside
    assert all(queued == 1 for _, queued in beside[:-1]), beside
    for handle, request in zip(handles, requests, strict=True):
        assert handle.completion.tokens == expected_output(target, "none", request)


def test_rows_finishing_at_the_queued_step_leave_before_newcomers_join(target, prompts):
    """A group of newcomers joins right after the queued step's read, which a row finishes at:
    the row leaves first, the newcomers take the batch positions after the rows left, and
    every request's tokens are `generate()`'s. Swept over the finishing row's length, so that
    some length meets the join (counted)."""
    met = 0
    for new_tokens in range(2, 14):
        scheduler = Scheduler(target, prefill_chunk=4, eos_token_id=[], read_ahead=True)
        read_queued = scheduler._read_queued

        def spy(scheduler=scheduler, read_queued=read_queued):
            nonlocal met
            before = len(scheduler.rows)
            read_queued()
            met += len(scheduler.rows) < before

        scheduler._read_queued = spy
        requests = [
            {"prompt": prompts[0], "max_new_tokens": new_tokens, "temperature": 0.0, "seed": 0},
            {"prompt": prompts[1], "max_new_tokens": 30, "temperature": 0.8, "seed": 1},
            {"prompt": prompts[2] + prompts[4], "max_new_tokens": 8, "temperature": 0.0, "seed": 2},
        ]
        handles = [scheduler.submit(Request(**request)) for request in requests[:2]]
        while len(scheduler.rows) < 2:
            scheduler.step()
        handles.append(scheduler.submit(Request(**requests[2])))
        scheduler.run_until_idle()
        scheduler.close()
        for handle, request in zip(handles, requests, strict=True):
            assert handle.completion.tokens == expected_output(target, "none", request)
    assert met >= 1


def test_read_ahead_must_be_a_bool(target, prompts):
    with pytest.raises(TypeError, match="read_ahead: expected None or a bool"):
        generate(target, prompts, drafter=None, max_new_tokens=2, read_ahead="yes")
    with pytest.raises(TypeError, match="read_ahead: expected None or a bool"):
        Scheduler(target, read_ahead=1)


def test_a_host_copy_on_the_cpu_is_the_tensor_read():
    values = torch.arange(12).reshape(3, 4)
    assert HostCopy(values).wait() == values.tolist()


@pytest.mark.gpu
def test_read_ahead_on_cuda_equals_reading_every_step(monkeypatch):
    """The CUDA path (a pinned buffer, an event; CUDA graphs for the drafters' steps): the same
    greedy and sampled output, plain and with drafters that read ahead, the n-gram lookup and
    a block chain among them."""
    target = tiny_llama(vocab_size=VOCAB).cuda()
    values = torch.arange(12, device="cuda").reshape(3, 4)
    assert HostCopy(values * 2).wait() == (values * 2).tolist()
    rows = repetitive_prompts([5, 9, 14, 3], VOCAB, seed=4)
    for kwargs in ({"eos_token_id": [7, 11]}, {"temperature": 0.9, "seed": [1, 2, 3, 4]}):
        assert run(target, rows, True, **kwargs) == run(target, rows, False, **kwargs)
    code, prompts = load_model("tiny-code", torch.device("cuda")), code_prompts()
    # The n-gram lookup on the device (its default on CUDA when compiling; these tests run
    # uncompiled) reads ahead, alone and grafted.
    specs = [
        "draft:tiny-code-draft:4",
        "eagle:tiny-code-eagle3:8",
        "block:tiny-code-dflash:8",
        "block-chain:tiny-code-pard:4",
    ]
    makers = {spec: DrafterSpec.parse(spec).factory(code) for spec in specs}
    eagle = DrafterSpec.parse("eagle:tiny-code-eagle:8").factory(code)
    makers["ngram:8 on the device"] = lambda: NGramDrafter(8, device_lookup=True)
    makers["eagle+ngram on the device"] = lambda: GraftedDrafter(
        eagle(), NGramDrafter(8, device_lookup=True)
    )
    unread, most = count_unread(monkeypatch)
    for spec, make in makers.items():
        for kwargs in ({}, {"temperature": 0.8, "seed": [1, 2, 3, 4]}):
            unread[0] = most[0] = 0
            ahead = run(code, prompts, True, drafter=make(), **kwargs)
            assert most[0] == 2, (spec, kwargs)
            assert ahead == run(code, prompts, False, drafter=make(), **kwargs), (spec, kwargs)
    # The scheduler reads ahead by default on CUDA: requests joining at steps 0, 0, 3 and 6.
    routes = {spec: DrafterSpec.parse(spec).build(code) for spec in SERVED}
    arrivals = [
        (3 * (i // 2) + 3 * (i == 3), {"prompt": prompt, "max_new_tokens": 12 + 4 * i,
         "temperature": 0.8 * (i == 2), "seed": i, "route": SERVED[i]})
        for i, prompt in enumerate(prompts)
    ]  # fmt: skip
    served = {read_ahead: serve(code, routes, arrivals, read_ahead) for read_ahead in (None, False)}
    assert served[None][1] > 0 and served[False][1] == 0
    tokens = {key: [c.tokens for c in completions] for key, (completions, _) in served.items()}
    assert tokens[None] == tokens[False]
