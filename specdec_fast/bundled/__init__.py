"""Checkpoints shipped with the package (Hugging Face folders, loadable offline).

`path("tiny-code")` is the target model, `path("tiny-code-draft")` its draft model; drafter heads
trained for the target live beside them. Each folder's README.md says how it was made.

`path("smollm2-135m-instruct")` is a real target that is not shipped here but made on first use
from the GGUF file of a package on the registry (`specdec_fast.bundled.converted`); its drafters
(`smollm2-135m-instruct-eagle3`, `-dflash`) are shipped like the others.
"""

from pathlib import Path

from . import converted

_ROOT = Path(__file__).resolve().parent


def available() -> list[str]:
    """Names of the bundled checkpoints present in this installation, and the converted
    targets (made on first use when their package is installed)."""
    shipped = [entry.name for entry in _ROOT.iterdir() if (entry / "config.json").is_file()]
    return sorted([*shipped, *converted.SOURCES])


def path(name: str) -> str:
    """The local folder of bundled checkpoint `name`, for `from_pretrained`: a converted target
    is made on first use (`converted.folder`)."""
    if name in converted.SOURCES:
        return converted.folder(name)
    folder = _ROOT / name
    if not (folder / "config.json").is_file():
        raise ValueError(f"name: expected one of {available()}, got {name!r}")
    return str(folder)
