"""One validation layer for `generate`'s arguments, run before anything is allocated.

`check_generate_arguments` reads every argument once and returns them normalized (`Arguments`).
Each error names the argument, the expected form and the value given: TypeError for a value of
the wrong kind, ValueError for one out of range. The sampling parameters follow the kernels' own
rules (`specdec_fast.kernels.validation.SAMPLING_RULES`, which `verify` applies too), so a value
passes or fails alike on every device and through either entry point.

Limits checked here:
- every prompt token in `[0, vocab_size)`;
- positions: the KV capacity per sequence (`max_cache_len`, by default the longest prompt plus
  `max_new_tokens`) is at most the model's `max_position_embeddings`, when the config has one:
  a default capacity is cut to it (a row that reaches it finishes with reason "cache", after
  the tokens plain decoding gives it), an explicit one beyond it is refused, and so is a prompt
  longer than the capacity. The storage holds one tree beyond the capacity: a tree verified
  near it writes its nodes there, and those past the capacity are never kept, so that every
  drafter stops where plain decoding does, with the same tokens;
- memory: the KV cache the call would allocate (layers x 2 x B x Hkv x the capacity and a
  tree, rounded up to `CACHE_BLOCK`, x D x element size) must fit the device's total memory
  (the GPU's for CUDA, the machine's physical memory for the CPU); the error gives both byte
  counts.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specdec_fast.cache import kv_shape, model_shards
from specdec_fast.kernels.tree_attention import MAX_TREE_NODES
from specdec_fast.kernels.validation import (
    SAMPLING_RULES,
    is_int,
    is_number,
    sampling_values_valid,
)
from specdec_fast.requests import Sampling, StopRule, row_seeds

# KV storage is allocated in whole blocks of slots, so calls of similar lengths share a layout.
CACHE_BLOCK = 256


@dataclass
class Arguments:
    """`generate`'s arguments after validation: the unpadded prompts, per-row sampling
    parameters, the stop rule, the KV capacity per sequence, the storage allocated for it
    (`capacity` and one tree, rounded up to `CACHE_BLOCK`) and the nodes of the largest tree."""

    prompts: list[list[int]]
    sampling: Sampling
    rule: StopRule
    capacity: int
    storage: int
    max_nodes: int


def _as_float(value) -> float:
    """`float(value)`, with ints beyond float range as large as infinity (the rules refuse it)."""
    try:
        return float(value)
    except OverflowError:
        return float("inf") if value > 0 else float("-inf")


def _kind(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return f"{type(value).__name__} {value!r}"[:120]


def _token_list(name: str, row) -> list[int]:
    """The ints of one token sequence (a list, tuple, 1-D integer array or tensor)."""
    if isinstance(row, torch.Tensor):
        integral = not (row.dtype.is_floating_point or row.dtype.is_complex)
        if row.dim() != 1 or not integral or row.dtype == torch.bool:
            raise TypeError(f"{name}: expected a 1-D sequence of int token ids, got {_kind(row)}")
        return row.tolist()
    if isinstance(row, np.ndarray):
        if row.ndim != 1 or not np.issubdtype(row.dtype, np.integer):
            raise TypeError(f"{name}: expected a 1-D sequence of int token ids, got {_kind(row)}")
        return row.tolist()
    if isinstance(row, (str, bytes)) or not isinstance(row, Sequence):
        raise TypeError(f"{name}: expected a sequence of int token ids, got {_kind(row)}")
    for index, token in enumerate(row):
        if not is_int(token):
            raise TypeError(f"{name}[{index}]: expected an int token id, got {_kind(token)}")
    return [int(token) for token in row]


def _prompts(input_ids, attention_mask) -> list[list[int]]:
    """The unpadded prompts of a `[B, T]` tensor (with its mask) or of B token lists."""
    if isinstance(input_ids, torch.Tensor):
        if (
            input_ids.dtype.is_floating_point
            or input_ids.dtype.is_complex
            or (input_ids.dtype == torch.bool)
        ):
            raise TypeError(f"input_ids: expected an integer tensor, got {input_ids.dtype}")
        if input_ids.dim() != 2:
            raise ValueError(
                f"input_ids: expected a [B, T] tensor, got shape {tuple(input_ids.shape)}"
            )
        if attention_mask is None:
            real = torch.ones_like(input_ids, dtype=torch.bool)
        else:
            if not isinstance(attention_mask, torch.Tensor):
                raise TypeError(
                    f"attention_mask: expected None or a [B, T] tensor, got {_kind(attention_mask)}"
                )
            if attention_mask.shape != input_ids.shape:
                raise ValueError(
                    f"attention_mask: expected shape {tuple(input_ids.shape)} (that of "
                    f"input_ids), got {tuple(attention_mask.shape)}"
                )
            if attention_mask.dtype.is_complex:
                raise TypeError(f"attention_mask: expected 0/1 values, got {attention_mask.dtype}")
            real = attention_mask.to(input_ids.device) != 0
        ids, real = input_ids.cpu().tolist(), real.cpu().tolist()
        prompts = [
            [t for t, keep in zip(row, mask, strict=True) if keep]
            for row, mask in zip(ids, real, strict=True)
        ]
    else:
        if isinstance(input_ids, (str, bytes)) or not isinstance(input_ids, Sequence):
            raise TypeError(
                "input_ids: expected a LongTensor [B, T] or a list of B token lists, got "
                f"{_kind(input_ids)}"
            )
        if attention_mask is not None:
            raise ValueError("attention_mask: only meaningful with a padded input_ids tensor")
        if input_ids and all(is_int(token) for token in input_ids):
            raise TypeError(
                "input_ids: expected a list of token lists, got a flat list of ints (one prompt "
                "is [[...]])"
            )
        prompts = [_token_list(f"input_ids[{row}]", ids) for row, ids in enumerate(input_ids)]
    if not prompts:
        raise ValueError("input_ids: the batch is empty")
    for row, prompt in enumerate(prompts):
        if not prompt:
            raise ValueError(f"input_ids: prompt {row} has no tokens")
    return prompts


def _check_vocabulary(name: str, tokens: list[int], vocab_size: int) -> None:
    bad = [t for t in tokens if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{name}: token ids outside [0, {vocab_size}): {bad[:5]}")


def _per_row(name: str, value, batch: int) -> torch.Tensor:
    """A sampling parameter as a `[B]` host tensor (float64, or int64 for top_k and seed):
    a scalar, B values (a sequence or a tensor), each checked by `SAMPLING_RULES`."""
    integral = name in ("top_k", "seed")
    expected = "an int" if integral else "a number"
    if isinstance(value, torch.Tensor):
        if (
            value.dtype.is_complex
            or value.dtype == torch.bool
            or (integral and value.dtype.is_floating_point)
        ):
            raise TypeError(f"{name}: expected {expected} per row, got {_kind(value)}")
        if value.dim() > 1:
            raise ValueError(f"{name}: expected a scalar or a [B] tensor, got {_kind(value)}")
        values = value.detach().cpu().flatten().tolist()
    elif isinstance(value, np.ndarray):
        if value.ndim > 1:
            raise ValueError(f"{name}: expected a scalar or a [B] array, got {_kind(value)}")
        values = value.flatten().tolist()
    elif is_number(value):
        values = [value]
    elif isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        values = list(value)
    else:
        raise TypeError(
            f"{name}: expected {expected}, or one per row (B = {batch}), got {_kind(value)}"
        )
    for index, item in enumerate(values):
        if not (is_int(item) if integral else is_number(item)):
            where = name if len(values) == 1 else f"{name}[{index}]"
            raise TypeError(f"{where}: expected {expected}, got {_kind(item)}")
    if len(values) == 1:
        values = values * batch
    if len(values) != batch:
        raise ValueError(f"{name}: expected a scalar or {batch} values, got {len(values)}")
    if name == "seed":
        # Any Python int works: seeds are hashed per row (`row_seeds`), never stored as is.
        return values
    tensor = torch.tensor(
        # top_k beyond int32 means the same as 2**31 - 1 (off), below 0 as -1 (refused).
        [min(max(int(v), -1), 2**31 - 1) if integral else _as_float(v) for v in values],
        dtype=torch.int64 if integral else torch.float64,
    )
    bad = (~sampling_values_valid(name, tensor)).nonzero()
    if len(bad):
        index = int(bad[0, 0])
        where = name if np.ndim(value) == 0 else f"{name}[{index}]"
        raise ValueError(f"{where}: expected {SAMPLING_RULES[name]}, got {values[index]!r}")
    return tensor


def draw_seed() -> int:
    """A seed for a call or request that gives none: drawn from torch's generator, so that it
    follows `torch.manual_seed`, like sampling in HF generate."""
    return int(torch.randint(0, 2**62, (1,)).item())


def build_sampling(batch: int, temperature, top_k, top_p, seed) -> Sampling:
    """The per-row sampling parameters of `batch` rows from scalars or per-row values, each
    checked by `SAMPLING_RULES` (a ValueError names the argument and the row)."""
    temperature = _per_row("temperature", temperature, batch).float()
    top_k = _per_row("top_k", top_k, batch)
    top_p = _per_row("top_p", top_p, batch).float()
    if seed is None:
        seed = draw_seed()
    seeds = _per_row("seed", seed, batch)
    # One seed for the batch: row r takes seed + r.
    shared = (seed.numel() if isinstance(seed, torch.Tensor) else np.size(seed)) == 1
    return Sampling(temperature, top_k, top_p, row_seeds(seeds, shared))


def eos_tokens(eos_token_id, vocab_size: int | None, source: str) -> frozenset[int]:
    """The EOS ids, checked against `vocab_size` unless it is None (a model's own default may
    name ids its vocabulary lacks: they are never generated, so they never stop anything)."""
    if eos_token_id is None:
        return frozenset()
    tokens = [eos_token_id] if is_int(eos_token_id) else eos_token_id
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.flatten()
    try:
        tokens = _token_list(source, tokens)
    except TypeError:
        raise TypeError(
            f"{source}: expected None, an int token id or a list of them, got {_kind(eos_token_id)}"
        ) from None
    if vocab_size is not None:
        _check_vocabulary(source, tokens, vocab_size)
    return frozenset(tokens)


def _stop_sequences(stop, tokenizer, vocab_size: int) -> list[list[int]]:
    """Stop token sequences: None, one flat list of ints, a string, or a list mixing token
    lists and strings; strings are tokenized with `tokenizer` (no special tokens added)."""
    if stop is None:
        return []
    single = isinstance(stop, str) or (
        isinstance(stop, Sequence) and stop and all(is_int(token) for token in stop)
    )
    if single:
        stop = [stop]
    if isinstance(stop, bytes) or not isinstance(stop, Sequence):
        raise TypeError(
            f"stop: expected a token list, a string or a list of them, got {_kind(stop)}"
        )
    sequences = []
    for index, item in enumerate(stop):
        name = "stop" if single else f"stop[{index}]"
        if isinstance(item, str):
            if tokenizer is None:
                raise ValueError(
                    f"{name}: the string {item!r} needs a tokenizer: pass tokenizer= to "
                    "generate, or give the stop as token ids"
                )
            tokens = list(tokenizer.encode(item, add_special_tokens=False))
            if not tokens:
                raise ValueError(f"{name}: the string {item!r} encodes to no tokens")
        else:
            tokens = _token_list(name, item)
        if not tokens:
            raise ValueError(f"{name}: empty stop sequence")
        _check_vocabulary(name, tokens, vocab_size)
        sequences.append(tokens)
    return sequences


def _max_nodes(drafter) -> int:
    """The drafter's `max_nodes`, checked against the tree-attention limit."""
    if drafter is None:
        return 1
    if not callable(getattr(drafter, "propose", None)):
        raise TypeError(
            f"drafter: expected None or a drafter (an object with propose(state) and max_nodes), "
            f"got {_kind(drafter)}"
        )
    nodes = getattr(drafter, "max_nodes", None)
    if not is_int(nodes) or not 1 <= nodes <= MAX_TREE_NODES:
        raise ValueError(
            f"drafter.max_nodes: expected an int in [1, {MAX_TREE_NODES}] (tokens verified per "
            f"step, root included; tree attention's limit), got {nodes!r} for {drafter!r}"
        )
    return int(nodes)


def _memory_limit(device: torch.device) -> tuple[int | None, str]:
    """The bytes a KV cache may take on `device`, and where the figure comes from."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory, f"the memory of {device}"
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "the machine's memory"
    except (AttributeError, ValueError, OSError):
        return None, "unknown"


def _bytes(count: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if count < 1024 or unit == "PB":
            return f"{count:.1f} {unit}" if unit != "B" else f"{count} B"
        count /= 1024
    raise AssertionError("unreachable")


def _capacity(
    model, prompts, max_new_tokens, max_cache_len, max_nodes, max_positions
) -> tuple[int, int]:
    """(capacity per sequence, storage slots) after the position and memory checks."""
    longest = max(len(p) for p in prompts)
    row = max(range(len(prompts)), key=lambda r: len(prompts[r]))
    if max_positions is not None and longest > max_positions:
        raise ValueError(
            f"input_ids: prompt {row} has {longest} tokens, more than the model's "
            f"max_position_embeddings = {max_positions}"
        )
    if max_cache_len is None:
        capacity = longest + max_new_tokens
        if max_positions is not None:
            capacity = min(capacity, max_positions)
    else:
        if not is_int(max_cache_len):
            raise TypeError(f"max_cache_len: expected None or an int, got {_kind(max_cache_len)}")
        if max_positions is not None and max_cache_len > max_positions:
            raise ValueError(
                f"max_cache_len: expected at most the model's max_position_embeddings = "
                f"{max_positions}, got {max_cache_len}"
            )
        if max_cache_len < 1:
            raise ValueError(f"max_cache_len: expected an int >= 1, got {max_cache_len}")
        capacity = int(max_cache_len)
    if max_new_tokens > 0 and longest > capacity:
        raise ValueError(
            f"max_cache_len: {capacity} cannot hold the longest prompt ({longest} tokens)"
        )
    storage = -(-(capacity + max_nodes - 1) // CACHE_BLOCK) * CACHE_BLOCK
    if max_new_tokens > 0:
        shape = kv_shape(model.config, len(prompts), storage, model_shards(model))
        needed = int(np.prod(shape, dtype=object)) * model.dtype.itemsize
        limit, where = _memory_limit(model.device)
        if limit is not None and needed > limit:
            name = "max_new_tokens" if max_cache_len is None else "max_cache_len"
            raise ValueError(
                f"{name}: the KV cache for {len(prompts)} sequences of {storage} slots (prompt + "
                f"max_new_tokens + a tree, in blocks of {CACHE_BLOCK}) would take "
                f"{needed} bytes ({_bytes(needed)}), more than {where} ({limit} bytes, "
                f"{_bytes(limit)}); lower {name}"
            )
    return capacity, storage


def check_generate_arguments(
    model,
    input_ids,
    *,
    drafter,
    max_new_tokens,
    attention_mask=None,
    temperature=0.0,
    top_k=0,
    top_p=1.0,
    seed=None,
    eos_token_id=None,
    stop=None,
    max_cache_len=None,
    tokenizer=None,
    on_tokens=None,
    use_cuda_graphs=None,
    compile=None,
    exact=False,
    read_ahead=None,
) -> Arguments:
    """Validate and normalize the arguments of `specdec_fast.generate` (see its doc and the
    module doc); raises TypeError or ValueError naming the first argument that is wrong."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "get_text_config") or not hasattr(model, "device"):
        raise TypeError(f"model: expected a transformers PreTrainedModel, got {_kind(model)}")
    text_config = config.get_text_config(decoder=True)
    vocab_size = text_config.vocab_size
    max_nodes = _max_nodes(drafter)
    if not is_int(max_new_tokens):
        raise TypeError(f"max_new_tokens: expected an int >= 0, got {_kind(max_new_tokens)}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens: expected an int >= 0, got {max_new_tokens}")
    max_new_tokens = int(max_new_tokens)
    prompts = _prompts(input_ids, attention_mask)
    for row, prompt in enumerate(prompts):
        _check_vocabulary(f"input_ids: prompt {row}", prompt, vocab_size)
    if tokenizer is not None and not callable(getattr(tokenizer, "encode", None)):
        raise TypeError(
            f"tokenizer: expected None or a tokenizer with encode(), got {_kind(tokenizer)}"
        )
    if on_tokens is not None and not callable(on_tokens):
        raise TypeError(f"on_tokens: expected None or a callable, got {_kind(on_tokens)}")
    for name, flag in (
        ("use_cuda_graphs", use_cuda_graphs),
        ("compile", compile),
        ("exact", exact),
        ("read_ahead", read_ahead),
    ):
        if flag is not None and not isinstance(flag, bool):
            raise TypeError(f"{name}: expected None or a bool, got {_kind(flag)}")
    if eos_token_id is None:
        generation_config = getattr(model, "generation_config", None)
        eos = eos_tokens(
            getattr(generation_config, "eos_token_id", None),
            None,
            "eos_token_id (the model's generation_config)",
        )
    else:
        eos = eos_tokens(eos_token_id, vocab_size, "eos_token_id")
    rule = StopRule(eos, _stop_sequences(stop, tokenizer, vocab_size), max_new_tokens)
    sampling = build_sampling(len(prompts), temperature, top_k, top_p, seed)
    max_positions = getattr(text_config, "max_position_embeddings", None)
    capacity, storage = _capacity(
        model, prompts, max_new_tokens, max_cache_len, max_nodes, max_positions
    )
    return Arguments(prompts, sampling, rule, capacity, storage, max_nodes)
