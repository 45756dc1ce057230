"""`specdec-fast serve`: an OpenAI-compatible HTTP server on FastAPI and uvicorn.

Endpoints: `POST /v1/completions` and `POST /v1/chat/completions` (streamed as server-sent
events with `stream: true`, else one JSON response; `specdec_fast.serving.protocol` lists the
fields), `GET /v1/models` (the served model name, every route name and alias), `GET /health`
(200 while the scheduler serves, 503 otherwise) and `GET /metrics` (Prometheus,
`specdec_fast.serving.metrics`).

Requests are routed (`specdec_fast.serving.routes`) and decoded by one continuous-batching
`Scheduler` on its own thread; tokens travel to the event loop as they are accepted and are
decoded there incrementally. Errors use OpenAI's error shape: 400 for a malformed request (bad
JSON, an unknown model or route, a bad field, a prompt over the context), 429 when the queue of
waiting requests is full, 503 when the scheduler has stopped; a request's `X-Request-Id` comes
back on every response to it, errors included. A client that disconnects, from a
stream or while waiting for a whole response, has its request cancelled: its slot goes to the
next request.

    engine = ServingEngine(model, tokenizer, server_routes("ngram", []))
    uvicorn.run(create_app(engine), host="127.0.0.1", port=8000)
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from specdec_fast.guardrails import Guardrails
from specdec_fast.serving.metrics import ServingMetrics
from specdec_fast.serving.protocol import (
    CHAT,
    COMPLETION,
    GenerationParams,
    RequestError,
    TextStream,
    chunk,
    error_body,
    finish_reason,
    new_id,
    parse_request,
    response,
    sse,
    usage,
)
from specdec_fast.serving.routes import ROUTE_HEADER, RouteConfig, Router
from specdec_fast.serving.scheduler import (
    FAILED,
    Completion,
    QueueFull,
    Scheduler,
    SchedulerStopped,
)
from specdec_fast.serving.scheduler import Request as SchedulerRequest
from specdec_fast.text import stop_token_ids

REQUEST_ID_HEADER = "X-Request-Id"
RETRY_AFTER_S = "1"


class ServingEngine:
    """What a server serves: the model and tokenizer, one scheduler for every route (drafters
    built through the registry, one per route), the router and the metrics.

    Args:
        model, tokenizer: the target and its tokenizer.
        routes: the routes (`server_routes`); a drafter SPEC used by several routes loads its
            checkpoint once.
        guardrails: policies by route name (default: the default policy everywhere).
        model_name: the name `/v1/models` lists and requests give (the default route).
        max_batch, max_queue, prefill_chunk: the scheduler's (`Scheduler`).
        context_len: prompt plus completion tokens a request may hold (default: the model's
            `max_position_embeddings`).
        chat_template: a Jinja chat template for tokenizers without one (or to replace it).
        keep_special_tokens: keep special tokens in the returned text.
        seed: of the canary draws.
        compile: compile the model's steps (`generate`'s `compile`).
        overlap_prefill: the scheduler's (`Scheduler`): prompts fed beside the decode steps.
    """

    def __init__(
        self,
        model,
        tokenizer,
        routes: list[RouteConfig],
        *,
        guardrails: Guardrails | None = None,
        model_name: str = "specdec-fast",
        max_batch: int = 16,
        max_queue: int = 256,
        prefill_chunk: int = 256,
        context_len: int | None = None,
        chat_template: str | None = None,
        keep_special_tokens: bool = False,
        seed: int = 0,
        compile: bool | None = None,
        overlap_prefill: bool | None = None,
    ):
        self.model, self.tokenizer, self.model_name = model, tokenizer, model_name
        self.keep_special_tokens = keep_special_tokens
        if chat_template is not None:
            tokenizer.chat_template = chat_template
        text_config = model.config.get_text_config(decoder=True)
        self.vocab_size = text_config.vocab_size
        self.context_len = context_len or text_config.max_position_embeddings
        factories: dict[tuple, object] = {}
        drafters = {}
        for route in routes:
            spec = route.spec
            key = (spec.kind, spec.path)
            if spec.info is not None and key not in factories:
                factories[key] = spec.factory(model)
            drafters[route.name] = None if spec.info is None else factories[key](spec.size)
        width = max((d.max_nodes for d in drafters.values() if d is not None), default=1)
        self.scheduler = Scheduler(
            model,
            drafters,
            guardrails=guardrails or Guardrails(),
            max_batch=max_batch,
            max_queue=max_queue,
            max_cache_len=self.context_len + width,
            prefill_chunk=prefill_chunk,
            eos_token_id=stop_token_ids(model, tokenizer),
            compile=compile,
            overlap_prefill=overlap_prefill,
        )
        self.metrics: ServingMetrics | None = None
        self.mailbox: _Mailbox | None = None  # the serving event loop's (set at start-up)
        self.router = Router(self.scheduler, routes, model_name, self._observe, seed)
        self.metrics = ServingMetrics(self.scheduler, self.router, model_name)

    def _observe(self, route: str, completion: Completion) -> None:
        if self.metrics is not None:
            self.metrics.observe(route, completion)

    def start(self) -> None:
        self.scheduler.start()

    def close(self) -> None:
        self.scheduler.close()


def _error(status: int, message: str, kind: str, param=None, code=None, headers=None):
    return JSONResponse(error_body(message, kind, param, code), status, headers=headers)


def _echoed(request: Request) -> dict[str, str]:
    """The client's request id, for the response's headers (errors included), if it sent one."""
    given = request.headers.get(REQUEST_ID_HEADER)
    return {} if given is None else {REQUEST_ID_HEADER: given}


def create_app(engine: ServingEngine) -> FastAPI:
    """The FastAPI application over `engine`; its lifespan starts and closes the scheduler."""

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

    app = FastAPI(title="specdec-fast", lifespan=lifespan)
    app.state.engine = engine

    @app.exception_handler(RequestError)
    async def request_error(request: Request, error: RequestError):
        return JSONResponse(error.body(), error.status, headers=_echoed(request))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException):
        return _error(error.status_code, str(error.detail), "invalid_request_error")

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError):
        return _error(400, str(error), "invalid_request_error")

    @app.get("/health")
    async def health():
        if not engine.scheduler.alive:
            return _error(503, "the scheduler is not running", "server_error", code="stopped")
        return {"status": "ok"}

    @app.get("/v1/models")
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

    @app.get("/metrics")
    async def metrics():
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _generate(engine, request, COMPLETION)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _generate(engine, request, CHAT)

    return app


class _Mailbox:
    """Deliveries from the scheduler's thread to queues of the event loop: one wake-up of the
    loop carries everything posted since the last (a step's tokens for every stream), so that
    the loop takes the interpreter from the scheduler's thread once per step, not per request."""

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
    token lists, then the `Completion`."""

    def __init__(self, mailbox: _Mailbox):
        self.mailbox = mailbox
        self.queue: asyncio.Queue = asyncio.Queue()

    def put(self, item) -> None:
        self.mailbox.post(self.queue, item)


async def _generate(engine: ServingEngine, request: Request, kind: str):
    body = await request.body()
    params = parse_request(body, kind, engine.tokenizer, engine.vocab_size, engine.context_len)
    route = engine.router.resolve(params.model, request.headers.get(ROUTE_HEADER))
    events = _Events(engine.mailbox)
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
        on_finish=events.put,
    )
    try:
        handle = engine.router.submit(route, scheduled)
    except QueueFull as error:
        engine.metrics.reject("queue_full")
        return _error(
            429,
            str(error),
            "rate_limit_error",
            code="queue_full",
            headers={"Retry-After": RETRY_AFTER_S} | _echoed(request),
        )
    except SchedulerStopped as error:
        engine.metrics.reject("stopped")
        return _error(503, str(error), "server_error", code="stopped", headers=_echoed(request))
    except ValueError as error:
        raise RequestError(str(error)) from None
    request_id = new_id(kind)
    headers = {REQUEST_ID_HEADER: request.headers.get(REQUEST_ID_HEADER, request_id)}
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
            handle.cancel()
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
    uvicorn until interrupted."""
    import uvicorn

    from specdec_fast.loading import load_model, load_tokenizer, pick_device
    from specdec_fast.serving.routes import load_routes, server_routes

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    extra = load_routes(args.routes) if args.routes else []
    routes = server_routes(
        str(args.drafter), extra, mode="shadow" if args.shadow else "speculate", canary=args.canary
    )
    guardrails = Guardrails.from_yaml(Path(args.guardrails)) if args.guardrails else None
    template = None
    if args.chat_template is not None:
        path = Path(args.chat_template)
        template = path.read_text() if path.is_file() else args.chat_template
    model = load_model(args.model, pick_device(args.device), args.dtype)
    tokenizer = load_tokenizer(args.model)
    engine = ServingEngine(
        model,
        tokenizer,
        routes,
        guardrails=guardrails,
        model_name=args.served_model_name or Path(args.model).name,
        max_batch=args.max_batch,
        max_queue=args.max_queue,
        prefill_chunk=args.prefill_chunk,
        overlap_prefill=args.overlap_prefill,
        context_len=args.max_model_len,
        chat_template=template,
        keep_special_tokens=args.keep_special_tokens,
        seed=args.seed,
    )
    uvicorn.run(create_app(engine), host=args.host, port=args.port, log_level=args.log_level)
    return 0
