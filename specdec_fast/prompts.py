"""Code-completion prompts cut from the held-out standard-library modules.

The bundled models never saw these modules (see `specdec_fast.train.corpus`). The prompts ship with
the package (`data/code_prompts.jsonl`), so the demo and benchmarks use the same ones on any
interpreter; `python -m specdec_fast.train prompts` rebuilds the file from the running
interpreter's standard library.
"""

from __future__ import annotations

import json
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent / "data"
CODE_PROMPTS = DATA_DIR / "code_prompts.jsonl"


def load_code_prompts(limit: int | None = None) -> list[dict]:
    """The shipped held-out code prompts: dicts with `prompt`, `task` and `source`."""
    records = [json.loads(line) for line in CODE_PROMPTS.read_text().splitlines() if line]
    return records[:limit]
