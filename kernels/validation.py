"""Host-side argument checks shared by the kernel launchers.

Every check raises `ValueError` naming the argument, what was expected and what was given, so that
bad input never reaches a kernel. Checks on tensor *values* (lengths in range) need the values on
the host; `values_checkable` says when reading them is allowed.
"""

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
