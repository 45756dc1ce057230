"""The loopback server the serving tests share: uvicorn on a thread over an engine, the
chat template and prompts they send, and the bound on every wait."""

import json
import threading
import time

import httpx
import torch
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from specdec_fast import generate
from specdec_fast.loading import load_model, load_tokenizer
from specdec_fast.serving.engine_process import ProcessEngine
from specdec_fast.serving.server import REQUEST_ID_HEADER, create_app
from specdec_fast.serving.service import Service
from specdec_fast.text import decode, encode_prompt, stop_token_ids

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
TIMEOUT_S = 60.0
PROMPTS = [
    "def reverse(s):\n",
    "import os\n\n\ndef main():\n",
    "class Stack:\n    def __init__(self):\n",
    "for i in range(10):\n",
]


class Server:
    """uvicorn serving `engine` on a free loopback port, on a thread of its own (`app_options`:
    `create_app`'s keyword arguments)."""

    def __init__(self, engine: Service | ProcessEngine, **app_options):
        self.app = create_app(engine, **app_options)
        config = uvicorn.Config(
            self.app, host="127.0.0.1", port=0, log_level="warning", lifespan="on"
        )
        self.engine = engine
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + TIMEOUT_S
        while not self.server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(TIMEOUT_S)
        assert not self.thread.is_alive()

    def metric(self, name: str, **labels) -> float:
        return metric(self.url, name, **labels)

    def decode_steps(self) -> dict[int, float]:
        """The server's decode steps so far, by batch size."""
        text = httpx.get(self.url + "/metrics", timeout=TIMEOUT_S).text
        return {
            int(sample.labels["batch"]): sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == "specdec_decode_steps_total"
        }


LONG_STREAM = {"prompt": PROMPTS[0], "max_tokens": 2000, "ignore_eos": True, "stream": True}


def overload(server: Server) -> httpx.Response:
    """On a server of one slot and one queue place: a long stream holds the slot, a second
    request (PROMPTS[1], 8 greedy tokens) waits, a third is refused with a 429 in OpenAI's
    shape, the client's request id echoed; then the stream's client disconnects, long before
    its 2000 tokens, and the waiting request is served at once. Returns its response."""
    waiting: dict = {}

    def second():
        waiting["reply"] = httpx.post(
            server.url + "/v1/completions",
            json={"prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0},
            timeout=TIMEOUT_S,
        )

    with httpx.Client(timeout=TIMEOUT_S) as client:
        with client.stream("POST", server.url + "/v1/completions", json=LONG_STREAM) as stream:
            lines = stream.iter_lines()  # kept: a closed iterator closes the stream
            assert next(line for line in lines if line.startswith("data: "))
            thread = threading.Thread(target=second)
            thread.start()
            deadline = time.monotonic() + TIMEOUT_S
            while server.metric("vllm:num_requests_waiting") < 1:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            refused = client.post(
                server.url + "/v1/completions",
                json={"prompt": "x"},
                headers={REQUEST_ID_HEADER: "refused-1"},
            )
            assert refused.status_code == 429
            assert refused.json()["error"]["code"] == "queue_full"
            assert refused.headers[REQUEST_ID_HEADER] == "refused-1"  # the client's own
        started = time.monotonic()
        thread.join(TIMEOUT_S)
    assert time.monotonic() - started < TIMEOUT_S / 2
    assert waiting["reply"].status_code == 200
    return waiting["reply"]


def metric(url: str, name: str, **labels) -> float:
    """The sum of the /metrics samples of `name` with these labels (0.0 when absent) of the
    server at `url`."""
    text = httpx.get(url + "/metrics", timeout=TIMEOUT_S).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            head, value = line.rsplit(" ", 1)
            if all(f'{key}="{val}"' in head for key, val in labels.items()):
                total += float(value)
    return total


def cut_at_stop_strings(url: str, expected: str, **body) -> None:
    """A greedy request (`body`) whose output (`expected`) has a newline, with the stop string
    "\\n", non-streamed then streamed: each response is the text before the newline and ends
    with finish_reason "stop", and so do the server's counters (`vllm:request_success_total`),
    though the server cancels the request in its scheduler, no client's "abort"."""
    cut = expected[: expected.index("\n")]
    body = {"max_tokens": 200, "temperature": 0, **body, "stop": ["\n"]}

    def ended() -> dict[str, float]:
        success = "vllm:request_success_total"
        return {r: metric(url, success, finished_reason=r) for r in ("stop", "abort")}

    before = ended()
    with httpx.Client(timeout=TIMEOUT_S) as client:
        reply = client.post(url + "/v1/completions", json=body).json()
        assert reply["choices"][0]["text"] == cut
        assert reply["choices"][0]["finish_reason"] == "stop"
        streamed = {**body, "stream": True}
        with client.stream("POST", url + "/v1/completions", json=streamed) as stream:
            data = [line.removeprefix("data: ") for line in stream.iter_lines() if line]
    assert data[-1] == "[DONE]"
    choices = [json.loads(event)["choices"][0] for event in data[:-1]]
    assert "".join(c["text"] for c in choices) == cut and choices[-1]["finish_reason"] == "stop"
    deadline = time.monotonic() + TIMEOUT_S
    while ended()["stop"] < before["stop"] + 2:
        assert time.monotonic() < deadline, (before, ended())
        time.sleep(0.05)
    assert ended() == {"stop": before["stop"] + 2, "abort": before["abort"]}


def greedy_reference():
    """`generate()` greedy on another copy of the model: the text a request must get."""
    model = load_model("tiny-code", torch.device("cpu"))
    tokenizer = load_tokenizer("tiny-code")
    tokenizer.chat_template = TEMPLATE
    stops = stop_token_ids(model, tokenizer)

    def complete(prompt=None, messages=None, max_tokens=16) -> tuple[str, int]:
        ids = encode_prompt(tokenizer, prompt, messages, chat=messages is not None)
        out = generate(model, [ids], drafter=None, max_new_tokens=max_tokens, eos_token_id=stops)
        tokens = out.sequences[0][len(ids) :].tolist()
        return decode(tokenizer, tokens), len(tokens)

    return complete
