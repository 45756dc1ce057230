"""Warming a server's compiled steps up before it takes requests.

A compiled step compiles on the first call of its shape: batch 1 and batch 2+ apart (the
compiler specialises a size of 1), each step kind apart (a plain decode step, a drafter's tree,
its update, a lone row's tree after a batch's). In a server those first calls are requests: the
first request, the first pair, the first sampled one, the first row left alone with a draft
each wait for a compilation (10-30 s a graph on a CPU, longer with a CUDA graph's capture), and
every request decoding beside them waits too. `warm_up` meets them before the server opens: a
scheduler of its own over the same model, with drafters from the same factories (the compiled
graphs are kept on the model's runner and on the drafters' models, so the server's own
scheduler finds them), serves synthetic requests on every route: alone and in pairs, greedy and
sampled, over a prompt that repeats (a lookup drafter finds drafts) and one that does not (it
decodes plainly), a pair of unequal lengths leaving one row alone, newcomers joining running
rows. Its counters and guardrails die with it. `tests/test_serving_warmup.py` checks that
serving afterwards compiles nothing.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

from specdec_fast.compiled import graphs_compiled
from specdec_fast.drafters.base import Drafter
from specdec_fast.notices import notice
from specdec_fast.serving.scheduler import Request, Scheduler

PROMPT_TOKENS = 32
NEW_TOKENS = 8
JOIN_AFTER = 2  # steps
# The samplings met: greedy, plain sampling and sampling with both filters.
SAMPLINGS = (
    {},
    {"temperature": 0.8, "seed": 0},
    {"temperature": 0.8, "top_k": 40, "top_p": 0.9, "seed": 1},
)


@dataclass
class RouteWarmUp:
    """What warming one route up took: graphs compiled (`compiled.graphs_compiled`), seconds,
    requests served and drafter errors met."""

    route: str
    graphs: int
    seconds: float
    requests: int
    drafter_errors: int


def warm_up_prompts(vocab_size: int) -> tuple[list[int], list[int]]:
    """(a prompt repeating an 8-token phrase, one without a repeated token): `PROMPT_TOKENS`
    ids each (fewer without a repeat in a vocabulary smaller than that)."""
    if vocab_size < 2:
        raise ValueError(f"vocab_size: expected at least 2 tokens, got {vocab_size}")
    phrase = [(3 + i) % vocab_size for i in range(8)]
    repeating = (phrase * (PROMPT_TOKENS // len(phrase) + 1))[:PROMPT_TOKENS]
    # Ids 13 apart (coprime to the vocabulary's size; else 1 apart): none comes twice.
    stride = 13 if vocab_size % 13 else 1
    distinct = [(7 + stride * i) % vocab_size for i in range(min(PROMPT_TOKENS, vocab_size))]
    return repeating, distinct


def groups(vocab_size: int) -> list[list[list[tuple[list[int], int]]]]:
    """The synthetic requests' groups, each served from an empty batch, as waves of (prompt,
    new tokens) pairs: a wave joins the batch `JOIN_AFTER` steps after the one before (its
    prompts fed into rows beside running ones). Alone and in pairs, each prompt kind; a pair of
    unequal lengths (one row decodes alone after the other ends, with a draft); newcomers
    joining one running row and two; prompts of other lengths (a dynamic dimension, met
    twice)."""
    repeating, distinct = warm_up_prompts(vocab_size)
    return [
        [[(repeating, NEW_TOKENS)]],
        [[(distinct, NEW_TOKENS)]],
        [[(repeating[1:], NEW_TOKENS), (repeating[3:], NEW_TOKENS)]],
        [[(distinct[1:], NEW_TOKENS), (distinct[2:], NEW_TOKENS)]],
        [[(repeating[2:], 2), (repeating, 2 * NEW_TOKENS)]],
        [[(repeating, 2 * NEW_TOKENS)], [(repeating[4:], NEW_TOKENS)]],
        [
            [(repeating[1:], 2 * NEW_TOKENS), (distinct, 2 * NEW_TOKENS)],
            [(repeating[5:], NEW_TOKENS), (distinct[3:], NEW_TOKENS)],
        ],
    ]


def fit(prompt: list[int], tokens: int, context_len: int) -> tuple[list[int], int]:
    """(prompt, new tokens) cut to hold at most `context_len` tokens: the new tokens to half of
    it at most, the prompt to the rest (its last ids)."""
    tokens = max(1, min(tokens, context_len // 2))
    return prompt[-max(1, context_len - tokens) :], tokens


def warm_up(model, drafters: Mapping[str, Drafter | None], **options) -> list[RouteWarmUp]:
    """Serve the synthetic requests (`groups`, each sampling of `SAMPLINGS`) on every route
    of `drafters` through a `Scheduler(model, drafters, **options)` of their own, closed at
    the end; a notice per route says what it compiled. Raises RuntimeError if a request
    fails (the server's own would)."""
    scheduler = Scheduler(model, drafters, **options)
    vocab_size = scheduler.vocab_size
    done = []
    try:
        for route in drafters:
            before, start, served = graphs_compiled(), time.perf_counter(), 0
            for sampling in SAMPLINGS:
                for waves in groups(vocab_size):
                    handles = []
                    for wave in waves:
                        if handles:
                            scheduler.run_until_idle(max_steps=JOIN_AFTER)
                        for prompt, tokens in wave:
                            fitted = fit(prompt, tokens, scheduler.context_len)
                            request = Request(*fitted, route=route, eos_token_id=[], **sampling)
                            handles.append(scheduler.submit(request))
                    scheduler.run_until_idle()
                    for handle in handles:
                        completion = handle.completion
                        if completion is None or completion.finish_reason == "error":
                            why = "no answer" if completion is None else completion.error
                            raise RuntimeError(f"warming route {route!r} up: {why}")
                    served += len(handles)
            lane = scheduler.lanes[route]
            errors = lane.counters.drafter_errors
            warmed = RouteWarmUp(
                route, graphs_compiled() - before, time.perf_counter() - start, served, errors
            )
            done.append(warmed)
            notice(
                f"route {route!r} warmed up: {warmed.graphs} step graphs compiled in "
                f"{warmed.seconds:.1f} s ({served} synthetic requests"
                + (f", {errors} DRAFTER ERRORS, the last: {lane.last_error}" if errors else "")
                + ")"
            )
    finally:
        scheduler.close()
    return done
