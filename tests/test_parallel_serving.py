"""`specdec-fast serve --tensor-parallel 2` (issue 49, `specdec_fast.serving.lockstep`): a real
server process, launched as the command line launches it (through torch.distributed.run), whose
two gloo ranks each hold half of the bundled tiny-code target's heads, answered by the official
`openai` client. Its outputs are single-process `generate`'s: greedy on the plain, n-gram and
draft-model routes (sent at once, so that rows join and leave one batch), sampled with a seed,
and streamed; a stream left midway is cancelled on every rank. SIGTERM to the command stops
every rank and it exits 0 (ranks whose served requests disagree raise: tests/test_parallel.py
checks it in its own launch).

Every wait is bounded: the server's start, each request (the client's timeout), the shutdown.
"""

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import torch
from loopback import cut_at_stop_strings
from tensor_parallel_ranks import free_port

from specdec_fast import bundled, generate
from specdec_fast.drafters.registry import DrafterSpec
from specdec_fast.loading import load_model, load_tokenizer
from specdec_fast.text import decode, encode_prompt, stop_token_ids

pytestmark = pytest.mark.skipif(
    "tiny-code" not in bundled.available(), reason="the bundled checkpoints are not installed"
)
WORLD = 2
NEW_TOKENS = 8
PROMPT = "def fib(n):"
# The route's name (the request's `model`) -> its drafter SPEC.
ROUTES = {"plain": "none", "tiny-code": "ngram:8", "draft": "draft:tiny-code-draft:4"}
SAMPLED = {"temperature": 0.8, "top_p": 0.9, "seed": 7}
START_S = 90.0
TIMEOUT_S = 60.0


def descendants(pid: int) -> list[int]:
    """The processes `pid` started, theirs, and so on (Linux's /proc)."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        for child in (task / "children").read_text().split():
            found += [int(child), *descendants(int(child))]
    return found


def alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status  # a zombie has exited


class TensorParallelServer:
    """`specdec-fast serve --tensor-parallel 2` in a session of its own (as a terminal or a
    service manager would start it), its output in `log`."""

    def __init__(self, folder: Path):
        routes = folder / "routes.yaml"
        routes.write_text(f"routes:\n  draft:\n    drafter: {ROUTES['draft']}\n")
        self.url = f"http://127.0.0.1:{free_port()}"
        argv = [sys.executable, "-m", "specdec_fast", "serve", "--tensor-parallel", str(WORLD)]
        argv += ["--model", "tiny-code", "--drafter", ROUTES["tiny-code"], "--routes", str(routes)]
        argv += ["--port", self.url.rsplit(":", 1)[1], "--threads", "1", "--drain-timeout", "5"]
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
        self.log = folder / "log"
        with self.log.open("w") as log:
            self.process = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self.processes: list[int] = []  # the launcher, the ranks and rank 0's engine process

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_S
        while True:
            assert self.process.poll() is None, self.log.read_text()
            assert time.monotonic() < deadline, self.log.read_text()
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.processes = descendants(self.process.pid)

    def kill(self) -> None:
        """End whatever is left, at once (a failed test's cleanup)."""
        for pid in [self.process.pid, *descendants(self.process.pid), *self.processes]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        self.process.wait()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = TensorParallelServer(tmp_path_factory.mktemp("serve"))
    try:
        server.wait_ready()
        yield server
    finally:
        server.kill()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def reference():
    """One process's `generate` on the whole model: the text a request must get."""
    model = load_model("tiny-code", torch.device("cpu"))
    tokenizer = load_tokenizer("tiny-code")
    ids = encode_prompt(tokenizer, PROMPT, chat=False)

    def complete(spec: str, **sampling) -> str:
        drafter = DrafterSpec.parse(spec).build(model)
        out = generate(
            model,
            [ids],
            drafter=drafter,
            max_new_tokens=NEW_TOKENS,
            eos_token_id=stop_token_ids(model, tokenizer),
            **sampling,
        )
        return decode(tokenizer, out.sequences[0][len(ids) :].tolist())

    return complete


def counter(server, family: str, *labels: str) -> float:
    """Rank 0's `family` counter of the series carrying every label in `labels`
    (`route="draft"`); 0 when no series has them."""
    metrics = httpx.get(server.url + "/metrics", timeout=TIMEOUT_S).text
    for line in metrics.splitlines():
        if line.startswith(family + "{") and all(label in line for label in labels):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_greedy_outputs_of_every_route_are_one_process_generates(server, client, reference):
    def ask(route: str) -> str:
        reply = client.completions.create(
            model=route, prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0
        )
        return reply.choices[0].text

    with ThreadPoolExecutor(len(ROUTES)) as pool:  # rows join and leave one batch
        served = dict(zip(ROUTES, pool.map(ask, ROUTES), strict=True))
    for route, spec in ROUTES.items():
        assert served[route] == reference(spec), route
    # The drafters drafted (rank 0's metrics): the routes speculated, not decoded plainly.
    for route in ("default", "draft"):  # `tiny-code`, the model's name, is the default route
        drafts = counter(server, "vllm:spec_decode_num_draft_tokens_total", f'route="{route}"')
        assert drafts > 0, route


def test_a_stop_strings_end_is_a_stop_on_every_rank(server):
    """Rank 0's server cancels a request at its stop string, and the plan carries the reason to
    every rank: the responses and the counters say "stop"."""
    model = load_model("tiny-code", torch.device("cpu"))
    tokenizer = load_tokenizer("tiny-code")
    prompt = PROMPT + "\n    "  # its greedy answer is a comment line, then a newline
    ids = encode_prompt(tokenizer, prompt, chat=False)
    out = generate(model, [ids], drafter=None, max_new_tokens=24, eos_token_id=[], compile=False)
    expected = decode(tokenizer, out.sequences[0][len(ids) :].tolist())
    cut_at_stop_strings(server.url, expected, prompt=prompt, model="draft")


def test_a_seeded_sampled_request_draws_what_one_process_draws(client, reference):
    reply = client.completions.create(
        model="tiny-code", prompt=PROMPT, max_tokens=NEW_TOKENS, **SAMPLED
    )
    assert reply.choices[0].text == reference(ROUTES["tiny-code"], **SAMPLED)


def test_a_stream_carries_the_greedy_output(client, reference):
    stream = client.completions.create(
        model="draft", prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0, stream=True
    )
    chunks = [chunk.choices[0] for chunk in stream]
    assert len(chunks) > 2 and chunks[-1].finish_reason == "length"
    assert "".join(chunk.text for chunk in chunks) == reference(ROUTES["draft"])


def test_a_stream_left_midway_is_cancelled_on_every_rank(server, client, reference):
    """A client that leaves a long stream after two chunks: rank 0's plan cancels the request
    on every rank (each drops the row at the same step), and the ranks go on serving the next
    request in agreement (a rank whose finished requests differed would raise and stop them)."""
    labels = ('route="draft"', 'finished_reason="abort"')
    before = counter(server, "vllm:request_success_total", *labels)
    stream = client.completions.create(
        model="draft", prompt=PROMPT, max_tokens=400, temperature=0, stream=True
    )
    taken = [chunk for _, chunk in zip(range(2), stream, strict=False)]
    stream.close()
    assert len(taken) == 2 and taken[-1].choices[0].finish_reason is None
    deadline = time.monotonic() + TIMEOUT_S
    while counter(server, "vllm:request_success_total", *labels) < before + 1:
        assert time.monotonic() < deadline, "the cancelled stream never ended"
        time.sleep(0.2)
    reply = client.completions.create(
        model="draft", prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0
    )
    assert reply.choices[0].text == reference(ROUTES["draft"])


def test_sigterm_to_the_command_stops_every_rank_and_exits_0(server):
    assert len(server.processes) >= 1 + WORLD  # the launcher and its ranks, at least
    server.process.send_signal(signal.SIGTERM)
    code = server.process.wait(TIMEOUT_S)
    log = server.log.read_text()
    assert code == 0, log
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in server.processes):
        assert time.monotonic() < deadline, [pid for pid in server.processes if alive(pid)]
        time.sleep(0.1)
    assert "draining" in log and "Application shutdown complete" in log
    assert "forcefully" not in log  # torch.distributed.run killed no rank
    assert "terminate called" not in log  # no rank aborted in its teardown
