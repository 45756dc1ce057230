"""Loading targets and drafters from local folders or bundled names, and drafter specs.

Nothing here reaches the network: `from_pretrained` runs with `local_files_only=True`, weights are
safetensors (or `torch.load(weights_only=True)` inside the drafters' loaders), and remote code is
never trusted.

A drafter SPEC is one of:
    ngram[:N]            prompt lookup with a tree budget of N nodes (default 8)
    suffix[:N]           suffix-tree lookup (default 16 nodes)
    draft:PATH[:K]       a draft model, chain of K tokens (default 4; verifies N = K + 1)
    draft-tree:PATH[:N]  a draft model expanding a static tree of N nodes (default 8)
    medusa:PATH[:N]      Medusa heads, their static tree cut to N nodes
    eagle:PATH[:N]       an EAGLE-1/2/3 head, dynamic trees of N nodes
N counts the root: a tree of N nodes verifies exactly N tokens per step. PATH is a folder or a
bundled name (see `specdec_fast.bundled`). Head drafters are registered in
`HEAD_DRAFTERS` (module, builder); a kind whose module is missing is rejected as unavailable.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import torch

from specdec_fast import bundled
from specdec_fast.drafters import DraftModelDrafter, NGramDrafter, SuffixDrafter
from specdec_fast.drafters.base import Drafter
from specdec_fast.trees import default_tree


def _medusa(path: str, target, size: int | None) -> Drafter:
    from specdec_fast.drafters.medusa import MedusaDrafter
    from specdec_fast.wrapping import TrimmedDrafter

    drafter = MedusaDrafter.from_pretrained(path, target)
    return drafter if size is None else TrimmedDrafter(drafter, size)


def _eagle(path: str, target, size: int | None) -> Drafter:
    from specdec_fast.drafters.eagle import EagleDrafter

    return EagleDrafter.from_pretrained(
        path, target, **({} if size is None else {"max_nodes": size})
    )


# kind -> (module that must exist, builder(path, target, size)).
HEAD_DRAFTERS = {
    "medusa": ("specdec_fast.drafters.medusa", _medusa),
    "eagle": ("specdec_fast.drafters.eagle", _eagle),
}


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


@dataclass
class DrafterSpec:
    """A parsed drafter SPEC (see the module doc)."""

    kind: str
    path: str | None = None
    size: int | None = None

    @classmethod
    def parse(cls, spec: str) -> DrafterSpec:
        kind, _, rest = spec.partition(":")
        if kind in ("none", "plain") and not rest:
            return cls("none")
        if kind in ("ngram", "suffix"):
            return cls(kind, None, _size(spec, rest) if rest else None)
        if kind in HEAD_DRAFTERS and importlib.util.find_spec(HEAD_DRAFTERS[kind][0]) is None:
            raise ValueError(
                f"drafter spec {spec!r}: {kind} drafters are not available in this version"
            )
        if kind in ("draft", "draft-tree", *HEAD_DRAFTERS):
            if not rest:
                raise ValueError(f"drafter spec {spec!r}: expected {kind}:PATH[:SIZE]")
            path, _, size = rest.rpartition(":") if _has_size(rest) else (rest, "", "")
            return cls(kind, path, _size(spec, size) if size else None)
        raise ValueError(
            f"drafter spec {spec!r}: expected none, ngram[:N], suffix[:N], draft:PATH[:K], "
            "draft-tree:PATH[:N], medusa:PATH[:N] or eagle:PATH[:N]"
        )

    def build(self, target, size: int | None = None) -> Drafter | None:
        """The drafter for `target`; `size` (k or N) overrides the spec's own."""
        size = size or self.size
        if self.kind == "none":
            return None
        if self.kind == "ngram":
            return NGramDrafter(max_nodes=size or 8)
        if self.kind == "suffix":
            return SuffixDrafter(max_nodes=size or 16)
        if self.kind in HEAD_DRAFTERS:
            return HEAD_DRAFTERS[self.kind][1](resolve_path(self.path), target, size)
        draft = load_model(self.path, target.device, target.dtype)
        if self.kind == "draft":
            return DraftModelDrafter(draft, num_tokens=size or 4)
        return DraftModelDrafter(draft, tree=default_tree(size or 8))

    @property
    def is_chain(self) -> bool:
        """Whether the size is a chain length k (N = k + 1) rather than a tree's N."""
        return self.kind == "draft"

    def nodes(self, size: int) -> int:
        """N, the tokens verified per step, of this kind at `size` (k for chains, N for trees)."""
        return size + 1 if self.is_chain else size

    def __str__(self) -> str:
        text = self.kind if self.path is None else f"{self.kind}:{self.path}"
        return text if self.size is None else f"{text}:{self.size}"


def _has_size(rest: str) -> bool:
    head, _, tail = rest.rpartition(":")
    return bool(head) and tail.isdigit()


def _size(spec: str, text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"drafter spec {spec!r}: size must be a positive integer, got {text!r}")
    return int(text)
