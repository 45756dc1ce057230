"""Write a trained model as a Hugging Face checkpoint folder (bf16 safetensors + tokenizer)."""

import json
import sys
from pathlib import Path

import torch
from transformers import GenerationConfig, PreTrainedModel

from .tokenizer import load_tokenizer

INFO_NAME = "training_info.json"


def export_checkpoint(
    model: PreTrainedModel, tokenizer_dir: str | Path, out_dir: str | Path, info: dict
) -> None:
    """Save `model` in bf16 with its tokenizer, generation config and `training_info.json`.

    `info` describes the run (command, settings, tokens trained); the parameter count is added.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(tokenizer_dir)
    model = model.to(device="cpu", dtype=torch.bfloat16).eval()
    model.config.dtype = torch.bfloat16
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(str(out_dir))
    # safetensors writes 0600; installed package data must be readable by every user.
    (out_dir / "model.safetensors").chmod(0o644)
    tokenizer.save_pretrained(str(out_dir))
    info = {
        **info,
        "parameters": sum(p.numel() for p in model.parameters()),
        "python": sys.version.split()[0],
    }
    write_info(out_dir, info)


def read_info(model_dir: str | Path) -> dict:
    """The `training_info.json` of a checkpoint folder ({} when there is none)."""
    path = Path(model_dir) / INFO_NAME
    return json.loads(path.read_text()) if path.exists() else {}


def write_info(model_dir: str | Path, info: dict) -> None:
    (Path(model_dir) / INFO_NAME).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
