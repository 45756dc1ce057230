"""The per-window JSONL training log, with progress on stderr (`specdec_fast.progress`)."""

import json
import time

from specdec_fast.progress import Progress

# Training runs in the background: where stderr is a log file, a status line this often.
LOG_EVERY_S = 5.0


class StepLog:
    """Per-window training log: averages the loss over the steps since the last record, appends
    one JSON line to `path` and advances a progress bar.

    `add(loss)` after every step; `record(step, **fields)` when a window ends (extra fields such as
    lr or accuracy go into the line as given).
    """

    def __init__(self, path, total_steps: int, start_step: int, tokens_per_step: int, desc: str):
        self._file = open(path, "a")  # noqa: SIM115 (closed by close())
        self._progress = Progress(
            total_steps,
            initial=start_step,
            desc=desc,
            unit="step",
            min_interval_s=LOG_EVERY_S,
            log_every_s=LOG_EVERY_S,
        )
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
