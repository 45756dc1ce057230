"""The kernels as `torch.library` custom ops, namespace `specdec_fast`, with fake kernels.

`torch.compile` (fullgraph) and CUDA graph capture hold them as single opaque calls: the fake
implementations give output shapes without running anything, the real ones dispatch to the
backend (`backend.py`) at run time. The public functions validate and then call these ops while
compiling, the `run_*` dispatchers directly in eager mode (which saves the dispatcher's cost);
both run the same code.

    torch.ops.specdec_fast.tree_attention(q, k_cache, v_cache, cache_lens, tree_mask, q_lens,
                                          scale, softcap, window, q_depths) -> out
    torch.ops.specdec_fast.verify(logits, draft_tokens, parents, draft_probs,
                                  temperature, temperature_value, top_k, top_k_value,
                                  top_p, top_p_value, seed, seed_value)
                                  -> (accepted_nodes, num_accepted, next_tokens)
    torch.ops.specdec_fast.kv_compact(kv, cache_lens, accepted_nodes, num_accepted) -> None
    torch.ops.specdec_fast.linear_exact(x, weight, bias) -> out     (exact mode's linear layers:
        the fixed-tile Triton matmul on CUDA, fixed row tiles on the CPU; `batch_invariant.py`)

Arguments are those of the public functions after validation: the tree mask packed, the scale a
float, and each sampling parameter as a `[B]` tensor or None plus the scalar used when it is None.
"""

import torch

from .batch_invariant import linear_exact
from .kv_compact import run_kv_compact
from .tree_attention import run_tree_attention
from .verify import SamplingParams, run_verify

NAMESPACE = "specdec_fast"
SCHEMAS = {
    "tree_attention": (
        "tree_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cache_lens, "
        "Tensor? tree_mask, Tensor? q_lens, float scale, float? softcap, int? window, "
        "Tensor? q_depths) -> Tensor"
    ),
    "verify": (
        "verify(Tensor logits, Tensor draft_tokens, Tensor parents, Tensor? draft_probs, "
        "Tensor? temperature, float temperature_value, Tensor? top_k, int top_k_value, "
        "Tensor? top_p, float top_p_value, Tensor? seed, int seed_value) "
        "-> (Tensor, Tensor, Tensor)"
    ),
    "kv_compact": (
        "kv_compact(Tensor(a!) kv, Tensor(b!) cache_lens, Tensor accepted_nodes, "
        "Tensor num_accepted) -> ()"
    ),
    "linear_exact": "linear_exact(Tensor x, Tensor weight, Tensor? bias) -> Tensor",
}


def tree_attention_impl(
    q, k_cache, v_cache, cache_lens, tree_mask, q_lens, scale, softcap, window, q_depths
):
    out = run_tree_attention(
        q, k_cache, v_cache, cache_lens, tree_mask, q_lens, scale, softcap, window, q_depths
    )
    return out.contiguous()  # the layout the fake promises


def tree_attention_fake(q, *args):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def verify_impl(
    logits,
    draft_tokens,
    parents,
    draft_probs,
    temperature,
    temperature_value,
    top_k,
    top_k_value,
    top_p,
    top_p_value,
    seed,
    seed_value,
):
    params = SamplingParams(
        temperature_value if temperature is None else temperature,
        top_k_value if top_k is None else top_k,
        top_p_value if top_p is None else top_p,
        seed_value if seed is None else seed,
    )
    return tuple(run_verify(logits, draft_tokens, parents, draft_probs, params))


def verify_fake(logits, *args):
    batch, num_nodes = logits.shape[:2]
    return (
        logits.new_empty((batch, num_nodes), dtype=torch.int32),
        logits.new_empty((batch,), dtype=torch.int32),
        logits.new_empty((batch,), dtype=torch.int64),
    )


def kv_compact_impl(kv, cache_lens, accepted_nodes, num_accepted) -> None:
    run_kv_compact(kv, cache_lens, accepted_nodes, num_accepted)


def kv_compact_fake(kv, cache_lens, accepted_nodes, num_accepted) -> None:
    return None


def linear_exact_fake(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


IMPLEMENTATIONS = {
    "tree_attention": (tree_attention_impl, tree_attention_fake),
    "verify": (verify_impl, verify_fake),
    "kv_compact": (kv_compact_impl, kv_compact_fake),
    "linear_exact": (linear_exact, linear_exact_fake),
}


def _registered(name: str) -> bool:
    try:
        getattr(getattr(torch.ops, NAMESPACE), name)
    except AttributeError:
        return False
    return True


# A plain `Library` definition rather than `torch.library.custom_op`: the same schema and fake
# kernels for the compiler, without the Python autograd wrapper that would cost each of the
# engine's per-layer calls several microseconds (the ops are for inference: no gradients).
# A fragment, and only ops not defined yet: this module may be imported twice in a process (a
# script run from the source tree also sees `kernels/` as a top-level package).
_library = torch.library.Library(NAMESPACE, "FRAGMENT")
for _name, _schema in SCHEMAS.items():
    if _registered(_name):
        continue
    _library.define(_schema)
    _implementation, _fake = IMPLEMENTATIONS[_name]
    _library.impl(_name, _implementation, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NAMESPACE}::{_name}", _fake, lib=_library)
