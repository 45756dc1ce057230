"""Continuous batching: requests join and leave one running batch between steps.

`Scheduler(model, routes)` keeps a batch of up to `max_batch` sequences on the model's runner
(one KV cache, one verify forward per step) and runs the engine's step over it (DESIGN.md, "Data
flow of one step") while requests come and go:

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

A decode step reads the device once (the emitted tokens, `Batch.read_back`); prefill chunks and
joins read nothing back. `step()` runs one iteration on the calling thread; `start()` runs steps
on a thread of its own, and `submit` and `Handle.cancel` may then be called from any thread.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from specdec_fast.arguments import build_sampling
from specdec_fast.batch import Batch
from specdec_fast.compiled import compile_choice
from specdec_fast.drafters.base import (
    PAD_PARENT,
    Drafter,
    DraftState,
    Proposal,
    StepOutcome,
    supports_join,
    with_roots,
)
from specdec_fast.drafters.checks import checked
from specdec_fast.guardrails import DEFAULT_ROUTE, Guardrails, RouteGuard
from specdec_fast.kernels.verify import SamplingParams, run_verify
from specdec_fast.requests import Sampling, StopRule
from specdec_fast.runner import ModelRunner
from specdec_fast.stats import SequenceStats
from specdec_fast.transfer import to_device

PREFILL_CHUNK = 256
# Reasons a request ends besides its stop rule's ("eos", "stop", "length") and "cache".
CANCELLED, FAILED = "cancelled", "error"


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
    "cache" (the slot's KV capacity), "cancelled" or "error" (then `error` says why).
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
        self.cancelled = False

    def cancel(self) -> None:
        """End the request (finish reason "cancelled") and free its slot before the next step;
        a request that already ended is left as it is."""
        self.cancelled = True
        self._scheduler.wake()

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
    [steps, seconds]) and prompt chunks fed (`prefill_chunks`, `prefill_tokens`). `prefill_seconds`
    is the time the scheduler's thread spent on prompts (feeding them, or waiting for a chunk
    fed beside the steps when it had nothing to decode); `prefill_beside_seconds` the time of
    the chunks fed beside decode steps (`overlap_prefill`), on their own thread."""

    decode: dict[int, list] = field(default_factory=dict)
    prefill_chunks: int = 0
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    prefill_beside_seconds: float = 0.0


SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "seed")


class _Row:
    """One request in flight: its tokens, stop rule, sampling parameters, statistics, lane."""

    def __init__(
        self, handle: Handle, prompt: list[int], sampling: Sampling, rule: StopRule, arrival: float
    ):
        self.handle = handle
        self.request = handle.request
        self.tokens = prompt
        self.generated: list[int] = []
        self.rule = rule
        self.sampling = sampling  # host tensors [1]
        self.greedy = float(sampling.temperature[0]) == 0.0
        self.stats = SequenceStats(prompt_tokens=len(self.tokens))
        self.arrival = arrival
        self.admitted: float | None = None
        self.cached = 0  # committed cache slots: the prompt but its last token, then accepted
        self.lane: _Lane | None = None  # the lane whose drafter drafts for it; None: plain
        self.speculated = False


class _Lane:
    """A route: its drafter, guard and counters, and the speculating rows its drafter follows
    (in batch order: the drafter's batch is exactly these rows)."""

    def __init__(self, name: str, drafter: Drafter | None, guard: RouteGuard | None):
        self.name = name
        self.drafter = drafter
        self.guard = guard
        self.counters = RouteCounters()
        self.rows: list[_Row] = []
        self.begun = False  # attach and begin ran: end is owed
        self.positions: list[int] = []  # the rows' batch positions
        self.index: torch.Tensor | None = None  # the same on the device; None: the whole batch
        self.proposal: Proposal | None = None  # this step's
        self.last_error: str | None = None


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


def _token_latency(seconds: float, emitted: list[list[int]]) -> float | None:
    """Seconds per emitted token of a row, over the rows that emitted `emitted` in a step."""
    tokens = sum(len(e) for e in emitted)
    return seconds * len(emitted) / tokens if tokens else None


def _subset(params: SamplingParams, index: torch.Tensor | None) -> SamplingParams:
    if index is None:
        return params
    return SamplingParams(
        *(v[index] if isinstance(v, torch.Tensor) else v for v in
          (params.temperature, params.top_k, params.top_p, params.seed))
    )  # fmt: skip


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
        after_step: Callable[[], None] | None = None,
    ):
        routes = dict(routes) if routes is not None else {DEFAULT_ROUTE: None}
        if not routes:
            raise ValueError("routes: expected at least one route")
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
        self.width = max((d.max_nodes for d in routes.values() if d is not None), default=1)
        if max_cache_len is None:
            max_cache_len = text_config.max_position_embeddings + self.width
        if max_cache_len < self.width + 2:
            raise ValueError(
                f"max_cache_len: expected room for a prompt, a token and a tree of {self.width} "
                f"nodes, got {max_cache_len}"
            )
        self.max_cache_len = max_cache_len
        self.max_batch, self.max_queue, self.prefill_chunk = max_batch, max_queue, prefill_chunk
        config_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        self.eos_token_id = config_eos if eos_token_id is None else eos_token_id
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
        self.rows: list[_Row] = []  # the batch, in slot order
        self._prefill: _Prefill | None = None
        self._waiting: deque[_Row] = deque()
        self._reset_batch()
        self._root_parents: dict[int, torch.Tensor] = {}  # int64 [B, 1] of -1, by batch size
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
        return self.max_cache_len - self.width

    # -- submission (any thread) -------------------------------------------------------------

    def submit(self, request: Request) -> Handle:
        """Queue `request`; returns its handle. Raises ValueError (naming the field) for a bad
        request, `QueueFull` when `max_queue` requests wait, `SchedulerStopped` once stopped."""
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
        eos = self.eos_token_id if request.eos_token_id is None else request.eos_token_id
        rule = StopRule(eos, [list(seq) for seq in request.stop], new)
        sampling = build_sampling(
            1, request.temperature, request.top_k, request.top_p, request.seed
        )
        handle = Handle(request, self)
        row = _Row(handle, prompt, sampling, rule, time.perf_counter())
        with self._lock:
            if self._closed or self.error is not None:
                cause = "" if self.error is None else f" after {type(self.error).__name__}"
                raise SchedulerStopped(f"the scheduler is stopped{cause}")
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(f"{len(self._waiting)} requests are waiting (max_queue)")
            self._waiting.append(row)
            self._wakeup.notify()
        return handle

    def wake(self) -> None:
        """Wake the scheduler's thread (a request was cancelled)."""
        with self._lock:
            self._wakeup.notify()

    @property
    def waiting(self) -> int:
        """Requests queued for a slot."""
        return len(self._waiting)

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
        """Stop the thread, end every request ("cancelled") and the drafters; close the runner."""
        with self._lock:
            self._closed = True
            self._wakeup.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._abort(CANCELLED)
        if self._feeder is not None:
            self._feeder.shutdown()
        self.runner.close()

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._closed and not self._has_work():
                    self._wakeup.wait()
                if self._closed:
                    return
            try:
                self.step()
            except Exception as error:  # noqa: BLE001 - every request in flight gets the error
                self._abort(FAILED, f"{type(error).__name__}: {error}")
                try:
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
        return bool(self.rows or self._prefill is not None or self._waiting)

    def step(self) -> bool:
        """One iteration: drop cancelled requests, feed one chunk of the newcomers' prompts (a
        new group of newcomers takes the free slots when none is being fed), then one decode
        step of the batch. With `overlap_prefill` and a batch to decode, the chunk is handed to
        the prefill thread instead and the step goes on; a chunk fed there is taken in after
        the step that sees it done. Returns whether anything is left to do."""
        with torch.no_grad():
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

    def run_until_idle(self, max_steps: int | None = None) -> int:
        """`step()` until nothing is left to do (or `max_steps`); returns the steps run."""
        steps = 0
        while (max_steps is None or steps < max_steps) and self.step():
            steps += 1
        return steps

    # -- admission ---------------------------------------------------------------------------

    def _start_prefill(self) -> None:
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
        """The group's rows join the batch, and those that speculate their routes' drafters."""
        rows = group.rows
        for row, fed in zip(rows, group.fed, strict=True):
            row.cached = fed
        self.runner.admit_rows(group.start, len(rows), max(group.fed))
        first = len(self.rows)
        self.rows += rows
        self._roots = torch.cat([self._roots, to_device([r.tokens[-1] for r in rows], self.device)])
        self._sampling = Sampling(
            *(
                torch.cat(
                    [getattr(self._sampling, name)] + [getattr(r.sampling, name) for r in rows]
                )
                for name in SAMPLING_FIELDS
            )
        )
        self._device_sampling = None
        self._all_greedy = all(row.greedy for row in self.rows)
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
        self._index_lanes()
        for name, offsets in joining.items():
            self._join_lane(self.lanes[name], [rows[o] for o in offsets], offsets, first, hidden)
        self._index_lanes()
        # Requests cancelled while their prompts were fed leave before decoding.
        self._drop_cancelled()

    @staticmethod
    def _allowed(lane: _Lane) -> bool:
        return lane.guard is None or lane.guard.allows_speculation()

    def _join_lane(self, lane: _Lane, newcomers, offsets, first: int, hidden) -> None:
        """`newcomers` (batch positions `first + offsets`) join `lane`'s drafter: its `begin`
        when the lane has no rows, else its `join`."""
        state = self._state(newcomers, to_device([first + o for o in offsets], self.device))
        local = to_device(offsets, self.device)
        state.hidden = {layer: h[local] for layer, h in hidden.items()}
        where = "join" if lane.rows else "begin"
        try:
            if lane.rows:
                lane.drafter.join(state)
            else:
                with compile_choice(self._compile):
                    lane.drafter.attach(self.model, self.max_cache_len)
                lane.begun = True
                lane.drafter.begin(state)
        except Exception as error:  # noqa: BLE001 - a failing drafter falls back to plain
            self._fail(lane, where, error)
            return
        lane.rows += newcomers
        for row in newcomers:
            row.lane = lane

    # -- the decode step ---------------------------------------------------------------------

    def _reset_batch(self) -> None:
        self._roots = torch.zeros(0, dtype=torch.int64, device=self.device)
        self._sampling = Sampling(
            torch.zeros(0), torch.zeros(0, dtype=torch.int64), torch.zeros(0),
            torch.zeros(0, dtype=torch.int64),
        )  # fmt: skip
        self._device_sampling: SamplingParams | None = None
        self._all_greedy = True

    def _params(self) -> SamplingParams:
        """Every row's sampling parameters as device tensors `[B]` (uploaded when rows join)."""
        if self._device_sampling is None:
            self._device_sampling = SamplingParams(
                *(
                    to_device(tensor.numpy(), self.device, tensor.dtype)
                    for tensor in (getattr(self._sampling, name) for name in SAMPLING_FIELDS)
                )
            )
        return self._device_sampling

    def _state(self, rows: list[_Row], index: torch.Tensor | None) -> DraftState:
        """What a drafter sees of `rows`, at batch positions `index` (None: the whole batch)."""
        params = self._params()

        def pick(tensor: torch.Tensor) -> torch.Tensor:
            return tensor if index is None else tensor[index]

        return DraftState(
            tokens=[row.tokens for row in rows],
            temperature=pick(params.temperature),
            top_k=pick(params.top_k),
            top_p=pick(params.top_p),
            seed=pick(params.seed),
            device=self.device,
            greedy=all(row.greedy for row in rows),
            roots=pick(self._roots),
        )

    def _index_lanes(self) -> None:
        """Each lane's batch positions, after rows joined or left."""
        position = {id(row): p for p, row in enumerate(self.rows)}
        for lane in self.lanes.values():
            lane.positions = [position[id(row)] for row in lane.rows]
            whole = lane.positions == list(range(len(self.rows)))
            lane.index = None if whole else to_device(lane.positions, self.device)

    def _decode(self) -> None:
        start = time.perf_counter()
        drafting = []
        for lane in self.lanes.values():
            lane.proposal = None
            if not lane.rows:
                continue
            try:
                state = self._state(lane.rows, lane.index)
                # A row breaking a tree rule takes a plain step: the output stays exact.
                proposal = checked(
                    lane.drafter, lane.drafter.propose(state), state, self.vocab_size
                )
            except Exception as error:  # noqa: BLE001 - a failing drafter falls back to plain
                self._fail(lane, "propose", error)
                continue
            lane.proposal = proposal
            drafting.append(lane)
        proposal = self._assemble(drafting)
        out = self.runner.verify(proposal.tokens, proposal.parents)
        result = self._verify(out, proposal, drafting)
        self.runner.cache.compact(result.accepted_nodes, result.num_accepted, validate=False)
        host = Batch.read_back(proposal, result, out.depths)
        emitted, finished = self._emit(host, time.perf_counter())
        self.runner.cache.bound_lengths(max(row.cached for row in self.rows))
        for lane in drafting:
            self._update(lane, proposal, result, out, host, emitted)
        seconds = time.perf_counter() - start
        self._guard_step(seconds, host, emitted, drafting)
        self._roots = result.next_tokens
        steps = self.counters.decode.setdefault(len(self.rows), [0, 0.0])
        steps[0] += 1
        steps[1] += seconds
        self._drop(finished)

    def _assemble(self, drafting: list[_Lane]) -> Proposal:
        """One tree per row: each drafting lane's proposal at its rows, the root alone at the
        others (plain decoding), every row's root in column 0, padded to the widest tree."""
        if not drafting:
            parents = self._root_parents.get(len(self.rows))
            if parents is None:
                parents = torch.full((len(self.rows), 1), -1, device=self.device)
                self._root_parents[len(self.rows)] = parents
            plain = Proposal(self._roots[:, None], parents)
            width = self.runner.verify_width(len(self.rows), 1, self.width)
            return plain if width == 1 else with_roots(plain, self._roots, width)
        widest = max((lane.proposal.num_nodes for lane in drafting), default=1)
        width = self.runner.verify_width(len(self.rows), widest, self.width)
        if len(drafting) == 1 and drafting[0].index is None:
            return with_roots(drafting[0].proposal, self._roots, width)
        batch = len(self.rows)
        tokens = torch.zeros((batch, width), dtype=torch.int64, device=self.device)
        parents = torch.full_like(tokens, PAD_PARENT)
        tokens[:, 0] = self._roots
        parents[:, 0] = -1
        draft_probs = None
        for lane in drafting:
            sub, where = lane.proposal, lane.index
            nodes = sub.num_nodes
            tokens[where, 1:nodes] = sub.tokens[:, 1:].to(torch.int64)
            parents[where, :nodes] = sub.parents.to(torch.int64)
            if sub.draft_probs is not None:
                if draft_probs is None:
                    shape = (batch, width, sub.draft_probs.shape[2])
                    draft_probs = sub.draft_probs.new_zeros(shape)
                draft_probs[where, :nodes] = sub.draft_probs
        return Proposal(tokens, parents, draft_probs)

    def _verify(self, out, proposal: Proposal, drafting: list[_Lane]):
        """`kernels.verify` of the step: one call, or, when some lane's trees carry draft
        probabilities (sampled chains, the only trees that may), one call for each such lane
        and one for the other rows."""
        params = self._step_params(out.positions)
        chained = [lane for lane in drafting if lane.proposal.draft_probs is not None]
        if not chained or (len(drafting) == 1 and drafting[0].index is None):
            return run_verify(
                out.logits, proposal.tokens, proposal.parents, proposal.draft_probs, params
            )
        batch, width = proposal.tokens.shape
        accepted = torch.full((batch, width), -1, dtype=torch.int32, device=self.device)
        num_accepted = torch.zeros(batch, dtype=torch.int32, device=self.device)
        next_tokens = torch.zeros(batch, dtype=torch.int64, device=self.device)
        groups = [(lane.index, proposal.draft_probs) for lane in chained]
        in_chains = {p for lane in chained for p in lane.positions}
        rest = [p for p in range(batch) if p not in in_chains]
        if rest:
            groups.append((to_device(rest, self.device), None))
        for index, probs in groups:
            part = run_verify(
                out.logits[index],
                proposal.tokens[index],
                proposal.parents[index],
                None if probs is None else probs[index],
                _subset(params, index),
            )
            accepted[index], num_accepted[index], next_tokens[index] = part
        return type(part)(accepted, num_accepted, next_tokens)

    def _step_params(self, positions: torch.Tensor) -> SamplingParams:
        """As `Batch.sampling_params`: per-node seeds, each row's seed plus the node's position
        (`positions` int64 `[B, N]`)."""
        if self._all_greedy:
            return SamplingParams(0.0, 0, 1.0, 0)
        params = self._params()
        return SamplingParams(
            params.temperature, params.top_k, params.top_p, params.seed[:, None] + positions
        )

    def _emit(self, host, now: float) -> tuple[list[list[int]], list[int]]:
        """Each row's accepted drafts and next token, cut at its stop; the batch positions of
        the rows that finished."""
        emitted, finished = [], []
        for r, row in enumerate(self.rows):
            accepted = host.num_accepted[r]
            taken, reason = row.rule.take(row.generated, [*host.paths[r], host.next_tokens[r]])
            row.cached += accepted + 1
            if reason is None and row.cached + self.width > self.max_cache_len:
                reason = "cache"
            row.stats.record_step(host.depths[r], host.drafted[r], accepted)
            row.stats.record_emission(len(taken), now, row.arrival)
            row.tokens.extend(taken)
            emitted.append(taken)
            if taken and row.request.on_tokens is not None:
                row.request.on_tokens(taken)
            if reason is not None:
                row.stats.finish_reason = reason
                finished.append(r)
        return emitted, finished

    def _update(self, lane: _Lane, proposal, result, out, host, emitted) -> None:
        """The lane's drafter follows its rows' step; the lane's counters count it."""
        where, width, positions = lane.index, lane.proposal.num_nodes, lane.positions
        counters = lane.counters
        for p in positions:
            if host.drafted[p]:
                self.rows[p].speculated = True
                counters.drafts += 1
                counters.draft_tokens += host.drafted[p]
                counters.accepted_tokens += host.num_accepted[p]
                missing = host.num_accepted[p] - len(counters.accepted_per_position)
                counters.accepted_per_position += [0] * max(missing, 0)
                for depth in range(host.num_accepted[p]):
                    counters.accepted_per_position[depth] += 1
        if where is None:
            where = slice(None)
        outcome = StepOutcome(
            Proposal(
                proposal.tokens[where, :width],
                proposal.parents[where, :width],
                lane.proposal.draft_probs,
            ),
            result.accepted_nodes[where, :width],
            result.num_accepted[where],
            result.next_tokens[where],
            [emitted[p] for p in positions],
            {layer: h[where, :width] for layer, h in out.hidden_states.items()},
            [host.nodes[p] for p in positions],
            [host.drafted[p] for p in positions],
        )
        try:
            lane.drafter.update(self._state(lane.rows, lane.index), outcome)
        except Exception as error:  # noqa: BLE001 - the step was verified; the drafter is lost
            self._fail(lane, "update", error, record=False)
            lane.proposal = None
            if lane.guard is not None:
                lane.guard.record_speculative_step(0, 0, None, error=True)

    def _guard_step(self, seconds: float, host, emitted, drafting: list[_Lane]) -> None:
        """Each guarded route records the step of its speculating rows and of its plain ones;
        a route whose guard turned speculation off moves its rows to plain decoding."""
        plain: dict[str, list[list[int]]] = {}
        drafted = {id(row) for lane in drafting if lane.proposal for row in lane.rows}
        for row, tokens in zip(self.rows, emitted, strict=True):
            if id(row) not in drafted:
                plain.setdefault(row.request.route, []).append(tokens)
        for lane in self.lanes.values():
            if lane.guard is None:
                continue
            if lane.name in plain:
                lane.guard.record_plain_step(_token_latency(seconds, plain[lane.name]))
            if lane.proposal is not None:
                lane.guard.record_speculative_step(
                    sum(host.drafted[p] for p in lane.positions),
                    sum(host.num_accepted[p] for p in lane.positions),
                    _token_latency(seconds, [emitted[p] for p in lane.positions]),
                )
            if lane.rows and not lane.guard.speculating:
                self._trip(lane)

    # -- leaving -----------------------------------------------------------------------------

    def _fail(self, lane: _Lane, where: str, error: Exception, record: bool = True) -> None:
        """A drafter error: count it (on the guard's window too, unless `record` is False) and
        move the lane's rows to plain decoding."""
        lane.counters.drafter_errors += 1
        lane.last_error = f"drafter error in {where}: {type(error).__name__}: {error}"
        if record and lane.guard is not None:
            lane.guard.record_speculative_step(0, 0, None, error=True)
        self._trip(lane)

    def _trip(self, lane: _Lane, count: bool = True) -> None:
        """The lane's rows decode plainly from now on (counted as a trip when `count` and it had
        rows); its drafter's batch ends."""
        for row in lane.rows:
            row.lane = None
        lane.counters.trips += int(count and bool(lane.rows))
        lane.rows, lane.positions = [], []
        lane.index = None
        self._end(lane)

    def _end(self, lane: _Lane) -> None:
        if not lane.begun:
            return
        lane.begun = False
        try:
            lane.drafter.end()
        except Exception as error:  # noqa: BLE001 - nothing of the outputs depends on it
            lane.counters.drafter_errors += 1
            lane.last_error = f"drafter error in end: {type(error).__name__}: {error}"

    def _drop(self, leaving: list[int]) -> None:
        """The rows at batch positions `leaving` leave the batch (their finish reason set) and
        their lanes; each request's completion is then delivered."""
        if not leaving:
            return
        gone = set(leaving)
        keep = [p for p in range(len(self.rows)) if p not in gone]
        finished = [self.rows[p] for p in leaving]
        self.runner.keep(keep)
        self.rows = [self.rows[p] for p in keep]
        index = to_device(keep, self.device)
        host_index = torch.tensor(keep, dtype=torch.int64)
        self._roots = self._roots[index]
        self._sampling = Sampling(
            *(getattr(self._sampling, name)[host_index] for name in SAMPLING_FIELDS)
        )
        if self._device_sampling is not None:
            params = self._device_sampling
            self._device_sampling = SamplingParams(
                *(t[index] for t in (params.temperature, params.top_k, params.top_p, params.seed))
            )
        self._all_greedy = all(row.greedy for row in self.rows)
        gone_rows = {id(row) for row in finished}
        for lane in self.lanes.values():
            kept = [i for i, row in enumerate(lane.rows) if id(row) not in gone_rows]
            if len(kept) == len(lane.rows):
                continue
            lane.rows = [lane.rows[i] for i in kept]
            if not lane.rows:
                self._end(lane)
                continue
            try:
                lane.drafter.keep(kept)
            except Exception as error:  # noqa: BLE001
                self._fail(lane, "keep", error)
        self._index_lanes()
        for row in finished:
            self._finish(row, row.stats.finish_reason)

    def _drop_cancelled(self) -> None:
        with self._lock:
            cancelled = [row for row in self._waiting if row.handle.cancelled]
            for row in cancelled:
                self._waiting.remove(row)
        for row in cancelled:
            self._finish(row, CANCELLED)
        leaving = [p for p, row in enumerate(self.rows) if row.handle.cancelled]
        for p in leaving:
            self.rows[p].stats.finish_reason = CANCELLED
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
        self.rows, self._prefill = [], None
        for lane in self.lanes.values():
            self._trip(lane, count=False)
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
        row.handle.completion = completion
        row.handle.done.set()
        if row.request.on_finish is not None:
            row.request.on_finish(completion)
