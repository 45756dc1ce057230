"""Continuous batching: rows join a running batch, and every request's output is `generate()`'s.

The layers, bottom up: a `SpecKVCache.rows` view writes only its rows and `admit` takes them
into the batch; the runner's chunked `extend_rows` gives the logits of a one-shot prefill while
the batch's rows keep their cache; every registered drafter takes joining rows (`Drafter.join`);
and the scheduler, with arrivals scripted at given steps (chunked prompts, a full batch,
cancellations, guardrails tripping), gives each request exactly `generate()`'s tokens for the
same prompt, greedy and sampled with a seed, whatever joined or left beside it. One decode step
reads the device once, as `generate`'s does.
"""

import random
import sys
import threading
import time

import pytest
import torch
from bench_smoke import BENCH_DIR
from test_block import MODELS as BLOCK_MODELS
from test_block import VOCAB as BLOCK_VOCAB
from tiny_models import repetitive_prompts, tiny_llama
from transformers import LlamaConfig

from specdec_fast import BlockDrafter, NGramDrafter, bundled, generate
from specdec_fast.cache import SpecKVCache
from specdec_fast.drafters.base import Drafter, Proposal, supports_join
from specdec_fast.drafters.registry import DrafterSpec
from specdec_fast.guardrails import GuardrailPolicy, Guardrails
from specdec_fast.loading import load_model, load_tokenizer
from specdec_fast.prompts import load_code_prompts
from specdec_fast.runner import ModelRunner
from specdec_fast.serving import QueueFull, Request, Scheduler
from specdec_fast.serving.scheduler import FAILED

sys.path.insert(0, str(BENCH_DIR))
from step_ops import counting  # noqa: E402

VOCAB = 96
CONFIG = LlamaConfig(
    hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8
)
needs_bundled = pytest.mark.skipif(
    "tiny-code" not in bundled.available(), reason="the bundled checkpoints are not installed"
)
SPECS = [
    "none",
    "ngram:8",
    "suffix:16",
    "draft:tiny-code-draft:3",
    "draft-tree:tiny-code-draft:8",
    "medusa:tiny-code-medusa:8",
    "eagle:tiny-code-eagle:8",
    "eagle:tiny-code-eagle3:8",
]


def random_cache(rows: int, lengths: list[int]) -> SpecKVCache:
    cache = SpecKVCache(CONFIG, rows, 16, dtype=torch.float32, device="cpu")
    cache.kv.copy_(torch.randn(cache.kv.shape))
    cache.select(list(range(len(lengths))))
    cache.commit_lengths(torch.tensor(lengths, dtype=torch.int32), max(lengths))
    return cache


def test_a_rows_view_writes_its_rows_only_and_admit_appends_them():
    cache = random_cache(6, [3, 5])
    storage = cache._kv_storage.clone()
    view = cache.rows(4, 2)
    view.commit_lengths(torch.tensor([2, 6], dtype=torch.int32), 6)
    view.prepare_write(3)
    keys, values = torch.randn(2, 2, 3, 8), torch.randn(2, 2, 3, 8)
    view.layers[1].update(keys, values)
    written = cache._kv_storage
    # Only rows 4 and 5 changed, at slots 2..4 and 6..8 of layer 1.
    assert torch.equal(written[:, :, :4], storage[:, :, :4])
    assert torch.equal(written[1, 0, 4, :, 2:5], keys[0]) and torch.equal(
        written[1, 1, 5, :, 6:9], values[1]
    )
    assert cache.cache_lens.tolist() == [3, 5]
    cache.admit(4, 2, 9)
    assert cache.kv.shape[2] == 4 and cache.cache_lens.tolist() == [3, 5, 2, 6]
    assert torch.equal(cache.kv[:, :, :2], storage[:, :, :2])
    assert torch.equal(cache.kv[:, :, 2:, :, :9], written[:, :, 4:6, :, :9])
    with pytest.raises(ValueError, match="rows past the batch"):
        cache.admit(1, 1, 3)
    with pytest.raises(ValueError, match="start \\+ count <= capacity"):
        cache.rows(5, 2)


def test_with_capacity_keeps_the_batch():
    cache = random_cache(2, [4, 1])
    grown = cache.with_capacity(5)
    assert grown.capacity == 5 and grown.kv.shape[2] == 2
    assert torch.equal(grown.kv, cache.kv) and grown.cache_lens.tolist() == [4, 1]
    with pytest.raises(ValueError, match="rows"):
        cache.with_capacity(1)


def step_logits(runner: ModelRunner, roots: list[int]) -> torch.Tensor:
    """Logits of one plain step of the batch (each row's root alone), committed."""
    tokens = torch.tensor(roots)[:, None]
    out = runner.verify(tokens, torch.full_like(tokens, -1))
    accepted = torch.zeros(len(roots), 1, dtype=torch.int32)
    runner.cache.compact(accepted, torch.zeros(len(roots), dtype=torch.int32))
    return out.logits[:, 0]


def test_rows_joining_a_running_batch_see_what_a_fresh_prefill_sees():
    """Row A decodes three steps; row B joins through chunked `extend_rows` (chunks of 3); the
    next step's logits of both equal those of a fresh batch prefilled with A's and B's tokens."""
    model = tiny_llama(VOCAB, seed=3)
    first, second = repetitive_prompts([9, 11], VOCAB, seed=4)
    with ModelRunner(model, 64) as runner:
        runner.reserve(4)
        runner.prefill_rows([first])
        tokens = list(first)
        for _ in range(3):
            tokens.append(int(step_logits(runner, [tokens[-1]]).argmax()))
        chunks = [second[:3], second[3:6], second[6:10]]
        fed = 0
        for chunk in chunks:
            runner.extend_rows(1, [chunk], [fed])
            fed += len(chunk)
        runner.admit_rows(1, 1, fed)
        joined = step_logits(runner, [tokens[-1], second[-1]])
    with ModelRunner(model, 64) as fresh:
        ids = torch.zeros(2, 12, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, prompt in enumerate((tokens, second)):
            ids[row, : len(prompt)] = torch.tensor(prompt)
            mask[row, : len(prompt)] = 1
        fresh.prefill(ids, mask)
        expected = step_logits(fresh, [tokens[-1], second[-1]])
    torch.testing.assert_close(joined, expected, rtol=1e-4, atol=1e-4)


def test_a_drafter_with_state_and_no_join_is_refused():
    class Stateful(Drafter):
        def begin(self, state):
            self.rows = state.batch_size

        def propose(self, state):
            raise AssertionError("never called")

    assert supports_join(NGramDrafter()) and not supports_join(Stateful(4))
    with pytest.raises(ValueError, match="does not implement Drafter.join"):
        Scheduler(tiny_llama(VOCAB), {"stateful": Stateful(4)})
    with pytest.raises(NotImplementedError, match="join"):
        Stateful(4).join(None)


@pytest.fixture(scope="module")
def code_model():
    return load_model("tiny-code", torch.device("cpu"))


@pytest.fixture(scope="module")
def code_prompts():
    tokenizer = load_tokenizer("tiny-code")
    return [
        [tokenizer.bos_token_id, *tokenizer.encode(r["prompt"], add_special_tokens=False)][:48]
        for r in load_code_prompts(10)
    ]


# Whose trees depend on the request alone: a sampled row then draws what `generate()` draws with
# the same drafter (the suffix drafter's trees also depend on its store of earlier outputs).
SAMPLED_EXACT = [spec for spec in SPECS if not spec.startswith("suffix")]


def expected_output(model, spec: str, request: dict) -> list[int]:
    """`generate()`'s tokens for one request: plain decoding when greedy, the same drafter kind
    when sampling (a sampled draw depends on the tree verified, never on the batch)."""
    drafter = None if request["temperature"] == 0 else DrafterSpec.parse(spec).build(model)
    out = generate(
        model,
        [request["prompt"]],
        drafter=drafter,
        max_new_tokens=request["max_new_tokens"],
        temperature=request["temperature"],
        seed=request["seed"],
        eos_token_id=[],
    )
    return out.sequences[0][len(request["prompt"]) :].tolist()


def run_scripted(scheduler: Scheduler, arrivals, cancel_after=None, max_steps: int = 2000):
    """Submit each request of `arrivals` ((step, request fields)) before that `step()` call,
    cancel request i once it has `cancel_after[i]` tokens, and step until idle; returns the
    handles in `arrivals` order."""
    cancel_after = cancel_after or {}
    handles: dict[int, object] = {}

    def canceller(index: int):
        seen = []

        def on_tokens(tokens):
            seen.extend(tokens)
            if len(seen) >= cancel_after[index]:
                handles[index].cancel()

        return on_tokens

    step, busy = 0, True
    while busy or len(handles) < len(arrivals):
        for index, (at, request) in enumerate(arrivals):
            if at == step:
                fields = dict(request)
                if index in cancel_after:
                    fields["on_tokens"] = canceller(index)
                handles[index] = scheduler.submit(Request(**fields))
        busy = scheduler.step()
        step += 1
        assert step < max_steps
    return [handles[index] for index in range(len(arrivals))]


@needs_bundled
@pytest.mark.parametrize("spec", SPECS)
def test_each_drafter_takes_rows_joining_and_leaving(code_model, code_prompts, spec):
    """Three slots, seven requests of one route arriving at scripted steps (one that may not
    speculate, one sampled, one cancelled while it decodes), prompts fed in chunks: every
    completed request equals `generate()`; the drafter took rows through `join` and dropped them
    through `keep`."""
    drafter = DrafterSpec.parse(spec).build(code_model)
    calls = {"join": 0, "keep": 0}
    if drafter is not None:
        for name in calls:
            method = getattr(drafter, name)

            def counted(*args, _name=name, _method=method):
                calls[_name] += 1
                return _method(*args)

            setattr(drafter, name, counted)
    scheduler = Scheduler(
        code_model, {"route": drafter}, max_batch=3, prefill_chunk=16, eos_token_id=[]
    )
    lengths = [24, 10, 18, 14, 9, 20, 12]
    requests = [
        {"prompt": code_prompts[i], "max_new_tokens": n, "seed": i, "route": "route"}
        for i, n in enumerate(lengths)
    ]
    requests[3]["temperature"] = 0.8
    requests[4]["speculate"] = False
    arrivals = list(zip([0, 1, 3, 4, 6, 7, 9], requests, strict=True))
    handles = run_scripted(scheduler, arrivals, cancel_after={5: 3})
    scheduler.close()
    for index, (request, handle) in enumerate(zip(requests, handles, strict=True)):
        completion = handle.completion
        if index == 5:
            assert completion.finish_reason == "cancelled"
            assert 0 < len(completion.tokens) < request["max_new_tokens"]
            continue
        assert completion.finish_reason == "length"
        request.setdefault("temperature", 0.0)
        if request["temperature"] > 0 and spec not in SAMPLED_EXACT:
            continue
        kind = "none" if request.get("speculate") is False else spec
        assert completion.tokens == expected_output(code_model, kind, request), index
    if drafter is not None:
        assert calls["join"] >= 1 and calls["keep"] >= 1, calls
        assert any(h.completion.speculated for h in handles)
        assert not handles[4].completion.speculated


def random_arrivals(rng, prompts, count: int, specs, limits: tuple[int, int, int]) -> list:
    """`count` (step, request) pairs: prompts cut to 2..limits[0] tokens, 1..limits[1] new
    tokens, every third request sampled (on a route of `specs` that samples exactly), arriving
    at steps 0..limits[2]."""
    longest, most_new, last_step = limits
    requests = [
        {
            "prompt": prompts[i % len(prompts)][: rng.randint(2, longest)],
            "max_new_tokens": rng.randint(1, most_new),
            "temperature": 0.0 if i % 3 else 0.7,
            "seed": i,
        }
        for i in range(count)
    ]
    for request in requests:
        sampled = request["temperature"] > 0
        request["route"] = rng.choice([s for s in specs if s in SAMPLED_EXACT or not sampled])
    return [(rng.randint(0, last_step), request) for request in requests]


@needs_bundled
def test_random_arrivals_on_every_route_equal_generate(code_model, code_prompts):
    """Sixteen requests on random routes, greedy or sampled, arriving at random steps into four
    slots: each request's tokens are `generate()`'s."""
    routes = {spec: DrafterSpec.parse(spec).build(code_model) for spec in SPECS}
    arrivals = random_arrivals(random.Random(7), code_prompts, 16, SPECS, (48, 24, 40))
    scheduler = Scheduler(code_model, routes, max_batch=4, prefill_chunk=8, eos_token_id=[])
    handles = run_scripted(scheduler, arrivals)
    scheduler.close()
    for (_, request), handle in zip(arrivals, handles, strict=True):
        assert handle.completion.tokens == expected_output(code_model, request["route"], request)


@pytest.mark.parametrize("flavour", [*BLOCK_MODELS, "dflash-bfloat16"])
def test_block_drafters_take_rows_joining_and_leaving(flavour):
    """Block drafters (random models, both flavours, and a bfloat16 DFlash head on the float32
    target; not bundled) in three slots, eight requests arriving every other step, one of them a
    one-token prompt, prompts fed in chunks: each request's tokens and accepted drafts are those
    of `generate()` with the drafter on that request alone, and rows joined through `join`."""
    target = tiny_llama(BLOCK_VOCAB, layers=4)
    name, _, dtype = flavour.partition("-")
    model = BLOCK_MODELS[name](target)
    if dtype:
        model = model.to(getattr(torch, dtype))
    drafter = BlockDrafter(model, max_nodes=10)
    joins = []
    join = drafter.join
    drafter.join = lambda state: (joins.append(state.batch_size), join(state))
    prompts = repetitive_prompts([13, 5, 1, 30, 9, 2, 17, 8], BLOCK_VOCAB)
    arrivals = [
        (2 * i, {"prompt": p, "max_new_tokens": 10 + i, "route": "block"})
        for i, p in enumerate(prompts)
    ]
    scheduler = Scheduler(target, {"block": drafter}, max_batch=3, prefill_chunk=8, eos_token_id=[])
    handles = run_scripted(scheduler, arrivals)
    scheduler.close()
    for (_, request), handle in zip(arrivals, handles, strict=True):
        alone = BlockDrafter(drafter.model, max_nodes=10)
        out = generate(
            target, [request["prompt"]], drafter=alone, max_new_tokens=request["max_new_tokens"]
        )
        assert handle.completion.tokens == out.sequences[0][len(request["prompt"]) :].tolist()
        # A joined row's drafts are those of the row alone: its context entries came along.
        assert handle.completion.stats.accepted == out.stats.sequences[0].accepted
    assert joins and scheduler.lanes["block"].counters.accepted_tokens > 0


def test_a_cancelled_request_frees_its_slot_for_the_next():
    model = tiny_llama(VOCAB, seed=5)
    first, second = repetitive_prompts([7, 12], VOCAB, seed=6)
    scheduler = Scheduler(model, max_batch=1, eos_token_id=[])
    running = scheduler.submit(Request(first, 200))
    for _ in range(3):
        scheduler.step()
    waiting = scheduler.submit(Request(second, 10))
    scheduler.step()
    assert scheduler.waiting == 1 and running.completion is None
    running.cancel()
    scheduler.step()
    assert running.completion.finish_reason == "cancelled"
    assert scheduler.waiting == 0 and scheduler.running == 1
    scheduler.run_until_idle()
    expected = generate(model, [second], drafter=None, max_new_tokens=10, eos_token_id=[])
    assert waiting.completion.tokens == expected.sequences[0][12:].tolist()
    queued = scheduler.submit(Request(first, 5))
    queued.cancel()
    scheduler.step()
    assert queued.completion.finish_reason == "cancelled" and queued.completion.admitted is None


def test_a_request_whose_logits_are_nan_ends_alone_with_the_error():
    model = tiny_llama(VOCAB, seed=5)
    clean, later = repetitive_prompts([7, 12], VOCAB, seed=6)
    expected = [
        generate(model, [p], drafter=None, max_new_tokens=10, eos_token_id=[]).sequences[0]
        for p in (clean, later)
    ]
    poison = next(t for t in range(VOCAB) if all(t not in e.tolist() for e in expected))
    with torch.no_grad():
        model.model.embed_tokens.weight[poison] = float("nan")
    scheduler = Scheduler(model, max_batch=2, eos_token_id=[])
    bad = scheduler.submit(Request([*clean[:3], poison, *clean[3:]], 10))
    good = scheduler.submit(Request(clean, 10))
    scheduler.run_until_idle()
    assert bad.completion.finish_reason == FAILED and bad.completion.tokens == []
    assert "logits were NaN or infinite after 0 generated tokens" in bad.completion.error
    assert good.completion.tokens == expected[0][7:].tolist()
    # The slot the failed request left (NaN in its cache rows) serves the next one cleanly.
    after = scheduler.submit(Request(later, 10))
    scheduler.run_until_idle()
    assert after.completion.tokens == expected[1][12:].tolist()


def test_after_step_follows_each_step_of_the_thread_with_its_deliveries_made():
    # The engine process sends a step's events from `after_step`: by then the step's callbacks
    # have run, and it runs after every step of the thread, a failed one included.
    model = tiny_llama(VOCAB, seed=5)
    prompt = repetitive_prompts([9], VOCAB, seed=7)[0]
    delivered: list[int] = []
    seen: list[tuple[int, int, str]] = []  # (steps, tokens delivered, thread) at each call

    def after_step() -> None:
        seen.append((scheduler.steps, len(delivered), threading.current_thread().name))

    scheduler = Scheduler(model, max_batch=2, eos_token_id=[], after_step=after_step)
    scheduler.start()
    try:
        handle = scheduler.submit(Request(prompt, 12, on_tokens=delivered.extend))
        assert handle.wait(60) is not None
        deadline = time.monotonic() + 10
        while seen[-1][0] < scheduler.steps and time.monotonic() < deadline:
            time.sleep(0.01)
        expected = generate(model, [prompt], drafter=None, max_new_tokens=12, eos_token_id=[])
        assert delivered == expected.sequences[0][9:].tolist()
        assert {thread for *_, thread in seen} == {"specdec-scheduler"}
        # One call per decode step at least, each seeing every token of the steps before it.
        assert len({steps for steps, *_ in seen}) >= scheduler.steps == 12
        assert all(tokens == steps for steps, tokens, _ in seen)

        def broken(*args, **kwargs):
            raise RuntimeError("injected")

        calls = len(seen)
        scheduler.runner.verify = broken
        failed = scheduler.submit(Request(prompt, 4))
        assert failed.wait(60).finish_reason == FAILED
        deadline = time.monotonic() + 10
        while len(seen) == calls and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(seen) > calls
    finally:
        scheduler.close()


def test_long_prompts_are_fed_in_chunks_between_decode_steps():
    """A 41-token prompt (40 cached) in chunks of 5 takes 8 steps to join, decoding at the
    last; the running row emits a token at each of them."""
    model = tiny_llama(VOCAB, seed=8)
    short, long = repetitive_prompts([6, 41], VOCAB, seed=9)
    scheduler = Scheduler(model, prefill_chunk=5, eos_token_id=[], overlap_prefill=False)
    decoding = scheduler.submit(Request(short, 40))
    scheduler.step()
    emitted = []
    joining = scheduler.submit(Request(long, 6, on_tokens=lambda t: emitted.append(t)))
    produced, joined = [], []
    for _ in range(8):
        before = len(scheduler.rows[0].generated)
        scheduler.step()
        produced.append(len(scheduler.rows[0].generated) - before)
        joined.append(len(emitted))
    assert produced == [1] * 8 and joined == [0] * 7 + [1]
    scheduler.run_until_idle()
    for handle, prompt, count in ((decoding, short, 40), (joining, long, 6)):
        out = generate(model, [prompt], drafter=None, max_new_tokens=count, eos_token_id=[])
        assert handle.completion.tokens == out.sequences[0][len(prompt) :].tolist()


def test_prompts_fed_beside_the_steps_never_stall_the_batch():
    """With `overlap_prefill`, the 41-token prompt's 8 chunks go to the prefill thread one at a
    time while the running row decodes: that row emits a token at every step, the newcomer
    joins after 8 steps or more (a chunk is taken in after the step that sees it done), all
    its prefill time is beside the steps, and both outputs are `generate()`'s."""
    model = tiny_llama(VOCAB, seed=8)
    short, long = repetitive_prompts([6, 41], VOCAB, seed=9)
    scheduler = Scheduler(model, prefill_chunk=5, eos_token_id=[], overlap_prefill=True)
    assert scheduler.overlap_prefill
    decoding = scheduler.submit(Request(short, 60))
    scheduler.step()
    joining = scheduler.submit(Request(long, 6))
    steps = 0
    while len(scheduler.rows) < 2:
        before = len(scheduler.rows[0].generated)
        scheduler.step()
        steps += 1
        assert len(scheduler.rows[0].generated) == before + 1
        assert steps < 200
    assert steps >= 8
    counters = scheduler.counters
    assert counters.prefill_chunks == 9 and counters.prefill_tokens == 5 + 40
    assert counters.prefill_beside_seconds > 0
    scheduler.run_until_idle()
    scheduler.close()
    for handle, prompt, count in ((decoding, short, 60), (joining, long, 6)):
        out = generate(model, [prompt], drafter=None, max_new_tokens=count, eos_token_id=[])
        assert handle.completion.tokens == out.sequences[0][len(prompt) :].tolist()


BESIDE_SPECS = ["none", "ngram:8", "suffix:16", "draft:tiny-code-draft:3"]


@needs_bundled
@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "beside"])
def test_random_arrivals_with_prompts_fed_beside_the_steps_equal_generate(
    code_model, code_prompts, overlap
):
    """Twelve requests on the routes that read no hidden states, greedy or sampled, arriving at
    random steps into three slots, with prompts fed on this thread or beside the steps: each
    request's tokens are `generate()`'s, however the joins fall."""
    routes = {spec: DrafterSpec.parse(spec).build(code_model) for spec in BESIDE_SPECS}
    arrivals = random_arrivals(random.Random(11), code_prompts, 12, BESIDE_SPECS, (60, 20, 30))
    scheduler = Scheduler(
        code_model, routes, max_batch=3, prefill_chunk=8, eos_token_id=[], overlap_prefill=overlap
    )
    handles = run_scripted(scheduler, arrivals)
    scheduler.close()
    assert (scheduler.counters.prefill_beside_seconds > 0) == overlap
    for (_, request), handle in zip(arrivals, handles, strict=True):
        assert handle.completion.tokens == expected_output(code_model, request["route"], request)


def test_closing_waits_for_a_chunk_fed_beside_the_steps():
    """`close()` while a chunk is on the prefill thread ends every request as cancelled, and
    only after the chunk is in (the storage is not reset under it)."""
    model = tiny_llama(VOCAB, seed=8)
    short, long = repetitive_prompts([6, 30], VOCAB, seed=9)
    scheduler = Scheduler(model, eos_token_id=[], overlap_prefill=True)
    feed, fed = scheduler.runner.extend_rows, []

    def slow_feed(*args, **kwargs):
        time.sleep(0.3)
        out = feed(*args, **kwargs)
        fed.append(kwargs.get("beside_step", False))
        return out

    scheduler.runner.extend_rows = slow_feed
    decoding = scheduler.submit(Request(short, 40))
    scheduler.step()
    joining = scheduler.submit(Request(long, 6))
    scheduler.step()
    assert scheduler._feeding is not None and fed == [False]
    scheduler.close()
    assert fed == [False, True] and scheduler._feeding is None
    for handle in (decoding, joining):
        assert handle.completion.finish_reason == "cancelled"


def test_overlap_prefill_is_refused_with_routes_that_read_hidden_states():
    """Hooks fill one dict per runner: with a route reading hidden states, prompts stay on the
    scheduler's thread (the default turns overlap off; asking for it is an error)."""
    model = tiny_llama(VOCAB, seed=8)

    class HiddenNGram(NGramDrafter):
        hidden_layers = (0,)

    assert not Scheduler(model, {"hidden": HiddenNGram()}).overlap_prefill
    with pytest.raises(ValueError, match="overlap_prefill"):
        Scheduler(model, {"hidden": HiddenNGram()}, overlap_prefill=True)
    with ModelRunner(model, 64) as runner:
        runner.reserve(2)
        assert runner.feeds_beside_steps
        runner.capture_hidden([0])
        assert not runner.feeds_beside_steps
        with pytest.raises(RuntimeError, match="feeds_beside_steps"):
            runner.extend_rows(0, [[1, 2]], [0], beside_step=True)


def test_requests_are_validated_and_the_queue_is_bounded():
    scheduler = Scheduler(tiny_llama(VOCAB), max_queue=1, max_cache_len=40, eos_token_id=[])
    for request, match in (
        (Request([], 4), "prompt: expected at least one token"),
        (Request([1, VOCAB], 4), "prompt: token ids outside"),
        (Request([1, 2], 0), "max_new_tokens"),
        (Request([1] * 30, 10), "exceed the context of 39 tokens"),
        (Request([1, 2], 4, route="elsewhere"), "route: unknown route"),
        (Request([1, 2], 4, temperature=-1.0), "temperature"),
        (Request([1, 2], 4, eos_token_id=VOCAB), "eos_token_id: token ids outside"),
        (Request([1, 2], 4, eos_token_id="\n"), "eos_token_id: expected None, an int"),
    ):
        with pytest.raises(ValueError, match=match):
            scheduler.submit(request)
    scheduler.submit(Request([1, 2], 4))
    with pytest.raises(QueueFull):
        scheduler.submit(Request([1, 2], 4))


def test_an_eos_id_may_be_one_int_on_the_request_and_in_the_models_config():
    """`Request.eos_token_id` and the model's `generation_config.eos_token_id` may each be one
    int, as `generate` takes them (an int used to fail inside the scheduler with a TypeError);
    the rows stop where `generate` stops them."""
    prompts = repetitive_prompts([6, 9], VOCAB, seed=4)
    free = generate(tiny_llama(VOCAB), prompts, drafter=None, max_new_tokens=12, eos_token_id=[])
    first, second = (s.tolist()[len(p) + 2] for s, p in zip(free.sequences, prompts, strict=True))
    model = tiny_llama(VOCAB, eos_token_id=first)  # the model's default: one int
    scheduler = Scheduler(model)
    handles = [
        scheduler.submit(Request(prompts[0], 12)),
        scheduler.submit(Request(prompts[1], 12, eos_token_id=second)),
    ]
    scheduler.run_until_idle()
    for handle, prompt, eos in zip(handles, prompts, (first, second), strict=True):
        want = generate(model, [prompt], drafter=None, max_new_tokens=12, eos_token_id=eos)
        assert handle.completion.tokens == want.sequences[0].tolist()[len(prompt) :]
        assert handle.completion.finish_reason == "eos" and handle.completion.tokens[-1] == eos


class WrongChain(Drafter):
    """Drafts a chain of tokens the target does not pick (a stateless drafter, whose proposals
    need only the roots: it reads ahead)."""

    reads_ahead = True

    def __init__(self):
        super().__init__(4)

    def propose(self, state):
        batch = state.batch_size
        tokens = (state.roots[:, None] + torch.arange(4)[None] * 7 + 1) % VOCAB
        parents = torch.arange(-1, 3).expand(batch, -1).contiguous()
        return Proposal(tokens, parents)


def small_window(**fields) -> Guardrails:
    return Guardrails(
        GuardrailPolicy(window_steps=4, min_window_steps=2, cooldown_steps=6, **fields)
    )


def test_a_failing_drafter_trips_its_route_to_plain_decoding_and_recovers():
    """The drafter raises in propose: the rows go plain (outputs unchanged), the guard falls back
    after its window, re-probes after the cool-down, and speculates again once fixed."""
    model = tiny_llama(VOCAB, seed=10)
    prompts = repetitive_prompts([8, 9, 10, 11, 12, 13], VOCAB, seed=11)
    drafter = NGramDrafter(max_nodes=6)

    def broken(state):
        raise RuntimeError("injected fault")

    drafter.propose = broken
    # Only errors are judged here (this random model's outputs repeat no n-gram).
    guardrails = small_window(min_acceptance_rate=0.0, max_tpot_p95_regression=100.0)
    scheduler = Scheduler(model, {"code": drafter}, guardrails=guardrails, eos_token_id=[])
    guard, lane = scheduler.lanes["code"].guard, scheduler.lanes["code"]
    handles = [scheduler.submit(Request(p, 12, route="code")) for p in prompts[:3]]
    scheduler.run_until_idle()
    handles += [scheduler.submit(Request(prompts[3], 12, route="code"))]
    scheduler.run_until_idle()
    assert lane.counters.drafter_errors >= 2 and guard.fallbacks == 1
    assert not any(h.completion.speculated for h in handles)
    assert "injected fault" in lane.last_error
    del drafter.propose  # fixed: the next probe speculates
    later = [scheduler.submit(Request(p, 12, route="code")) for p in prompts[4:]]
    scheduler.run_until_idle()
    assert guard.probes >= 1 and guard.speculating
    assert all(h.completion.speculated for h in later)
    for handle, prompt in zip(handles + later, prompts, strict=True):
        out = generate(model, [prompt], drafter=None, max_new_tokens=12, eos_token_id=[])
        assert handle.completion.tokens == out.sequences[0][len(prompt) :].tolist()


class OutOfVocabulary(WrongChain):
    """Its chains end in a token outside the vocabulary, and it does not declare its proposals
    valid: the step's checks replace its trees by the root alone."""

    def propose(self, state):
        proposal = super().propose(state)
        proposal.tokens[:, -1] = VOCAB + 1
        return proposal


@pytest.mark.parametrize("read_ahead", [False, True])
def test_a_malformed_proposal_trips_its_route_to_plain_decoding(read_ahead):
    """As `generate` raises `DrafterError` for it, the scheduler counts a drafter error naming
    the broken rule and moves the route's rows to plain decoding; outputs are plain ones. With
    read-ahead the step queued behind the first was drafted before the trip: its malformed
    trees count too."""
    model = tiny_llama(VOCAB, seed=16)
    prompts = repetitive_prompts([8, 11], VOCAB, seed=17)
    scheduler = Scheduler(model, {"bad": OutOfVocabulary()}, eos_token_id=[], read_ahead=read_ahead)
    handles = [scheduler.submit(Request(p, 10, route="bad")) for p in prompts]
    scheduler.run_until_idle()
    lane = scheduler.lanes["bad"]
    assert lane.counters.drafter_errors == 1 + read_ahead and lane.counters.trips == 1
    assert (scheduler.counters.queued > 0) == read_ahead
    assert "DrafterError" in lane.last_error and "vocabulary" in lane.last_error
    assert not lane.rows
    for handle, prompt in zip(handles, prompts, strict=True):
        out = generate(model, [prompt], drafter=None, max_new_tokens=10, eos_token_id=[])
        assert handle.completion.tokens == out.sequences[0][len(prompt) :].tolist()


@pytest.mark.parametrize("read_ahead", [False, True])
def test_a_breached_acceptance_bound_moves_running_rows_to_plain(read_ahead):
    model = tiny_llama(VOCAB, seed=12)
    prompts = repetitive_prompts([8, 15], VOCAB, seed=13)
    scheduler = Scheduler(
        model,
        {"wrong": WrongChain()},
        guardrails=small_window(min_acceptance_rate=0.5, max_tpot_p95_regression=100.0),
        eos_token_id=[],
        read_ahead=read_ahead,
    )
    handles = [scheduler.submit(Request(p, 30, route="wrong")) for p in prompts]
    scheduler.run_until_idle()
    lane = scheduler.lanes["wrong"]
    assert lane.guard.fallbacks == 1 and lane.counters.trips == 1
    # Two steps in the window (and, with read-ahead, the one queued behind the second), then
    # plain: far fewer drafts than steps.
    assert lane.counters.drafts == (2 + read_ahead) * len(prompts)
    assert (scheduler.counters.queued > 0) == read_ahead
    for handle, prompt in zip(handles, prompts, strict=True):
        out = generate(model, [prompt], drafter=None, max_new_tokens=30, eos_token_id=[])
        assert handle.completion.tokens == out.sequences[0][len(prompt) :].tolist()


# (spec, reads per decode step allowed beyond the read-back, read-ahead), counted as in
# test_step_budget.py
READS = [
    ("none", 0, False),
    ("ngram:8", 0, False),
    ("medusa:tiny-code-medusa:8", 0, False),
    ("draft:tiny-code-draft:4", 1, False),
    ("none", 0, True),
    ("medusa:tiny-code-medusa:8", 0, True),
]


@needs_bundled
@pytest.mark.parametrize(
    ("spec", "extra", "read_ahead"),
    READS,
    ids=[spec + " read ahead" * read_ahead for spec, _, read_ahead in READS],
)
def test_one_host_read_per_decode_step(code_model, code_prompts, spec, extra, read_ahead):
    """As `generate`: the step reads the device once, read ahead or not; joins and prefill
    chunks read nothing (a short and a long run with the same joins differ by their steps'
    reads only)."""
    counts = []
    for new_tokens in (6, 30):
        scheduler = Scheduler(
            code_model,
            {"route": DrafterSpec.parse(spec).build(code_model)},
            prefill_chunk=8,
            eos_token_id=[],
            read_ahead=read_ahead,
        )
        arrivals = [
            (step, {"prompt": code_prompts[i], "max_new_tokens": new_tokens, "route": "route"})
            for i, step in enumerate((0, 2, 3))
        ]
        with counting() as reads:
            run_scripted(scheduler, arrivals)
        steps = sum(count for count, _ in scheduler.counters.decode.values())
        assert (scheduler.counters.queued > 0) == read_ahead
        counts.append((len(reads), steps, reads))
        scheduler.close()
    (short_reads, short_steps, _), (long_reads, long_steps, records) = counts
    assert long_steps > short_steps
    per_step = (long_reads - short_reads) / (long_steps - short_steps)
    assert per_step <= 1 + extra, records[-20:]
    assert sum(1 for read in records if read.kind == "to_host") >= long_steps


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "beside"])
def test_compiled_steps_serve_joins_and_compile_once(overlap):
    """With compiled steps, rows joining through prefill chunks of every width and batches of
    every size reuse the graphs of the first wave: a second wave compiles nothing, and every
    output is `generate()`'s. With prompts fed beside the steps (eagerly, on the prefill
    thread), outputs are the same; which chunks wait for a free batch, and so run compiled on
    the scheduler's thread, depends on timing, so the second wave may meet a new shape."""
    from torch._dynamo.utils import counters

    model = tiny_llama(VOCAB, seed=14)
    prompts = repetitive_prompts([5, 17, 9, 12, 3, 22, 8, 14], VOCAB, seed=15)
    scheduler = Scheduler(
        model,
        {"ngram": NGramDrafter(max_nodes=6), "plain": None},
        max_batch=3,
        prefill_chunk=6,
        eos_token_id=[],
        compile=True,
        overlap_prefill=overlap,
    )
    waves = []
    for wave in range(2):
        before = counters["stats"]["unique_graphs"]
        arrivals = [
            (
                2 * i,
                {"prompt": p, "max_new_tokens": 8 + i + wave, "route": ("plain", "ngram")[i % 2]},
            )
            for i, p in enumerate(prompts)
        ]
        waves.append(
            (run_scripted(scheduler, arrivals), counters["stats"]["unique_graphs"] - before)
        )
    scheduler.close()
    assert waves[0][1] > 0 and (overlap or waves[1][1] == 0)
    for wave, (handles, _) in enumerate(waves):
        for i, (handle, prompt) in enumerate(zip(handles, prompts, strict=True)):
            out = generate(
                model, [prompt], drafter=None, max_new_tokens=8 + i + wave, eos_token_id=[]
            )
            assert handle.completion.tokens == out.sequences[0][len(prompt) :].tolist()
