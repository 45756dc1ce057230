"""Graceful shutdown: on SIGTERM or SIGINT the server drains, then exits 0.

`GracefulServer` (a `uvicorn.Server`) takes the first signal as a request to drain (`Drain`):
new `/v1` requests get a 503 (code "shutting_down") and `/health` turns 503 while the listening
socket stays open, the requests in flight run on for up to `deadline_s`, those still running
then are cancelled (their responses end with `finish_reason` "abort", streams with their last
chunk and `[DONE]`), and uvicorn's own shutdown follows: connections closed once their
responses are sent, then the application's lifespan closes the engine (the scheduler ends,
the model's attention is restored). A second SIGINT forces the exit at once (uvicorn's).
Uvicorn re-raises a signal it handled once it is done, which would end the process by that
signal; the drain does not, so `specdec-fast serve` returns 0.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import signal
import threading
import time

import uvicorn

from specdec_fast.serving.limits import DRAIN_DEADLINE_S

# How long the cancelled requests' last responses may take to be written before uvicorn closes
# their connections.
CANCEL_GRACE_S = 10.0
POLL_S = 0.05

logger = logging.getLogger("specdec_fast.serving")


class Drain:
    """The requests in flight (accepted by the engine, not yet ended) and the drain.

    `admitting` counts the requests on their way to the engine (the event loop's), `track(handle)`
    when the engine accepts one, `release(key)` when its completion arrives (any thread);
    `run()` stops admitting, waits, cancels the rest.
    """

    def __init__(self, deadline_s: float = DRAIN_DEADLINE_S):
        self.deadline_s = deadline_s
        self.draining = False
        self.cancelled = 0  # requests cancelled at the deadline
        self.admitting = 0  # requests being submitted to the engine (not yet tracked)
        self._lock = threading.Lock()
        self._handles: dict[int, object] = {}
        self._keys = itertools.count()

    def track(self, handle) -> int:
        key = next(self._keys)
        with self._lock:
            self._handles[key] = handle
        return key

    def release(self, key: int) -> None:
        with self._lock:
            self._handles.pop(key, None)

    @property
    def in_flight(self) -> int:
        return len(self._handles)

    def _busy(self) -> bool:
        return bool(self._handles) or self.admitting > 0

    async def run(self) -> None:
        """Stop admitting; wait up to the deadline for the requests in flight; then cancel
        them, and any the engine accepts meanwhile, and wait (a bounded while) for their
        completions."""
        self.draining = True
        logger.info(
            "draining: %d requests in flight, deadline %.1f s", self.in_flight, self.deadline_s
        )
        end = time.monotonic() + self.deadline_s
        while self._busy() and time.monotonic() < end:
            await asyncio.sleep(POLL_S)
        cancelled: set[int] = set()
        end = time.monotonic() + CANCEL_GRACE_S
        while self._busy() and time.monotonic() < end:
            with self._lock:
                left = [(k, h) for k, h in self._handles.items() if k not in cancelled]
            for key, handle in left:
                handle.cancel()
                cancelled.add(key)
            await asyncio.sleep(POLL_S)
        self.cancelled = len(cancelled)
        if cancelled:
            logger.warning("drain deadline: cancelled %d requests", len(cancelled))


class GracefulServer(uvicorn.Server):
    """uvicorn's server with `Drain` on the first SIGTERM or SIGINT (see the module)."""

    def __init__(self, config: uvicorn.Config, drain: Drain):
        super().__init__(config)
        self.drain = drain
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining: asyncio.Task | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        if self._loop is None or (self.drain.draining and sig == signal.SIGINT):
            self.should_exit = self.force_exit = True
            return
        if not self.drain.draining:
            self.drain.draining = True  # at once: the loop runs the drain after this handler
            self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._draining = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            await self.drain.run()
        finally:
            self.should_exit = True


def log_to_stderr() -> None:
    """The server's own messages (the drain, the warnings at start) on stderr, as uvicorn's."""
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def run_server(app, host: str, port: int, log_level: str, drain_s: float) -> None:
    """Serve `app` until a signal has drained it (`GracefulServer`)."""
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=int(CANCEL_GRACE_S),
    )
    GracefulServer(config, app.state.drain).run()
