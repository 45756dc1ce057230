"""The evaluation harness: measure speculation on your own prompts before turning it on.

`bench(...)` (and `specdec-fast bench`) decodes a JSONL prompt set plainly and with each drafter
configuration over a grid of sizes and batch sizes, and writes `report.json` and `report.md`:
acceptance, latency percentiles, throughput, memory, errors, cost, speed-ups, quality equivalence
with plain decoding, the best configuration per task type and concurrency, and adaptive
speculation against the baseline at every concurrency.
"""

from __future__ import annotations

import platform
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path

from specdec_fast.guardrails import Guardrails
from specdec_fast.harness.prompts import (
    DEFAULT_PROMPTS,
    PromptRecord,
    default_prompts,
    first_per_task,
    load_prompts,
)
from specdec_fast.harness.report import summarize, write_report
from specdec_fast.harness.sweep import BenchConfig, run_sweep

__all__ = [
    "BenchConfig",
    "FailedRequests",
    "PromptRecord",
    "bench",
    "default_prompts",
    "load_prompts",
    "run_sweep",
    "write_report",
]


class FailedRequests(RuntimeError):
    """A sweep in which some request failed: a benchmark with a failed request measures a
    defect, so `bench` raises this once the report (which lists every failure) is written.

    report: the whole report; failures: its `failed_requests`."""

    def __init__(self, report: dict):
        self.report = report
        self.failures = report["failed_requests"]
        first = self.failures[0]
        where = report.get("files", {}).get("markdown", "the report")
        super().__init__(
            f"{len(self.failures)} failed requests (see {where}); the first: {first['cell']} "
            f"b={first['batch']} prompt {first['prompt_id']!r} ({first['side']}): "
            f"{first['error']}"
        )


def versions() -> dict[str, str]:
    """Python, torch, transformers and specdec-fast versions, for reports."""
    import torch
    import transformers

    from specdec_fast import __version__

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "specdec_fast": __version__,
    }


def bench(
    model,
    drafters: Sequence[str],
    prompts: str | Path | Sequence[PromptRecord] | None = None,
    out: str | Path | None = None,
    *,
    k: Sequence[int] = (1, 2, 3),
    trees: Sequence[int] = (),
    batch: Sequence[int] = (1, 4),
    adaptive: bool = True,
    max_new_tokens: int = 64,
    price_per_hour: float | None = None,
    guardrails: Guardrails | str | Path | None = None,
    repeats: int = 1,
    per_task: int | None = None,
    tokenizer=None,
    device: str | None = None,
    dtype: str | None = None,
    chat: bool | None = None,
    keep_special_tokens: bool = False,
    exact: bool = False,
    compile: bool | None = None,
    progress: bool = True,
) -> dict:
    """Benchmark drafters against plain decoding; returns the report and writes it to `out`.

    Args:
        model: a folder, a .gguf file or a bundled name (its tokenizer is loaded too), or a
            loaded HF model (then pass `tokenizer`).
        drafters: drafter SPECs (`ngram`, `suffix`, `draft:PATH`, `medusa:PATH`, ...).
        prompts: a JSONL file, a list of `PromptRecord`, or None for the shipped default set.
        k, trees, batch: the grid (see `BenchConfig`).
        guardrails: a `Guardrails` or a YAML file; each cell is judged against its policies.
        per_task: keep only the first `per_task` prompts of each task type.
        device, dtype: where and how to load a `model` given by path (`specdec_fast.loading`).
        chat: apply the tokenizer's chat template (None: when it has one).
        keep_special_tokens: keep special tokens in the outputs the checks judge.
        exact: decode every cell and the baseline in exact mode (`generate(..., exact=True)`);
            the report states the mode.
        compile: compile the steps; None decides (compiled on a GPU; on the CPU when the
            sweep is long enough to win back the compilation, see `harness.plan`).

    Raises:
        FailedRequests: some request failed (after the report is written).
    """
    from specdec_fast.loading import load_model, load_tokenizer, pick_device

    # The inputs given as files are read first: a bad one fails before the model loads.
    if out is not None and Path(out).exists() and not Path(out).is_dir():
        raise ValueError(f"out: {out} exists and is not a folder")
    if prompts is None:
        prompts_file, records = str(DEFAULT_PROMPTS), default_prompts(per_task)
    elif isinstance(prompts, (str, Path)):
        prompts_file, records = str(prompts), first_per_task(load_prompts(prompts), per_task)
    else:
        prompts_file, records = "(given)", first_per_task(list(prompts), per_task)
    if isinstance(guardrails, (str, Path)):
        guardrails = Guardrails.from_yaml(Path(guardrails))
    name = model if isinstance(model, (str, Path)) else type(model).__name__
    if isinstance(model, (str, Path)):
        tokenizer = tokenizer or load_tokenizer(str(model))
        model = load_model(str(model), pick_device(device), dtype)
    if tokenizer is None:
        raise ValueError("tokenizer: required when `model` is a loaded model")
    config = BenchConfig(
        drafters=list(drafters),
        sizes=list(k),
        trees=list(trees),
        batches=list(batch),
        adaptive=adaptive,
        max_new_tokens=max_new_tokens,
        price_per_hour=price_per_hour,
        repeats=repeats,
        guardrails=guardrails,
        chat=chat,
        keep_special_tokens=keep_special_tokens,
        exact=exact,
        compile=compile,
    )
    report = run_sweep(model, tokenizer, records, config, progress=progress)
    report["meta"] = {
        "model": str(name),
        "device": str(model.device),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "prompts_file": prompts_file,
        "versions": versions(),
    }
    summarize(report)
    if out is not None:
        report["files"] = write_report(report, out)
    if report["failed_requests"]:
        raise FailedRequests(report)
    return report
