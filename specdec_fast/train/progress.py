"""Progress reporting: a bar (tqdm when installed, otherwise a plain stderr line every few
seconds) and the per-window JSONL training log."""

import json
import sys
import time


class Progress:
    """Counts steps from `initial` to `total` and shows `postfix` fields with an ETA."""

    def __init__(self, total: int, initial: int = 0, desc: str = "", min_interval_s: float = 5.0):
        self.total = total
        self.count = initial
        self.desc = desc
        self.min_interval_s = min_interval_s
        self._start = time.monotonic()
        self._start_count = initial
        self._last_print = 0.0
        try:
            from tqdm import tqdm
        except ImportError:
            self._bar = None
        else:
            self._bar = tqdm(total=total, initial=initial, desc=desc, mininterval=min_interval_s)

    def update(self, steps: int = 1, **postfix) -> None:
        self.count += steps
        if self._bar is not None:
            self._bar.set_postfix(postfix, refresh=False)
            self._bar.update(steps)
            return
        now = time.monotonic()
        if now - self._last_print < self.min_interval_s and self.count < self.total:
            return
        self._last_print = now
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


class StepLog:
    """Per-window training log: averages the loss over the steps since the last record, appends
    one JSON line to `path` and advances a progress bar.

    `add(loss)` after every step; `record(step, **fields)` when a window ends (extra fields such as
    lr or accuracy go into the line as given).
    """

    def __init__(self, path, total_steps: int, start_step: int, tokens_per_step: int, desc: str):
        self._file = open(path, "a")  # noqa: SIM115 (closed by close())
        self._progress = Progress(total_steps, initial=start_step, desc=desc)
        self._tokens_per_step = tokens_per_step
        self._reset()

    def _reset(self) -> None:
        self._start, self._steps, self._loss_sum = time.monotonic(), 0, 0.0

    def add(self, loss: float) -> None:
        self._steps += 1
        self._loss_sum += loss

    def record(self, step: int, **fields) -> dict:
        elapsed = max(time.monotonic() - self._start, 1e-9)
        record = {
            "step": step,
            "loss": round(self._loss_sum / max(self._steps, 1), 5),
            **fields,
            "tokens": step * self._tokens_per_step,
            "tokens_per_s": round(self._steps * self._tokens_per_step / elapsed, 1),
            "time": time.time(),
        }
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        self._progress.update(
            self._steps, loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}"
        )
        self._reset()
        return record

    def close(self) -> None:
        self._progress.close()
        self._file.close()
