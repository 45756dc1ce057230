"""The server's `/metrics`: Prometheus metrics through `prometheus_client`, with vLLM's names.

Request metrics (labels `model_name`, `route`), observed when a served request ends:
`vllm:time_to_first_token_seconds` (from arrival, queueing included),
`vllm:inter_token_latency_seconds` (amortized over the tokens of a step),
`vllm:request_time_per_output_token_seconds`, `vllm:e2e_request_latency_seconds`,
`vllm:request_queue_time_seconds`, `vllm:prompt_tokens_total`, `vllm:generation_tokens_total`,
`vllm:request_success_total` (label `finished_reason`: stop, length, abort, error).

Read from the scheduler at each scrape: `vllm:num_requests_running`, `vllm:num_requests_waiting`,
and vLLM's spec-decode counters per route: `vllm:spec_decode_num_drafts_total` (row-steps that
verified draft tokens), `vllm:spec_decode_num_draft_tokens_total`,
`vllm:spec_decode_num_accepted_tokens_total` and
`vllm:spec_decode_num_accepted_tokens_per_pos_total` (label `position`, 0-based as in vLLM).

specdec's own, by route: the guardrail families of `specdec_fast.metrics`
(`specdec_route_speculating`, `specdec_route_fallbacks_total`, `specdec_route_probes_total`,
`specdec_route_drafter_errors_total`), `specdec_route_trips_total` (times running rows were
moved to plain decoding), `specdec_route_speculative_requests_total` (requests drawn to
speculate), `specdec_shadow_requests_total`, `specdec_shadow_mismatches_total` and
`specdec_shadow_skipped_total`; `specdec_requests_rejected_total` (label `reason`:
queue_full, stopped); and where the scheduler's time goes: `specdec_decode_steps_total` and
`specdec_decode_step_seconds_total` (label `batch`), `specdec_decode_steps_queued_total`
(steps queued before the step ahead of them was read: read-ahead), `specdec_prefill_chunks_total`,
`specdec_prefill_tokens_total`, `specdec_prefill_seconds_total`,
`specdec_prefill_beside_seconds_total`.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from specdec_fast.metrics import LATENCY_BUCKETS_S, ROUTE_FAMILIES
from specdec_fast.serving.protocol import finish_reason
from specdec_fast.serving.routes import Router
from specdec_fast.serving.scheduler import FAILED, Completion, Scheduler

REQUEST_BUCKETS_S = (*LATENCY_BUCKETS_S, 20.0, 30.0, 60.0, 120.0)
LABELS = ("model_name", "route")


class ServingMetrics:
    """Every metric of one server, in its own registry (`render()` is the /metrics body)."""

    def __init__(self, scheduler: Scheduler, router: Router, model_name: str):
        self.model_name = model_name
        self.registry = CollectorRegistry()

        def histogram(name: str, help_text: str, buckets=LATENCY_BUCKETS_S) -> Histogram:
            return Histogram(name, help_text, LABELS, buckets=buckets, registry=self.registry)

        self.ttft = histogram(
            "vllm:time_to_first_token_seconds", "Time to first token, from arrival."
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds",
            "Inter-token latency, amortized over the tokens a step emits.",
        )
        self.tpot = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Time per output token after the first, per request.",
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds", "Arrival to last token.", REQUEST_BUCKETS_S
        )
        self.queue = histogram(
            "vllm:request_queue_time_seconds", "Arrival to admission.", REQUEST_BUCKETS_S
        )
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Prompt tokens of ended requests.", LABELS, registry=self.registry
        )
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Generated tokens.", LABELS, registry=self.registry
        )
        self.success = Counter(
            "vllm:request_success",
            "Ended requests by finish reason.",
            (*LABELS, "finished_reason"),
            registry=self.registry,
        )
        self.rejected = Counter(
            "specdec_requests_rejected",
            "Requests refused before queueing (429 queue_full, 503 stopped).",
            ("model_name", "reason"),
            registry=self.registry,
        )
        self.registry.register(_SchedulerCollector(scheduler, router, model_name))

    def observe(self, route: str, completion: Completion) -> None:
        """A served request ended (called on the scheduler's thread)."""
        labels = (self.model_name, route)
        stats = completion.stats
        if stats.ttft is not None:
            self.ttft.labels(*labels).observe(stats.ttft)
        for value in stats.itl:
            self.itl.labels(*labels).observe(value)
        if stats.tpot is not None:
            self.tpot.labels(*labels).observe(stats.tpot)
        self.e2e.labels(*labels).observe(completion.finished - completion.arrival)
        if completion.admitted is not None:
            self.queue.labels(*labels).observe(completion.admitted - completion.arrival)
        self.prompt_tokens.labels(*labels).inc(stats.prompt_tokens)
        self.generation_tokens.labels(*labels).inc(len(completion.tokens))
        reason = (
            FAILED
            if completion.finish_reason == FAILED
            else finish_reason(completion.finish_reason)
        )
        self.success.labels(*labels, reason).inc()

    def reject(self, reason: str) -> None:
        self.rejected.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _SchedulerCollector:
    """Gauges and counters read from the scheduler and the router at scrape time."""

    def __init__(self, scheduler: Scheduler, router: Router, model_name: str):
        self.scheduler, self.router, self.model_name = scheduler, router, model_name

    def describe(self):
        return []

    def collect(self):
        model, scheduler = self.model_name, self.scheduler
        for name, help_text, value in (
            ("vllm:num_requests_running", "Requests holding a batch slot.", scheduler.running),
            ("vllm:num_requests_waiting", "Requests queued for a slot.", scheduler.waiting),
        ):
            gauge = GaugeMetricFamily(name, help_text, labels=["model_name"])
            gauge.add_metric([model], value)
            yield gauge
        steps = scheduler.counters
        decode = sorted(steps.decode.items())
        for name, help_text, index in (
            ("specdec_decode_steps", "Decode steps, by batch size.", 0),
            ("specdec_decode_step_seconds", "Time in decode steps, by batch size.", 1),
        ):
            family = CounterMetricFamily(name, help_text, labels=["model_name", "batch"])
            for batch, values in decode:
                family.add_metric([model, str(batch)], values[index])
            yield family
        for name, help_text, value in (
            (
                "specdec_decode_steps_queued",
                "Decode steps queued before the step ahead of them was read (read-ahead).",
                steps.queued,
            ),
            (
                "specdec_prefill_chunks",
                "Prompt chunks fed between decode steps.",
                steps.prefill_chunks,
            ),
            ("specdec_prefill_tokens", "Prompt tokens fed.", steps.prefill_tokens),
            (
                "specdec_prefill_seconds",
                "Time the scheduler's thread spent on prompts.",
                steps.prefill_seconds,
            ),
            (
                "specdec_prefill_beside_seconds",
                "Time of prompt chunks fed beside the decode steps, on their own thread.",
                steps.prefill_beside_seconds,
            ),
        ):
            family = CounterMetricFamily(name, help_text, labels=["model_name"])
            family.add_metric([model], value)
            yield family
        lanes = sorted(scheduler.lanes.items())
        speculative = [(route, lane) for route, lane in lanes if lane.drafter is not None]
        for name, help_text, value_of in (
            ("vllm:spec_decode_num_drafts", "Row-steps that verified draft tokens.", "drafts"),
            ("vllm:spec_decode_num_draft_tokens", "Draft tokens verified.", "draft_tokens"),
            ("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", "accepted_tokens"),
            ("specdec_route_trips", "Times running rows moved to plain decoding.", "trips"),
        ):
            family = CounterMetricFamily(name, help_text, labels=list(LABELS))
            for route, lane in speculative:
                family.add_metric([model, route], getattr(lane.counters, value_of))
            yield family
        family = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each position (0: the first after the root).",
            labels=[*LABELS, "position"],
        )
        for route, lane in speculative:
            for position, count in enumerate(list(lane.counters.accepted_per_position)):
                family.add_metric([model, route, str(position)], count)
        yield family
        guards = [(route, lane.guard) for route, lane in speculative if lane.guard is not None]
        for name, kind, help_text, value_of in ROUTE_FAMILIES:
            make = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            family = make(f"specdec_{name.removesuffix('_total')}", help_text, labels=list(LABELS))
            for route, guard in guards:
                family.add_metric([model, route], value_of(guard))
            yield family
        router = self.router
        family = CounterMetricFamily(
            "specdec_route_speculative_requests",
            "Requests drawn to speculate (the canary share of speculate-mode routes).",
            labels=list(LABELS),
        )
        for route, count in sorted(router.canary_speculating.items()):
            if router.routes[route].spec.info is not None:
                family.add_metric([model, route], count)
        yield family
        shadows = [
            (r, c) for r, c in sorted(router.shadow.items()) if router.routes[r].mode == "shadow"
        ]
        for name, help_text, field_name in (
            (
                "specdec_shadow_requests",
                "Shadow copies compared with the served output.",
                "requests",
            ),
            ("specdec_shadow_mismatches", "Shadow copies whose output differed.", "mismatches"),
            ("specdec_shadow_skipped", "Shadow copies skipped for a full queue.", "skipped"),
        ):
            family = CounterMetricFamily(name, help_text, labels=list(LABELS))
            for route, counters in shadows:
                family.add_metric([model, route], getattr(counters, field_name))
            yield family
