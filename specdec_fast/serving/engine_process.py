"""`ProcessEngine`: the server's `Service` (model, scheduler, drafters, router, metrics) in a
child process of its own, as vLLM's engine core runs apart from its API server.

Why: in one process, the event loop's Python (parsing requests, decoding text, writing
server-sent events) and the scheduler's thread share one interpreter lock, and every torch op
of a decode step gives the lock up and waits to take it back. On the bundled target on a CPU,
a thread doing Python a quarter of the time beside the decode loop slows its steps by 55%; the
same work in another process by 11% (`bench/bench_interpreter_lock.py`, results in
`bench/results/interpreter_lock-cpu.md`). Apart, the engine keeps its interpreter to itself
and the server process does the HTTP side.

The two talk over one `multiprocessing` pipe (spawned, never forked: torch's thread pools do
not survive a fork). The server sends `submit` (a request without its callbacks), `cancel`,
`metrics`, `health` and `close`; the child answers each call and sends its requests' events
(each step's new tokens, then the `Completion`) in one message per step, sent by the
scheduler's thread as the step ends. The server's reader thread calls the requests' callbacks,
as the scheduler's thread would in one process. If the child dies, every request in flight ends
with an error, `/health` and new requests get 503s.

    config = EngineConfig("tiny-code", server_routes("ngram", []))
    uvicorn.run(create_app(ProcessEngine(config)), port=8000)
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import multiprocessing
import signal
import threading
import traceback
from dataclasses import dataclass, field, replace
from functools import partial

from specdec_fast.guardrails import Guardrails
from specdec_fast.serving.routes import RouteConfig, RouteTable
from specdec_fast.serving.scheduler import (
    CANCELLED,
    FAILED,
    Completion,
    QueueFull,
    Request,
    SchedulerStopped,
)
from specdec_fast.stats import SequenceStats

HEALTH_TIMEOUT_S = 10.0  # a child that does not answer /health's question in time is unhealthy
CLOSE_TIMEOUT_S = 60.0  # then the child is killed
# What the child answers `submit` with instead of a handle, raised again in the server.
_REFUSALS = (QueueFull, SchedulerStopped, ValueError)


@dataclass(frozen=True)
class EngineConfig:
    """What the child builds its `Service` from (picklable: it crosses the pipe).

    model: an HF folder, a .gguf file or a bundled name (`load_model`); device, dtype: as
    `load_model` takes them (None: cuda if available, else cpu; "auto"). threads: torch's CPU
    threads in the child (None: torch's default). engine: `Service`'s keyword arguments
    (model_name, max_batch, chat_template, ...). tensor_parallel: the ranks the model is
    sharded over (`parallel.load_target`, in the process that builds: the rank; `--device` is
    then not read); rank 0's `Service` serves, the others follow it (`serving.lockstep`).
    """

    model: str
    routes: list[RouteConfig]
    guardrails: Guardrails | None = None
    device: str | None = None
    dtype: str = "auto"
    threads: int | None = None
    engine: dict = field(default_factory=dict)
    tensor_parallel: int = 1

    def build(self, **extra):
        """The `Service` this describes, in this process (torch's threads set, the model
        and tokenizer loaded); `extra`: more of its keyword arguments (`after_step`)."""
        import torch

        from specdec_fast.loading import load_model, load_tokenizer, pick_device
        from specdec_fast.parallel import load_target
        from specdec_fast.serving.service import Service

        if self.threads is not None:
            torch.set_num_threads(self.threads)
        if self.tensor_parallel > 1:
            model = load_target(self.model, self.dtype, self.tensor_parallel)
        else:
            model = load_model(self.model, pick_device(self.device), self.dtype)
        tokenizer = load_tokenizer(self.model)
        return Service(
            model, tokenizer, self.routes, guardrails=self.guardrails, **self.engine, **extra
        )


class ProcessEngine:
    """A `Service` in a child process, with the interface the server uses (`submit`,
    `metrics_text`, `healthy`, `start`, `close`, `router`, `tokenizer`, `context_len`).

    The tokenizer is loaded here too (the server decodes text); the routes are resolved here
    (`RouteTable`), served there. `start()` spawns the child and returns once its model is
    loaded, raising the child's error if it fails to start.
    """

    def __init__(self, config: EngineConfig):
        from specdec_fast.loading import load_tokenizer

        options = config.engine
        self.config = config
        self.model_name = options.get("model_name", "specdec-fast")
        self.keep_special_tokens = options.get("keep_special_tokens", False)
        self.tokenizer = load_tokenizer(config.model)
        if options.get("chat_template") is not None:
            self.tokenizer.chat_template = options["chat_template"]
        self.router = RouteTable(config.routes, self.model_name)
        self.mailbox = None  # the server's delivery to its event loop (set at start-up)
        self.vocab_size: int | None = None  # the child's model's, once started
        self.context_len: int | None = None
        self.process: multiprocessing.Process | None = None
        self.stopped: str | None = "not started"  # why requests are refused, or None
        self._conn = None
        self._reader: threading.Thread | None = None
        self._send_lock = threading.Lock()
        self._keys = itertools.count()
        self._calls: dict[int, asyncio.Future] = {}
        self._requests: dict[int, Request] = {}

    # -- life --------------------------------------------------------------------------------

    def start(self) -> None:
        """Spawn the child and wait until it serves (or raise `RuntimeError` with its error)."""
        if self.process is not None:
            raise RuntimeError("the engine process is already started")
        context = multiprocessing.get_context("spawn")
        here, there = context.Pipe()
        self.process = context.Process(
            target=_child, args=(there, self.config), name="specdec-engine", daemon=True
        )
        self.process.start()
        there.close()
        self._conn = here
        while not here.poll(0.5):
            if not self.process.is_alive():
                raise self._died_starting()
        try:
            kind, payload = here.recv()
        except EOFError:
            self.process.join(CLOSE_TIMEOUT_S)
            raise self._died_starting() from None
        if kind == "failed":
            self.process.join(CLOSE_TIMEOUT_S)
            raise RuntimeError(f"the engine process failed to start:\n{payload}")
        self.vocab_size, self.context_len = payload["vocab_size"], payload["context_len"]
        self.stopped = None
        self._reader = threading.Thread(
            target=self._read, name="specdec-engine-reader", daemon=True
        )
        self._reader.start()

    def _died_starting(self) -> RuntimeError:
        return RuntimeError(
            f"the engine process exited with code {self.process.exitcode} while starting"
        )

    def close(self) -> None:
        """Ask the child to end every request and exit; kill it if it does not in time."""
        if self.process is None:
            return
        with contextlib.suppress(OSError):
            self._send(("close",))
        self.process.join(CLOSE_TIMEOUT_S)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        if self._reader is not None:
            self._reader.join(CLOSE_TIMEOUT_S)
        self._conn.close()
        self._gone("the server is shutting down")

    # -- the server's interface --------------------------------------------------------------

    async def submit(self, route: str, request: Request) -> _RemoteHandle:
        """Submit `request` on `route` in the child; raises what `Service.submit_now`
        raises there (`QueueFull`, `SchedulerStopped`, `ValueError`). Its callbacks run on
        this process's reader thread."""
        key = next(self._keys)
        self._requests[key] = request
        bare = replace(request, on_tokens=None, on_finish=None)
        try:
            await self._call("submit", key, route, bare)
        except BaseException:
            self._requests.pop(key, None)
            raise
        return _RemoteHandle(self, key)

    async def metrics_text(self) -> bytes:
        """The child's /metrics body."""
        return await self._call("metrics")

    async def healthy(self) -> bool:
        """Whether the child answers, in time, that its scheduler serves."""
        if self.stopped is not None:
            return False
        try:
            return await asyncio.wait_for(self._call("health"), HEALTH_TIMEOUT_S)
        except (TimeoutError, SchedulerStopped):
            return False

    # -- the pipe ----------------------------------------------------------------------------

    def _send(self, message: tuple) -> None:
        with self._send_lock:
            self._conn.send(message)

    async def _call(self, kind: str, *args):
        """Send a call and wait for the child's answer (its refusal is raised here)."""
        if self.stopped is not None:
            raise SchedulerStopped(f"the engine process is not serving: {self.stopped}")
        key = next(self._keys)
        future = asyncio.get_running_loop().create_future()
        self._calls[key] = future
        try:
            self._send((kind, key, *args))
        except OSError as error:
            self._calls.pop(key, None)
            raise SchedulerStopped(f"the engine process is not serving: {error}") from None
        return await future

    def cancel(self, key: int, reason: str = CANCELLED) -> None:
        """Cancel the request (`_RemoteHandle.cancel`); nothing if the child is gone."""
        if self.stopped is None:
            with contextlib.suppress(OSError):
                self._send(("cancel", key, reason))

    def _read(self) -> None:
        """The reader thread: answers to calls go to their futures, events to the requests'
        callbacks, until the pipe closes."""
        try:
            while True:
                kind, *payload = self._conn.recv()
                if kind == "events":
                    for key, item in payload[0]:
                        self._deliver(key, item)
                else:
                    key, value = payload
                    future = self._calls.pop(key, None)
                    if future is not None:
                        future.get_loop().call_soon_threadsafe(_settle, future, value)
        except (EOFError, OSError):
            code = self.process.exitcode if self.process is not None else None
            self._gone(f"the engine process exited (code {code})")

    def _deliver(self, key: int, item) -> None:
        if isinstance(item, Completion):
            request = self._requests.pop(key, None)
            if request is not None and request.on_finish is not None:
                request.on_finish(item)
            return
        request = self._requests.get(key)
        if request is not None and request.on_tokens is not None:
            request.on_tokens(item)

    def _gone(self, reason: str) -> None:
        """The child is gone: refuse new requests, fail the calls and requests in flight."""
        if self.stopped is None:
            self.stopped = reason
        for future in [self._calls.pop(key) for key in list(self._calls)]:
            error = SchedulerStopped(f"the engine process is not serving: {reason}")
            with contextlib.suppress(RuntimeError):  # a closed loop
                future.get_loop().call_soon_threadsafe(_settle, future, error)
        for request in [self._requests.pop(key) for key in list(self._requests)]:
            if request.on_finish is not None:
                request.on_finish(_failed(request, reason))


class _RemoteHandle:
    """A request submitted to the child: `cancel()` it."""

    def __init__(self, engine: ProcessEngine, key: int):
        self.engine, self.key = engine, key

    def cancel(self, reason: str = CANCELLED) -> None:
        self.engine.cancel(self.key, reason)


def _settle(future: asyncio.Future, value) -> None:
    if future.done():
        return
    if isinstance(value, BaseException):
        future.set_exception(value)
    else:
        future.set_result(value)


def _failed(request: Request, reason: str) -> Completion:
    """The completion of a request whose engine process died."""
    return Completion(
        tokens=[],
        finish_reason=FAILED,
        stats=SequenceStats(prompt_tokens=len(request.prompt), finish_reason=FAILED),
        route=request.route,
        speculated=False,
        arrival=0.0,
        admitted=None,
        finished=0.0,
        error=f"the engine process is not serving: {reason}",
    )


# -- the child -------------------------------------------------------------------------------


class _Outbox:
    """The child's events for the server (each step's new tokens, completions), posted by the
    requests' callbacks and sent by `flush` in one message: by the scheduler's thread at the
    end of each step (its `after_step`), and by the main thread after each call it serves.
    No thread of its own: a sender woken per event would take the interpreter lock from the
    decode loop once per event; a flush at the end of a step costs one pickle and one write."""

    def __init__(self, send):
        self._send = send
        self._items: list[tuple[int, object]] = []
        self._lock = threading.Lock()  # held while sending too: events leave in order
        self.closed = False

    def post(self, key: int, item) -> None:
        with self._lock:
            if not self.closed:  # nobody to send to once the server is gone
                self._items.append((key, item))

    def flush(self) -> None:
        with self._lock:
            if not self._items or self.closed:
                return
            items, self._items = self._items, []
            try:
                self._send(("events", items))
            except OSError:  # the server process is gone
                self.closed = True


def _child(conn, config: EngineConfig) -> None:
    """The engine process: build the `Service`, then serve the server's calls until it
    says `close` or goes away."""
    # Ctrl-C reaches the whole process group, and a service manager's SIGTERM often every
    # process of the service: the server's drain, then its `close`, ends this one (a server
    # that dies closes the pipe, which ends it too).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    lock = threading.Lock()

    def send(message: tuple) -> None:
        with lock:
            conn.send(message)

    outbox = _Outbox(send)
    try:
        engine = config.build(after_step=outbox.flush)
        engine.start()
    except Exception:  # noqa: BLE001 - the server reports it and exits
        send(("failed", traceback.format_exc()))
        return
    # The startup heap lives as long as the engine: frozen, full collections skip it.
    gc.collect()
    gc.freeze()
    handles = {}

    def finished(key: int, completion: Completion) -> None:
        handles.pop(key, None)
        outbox.post(key, completion)

    def serve(kind: str, args: list) -> None:
        if kind == "cancel":
            key, reason = args
            handle = handles.get(key)
            if handle is not None:
                handle.cancel(reason)
            return
        call, *args = args
        if kind == "submit":
            key, route, request = args
            request = replace(
                request, on_tokens=partial(outbox.post, key), on_finish=partial(finished, key)
            )
            try:
                handle = engine.submit_now(route, request)
            except _REFUSALS as error:
                send(("answer", call, error))
                return
            handles[key] = handle
            if handle.done.is_set():  # it ended before it was stored
                handles.pop(key, None)
            send(("answer", call, True))
        elif kind == "metrics":
            send(("answer", call, engine.metrics.render()))
        elif kind == "health":
            send(("answer", call, engine.scheduler.alive))

    send(("ready", {"vocab_size": engine.vocab_size, "context_len": engine.context_len}))
    try:
        while True:
            try:
                kind, *args = conn.recv()
            except (EOFError, OSError):  # the server process is gone
                break
            if kind == "close":
                break
            serve(kind, args)
            outbox.flush()  # what the call's requests posted outside a step
    finally:
        engine.close()
        outbox.flush()
        conn.close()
    if config.tensor_parallel > 1:
        from specdec_fast.parallel import end_rank

        end_rank(0)  # a rank of a tensor-parallel target skips the interpreter's teardown
