"""Serving a tensor-parallel target: every rank's `Scheduler` in lockstep with rank 0's.

Under `specdec-fast serve --tensor-parallel N` each rank holds its shard of the target
(`specdec_fast.parallel`) and the same `Scheduler` (the same routes, drafters and limits). Rank 0
runs the HTTP server and takes the requests; the other ranks run no server: their scheduler runs
on their main thread (`Scheduler.follow`) and takes rank 0's requests.

A step follows from the batch's tokens, except for what the world decides between two steps
(requests submitted, requests cancelled, a shadow route's quality regressions, a stop) and what a
rank measures (a step's seconds, which the guardrails read). Rank 0 collects the first in a
`Plan` and broadcasts it at the top of every scheduler step (`Lockstep.exchange`: one
`broadcast_object_list`); every rank applies it before the step: the same requests (seeds drawn
on rank 0) join the same queue in the same order, the same requests are cancelled, the same
guards record the regressions. A step's seconds are agreed (`Lockstep.slowest`: an all-reduce,
max) before the guards read them. Admission from the queue, prefill chunks, joins, drafts,
accept/reject and finishing then come out the same on every rank, as in `generate`
(docs/PARALLEL.md, "How the ranks agree").

The agreement is checked, not assumed: after a step in which rank 0 finished requests, the next
plan has every rank compare a digest of the requests finished since the last check (their keys
and tokens, in order: `parallel.check_agreement`); a disagreement raises RuntimeError on every
rank, which stops the server (a rank cannot recover alone).

An idle rank 0 broadcasts an empty plan every `HEARTBEAT_S`, so that the other ranks, waiting in
the broadcast, never reach the process group's timeout.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from specdec_fast.parallel import check_agreement

HEARTBEAT_S = 60.0


@dataclass
class Plan:
    """What rank 0 decided since the last step, for every rank to apply before the next.

    submitted: (key, request) for each request submitted, in queue order: the scheduler's
        `Request` without its callbacks and with its seed drawn. cancelled: (key, reason) of each
        request cancelled. regressed: routes whose shadow copies caught a quality regression (one
        entry each). check: compare digests of the requests finished since the last check.
    stop: the scheduler closes; the other ranks leave `Scheduler.follow`.
    """

    submitted: list[tuple[int, object]] = field(default_factory=list)
    cancelled: list[tuple[int, str]] = field(default_factory=list)
    regressed: list[str] = field(default_factory=list)
    check: bool = False
    stop: bool = False


class Lockstep:
    """One rank's side of the plan (see the module).

    On rank 0 (`leads`), `announce(row)`, `cancel(key)` and `regressed(route)` may be called
    from any thread; they
    wait for the next `exchange`. `exchange`, `slowest` and `finished` run on the thread
    that runs the scheduler's steps, on every rank in the same order.
    """

    def __init__(self, device: torch.device):
        self.leads = dist.get_rank() == 0
        self.device = device
        self.handles: dict[int, object] = {}  # key -> the handle of a request not yet ended
        self.stopped = False  # a plan stopped the schedulers
        self._lock = threading.Lock()
        self._rows: list = []  # rank 0: rows submitted since the last exchange
        self._cancelled: list[tuple[int, str]] = []
        self._regressed: list[str] = []
        self._finished: list[torch.Tensor] = []  # int64 [1 + tokens]: key, then the tokens
        self._keys = itertools.count()

    @property
    def announced(self) -> int:
        """Rank 0: requests submitted that the next exchange queues."""
        return len(self._rows)

    def announce(self, row) -> None:
        """Rank 0: queue `row` (a scheduler row, its request's seed drawn) at the next exchange;
        its handle gets its key."""
        with self._lock:
            row.handle.key = next(self._keys)
            self._rows.append(row)

    def cancel(self, key: int, reason: str) -> None:
        """Rank 0: cancel the request `key` (finish reason `reason`) on every rank at the next
        exchange."""
        with self._lock:
            self._cancelled.append((key, reason))

    def regressed(self, route: str) -> None:
        """Rank 0: a quality regression for `route`'s guard, recorded on every rank at the next
        exchange."""
        with self._lock:
            self._regressed.append(route)

    def exchange(self, make_row, stop: bool = False) -> tuple[list, Plan]:
        """Broadcast rank 0's plan and apply its requests here: returns the rows to queue, in
        order (made by `make_row(request, key)` on the other ranks), and the plan. The
        cancelled requests' handles are marked; a check compares the finished requests'
        digests (RuntimeError on disagreement)."""
        plan, rows = None, []
        if self.leads:
            with self._lock:
                rows, self._rows = self._rows, []
                cancelled, self._cancelled = self._cancelled, []
                regressed, self._regressed = self._regressed, []
            submitted = [
                (row.handle.key, replace(row.request, on_tokens=None, on_finish=None))
                for row in rows
            ]
            plan = Plan(submitted, cancelled, regressed, bool(self._finished), stop)
        message = [plan]
        dist.broadcast_object_list(message, src=0)
        plan = message[0]
        self.stopped = plan.stop
        if not self.leads:
            rows = [make_row(request, key) for key, request in plan.submitted]
        for row in rows:
            self.handles[row.handle.key] = row.handle
        for key, reason in plan.cancelled:
            handle = self.handles.get(key)
            if handle is not None:  # else it ended before the cancellation reached the plan
                handle.mark_cancelled(reason)
        if plan.check:
            sequences, self._finished = self._finished, []
            check_agreement(sequences, self.device)
        return rows, plan

    def finished(self, key: int, tokens: list[int]) -> None:
        """The request `key` ended with `tokens` (checked at the next check)."""
        self.handles.pop(key, None)
        self._finished.append(torch.tensor([key, *tokens], dtype=torch.long))

    def slowest(self, seconds: float) -> float:
        """The largest of every rank's `seconds` (one all-reduce)."""
        value = torch.tensor([seconds], dtype=torch.float64, device=self.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return float(value.item())
