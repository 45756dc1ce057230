"""Loading models and tokenizers from local folders or bundled names.

Nothing here reaches the network: `from_pretrained` runs with `local_files_only=True`, weights are
safetensors (or `torch.load(weights_only=True)` inside the drafters' loaders), and remote code is
never trusted. Drafters are built from specs in `specdec_fast.drafters.registry`.
"""

from __future__ import annotations

import os

import torch

from specdec_fast import bundled


def resolve_path(name_or_path: str) -> str:
    """A local folder, or the folder of a bundled checkpoint of that name."""
    if os.path.isdir(name_or_path):
        return name_or_path
    if name_or_path in bundled.available():
        return bundled.path(name_or_path)
    raise ValueError(
        f"{name_or_path!r} is neither a folder nor a bundled model ({bundled.available()})"
    )


def pick_device(device: str | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def load_model(name_or_path: str, device: torch.device, dtype: torch.dtype | None = None):
    """An HF causal LM from a local folder or bundled name, in eval mode on `device`.

    dtype: default bf16 on CUDA and fp32 on the CPU (CPU bf16 matmuls are slow)."""
    from transformers import AutoModelForCausalLM

    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(
        resolve_path(name_or_path), dtype=dtype, local_files_only=True, trust_remote_code=False
    )
    return model.to(device).eval()


def load_tokenizer(name_or_path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        resolve_path(name_or_path), local_files_only=True, trust_remote_code=False
    )
