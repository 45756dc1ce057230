"""The soak's short version: a real `specdec-fast serve` process (its engine in a child
process) under mixed traffic from the official openai client, with faults, then the books
(bench/bench_soak.py says what is sent and checked; the long one runs from there).

About 150 requests: completions and chats, streamed and not, on three routes (one whose drafter
raises on every fifth step), sampled ones, streams whose client goes away after one chunk,
malformed and oversized bodies, requests over the small context and ones that fill it, at six at
once against four batch slots and four queue places (some 429s). Every request must end in
exactly one answer of its own (greedy ones equal to `generate()`'s) or refusal, the server's
counters must match, its memory must not grow by more than 10% after the warm-up, and SIGINT
(Ctrl-C, to its process group) must end it with code 0.
"""

import pytest
from bench_smoke import import_bench

from specdec_fast import bundled

pytestmark = pytest.mark.skipif(
    "tiny-code" not in bundled.available(), reason="the bundled checkpoints are not installed"
)


def test_a_short_soak_loses_nothing_and_the_books_balance(monkeypatch, tmp_path):
    soak = import_bench(monkeypatch, "bench_soak")
    figures = soak.run_soak(150, concurrency=6, folder=tmp_path, seed=1, warmup=30)
    assert figures["failures"] == []
    counts = figures["counts"]
    # Every kind of traffic was exercised, the faults included.
    for outcome in ("completed", "disconnected", "refused_400", "refused_413"):
        assert counts.get(outcome, 0) > 0, counts
    assert figures["flaky_drafter_errors"] > 0
    assert figures["server_exit_code"] == 0
    assert sum(counts.values()) == 150


def test_the_books_catch_a_wrong_answer_and_a_lost_count(monkeypatch):
    soak = import_bench(monkeypatch, "bench_soak")
    expected = {("complete", 0, 6): ("abc", 3)}
    item = soak.Planned(0, "complete", 0, 6, "tiny-code")
    right = soak.Outcome(0, "complete", "tiny-code", 200, "abc", "length", 3, "cmpl-1")
    wrong = soak.Outcome(0, "complete", "tiny-code", 200, "abd", "length", 3, "cmpl-1")
    assert soak.audit([item], [right], expected)["failures"] == []
    assert "differs from generate" in soak.audit([item], [wrong], expected)["failures"][0]
    books = soak.audit([item], [right], expected)
    key = ("vllm:request_success_total", (("finished_reason", "length"), ("route", "default")))
    assert soak.reconcile(books, {}, {key: 1.0}) == []
    assert soak.reconcile(books, {}, {})  # the server counted none of it
