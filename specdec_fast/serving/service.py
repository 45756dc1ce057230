"""`Service`: what `specdec-fast serve` serves, in the server's own process: the model and
tokenizer, one continuous-batching `Scheduler` on a thread of its own, the router and the
metrics. `specdec_fast.serving.engine_process.ProcessEngine` runs one in a child process.
"""

from __future__ import annotations

from collections.abc import Callable

from specdec_fast.cache import model_shards
from specdec_fast.compiled import compile_by_default
from specdec_fast.guardrails import Guardrails
from specdec_fast.parallel import finish_ranks, leave_ranks
from specdec_fast.serving.metrics import ServingMetrics
from specdec_fast.serving.routes import RouteConfig, Router
from specdec_fast.serving.scheduler import (
    Completion,
    Handle,
    QueueFull,
    Request,
    Scheduler,
    SchedulerStopped,
)
from specdec_fast.serving.warmup import warm_up as run_warm_up
from specdec_fast.text import stop_token_ids


class Service:
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
        read_ahead: the scheduler's: each decode step queued before the one before is read.
        after_step: the scheduler's: called at the end of each of its steps.
        warm_up: serve synthetic requests on every route before the scheduler starts, so that
            the first requests do not wait for compilations (`serving.warmup`). None (default):
            when the steps compile (`compile`, else `SPECDEC_COMPILE`).
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
        read_ahead: bool | None = None,
        after_step: Callable[[], None] | None = None,
        warm_up: bool | None = None,
    ):
        if warm_up is not None and not isinstance(warm_up, bool):
            raise TypeError(f"warm_up: expected None or a bool, got {warm_up!r}")
        self.model, self.tokenizer, self.model_name = model, tokenizer, model_name
        self.keep_special_tokens = keep_special_tokens
        if chat_template is not None:
            tokenizer.chat_template = chat_template
        text_config = model.config.get_text_config(decoder=True)
        self.vocab_size = text_config.vocab_size
        self.context_len = context_len or text_config.max_position_embeddings
        factories: dict[tuple, object] = {}
        for route in routes:
            spec = route.spec
            key = (spec.kind, spec.path)
            if spec.info is not None and key not in factories:
                factories[key] = spec.factory(model)

        def route_drafters() -> dict:
            return {
                route.name: None
                if route.spec.info is None
                else factories[(route.spec.kind, route.spec.path)](route.spec.size)
                for route in routes
            }

        drafters = route_drafters()
        width = max((d.max_nodes for d in drafters.values() if d is not None), default=1)
        options = {
            "max_batch": max_batch,
            "max_queue": max_queue,
            "max_cache_len": self.context_len + width,
            "prefill_chunk": prefill_chunk,
            "eos_token_id": stop_token_ids(model, tokenizer),
            "compile": compile,
            "overlap_prefill": overlap_prefill,
            "read_ahead": read_ahead,
        }
        sharded = model_shards(model) > 1
        if warm_up and sharded:
            raise ValueError(
                "warm_up: a tensor-parallel target runs its steps eagerly, in lockstep with its "
                "other ranks; there is nothing to warm up"
            )
        if warm_up is None:
            warm_up = not sharded and (compile_by_default() if compile is None else compile)
        # The warm-up's own drafters, from the same factories: its scheduler ends them.
        self.warm_up = run_warm_up(model, route_drafters(), **options) if warm_up else []
        self.scheduler = Scheduler(
            model,
            drafters,
            guardrails=guardrails or Guardrails(),
            after_step=after_step,
            **options,
        )
        self.metrics: ServingMetrics | None = None
        self.mailbox = None  # the server's delivery to its event loop (set at start-up)
        self.router = Router(self.scheduler, routes, model_name, self._observe, seed)
        self.metrics = ServingMetrics(self.scheduler, self.router, model_name)

    def _observe(self, route: str, completion: Completion) -> None:
        if self.metrics is not None:
            self.metrics.observe(route, completion)

    def start(self) -> None:
        self.scheduler.start()

    def close(self) -> None:
        """Close the scheduler; a rank of a tensor-parallel target then leaves its group: with
        the others when the stop plan reached every rank (`parallel.finish_ranks`), alone when
        rank 0 failed (the others then lose it in their collectives)."""
        self.scheduler.close()
        if model_shards(self.model) == 1:
            return
        if self.scheduler.ranks_stopped:
            finish_ranks()
        else:
            leave_ranks()

    def submit_now(self, route: str, request: Request) -> Handle:
        """`request` on `route` through the router; a refusal (`QueueFull`, `SchedulerStopped`)
        is counted in the metrics, then raised; a `ValueError` names a bad request."""
        try:
            return self.router.submit(route, request)
        except QueueFull:
            self.metrics.reject("queue_full")
            raise
        except SchedulerStopped:
            self.metrics.reject("stopped")
            raise

    # The server's interface, shared with `ProcessEngine` (whose answers come from its child).

    async def submit(self, route: str, request: Request) -> Handle:
        """`submit_now`: its callbacks run on the scheduler's thread."""
        return self.submit_now(route, request)

    async def metrics_text(self) -> bytes:
        """The /metrics body."""
        return self.metrics.render()

    async def healthy(self) -> bool:
        """Whether requests are being served."""
        return self.scheduler.alive
