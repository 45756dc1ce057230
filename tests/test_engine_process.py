"""`ProcessEngine`: `specdec-fast serve`'s engine in a child process, on loopback.

The servers run uvicorn on a thread over an engine spawned as a child process (the bundled
tiny-code target, one torch thread). Outputs are checked against `generate()` greedy on a copy
of the model in this process; refusals, cancellation and the child's death against what the
in-process engine does (tests/test_serving.py). Every wait is bounded.
"""

import asyncio
import os
import signal
import time

import httpx
import openai
import pytest
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
from specdec_fast.serving import server as server_module
from specdec_fast.serving.engine_process import EngineConfig, ProcessEngine
from specdec_fast.serving.routes import RouteConfig, server_routes

pytestmark = pytest.mark.skipif(
    "tiny-code" not in bundled.available(), reason="the bundled checkpoints are not installed"
)


def engine(routes, **options) -> ProcessEngine:
    options = {"model_name": "tiny-code", "chat_template": TEMPLATE, **options}
    return ProcessEngine(EngineConfig("tiny-code", routes, threads=1, engine=options))


@pytest.fixture(scope="module")
def server():
    routes = server_routes("ngram:8", [RouteConfig("shadowed", "ngram:8", mode="shadow")])
    running = Server(engine(routes, max_batch=16))
    yield running
    running.close()


@pytest.fixture(scope="module")
def reference():
    complete = greedy_reference()
    return lambda *args, **kwargs: complete(*args, **kwargs)[0]


def test_the_child_serves_concurrent_streams_equal_to_generate(server, reference):
    async def run():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)

        async def one(i):
            prompt = PROMPTS[i % len(PROMPTS)] + "#" * (i // len(PROMPTS))
            if i % 2:
                reply = await client.completions.create(
                    model="tiny-code", prompt=prompt, max_tokens=10 + i, temperature=0
                )
                return reply.choices[0].text
            stream = await client.completions.create(
                model="tiny-code", prompt=prompt, max_tokens=10 + i, temperature=0, stream=True
            )
            return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])

        return await asyncio.gather(*(one(i) for i in range(12)))

    texts = asyncio.run(run())
    for i, text in enumerate(texts):
        assert text == reference(
            PROMPTS[i % len(PROMPTS)] + "#" * (i // len(PROMPTS)), None, 10 + i
        )
    # The metrics are the child's: its decode steps shared batches, its drafter accepted.
    steps = server.decode_steps()
    assert any(count > 0 for batch, count in steps.items() if batch >= 6)
    assert server.metric("vllm:spec_decode_num_accepted_tokens_total", route="default") > 0
    assert server.metric("vllm:request_success_total", route="default") >= 12


def test_a_stop_strings_end_crosses_the_pipe_as_a_stop(server, reference):
    """The server's cancellation at a stop string reaches the child with its reason. On a shadow
    route the served request's end cancels its copy, and the pair compares nothing (the served
    tokens stop short of the copy's)."""
    cut_at_stop_strings(
        server.url, reference(PROMPTS[1], None, 24), prompt=PROMPTS[1], model="shadowed"
    )
    assert server.metric("specdec_shadow_mismatches_total", route="shadowed") == 0.0


def test_chat_models_routes_and_shadow_copies_cross_the_pipe(server, reference):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Write a function that adds two numbers."}]
    reply = client.chat.completions.create(
        model="shadowed", messages=messages, max_tokens=16, temperature=0, timeout=TIMEOUT_S
    )
    assert reply.choices[0].message.content == reference(messages=messages)
    assert {"tiny-code", "default", "plain", "shadowed"} <= {m.id for m in client.models.list()}
    deadline = time.monotonic() + TIMEOUT_S
    while server.metric("specdec_shadow_requests_total", route="shadowed") < 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert server.metric("specdec_shadow_mismatches_total", route="shadowed") == 0.0
    unknown = httpx.post(
        server.url + "/v1/completions", json={"model": "nope", "prompt": "x"}, timeout=TIMEOUT_S
    )
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "model"
    over = httpx.post(
        server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 5000}, timeout=TIMEOUT_S
    )
    assert over.status_code == 400 and over.json()["error"]["param"] == "max_tokens"


def test_refusals_disconnects_and_the_childs_death(reference):
    """One slot, one queue place, in the child: a stream holds the slot, a second request
    waits, a third gets the child's 429; the stream's disconnect admits the waiting one. Then
    the child is killed mid-stream: the stream ends with an error, /health, /metrics and new
    requests get 503s."""
    small = Server(engine(server_routes("none", []), max_batch=1, max_queue=1))
    try:
        served = overload(small)
        assert served.json()["choices"][0]["text"] == reference(PROMPTS[1], None, 8)
        assert small.metric("vllm:request_success_total", finished_reason="abort") == 1.0
        assert small.metric("specdec_requests_rejected_total", reason="queue_full") == 1.0

        with (
            httpx.Client(timeout=TIMEOUT_S) as client,
            client.stream("POST", small.url + "/v1/completions", json=LONG_STREAM) as stream,
        ):
            lines = (line for line in stream.iter_lines() if line.startswith("data: "))
            assert next(lines)
            os.kill(small.engine.process.pid, signal.SIGKILL)
            rest = list(lines)
        assert '"type": "server_error"' in rest[-2] and "engine process" in rest[-2]
        assert rest[-1] == "data: [DONE]"
        assert httpx.get(small.url + "/health", timeout=TIMEOUT_S).status_code == 503
        assert httpx.get(small.url + "/metrics", timeout=TIMEOUT_S).status_code == 503
        stopped = httpx.post(small.url + "/v1/completions", json=LONG_STREAM, timeout=TIMEOUT_S)
        assert stopped.status_code == 503 and stopped.json()["error"]["code"] == "stopped"
    finally:
        small.close()


def test_a_child_that_cannot_start_says_why():
    broken = ProcessEngine(EngineConfig("tiny-code", server_routes("none", []), device="nodev"))
    with pytest.raises(RuntimeError, match="failed to start(.|\n)*nodev"):
        broken.start()
    assert broken.stopped is not None


def test_serve_puts_its_engine_in_a_child_by_default(monkeypatch, tmp_path):
    template = tmp_path / "template.jinja"
    template.write_text(TEMPLATE)
    started = {}
    monkeypatch.setattr(server_module, "run_server", lambda app, *args: started.update(app=app))
    argv = ["serve", "--drafter", "suffix:8", "--shadow", "--threads", "1", "--max-batch", "3"]
    assert main([*argv, "--chat-template", str(template), "--served-model-name", "coder"]) == 0
    engine = started["app"].state.engine
    assert isinstance(engine, ProcessEngine) and engine.process is None  # started by the app
    config = engine.config
    assert config.model == "tiny-code" and config.threads == 1
    assert config.engine["max_batch"] == 3 and config.engine["model_name"] == "coder"
    assert {route.name: route.mode for route in config.routes}["default"] == "shadow"
    assert engine.router.resolve("coder", None) == "default"
    assert engine.tokenizer.chat_template == TEMPLATE
