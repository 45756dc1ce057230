"""Building the shipped prompt files from the held-out standard-library modules.

`python -m specdec_fast.train prompts` rewrites `data/code_prompts.jsonl` (read by
`specdec_fast.prompts`) and `data/default_prompts.jsonl` (read by `specdec_fast.harness.prompts`)
from the running interpreter's standard library.
"""

from __future__ import annotations

import ast
import json
import re
import sys

import torch

from specdec_fast.harness.prompts import DEFAULT_PROMPTS, PromptRecord
from specdec_fast.prompts import CODE_PROMPTS, load_code_prompts

from . import corpus

# A prompt ends right after a function signature and its docstring's first line, where the
# continuation (the docstring, then the body) is the model's job.
_CUT = re.compile(r"^( *)def [^\n]*:\n\1    \"\"\"[^\n]*\n", re.MULTILINE)


def cut_prompts(text: str, context_chars: int, per_file: int | None) -> list[str]:
    """Up to `per_file` prompts (None: every one) from one module: the `context_chars`
    characters before and including each cut point, starting at a line boundary."""
    prompts = []
    for match in _CUT.finditer(text):
        end = match.end()
        start = text.find("\n", max(0, end - context_chars)) + 1
        if end - start < context_chars // 2:
            continue
        prompts.append(text[start:end])
        if len(prompts) == per_file:
            break
    return prompts


def training_prompts(texts: list[str], tokenizer, prompt_len: int, per_file: int | None = 4):
    """int64 `[count, prompt_len]` token rows: the last `prompt_len` tokens (no BOS) of every
    prompt cut from `texts` as the shipped code prompts are (after a signature and its
    docstring's first line; at most `per_file` per text, None for all), skipping shorter ones."""
    rows = []
    for text in texts:
        for prompt in cut_prompts(text, context_chars=600, per_file=per_file):
            ids = tokenizer(prompt, add_special_tokens=False).input_ids
            if len(ids) >= prompt_len:
                rows.append(ids[-prompt_len:])
    if not rows:
        raise ValueError(f"no training prompt of at least {prompt_len} tokens in the corpus")
    return torch.tensor(rows, dtype=torch.int64)


def build_code_prompts(count: int = 24, context_chars: int = 600, per_file: int = 2) -> list[dict]:
    """Prompts from the held-out modules of the running interpreter, in file-list order."""
    root = corpus.stdlib_root()
    records = []
    for rel in corpus.list_files("heldout", root):
        text = (root / rel).read_text(encoding="utf-8", errors="replace")
        for prompt in cut_prompts(text, context_chars, per_file):
            records.append({"prompt": prompt, "task": "code", "source": rel})
            if len(records) == count:
                return records
    return records


def _documented_functions(per_task: int) -> list[tuple[str, ast.FunctionDef, str, str]]:
    """(module, function node, docstring, source) of documented functions with arguments in the
    held-out modules, in file order."""
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


def _run_prompts(args) -> int:
    code = build_code_prompts()
    CODE_PROMPTS.parent.mkdir(exist_ok=True)
    CODE_PROMPTS.write_text("".join(json.dumps(r) + "\n" for r in code))
    records = build_default_prompts()
    DEFAULT_PROMPTS.write_text("".join(json.dumps(r.to_dict()) + "\n" for r in records))
    print(f"wrote {len(code)} prompts to {CODE_PROMPTS}", file=sys.stderr)
    print(f"wrote {len(records)} prompts to {DEFAULT_PROMPTS}", file=sys.stderr)
    return 0


def register_prompts(sub) -> None:
    parser = sub.add_parser(
        "prompts", help="rebuild the shipped prompt files from the held-out stdlib modules"
    )
    parser.set_defaults(run=_run_prompts)
