"""GGUF files: what reading them needs, and their dequantization into an HF folder.

transformers reads a `.gguf` file through `from_pretrained(..., gguf_file=)`, which needs the
`gguf` and `accelerate` packages (the `gguf` extra) and dequantizes every tensor on each load.
`dequantize_to_folder` pays that once: it writes the dequantized weights as safetensors with the
config, generation config and tokenizer (chat template included), a folder any later load reads
like an HF checkpoint.
"""

from __future__ import annotations

import functools
import importlib.util
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import torch

# What transformers needs to read a GGUF file, and the extra that installs it.
GGUF_PACKAGES = ("gguf", "accelerate")
GGUF_EXTRA = "specdec-fast[gguf]"


class MissingExtra(ImportError):
    """An optional dependency is missing; the message names the extra that installs it."""


def require_gguf() -> None:
    """Raise MissingExtra naming the `gguf` extra unless transformers can read GGUF files."""
    missing = [name for name in GGUF_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise MissingExtra(
            f"loading a GGUF file needs {' and '.join(missing)}: pip install '{GGUF_EXTRA}'"
        )


def _special_tokens(tokenizer, config) -> None:
    """Name the special tokens after the ids the GGUF metadata gives (kept in `config`):
    transformers' GGUF tokenizer reader can name a different token (SmolLM2's eos comes back
    as `<|im_start|>`, its id 2 being `<|im_end|>`)."""
    for role in ("bos", "eos", "pad", "unk"):
        token_id = getattr(config, f"{role}_token_id", None)
        if token_id is not None:
            setattr(tokenizer, f"{role}_token", tokenizer.convert_ids_to_tokens(token_id))


@contextmanager
def _parsed_once() -> Iterator[None]:
    """Within the block, each GGUF file is parsed once and each of gguf's tensor-name maps built
    once. transformers parses the file anew for the config, the tokenizer and the weights (4 s
    each for SmolLM2's 49,152-token vocabulary on a 2-core CPU) and builds the same name map
    for every tensor (5 s for SmolLM2's 273); it imports both from `gguf` at each call, so the
    module's attributes are what it gets. The parsed reader is read-only (memory-mapped)."""
    import gguf

    open_reader = functools.lru_cache(maxsize=None)(gguf.GGUFReader)
    name_map = functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map)
    with (
        mock.patch.object(gguf, "GGUFReader", open_reader),
        mock.patch.object(gguf, "get_tensor_name_map", name_map),
    ):
        yield


def dequantize_to_folder(gguf_file: str | Path, out_dir: str | Path) -> None:
    """Write `gguf_file` as an HF folder `out_dir`: float32 safetensors weights (dequantized),
    config.json and generation_config.json without the GGUF quantization record, and the
    tokenizer with its chat template. Written in a temporary folder beside `out_dir` and
    renamed into place, so a reader never sees a half-written folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    require_gguf()
    gguf_file, out_dir = Path(gguf_file), Path(out_dir)
    read = {"gguf_file": gguf_file.name, "local_files_only": True, "trust_remote_code": False}
    with _parsed_once():
        quantized = AutoModelForCausalLM.from_pretrained(
            gguf_file.parent, dtype=torch.float32, **read
        )
        tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, **read)
    config = quantized.config
    del config.quantization_config
    config.dtype = torch.float32
    # A plain model of the same config holds the weights: a GGUF-quantized model refuses to save.
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())
    model.generation_config = quantized.generation_config
    _special_tokens(tokenizer, config)
    # A byte-level BPE decodes exactly without the WordPiece clean-up (which transformers warns of).
    tokenizer.clean_up_tokenization_spaces = False
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        # mkdtemp and safetensors create their entries private; a cache is for every reader.
        staging.chmod(0o755)
        for entry in staging.iterdir():
            entry.chmod(0o644)
        staging.rename(out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
