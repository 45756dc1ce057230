"""`specdec-fast serve` on loopback: the OpenAI API, routes, guardrails, overload, disconnects,
and the load generator's report.

Servers run uvicorn on a thread (port 0 on 127.0.0.1) over the bundled tiny-code target with a
tiny chat template. Expected outputs come from `generate()` on a separate copy of the model
(the server's scheduler drives its own). Every wait is bounded.
"""

import asyncio
import json
import random
import time
import warnings

import httpx
import openai
import pytest
import torch
from loopback import (
    LONG_STREAM,
    PROMPTS,
    TEMPLATE,
    TIMEOUT_S,
    Server,
    cut_at_stop_strings,
    greedy_reference,
    overload,
)

from specdec_fast import bundled
from specdec_fast.cli import main
from specdec_fast.guardrails import Guardrails
from specdec_fast.harness.prompts import PromptRecord
from specdec_fast.loading import load_model, load_tokenizer
from specdec_fast.serving import server as server_module
from specdec_fast.serving.loadgen import (
    LoadConfig,
    RequestRecord,
    integrity,
    run_sweep,
    write_serving_report,
)
from specdec_fast.serving.protocol import TextStream
from specdec_fast.serving.routes import ROUTE_HEADER, RouteConfig, load_routes, server_routes
from specdec_fast.serving.server import REQUEST_ID_HEADER
from specdec_fast.serving.service import Service
from specdec_fast.text import encode_prompt

pytestmark = pytest.mark.skipif(
    "tiny-code" not in bundled.available(), reason="the bundled checkpoints are not installed"
)
GUARDRAILS = """
speculative_decoding_guardrails:
  max_tpot_p95_regression: 100.0
  # The bundled target rarely repeats itself on these short prompts: n-gram acceptance sits
  # near the default 0.1 floor, and the default route must keep speculating for these tests.
  min_acceptance_rate: 0.0
  routes:
    faulty: {window_steps: 2, min_window_steps: 1, cooldown_steps: 100000}
"""


def make_engine(routes, **options) -> Service:
    model = load_model("tiny-code", torch.device("cpu"))
    tokenizer = load_tokenizer("tiny-code")
    return Service(
        model, tokenizer, routes, model_name="tiny-code", chat_template=TEMPLATE, **options
    )


@pytest.fixture(scope="module")
def server():
    routes = server_routes(
        "ngram:8",
        [
            RouteConfig("faulty", "ngram:8"),
            RouteConfig("shadowed", "ngram:8", mode="shadow"),
            RouteConfig("canary", "ngram:8", canary=0.5, aliases=("tiny-code-canary",)),
        ],
    )
    running = Server(make_engine(routes, guardrails=Guardrails.from_yaml(GUARDRAILS), max_batch=16))
    yield running
    running.close()


@pytest.fixture(scope="module")
def reference():
    return greedy_reference()


def test_the_openai_client_streams_chat_completions(server, reference):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Write a function that adds two numbers."}]
    stream = client.chat.completions.create(
        model="tiny-code",
        messages=messages,
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        timeout=TIMEOUT_S,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    expected, count = reference(messages=messages, max_tokens=24)
    assert text == expected
    assert len([c for c in chunks if c.choices]) > 2  # streamed, not sent at once
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert chunks[-1].usage.completion_tokens == count
    whole = client.chat.completions.create(
        model="tiny-code", messages=messages, max_tokens=24, temperature=0, timeout=TIMEOUT_S
    )
    assert whole.choices[0].message.content == expected
    models = {m.id for m in client.models.list()}
    assert {"tiny-code", "default", "plain", "faulty", "tiny-code-canary"} <= models


def test_sixteen_concurrent_requests_equal_generate(server, reference):
    async def run():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        calls = [
            client.completions.create(
                model="tiny-code",
                prompt=PROMPTS[i % len(PROMPTS)] + "#" * (i // len(PROMPTS)),
                max_tokens=12 + i,
                temperature=0,
                timeout=TIMEOUT_S,
            )
            for i in range(16)
        ]
        return await asyncio.gather(*calls)

    before = server.decode_steps()
    replies = asyncio.run(run())
    after = server.decode_steps()
    # They shared batches: decode steps of eight rows or more ran.
    assert any(after[b] > before.get(b, 0) for b in after if b >= 8)
    for i, reply in enumerate(replies):
        prompt = PROMPTS[i % len(PROMPTS)] + "#" * (i // len(PROMPTS))
        expected, count = reference(prompt=prompt, max_tokens=12 + i)
        assert reply.choices[0].text == expected, i
        assert reply.usage.completion_tokens == count
    assert server.metric("vllm:spec_decode_num_accepted_tokens_total", route="default") > 0


def test_a_drafter_fault_trips_the_route_and_shows_in_metrics(server, reference, caplog):
    lane = server.engine.scheduler.lanes["faulty"]

    def broken(state):
        raise RuntimeError("injected drafter fault")

    lane.drafter.propose = broken
    for prompt in PROMPTS[:2]:
        reply = httpx.post(
            server.url + "/v1/completions",
            json={"model": "faulty", "prompt": prompt, "max_tokens": 16, "temperature": 0},
            timeout=TIMEOUT_S,
        )
        assert reply.status_code == 200
        assert reply.json()["choices"][0]["text"] == reference(prompt=prompt)[0]
    labels = {"model_name": "tiny-code", "route": "faulty"}
    assert server.metric("specdec_route_fallbacks_total", **labels) == 1.0
    assert server.metric("specdec_route_drafter_errors_total", **labels) >= 1.0
    assert server.metric("specdec_route_speculating", **labels) == 0.0
    assert server.metric("specdec_route_speculating", route="default") == 1.0
    assert "injected drafter fault" in lane.last_error
    # The operator sees it in the log: one warning with the error, however many follow it.
    logged = [r.getMessage() for r in caplog.records if r.name.startswith("specdec_fast.serving")]
    assert len(logged) == 1 and "route 'faulty': drafter error in propose" in logged[0], logged
    assert "injected drafter fault" in logged[0]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("frequency_penalty", 0.5),
        ("logit_bias", {"5": 10}),
        ("logprobs", True),
        ("tools", [{"type": "function", "function": {"name": "f"}}]),
        ("response_format", {"type": "json_object"}),
    ],
)
def test_fields_that_would_change_the_output_are_refused_not_ignored(server, field, value):
    """Unless they hold their neutral value (a text `response_format`, no penalty), which
    changes nothing."""
    url, chat = server.url + "/v1/chat/completions", [{"role": "user", "content": "x"}]
    body = {"messages": chat, "max_tokens": 1}
    reply = httpx.post(url, json={**body, field: value}, timeout=TIMEOUT_S)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert (error["param"], error["code"]) == (field, "unsupported")
    neutral = {"response_format": {"type": "text"}, "frequency_penalty": 0, "logprobs": False}
    assert httpx.post(url, json={**body, **neutral}, timeout=TIMEOUT_S).status_code == 200


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b'{"model": "tiny-code", "prompt": "x"', None),
        (b'{"model": "no-such-model", "prompt": "x"}', "model"),
        (b'{"model": "tiny-code", "prompt": "x", "max_tokens": -3}', "max_tokens"),
        (json.dumps({"model": "tiny-code", "prompt": "word " * 2100}).encode(), "prompt"),
        (b'{"model": "tiny-code", "prompt": "x", "max_tokens": 5000}', "max_tokens"),
        (b'{"model": "tiny-code", "prompt": "x", "temperature": "hot"}', "temperature"),
        (b'{"model": "tiny-code", "prompt": ["a", "b"]}', "prompt"),
    ],
    ids=[
        "malformed-json",
        "unknown-model",
        "negative-max-tokens",
        "prompt-over-context",
        "completion-over-context",
        "bad-type",
        "two-prompts",
    ],
)
def test_bad_requests_get_a_400_in_openai_shape(server, body, param):
    reply = httpx.post(
        server.url + "/v1/completions",
        content=body,
        headers={"content-type": "application/json", REQUEST_ID_HEADER: "bad-1"},
        timeout=TIMEOUT_S,
    )
    assert reply.status_code == 400 and reply.headers[REQUEST_ID_HEADER] == "bad-1"
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert error["message"]


def test_an_unknown_route_header_and_chat_without_messages_get_400s(server):
    reply = httpx.post(
        server.url + "/v1/completions",
        json={"prompt": "x"},
        headers={ROUTE_HEADER: "nowhere"},
        timeout=TIMEOUT_S,
    )
    assert reply.status_code == 400 and reply.json()["error"]["param"] == ROUTE_HEADER
    # The header wins over `model`, and the answer names the route that served it.
    for headers, route in (({}, "plain"), ({ROUTE_HEADER: "faulty"}, "faulty")):
        reply = httpx.post(
            server.url + "/v1/completions",
            json={"model": "plain", "prompt": "x", "max_tokens": 1},
            headers=headers,
            timeout=TIMEOUT_S,
        )
        assert reply.status_code == 200 and reply.headers[ROUTE_HEADER] == route
    reply = httpx.post(
        server.url + "/v1/chat/completions", json={"messages": []}, timeout=TIMEOUT_S
    )
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "messages"


def test_shadow_copies_are_compared_never_returned(server, reference):
    for prompt in PROMPTS[:2]:
        reply = httpx.post(
            server.url + "/v1/completions",
            json={"model": "shadowed", "prompt": prompt, "max_tokens": 16, "temperature": 0},
            timeout=TIMEOUT_S,
        )
        assert reply.json()["choices"][0]["text"] == reference(prompt=prompt)[0]
    deadline = time.monotonic() + TIMEOUT_S
    while server.metric("specdec_shadow_requests_total", route="shadowed") < 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert server.metric("specdec_shadow_mismatches_total", route="shadowed") == 0.0
    # The copies speculated; the served requests did not.
    assert server.metric("vllm:spec_decode_num_drafts_total", route="shadowed") > 0
    assert server.metric("specdec_route_speculative_requests_total", route="shadowed") == 0.0
    assert server.metric("vllm:request_success_total", route="shadowed") == 2.0


def test_a_canary_share_of_requests_speculates(server):
    for _ in range(8):
        reply = httpx.post(
            server.url + "/v1/completions",
            json={"model": "tiny-code-canary", "prompt": "x = 1\n", "max_tokens": 2},
            timeout=TIMEOUT_S,
        )
        assert reply.status_code == 200
    draws = random.Random("0:canary")
    expected = sum(draws.random() < 0.5 for _ in range(8))
    assert 0 < expected < 8
    labels = {"route": "canary"}
    assert server.metric("specdec_route_speculative_requests_total", **labels) == expected
    assert server.metric("vllm:request_success_total", **labels) == 8.0


def test_overload_gets_429_a_disconnect_frees_the_slot_and_a_stop_503(reference):
    """One slot, one queue place: a long stream holds the slot, a second request waits, a third
    is refused with a 429; when the stream's client disconnects, the waiting one is served. A
    stopped scheduler gets 503s."""
    small = Server(make_engine(server_routes("none", []), max_batch=1, max_queue=1))
    try:
        served = overload(small)
        assert served.json()["choices"][0]["text"] == reference(PROMPTS[1], None, 8)[0]
        assert small.metric("vllm:request_success_total", finished_reason="abort") == 1.0
        assert small.metric("specdec_requests_rejected_total", reason="queue_full") == 1.0
        assert small.metric("vllm:num_requests_running") == 0.0
        # A client that gives up on a whole (non-streamed) response frees the slot too.
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                small.url + "/v1/completions",
                json={"prompt": PROMPTS[2], "max_tokens": 2000, "ignore_eos": True},
                timeout=httpx.Timeout(TIMEOUT_S, read=0.5),
            )
        deadline = time.monotonic() + TIMEOUT_S / 2
        while small.metric("vllm:request_success_total", finished_reason="abort") < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert small.metric("vllm:num_requests_running") == 0.0
        # Once the scheduler has stopped, health and requests get 503s in OpenAI's shape.
        small.engine.scheduler.close()
        assert httpx.get(small.url + "/health", timeout=TIMEOUT_S).status_code == 503
        stopped = httpx.post(small.url + "/v1/completions", json=LONG_STREAM, timeout=TIMEOUT_S)
        assert stopped.status_code == 503 and stopped.json()["error"]["code"] == "stopped"
        assert small.metric("specdec_requests_rejected_total", reason="stopped") == 1.0
    finally:
        small.close()


def test_stop_strings_token_prompts_and_ignore_eos(server, reference):
    expected, _ = reference(prompt=PROMPTS[1], max_tokens=24)
    cut_at_stop_strings(server.url, expected, prompt=PROMPTS[1])
    tokenizer = server.engine.tokenizer
    ids = encode_prompt(tokenizer, PROMPTS[1], chat=False)
    reply = httpx.post(
        server.url + "/v1/completions",
        json={"prompt": ids, "max_tokens": 24, "temperature": 0, "ignore_eos": True},
        timeout=TIMEOUT_S,
    ).json()
    assert reply["usage"] == {
        "prompt_tokens": len(ids),
        "completion_tokens": 24,
        "total_tokens": len(ids) + 24,
    }
    assert reply["choices"][0]["text"].startswith(expected)


def test_text_stream_holds_back_partial_text_and_cuts_at_a_stop():
    tokenizer = load_tokenizer("tiny-code")
    ids = tokenizer.encode("result = compute(x) # STOP here", add_special_tokens=False)
    stream = TextStream(tokenizer, ["STOP"])
    pieces = [stream.push([token]) for token in ids]
    assert "".join(pieces) + stream.flush() == "result = compute(x) # "
    assert stream.stopped and max(len(p) for p in pieces) < len("result = compute(x) # ")
    plain = TextStream(tokenizer, [])
    text = "".join(plain.push([token]) for token in ids) + plain.flush()
    assert text == "result = compute(x) # STOP here" and not plain.stopped
    # Characters split across byte-level tokens come out whole, never as U+FFFD.
    wide = "naïve café: 3 × 4 ≤ 12 ✓ — done"
    ids = tokenizer.encode(wide, add_special_tokens=False)
    assert any("\ufffd" in tokenizer.decode([token]) for token in ids)  # split characters
    stream = TextStream(tokenizer, ["done"])
    pieces = [stream.push(ids[i : i + 2]) for i in range(0, len(ids), 2)] + [stream.flush()]
    assert "".join(pieces) == wide[: wide.index("done")] and "\ufffd" not in "".join(pieces)


def test_a_short_qps_sweep_writes_its_report(server, tmp_path):
    prompts = [
        PromptRecord(prompt=text, task="code", max_new_tokens=8, id=f"p{i}", check="python")
        for i, text in enumerate(PROMPTS[:3])
    ]
    config = LoadConfig(url=server.url, qps=[4, 8], duration=1.0, num_requests=5, seed=3, rounds=2)
    lines, between = [], []
    report = run_sweep(
        config, prompts, "(test prompts)", lines.append, lambda q, k: between.append((q, k))
    )
    files = write_serving_report(report, tmp_path)
    # Two levels, in two rounds each, on the plain and the default route in turn.
    assert len(lines) == 8 and "round 2/2 default" in lines[3]
    assert between == [(4, 0), (4, 1), (8, 0), (8, 1)]
    markdown = (tmp_path / "report.md").read_text()
    assert "## Served traffic" in markdown and "| QPS |" in markdown
    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved["config"]["axis"] == "qps" and saved["config"]["batches"] == [4, 8]
    assert sorted(saved["serving"]) == ["4", "8"]
    assert files["json"].endswith("report.json")
    for level in ("4", "8"):
        for route in ("plain", "default"):
            checks = saved["integrity"][level][route]
            assert checks["completed"] == checks["requests"] == 6  # 3 per round
            assert checks["lost"] == checks["unaccounted"] == checks["wrong_ids"] == 0
            assert checks["inconsistent_outputs"] == 0
            metrics = saved["serving"][level][route]
            assert metrics["tpot_s"]["p50"] > 0 and metrics["ttft_s"]["p99"] > 0
            # The server's step counters over the level: where its time went.
            busy = metrics["scheduler"]
            assert 0 < busy["decode_share"] < 1
            # Prompts fed on the scheduler's thread, or beside its steps (`overlap_prefill`).
            fed = (busy["prefill_share"], busy["prefill_beside_share"])
            assert all(0 <= share < 1 for share in fed) and sum(fed) > 0
            assert busy["prefill_tokens"] > 0 and sum(busy["decode_steps_by_batch"].values()) > 0
        cell = next(c for c in saved["cells"] if c["batch"] == int(level))
        assert cell["quality"]["greedy_exact_matches"] == cell["quality"]["greedy_prompts"] == 6
        assert cell["metrics"]["acceptance_rate"] is not None
    assert (tmp_path / "speedup_vs_concurrency.png").exists()


def test_a_baseline_alone_reports_without_empty_plots(server, tmp_path):
    prompts = [PromptRecord(prompt=PROMPTS[0], task="code", max_new_tokens=4, id="p0")]
    config = LoadConfig(
        url=server.url, qps=[8], duration=None, num_requests=2, routes=[], baseline="default"
    )
    with warnings.catch_warnings():
        # What matplotlib says of a legend with nothing in it.
        warnings.filterwarnings("error", message="No artists with labels")
        write_serving_report(run_sweep(config, prompts, None, lambda line: None), tmp_path)
    assert [p.name for p in tmp_path.glob("*.png")] == ["latency_percentiles.png"]
    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved["integrity"]["8"]["default"]["completed"] == 2


def test_integrity_counts_refusals_as_errors_and_catches_misdelivered_responses():
    prompts = [PromptRecord(prompt="x", task="code", temperature=0.0, id="p0")]

    def record(index, request_id, status=200, text="a", error=None):
        finish = None if error else "length"
        return RequestRecord(
            index, 0, "plain", 0.0, text=text, finish_reason=finish, error=error,
            status=status, request_id=request_id,
        )  # fmt: skip

    served = [record(0, "0"), record(1, "1"), record(2, "2", 429, "", "HTTP 429: full")]
    checks = integrity(served, {"ended": 2.0, "rejected": 1.0}, prompts)
    assert checks["completed"] == 2 and checks["refused"] == checks["errors"] == 1
    assert checks["lost"] == checks["unaccounted"] == checks["wrong_ids"] == 0
    # Request 1 got request 0's response, and one the server never counted.
    crossed = [record(0, "0"), record(1, "0", text="b"), record(2, "2", 429, "", "HTTP 429")]
    checks = integrity(crossed, {"ended": 1.0, "rejected": 1.0}, prompts)
    assert checks["wrong_ids"] == 2 and checks["inconsistent_outputs"] == 1
    assert checks["unaccounted"] == -1


def test_bench_url_on_the_command_line(server, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "\n".join(json.dumps({"prompt": p, "task": "code", "max_new_tokens": 6}) for p in PROMPTS)
    )
    # Two rounds of ceil(3 / 2) requests each (the count ends a round long before 10 s).
    argv = ["bench", "--url", server.url, "--qps", "8", "--duration", "20", "--num-requests"]
    argv += ["3", "--rounds", "2", "--prompts", str(prompts), "--route", "canary"]
    assert main([*argv, "--out", str(tmp_path / "out")]) == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["config"]["drafters"] == ["canary"] and report["config"]["batches"] == [8]
    assert report["integrity"]["8"]["canary"]["completed"] == 4


def test_serve_builds_its_routes_guardrails_and_template(monkeypatch, tmp_path):
    routes = tmp_path / "routes.yaml"
    routes.write_text("routes:\n  code: {drafter: 'suffix:8', canary: 0.25, aliases: [coder]}\n")
    guardrails = tmp_path / "guardrails.yaml"
    guardrails.write_text(GUARDRAILS.replace("faulty", "code"))
    template = tmp_path / "template.jinja"
    template.write_text(TEMPLATE)
    started = {}
    monkeypatch.setattr(
        server_module,
        "run_server",
        lambda app, host, port, log_level, drain_s: started.update(app=app, host=host, port=port),
    )
    argv = ["serve", "--drafter", "none", "--routes", str(routes), "--guardrails", str(guardrails)]
    argv += ["--chat-template", str(template), "--port", "8123", "--max-batch", "2"]
    argv += ["--no-overlap-prefill", "--read-ahead", "--no-engine-process"]
    assert main(argv) == 0
    engine = started["app"].state.engine
    try:
        assert started["port"] == 8123 and started["host"] == "127.0.0.1"
        assert set(engine.router.routes) == {"default", "plain", "code"}
        assert engine.router.resolve("coder", None) == "code"
        assert engine.router.resolve("tiny-code", None) == "default"
        assert engine.scheduler.lanes["code"].guard.policy.min_window_steps == 1
        assert engine.scheduler.lanes["default"].drafter is None
        assert engine.scheduler.max_batch == 2 and engine.tokenizer.chat_template == TEMPLATE
        assert not engine.scheduler.overlap_prefill and engine.scheduler.read_ahead
    finally:
        engine.close()


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("routes:\n  a: {drafter: ngram, mood: shadow}\n", "routes.a.mood: unknown field"),
        ("routes:\n  a: {drafter: ngram, mode: sometimes}\n", "routes.a.mode"),
        ("routes:\n  a: {drafter: ngram, canary: 2}\n", "routes.a.canary"),
        ("routes:\n  a: {drafter: 'nonsense:1'}\n", "drafter spec"),
        ("routes:\n  plain: {drafter: ngram}\n", "reserved"),
        ("nothing: here\n", "top-level `routes`"),
    ],
)
def test_bad_route_files_name_the_field(text, match):
    with pytest.raises(ValueError, match=match):
        server_routes("ngram", load_routes(text))
