"""The prompts shipped for the demo and the benchmarks.

Code-completion prompts (`data/code_prompts.jsonl`) are cut from the held-out standard-library
modules, which the bundled models never saw (see `specdec_fast.train.corpus`); they ship with the
package, so every interpreter uses the same ones, and `python -m specdec_fast.train prompts`
rebuilds them from the running interpreter's standard library. Chat prompts
(`data/chat_prompts.jsonl`, written by hand: short coding and writing requests) are for models
with a chat template.
"""

from __future__ import annotations

import json
from pathlib import Path

from specdec_fast.text import check_messages

DATA_DIR = Path(__file__).resolve().parent / "data"
CODE_PROMPTS = DATA_DIR / "code_prompts.jsonl"
CHAT_PROMPTS = DATA_DIR / "chat_prompts.jsonl"


def load_code_prompts(limit: int | None = None) -> list[dict]:
    """The shipped held-out code prompts: dicts with `prompt`, `task` and `source`."""
    records = [json.loads(line) for line in CODE_PROMPTS.read_text().splitlines() if line]
    return records[:limit]


def load_chat_prompts(limit: int | None = None) -> list[dict]:
    """The shipped chat prompts: dicts with `messages` (role/content), `task` and `id`."""
    records = [json.loads(line) for line in CHAT_PROMPTS.read_text().splitlines() if line]
    for number, record in enumerate(records, start=1):
        check_messages(record["messages"], f"{CHAT_PROMPTS.name}:{number}.messages")
    return records[:limit]
