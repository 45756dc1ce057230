"""Reading the files a user points us at, with errors that name the file, and the line or field.

Every reader here raises `FileFormatError` (a ValueError) whose message starts with the file's
path: JSON and YAML errors give the line and column, safetensors and `torch.load` errors say
what the file is not, and `check_config_fields` names a config field of the wrong kind. YAML is
read with `yaml.safe_load` (no Python tags) and tensors with `torch.load(weights_only=True)`
(no code runs); a pickle payload is refused with a one-line reason instead of torch's own.
"""

from __future__ import annotations

import json
import os
import pickle
import struct
from pathlib import Path

import torch

# Integer fields of model and head configs: transformers would fail deep inside on another kind.
INT_CONFIG_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "num_heads",
    "num_layers",
    "block_size",
)


class FileFormatError(ValueError):
    """A file that cannot be read as what it should be; the message starts with its path."""


def _line(mark) -> str:
    return f"line {mark.line + 1}, column {mark.column + 1}"


def parse_json(text: str, source: str | os.PathLike):
    """`json.loads(text)`; on failure the error names `source` and the line."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise FileFormatError(
            f"{source}: not valid JSON: {error.msg} at line {error.lineno}, column {error.colno}"
        ) from None


def read_json(path: str | os.PathLike):
    """The JSON document in `path`."""
    path = Path(path)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as error:
        raise FileFormatError(f"{path}: cannot read it: {error}") from None
    return parse_json(text, path)


def parse_yaml(text: str, source: str | os.PathLike):
    """`yaml.safe_load(text)`; parser errors and Python tags name `source` and the line."""
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        where = f" at {_line(mark)}" if mark is not None else ""
        problem = error.problem or error.context or "malformed"
        if isinstance(error, yaml.constructor.ConstructorError) and "tag" in problem:
            problem += " (only plain YAML is read: Python object tags are refused)"
        raise FileFormatError(f"{source}: not valid YAML{where}: {problem}") from None
    except yaml.YAMLError as error:
        raise FileFormatError(f"{source}: not valid YAML: {error}") from None


def read_safetensors_file(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as error:
        raise FileFormatError(
            f"{path}: not a readable safetensors file (truncated or corrupt?): {error}"
        ) from None


def read_torch(path: str | os.PathLike) -> dict:
    """The state dict of a PyTorch tensor file, read with `weights_only=True`."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise FileFormatError(
            f"{path}: not a safetensors checkpoint or a weights-only tensor file: it holds "
            "pickled Python objects, which are never loaded (they could run code); save the "
            "state dict with safetensors or torch.save(state_dict)"
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError, struct.error) as error:
        raise FileFormatError(
            f"{path}: not a readable PyTorch tensor file (truncated or corrupt?): "
            f"{str(error).splitlines()[0][:200]}"
        ) from None
    if not isinstance(state, dict):
        raise FileFormatError(f"{path}: expected a state dict, got {type(state).__name__}")
    return state


def check_config_fields(config: dict, path: str | os.PathLike) -> dict:
    """`config` (a parsed config.json) after checking it is an object whose `INT_CONFIG_FIELDS`
    that are set are positive ints; errors name the file and the field."""
    if not isinstance(config, dict):
        raise FileFormatError(f"{path}: expected a JSON object, got {type(config).__name__}")
    for name in INT_CONFIG_FIELDS:
        value = config.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise FileFormatError(f"{path}: field {name!r}: expected an int >= 1, got {value!r}")
    return config
