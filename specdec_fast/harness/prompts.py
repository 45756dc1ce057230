"""Benchmark prompt sets: the JSONL format, its loader, and the shipped default set.

One JSON object per line:
    prompt           the text to complete (required)
    task             qa | code | summary | rag | agent | structured, or any label (default "other")
    max_new_tokens   default: the benchmark's
    temperature      default 0.0 (greedy)
    check            exact | json | python | a regular expression (see `harness.checks`)
    id, source       free-form labels, shown in reports

The default set (`data/default_prompts.jsonl`) is built offline from the standard-library modules
the bundled models never saw (`specdec_fast.train.corpus`, held-out split): code completion cut from
those modules, JSON / SQL / config generation, docstring summaries, questions with and without the
function source as context, and tool calls. `python -m specdec_fast.harness.prompts` rebuilds it.
"""

from __future__ import annotations

import ast
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from specdec_fast.harness.checks import validate_check
from specdec_fast.prompts import DATA_DIR, load_code_prompts

DEFAULT_PROMPTS = DATA_DIR / "default_prompts.jsonl"
TASKS = ("qa", "code", "summary", "rag", "agent", "structured")
_FIELDS = ("prompt", "task", "max_new_tokens", "temperature", "check", "id", "source")


@dataclass
class PromptRecord:
    """One benchmark prompt (see the module doc for the fields)."""

    prompt: str
    task: str = "other"
    max_new_tokens: int | None = None
    temperature: float = 0.0
    check: str | None = None
    id: str = ""
    source: str | None = None

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


def parse_record(values: dict, where: str) -> PromptRecord:
    """A `PromptRecord` from one decoded JSONL line; errors name `where` and the field."""
    if not isinstance(values, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(values).__name__}")
    unknown = sorted(set(values) - set(_FIELDS))
    if unknown:
        raise ValueError(f"{where}: unknown fields {unknown}; known: {', '.join(_FIELDS)}")
    prompt = values.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise ValueError(f"{where}.prompt: expected a non-empty string, got {prompt!r}")
    record = PromptRecord(prompt=prompt, id=str(values.get("id", where)))
    task = values.get("task", record.task)
    if not isinstance(task, str) or not task:
        raise ValueError(f"{where}.task: expected a non-empty string, got {task!r}")
    record.task = task
    limit = values.get("max_new_tokens")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"{where}.max_new_tokens: expected a positive integer, got {limit!r}")
    record.max_new_tokens = limit
    temperature = values.get("temperature", 0.0)
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, (int, float))
        or (temperature < 0)
    ):
        raise ValueError(f"{where}.temperature: expected a number >= 0, got {temperature!r}")
    record.temperature = float(temperature)
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
    records = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
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


def _documented_functions(per_task: int) -> list[tuple[str, ast.FunctionDef, str, str]]:
    """(module, function node, docstring, source) of documented functions with arguments in the
    held-out modules, in file order."""
    from specdec_fast.train import corpus

    root = corpus.stdlib_root()
    found = []
    for rel in corpus.list_files("heldout", root):
        try:
            text = (root / rel).read_text(encoding="utf-8")
            tree = ast.parse(text)
        except (UnicodeDecodeError, SyntaxError):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            args = [a.arg for a in node.args.args if a.arg not in ("self", "cls")]
            source = ast.get_source_segment(text, node) or ""
            if doc and args and 40 <= len(doc) <= 600 and len(source) <= 1200:
                found.append((rel, node, doc, source))
                break  # one function per module keeps the set diverse
        if len(found) == 4 * per_task:
            break
    return found


def build_default_prompts(per_task: int = 4) -> list[PromptRecord]:
    """The default set: `per_task` prompts of each task type (see the module doc)."""
    functions = _documented_functions(per_task)
    records = [
        PromptRecord(r["prompt"], "code", 64, 0.0, "python", f"code-{i}", r["source"])
        for i, r in enumerate(load_code_prompts(per_task))
    ]
    for i, (module, node, doc, _) in enumerate(functions[:per_task]):
        records.append(
            PromptRecord(
                f"# Summarize this docstring of {node.name}() in one line.\n"
                f'"""\n{doc}\n"""\n# Summary:',
                "summary",
                32,
                0.0,
                r"\w+",
                f"summary-{i}",
                module,
            )
        )
        records.append(
            PromptRecord(
                f"# Q: What does {module[:-3].replace('/', '.')}.{node.name}() do?\n# A:",
                "qa",
                32,
                0.8 if i % 2 else 0.0,
                r"\w+",
                f"qa-{i}",
                module,
            )
        )
    for i, (module, node, _, source) in enumerate(functions[per_task : 2 * per_task]):
        args = [a.arg for a in node.args.args if a.arg not in ("self", "cls")]
        records.append(
            PromptRecord(
                f"# Context:\n{source}\n\n# Q: Which arguments does {node.name}() take?\n# A:",
                "rag",
                32,
                0.0,
                "|".join(args),
                f"rag-{i}",
                module,
            )
        )
    for i, (module, node, _, _) in enumerate(functions[2 * per_task : 3 * per_task]):
        records.append(
            PromptRecord(
                "# Tools: search(query), read_file(path), run(command)\n"
                f"# Task: find where {node.name}() is defined and show its source.\n"
                "# Reply with one tool call as JSON.\ncall = ",
                "agent",
                48,
                0.0,
                "json",
                f"agent-{i}",
                module,
            )
        )
    structured = [
        ("# The settings of this module as JSON.\nsettings = ", "json"),
        ("# One row of the results table as a JSON object.\nrow = ", "json"),
        ('cursor.execute("', r"(?i)\b(select|insert|update|delete|create)\b"),
        ('CONFIG = """\n[server]\nhost = localhost\nport = 8080\n\n[', r"(?m)^\w+\s*="),
    ]
    for i, (module, node, _, _) in enumerate(functions[3 * per_task : 4 * per_task]):
        prompt, check = structured[i % len(structured)]
        header = f"# Module {module}, function {node.name}().\n"
        records.append(
            PromptRecord(header + prompt, "structured", 48, 0.0, check, f"structured-{i}", module)
        )
    return records


def main() -> None:
    records = build_default_prompts()
    DEFAULT_PROMPTS.write_text("".join(json.dumps(r.to_dict()) + "\n" for r in records))
    print(f"wrote {len(records)} prompts to {DEFAULT_PROMPTS}")


if __name__ == "__main__":
    main()
