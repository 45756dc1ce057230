"""Compatibility fix for the Triton interpreter (TRITON_INTERPRET=1) under numpy >= 2.4.

The interpreter keeps scalars as 1-element arrays and converts them with `int(array)`, which
numpy 2.4 rejects, so a loop bound computed in a kernel (`range(lo, hi)` with `hi` loaded from
memory) fails with "only 0-dimensional arrays can be converted to Python scalars"
(triton-lang/triton#9171). The fix wraps the interpreter's tensor patching to convert through
`.item()`. It changes nothing for compiled kernels; import this module before launching kernels.
"""

from triton.runtime import interpreter


def _index_of(tensor) -> int:
    return int(tensor.handle.data.reshape(-1)[0])


def _patch_lang_tensor_with_index(tensor, scope, _original=interpreter._patch_lang_tensor):
    _original(tensor, scope)
    scope.set_attr(tensor, "__index__", _index_of)


if not getattr(interpreter._patch_lang_tensor, "specdec_index_fix", False):
    _patch_lang_tensor_with_index.specdec_index_fix = True
    interpreter._patch_lang_tensor = _patch_lang_tensor_with_index
