"""Code-completion prompts cut from the held-out standard-library modules.

The bundled models never saw these modules (see `specdec_fast.train.corpus`). The prompts ship with
the package (`data/code_prompts.jsonl`), so the demo and benchmarks use the same ones on any
interpreter; `python -m specdec_fast.prompts` rebuilds the file from the running interpreter's
standard library.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent / "data"
CODE_PROMPTS = DATA_DIR / "code_prompts.jsonl"
# A prompt ends right after a function signature and its docstring's first line, where the
# continuation (the docstring, then the body) is the model's job.
_CUT = re.compile(r"^( *)def [^\n]*:\n\1    \"\"\"[^\n]*\n", re.MULTILINE)


def cut_prompts(text: str, context_chars: int, per_file: int) -> list[str]:
    """Up to `per_file` prompts from one module: the `context_chars` characters before and
    including each cut point, starting at a line boundary."""
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


def build_code_prompts(count: int = 24, context_chars: int = 600, per_file: int = 2) -> list[dict]:
    """Prompts from the held-out modules of the running interpreter, in file-list order."""
    from specdec_fast.train import corpus

    root = corpus.stdlib_root()
    records = []
    for rel in corpus.list_files("heldout", root):
        text = (root / rel).read_text(encoding="utf-8", errors="replace")
        for prompt in cut_prompts(text, context_chars, per_file):
            records.append({"prompt": prompt, "task": "code", "source": rel})
            if len(records) == count:
                return records
    return records


def load_code_prompts(limit: int | None = None) -> list[dict]:
    """The shipped held-out code prompts: dicts with `prompt`, `task` and `source`."""
    records = [json.loads(line) for line in CODE_PROMPTS.read_text().splitlines() if line]
    return records[:limit]


def main() -> None:
    records = build_code_prompts()
    DATA_DIR.mkdir(exist_ok=True)
    CODE_PROMPTS.write_text("".join(json.dumps(r) + "\n" for r in records))
    print(f"wrote {len(records)} prompts to {CODE_PROMPTS}")


if __name__ == "__main__":
    main()
