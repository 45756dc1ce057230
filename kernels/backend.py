"""Backend choice shared by every kernel.

CUDA tensors run the Triton kernels; CPU tensors run the plain-torch references, unless
`SPECDEC_BACKEND=triton` is set, which runs the Triton kernels on the CPU through the Triton
interpreter. `SPECDEC_BACKEND=torch` forces the references everywhere. The variable is read at
every call so that tests can switch it; `TRITON_INTERPRET` must be decided before Triton compiles
anything, so it is set when the package is imported (see `kernels/__init__.py`).
"""

import os

import torch

BACKENDS = ("auto", "triton", "torch")


def requested_backend() -> str:
    """The value of SPECDEC_BACKEND ("auto" when unset), validated."""
    backend = os.environ.get("SPECDEC_BACKEND", "auto").strip().lower() or "auto"
    if backend not in BACKENDS:
        raise ValueError(f"SPECDEC_BACKEND must be one of {BACKENDS}, got {backend!r}")
    return backend


def use_triton(device: torch.device) -> bool:
    """True when a kernel call on tensors living on `device` should run the Triton kernel."""
    backend = requested_backend()
    if backend == "torch":
        return False
    if backend == "triton":
        return True
    return device.type == "cuda"


def interpreter_needed() -> bool:
    """Triton kernels must be interpreted: they were asked for and no GPU can compile them."""
    return requested_backend() == "triton" and not torch.cuda.is_available()
