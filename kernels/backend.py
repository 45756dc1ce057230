"""Backend choice shared by every kernel.

`SPECDEC_BACKEND` picks the implementation, read at every call so that tests can switch it:
- `auto` (the default): CUDA tensors run the Triton kernels, CPU tensors the fused-torch
  implementations in `fused/` (fast, portable);
- `triton`: the Triton kernels everywhere; CPU tensors then run through the Triton interpreter,
  which must be switched on before Triton compiles anything, so the variable has to be set
  before `specdec_fast` is imported (`kernels/__init__.py` sets `TRITON_INTERPRET` then);
- `fused`: the fused-torch implementations everywhere (on CUDA they read lengths back to the
  host, so they are for comparisons, not for speed there);
- `torch`: the plain-torch references, the readable test oracles.
"""

import os
from functools import cache

import torch

BACKENDS = ("auto", "triton", "fused", "torch")


def requested_backend() -> str:
    """The value of SPECDEC_BACKEND ("auto" when unset), validated."""
    backend = os.environ.get("SPECDEC_BACKEND", "auto").strip().lower() or "auto"
    if backend not in BACKENDS:
        raise ValueError(f"SPECDEC_BACKEND must be one of {BACKENDS}, got {backend!r}")
    return backend


def interpreting() -> bool:
    """Whether this process's Triton kernels were built for the interpreter."""
    from triton.runtime.interpreter import InterpretedFunction

    from .jit.kv_compact import kv_compact_kernel

    return isinstance(kv_compact_kernel, InterpretedFunction)


def backend_for(device: torch.device) -> str:
    """The implementation ("triton", "fused" or "torch") for a kernel call on `device`.

    Raises RuntimeError when the Triton kernels are asked for on the CPU in a process whose
    kernels were not built for the interpreter (SPECDEC_BACKEND=triton set after import).
    """
    backend = requested_backend()
    if backend == "auto":
        return "triton" if device.type == "cuda" else "fused"
    if backend == "triton" and device.type != "cuda" and not interpreting():
        raise RuntimeError(
            "SPECDEC_BACKEND=triton on CPU tensors runs the Triton interpreter, which has to be on "
            "before specdec_fast is imported: set SPECDEC_BACKEND=triton (or TRITON_INTERPRET=1) "
            "in the environment of the process, not after the import"
        )
    return backend


def use_triton(device: torch.device) -> bool:
    """True when a kernel call on tensors living on `device` should run the Triton kernel."""
    return backend_for(device) == "triton"


def interpreter_needed() -> bool:
    """Triton kernels must be interpreted: they were asked for and no GPU can compile them."""
    return requested_backend() == "triton" and not torch.cuda.is_available()


@cache
def sm_count(device: torch.device) -> int | None:
    """Streaming multiprocessors of a CUDA device, which the launchers size their grids by; None
    elsewhere (the interpreter)."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).multi_processor_count
