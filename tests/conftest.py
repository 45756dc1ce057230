"""Test setup: Triton kernels run under the interpreter when no GPU is present.

TRITON_INTERPRET must be set before Triton is first imported, hence at the top of conftest.
Tests that exercise the Triton path call the launchers directly or set SPECDEC_BACKEND=triton
through the `triton_backend` fixture; everything else uses the default backend choice.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

# Test tensors are tiny: one intra-op thread avoids oversubscription (and its spin-waits) when
# the machine is shared, and keeps timings steady.
torch.set_num_threads(1)

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")


def pytest_collection_modifyitems(config, items):
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
def torch_backend(monkeypatch):
    """Route kernel calls to the plain-torch references."""
    monkeypatch.setenv("SPECDEC_BACKEND", "torch")
