"""Host-side argument checks shared by the kernel launchers.

Every check raises `ValueError` naming the argument, what was expected and what was given, so that
bad input never reaches a kernel. Checks on tensor *values* (lengths in range) need the values on
the host; `values_checkable` says when reading them is allowed.
"""

import math
import numbers
from collections.abc import Callable, Sequence

import numpy as np
import torch


def check_tensor(
    name: str,
    tensor: object,
    *,
    shape: Sequence[int] | None = None,
    dims: str | None = None,
    dtypes: Sequence[torch.dtype] | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Check that `tensor` is a tensor with the given shape, dtype and device; return it.

    `dims` names the dimensions for the message (e.g. "[B, Hq, N, D]"); -1 in `shape` is free.
    """
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
    if shape is not None:
        matches = tensor.dim() == len(shape) and all(
            want in (-1, got) for want, got in zip(shape, tensor.shape, strict=True)
        )
        if not matches:
            wanted = tuple("*" if want == -1 else want for want in shape)
            label = f"{dims} = {wanted}" if dims else str(wanted)
            raise ValueError(f"{name}: expected shape {label}, got {tuple(tensor.shape)}")
    if dtypes is not None and tensor.dtype not in dtypes:
        allowed = ", ".join(str(dtype).removeprefix("torch.") for dtype in dtypes)
        raise ValueError(f"{name}: expected dtype in ({allowed}), got {tensor.dtype}")
    if device is not None and tensor.device != device:
        raise ValueError(f"{name}: expected a tensor on {device}, got one on {tensor.device}")
    return tensor


def check_unit_stride(name: str, tensor: torch.Tensor, dim: int = -1) -> None:
    """Kernels address the last dimension contiguously; other strides are free."""
    if tensor.shape[dim] > 1 and tensor.stride(dim) != 1:
        raise ValueError(
            f"{name}: expected unit stride on dim {dim}, got strides {tuple(tensor.stride())}"
        )


def values_checkable(tensor: torch.Tensor) -> bool:
    """Whether checks may read `tensor`'s values: never while `torch.compile` traces (a read would
    break the graph); on the CPU otherwise always; on CUDA only outside graph capture, where the
    read would break the capture (the kernels stay in bounds regardless)."""
    if torch.compiler.is_compiling():
        return False
    return tensor.device.type != "cuda" or not torch.cuda.is_current_stream_capturing()


def check_ranges(bounds: Sequence[tuple[str, torch.Tensor, int, int]]) -> None:
    """Check `low <= values <= high` for every `(name, values, low, high)` with a single host read
    (a device sync on CUDA); on failure name the first offender."""
    if not bounds:
        return
    flags = [((values < low) | (values > high)).any() for _, values, low, high in bounds]
    if not bool(torch.stack(flags).any()):
        return
    for (name, values, low, high), flag in zip(bounds, flags, strict=True):
        if bool(flag):
            index = int(((values < low) | (values > high)).nonzero()[0, 0])
            raise ValueError(
                f"{name}[{index}] = {int(values[index])} is out of range: expected "
                f"{low} <= {name}[{index}] <= {high}"
            )


# One set of rules for the sampling parameters, shared by `verify` and the engine's `generate`
# (which validates a call's parameters once, on the host, for every device).
# Positive temperatures below the smallest normal fp32 would make 1 / T overflow in the kernels.
MIN_TEMPERATURE = 2.0**-126
SAMPLING_RULES = {
    "temperature": f"0 or a finite number >= {MIN_TEMPERATURE:.3g}",
    "top_k": "an int >= 0 (0: off)",
    "top_p": "a number in (0, 1] (1: off)",
}


def sampling_values_valid(name: str, values: torch.Tensor) -> torch.Tensor:
    """Elementwise: whether `values` (any shape) obey `SAMPLING_RULES[name]` (NaN never does)."""
    if name == "temperature":
        values = values.double()
        return (values == 0) | ((values >= MIN_TEMPERATURE) & (values < math.inf))
    if name == "top_k":
        return values >= 0
    if name == "top_p":
        return (values > 0) & (values <= 1)
    raise KeyError(name)


def is_int(value) -> bool:
    """An integer, numpy's included (numbers.Integral), and not a bool."""
    return isinstance(value, (numbers.Integral, np.integer)) and not isinstance(value, bool)


def is_number(value) -> bool:
    """A real number, numpy's included (numbers.Real), and not a bool."""
    return isinstance(value, (numbers.Real, np.number)) and not isinstance(value, (bool, np.bool_))


def check_sampling_scalar(name: str, value: object) -> float | int:
    """`value` as the kernels take it (a float, or an int for top_k) when it obeys
    `SAMPLING_RULES[name]`; ValueError naming it and the rule otherwise."""
    integral = name == "top_k"
    # numpy's scalars (np.float32, np.int64) count as the numbers they hold.
    if not (is_int(value) if integral else is_number(value)):
        raise ValueError(f"{name}: expected {SAMPLING_RULES[name]}, got {value!r}")
    try:
        number = float(value)
    except OverflowError:  # an int beyond float range: as large as infinity for the rules
        number = math.copysign(math.inf, value)
    if not bool(sampling_values_valid(name, torch.tensor(number, dtype=torch.float64))):
        raise ValueError(f"{name}: expected {SAMPLING_RULES[name]}, got {value!r}")
    return int(value) if integral else number


# How far a row of draft probabilities may sum from 1: fp32 rounding over a large vocabulary
# stays well inside 1e-3, and 16-bit probabilities (8 or 11 mantissa bits) inside 1e-2.
DRAFT_PROBS_TOLERANCE = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 1e-2}
DRAFT_PROBS_RULE = "finite, >= 0 and summing to 1 (within 1e-3 in fp32, 1e-2 in 16 bits)"


def draft_probs_invalid(draft_probs: torch.Tensor) -> torch.Tensor:
    """bool `[B, N]`: the rows of `draft_probs` `[B, N, V]` that are not a distribution
    (`DRAFT_PROBS_RULE`). Device ops only; the caller picks which nodes count."""
    probs = draft_probs.float()
    tolerance = DRAFT_PROBS_TOLERANCE.get(draft_probs.dtype, 1e-3)
    # NaN fails every comparison, so `>= 0` also rejects it; +inf fails the sum.
    distribution = (probs >= 0).all(dim=-1) & ((probs.sum(dim=-1) - 1).abs() <= tolerance)
    return ~distribution


def describe_draft_probs(draft_probs: torch.Tensor, b: int, i: int) -> str:
    """The message for row `[b, i]` that `draft_probs_invalid` flagged (reads the row)."""
    row = draft_probs[b, i].float()
    return (
        f"draft_probs[{b}, {i}]: expected {DRAFT_PROBS_RULE}, got "
        f"{int(torch.isnan(row).sum())} NaN, {int((row < 0).sum())} negative, sum "
        f"{float(row.nan_to_num(0.0).sum()):.6g}"
    )


def _first_node(bad_nodes: torch.Tensor, b: int) -> int:
    return int(bad_nodes[b].nonzero()[0, 0])


def tree_problems(
    draft_tokens: torch.Tensor,
    parents: torch.Tensor,
    vocab: int,
    draft_probs: torch.Tensor | None = None,
) -> list[tuple[torch.Tensor, Callable[[int], str]]]:
    """The rules a batch of draft trees must obey (the form `verify` takes), each as
    `(bad, describe)`: `bad` bool `[B]` computed on the device, `describe(b)` the message for
    sequence b (it reads values; call it only on failure). Rules: node 0 is the root (parent
    -1); every other node is padding (-2) or has an existing parent of lower index; existing
    nodes' tokens lie in `[0, vocab)`; with `draft_probs` `[B, N, V]`, trees are chains and the
    rows of existing nodes after the root are distributions (`DRAFT_PROBS_RULE`)."""
    num_nodes = parents.shape[1]
    node = torch.arange(num_nodes, device=parents.device)
    parent = parents.long()
    token = draft_tokens.long()
    later = (parent != -2) & (node >= 1)
    parent_exists = (parent != -2).gather(1, parent.clamp(0, num_nodes - 1))
    not_topological = later & ((parent < 0) | (parent >= node))
    padded_parent = later & ~not_topological & ~parent_exists
    out_of_vocab = later & ((token < 0) | (token >= vocab))

    def parent_at(b: int, i: int) -> int:
        return int(parents[b, i])

    problems = [
        (
            parent[:, 0] != -1,
            lambda b: (
                f"parents[{b}, 0] = {parent_at(b, 0)}: the root must be node 0, with parent -1"
            ),
        ),
        (
            not_topological.any(dim=1),
            lambda b: (
                f"parents[{b}, {(i := _first_node(not_topological, b))}] = {parent_at(b, i)}: "
                f"expected -2 (padding) or a parent in [0, {i}) (topological order, one root)"
            ),
        ),
        (
            padded_parent.any(dim=1),
            lambda b: (
                f"parents[{b}, {(i := _first_node(padded_parent, b))}] = {parent_at(b, i)}: "
                f"that parent is a padded node (parent -2)"
            ),
        ),
        (
            out_of_vocab.any(dim=1),
            lambda b: (
                f"draft_tokens[{b}, {(i := _first_node(out_of_vocab, b))}] = "
                f"{int(draft_tokens[b, i])} is outside the vocabulary [0, {vocab})"
            ),
        ),
    ]
    if draft_probs is not None:
        not_chain = later & (parent != node - 1)
        problems.append(
            (
                not_chain.any(dim=1),
                lambda b: (
                    f"draft_probs: only chains take draft probabilities, but sequence {b} has "
                    f"parents[{b}, {(i := _first_node(not_chain, b))}] = {parent_at(b, i)} "
                    f"(a chain has {i - 1})"
                ),
            )
        )
        not_distribution = later & draft_probs_invalid(draft_probs)
        problems.append(
            (
                not_distribution.any(dim=1),
                lambda b: describe_draft_probs(draft_probs, b, _first_node(not_distribution, b)),
            )
        )
    return problems


def raise_first_problem(problems: list[tuple[torch.Tensor, Callable[[int], str]]]) -> None:
    """Read every `(bad, describe)` flag of `problems` in one host read; raise ValueError with
    the first rule's message for its first failing sequence."""
    if not problems:
        return
    flags = torch.stack([bad for bad, _ in problems]).cpu()
    for (_, describe), bad in zip(problems, flags, strict=True):
        if bool(bad.any()):
            raise ValueError(describe(int(bad.nonzero()[0, 0])))
