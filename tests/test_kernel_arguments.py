"""Random malformed arguments at each kernel, on both fast backends: the only exceptions are
ValueError/TypeError whose message starts with the argument's name; and SPECDEC_BACKEND=triton
where the interpreter is off is a clear error."""

import math
import os
import re
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdec_fast.kernels import backend, kv_compact, tree_attention, verify

B, HQ, HKV, N, D, LMAX, V = 2, 2, 1, 3, 8, 16, 16


def _attention_args() -> dict:
    generator = torch.Generator().manual_seed(0)
    return {
        "q": torch.randn(B, HQ, N, D, generator=generator),
        "k_cache": torch.randn(B, HKV, LMAX, D, generator=generator),
        "v_cache": torch.randn(B, HKV, LMAX, D, generator=generator),
        "cache_lens": torch.tensor([5, 7], dtype=torch.int32),
        "tree_mask": None,
        "q_lens": None,
        "scale": None,
        "softcap": None,
        "window": None,
    }


def _verify_args() -> dict:
    generator = torch.Generator().manual_seed(0)
    return {
        "logits": torch.randn(B, N + 1, V, generator=generator),
        "draft_tokens": torch.randint(V, (B, N + 1), generator=generator),
        "parents": torch.tensor([[-1, 0, 1, 2]] * B),
        "draft_probs": None,
        "temperature": 0.5,
        "top_k": 0,
        "top_p": 1.0,
        "seed": 3,
    }


def _compact_args() -> dict:
    return {
        "kv": torch.randn(2, 2, B, HKV, LMAX, 4),
        "cache_lens": torch.tensor([3, 5], dtype=torch.int32),
        "accepted_nodes": torch.tensor([[0, 1, -1, -1], [0, 2, 3, -1]], dtype=torch.int32),
        "num_accepted": torch.tensor([1, 2], dtype=torch.int32),
    }


def _not_a_tensor():
    return st.sampled_from([None, "tensor", 3, [1, 2]])


# kernel -> (call(args), base arguments, {argument: strategy of malformed values})
KERNELS = {
    "tree_attention": (
        lambda a: tree_attention(**a),
        _attention_args,
        {
            "q": st.sampled_from(
                [
                    torch.zeros(B, HQ, N, D, dtype=torch.float64),
                    torch.zeros(B, N, D),
                    torch.zeros(B, HQ, N, 300),
                    "q",
                ]
            ),
            "k_cache": st.sampled_from(
                [
                    torch.zeros(B, HKV, LMAX, D, dtype=torch.float16),
                    torch.zeros(B + 1, HKV, LMAX, D),
                    torch.zeros(B, 3, LMAX, D),
                    torch.zeros(B, HKV, 2, D),
                ]
            ),
            "v_cache": st.sampled_from(
                [torch.zeros(B, HKV, LMAX - 1, D), torch.zeros(B, HKV, LMAX, D).transpose(2, 3)]
            ),
            "cache_lens": st.one_of(
                _not_a_tensor(),
                st.sampled_from(
                    [
                        torch.tensor([5, 7]),
                        torch.tensor([5], dtype=torch.int32),
                        torch.tensor([-1, 0], dtype=torch.int32),
                        torch.tensor([14, 2], dtype=torch.int32),
                    ]
                ),
            ),
            "tree_mask": st.sampled_from(
                [
                    torch.ones(B, N, N + 1, dtype=torch.bool),
                    torch.ones(B, N, N),
                    "mask",
                    torch.ones(B, N, 2, dtype=torch.int32),
                ]
            ),
            "q_lens": st.sampled_from(
                [
                    torch.tensor([4, 0], dtype=torch.int32),
                    torch.tensor([-1, 2], dtype=torch.int32),
                    torch.tensor([1, 2]),
                    [1, 2],
                ]
            ),
            "scale": st.one_of(
                st.just(math.nan), st.just(math.inf), st.text(max_size=2), st.just(torch.ones(2))
            ),
            "softcap": st.one_of(st.floats(max_value=0.0), st.just(math.nan), st.text(max_size=2)),
            "window": st.one_of(st.integers(max_value=0), st.floats(), st.text(max_size=2)),
        },
    ),
    "verify": (
        lambda a: verify(**a),
        _verify_args,
        {
            "logits": st.sampled_from(
                [
                    torch.zeros(B, N + 1, V, dtype=torch.int64),
                    torch.zeros(B, V),
                    [[0.0]],
                    torch.zeros(B + 1, N + 1, V),
                ]
            ),
            "draft_tokens": st.sampled_from(
                [
                    torch.zeros(B, N),
                    torch.full((B, N + 1), V),
                    torch.full((B, N + 1), -3),
                    torch.zeros(B, N + 1, dtype=torch.int16),
                ]
            ),
            "parents": st.sampled_from(
                [
                    torch.tensor([[0, 0, 1, 2]] * B),
                    torch.tensor([[-1, 2, 1, 2]] * B),
                    torch.tensor([[-1, 0, -2, 2]] * B),
                    torch.zeros(B, N + 1),
                ]
            ),
            "draft_probs": st.sampled_from(
                [
                    torch.zeros(B, N + 1, V + 1),
                    torch.full((B, N + 1, V), math.nan),
                    torch.full((B, N + 1, V), -1.0 / V),
                    torch.full((B, N + 1, V), 2.0 / V),
                    "probs",
                ]
            ),
            "temperature": st.one_of(
                st.floats(max_value=-1e-9),
                st.just(math.nan),
                st.floats(min_value=1e-44, max_value=1e-39),
                st.text(max_size=2),
                st.just(torch.ones(B + 1)),
            ),
            "top_k": st.one_of(
                st.integers(max_value=-1), st.floats(allow_nan=False), st.text(max_size=2)
            ),
            "top_p": st.one_of(
                st.floats(max_value=0.0), st.floats(min_value=1.0001), st.just(math.nan)
            ),
            "seed": st.one_of(
                st.text(max_size=2), st.floats(), st.just(torch.ones(B + 1, dtype=torch.int64))
            ),
        },
    ),
    "kv_compact": (
        lambda a: kv_compact(**a),
        _compact_args,
        {
            "kv": st.sampled_from(
                [
                    torch.zeros(2, B, HKV, LMAX, 4),
                    torch.zeros(2, 3, B, HKV, LMAX, 4),
                    "kv",
                    torch.zeros(2, 2, B, HKV, LMAX, 4, dtype=torch.complex128),
                ]
            ),
            "cache_lens": st.one_of(
                _not_a_tensor(),
                st.sampled_from(
                    [
                        torch.tensor([3, 5]),
                        torch.tensor([-2, 5], dtype=torch.int32),
                        torch.tensor([15, 5], dtype=torch.int32),
                    ]
                ),
            ),
            "accepted_nodes": st.sampled_from(
                [
                    torch.tensor([[1, 1, -1, -1], [0, 2, 3, -1]], dtype=torch.int32),
                    torch.tensor([[0, 1, -1, -1], [0, 3, 2, -1]], dtype=torch.int32),
                    torch.tensor([[0, 1], [0, 2]]),
                    torch.tensor([[0, 9, -1, -1], [0, 2, 3, -1]], dtype=torch.int32),
                ]
            ),
            "num_accepted": st.one_of(
                _not_a_tensor(),
                st.sampled_from(
                    [
                        torch.tensor([4, 2], dtype=torch.int32),
                        torch.tensor([-1, 2], dtype=torch.int32),
                        torch.tensor([1, 2, 3], dtype=torch.int32),
                    ]
                ),
            ),
        },
    ),
}


@pytest.mark.parametrize("kernel", list(KERNELS))
@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_random_malformed_kernel_arguments_are_named(kernel_backend, kernel, data):
    call, base, malformed = KERNELS[kernel]
    args = base()
    name = data.draw(st.sampled_from(sorted(malformed)), label="argument")
    value = data.draw(malformed[name], label=name)
    # A fresh copy: kv_compact writes in place (an accepted value would change the pool).
    args[name] = value.clone() if isinstance(value, torch.Tensor) else value
    with pytest.raises((TypeError, ValueError)) as raised:
        call(args)
    names = "|".join(re.escape(n) for n in args)
    assert re.match(rf"({names})\b", str(raised.value)), (name, raised.value)


def test_the_triton_backend_without_the_interpreter_is_a_clear_error(monkeypatch):
    """SPECDEC_BACKEND=triton set after import: CPU tensors cannot run the Triton kernels."""
    monkeypatch.setenv("SPECDEC_BACKEND", "triton")
    monkeypatch.setattr(backend, "interpreting", lambda: False)
    with pytest.raises(RuntimeError, match="has to be on before Triton is imported"):
        tree_attention(**{k: v for k, v in _attention_args().items() if v is not None})
    monkeypatch.setenv("SPECDEC_BACKEND", "cuda")
    with pytest.raises(ValueError, match=r"SPECDEC_BACKEND must be one of"):
        verify(**_verify_args())


def test_triton_imported_before_the_interpreter_was_asked_for_is_a_clear_error(tmp_path):
    """transformers' model classes import Triton: with SPECDEC_BACKEND=triton alone in the
    environment, Triton's own library was built for the compiler before specdec_fast switched
    the interpreter on, and the interpreted kernels failed calling it with Triton's "Cannot call
    @triton.jit'd outside of the scope of a kernel"."""
    code = (
        "from transformers import LlamaForCausalLM\n"
        "import torch\n"
        "from specdec_fast.kernels import backend\n"
        "try:\n"
        "    print(backend.backend_for(torch.device('cpu')))\n"
        "except RuntimeError as error:\n"
        "    print(error)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["SPECDEC_BACKEND"] = "triton"
    # Away from the repository root, whose kernels/ folder transformers would import as its
    # optional `kernels` package (switching the interpreter on before Triton's import).
    run = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert "has to be on before Triton is imported" in run.stdout
