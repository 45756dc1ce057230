"""Test setup: Triton kernels run under the interpreter when no GPU is present; the engine runs
eagerly unless a test asks for compiled steps.

TRITON_INTERPRET must be set before Triton is first imported, hence at the top of conftest.
Tests that exercise the Triton path call the launchers directly or set SPECDEC_BACKEND=triton
through the `triton_backend` fixture; everything else uses the default backend choice.
"""

import functools
import os

# Inductor's CPU kernels in scalar C++ (no vector ISA): each compiled test graph's kernels compile
# in about half the time, the same graphs and the same engine code around them (what the compiled
# tests check). `TORCHINDUCTOR_VEC_ISA_OK= bash run.sh test` (set, empty: inductor's own choice)
# runs them vectorized, as a CPU user gets them. Set before torch reads it; the tests'
# subprocesses inherit it.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Compiling every tiny test model would cost seconds each: tests run the engine eagerly unless
# they ask for compiled steps (`compile=True`), which tests/test_compiled_step.py does.
os.environ.setdefault("SPECDEC_COMPILE", "0")
# Freezing makes each compile several times slower: the compiled tests run unfrozen unless they
# test freezing itself (tests/test_compiled_step.py, tests/test_bench_e2e.py set it).
os.environ.setdefault("SPECDEC_FREEZE", "0")

import pytest  # noqa: E402

# Test tensors are tiny: one intra-op thread avoids oversubscription (and its spin-waits) when
# the machine is shared, and keeps timings steady.
torch.set_num_threads(1)

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")


# The modules that take longest on the CPU (their summed test times in a cold suite run, as on
# CI's machine: an empty inductor cache), longest first. `run.sh test` hands whole modules to its
# two workers in collection order (`--dist loadfile --no-loadscope-reorder`): these first, the
# many short ones last, so that the two workers finish together rather than one running a long
# module on alone.
SLOWEST_MODULES = (
    "test_step_budget.py",
    "test_compiled_step.py",
    "test_compiled_drafters.py",
    "test_continuous_batching.py",
    "test_eagle.py",
    "test_block.py",
    "test_gpu_suite.py",
    "test_verify_schedules.py",
    "test_step_graphs.py",
    "test_bench_e2e.py",
    "test_verify.py",
    "test_parallel.py",
    "test_verify_lossless.py",
    "test_read_ahead.py",
    "test_serving_warmup.py",
    "test_tree_attention_window.py",
    "test_tree_attention_tiles.py",
    "test_harness.py",
    "test_parallel_serving.py",
    "test_bench_tree_attention.py",
    "test_chat_target.py",
    "test_engine_process.py",
    "test_serving.py",
    "test_server_soak.py",
    "test_bench_verify.py",
    "test_server_shutdown.py",
    "test_ngram_device.py",
    "test_bundled.py",
    "test_exact.py",
    "test_sm90_compile.py",
    "test_generate_sampling.py",
    "test_bench_kv_compact.py",
    "test_generate.py",
)


def pytest_collection_modifyitems(config, items):
    first = {name: rank for rank, name in enumerate(SLOWEST_MODULES)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def device() -> torch.device:
    return DEVICE


@pytest.fixture
def triton_backend(monkeypatch):
    """Route kernel calls to the Triton kernels (interpreted on the CPU)."""
    monkeypatch.setenv("SPECDEC_BACKEND", "triton")


@pytest.fixture
def fused_backend(monkeypatch):
    """Route kernel calls to the fused-torch implementations (the CPU default)."""
    monkeypatch.setenv("SPECDEC_BACKEND", "fused")


@pytest.fixture(params=["triton", "fused"])
def kernel_backend(request, monkeypatch) -> str:
    """Each fast implementation in turn: the Triton kernels (interpreted on the CPU) and the
    fused-torch ones; the tests check them against the references."""
    monkeypatch.setenv("SPECDEC_BACKEND", request.param)
    return request.param


@pytest.fixture
def torch_backend(monkeypatch):
    """Route kernel calls to the plain-torch references."""
    monkeypatch.setenv("SPECDEC_BACKEND", "torch")


@pytest.fixture
def capture_only(monkeypatch):
    """Compiled mode with dynamo's capture only (its `eager` backend runs the graphs as
    captured): what compiles, and when, is decided by the capture's guards, whatever backend
    turns the graphs into code, without inductor's seconds of code generation per graph."""
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
