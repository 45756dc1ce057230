"""Host-side argument checks shared by the kernel launchers.

Every check raises `ValueError` naming the argument, what was expected and what was given, so that
bad input never reaches a kernel. Checks on tensor *values* (lengths in range) need the values on
the host; `values_checkable` says when reading them is allowed.
"""

import math
from collections.abc import Sequence

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


def check_sampling_scalar(name: str, value: object) -> float | int:
    """`value` as the kernels take it (a float, or an int for top_k) when it obeys
    `SAMPLING_RULES[name]`; ValueError naming it and the rule otherwise."""
    integral = name == "top_k"
    kinds = (int,) if integral else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
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
