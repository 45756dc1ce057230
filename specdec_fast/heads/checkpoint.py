"""Reading and writing drafter-head checkpoints in their public layouts.

A checkpoint is a folder (or a bundled name) with `config.json` and one weights file: safetensors,
or a PyTorch pickle read with `torch.load(weights_only=True)`, which executes no code. Nothing is
fetched from the network.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from specdec_fast.loading import resolve_path

CONFIG_NAME = "config.json"


def resolve_folder(name_or_path: str | os.PathLike) -> Path:
    """A checkpoint folder, or the folder of the bundled checkpoint of that name."""
    return Path(resolve_path(str(name_or_path)))


def read_config(folder: Path) -> dict:
    path = folder / CONFIG_NAME
    if not path.is_file():
        raise ValueError(f"{folder}: no {CONFIG_NAME}")
    return json.loads(path.read_text())


def read_weights(folder: Path, names: Sequence[str]) -> dict[str, torch.Tensor]:
    """The state dict in the first of `names` present in `folder` (`.safetensors` files are
    read as safetensors, anything else with `torch.load(weights_only=True)`)."""
    for name in names:
        path = folder / name
        if not path.is_file():
            continue
        if name.endswith(".safetensors"):
            return load_file(str(path))
        state = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(state, dict):
            raise ValueError(f"{path}: expected a state dict, got {type(state).__name__}")
        return state
    raise ValueError(f"{folder}: no weights file (looked for {', '.join(names)})")


SAFETENSORS_NAME = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"


def read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    """The state dict in `folder`'s `model.safetensors`, or in the shards its
    `model.safetensors.index.json` lists; nothing but safetensors is read."""
    single, index = folder / SAFETENSORS_NAME, folder / SAFETENSORS_INDEX
    if single.is_file():
        return load_file(str(single))
    if not index.is_file():
        raise ValueError(f"{folder}: no {SAFETENSORS_NAME} nor {SAFETENSORS_INDEX}")
    shards = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
    if not shards:
        raise ValueError(f"{index}: its weight_map lists no shard")
    state = {}
    for shard in shards:
        path = folder / shard
        if not path.is_file():
            raise ValueError(f"{index}: shard {shard} is missing")
        state.update(load_file(str(path)))
    return state


def load_strict(module: nn.Module, state: dict[str, torch.Tensor], what: str) -> None:
    """`module.load_state_dict(state)` with errors that name every missing or unexpected key and
    every shape that differs."""
    expected = module.state_dict()
    missing = sorted(expected.keys() - state.keys())
    unexpected = sorted(state.keys() - expected.keys())
    if missing or unexpected:
        raise ValueError(
            f"{what}: the checkpoint does not match the head's layout: missing keys {missing}, "
            f"unexpected keys {unexpected}"
        )
    for key, tensor in expected.items():
        if tuple(state[key].shape) != tuple(tensor.shape):
            raise ValueError(
                f"{what}: {key}: expected shape {tuple(tensor.shape)}, the checkpoint has "
                f"{tuple(state[key].shape)}"
            )
    module.load_state_dict({key: value.to(expected[key].dtype) for key, value in state.items()})


def write_checkpoint(
    folder: str | os.PathLike, config: dict, state: dict[str, torch.Tensor], weights_name: str
) -> None:
    """Write `config.json` and the safetensors file `weights_name` into `folder`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tensors = {key: value.detach().to("cpu").contiguous() for key, value in state.items()}
    save_file(tensors, str(folder / weights_name), metadata={"format": "pt"})


# The fields that shape one decoder layer, copied from a target's config into a head's.
LAYER_SHAPE_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "vocab_size",
    "max_position_embeddings",
    "hidden_act",
    "rope_parameters",
)


def layer_shape(config) -> dict:
    """The `LAYER_SHAPE_FIELDS` that a (text) config sets, for a head shaped like its layers."""
    return {
        key: getattr(config, key)
        for key in LAYER_SHAPE_FIELDS
        if getattr(config, key, None) is not None
    }


def check_fits(what: str, name: str, head_value, target_value) -> None:
    """Raise ValueError when a head's dimension `name` differs from the target's."""
    if head_value != target_value:
        raise ValueError(
            f"{what}: the head's {name} is {head_value}, the target's is {target_value}: the head "
            "was not made for this target"
        )
