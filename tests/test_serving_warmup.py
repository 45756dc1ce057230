"""The server's warm-up (`specdec_fast.serving.warmup`): after it, serving compiles nothing.

Dynamo's capture only (its `eager` backend, as in test_compiled_step.py): which step shapes
compile, and when, is the capture's, whatever backend turns the graphs into code."""

import pytest
import torch
from tiny_models import repetitive_prompts, tiny_llama

from specdec_fast import DraftModelDrafter, NGramDrafter, bundled, generate
from specdec_fast.cli import build_parser
from specdec_fast.compiled import COMPILE_ENV, graphs_compiled
from specdec_fast.loading import load_model, load_tokenizer
from specdec_fast.serving import Request, Scheduler
from specdec_fast.serving.routes import server_routes
from specdec_fast.serving.service import Service
from specdec_fast.serving.warmup import JOIN_AFTER, fit, groups, warm_up, warm_up_prompts

VOCAB = 96

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("capture_only")]


def routes(draft) -> dict:
    return {
        "plain": None,
        "ngram": NGramDrafter(max_nodes=6),
        "draft": DraftModelDrafter(draft, num_tokens=3),
    }


def traffic(scheduler: Scheduler) -> list:
    """Requests unlike the warm-up's on every route: other prompts and lengths, a lone request,
    three at once with unequal lengths, sampled ones, and newcomers joining a running batch."""
    handles = []
    prompts = repetitive_prompts([11, 27, 19, 40, 8], VOCAB, seed=3)

    def submit(route, prompt, tokens, **sampling):
        request = Request(prompt, tokens, route=route, eos_token_id=[], **sampling)
        handles.append(scheduler.submit(request))

    for route in scheduler.lanes:
        submit(route, prompts[0], 9)
        scheduler.run_until_idle()
        for prompt, tokens in zip(prompts[1:4], (3, 12, 7), strict=True):
            submit(route, prompt, tokens, temperature=0.7, seed=tokens)
        scheduler.run_until_idle()
        submit(route, prompts[4], 10, temperature=1.1, top_k=30, top_p=0.8, seed=5)
        scheduler.run_until_idle(max_steps=2)
        submit(route, prompts[1], 6)  # joins the running row
        scheduler.run_until_idle()
    assert all(h.completion.finish_reason == "length" for h in handles)
    return handles


def test_after_a_warm_up_serving_compiles_nothing():
    """Every route compiles in the warm-up (so the steps do compile here), and the traffic after
    it compiles nothing. Without the warm-up's joining waves the draft model's prefill of a
    newcomer compiled in the traffic (a storage view of fewer rows than its storage: checked)."""
    options = {"max_batch": 4, "max_cache_len": 96, "compile": True}
    target, draft = tiny_llama(VOCAB, seed=8), tiny_llama(VOCAB, hidden_size=24, layers=1)
    before = graphs_compiled()
    warmed = warm_up(target, routes(draft), **options)
    assert [w.route for w in warmed] == ["plain", "ngram", "draft"]
    assert all(w.graphs > 0 and w.drafter_errors == 0 for w in warmed)
    assert sum(w.graphs for w in warmed) == graphs_compiled() - before
    assert all(w.requests == 3 * 14 for w in warmed)  # every sampling, every group's requests
    scheduler = Scheduler(target, routes(draft), **options)
    before = graphs_compiled()
    handles = traffic(scheduler)
    scheduler.close()
    assert graphs_compiled() == before
    assert sum(h.completion.speculated for h in handles) > 0
    # The greedy requests (each route's lone request and joiner) give `generate`'s tokens.
    for handle in handles:
        request = handle.request
        if request.temperature == 0.0:
            want = generate(target, [list(request.prompt)], drafter=None,
                            max_new_tokens=request.max_new_tokens, eos_token_id=[])  # fmt: skip
            assert handle.completion.tokens == want.sequences[0].tolist()[len(request.prompt) :]


def test_the_synthetic_prompts():
    repeating, distinct = warm_up_prompts(VOCAB)
    assert len(repeating) == len(distinct) == 32
    assert repeating[:8] == repeating[8:16]  # a lookup finds the phrase again
    assert len(set(distinct)) == 32  # and nothing in this one
    for vocab in (2, 13, 26, 31):
        _, distinct = warm_up_prompts(vocab)
        assert len(set(distinct)) == len(distinct) == min(32, vocab)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        warm_up_prompts(1)
    # Alone and in pairs; a pair whose first row ends long before the second; newcomers that
    # join one running row and two.
    waves = [[len(wave) for wave in group] for group in groups(VOCAB)]
    assert waves == [[1], [1], [2], [2], [2], [1, 1], [2, 2]]
    (short, long), *_ = groups(VOCAB)[4]
    assert short[1] < long[1]
    for group in groups(VOCAB)[5:]:
        first, joining = group
        assert min(tokens for _, tokens in first) > JOIN_AFTER  # still running when they join


@pytest.mark.skipif(
    "tiny-code" not in bundled.available(), reason="the bundled checkpoints are not installed"
)
def test_the_service_warms_up_when_its_steps_compile(monkeypatch):
    """`Service(warm_up=None)` warms every route up when the steps compile and not otherwise
    (eager steps here, to keep it short: `warm_up=True` forces it); the warm-up's drafters are
    its own (the served routes' drafters begin unused); a bad value is refused."""
    model = load_model("tiny-code", torch.device("cpu"))
    tokenizer = load_tokenizer("tiny-code")
    routes = server_routes("draft:tiny-code-draft:2", [])

    def service(**options):
        return Service(model, tokenizer, routes, model_name="tiny-code", **options)

    monkeypatch.setenv(COMPILE_ENV, "0")
    assert service().warm_up == []
    with monkeypatch.context() as patched:
        # Compiled steps: the default warms up (the warm-up itself stubbed: compiling is slow).
        calls = []
        patched.setattr(
            "specdec_fast.serving.service.run_warm_up",
            lambda model, drafters, **options: calls.append((drafters, options)) or ["ran"],
        )
        assert service(compile=True).warm_up == ["ran"]
        ((drafters, options),) = calls
        assert set(drafters) == {"default", "plain"}
        assert options["compile"] is True and options["max_batch"] == 16
    # Greedy only, to keep it short (every sampling: the test above).
    monkeypatch.setattr("specdec_fast.serving.warmup.SAMPLINGS", ({},))
    warmed = service(warm_up=True)
    assert [w.route for w in warmed.warm_up] == ["default", "plain"]
    assert all(w.requests == 14 and w.drafter_errors == 0 for w in warmed.warm_up)
    drafted = warmed.scheduler.lanes["default"]
    assert drafted.counters.drafts == 0 and drafted.counters.draft_tokens == 0
    with pytest.raises(TypeError, match="warm_up: expected None or a bool"):
        service(warm_up="yes")


def test_serve_takes_warm_up_flags(monkeypatch):
    """`serve --warm-up/--no-warm-up` reaches the engine's options (default None: when the
    steps compile)."""
    import specdec_fast.serving.server as server

    built = []
    monkeypatch.setattr(server, "EngineConfig", lambda *args: built.append(args) or 1 / 0)
    for flags, expected in (([], None), (["--warm-up"], True), (["--no-warm-up"], False)):
        args = build_parser().parse_args(["serve", "--model", "m", "--no-engine-process", *flags])
        with pytest.raises(ZeroDivisionError):
            server.serve(args)
        assert built.pop()[6]["warm_up"] is expected


def test_a_short_context_cuts_the_synthetic_requests():
    """Requests are cut to the scheduler's context (a model of few positions still warms up)."""
    assert fit(list(range(32)), 16, 20) == (list(range(22, 32)), 10)
    assert fit(list(range(32)), 8, 2) == ([31], 1)
    target = tiny_llama(VOCAB, seed=9)
    (plain,) = warm_up(target, {"plain": None}, max_cache_len=24, compile=False)
    assert plain.requests == 3 * 14 and plain.graphs == 0
