"""Compatibility fixes for the Triton interpreter (TRITON_INTERPRET=1).

Under numpy >= 2.4: the interpreter keeps scalars as 1-element arrays and converts them with
`int(array)`, which numpy 2.4 rejects, so a loop bound computed in a kernel (`range(lo, hi)`
with `hi` loaded from memory) fails with "only 0-dimensional arrays can be converted to Python
scalars" (triton-lang/triton#9171). The fix wraps the interpreter's tensor patching to convert
through `.item()`.

Row-invariant dots: the interpreter computes `tl.dot` with `np.matmul`, and OpenBLAS's sgemm
need not give a row the same bits at every place in the tile (on an AMD EPYC, rows moved by an
ulp with their offset in a 64-row block), while one compiled program computes every row alike,
which is what the batch-invariant kernels promise. Interpreted dots therefore run through
`np.einsum` without BLAS: one loop, the same for every row.

Neither fix changes compiled kernels; import this module before launching kernels.
"""

import numpy as np
from triton.runtime import interpreter


def _index_of(tensor) -> int:
    return int(tensor.handle.data.reshape(-1)[0])


def _patch_lang_tensor_with_index(tensor, scope, _original=interpreter._patch_lang_tensor):
    _original(tensor, scope)
    scope.set_attr(tensor, "__index__", _index_of)


if not getattr(interpreter._patch_lang_tensor, "specdec_index_fix", False):
    _patch_lang_tensor_with_index.specdec_index_fix = True
    interpreter._patch_lang_tensor = _patch_lang_tensor_with_index


def _row_invariant_dot(self, a, b, d, input_precision, max_num_imprecise_acc, _original=None):
    if a.data.dtype.kind != "f" or a.dtype.primitive_bitwidth == 8:
        return _original(self, a, b, d, input_precision, max_num_imprecise_acc)
    product = np.einsum("...mk,...kn->...mn", a.data, b.data, dtype=d.data.dtype, optimize=False)
    return interpreter.TensorHandle(product + d.data, d.dtype.scalar)


_builder = interpreter.InterpreterBuilder
if not getattr(_builder.create_dot, "specdec_row_invariant", False):
    _row_invariant_dot.__defaults__ = (_builder.create_dot,)
    _row_invariant_dot.specdec_row_invariant = True
    _builder.create_dot = _row_invariant_dot
