"""Graceful shutdown: a signal drains the server, cancels what outlasts the deadline, exits 0.

A real `specdec-fast serve` process (started through bench/bench_soak.py's `ServerProcess`) and
its engine process are sent SIGTERM, as a service manager sends it to every process of a
service, while two long streams and a short one run: new requests get a 503 at once, the
short stream finishes normally, the long ones end at the deadline with `finish_reason` "abort",
their last chunk and `[DONE]`, and the process exits with code 0. In this process, the same drain
(`GracefulServer.handle_exit`, which the signal calls) restores the model's attention. Every wait
is bounded.
"""

import asyncio
import json
import signal
import threading
import time

import httpx
import openai
import pytest
import torch
import uvicorn
from bench_smoke import import_bench
from loopback import PROMPTS, TIMEOUT_S

from specdec_fast import bundled
from specdec_fast.loading import load_model, load_tokenizer
from specdec_fast.serving.routes import server_routes
from specdec_fast.serving.server import create_app
from specdec_fast.serving.service import Service
from specdec_fast.serving.shutdown import Drain, GracefulServer

pytestmark = pytest.mark.skipif(
    "tiny-code" not in bundled.available(), reason="the bundled checkpoints are not installed"
)
DEADLINE_S = 4.0
LONG = {"model": "tiny-code", "max_tokens": 2000, "ignore_eos": True, "stream": True}


def stream_lines(url: str, body: dict, first: threading.Event, out: dict, name: str) -> None:
    """Read a streamed completion's lines into out[name] (set `first` at its first chunk)."""
    lines = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=TIMEOUT_S) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line:
                lines.append(line)
                first.set()
    out[name] = lines


def start_streams(url: str) -> tuple[dict, list[threading.Thread]]:
    """Two long streams and a short one, each past its first chunk."""
    out, threads = {}, []
    bodies = {
        "long-0": {**LONG, "prompt": PROMPTS[0]},
        "long-1": {**LONG, "prompt": PROMPTS[1]},
        "short": {**LONG, "prompt": PROMPTS[2], "max_tokens": 24},
    }
    for name, body in bodies.items():
        first = threading.Event()
        thread = threading.Thread(target=stream_lines, args=(url, body, first, out, name))
        thread.start()
        assert first.wait(TIMEOUT_S), name
        threads.append(thread)
    return out, threads


def finish_reason(lines: list[str]) -> str:
    """The finish reason of a stream's lines, which must end with `[DONE]`."""
    assert lines[-1] == "data: [DONE]", lines[-3:]
    chunks = [json.loads(line[len("data: ") :]) for line in lines[:-1]]
    reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert all(r is None for r in reasons[:-1])
    return reasons[-1]


def test_sigterm_to_a_real_server_drains_cancels_and_exits_0(monkeypatch, tmp_path):
    soak = import_bench(monkeypatch, "bench_soak")
    args = soak.serve_args(tmp_path, max_batch=4, max_queue=4, context_len=2048)
    server = soak.ServerProcess([*args, "--drain-timeout", str(DEADLINE_S)], tmp_path / "log")
    server.wait_ready()
    try:
        out, threads = start_streams(server.url)
        signalled = time.monotonic()
        server.send(signal.SIGTERM)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.InternalServerError) as refused:
            deadline = time.monotonic() + DEADLINE_S
            while time.monotonic() < deadline:  # the signal is handled between two bytecodes
                client.completions.create(model="tiny-code", prompt="x", max_tokens=1)
                time.sleep(0.05)
        assert refused.value.status_code == 503 and refused.value.code == "shutting_down"
        assert set(refused.value.body) == {"message", "type", "param", "code"}
        assert httpx.get(server.url + "/health", timeout=TIMEOUT_S).status_code == 503
        for thread in threads:
            thread.join(TIMEOUT_S)
            assert not thread.is_alive()
        ended = time.monotonic() - signalled
    finally:
        code = server.stop(signal.SIGTERM, timeout=TIMEOUT_S)
    assert code == 0, (tmp_path / "log").read_text()
    assert finish_reason(out["short"]) == "length"
    assert finish_reason(out["long-0"]) == finish_reason(out["long-1"]) == "abort"
    assert DEADLINE_S <= ended < DEADLINE_S + 20
    log = (tmp_path / "log").read_text()
    assert "draining: 3 requests in flight" in log and "cancelled 2 requests" in log


def test_a_drain_ends_the_engine_and_restores_the_model():
    model = load_model("tiny-code", torch.device("cpu"))
    original = model.config._attn_implementation
    routes = server_routes("ngram:8", [])
    engine = Service(model, load_tokenizer("tiny-code"), routes, model_name="tiny-code")
    drain = Drain(deadline_s=0.5)
    app = create_app(engine, drain=drain)
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning")
    server = GracefulServer(config, drain)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + TIMEOUT_S
    while not server.started:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    first, out = threading.Event(), {}
    reader = threading.Thread(
        target=stream_lines, args=(url, {**LONG, "prompt": PROMPTS[0]}, first, out, "long")
    )
    reader.start()
    assert first.wait(TIMEOUT_S)
    assert model.config._attn_implementation != original  # the engine drives it
    server.handle_exit(signal.SIGTERM, None)
    reader.join(TIMEOUT_S)
    thread.join(TIMEOUT_S)
    assert not thread.is_alive() and not reader.is_alive()
    assert finish_reason(out["long"]) == "abort" and drain.cancelled == 1
    assert not engine.scheduler.alive
    assert model.config._attn_implementation == original


def test_a_request_accepted_after_the_deadline_is_cancelled_too():
    """A request on its way to the engine when the drain starts (`admitting`) is waited for,
    and cancelled once accepted, even after the deadline; the drain ends when it completes."""

    class Handle:
        cancels = 0

        def cancel(self):
            self.cancels += 1

    async def scenario():
        drain = Drain(deadline_s=0.1)
        drain.admitting = 1
        running = asyncio.ensure_future(drain.run())
        await asyncio.sleep(0.3)  # past the deadline, still submitting
        assert not running.done()
        handle = Handle()
        key = drain.track(handle)
        drain.admitting = 0
        await asyncio.sleep(0.2)
        assert handle.cancels == 1 and not running.done()  # cancelled once, awaited
        drain.release(key)  # its completion arrives
        await asyncio.wait_for(running, TIMEOUT_S)
        return drain.cancelled

    assert asyncio.run(scenario()) == 1
