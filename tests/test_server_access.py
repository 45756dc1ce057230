"""A server exposed on a port: API keys, request limits and the refusals while draining, each
seen through the official openai client (and raw HTTP where the client cannot send it).

One server (uvicorn on a loopback thread, the bundled tiny-code target, in-process engine)
with two keys and small limits serves every test here; every wait is bounded.
"""

import hmac
import json
import logging
import threading
import time

import httpx
import openai
import pytest
import torch
from fastapi.testclient import TestClient
from loopback import LONG_STREAM, PROMPTS, TEMPLATE, TIMEOUT_S, Server, greedy_reference

from specdec_fast import bundled
from specdec_fast.cli import main
from specdec_fast.loading import load_model, load_tokenizer
from specdec_fast.serving import protocol
from specdec_fast.serving import server as server_module
from specdec_fast.serving.access import API_KEY_ENV, ApiKeys, is_loopback
from specdec_fast.serving.limits import Limits
from specdec_fast.serving.routes import RouteConfig, server_routes
from specdec_fast.serving.server import create_app
from specdec_fast.serving.service import Service

pytestmark = pytest.mark.skipif(
    "tiny-code" not in bundled.available(), reason="the bundled checkpoints are not installed"
)
KEYS = ("first-key", "second-key")
LIMITS = Limits(
    max_body_bytes=4096, max_messages=3, max_stop=2, max_prompt_tokens=64, max_tokens=32
)
ROUTE_CAP = 4


def make_engine(**options) -> Service:
    model = load_model("tiny-code", torch.device("cpu"))
    tokenizer = load_tokenizer("tiny-code")
    routes = server_routes("ngram:8", [RouteConfig("short", "ngram:8", max_tokens=ROUTE_CAP)])
    return Service(
        model, tokenizer, routes, model_name="tiny-code", chat_template=TEMPLATE, **options
    )


@pytest.fixture(scope="module")
def server():
    running = Server(make_engine(max_batch=4), keys=ApiKeys(KEYS), limits=LIMITS)
    yield running
    running.close()


def client(server: Server, key: str | None = KEYS[1]) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


def refusal(call) -> openai.APIStatusError:
    """The openai client's error for `call()`, whose body must be OpenAI's error shape."""
    with pytest.raises(openai.APIStatusError) as caught:
        call()
    error = caught.value
    assert set(error.body) == {"message", "type", "param", "code"}, error.body
    return error


# -- API keys ----------------------------------------------------------------------------------


def test_every_v1_route_needs_a_valid_key(server):
    wrong = client(server, "third-key")
    calls = [
        wrong.models.list,
        lambda: wrong.completions.create(model="tiny-code", prompt="x", max_tokens=2),
        lambda: wrong.chat.completions.create(
            model="tiny-code", messages=[{"role": "user", "content": "x"}], max_tokens=2
        ),
    ]
    for call in calls:
        error = refusal(call)
        assert isinstance(error, openai.AuthenticationError)
        assert error.status_code == 401 and error.code == "invalid_api_key"
    for headers in ({}, {"Authorization": KEYS[0]}, {"Authorization": f"Basic {KEYS[0]}"}):
        reply = httpx.get(server.url + "/v1/models", headers=headers, timeout=TIMEOUT_S)
        assert reply.status_code == 401, headers
        assert reply.headers["WWW-Authenticate"] == "Bearer"
        assert reply.json()["error"]["code"] == "invalid_api_key"
    # Either key serves; /health and /metrics stay open (no --metrics-auth).
    for key in KEYS:
        assert "tiny-code" in [m.id for m in client(server, key).models.list().data]
    assert httpx.get(server.url + "/health", timeout=TIMEOUT_S).status_code == 200
    assert httpx.get(server.url + "/metrics", timeout=TIMEOUT_S).status_code == 200


def test_a_served_request_with_a_key_equals_generate(server):
    expected, count = greedy_reference()(prompt=PROMPTS[0], max_tokens=8)
    reply = client(server).completions.create(
        model="tiny-code", prompt=PROMPTS[0], max_tokens=8, temperature=0
    )
    assert reply.choices[0].text == expected and reply.usage.completion_tokens == count


def test_keys_are_compared_in_constant_time_with_every_key(monkeypatch):
    compared = []
    real = hmac.compare_digest

    def counting(a, b):
        compared.append(b)
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", counting)
    keys = ApiKeys(KEYS)
    assert keys.allows(f"Bearer {KEYS[0]}")  # a match does not stop the comparisons
    assert compared == [key.encode() for key in KEYS]
    assert not keys.allows(f"Bearer {KEYS[0]}x") and not keys.allows(None)
    assert ApiKeys().allows(None)  # no keys: open


def test_keys_from_the_environment_and_the_exposure_warning(monkeypatch, caplog):
    keys = ApiKeys.from_sources(["cli-key"], {API_KEY_ENV: "env-a, env-b"})
    assert all(keys.allows(f"Bearer {key}") for key in ("cli-key", "env-a", "env-b"))
    assert not ApiKeys.from_sources(None, {})
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("example.org")

    started = {}
    monkeypatch.setattr(
        server_module, "run_server", lambda app, *args: started.update(app=app, args=args)
    )
    argv = ["serve", "--drafter", "none", "--no-engine-process", "--host", "0.0.0.0"]
    for env, warned in ((None, True), ("env-key", False)):
        if env is None:
            monkeypatch.delenv(API_KEY_ENV, raising=False)
        else:
            monkeypatch.setenv(API_KEY_ENV, env)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="specdec_fast.serving"):
            assert main(argv) == 0
        started["app"].state.engine.close()
        assert ("without an API key" in caplog.text) == warned, caplog.text
    assert started["app"].state.keys.allows("Bearer env-key")


def test_metrics_auth_puts_metrics_behind_the_keys(monkeypatch):
    app = create_app(make_engine(), keys=ApiKeys(KEYS), metrics_auth=True)
    with TestClient(app) as http:
        assert http.get("/metrics").status_code == 401
        assert http.get("/metrics", headers={"Authorization": f"Bearer {KEYS[0]}"}).is_success
        assert http.get("/health").status_code == 200


# -- limits ------------------------------------------------------------------------------------


def test_an_oversized_body_gets_a_413_before_it_is_tokenized(server, monkeypatch):
    encoded = []
    real = protocol.encode_prompt
    monkeypatch.setattr(
        protocol, "encode_prompt", lambda *a, **k: encoded.append(1) or real(*a, **k)
    )
    error = refusal(
        lambda: client(server).completions.create(
            model="tiny-code", prompt="word " * 1000, max_tokens=2
        )
    )
    assert error.status_code == 413 and error.code == "request_too_large"
    assert "4096" in error.message
    # A chunked body declares no length: it is refused as its chunks arrive.
    chunks = (b'{"prompt": "' + b"x" * 1024 for _ in range(8))
    reply = httpx.post(
        server.url + "/v1/completions",
        content=chunks,
        headers={"Authorization": f"Bearer {KEYS[0]}"},
        timeout=TIMEOUT_S,
    )
    assert reply.status_code == 413 and reply.json()["error"]["code"] == "request_too_large"
    assert not encoded
    # Under the limit, the same path tokenizes and serves.
    client(server).completions.create(model="tiny-code", prompt="x", max_tokens=1)
    assert encoded


@pytest.mark.parametrize(
    ("fields", "param", "limit"),
    [
        ({"messages": [{"role": "user", "content": "x"}] * 4}, "messages", 3),
        ({"prompt": "x", "stop": ["a", "b", "c"]}, "stop", 2),
        ({"prompt": "x", "stop_token_ids": [1, 2, 3]}, "stop_token_ids", 2),
        ({"prompt": "x", "n": 2}, "n", 1),
        ({"prompt": "x", "max_tokens": 33}, "max_tokens", 32),
        ({"prompt": "x", "max_tokens": 5, "model": "short"}, "max_tokens", ROUTE_CAP),
        ({"prompt": "word " * 70}, "prompt", 64),
        ({"prompt": list(range(65))}, "prompt", 64),
    ],
    ids=["messages", "stop", "stop-ids", "n", "max-tokens", "route-cap", "prompt", "prompt-ids"],
)
def test_requests_over_a_limit_get_a_400_naming_field_and_limit(server, fields, param, limit):
    fields = {"model": "tiny-code", **fields}
    openai_client = client(server)
    if "messages" in fields:
        call = lambda: openai_client.chat.completions.create(**fields)  # noqa: E731
    else:
        extra = {k: fields.pop(k) for k in ("stop_token_ids",) if k in fields}
        call = lambda: openai_client.completions.create(**fields, extra_body=extra)  # noqa: E731
    error = refusal(call)
    assert isinstance(error, openai.BadRequestError)
    assert error.param == param and error.code == "limit_exceeded", error.body
    assert f"at most {limit}" in error.message


def test_a_route_cap_bounds_a_completion_that_asks_for_none(server):
    reply = client(server).chat.completions.create(
        model="short", messages=[{"role": "user", "content": "x"}], temperature=0
    )
    assert reply.usage.completion_tokens <= ROUTE_CAP
    described = client(server).models.list().data
    assert {m.id: m.specdec["max_tokens"] for m in described}["short"] == ROUTE_CAP


def test_limits_refuse_bad_values():
    with pytest.raises(ValueError, match="max_stop"):
        Limits(max_stop=0)
    assert Limits(max_tokens=8).with_route_cap(16).max_tokens == 8
    assert Limits().with_route_cap(16).max_tokens == 16
    with pytest.raises(ValueError, match="routes.a.max_tokens"):
        RouteConfig("a", max_tokens="many")


# -- draining ----------------------------------------------------------------------------------


def test_while_draining_v1_and_health_answer_503(server):
    drain = server.app.state.drain
    drain.draining = True
    try:
        error = refusal(
            lambda: client(server).completions.create(model="tiny-code", prompt="x", max_tokens=1)
        )
        assert error.status_code == 503 and error.code == "shutting_down"
        health = httpx.get(server.url + "/health", timeout=TIMEOUT_S)
        assert health.status_code == 503
        assert json.loads(health.text)["error"]["code"] == "shutting_down"
    finally:
        drain.draining = False
    assert client(server).completions.create(model="tiny-code", prompt="x", max_tokens=1)


def test_a_full_queue_answers_429_to_the_openai_client():
    busy = Server(make_engine(max_batch=1, max_queue=1))
    try:
        waiting = threading.Thread(
            target=httpx.post,
            args=(busy.url + "/v1/completions",),
            kwargs={"json": {"prompt": "x", "max_tokens": 2}, "timeout": TIMEOUT_S},
        )
        with httpx.stream(
            "POST", busy.url + "/v1/completions", json=LONG_STREAM, timeout=TIMEOUT_S
        ) as stream:
            lines = stream.iter_lines()  # kept: a closed iterator closes the stream
            assert next(line for line in lines if line.startswith("data: "))
            waiting.start()
            deadline = time.monotonic() + TIMEOUT_S
            while busy.metric("vllm:num_requests_waiting") < 1:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            error = refusal(
                lambda: client(busy, "unused").completions.create(
                    model="tiny-code", prompt="x", max_tokens=1
                )
            )
        assert isinstance(error, openai.RateLimitError) and error.code == "queue_full"
        waiting.join(TIMEOUT_S)
    finally:
        busy.close()
