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
    """Whether this process's Triton kernels, and Triton's own library functions that they call,
    were built for the interpreter: Triton decides it for each function as it is defined, so a
    Triton imported before `TRITON_INTERPRET` was set (transformers' model classes import it)
    built its library for the compiler, and interpreted kernels fail calling it."""
    from triton.language import standard
    from triton.runtime.interpreter import InterpretedFunction

    from .jit.kv_compact import kv_compact_kernel

    return isinstance(kv_compact_kernel, InterpretedFunction) and isinstance(
        standard.cdiv, InterpretedFunction
    )


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
            "before Triton is imported: set SPECDEC_BACKEND=triton in the environment of the "
            "process and import specdec_fast before anything that imports Triton (transformers' "
            "model classes do), or set TRITON_INTERPRET=1 there too"
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
