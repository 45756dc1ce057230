"""Checkpoints shipped with the package (Hugging Face folders, loadable offline).

`path("tiny-code")` is the target model, `path("tiny-code-draft")` its draft model; drafter heads
trained for the target live beside them. Each folder's README.md says how it was made.
"""

from pathlib import Path

_ROOT = Path(__file__).resolve().parent


def available() -> list[str]:
    """Names of the bundled checkpoints present in this installation."""
    return sorted(entry.name for entry in _ROOT.iterdir() if (entry / "config.json").is_file())


def path(name: str) -> str:
    """The local folder of bundled checkpoint `name`, for `from_pretrained`."""
    folder = _ROOT / name
    if not (folder / "config.json").is_file():
        raise ValueError(f"name: expected one of {available()}, got {name!r}")
    return str(folder)
