"""specdec_fast.kernels: Triton kernels for speculative-decoding verification.

Each op has a Triton kernel (`jit/`), a launcher that validates inputs and picks the backend
(`<op>.py`), and a plain-torch reference with the same signature (`reference/`). This package
imports only torch and triton and knows nothing about models.
"""

import os

from .backend import interpreter_needed

if interpreter_needed():
    # Must precede the first `import triton`: @triton.jit decides interpretation at decoration time.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from .backend import requested_backend, use_triton  # noqa: E402

__all__ = ["requested_backend", "use_triton"]
