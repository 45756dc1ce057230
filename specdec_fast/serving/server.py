"""`specdec-fast serve`: an OpenAI-compatible HTTP server on FastAPI and uvicorn.

Endpoints: `POST /v1/completions` and `POST /v1/chat/completions` (streamed as server-sent
events with `stream: true`, else one JSON response; `specdec_fast.serving.protocol` lists the
fields), `GET /v1/models` (the served model name, every route name and alias), `GET /health`
(200 while the scheduler serves, 503 otherwise) and `GET /metrics` (Prometheus,
`specdec_fast.serving.metrics`).

Requests are routed (`specdec_fast.serving.routes`) and decoded by one continuous-batching
`Scheduler`, in a child process of its own (`ProcessEngine`, the default of `specdec-fast
serve`: the engine keeps an interpreter to itself) or on a thread of this one (`Service`,
`--no-engine-process`); tokens travel to the event loop as they are accepted and are decoded
there incrementally. Errors use OpenAI's error shape: 401 without a valid API key
(`specdec_fast.serving.access`), 413 for a body over the limit and 400 for one over another
limit (`specdec_fast.serving.limits`), for a malformed request (bad JSON, an unknown model or
route, a bad field, a prompt over the context), 429 when the queue of waiting requests is full,
503 when the scheduler has stopped or the server drains on a signal
(`specdec_fast.serving.shutdown`); a request's `X-Request-Id` comes back on every response to
it, errors included. A client that disconnects, from a
stream or while waiting for a whole response, has its request cancelled: its slot goes to the
next request.

    engine = Service(model, tokenizer, server_routes("ngram", []))  # in this process
    engine = ProcessEngine(EngineConfig("tiny-code", server_routes("ngram", [])))  # or apart
    uvicorn.run(create_app(engine), host="127.0.0.1", port=8000)
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import signal
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from specdec_fast.guardrails import Guardrails
from specdec_fast.parallel import launched_rank
from specdec_fast.serving.access import API_KEY_ENV, ApiKeys, is_loopback
from specdec_fast.serving.engine_process import EngineConfig, ProcessEngine
from specdec_fast.serving.errors import RequestError, error_body
from specdec_fast.serving.limits import Limits
from specdec_fast.serving.protocol import (
    CHAT,
    COMPLETION,
    GenerationParams,
    TextStream,
    chunk,
    finish_reason,
    new_id,
    parse_json,
    parse_request,
    response,
    sse,
    usage,
)
from specdec_fast.serving.routes import ROUTE_HEADER
from specdec_fast.serving.scheduler import (
    FAILED,
    STOP_STRING,
    Completion,
    QueueFull,
    SchedulerStopped,
)
from specdec_fast.serving.scheduler import Request as SchedulerRequest
from specdec_fast.serving.service import Service
from specdec_fast.serving.shutdown import Drain, log_to_stderr, logger, run_server

REQUEST_ID_HEADER = "X-Request-Id"
RETRY_AFTER_S = "1"


def _error(status: int, message: str, kind: str, param=None, code=None, headers=None):
    return JSONResponse(error_body(message, kind, param, code), status, headers=headers)


def _shutting_down() -> RequestError:
    return RequestError(
        "the server is shutting down", code="shutting_down", status=503, kind="server_error"
    )


def _echoed(request: Request) -> dict[str, str]:
    """The client's request id, for the response's headers (errors included), if it sent one."""
    given = request.headers.get(REQUEST_ID_HEADER)
    return {} if given is None else {REQUEST_ID_HEADER: given}


def create_app(
    engine: Service | ProcessEngine,
    *,
    keys: ApiKeys | None = None,
    limits: Limits | None = None,
    drain: Drain | None = None,
    metrics_auth: bool = False,
) -> FastAPI:
    """The FastAPI application over `engine`; its lifespan starts and closes it.

    keys: the API keys every `/v1` route (and `/metrics` with `metrics_auth`) asks for (none:
    open). limits: the request limits (`Limits`' defaults). drain: the in-flight requests and
    the drain that `GracefulServer` starts on a signal (a new one by default).
    """
    keys = keys or ApiKeys()
    limits = limits or Limits()
    drain = drain or Drain()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.mailbox = _Mailbox(asyncio.get_running_loop())
        engine.start()
        # The startup heap (model, tokenizer, libraries) lives as long as the server: frozen, the
        # garbage collector's full passes skip it instead of pausing the decode loop.
        gc.collect()
        gc.freeze()
        try:
            yield
        finally:
            engine.close()

    async def authorized(request: Request) -> None:
        if not keys.allows(request.headers.get("Authorization")):
            raise RequestError(
                "Incorrect or missing API key: send `Authorization: Bearer KEY`",
                code="invalid_api_key",
                status=401,
            )

    async def admitting(request: Request) -> None:
        if drain.draining:
            raise _shutting_down()

    v1 = [Depends(authorized), Depends(admitting)]
    app = FastAPI(title="specdec-fast", lifespan=lifespan)
    app.state.engine = engine
    app.state.drain = drain
    app.state.keys = keys

    @app.exception_handler(RequestError)
    async def request_error(request: Request, error: RequestError):
        headers = _echoed(request)
        if error.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        return JSONResponse(error.body(), error.status, headers=headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException):
        return _error(error.status_code, str(error.detail), "invalid_request_error")

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError):
        return _error(400, str(error), "invalid_request_error")

    @app.get("/health")
    async def health():
        if drain.draining:
            raise _shutting_down()
        if not await engine.healthy():
            return _error(503, "the scheduler is not running", "server_error", code="stopped")
        return {"status": "ok"}

    @app.get("/v1/models", dependencies=v1)
    async def models():
        created = int(time.time())
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": created,
                    "owned_by": "specdec-fast",
                    "max_model_len": engine.context_len,
                    "specdec": engine.router.describe(name),
                }
                for name in engine.router.model_names
            ],
        }

    @app.get("/metrics", dependencies=[Depends(authorized)] if metrics_auth else [])
    async def metrics():
        try:
            body = await engine.metrics_text()
        except SchedulerStopped as error:
            return _error(503, str(error), "server_error", code="stopped")
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions", dependencies=v1)
    async def completions(request: Request):
        return await _generate(engine, request, COMPLETION, limits, drain)

    @app.post("/v1/chat/completions", dependencies=v1)
    async def chat_completions(request: Request):
        return await _generate(engine, request, CHAT, limits, drain)

    return app


class _Mailbox:
    """Deliveries from the engine's thread (the scheduler's, or the reader of the engine
    process's pipe) to queues of the event loop: one wake-up of the loop carries everything
    posted since the last (a step's tokens for every stream), so that the loop takes the
    interpreter from that thread once per step, not per request."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple[asyncio.Queue, object]] = []
        self._scheduled = False

    def post(self, queue: asyncio.Queue, item) -> None:
        with self._lock:
            self._items.append((queue, item))
            if self._scheduled:
                return
            self._scheduled = True
        # A closed loop (the server shut down) drops it.
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        with self._lock:
            items, self._items, self._scheduled = self._items, [], False
        for queue, item in items:
            queue.put_nowait(item)


class _Events:
    """The scheduler's callbacks for one request, delivered to the event loop as a queue of
    token lists, then the `Completion`; the completion also releases the request from the
    drain's in-flight set (on the engine's thread: a request whose client is gone still
    leaves it)."""

    def __init__(self, mailbox: _Mailbox, drain: Drain):
        self.mailbox = mailbox
        self.drain = drain
        self.key: int | None = None  # the drain's, once the engine accepted the request
        self.ended = False
        self.queue: asyncio.Queue = asyncio.Queue()

    def put(self, item) -> None:
        self.mailbox.post(self.queue, item)

    def finish(self, completion: Completion) -> None:
        self.ended = True
        if self.key is not None:
            self.drain.release(self.key)
        self.put(completion)

    def accepted(self, handle) -> None:
        self.key = self.drain.track(handle)
        if self.ended:  # it ended before it was tracked
            self.drain.release(self.key)


async def _read_body(request: Request, limits: Limits) -> bytes:
    """The request's body, refused (413) past `limits.max_body_bytes` before it is all read:
    at once from its Content-Length, else as its chunks arrive."""
    limits.check_declared_length(request.headers.get("Content-Length"))
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        limits.check_body_size(size)
        parts.append(part)
    return b"".join(parts)


async def _generate(
    engine: Service | ProcessEngine, request: Request, kind: str, limits: Limits, drain: Drain
):
    values = parse_json(await _read_body(request, limits))
    route = engine.router.resolve(values.get("model"), request.headers.get(ROUTE_HEADER))
    limits = limits.with_route_cap(engine.router.routes[route].max_tokens)
    params = parse_request(
        values, kind, engine.tokenizer, engine.vocab_size, engine.context_len, limits
    )
    if drain.draining:  # the signal came while the body was read
        raise _shutting_down()
    events = _Events(engine.mailbox, drain)
    scheduled = SchedulerRequest(
        prompt=params.prompt_ids,
        max_new_tokens=params.max_tokens,
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        seed=params.seed,
        eos_token_id=[] if params.ignore_eos else None,
        stop=[[token] for token in params.stop_token_ids],
        on_tokens=events.put,
        on_finish=events.finish,
    )
    drain.admitting += 1  # the drain waits for it too, though it has no handle yet
    try:
        handle = await engine.submit(route, scheduled)
    except QueueFull as error:
        return _error(
            429,
            str(error),
            "rate_limit_error",
            code="queue_full",
            headers={"Retry-After": RETRY_AFTER_S} | _echoed(request),
        )
    except SchedulerStopped as error:
        return _error(503, str(error), "server_error", code="stopped", headers=_echoed(request))
    except ValueError as error:
        raise RequestError(str(error)) from None
    else:
        events.accepted(handle)
    finally:
        drain.admitting -= 1
    request_id = new_id(kind)
    # The route that serves it, whichever picked it (the route header wins over `model`).
    headers = {
        REQUEST_ID_HEADER: request.headers.get(REQUEST_ID_HEADER, request_id),
        ROUTE_HEADER: route,
    }
    model = params.model or engine.model_name
    text = TextStream(engine.tokenizer, params.stop, engine.keep_special_tokens)
    if params.stream:
        stream = _stream(events, handle, text, params, kind, request_id, model)
        return StreamingResponse(stream, media_type="text/event-stream", headers=headers)
    watcher = asyncio.ensure_future(_disconnected(request))
    collector = asyncio.ensure_future(_collect(events, handle, text))
    done, _ = await asyncio.wait({watcher, collector}, return_when=asyncio.FIRST_COMPLETED)
    if collector not in done:
        handle.cancel()
        collector.cancel()
        return Response(status_code=499)
    watcher.cancel()
    completion = collector.result()
    if completion is not None and completion.finish_reason == FAILED:
        return _error(500, completion.error or "generation failed", "server_error", headers=headers)
    reason = "stop" if text.stopped else finish_reason(completion.finish_reason)
    body = response(
        kind, request_id, model, text.text, reason, usage(len(params.prompt_ids), len(text.ids))
    )
    return JSONResponse(body, headers=headers)


async def _disconnected(request: Request) -> None:
    """Returns when the client goes away (the body was read: only a disconnect is left)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _collect(events: _Events, handle, text: TextStream) -> Completion | None:
    """Every token of the request; returns its completion, or None when a stop string ended
    it (the scheduler's request is then cancelled)."""
    while True:
        item = await events.queue.get()
        if isinstance(item, Completion):
            text.flush()
            return item
        text.push(item)
        if text.stopped:
            handle.cancel(STOP_STRING)
            return None


async def _stream(
    events: _Events,
    handle,
    text: TextStream,
    params: GenerationParams,
    kind: str,
    request_id: str,
    model: str,
) -> AsyncIterator[str]:
    """The server-sent events of one streamed request; cancels it however the stream ends
    (a client that disconnects closes the generator)."""
    prompt_tokens = len(params.prompt_ids)

    def running_usage() -> dict | None:
        return usage(prompt_tokens, len(text.ids)) if params.continuous_usage else None

    try:
        if kind == CHAT:
            yield sse(chunk(kind, request_id, model, "", role=True, usage_=running_usage()))
        completion = None
        while completion is None:
            item = await events.queue.get()
            if isinstance(item, Completion):
                completion = item
                delta = text.flush()
            else:
                delta = text.push(item)
            # With running usage every step is sent, so that clients can time its tokens.
            if delta or (params.continuous_usage and completion is None and not text.stopped):
                yield sse(chunk(kind, request_id, model, delta, usage_=running_usage()))
            if text.stopped:
                handle.cancel(STOP_STRING)
                break
        if completion is not None and completion.finish_reason == FAILED:
            failure = error_body(completion.error or "generation failed", "server_error")
            yield sse(failure)
        else:
            reason = "stop" if text.stopped else finish_reason(completion.finish_reason)
            yield sse(chunk(kind, request_id, model, "", reason, running_usage()))
        if params.include_usage:
            yield sse(
                chunk(kind, request_id, model, None, usage_=usage(prompt_tokens, len(text.ids)))
            )
        yield sse("[DONE]")
    finally:
        handle.cancel()


def serve(args) -> int:
    """`specdec-fast serve` (see `specdec_fast.cli`): load the model, build the routes, run
    uvicorn until a signal has drained it (`specdec_fast.serving.shutdown`)."""
    from specdec_fast.serving.routes import load_routes, server_routes

    extra = load_routes(args.routes) if args.routes else []
    routes = server_routes(
        str(args.drafter), extra, mode="shadow" if args.shadow else "speculate", canary=args.canary
    )
    guardrails = Guardrails.from_yaml(Path(args.guardrails)) if args.guardrails else None
    template = None
    if args.chat_template is not None:
        path = Path(args.chat_template)
        template = path.read_text() if path.is_file() else args.chat_template
    options = {
        "model_name": args.served_model_name or Path(args.model).name,
        "max_batch": args.max_batch,
        "max_queue": args.max_queue,
        "prefill_chunk": args.prefill_chunk,
        "overlap_prefill": args.overlap_prefill,
        "read_ahead": args.read_ahead,
        "warm_up": args.warm_up,
        "context_len": args.max_model_len,
        "chat_template": template,
        "keep_special_tokens": args.keep_special_tokens,
        "seed": args.seed,
    }
    config = EngineConfig(
        args.model,
        routes,
        guardrails,
        args.device,
        args.dtype,
        args.threads,
        options,
        args.tensor_parallel,
    )
    if args.tensor_parallel > 1 and launched_rank() != 0:
        return follow(config)
    log_to_stderr()
    keys = ApiKeys.from_sources(args.api_key)
    if not keys and not is_loopback(args.host):
        logger.warning(
            "serving %s without an API key: anyone who reaches this port may use the model "
            "(give --api-key or set %s)",
            args.host,
            API_KEY_ENV,
        )
    limits = Limits(
        args.max_body_bytes,
        args.max_messages,
        args.max_stop,
        args.max_prompt_tokens,
        args.max_tokens_limit,
    )
    engine = ProcessEngine(config) if args.engine_process else config.build()
    app = create_app(
        engine,
        keys=keys,
        limits=limits,
        drain=Drain(args.drain_timeout),
        metrics_auth=args.metrics_auth,
    )
    run_server(app, args.host, args.port, args.log_level, args.drain_timeout)
    return 0


def follow(config: EngineConfig) -> int:
    """A rank other than 0 of `serve --tensor-parallel N`: no server; its scheduler runs rank
    0's steps on this thread until rank 0's closes (`specdec_fast.serving.lockstep`). Once it
    serves, signals are left to rank 0, whose drain ends this rank too: a rank that left on its
    own would leave the others waiting in a collective."""
    service = config.build()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        service.scheduler.follow()
    finally:
        service.close()
    return 0
