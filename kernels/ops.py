"""`define_op`: a kernel as a `torch.library` custom op of namespace `specdec_fast`, with a fake
kernel, declared in the kernel's own module beside its launcher.

`torch.compile` (fullgraph) and CUDA graph capture hold the ops as single opaque calls: the fake
implementations give output shapes without running anything, the real ones dispatch to the
backend (`backend.py`) at run time. The public functions validate and then call these ops while
compiling, the `run_*` dispatchers directly in eager mode (which saves the dispatcher's cost);
both run the same code. The ops (declared in `tree_attention.py`, `verify.py`, `kv_compact.py`
and `batch_invariant.py`; `kernels/__init__.py` imports them all):

    torch.ops.specdec_fast.tree_attention(q, k_cache, v_cache, cache_lens, tree_mask, q_lens,
                                          scale, softcap, window, q_depths) -> out
    torch.ops.specdec_fast.verify(logits, draft_tokens, parents, draft_probs,
                                  temperature, temperature_value, top_k, top_k_value,
                                  top_p, top_p_value, seed, seed_value)
                                  -> (accepted_nodes, num_accepted, next_tokens)
    torch.ops.specdec_fast.kv_compact(kv, cache_lens, accepted_nodes, num_accepted) -> None
    torch.ops.specdec_fast.linear_exact(x, weight, bias) -> out     (exact mode's linear layers:
        the fixed-tile Triton matmul on CUDA, fixed row tiles on the CPU)

Arguments are those of the public functions after validation: the tree mask packed, the scale a
float, and each sampling parameter as a `[B]` tensor or None plus the scalar used when it is None.
"""

from collections.abc import Callable

import torch

NAMESPACE = "specdec_fast"

# A plain `Library` definition rather than `torch.library.custom_op`: the same schema and fake
# kernels for the compiler, without the Python autograd wrapper that would cost each of the
# engine's per-layer calls several microseconds (the ops are for inference: no gradients).
# A fragment, and only ops not defined yet: a kernel module may be imported twice in a process
# (a script run from the source tree also sees `kernels/` as a top-level package).
_library = torch.library.Library(NAMESPACE, "FRAGMENT")


def _registered(name: str) -> bool:
    try:
        getattr(getattr(torch.ops, NAMESPACE), name)
    except AttributeError:
        return False
    return True


def define_op(schema: str, fake: Callable) -> Callable[[Callable], Callable]:
    """A decorator: define `specdec_fast::NAME` by `schema` ("NAME(Tensor x, ...) -> Tensor"),
    the decorated function its implementation on every device and `fake` its fake kernel (the
    outputs' shapes, dtypes and strides from the inputs'); returns the function unchanged."""
    name = schema.partition("(")[0]

    def register(implementation: Callable) -> Callable:
        if not _registered(name):
            _library.define(schema)
            _library.impl(name, implementation, "CompositeExplicitAutograd")
            torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=_library)
        return implementation

    return register
