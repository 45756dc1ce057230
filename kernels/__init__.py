"""specdec_fast.kernels: Triton kernels for speculative-decoding verification.

Each op has a Triton kernel (`jit/`), a launcher that validates inputs and picks the backend
(`<op>.py`, which also declares the op to `torch.library` with `ops.define_op`), and a
plain-torch reference with the same signature (`reference/`). This package imports only torch
and triton and knows nothing about models.
"""

import os

from .backend import interpreter_needed

if interpreter_needed():
    # Must precede the first `import triton`: @triton.jit decides interpretation at decoration time.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from . import batch_invariant  # noqa: E402, F401  (declares the op linear_exact)
from .backend import backend_for, requested_backend, use_triton  # noqa: E402
from .kv_compact import kv_compact  # noqa: E402
from .reference.kv_compact import kv_compact_reference  # noqa: E402
from .reference.verify import VerifyResult, verify_reference  # noqa: E402
from .tree_attention import pack_tree_mask, tree_attention  # noqa: E402
from .verify import verify  # noqa: E402

__all__ = [
    "backend_for",
    "kv_compact",
    "kv_compact_reference",
    "pack_tree_mask",
    "requested_backend",
    "tree_attention",
    "use_triton",
    "verify",
    "verify_reference",
    "VerifyResult",
]
