"""Continuous batching: requests join and leave one running batch between steps.

`Scheduler(model, routes)` keeps a batch of up to `max_batch` sequences on the model's runner
(one KV cache, one verify forward per step) and runs the engine's step over it
(docs/ARCHITECTURE.md, "Data flow of one step") while requests come and go:

- a request waits in a bounded queue (`submit` raises `QueueFull` past `max_queue`) until a slot
  is free; its prompt is then fed into the storage rows past the batch's end, at most
  `prefill_chunk` tokens per row between two decode steps of the batch (long prompts are
  chunked), and its row joins the batch once the prompt is in. A reused slot starts from an empty
  cache (its lengths are reset, its old K/V never read). On the CPU, with a core to spare and no
  route reading hidden states, the chunks are fed on a thread of their own while the batch
  decodes (`overlap_prefill`): the batch's steps no longer wait for newcomers' prompts;
- every request has its own sampling parameters, stop rule, token budget and route. A route's
  drafter (one instance per route, fed rows through `Drafter.join`) drafts for the route's
  speculating rows; every other row verifies its root alone, which is plain decoding, in the same
  forward;
- finished and cancelled rows leave the batch at the end of the step (a cancelled row before the
  next one), freeing their slot and their drafter state.

Each route with a drafter has a `RouteGuard` (`specdec_fast.guardrails`): a drafter exception or
a breached bound moves the route's running rows to plain decoding for the rest of their requests
(a drafter's state cannot skip steps) and new requests of the route decode plainly until the
guard re-probes after its cool-down. Outputs never change: greedy rows give exactly `generate()`'s
tokens for the same prompt, whatever joins or leaves beside them, and sampled rows keep the
target's distribution and, with a seed, `generate()`'s draws (the random streams are keyed by a
row's seed and position, never by its slot).

A decode step is `specdec_fast.step`, the step `generate` runs, over the routes' lanes: the
scheduler keeps admission, prefill and joins, routes, streaming, the guardrails' decisions and
the metrics. A step reads the device once (the emitted tokens, `batch.read_back`); prefill
chunks and joins read nothing back. With `read_ahead` (on by default on CUDA), while the batch
is settled (no group of newcomers to admit or joining, no cancelled row) and every route with
running rows has plain decoding or a drafter that reads ahead, the next step is queued before
the last one is read, as `generate` does: the host's work between steps (the step's emission,
streaming, the guards, the next iteration, a chunk of newcomers' prompts fed past the batch's
rows) then overlaps the device's. A change to the batch (a row finished or cancelled, a group
admitted or joining) first reads the queued step; a route moved to plain decoding needs no read
(the queued step's trees were verified as any other's).
`step()` runs one iteration on the calling thread; `start()` runs steps on a thread of its own,
and `submit` and `Handle.cancel` may then be called from any thread.

On a tensor-parallel target (`specdec_fast.parallel.load_target`) every rank holds the same
scheduler: rank 0's takes the requests, the others' run its steps (`follow`), and at the top of
each step every rank applies rank 0's plan of what changed (`specdec_fast.serving.lockstep`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import torch

from specdec_fast import graphs
from specdec_fast.arguments import build_sampling, draw_seed, eos_tokens
from specdec_fast.batch import FAILED, Batch, Row
from specdec_fast.cache import model_shards
from specdec_fast.compiled import compile_choice
from specdec_fast.drafters.base import Drafter, supports_join
from specdec_fast.guardrails import DEFAULT_ROUTE, Guardrails, RouteGuard
from specdec_fast.parallel import check_tensor_parallel
from specdec_fast.requests import Sampling, StopRule
from specdec_fast.runner import ModelRunner
from specdec_fast.serving.lockstep import HEARTBEAT_S, Lockstep
from specdec_fast.stats import SequenceStats
from specdec_fast.step import (
    Drafted,
    Lane,
    Launched,
    StepReport,
    drop,
    finish,
    first_unread,
    index_lanes,
    launch,
    queue_behind,
)
from specdec_fast.transfer import to_device

PREFILL_CHUNK = 256
# A route's drafter errors are logged (a warning) at most this often, each line with the count.
ERROR_LOG_EVERY_S = 60.0

logger = logging.getLogger(__name__)
# Reasons a request ends besides its stop rule's ("eos", "stop", "length"), "cache" and FAILED:
# cancelled by its caller (a client gone, a drain's deadline), or by the server when its text
# reached one of the request's stop strings (matched on the text, `protocol.TextStream`).
CANCELLED = "cancelled"
STOP_STRING = "stop_string"
CANCEL_REASONS = (CANCELLED, STOP_STRING)


class QueueFull(RuntimeError):
    """`Scheduler.submit`: the queue of waiting requests is at `max_queue`."""


class SchedulerStopped(RuntimeError):
    """`Scheduler.submit`: the scheduler is closed, or its thread stopped on an error."""


@dataclass
class Request:
    """One request, as the scheduler takes it (host data).

    prompt: the token ids (at least one). max_new_tokens: >= 1.
    temperature, top_k, top_p, seed: as `generate` takes them for one sequence (seed None draws
        one from torch's generator).
    eos_token_id: int or list; None uses the scheduler's (by default the model's).
    stop: stop token sequences. route: a route of the scheduler.
    speculate: whether the request may speculate on its route (False: plain decoding on it).
    on_tokens(tokens): called with each step's new tokens (on the scheduler's thread).
    on_finish(completion): called once, when the request ends in any way.
    """

    prompt: Sequence[int]
    max_new_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    eos_token_id: int | Sequence[int] | None = None
    stop: Sequence[Sequence[int]] = ()
    route: str = DEFAULT_ROUTE
    speculate: bool = True
    on_tokens: Callable[[list[int]], None] | None = None
    on_finish: Callable[[Completion], None] | None = None


@dataclass
class Completion:
    """How a request ended.

    tokens: the generated tokens (stops included). finish_reason: "eos", "stop", "length",
    "cache" (the slot's KV capacity), "cancelled", "stop_string" (cancelled when the server's
    text reached a stop string) or "error" (then `error` says why).
    stats: the request's `SequenceStats`, TTFT measured from its arrival (queueing included).
    speculated: whether a drafter drafted for it at some step.
    arrival, admitted, finished: `time.perf_counter()` at submission, at the start of its
    prefill (None if it never got a slot) and at its end.
    """

    tokens: list[int]
    finish_reason: str
    stats: SequenceStats
    route: str
    speculated: bool
    arrival: float
    admitted: float | None
    finished: float
    error: str | None = None


class Handle:
    """A submitted request: `cancel()` it, or wait for its `completion`."""

    def __init__(self, request: Request, scheduler: Scheduler):
        self.request = request
        self.completion: Completion | None = None
        self.done = threading.Event()
        self._scheduler = scheduler
        self.cancel_reason: str | None = None
        self.key: int | None = None  # under tensor parallelism, its key on every rank

    @property
    def cancelled(self) -> bool:
        return self.cancel_reason is not None

    def cancel(self, reason: str = CANCELLED) -> None:
        """End the request (finish reason `reason`, one of `CANCEL_REASONS`) and free its slot
        before the next step; a request that already ended, or was cancelled before, is left as
        it is."""
        self._scheduler.cancel(self, reason)

    def mark_cancelled(self, reason: str) -> None:
        """The scheduler's side of `cancel`: its next step ends the request with `reason` (the
        first reason given stands)."""
        if self.cancel_reason is None:
            self.cancel_reason = reason

    def wait(self, timeout: float | None = None) -> Completion | None:
        self.done.wait(timeout)
        return self.completion


@dataclass
class RouteCounters:
    """Cumulative speculation counters of one route (vLLM's spec-decode metrics, per route).

    drafts: row-steps that verified at least one draft token; draft_tokens: draft tokens offered;
    accepted_tokens: draft tokens accepted; accepted_per_position[d]: accepted tokens at depth
    d + 1; drafter_errors: drafter exceptions; trips: times the route's running rows were moved
    to plain decoding (errors and guardrail breaches).
    """

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    drafter_errors: int = 0
    trips: int = 0


@dataclass
class StepCounters:
    """Where the scheduler's time goes, cumulative: decode steps by batch size (`decode[B]` =
    [steps, seconds]; a step's seconds exclude those of the step queued before it), the decode
    steps queued before the step ahead of them was read (`queued`: read-ahead) and prompt
    chunks fed (`prefill_chunks`, `prefill_tokens`). `prefill_seconds`
    is the time the scheduler's thread spent on prompts (feeding them, or waiting for a chunk
    fed beside the steps when it had nothing to decode); `prefill_beside_seconds` the time of
    the chunks fed beside decode steps (`overlap_prefill`), on their own thread."""

    decode: dict[int, list] = field(default_factory=dict)
    queued: int = 0
    prefill_chunks: int = 0
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    prefill_beside_seconds: float = 0.0


class _Row(Row):
    """One request in flight: a batch `Row` with its handle, arrival and lane."""

    def __init__(
        self, handle: Handle, prompt: list[int], sampling: Sampling, rule: StopRule, arrival: float
    ):
        super().__init__(prompt, rule, sampling, arrival, handle.request.on_tokens)
        self.handle = handle
        self.request = handle.request
        self.arrival = arrival
        self.admitted: float | None = None
        self.lane: _Lane | None = None  # the lane whose drafter drafts for it; None: plain
        self.speculated = False


class _Lane(Lane):
    """A route: its drafter, guard and counters, and the speculating rows its drafter follows.
    Its drafter failing moves its rows to plain decoding."""

    def __init__(self, name: str, drafter: Drafter | None, guard: RouteGuard | None):
        super().__init__(drafter)
        self.name = name
        self.guard = guard
        self.counters = RouteCounters()
        self.begun = False  # attach and begin ran: end is owed
        self.last_error: str | None = None
        self._logged_at: float | None = None  # `time.monotonic()` of the last error logged

    def fail(self, where: str, error: Exception, verified: bool = False) -> None:
        """A drafter error: count it (on the guard's window too: here, or with the step's
        figures in `_guard_step` when the step had verified the lane's proposal), log it (at
        most every `ERROR_LOG_EVERY_S`) and move the rows to plain decoding."""
        self.counters.drafter_errors += 1
        self.last_error = f"drafter error in {where}: {type(error).__name__}: {error}"
        now = time.monotonic()
        if self._logged_at is None or now - self._logged_at >= ERROR_LOG_EVERY_S:
            self._logged_at = now
            logger.warning(
                "route %r: %s (%d drafter errors so far); its requests decode plainly",
                self.name,
                self.last_error,
                self.counters.drafter_errors,
            )
        if self.guard is not None and not verified:
            self.guard.record_error()
        self.trip()

    def trip(self, count: bool = True) -> None:
        """The rows decode plainly from now on (counted as a trip when `count` and it had
        rows); the drafter's batch ends."""
        for row in self.rows:
            row.lane = None
        self.counters.trips += int(count and bool(self.rows))
        self.rows, self.positions, self.index = [], [], None
        self.end()

    def end(self) -> None:
        if not self.begun:
            return
        self.begun = False
        try:
            self.drafter.end()
        except Exception as error:  # noqa: BLE001 - nothing of the outputs depends on it
            self.counters.drafter_errors += 1
            self.last_error = f"drafter error in end: {type(error).__name__}: {error}"

    def count(self, draft: Drafted, host, rows: list[_Row], gone: set[int]) -> None:
        """The counters and rows' `speculated` of the lane's step `draft` (batch `rows`), but
        for the rows at positions `gone`."""
        counters = self.counters
        for p in draft.positions:
            if host.drafted[p] and p not in gone:
                rows[p].speculated = True
                counters.drafts += 1
                counters.draft_tokens += host.drafted[p]
                counters.accepted_tokens += host.num_accepted[p]
                missing = host.num_accepted[p] - len(counters.accepted_per_position)
                counters.accepted_per_position += [0] * max(missing, 0)
                for depth in range(host.num_accepted[p]):
                    counters.accepted_per_position[depth] += 1


@dataclass
class _Prefill:
    """Newcomers whose prompts are being fed into storage rows [start, start + len(rows))."""

    rows: list[_Row]
    start: int
    fed: list[int]
    hidden: list[dict[int, torch.Tensor]] = field(default_factory=list)

    def remaining(self, r: int) -> list[int]:
        """The prompt tokens still to cache for row r (all but the last; none once cancelled)."""
        row = self.rows[r]
        return [] if row.handle.cancelled else row.tokens[self.fed[r] : len(row.tokens) - 1]

    def chunks(self, size: int) -> list[list[int]]:
        """Each row's next chunk of at most `size` tokens."""
        return [self.remaining(r)[:size] for r in range(len(self.rows))]


@dataclass
class _Feed:
    """A chunk of `group`'s prompts being fed on the prefill thread; `future` gives its seconds."""

    group: _Prefill
    chunks: list[list[int]]
    future: Future


def _spare_core(threads: int) -> bool:
    """Whether this process may use more CPU cores than `threads`."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (cores or 1) > threads


class Scheduler:
    """Continuous batching over one model (see the module doc).

    Args:
        model: an HF causal LM (as `generate` takes it).
        routes: route name -> drafter (None: a plain route); default `{"default": None}`. Each
            route keeps its drafter instance, so it must take joining rows (`supports_join`).
        guardrails: policies by route name (`Guardrails.route`); None keeps only the fallback
            on drafter errors.
        max_batch: slots: the most requests decoded (or prefilled) at once.
        max_queue: waiting requests beyond which `submit` raises `QueueFull`.
        max_cache_len: KV slots per sequence; a request needs its prompt, `max_new_tokens` and
            the widest tree of any route. Default: `max_position_embeddings` plus that tree.
        prefill_chunk: prompt tokens per row fed between two decode steps (or beside one).
        eos_token_id: stop ids of requests that give none (default: the model's).
        use_cuda_graphs, compile: as for `generate` (drafters' own models follow `compile`).
        read_ahead: queue each decode step before reading the one before while the batch is
            settled (see the module doc), as `generate`'s `read_ahead`; outputs are the same.
            None (default): on for a CUDA model; off for a tensor-parallel target (its ranks
            decide between steps in lockstep), where True is refused.
        overlap_prefill: feed newcomers' prompts on a thread of their own while the batch
            decodes (their rows join when a chunk is in; outputs are the same). It needs a CPU
            model and routes that read no hidden states (`ModelRunner.feeds_beside_steps`), and
            pays where a core is free beside torch's threads. None (default): on when all of
            that holds.
        after_step: called with no arguments after each step of the scheduler's thread
            (`start`), failed or not: where the callbacks' deliveries of a step can go out at
            once (the engine process sends a step's events to the server in one message).
    """

    def __init__(
        self,
        model,
        routes: Mapping[str, Drafter | None] | None = None,
        *,
        guardrails: Guardrails | None = None,
        max_batch: int = 16,
        max_queue: int = 256,
        max_cache_len: int | None = None,
        prefill_chunk: int = PREFILL_CHUNK,
        eos_token_id: int | Sequence[int] | None = None,
        use_cuda_graphs: bool | None = None,
        compile: bool | None = None,
        overlap_prefill: bool | None = None,
        read_ahead: bool | None = None,
        after_step: Callable[[], None] | None = None,
    ):
        routes = dict(routes) if routes is not None else {DEFAULT_ROUTE: None}
        if not routes:
            raise ValueError("routes: expected at least one route")
        if read_ahead is not None and not isinstance(read_ahead, bool):
            raise TypeError(f"read_ahead: expected None or a bool, got {read_ahead!r}")
        sharded = model_shards(model) > 1
        if sharded:
            # A tensor-parallel target (`lockstep`) runs eagerly, and its prompts are fed on the
            # scheduler's thread: a chunk fed beside the steps would join when it happens to be
            # done, which differs between ranks.
            for drafter in routes.values():
                check_tensor_parallel(
                    model, drafter, compile=compile, use_cuda_graphs=use_cuda_graphs, exact=False
                )
            if overlap_prefill:
                raise ValueError(
                    "overlap_prefill: a tensor-parallel target feeds prompts between its steps"
                )
            if read_ahead:
                raise ValueError(
                    "read_ahead: a tensor-parallel target reads each step before the next (its "
                    "ranks apply rank 0's plan between steps)"
                )
            compile = use_cuda_graphs = overlap_prefill = read_ahead = False
        for name, drafter in routes.items():
            if drafter is not None and not supports_join(drafter):
                raise ValueError(
                    f"routes[{name!r}]: {type(drafter).__name__} cannot take rows into a running "
                    "batch (it does not implement Drafter.join)"
                )
        for name, value, low in (
            ("max_batch", max_batch, 1),
            ("max_queue", max_queue, 0),
            ("prefill_chunk", prefill_chunk, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name}: expected an integer >= {low}, got {value!r}")
        text_config = model.config.get_text_config(decoder=True)
        self.model = model
        self.vocab_size = text_config.vocab_size
        self.max_nodes = max((d.max_nodes for d in routes.values() if d is not None), default=1)
        if max_cache_len is None:
            max_cache_len = text_config.max_position_embeddings + self.max_nodes
        if max_cache_len < self.max_nodes + 2:
            raise ValueError(
                f"max_cache_len: expected room for a prompt, a token and a tree of "
                f"{self.max_nodes} nodes, got {max_cache_len}"
            )
        self.max_cache_len = max_cache_len
        self.max_batch, self.max_queue, self.prefill_chunk = max_batch, max_queue, prefill_chunk
        config_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        # Ids past the vocabulary are never generated: they stop nothing, and are let be (a
        # tokenizer's stop ids may lie past the model's embeddings).
        self.eos_token_id = eos_tokens(
            config_eos if eos_token_id is None else eos_token_id, None, "eos_token_id"
        )
        self.lanes = {
            name: _Lane(
                name,
                drafter,
                guardrails.route(name) if guardrails is not None and drafter is not None else None,
            )
            for name, drafter in routes.items()
        }
        self.runner = ModelRunner.for_model(
            model, max_cache_len, use_cuda_graphs=use_cuda_graphs, compile=compile
        )
        # The caller's raw choice, not `self.runner.compile` (the resolved one): drafters attach
        # under it (`compile_choice`), and None must leave `SPECDEC_COMPILE` in charge of their
        # own models.
        self._compile = compile
        self.runner.capture_hidden(
            sorted({layer for d in routes.values() if d is not None for layer in d.hidden_layers})
        )
        self.runner.reserve(max_batch)
        self.device = self.runner.device
        self.read_ahead = self.device.type == "cuda" if read_ahead is None else read_ahead
        self._queued: Launched | None = None  # a step launched and not yet read (read-ahead)
        self._lockstep = Lockstep(self.device) if sharded else None
        # Rank 0's idle thread wakes for the heartbeat that the other ranks wait for.
        self._idle_s = HEARTBEAT_S if sharded else None
        if overlap_prefill is None:
            overlap_prefill = self.runner.feeds_beside_steps and _spare_core(
                torch.get_num_threads()
            )
        elif overlap_prefill and not self.runner.feeds_beside_steps:
            self.runner.close()
            raise ValueError(
                "overlap_prefill: needs a model on the CPU and routes whose drafters read no "
                "hidden states"
            )
        self.overlap_prefill = bool(overlap_prefill)
        self._feeder = (
            ThreadPoolExecutor(1, thread_name_prefix="specdec-prefill") if overlap_prefill else None
        )
        self._feeding: _Feed | None = None
        self._lanes = list(self.lanes.values())
        self._prefill: _Prefill | None = None
        self._waiting: deque[_Row] = deque()
        self._reset_batch()
        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._closed = False
        self.error: BaseException | None = None
        self.steps = 0
        self.counters = StepCounters()
        self.after_step = after_step

    @property
    def context_len(self) -> int:
        """The most tokens a request may hold: prompt plus `max_new_tokens`."""
        return self.max_cache_len - self.max_nodes

    @property
    def rows(self) -> list[_Row]:
        """The batch's rows, in slot order."""
        return self.batch.rows

    # -- submission (any thread) -------------------------------------------------------------

    def submit(self, request: Request) -> Handle:
        """Queue `request`; returns its handle. Raises ValueError (naming the field) for a bad
        request, `QueueFull` when `max_queue` requests wait, `SchedulerStopped` once stopped."""
        row = self._new_row(request)
        with self._lock:
            if self._closed or self.error is not None:
                cause = "" if self.error is None else f" after {type(self.error).__name__}"
                raise SchedulerStopped(f"the scheduler is stopped{cause}")
            if self.waiting >= self.max_queue:
                raise QueueFull(f"{self.waiting} requests are waiting (max_queue)")
            if self._lockstep is None:
                self._waiting.append(row)
            else:
                self._lockstep.announce(row)  # queued on every rank at the next step
            self._wakeup.notify()
        return row.handle

    def _new_row(self, request: Request, key: int | None = None) -> _Row:
        """The row of a checked `request` (ValueError names a bad field), its seed drawn."""
        if request.route not in self.lanes:
            raise ValueError(
                f"route: unknown route {request.route!r}; routes: {', '.join(self.lanes)}"
            )
        try:
            prompt = [int(t) for t in request.prompt]
        except (TypeError, ValueError):
            raise ValueError(f"prompt: expected token ids, got {request.prompt!r}") from None
        if not prompt:
            raise ValueError("prompt: expected at least one token")
        outside = [t for t in prompt if not 0 <= t < self.vocab_size]
        if outside:
            raise ValueError(f"prompt: token ids outside [0, {self.vocab_size}): {outside[:5]}")
        new = request.max_new_tokens
        if isinstance(new, bool) or not isinstance(new, int) or new < 1:
            raise ValueError(f"max_new_tokens: expected an integer >= 1, got {new!r}")
        if len(prompt) + new > self.context_len:
            raise ValueError(
                f"prompt: {len(prompt)} tokens plus max_new_tokens={new} exceed the "
                f"context of {self.context_len} tokens"
            )
        if request.seed is None:
            # Drawn here, so that every rank of a tensor-parallel target gets the same.
            request = replace(request, seed=draw_seed())
        eos = self.eos_token_id
        if request.eos_token_id is not None:
            try:
                eos = eos_tokens(request.eos_token_id, self.vocab_size, "eos_token_id")
            except TypeError as error:
                raise ValueError(str(error)) from None
        rule = StopRule(eos, [list(seq) for seq in request.stop], new)
        sampling = build_sampling(
            1, request.temperature, request.top_k, request.top_p, request.seed
        )
        handle = Handle(request, self)
        handle.key = key
        return _Row(handle, prompt, sampling, rule, time.perf_counter())

    def cancel(self, handle: Handle, reason: str = CANCELLED) -> None:
        """`handle.cancel(reason)`: under tensor parallelism on every rank at the next step."""
        if reason not in CANCEL_REASONS:
            raise ValueError(f"reason: expected one of {CANCEL_REASONS}, got {reason!r}")
        if self._lockstep is None:
            handle.mark_cancelled(reason)
        else:
            self._lockstep.cancel(handle.key, reason)
        self.wake()

    def record_quality_regression(self, route: str) -> None:
        """A quality regression for `route`'s guard (a shadow copy's output differed): under
        tensor parallelism on every rank at the next step."""
        if self._lockstep is None:
            self.lanes[route].guard.record_quality_regression()
        else:
            self._lockstep.regressed(route)

    def wake(self) -> None:
        """Wake the scheduler's thread (a request was cancelled)."""
        with self._lock:
            self._wakeup.notify()

    @property
    def waiting(self) -> int:
        """Requests queued for a slot."""
        announced = 0 if self._lockstep is None else self._lockstep.announced
        return len(self._waiting) + announced

    @property
    def ranks_stopped(self) -> bool:
        """A tensor-parallel target: whether every rank has taken the plan that stopped the
        schedulers (they can then leave their group together, `parallel.finish_ranks`)."""
        return self._lockstep is not None and self._lockstep.stopped

    @property
    def running(self) -> int:
        """Requests holding a slot (decoding, or having their prompt fed)."""
        return len(self.rows) + (len(self._prefill.rows) if self._prefill is not None else 0)

    # -- the loop ----------------------------------------------------------------------------

    def start(self) -> None:
        """Run steps on a thread of its own until `close()`."""
        if self._thread is not None:
            raise RuntimeError("the scheduler is already running")
        self._thread = threading.Thread(target=self._loop, name="specdec-scheduler", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        """Whether requests are being served: not closed, and the thread (if any) running."""
        thread_ok = self._thread is None or self._thread.is_alive()
        return not self._closed and self.error is None and thread_ok

    def close(self) -> None:
        """Stop the thread, end every request ("cancelled") and the drafters; close the runner.
        Rank 0 of a tensor-parallel target stops the other ranks (unless it failed: then its
        exit ends theirs, as their collectives lose it)."""
        with self._lock:
            self._closed = True
            self._wakeup.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        lockstep = self._lockstep
        if lockstep is not None and lockstep.leads and not lockstep.stopped and self.error is None:
            self._follow_plan(stop=True)
        self._abort(CANCELLED)
        if self._feeder is not None:
            self._feeder.shutdown()
        self.runner.close()

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._closed and not self._has_work():
                    if not self._wakeup.wait(self._idle_s):
                        break  # a step with nothing to do: the heartbeat (`lockstep`)
                if self._closed:
                    return
            try:
                self.step()
            except Exception as error:  # noqa: BLE001 - every request in flight gets the error
                self._abort(FAILED, f"{type(error).__name__}: {error}")
                try:
                    if self._lockstep is not None:
                        raise  # a rank cannot go on alone: the others may be past this step
                    self.runner.reserve(self.max_batch)
                except Exception as fatal:  # noqa: BLE001 - nothing more can be served
                    with self._lock:
                        self.error = fatal
                    self._abort(FAILED, f"{type(fatal).__name__}: {fatal}")
                    return
            finally:
                if self.after_step is not None:
                    self.after_step()

    def _has_work(self) -> bool:
        return bool(self.rows or self._prefill is not None or self.waiting)

    def step(self) -> bool:
        """One iteration: drop cancelled requests, feed one chunk of the newcomers' prompts (a
        new group of newcomers takes the free slots when none is being fed), then one decode
        step of the batch. With `overlap_prefill` and a batch to decode, the chunk is handed to
        the prefill thread instead and the step goes on; a chunk fed there is taken in after
        the step that sees it done. Returns whether anything is left to do."""
        with torch.no_grad():
            if self._lockstep is not None and not self._follow_plan():
                return False
            self._drop_cancelled()
            if self._prefill is None:
                self._start_prefill()
            if self._prefill is not None:
                if self._feeder is None or not self.rows:
                    self._prefill_chunk()
                elif self._feeding is None:
                    self._feed_beside(self._prefill)
            if self.rows:
                self._decode()
                self.steps += 1
            if self._feeding is not None and self._feeding.future.done():
                self._take_feed()
        return bool(self.rows or self._prefill is not None or self._waiting)

    def _follow_plan(self, stop: bool = False) -> bool:
        """Tensor parallelism: rank 0's plan, applied on this rank (`lockstep`); False when the
        scheduler stops (rank 0: `stop`)."""
        rows, plan = self._lockstep.exchange(self._new_row, stop)
        with self._lock:
            self._waiting.extend(rows)
            self._closed |= plan.stop
        for route in plan.regressed:
            self.lanes[route].guard.record_quality_regression()
        return not plan.stop

    def follow(self) -> None:
        """A rank other than 0 of a tensor-parallel target: run rank 0's steps on this thread
        until rank 0's scheduler closes (`lockstep`; the requests come from rank 0's plans)."""
        if self._lockstep is None or self._lockstep.leads:
            raise RuntimeError("follow: only the ranks other than 0 follow rank 0's steps")
        while not self._closed:
            self.step()

    def run_until_idle(self, max_steps: int | None = None) -> int:
        """`step()` until nothing is left to do (or `max_steps`); returns the steps run."""
        steps = 0
        while (max_steps is None or steps < max_steps) and self.step():
            steps += 1
        return steps

    # -- admission ---------------------------------------------------------------------------

    def _start_prefill(self) -> None:
        if self._waiting and len(self.rows) < self.max_batch:
            self._read_queued()  # newcomers are fed past the batch's end: it must be settled
        taken = []
        with self._lock:
            while self._waiting and len(taken) < self.max_batch - len(self.rows):
                taken.append(self._waiting.popleft())
        if taken:
            now = time.perf_counter()
            for row in taken:
                row.admitted = now
            self._prefill = _Prefill(taken, len(self.rows), [0] * len(taken))

    def _prefill_chunk(self) -> None:
        """Feed the group's next chunk on this thread (after taking in one fed beside)."""
        start = time.perf_counter()
        if self._feeding is not None:
            self._take_feed()
        else:
            group = self._prefill
            chunks = group.chunks(self.prefill_chunk)
            self._chunk_fed(group, chunks, self.runner.extend_rows(group.start, chunks, group.fed))
        self.counters.prefill_seconds += time.perf_counter() - start

    def _feed_beside(self, group: _Prefill) -> None:
        """Hand the group's next chunk to the prefill thread."""
        chunks = group.chunks(self.prefill_chunk)

        def feed() -> float:
            start = time.perf_counter()
            self.runner.extend_rows(group.start, chunks, group.fed, beside_step=True)
            return time.perf_counter() - start

        self._feeding = _Feed(group, chunks, self._feeder.submit(feed))

    def _take_feed(self) -> None:
        """The chunk fed beside the steps is in (waiting for it if need be): book it."""
        feed, self._feeding = self._feeding, None
        self.counters.prefill_beside_seconds += feed.future.result()
        self._chunk_fed(feed.group, feed.chunks, {})

    def _chunk_fed(self, group: _Prefill, chunks: list[list[int]], hidden) -> None:
        """Book a chunk fed to `group`; the group joins the batch once its prompts are in."""
        if hidden:
            group.hidden.append(hidden)
        group.fed = [fed + len(chunk) for fed, chunk in zip(group.fed, chunks, strict=True)]
        self.counters.prefill_chunks += 1
        self.counters.prefill_tokens += sum(len(chunk) for chunk in chunks)
        if not any(group.remaining(r) for r in range(len(group.rows))):
            self._prefill = None
            self._join(group)

    def _join(self, group: _Prefill) -> None:
        """The group's rows join the batch, and those that speculate their routes' drafters
        (after the step queued by read-ahead, if any, is read: the batch changes)."""
        self._read_queued()
        rows = group.rows
        for row, fed in zip(rows, group.fed, strict=True):
            row.cached = fed
        self.runner.admit_rows(group.start, len(rows), max(group.fed))
        first = len(self.rows)
        self.batch.join(rows, to_device([r.tokens[-1] for r in rows], self.device))
        hidden = {
            layer: torch.cat([chunk[layer] for chunk in group.hidden], dim=1)
            for layer in (group.hidden[0] if group.hidden else {})
        }
        joining: dict[str, list[int]] = {}
        for offset, row in enumerate(rows):
            lane = self.lanes[row.request.route]
            wanted = lane.drafter is not None and row.request.speculate
            if wanted and not row.handle.cancelled and self._allowed(lane):
                joining.setdefault(lane.name, []).append(offset)
        index_lanes(self.batch, self._lanes)
        for name, offsets in joining.items():
            self._join_lane(self.lanes[name], [rows[o] for o in offsets], offsets, first, hidden)
        index_lanes(self.batch, self._lanes)
        # Requests cancelled while their prompts were fed leave before decoding.
        self._drop_cancelled()

    @staticmethod
    def _allowed(lane: _Lane) -> bool:
        return lane.guard is None or lane.guard.allows_speculation()

    def _join_lane(self, lane: _Lane, newcomers, offsets, first: int, hidden) -> None:
        """`newcomers` (batch positions `first + offsets`) join `lane`'s drafter: its `begin`
        when the lane has no rows, else its `join`."""
        state = self.batch.state(newcomers, to_device([first + o for o in offsets], self.device))
        local = to_device(offsets, self.device)
        state.hidden = {layer: h[local] for layer, h in hidden.items()}
        where = "join" if lane.rows else "begin"
        try:
            if lane.rows:
                lane.drafter.join(state)
            else:
                with compile_choice(self._compile), graphs.choice(self.runner.use_cuda_graphs):
                    lane.drafter.attach(self.model, self.max_cache_len)
                lane.begun = True
                lane.drafter.begin(state)
        except Exception as error:  # noqa: BLE001 - a failing drafter falls back to plain
            lane.fail(where, error)
            return
        lane.rows += newcomers
        for row in newcomers:
            row.lane = lane

    # -- the decode step ---------------------------------------------------------------------

    def _reset_batch(self) -> None:
        # Its slots (the capacity and a tree) are the storage's: a request's prompt and tokens
        # fit the context, so no row stops for its cache.
        self.batch = Batch(self.device, self.context_len + 1, self.max_nodes)

    def _decode(self) -> None:
        """One decode step: the one queued by the step before (read-ahead), or a new one; the
        next is queued behind it when it may be (`step.queue_behind`) and stays queued unless
        rows finish at this step. A group of newcomers being fed does not stop it: the chunks
        go to storage rows past the batch's, and the queued step is read before they join."""
        runner, batch, lanes, vocab = self.runner, self.batch, self._lanes, self.vocab_size
        launched, self._queued = self._queued, None
        if launched is None:
            launched = launch(runner, batch, lanes, vocab, first_unread(lanes, self.read_ahead))
        queued = queue_behind(runner, batch, lanes, vocab, launched)
        ahead = 0 if queued is None else queued.proposal.num_nodes
        finished = self._book(finish(runner, batch, launched, vocab, ahead))
        if queued is not None:
            self.counters.queued += 1
            if finished:
                # Rows leave: read the queued step first (what it ran for them made nothing).
                finished = sorted({*finished, *self._book(finish(runner, batch, queued, vocab))})
            else:
                self._queued = queued
        self._drop(finished)

    def _read_queued(self) -> None:
        """Read the step queued by read-ahead, if any, before the batch changes."""
        if self._queued is not None:
            queued, self._queued = self._queued, None
            self._drop(self._book(finish(self.runner, self.batch, queued, self.vocab_size)))

    def _book(self, report: StepReport) -> list[int]:
        """Count a step read (routes, guards, time), but for rows that had finished at the step
        before, which this one was queued behind (they emitted nothing at it); returns the
        positions of the rows that finished at it."""
        ended = {p for p, row in enumerate(self.rows) if row.stats.finish_reason is not None}
        gone = ended.difference(report.finished)
        if self._lockstep is not None:
            # The guards decide on the step's time: every rank must read the same.
            report.seconds = self._lockstep.slowest(report.seconds)
        for draft in report.drafted:
            draft.lane.count(draft, report.host, self.rows, gone)
        self._guard_step(report, gone)
        steps = self.counters.decode.setdefault(len(self.rows), [0, 0.0])
        steps[0] += 1
        steps[1] += report.seconds
        return report.finished

    def _guard_step(self, report: StepReport, gone: set[int]) -> None:
        """Each guarded route records the step of its plain rows and of its speculating ones
        (`RouteGuard.record_step`, as `generate`'s guarded drafters do), the rows at `gone`
        left out; a route whose guard turned speculation off moves its rows to plain
        decoding."""
        # Per lane whose proposal was verified: that draft and its rows still there.
        drafts: dict[int, tuple[Drafted, list[int]]] = {}
        for draft in report.drafted:
            where = [p for p in draft.positions if p not in gone]
            if where:
                drafts[id(draft.lane)] = draft, where
        skipped = gone.union(*(where for _, where in drafts.values()))
        plain: dict[str, list[list[int]]] = {}
        for p, (row, tokens) in enumerate(zip(self.rows, report.emitted, strict=True)):
            if p not in skipped:
                plain.setdefault(row.request.route, []).append(tokens)
        host = report.host
        for lane in self._lanes:
            if lane.guard is None:
                continue
            draft, where = drafts.get(id(lane), (None, []))
            speculating = lane.guard.record_step(
                report.seconds,
                plain.get(lane.name, []),
                None if draft is None else [report.emitted[p] for p in where],
                sum(host.drafted[p] for p in where),
                sum(host.num_accepted[p] for p in where),
                error=draft is not None and draft.failed,
            )
            if lane.rows and not speculating:
                lane.trip()

    # -- leaving -----------------------------------------------------------------------------

    def _drop(self, leaving: list[int]) -> None:
        """The rows at batch positions `leaving` leave the batch (their finish reason set) and
        their lanes (a lane left without rows ends its drafter's batch); each request's
        completion is then delivered."""
        finished = drop(self.runner, self.batch, self._lanes, leaving)
        if not finished:
            return
        for lane in self._lanes:
            if not lane.rows:
                lane.end()
        for row in finished:
            self._finish(row, row.stats.finish_reason, row.error)

    def _drop_cancelled(self) -> None:
        with self._lock:
            cancelled = [row for row in self._waiting if row.handle.cancelled]
            for row in cancelled:
                self._waiting.remove(row)
        for row in cancelled:
            self._finish(row, row.handle.cancel_reason)
        leaving = [p for p, row in enumerate(self.rows) if row.handle.cancelled]
        if leaving and self._queued is not None:
            self._read_queued()  # rows may leave with it: their positions change
            leaving = [p for p, row in enumerate(self.rows) if row.handle.cancelled]
        for p in leaving:
            self.rows[p].stats.finish_reason = self.rows[p].handle.cancel_reason
        self._drop(leaving)

    def _abort(self, reason: str, error: str | None = None) -> None:
        """End every request (waiting, being fed, decoding) with `reason`, and every lane."""
        if self._feeding is not None:
            # The prefill thread writes the storage until its chunk is in; errors end with it.
            feed, self._feeding = self._feeding, None
            feed.future.exception()
        with self._lock:
            waiting = list(self._waiting)
            self._waiting.clear()
        rows = self.rows + (self._prefill.rows if self._prefill is not None else []) + waiting
        self._prefill = self._queued = None
        for lane in self._lanes:
            lane.trip(count=False)
        self._reset_batch()
        for row in rows:
            self._finish(row, reason, error)

    def _finish(self, row: _Row, reason: str, error: str | None = None) -> None:
        row.stats.finish_reason = reason
        completion = Completion(
            tokens=list(row.generated),
            finish_reason=reason,
            stats=row.stats,
            route=row.request.route,
            speculated=row.speculated,
            arrival=row.arrival,
            admitted=row.admitted,
            finished=time.perf_counter(),
            error=error,
        )
        if self._lockstep is not None:
            self._lockstep.finished(row.handle.key, completion.tokens)
        row.handle.completion = completion
        row.handle.done.set()
        if row.request.on_finish is not None:
            row.request.on_finish(completion)
