"""Benchmark prompt sets: the JSONL format, its loader, and the shipped default set.

One JSON object per line:
    prompt           the text to complete, or
    messages         chat messages instead, [{"role": "user", "content": "..."}, ...] (one of the
                     two is required; a chat model gets `prompt` as one user message)
    task             qa | code | summary | rag | agent | structured, or any label (default "other")
    max_new_tokens   default: the benchmark's
    temperature      default 0.0 (greedy)
    check            exact | json | python | a regular expression (see `harness.checks`)
    id, source       free-form labels, shown in reports

The default set (`data/default_prompts.jsonl`) is built offline from the standard-library modules
the bundled models never saw (`specdec_fast.train.corpus`, held-out split): code completion cut from
those modules, JSON / SQL / config generation, docstring summaries, questions with and without the
function source as context, and tool calls. `python -m specdec_fast.train prompts` rebuilds it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from specdec_fast.files import FileFormatError
from specdec_fast.harness.checks import validate_check
from specdec_fast.kernels.validation import check_sampling_scalar
from specdec_fast.prompts import DATA_DIR
from specdec_fast.text import check_messages

DEFAULT_PROMPTS = DATA_DIR / "default_prompts.jsonl"
TASKS = ("qa", "code", "summary", "rag", "agent", "structured")
_FIELDS = ("prompt", "messages", "task", "max_new_tokens", "temperature", "check", "id", "source")


@dataclass
class PromptRecord:
    """One benchmark prompt (see the module doc for the fields): `prompt` text or chat
    `messages`, exactly one of them."""

    prompt: str | None
    task: str = "other"
    max_new_tokens: int | None = None
    temperature: float = 0.0
    check: str | None = None
    id: str = ""
    source: str | None = None
    messages: list[dict] | None = None

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @property
    def text(self) -> str:
        """The prompt for reports: the text, or the messages one per line as `role: content`."""
        if self.prompt is not None:
            return self.prompt
        return "\n".join(f"{m['role']}: {m['content']}" for m in self.messages)


def parse_record(values: dict, where: str) -> PromptRecord:
    """A `PromptRecord` from one decoded JSONL line; errors name `where` and the field."""
    if not isinstance(values, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(values).__name__}")
    unknown = sorted(set(values) - set(_FIELDS))
    if unknown:
        raise ValueError(f"{where}: unknown fields {unknown}; known: {', '.join(_FIELDS)}")
    prompt, messages = values.get("prompt"), values.get("messages")
    if prompt is not None and messages is not None:
        raise ValueError(f"{where}: give `prompt` or `messages`, not both")
    if messages is not None:
        check_messages(messages, f"{where}.messages")
    elif not isinstance(prompt, str) or not prompt:
        raise ValueError(
            f"{where}.prompt: expected a non-empty string (or chat `messages`), got {prompt!r}"
        )
    record = PromptRecord(prompt=prompt, messages=messages, id=str(values.get("id", where)))
    task = values.get("task", record.task)
    if not isinstance(task, str) or not task:
        raise ValueError(f"{where}.task: expected a non-empty string, got {task!r}")
    record.task = task
    limit = values.get("max_new_tokens")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"{where}.max_new_tokens: expected a positive integer, got {limit!r}")
    record.max_new_tokens = limit
    try:
        record.temperature = float(
            check_sampling_scalar("temperature", values.get("temperature", 0.0))
        )
    except ValueError as error:
        raise ValueError(f"{where}.{error}") from None
    check = values.get("check")
    if check is not None:
        if not isinstance(check, str):
            raise ValueError(f"{where}.check: expected a string, got {check!r}")
        try:
            validate_check(check)
        except ValueError as error:
            raise ValueError(f"{where}.{error}") from None
    record.check = check
    record.source = values.get("source")
    return record


def load_prompts(path: str | Path) -> list[PromptRecord]:
    """The prompts of a JSONL file (blank lines skipped); errors name the file and line."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as error:
        raise FileFormatError(f"{path}: cannot read the prompts: {error}") from None
    records = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{Path(path).name}:{number}"
        try:
            values = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{where}: invalid JSON ({error})") from None
        records.append(parse_record(values, where))
    if not records:
        raise ValueError(f"{path}: no prompts")
    return records


def first_per_task(records: list[PromptRecord], limit: int | None) -> list[PromptRecord]:
    """The first `limit` records of each task (all of them when `limit` is None), in order."""
    if limit is None:
        return records
    taken: dict[str, int] = {}
    out = []
    for record in records:
        if taken.get(record.task, 0) < limit:
            taken[record.task] = taken.get(record.task, 0) + 1
            out.append(record)
    return out


def default_prompts(limit_per_task: int | None = None) -> list[PromptRecord]:
    """The shipped default prompt set, optionally cut to the first `limit_per_task` per task."""
    return first_per_task(load_prompts(DEFAULT_PROMPTS), limit_per_task)
