"""The engine's transfers between host and device, in one place.

`to_host` is the blocking read: the engine calls it once per step (the emitted tokens), and
nothing else in a compiled step reads device tensors (tests/test_step_budget.py counts; an eager
block drafter still reads its block's top-K once, `to_host_array`, for its best-first heap).
`HostCopy` starts that read without waiting for it (a pinned buffer on CUDA), so the host can
queue the next step before it waits (`generate`'s read-ahead, `specdec_fast.step`).
`to_device` uploads host data (lists, numpy arrays) without making the host wait: on CUDA
through pinned memory with a non-blocking copy, on the CPU as is. `host_resident` is the
condition of the CPU shortcuts that read tensors because, there, reading costs no transfer.
"""

from __future__ import annotations

import numpy as np
import torch


def to_host(tensor: torch.Tensor, landed: torch.cuda.Event | None = None) -> list:
    """`tensor`'s values as (nested) Python lists: a blocking device-to-host read. `landed`: an
    event to wait for first (`HostCopy`'s, when `tensor` is the pinned end of a copy)."""
    if landed is not None:
        landed.synchronize()
    return tensor.tolist()


class HostCopy:
    """`tensor`'s values on their way to the host: on CUDA a non-blocking copy into pinned
    memory, queued on the current stream behind the work that makes `tensor` (so a step queued
    after it cannot overwrite its source first), with an event to wait on; elsewhere `tensor`
    itself. `wait()` blocks until the copy has landed and returns the values as `to_host` does."""

    def __init__(self, tensor: torch.Tensor):
        self._event = None
        if tensor.device.type == "cuda":
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
            tensor = host
        self._tensor = tensor

    def wait(self) -> list:
        return to_host(self._tensor, self._event)


def to_host_array(tensor: torch.Tensor) -> np.ndarray:
    """`tensor`'s values as a numpy array: a blocking device-to-host read, one copy (for host
    work over more values than `to_host`'s lists carry cheaply)."""
    return tensor.cpu().numpy()


def to_device(data, device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """Host `data` (a list, nested lists or a numpy array) as a tensor on `device`, copied
    without blocking the host."""
    # A copy, never a view: the caller may reuse its array while a non-blocking copy runs.
    host = torch.tensor(data, dtype=dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def host_resident(tensor: torch.Tensor) -> bool:
    """Whether `tensor` lives in host memory, where reading it back costs no transfer (the CPU
    shortcuts' condition; the step's budget test turns it off to count an accelerator's reads)."""
    return tensor.device.type == "cpu"
