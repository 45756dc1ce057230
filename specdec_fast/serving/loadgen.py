"""The load generator behind `specdec-fast bench --url URL --qps 1,4,16 --duration S`.

For each QPS level, requests arrive as a Poisson process (exponential gaps drawn from a seeded
generator, as vLLM's serving benchmark does) for `duration`
seconds (or until `num_requests`), each streaming a completion (`/v1/completions` for a prompt,
`/v1/chat/completions` for chat messages) of the JSONL prompt set, taken in order and cycled.
Every level runs once on the plain route (speculation off) and once on each speculative route,
with the same arrival times and prompts, one after the other.

Per request: TTFT (send to first token), ITL (each streamed step's gap amortized over its
tokens, counted from `stream_options.continuous_usage_stats`), TPOT ((last - first token) /
(tokens - 1)) and end-to-end latency; per level and route: their p50/p95/p99, tokens/s,
requests/s, goodput (requests/s meeting every SLO given), the mean concurrency, errors, and the
acceptance measured from the server's spec-decode counters (`/metrics` before and after).
Greedy outputs of a speculative route are compared with the plain route's for the same request.

`write_serving_report` writes report.json, report.md and the PNG plots in the offline harness's
format (`specdec_fast.harness.report`), with QPS in place of the batch size: every speculative
route at a level is a cell, the plain route at that level its baseline, and the speed-up the
TPOT p50 ratio.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from specdec_fast.harness import versions
from specdec_fast.harness.prompts import PromptRecord
from specdec_fast.harness.report import write_report
from specdec_fast.harness.sweep import compare_outputs
from specdec_fast.serving.routes import PLAIN_ROUTE, ROUTE_HEADER
from specdec_fast.serving.server import REQUEST_ID_HEADER
from specdec_fast.stats import percentile

PERCENTILES = (50, 95, 99)
SPEC_COUNTERS = {
    "drafts": "vllm:spec_decode_num_drafts",
    "draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "accepted_tokens": "vllm:spec_decode_num_accepted_tokens",
}
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"
ENDED = "vllm:request_success"
REJECTED = "specdec_requests_rejected"
REQUEST_TIMEOUT_S = 600.0


@dataclass
class LoadConfig:
    """One sweep.

    url: the server's base URL. qps: arrival rates (requests/s). duration: seconds
    of arrivals per level; num_requests: or this many requests per level (whichever ends
    first when both are given). routes: the speculative routes to measure; baseline: the route
    with speculation off. max_new_tokens: for prompts without their own. goodput: SLOs in
    seconds by metric ("ttft", "tpot", "e2e"). seed: of the arrival times. rounds: each level is
    run in this many segments (of `duration / rounds` seconds, `num_requests / rounds` requests),
    the routes taking turns segment by segment, so that a drifting machine affects them alike
    (segment k draws its arrivals with seed + k).
    """

    url: str
    qps: list[float]
    duration: float | None = 60.0
    num_requests: int | None = None
    routes: list[str] = field(default_factory=lambda: ["default"])
    baseline: str = PLAIN_ROUTE
    max_new_tokens: int = 64
    goodput: dict[str, float] = field(default_factory=dict)
    seed: int = 0
    noise_floor: float = 0.05
    rounds: int = 1

    def __post_init__(self) -> None:
        if not self.qps or any(not 0 < q < math.inf for q in self.qps):
            raise ValueError(f"qps: expected positive finite rates, got {self.qps}")
        if self.duration is None and self.num_requests is None:
            raise ValueError("duration: give a duration, a number of requests, or both")
        if self.duration is not None and not self.duration > 0:
            raise ValueError(f"duration: expected seconds > 0, got {self.duration}")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError(f"num_requests: expected >= 1, got {self.num_requests}")
        if self.rounds < 1:
            raise ValueError(f"rounds: expected >= 1, got {self.rounds}")
        unknown = set(self.goodput) - {"ttft", "tpot", "e2e"}
        if unknown:
            raise ValueError(f"goodput: unknown metrics {sorted(unknown)}; known: ttft, tpot, e2e")


@dataclass
class RequestRecord:
    """What one request measured (seconds; None where it does not apply)."""

    index: int
    prompt_index: int
    route: str
    sent: float
    ttft: float | None = None
    tpot: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    tokens: int = 0
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    status: int | None = None
    request_id: str | None = None


def arrival_times(qps: float, duration: float | None, count: int | None, seed: int) -> list[float]:
    """Send times (seconds from the start) of a Poisson process of rate `qps`, seeded: until
    `duration` or `count` arrivals, whichever comes first."""
    rng = random.Random(seed)
    times, now = [], 0.0
    while count is None or len(times) < count:
        now += rng.expovariate(qps)
        if duration is not None and now > duration:
            break
        times.append(now)
    return times


def _body(record: PromptRecord, route: str, max_new_tokens: int) -> tuple[str, dict]:
    body = {
        "model": route,
        "max_tokens": record.max_new_tokens or max_new_tokens,
        "temperature": record.temperature,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    if record.messages is not None:
        return "/v1/chat/completions", body | {"messages": record.messages}
    return "/v1/completions", body | {"prompt": record.prompt}


async def _request(
    client: httpx.AsyncClient, config: LoadConfig, record: PromptRecord, out: RequestRecord
) -> None:
    """Send one streamed request and fill `out` (an error string on any failure)."""
    path, body = _body(record, out.route, config.max_new_tokens)
    headers = {ROUTE_HEADER: out.route, REQUEST_ID_HEADER: str(out.index)}
    start = time.perf_counter()
    first = last = None
    try:
        async with client.stream("POST", config.url + path, json=body, headers=headers) as reply:
            out.status = reply.status_code
            out.request_id = reply.headers.get(REQUEST_ID_HEADER)
            if reply.status_code != 200:
                message = json.loads(await reply.aread()).get("error", {}).get("message")
                out.error = f"HTTP {reply.status_code}: {message}"
                return
            async for line in reply.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: ") :])
                if "error" in event:
                    out.error = event["error"].get("message", "error")
                    return
                now = time.perf_counter()
                for choice in event.get("choices", []):
                    out.text += choice.get("text") or choice.get("delta", {}).get("content") or ""
                    out.finish_reason = choice.get("finish_reason") or out.finish_reason
                tokens = (event.get("usage") or {}).get("completion_tokens", out.tokens)
                new = tokens - out.tokens
                if new > 0:
                    if first is None:
                        first = now
                        out.ttft = now - start
                        out.itl += [0.0] * (new - 1)
                    else:
                        out.itl += [(now - last) / new] * new
                    last = now
                    out.tokens = tokens
    except (httpx.HTTPError, json.JSONDecodeError, ValueError) as error:
        out.error = f"{type(error).__name__}: {error}"
        return
    out.e2e = time.perf_counter() - start
    if out.tokens >= 2:
        out.tpot = (last - first) / (out.tokens - 1)
    if out.finish_reason is None:
        out.error = "the stream ended without a finish reason"


# The scheduler's prompt counters (`specdec_<name>_total`), read into `_scrape`'s dict.
PREFILL_COUNTERS = ("prefill_seconds", "prefill_beside_seconds", "prefill_tokens")


async def _scrape(client: httpx.AsyncClient, url: str) -> dict:
    """From `/metrics`: per route its spec-decode counters and ended requests
    ({route: {name: value, "ended": n, "positions": {p: n}}}); "rejected": requests the server
    refused (429/503); the scheduler's time: "decode" {B: [steps, seconds]}, "prefill_seconds",
    "prefill_beside_seconds", "prefill_tokens"."""
    reply = await client.get(url + "/metrics")
    reply.raise_for_status()
    routes: dict[str, dict] = {}
    out = {"routes": routes, "rejected": 0.0, "decode": {}} | dict.fromkeys(PREFILL_COUNTERS, 0.0)
    names = {f"{metric}_total": key for key, metric in SPEC_COUNTERS.items()}
    names[f"{ENDED}_total"] = "ended"
    for family in text_string_to_metric_families(reply.text):
        for sample in family.samples:
            name = sample.name.removesuffix("_total")
            if name == REJECTED:
                out["rejected"] += sample.value
            elif name.removeprefix("specdec_") in PREFILL_COUNTERS:
                out[name.removeprefix("specdec_")] += sample.value
            elif name in ("specdec_decode_steps", "specdec_decode_step_seconds"):
                steps = out["decode"].setdefault(int(sample.labels["batch"]), [0.0, 0.0])
                steps[name == "specdec_decode_step_seconds"] += sample.value
            route = sample.labels.get("route")
            if route is None:
                continue
            counters = routes.setdefault(route, {"positions": {}})
            if sample.name in names:
                key = names[sample.name]
                counters[key] = counters.get(key, 0.0) + sample.value
            elif sample.name == f"{PER_POSITION}_total":
                counters["positions"][int(sample.labels["position"])] = sample.value
    return out


async def _route_info(client: httpx.AsyncClient, url: str) -> dict[str, dict]:
    reply = await client.get(url + "/v1/models")
    reply.raise_for_status()
    return {m["id"]: m.get("specdec", {}) for m in reply.json()["data"]}


async def run_level(
    client: httpx.AsyncClient,
    config: LoadConfig,
    prompts: Sequence[PromptRecord],
    qps: float,
    route: str,
    segment: int = 0,
    first: int = 0,
) -> tuple[list[RequestRecord], float, dict]:
    """One segment of a level on one route: (records, wall seconds, server counter deltas).
    Requests are numbered from `first` (the number is their id and picks their prompt)."""
    duration = None if config.duration is None else config.duration / config.rounds
    count = None if config.num_requests is None else -(-config.num_requests // config.rounds)
    times = arrival_times(qps, duration, count, config.seed + segment)
    before = await _scrape(client, config.url)
    records = [
        RequestRecord(i, i % len(prompts), route, sent) for i, sent in enumerate(times, first)
    ]
    start = time.perf_counter()

    async def send(record: RequestRecord) -> None:
        await asyncio.sleep(max(0.0, start + record.sent - time.perf_counter()))
        await _request(client, config, prompts[record.prompt_index], record)

    await asyncio.gather(*(send(record) for record in records))
    wall = time.perf_counter() - start
    after = await _scrape(client, config.url)
    delta = _delta(before["routes"].get(route, {}), after["routes"].get(route, {}))
    for key in ("rejected", *PREFILL_COUNTERS):
        delta[key] = after[key] - before[key]
    delta["decode"] = {
        batch: [a - b for a, b in zip(steps, before["decode"].get(batch, [0.0, 0.0]), strict=True)]
        for batch, steps in sorted(after["decode"].items())
    }
    return records, wall, delta


def _delta(before: dict, after: dict) -> dict:
    out = {key: after.get(key, 0.0) - before.get(key, 0.0) for key in (*SPEC_COUNTERS, "ended")}
    positions = after.get("positions", {})
    out["positions"] = [
        positions[p] - before.get("positions", {}).get(p, 0.0) for p in sorted(positions)
    ]
    return out


def _percentiles(samples: list[float]) -> dict[str, float | None]:
    return {f"p{q}": percentile(samples, q) for q in PERCENTILES}


def level_metrics(records: list[RequestRecord], wall: float, counters: dict, goodput: dict) -> dict:
    """The harness's cell metrics for one level and route, plus the serving figures."""
    done = [r for r in records if r.error is None]
    tokens = sum(r.tokens for r in done)
    good = [
        r
        for r in done
        if all(
            getattr(r, metric) is not None and getattr(r, metric) <= bound
            for metric, bound in goodput.items()
        )
    ]
    drafts, draft_tokens = counters.get("drafts", 0.0), counters.get("draft_tokens", 0.0)
    accepted = counters.get("accepted_tokens", 0.0)
    return {
        "requests": len(records),
        "completed": len(done),
        "new_tokens": tokens,
        "tokens_per_second": tokens / wall if wall else None,
        "requests_per_second": len(done) / wall if wall else None,
        "goodput_requests_per_second": len(good) / wall if wall else None,
        "mean_concurrency": sum(r.e2e for r in done) / wall if wall else None,
        "ttft_s": _percentiles([r.ttft for r in done if r.ttft is not None]),
        "tpot_s": _percentiles([r.tpot for r in done if r.tpot is not None]),
        "itl_s": _percentiles([x for r in done for x in r.itl]),
        "e2e_s": _percentiles([r.e2e for r in done]),
        "error_rate": (len(records) - len(done)) / len(records) if records else 0.0,
        "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
        "mean_accepted_tokens_per_step": 1.0 + accepted / drafts if drafts else None,
        "per_position_acceptance": [p / drafts for p in counters.get("positions", [])]
        if drafts
        else [],
        "drafted_tokens": draft_tokens,
        "accepted_tokens": accepted,
        "peak_memory_bytes": None,
        "cost_per_1k_output_tokens": None,
        "wall_time_s": wall,
        "experienced_concurrency": _percentiles(experienced_concurrency(done)),
        "scheduler": _scheduler_time(counters, wall),
    }


def experienced_concurrency(records: list[RequestRecord]) -> list[float]:
    """Per request, the mean number of requests in flight during its life (itself included):
    the batch it was decoded in, as the client sees it."""
    spans = [(r.sent, r.sent + r.e2e) for r in records]
    out = []
    for start, end in spans:
        overlap = sum(max(0.0, min(end, e) - max(start, s)) for s, e in spans)
        out.append(overlap / (end - start) if end > start else 1.0)
    return out


def _scheduler_time(counters: dict, wall: float) -> dict:
    """The server's step counters over a level: mean decode step by batch size, and the share
    of the wall time spent decoding and feeding prompts (on the scheduler's thread, and beside
    its steps on the prefill thread)."""
    decode = {b: s for b, s in counters.get("decode", {}).items() if s[0] > 0}
    decode_s = sum(seconds for _, seconds in decode.values())
    return {
        "decode_steps_by_batch": {b: int(count) for b, (count, _) in decode.items()},
        "decode_step_s_by_batch": {b: seconds / count for b, (count, seconds) in decode.items()},
        "decode_share": decode_s / wall if wall else None,
        "prefill_share": counters.get("prefill_seconds", 0.0) / wall if wall else None,
        "prefill_beside_share": (
            counters.get("prefill_beside_seconds", 0.0) / wall if wall else None
        ),
        "prefill_tokens": int(counters.get("prefill_tokens", 0.0)),
    }


def _quality(prompts, records, baseline) -> dict:
    """Outputs of a route against the baseline route's, request by request (the harness's
    `compare_outputs`: greedy exact matches, checks, divergences); "first_differing_token" is
    then a character offset."""
    theirs = {r.index: r for r in baseline if r.error is None}
    return compare_outputs(
        (prompts[r.prompt_index], r.text, theirs[r.index].text, r.text, theirs[r.index].text)
        for r in records
        if r.error is None and r.index in theirs
    )


def _task_splits(prompts, records, baseline) -> dict:
    def mean_tpot(rows):
        values = [r.tpot for r in rows if r.error is None and r.tpot is not None]
        return sum(values) / len(values) if values else None

    out = {}
    for task in sorted({p.task for p in prompts}):
        ours = [r for r in records if prompts[r.prompt_index].task == task]
        theirs = [r for r in baseline if prompts[r.prompt_index].task == task]
        mine, base = mean_tpot(ours), mean_tpot(theirs)
        tpots = [r.tpot for r in ours if r.error is None and r.tpot is not None]
        out[task] = {
            "prompts": len({r.prompt_index for r in ours}),
            "acceptance_rate": None,
            "mean_accepted_tokens_per_step": None,
            "tpot_p50_s": percentile(tpots, 50),
            "speedup_tpot": base / mine if base and mine else None,
        }
    return {"task": out}


def _merged(runs: tuple, part: tuple) -> tuple:
    """Segments of one route at one level as one run: records joined (their send times moved
    after the earlier segments'), walls and counters summed."""
    if not runs:
        return part
    for record in part[0]:
        record.sent += runs[1]
    return runs[0] + part[0], runs[1] + part[1], _sum(runs[2], part[2])


def _sum(a, b):
    """Counter deltas added: numbers, lists element by element, dicts key by key."""
    if isinstance(a, dict):
        return {key: _sum(a.get(key, 0.0), b.get(key, 0.0)) for key in a.keys() | b.keys()}
    if isinstance(a, list) or isinstance(b, list):
        a, b = list(a or []), list(b or [])
        width = max(len(a), len(b))
        return [
            _sum(*pair)
            for pair in zip(a + [0.0] * (width - len(a)), b + [0.0] * (width - len(b)), strict=True)
        ]
    return a + b


async def _sweep(config: LoadConfig, prompts: Sequence[PromptRecord], progress, between) -> dict:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        info = await _route_info(client, config.url)
        for route in [config.baseline, *config.routes]:
            if route not in info:
                raise ValueError(f"routes: the server has no route {route!r}; it has {list(info)}")
        levels = []
        for qps in config.qps:
            runs: dict[str, tuple] = {}
            first = 0
            for segment in range(config.rounds):
                for route in [config.baseline, *config.routes]:
                    part = await run_level(client, config, prompts, qps, route, segment, first)
                    runs[route] = _merged(runs.get(route, ()), part)
                    ok = sum(r.error is None for r in part[0])
                    progress(
                        f"qps={_level(qps)} round {segment + 1}/{config.rounds} {route}: "
                        f"{ok}/{len(part[0])} requests completed"
                    )
                first += len(part[0])
                if between is not None:
                    between(qps, segment)
            levels.append((qps, runs))
    return {"info": info, "levels": levels}


def run_sweep(
    config: LoadConfig,
    prompts: Sequence[PromptRecord],
    prompts_file: str | None = None,
    progress=print,
    between=None,
) -> dict:
    """Run the sweep against the server and return the report (harness format, module doc);
    `progress` gets one line per segment and route; `between(qps, segment)`, when given, runs
    after each segment of every route (a benchmark measuring something else in turn)."""
    raw = asyncio.run(_sweep(config, list(prompts), progress, between))
    return build_report(config, list(prompts), raw, prompts_file)


def _level(qps: float) -> int | float:
    """A QPS level as reports key it (4, not 4.0)."""
    return int(qps) if float(qps).is_integer() else qps


def build_report(
    config: LoadConfig, prompts: list[PromptRecord], raw: dict, prompts_file: str | None = None
) -> dict:
    """The report of a finished sweep (`raw`: route info and every level's runs)."""
    info = raw["info"]
    baseline, cells, serving, checks = {}, [], {}, {}
    for qps, runs in raw["levels"]:
        label = str(_level(qps))
        base_records, base_wall, base_counters = runs[config.baseline]
        base = level_metrics(base_records, base_wall, base_counters, config.goodput)
        baseline[label] = base
        serving[label] = {config.baseline: base}
        checks[label] = {
            route: integrity(records, counters, prompts)
            for route, (records, _, counters) in runs.items()
        }
        for route in config.routes:
            records, wall, counters = runs[route]
            metrics = level_metrics(records, wall, counters, config.goodput)
            quality = _quality(prompts, records, base_records)
            metrics["quality_regressions"] = quality["quality_regressions"]
            serving[label][route] = metrics
            route_info = info.get(route, {})
            tpot, base_tpot = metrics["tpot_s"]["p50"], base["tpot_s"]["p50"]
            cells.append(
                {
                    "name": f"{route} ({route_info.get('drafter', '?')})",
                    "drafter": route_info.get("drafter", route),
                    "size": route_info.get("nodes"),
                    "nodes": route_info.get("nodes") or 1,
                    "batch": _level(qps),
                    "adaptive": False,
                    "metrics": metrics,
                    "speedup": base_tpot / tpot if tpot and base_tpot else None,
                    "speedup_tpot_p50": base_tpot / tpot if tpot and base_tpot else None,
                    "paired_baseline_tokens_per_second": base["tokens_per_second"],
                    "splits": _task_splits(prompts, records, base_records),
                    "quality": quality,
                    "errors": {str(r.index): r.error for r in records if r.error is not None},
                }
            )
    return {
        "config": {
            "drafters": list(config.routes),
            "sizes": [],
            "trees": [],
            "batches": [_level(q) for q in config.qps],
            "adaptive": False,
            "max_new_tokens": config.max_new_tokens,
            "price_per_hour": None,
            "repeats": 1,
            "noise_floor": config.noise_floor,
            "seed": config.seed,
            "chat": None,
            "keep_special_tokens": False,
            "axis": "qps",
            "url": config.url,
            "duration_s": config.duration,
            "num_requests": config.num_requests,
            "baseline_route": config.baseline,
            "goodput_slo_s": config.goodput,
            "routes": info,
        },
        "prompts": [p.to_dict() for p in prompts],
        "noise": {str(_level(q)): config.noise_floor for q in config.qps},
        "baseline": baseline,
        "cost_model": None,
        "cells": cells,
        "guardrails": None,
        "serving": serving,
        "integrity": checks,
        "requests": {
            str(_level(qps)): {
                route: [asdict(r) for r in records] for route, (records, _, _) in runs.items()
            }
            for qps, runs in raw["levels"]
        },
        "meta": {
            "model": config.url,
            "device": "server",
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "prompts_file": prompts_file,
            "versions": versions(),
        },
    }


def integrity(records: list[RequestRecord], counters: dict, prompts) -> dict:
    """Whether every request ended in exactly one complete response or one error, its own:
    `lost` (neither), `unaccounted` (the server's count of ended and refused requests against
    the client's), `wrong_ids` (a response under another request's id, or an id twice), and
    `inconsistent_outputs` (a complete greedy response that differs from an earlier one of the
    same prompt, which a response delivered to the wrong request would be)."""
    done = [r for r in records if r.error is None]
    refused = sum(r.status in (429, 503) for r in records)
    failed_in_stream = sum(r.error is not None and r.status == 200 for r in records)
    ids = [r.request_id for r in records]
    first_text: dict[int, str] = {}
    inconsistent = 0
    for r in done:
        if prompts[r.prompt_index].temperature == 0:
            expected = first_text.setdefault(r.prompt_index, r.text)
            inconsistent += r.text != expected
    return {
        "requests": len(records),
        "completed": len(done),
        "errors": len(records) - len(done),
        "refused": refused,
        "lost": sum(r.error is None and r.finish_reason is None for r in records),
        "unaccounted": int(
            counters.get("ended", 0.0)
            - (len(done) + failed_in_stream)
            + counters.get("rejected", 0.0)
            - refused
        ),
        "wrong_ids": sum(r.request_id != str(r.index) for r in records) + len(ids) - len(set(ids)),
        "inconsistent_outputs": inconsistent,
    }


def write_serving_report(report: dict, out: str | Path) -> dict[str, str]:
    """report.json, report.md and the plots in `out` (the harness's writer)."""
    return write_report(report, out)
