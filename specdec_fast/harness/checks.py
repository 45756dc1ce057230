"""Quality checks on generated text: `exact`, `json`, `python`, or a regular expression.

A check is judged on a completion (the generated text only) and, for `exact`, against the plain
decoding baseline's completion of the same prompt. The harness compares each check's outcome with
the baseline's: a regression is a prompt whose baseline passes and whose speculative run fails.

- `exact`: the completion equals the baseline completion.
- `json`: the completion holds a JSON object or array starting at its first `{` or `[`.
- `python`: the code, dedented, parses as Python, or parses once a trailing indented block is
  given a `pass` body. The code is the first Markdown code block's when the completion has one
  (a chat model's answer), else the completion; generated code is cut at the token limit, so
  its last line is judged only when a newline ends it (a completion of one line is judged
  whole).
- anything else: a non-empty regular expression that must match somewhere (`re.search`,
  multiline).
"""

from __future__ import annotations

import ast
import json
import re
import textwrap

NAMED_CHECKS = ("exact", "json", "python")
# A Markdown code block: its body, to the closing fence or the end of a completion cut short.
CODE_BLOCK = re.compile(r"```[^\n`]*\n(.*?)(?:^[ \t]*```|\Z)", re.DOTALL | re.MULTILINE)


def validate_check(check: str) -> None:
    """Raise ValueError if `check` is neither a named check nor a valid regular expression."""
    if check in NAMED_CHECKS:
        return
    if not check:
        raise ValueError(
            f"check: expected one of {', '.join(NAMED_CHECKS)} or a regular expression, got an "
            "empty one (it would pass everything)"
        )
    try:
        re.compile(check, re.MULTILINE)
    except re.error as error:
        raise ValueError(
            f"check: expected one of {', '.join(NAMED_CHECKS)} or a regular expression, "
            f"got {check!r} ({error})"
        ) from None


def _json_ok(text: str) -> bool:
    starts = [i for i in (text.find("{"), text.find("[")) if i >= 0]
    if not starts:
        return False
    try:
        json.JSONDecoder().raw_decode(text[min(starts) :])
    except ValueError:
        return False
    return True


def _python_ok(text: str) -> bool:
    block = CODE_BLOCK.search(text)
    if block is not None:
        text = block.group(1)
    complete = text[: text.rfind("\n") + 1] if "\n" in text else text
    source = textwrap.dedent(complete)
    for candidate in (source, source + "    pass\n"):
        try:
            ast.parse(candidate)
        except (SyntaxError, ValueError):
            continue
        return True
    return False


def passes(check: str, completion: str, baseline: str | None = None) -> bool:
    """Whether `completion` passes `check` (`baseline`: the plain completion, for `exact`)."""
    if check == "exact":
        return completion == baseline
    if check == "json":
        return _json_ok(completion)
    if check == "python":
        return _python_ok(completion)
    return re.search(check, completion, re.MULTILINE) is not None
