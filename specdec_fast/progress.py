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
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
