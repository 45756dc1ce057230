"""Progress on stderr: one self-rewriting tqdm line while stderr is a terminal, nothing otherwise.

A log file or a pipe gets no progress at all (no carriage-return soup), unless the caller asks
for plain lines at most every `log_every_s` seconds, as background training runs do.
"""

from __future__ import annotations

import sys
import time

from tqdm import tqdm


class Progress:
    """Counts steps from `initial` to `total` and shows `postfix` fields with a rate and an ETA.

    enabled: False shows nothing anywhere.
    log_every_s: where stderr is not a terminal, print a plain line at most this often (and at
        the end); None prints nothing there.
    compiles: say so while torch compiles a graph (its dynamo callbacks): a first call of a
        shape may compile for tens of seconds before its first step, which would otherwise
        look like a stall. The line reads "DESC (compiling a step graph)" until it ends.
    """

    def __init__(
        self,
        total: int,
        initial: int = 0,
        desc: str = "",
        unit: str = "it",
        *,
        min_interval_s: float = 0.1,
        log_every_s: float | None = None,
        enabled: bool = True,
        compiles: bool = False,
    ):
        self.total = total
        self.count = initial
        self.desc = desc
        self.log_every_s = log_every_s if enabled else None
        self._start = time.monotonic()
        self._start_count = initial
        self._last_line = 0.0
        self._bar = None
        if enabled and sys.stderr.isatty():
            self._bar = tqdm(
                total=total,
                initial=initial,
                desc=desc,
                unit=unit,
                mininterval=min_interval_s,
                dynamic_ncols=True,
                leave=False,
                file=sys.stderr,
            )
            self.log_every_s = None
        self._callbacks = None
        if compiles and (self._bar is not None or self.log_every_s is not None):
            from torch._dynamo.callback import callback_handler

            self._callbacks = (self._compiling, self._compiled)
            callback_handler.register_start_callback(self._compiling)
            callback_handler.register_end_callback(self._compiled)

    def _compiling(self, _args) -> None:
        self._say(f"{self.desc} (compiling a step graph)")

    def _compiled(self, _args) -> None:
        self._say(self.desc)

    def _say(self, desc: str) -> None:
        if self._bar is not None:
            self._bar.set_description(desc, refresh=True)
        elif desc != self.desc:
            print(f"{desc} at {self.count}/{self.total}", file=sys.stderr, flush=True)

    def update(self, steps: int = 1, **postfix) -> None:
        self.count += steps
        if self._bar is not None:
            self._bar.set_postfix(postfix, refresh=False)
            self._bar.update(steps)
            return
        if self.log_every_s is None:
            return
        now = time.monotonic()
        if now - self._last_line < self.log_every_s and self.count < self.total:
            return
        self._last_line = now
        rate = (self.count - self._start_count) / max(now - self._start, 1e-9)
        eta_s = (self.total - self.count) / rate if rate > 0 else float("inf")
        fields = " ".join(f"{key}={value}" for key, value in postfix.items())
        print(
            f"{self.desc} {self.count}/{self.total} {fields} eta={eta_s / 60:.1f}min",
            file=sys.stderr,
            flush=True,
        )

    def close(self) -> None:
        if self._callbacks is not None:
            from torch._dynamo.callback import callback_handler

            callback_handler.remove_start_callback(self._callbacks[0])
            callback_handler.remove_end_callback(self._callbacks[1])
            self._callbacks = None
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
