"""Soak: a real `specdec-fast serve` process under mixed traffic and faults, then the books.

    python bench/bench_soak.py --requests 10000 --concurrency 8 --out bench/results/soak.json

starts the server (the bundled tiny-code target, its engine in a child process, steps not
compiled) as a process of its own, with three routes: `default` (n-gram), `plain` and `flaky`
(an n-gram drafter that raises on every FLAKY_EVERY-th step, its guardrail re-probing after a
few steps), a small context (`--max-model-len`) that requests fill, and small queues. The
official openai client (asyncio, `--concurrency` at once) then sends a seeded mix: completions
and chats, streamed and not, greedy on every route and sampled, streams whose client disconnects
after the first chunk, malformed JSON, oversized bodies, and requests over the context. Then:

- every request ended one way: a complete answer, a refusal (400, 413, 429) or, for the
  disconnects, nothing; no answer twice (unique response ids, each request's `X-Request-Id`
  echoed on its own answer);
- every greedy answer equals `generate()`'s on a copy of the model in this process (a misdelivered
  answer would not);
- the server's Prometheus counters add up to what the clients saw: ended requests per route and
  finish reason (disconnects as "abort"), completion tokens, refusals;
- the server's resident memory (the server and its engine process) after the run is within
  `RSS_GROWTH_LIMIT` of what it was after the warm-up;
- SIGINT to its process group (Ctrl-C) ends it with code 0.

`run_soak` returns the figures and the failures; tests/test_server_soak.py runs a short one.
`python bench/bench_soak.py serve ARGS` is how the server is started: the flaky drafter is
registered in that process and in its engine process (which re-runs this file as its main).
`ServerProcess` starts and stops such a server (tests/test_server_shutdown.py signals one).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

HERE = Path(__file__).resolve()
FLAKY_EVERY = 5  # the flaky drafter raises on every 5th step it drafts
RSS_GROWTH_LIMIT = 0.10
CONTEXT_LEN = 96
FILL_LEN = CONTEXT_LEN * 3 // 4  # a `fill` request's prompt tokens; it asks for the rest
START_TIMEOUT_S = 180.0
REQUEST_TIMEOUT_S = 120.0
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
GUARDRAILS = """
speculative_decoding_guardrails:
  max_tpot_p95_regression: 100.0
  min_acceptance_rate: 0.0
  routes:
    flaky: {window_steps: 2, min_window_steps: 1, cooldown_steps: 3}
"""
ROUTES = "routes:\n  flaky: {drafter: 'flaky:8'}\n"
PROMPTS = [
    "def reverse(s):\n",
    "import os\n\n\ndef main():\n",
    "class Stack:\n    def __init__(self):\n",
    "for i in range(10):\n",
    "def fib(n):\n    if n < 2:\n",
    "# sort a list of numbers\n",
    "with open(path) as f:\n",
    "try:\n    value = int(text)\n",
]
MAX_TOKENS = (6, 12)
MODELS = ("tiny-code", "plain", "flaky")
KINDS = (
    ("complete", 6),
    ("stream", 5),
    ("chat", 3),
    ("chat_stream", 2),
    ("sampled", 2),
    ("fill", 1),
    ("disconnect", 2),
    ("malformed", 1),
    ("oversized", 1),
    ("over_context", 1),
)


# -- the server ----------------------------------------------------------------------------------


def register_flaky() -> None:
    """Add the `flaky` drafter kind (n-gram, raising on every FLAKY_EVERY-th step) to the
    registry of this process."""
    from specdec_fast.drafters.ngram import NGramDrafter
    from specdec_fast.drafters.registry import REGISTRY, DrafterKind

    class FlakyDrafter(NGramDrafter):
        def __init__(self, max_nodes: int):
            super().__init__(max_nodes=max_nodes)
            self.calls = 0

        def propose(self, state):
            self.calls += 1
            if self.calls % FLAKY_EVERY == 0:
                raise RuntimeError(f"flaky drafter: injected fault at step {self.calls}")
            return super().propose(state)

    REGISTRY["flaky"] = DrafterKind(
        "flaky", "n-gram raising on some steps (the soak's fault)", 8, lambda _, n: FlakyDrafter(n)
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rss_bytes(pid: int) -> int:
    """Resident memory of `pid` and its children (the engine process), from /proc."""
    total = 0
    pids = [pid]
    children = Path(f"/proc/{pid}/task/{pid}/children")
    if children.exists():
        pids += [int(p) for p in children.read_text().split()]
    for p in pids:
        status = Path(f"/proc/{p}/status")
        if status.exists():
            for line in status.read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
    return total


class ServerProcess:
    """`specdec-fast serve` (through this file, with `flaky` registered) as a process of its own
    on a free loopback port, started at once (`wait_ready()` waits for it to serve); `stop(sig)`
    signals it and returns its exit code (bounded).

    args: more `serve` arguments. log: the file its stderr goes to.
    """

    def __init__(self, args: list[str], log: Path, nice: int = 0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        argv = [sys.executable, str(HERE), "serve", "--port", str(self.port), *args]
        if nice:
            argv = ["nice", "-n", str(nice), *argv]
        env = {**os.environ, "SPECDEC_COMPILE": "0", "OMP_NUM_THREADS": "1"}
        self._stderr = log.open("w")
        # A session of its own: a signal reaches the server and its engine process, as Ctrl-C
        # (the terminal's process group) or a service manager (every process) sends it.
        self.process = subprocess.Popen(
            argv, stdout=subprocess.DEVNULL, stderr=self._stderr, env=env, start_new_session=True
        )

    def wait_ready(self) -> ServerProcess:
        """Wait (bounded) until /health answers 200; raise with the server's log if it exits
        or does not."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited while starting:\n{self.log.read_text()}")
            if time.monotonic() > deadline:
                self.process.kill()
                raise RuntimeError(f"the server did not start:\n{self.log.read_text()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)

    @property
    def pid(self) -> int:
        return self.process.pid

    def rss(self) -> int:
        return rss_bytes(self.pid)

    def send(self, sig: int) -> None:
        """Send `sig` to the server's process group (the server and its engine process)."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, sig)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        """Signal the server's process group; its exit code (it is killed, and the code
        negative, past `timeout`)."""
        self.send(sig)
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            code = self.process.wait()
        self._stderr.close()
        return code

    def metrics(self) -> dict[tuple[str, tuple], float]:
        """The /metrics samples, by name and sorted labels."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(self.url + "/metrics", timeout=30).text
        return {
            (sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        }


def serve_args(
    folder: Path, max_batch: int, max_queue: int, context_len: int = CONTEXT_LEN
) -> list[str]:
    """The soak server's `serve` arguments (its route and guardrail files written to
    `folder`)."""
    routes, guardrails, template = (
        folder / "routes.yaml",
        folder / "guardrails.yaml",
        folder / "t.jinja",
    )
    routes.write_text(ROUTES)
    guardrails.write_text(GUARDRAILS)
    template.write_text(TEMPLATE)
    return [
        "--model",
        "tiny-code",
        "--served-model-name",
        "tiny-code",
        "--drafter",
        "ngram:8",
        "--routes",
        str(routes),
        "--guardrails",
        str(guardrails),
        "--chat-template",
        str(template),
        "--max-model-len",
        str(context_len),
        "--max-batch",
        str(max_batch),
        "--max-queue",
        str(max_queue),
        "--max-body-bytes",
        "8192",
        "--threads",
        "1",
        "--log-level",
        "warning",
    ]


# -- the traffic ---------------------------------------------------------------------------------


@dataclass
class Planned:
    """One request of the plan: `kind` (KINDS), the prompt's index, `max_tokens`, `model`."""

    index: int
    kind: str
    prompt: int
    max_tokens: int
    model: str


@dataclass
class Outcome:
    """What the client saw: `status` (200, or the refusal's), the text, finish reason and
    completion tokens of a complete answer, the response id, whether the request id came back,
    and `error` for anything unexpected."""

    index: int
    kind: str
    model: str
    status: int | None = None
    text: str | None = None
    finish_reason: str | None = None
    completion_tokens: int | None = None
    response_id: str | None = None
    echoed: bool = True
    error: str | None = None
    extra: dict = field(default_factory=dict)


def plan(requests: int, seed: int) -> list[Planned]:
    rng = random.Random(seed)
    kinds = [kind for kind, weight in KINDS for _ in range(weight)]
    return [
        Planned(
            i,
            rng.choice(kinds),
            rng.randrange(len(PROMPTS)),
            rng.choice(MAX_TOKENS),
            rng.choice(MODELS),
        )
        for i in range(requests)
    ]


def fill_prompt(prompt_ids: list[int]) -> list[int]:
    """A token prompt of FILL_LEN tokens (the prompt's ids repeated); with `max_tokens` =
    CONTEXT_LEN - FILL_LEN and `ignore_eos` it fills the context."""
    return (prompt_ids * (FILL_LEN // len(prompt_ids) + 1))[:FILL_LEN]


async def send_one(client, http: httpx.AsyncClient, url: str, item: Planned, ids) -> Outcome:
    """Send one planned request; never raises (what went wrong is in the outcome)."""
    import openai

    out = Outcome(item.index, item.kind, item.model)
    headers = {"X-Request-Id": f"soak-{item.index}"}
    prompt = PROMPTS[item.prompt]
    common = {"model": item.model, "max_tokens": item.max_tokens, "extra_headers": headers}
    try:
        if item.kind in ("malformed", "oversized"):
            body = b'{"prompt": "x", ' if item.kind == "malformed" else b"{" + b" " * 9000 + b"}"
            reply = await http.post(
                url + "/v1/completions",
                content=body,
                headers={**headers, "Content-Type": "application/json"},
            )
            out.status = reply.status_code
            out.echoed = reply.headers.get("X-Request-Id") == headers["X-Request-Id"]
            error = reply.json()["error"]
            out.extra["code"] = error["code"]
            out.extra["openai_shape"] = set(error) == ERROR_FIELDS
            return out
        if item.kind == "over_context":
            await client.completions.create(
                prompt=ids[item.prompt], **{**common, "max_tokens": CONTEXT_LEN}, temperature=0
            )
            out.status = 200
            return out
        if item.kind == "fill":
            filled = fill_prompt(ids[item.prompt])
            raw = await client.completions.with_raw_response.create(
                prompt=filled,
                **{**common, "max_tokens": CONTEXT_LEN - FILL_LEN},
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            return _whole(out, raw, headers)
        if item.kind == "disconnect":
            stream = await client.completions.create(
                prompt=prompt,
                **{**common, "max_tokens": CONTEXT_LEN - len(ids[item.prompt])},
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            async for _ in stream:
                break
            await stream.close()
            out.status = 200
            return out
        chat = item.kind.startswith("chat")
        stream = item.kind.endswith("stream")
        sampling = (
            {"temperature": 0.8, "seed": item.index}
            if item.kind == "sampled"
            else {"temperature": 0}
        )
        api = client.chat.completions if chat else client.completions
        content = (
            {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
        )
        raw = await api.with_raw_response.create(**content, **common, **sampling, stream=stream)
        if not stream:
            return _whole(out, raw, headers, chat)
        out.status = raw.http_response.status_code
        out.echoed = raw.headers.get("X-Request-Id") == headers["X-Request-Id"]
        parts, ids_seen = [], set()
        async for chunk in raw.parse():
            ids_seen.add(chunk.id)
            if chunk.choices:
                choice = chunk.choices[0]
                parts.append((choice.delta.content if chat else choice.text) or "")
                out.finish_reason = choice.finish_reason or out.finish_reason
        out.text = "".join(parts)
        out.response_id = ids_seen.pop() if len(ids_seen) == 1 else f"mixed:{sorted(ids_seen)}"
    except openai.APIStatusError as error:
        out.status = error.status_code
        out.extra["code"] = error.code
        out.extra["openai_shape"] = isinstance(error.body, dict) and set(error.body) == ERROR_FIELDS
        out.echoed = error.response.headers.get("X-Request-Id") == headers["X-Request-Id"]
    except Exception as error:  # noqa: BLE001 - recorded: the soak's books count it
        out.error = f"{type(error).__name__}: {error}"
    return out


def _whole(out: Outcome, raw, headers: dict, chat: bool = False) -> Outcome:
    out.status = raw.http_response.status_code
    out.echoed = raw.headers.get("X-Request-Id") == headers["X-Request-Id"]
    reply = raw.parse()
    choice = reply.choices[0]
    out.text = choice.message.content if chat else choice.text
    out.finish_reason = choice.finish_reason
    out.completion_tokens = reply.usage.completion_tokens
    out.response_id = reply.id
    return out


async def traffic(url: str, items: list[Planned], concurrency: int, ids, on_done=None):
    """Send `items` with `concurrency` clients at once; the outcomes in order."""
    import openai

    client = openai.AsyncOpenAI(
        base_url=url + "/v1", api_key="unused", max_retries=0, timeout=REQUEST_TIMEOUT_S
    )
    outcomes: list[Outcome | None] = [None] * len(items)
    queue = iter(items)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as http:

        async def worker():
            for item in queue:
                outcomes[item.index] = await send_one(client, http, url, item, ids)
                if on_done is not None:
                    on_done(item.index)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    await client.close()
    return outcomes


# -- the books -----------------------------------------------------------------------------------


def references():
    """`generate()` greedy of every prompt, as completion and as chat, at every MAX_TOKENS and
    filling the context: {(mode, prompt, max_tokens): (text, tokens)}; and the prompts' ids.
    One call per prompt and mode: a greedy completion of fewer tokens is a prefix of a longer
    one (both stop at the same end-of-sequence)."""
    import torch

    from specdec_fast import generate
    from specdec_fast.loading import load_model, load_tokenizer
    from specdec_fast.text import decode, encode_prompt, stop_token_ids

    torch.set_num_threads(1)
    model = load_model("tiny-code", torch.device("cpu"))
    tokenizer = load_tokenizer("tiny-code")
    tokenizer.chat_template = TEMPLATE
    stops = stop_token_ids(model, tokenizer)
    expected, ids = {}, []
    for p, prompt in enumerate(PROMPTS):
        plain = encode_prompt(tokenizer, prompt, chat=False)
        chat = encode_prompt(tokenizer, messages=[{"role": "user", "content": prompt}], chat=True)
        ids.append(plain)
        filled = fill_prompt(plain)
        cases = [("fill", filled, CONTEXT_LEN - FILL_LEN, [])]
        cases += [
            (mode, ids_, max(MAX_TOKENS), stops)
            for mode, ids_ in (("complete", plain), ("chat", chat))
        ]
        for mode, prompt_ids, m, eos in cases:
            out = generate(
                model, [prompt_ids], drafter=None, max_new_tokens=m, eos_token_id=eos, compile=False
            )
            tokens = out.sequences[0][len(prompt_ids) :].tolist()
            for shorter in MAX_TOKENS if mode != "fill" else (m,):
                expected[(mode, p, shorter)] = (
                    decode(tokenizer, tokens[:shorter]),
                    len(tokens[:shorter]),
                )
    return expected, ids


EXPECTED_STATUS = {"malformed": 400, "oversized": 413, "over_context": 400}
ERROR_FIELDS = {"message", "type", "param", "code"}  # OpenAI's error object


def audit(items: list[Planned], outcomes: list[Outcome], expected: dict) -> dict:
    """The client's side of the books: counts by outcome and every failure, in words."""
    failures = []
    counts = Counter()
    accepted_by_route, disconnected_by_route, completed_by_route = Counter(), Counter(), Counter()
    response_ids = Counter(o.response_id for o in outcomes if o.response_id)
    for item, out in zip(items, outcomes, strict=True):
        where = f"request {item.index} ({item.kind} on {item.model})"
        if out is None or out.error is not None:
            failures.append(f"{where}: {out.error if out else 'no outcome'}")
            continue
        if not out.echoed:
            failures.append(f"{where}: its X-Request-Id did not come back on its answer")
        if out.status != 200 and not out.extra.get("openai_shape"):
            failures.append(f"{where}: its {out.status} is not in OpenAI's error shape")
        if out.status == 429:
            counts["refused_429"] += 1
            continue
        want = EXPECTED_STATUS.get(item.kind, 200)
        if out.status != want:
            failures.append(f"{where}: status {out.status}, expected {want} ({out.extra})")
            continue
        if want != 200:
            counts[f"refused_{want}"] += 1
            continue
        route = "default" if item.model == "tiny-code" else item.model
        accepted_by_route[route] += 1
        if item.kind == "disconnect":
            counts["disconnected"] += 1
            disconnected_by_route[route] += 1
            continue
        counts["completed"] += 1
        completed_by_route[(route, out.finish_reason)] += 1
        if response_ids[out.response_id] != 1:
            failures.append(f"{where}: response id {out.response_id} answered more than once")
        mode = {"chat": "chat", "chat_stream": "chat", "fill": "fill"}.get(item.kind, "complete")
        if item.kind == "sampled":
            continue
        m = CONTEXT_LEN - FILL_LEN if mode == "fill" else item.max_tokens
        text, count = expected[(mode, item.prompt, m)]
        if out.text != text:
            failures.append(f"{where}: text {out.text!r} differs from generate's {text!r}")
        if out.completion_tokens is not None and out.completion_tokens != count:
            failures.append(f"{where}: {out.completion_tokens} tokens, generate {count}")
    return {
        "counts": counts,
        "accepted_by_route": accepted_by_route,
        "disconnected_by_route": disconnected_by_route,
        "completed_by_route": completed_by_route,
        "failures": failures,
    }


def counter_delta(before: dict, after: dict, name: str, **labels) -> float:
    """How much the samples of `name` with these labels (summed) grew from `before` to
    `after` (`ServerProcess.metrics()`)."""

    def total(samples: dict) -> float:
        return sum(
            value
            for (sample, sample_labels), value in samples.items()
            if sample == name and all((k, v) in sample_labels for k, v in labels.items())
        )

    return total(after) - total(before)


def reconcile(books: dict, before: dict, after: dict) -> list[str]:
    """The server's counters (their growth over the run) against the client's books: requests
    ended per route (every accepted one, once), per finish reason (a disconnected stream is an
    "abort", unless it ended before the server saw its client go), and refusals (429s)."""
    failures = []
    ended = "vllm:request_success_total"
    routes = set(books["accepted_by_route"]) | {"default", "plain", "flaky"}
    for route in sorted(routes):
        served = counter_delta(before, after, ended, route=route)
        accepted = books["accepted_by_route"][route]
        if served != accepted:
            failures.append(f"{ended}{{route={route}}}: {served:g}, requests accepted {accepted}")
        aborted = counter_delta(before, after, ended, route=route, finished_reason="abort")
        if not 0 <= aborted <= books["disconnected_by_route"][route]:
            failures.append(
                f"{ended}{{route={route}, abort}}: {aborted:g}, disconnects "
                f"{books['disconnected_by_route'][route]}"
            )
        for reason in ("stop", "length"):
            completed = books["completed_by_route"][(route, reason)]
            served = counter_delta(before, after, ended, route=route, finished_reason=reason)
            # The disconnects the server finished before it saw them go count here too.
            slack = books["disconnected_by_route"][route] - aborted
            if not completed <= served <= completed + slack:
                failures.append(
                    f"{ended}{{route={route}, {reason}}}: {served:g}, completed {completed}"
                )
    errors = counter_delta(before, after, ended, finished_reason="error")
    if errors:
        failures.append(f"{errors:g} requests ended in an error")
    rejected = counter_delta(before, after, "specdec_requests_rejected_total")
    refused = books["counts"]["refused_429"]
    if rejected != refused:
        failures.append(f"specdec_requests_rejected_total: {rejected:g}, 429s seen: {refused}")
    return failures


def run_soak(
    requests: int,
    concurrency: int,
    folder: Path,
    seed: int = 0,
    max_batch: int = 4,
    max_queue: int = 4,
    warmup: int | None = None,
    nice: int = 0,
    progress=None,
) -> dict:
    """The soak (see the module): the figures, and `failures` (empty when the books balance)."""
    started = time.perf_counter()
    server = ServerProcess(serve_args(folder, max_batch, max_queue), folder / "server.log", nice)
    try:
        expected, ids = references()  # while the server starts
        server.wait_ready()
        items = plan(requests, seed)
        warmup = warmup if warmup is not None else max(requests // 10, concurrency * 4)
        rss_start = server.rss()
        warm = asyncio.run(traffic(server.url, items[:warmup], concurrency, ids))
        rss_warm = server.rss()
        before = server.metrics()
        run_started = time.perf_counter()
        rest = [replace_index(item, i) for i, item in enumerate(items[warmup:])]
        outcomes = asyncio.run(traffic(server.url, rest, concurrency, ids, progress))
        run_seconds = time.perf_counter() - run_started
        # The disconnected streams' cancellations reach the counters within a step or two.
        time.sleep(1.0)
        after = server.metrics()
        rss_end = server.rss()
        books_warm = audit(items[:warmup], warm, expected)
        books = audit(rest, outcomes, expected)
        failures = books_warm["failures"] + books["failures"] + reconcile(books, before, after)
        growth = rss_end / rss_warm - 1.0
        if growth > RSS_GROWTH_LIMIT:
            failures.append(f"RSS grew by {growth:.1%} after the warm-up (limit 10%)")
        fallbacks = counter_delta({}, after, "specdec_route_drafter_errors_total", route="flaky")
        if fallbacks == 0:
            failures.append("the flaky route's drafter never raised: the fault was not exercised")
    finally:
        exit_code = server.stop(signal.SIGINT)
    if exit_code != 0:
        failures.append(f"the server exited with code {exit_code} on SIGINT")
    counts = books_warm["counts"] + books["counts"]
    return {
        "requests": requests,
        "warmup_requests": warmup,
        "concurrency": concurrency,
        "max_batch": max_batch,
        "max_queue": max_queue,
        "seed": seed,
        "counts": dict(counts),
        "measured_requests": len(rest),
        "measured_seconds": round(run_seconds, 1),
        "requests_per_second": round(len(rest) / run_seconds, 2),
        "total_seconds": round(time.perf_counter() - started, 1),
        "rss_start_mb": round(rss_start / 2**20, 1),
        "rss_after_warmup_mb": round(rss_warm / 2**20, 1),
        "rss_end_mb": round(rss_end / 2**20, 1),
        "rss_growth": round(growth, 4),
        "flaky_drafter_errors": fallbacks,
        "server_exit_code": exit_code,
        "failures": failures,
    }


def replace_index(item: Planned, index: int) -> Planned:
    return Planned(index, item.kind, item.prompt, item.max_tokens, item.model)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        from specdec_fast.cli import main as cli_main

        return cli_main(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=10000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-batch", type=int, default=4)
    parser.add_argument("--max-queue", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--nice", type=int, default=10, help="the server's niceness (10)")
    parser.add_argument("--out", default=None, help="the figures as JSON")
    args = parser.parse_args(argv)
    counter = itertools.count(1)
    started = time.perf_counter()

    def progress(_):
        n = next(counter)
        if n % 500 == 0:
            print(f"{n} requests, {time.perf_counter() - started:.0f} s", file=sys.stderr)

    with tempfile.TemporaryDirectory() as folder:
        figures = run_soak(
            args.requests,
            args.concurrency,
            Path(folder),
            args.seed,
            args.max_batch,
            args.max_queue,
            nice=args.nice,
            progress=progress,
        )
    figures["command"] = " ".join(["python bench/bench_soak.py", *argv])
    figures["load"] = os.getloadavg()  # 1, 5 and 15 minutes, at the end
    text = json.dumps(figures, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0 if not figures["failures"] else 1


if __name__ in ("__main__", "__mp_main__"):
    register_flaky()
if __name__ == "__main__":
    sys.exit(main())
