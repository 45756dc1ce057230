"""The package layout of docs/ARCHITECTURE.md: kernels install as specdec_fast.kernels, never as
`kernels`."""

import importlib.util
import os
import subprocess
import sys

import pytest
import torch
from bench_smoke import BENCH_DIR

import specdec_fast
import specdec_fast.kernels as kernels
from specdec_fast.cli import main
from specdec_fast.kernels.backend import requested_backend, use_triton


def test_kernels_are_a_subpackage():
    assert kernels.__name__ == "specdec_fast.kernels"
    top_level = importlib.util.find_spec("kernels")
    # A top-level `kernels` may exist (Hugging Face's library), but it must never be ours.
    if top_level is not None and top_level.origin is not None:
        assert not os.path.samefile(
            os.path.dirname(top_level.origin), os.path.dirname(kernels.__file__)
        )


def test_bundled_is_an_attribute_of_the_package():
    # A fresh interpreter: in this one another test may have imported specdec_fast.bundled.
    script = "import specdec_fast; print(specdec_fast.bundled.path('tiny-code'))"
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == specdec_fast.bundled.path("tiny-code")
    assert "bundled" in specdec_fast.__all__


def test_version_is_set():
    assert specdec_fast.__version__ != "0.0.0"


@pytest.mark.parametrize(
    ("value", "on_cpu", "on_cuda"),
    [("torch", False, False), ("triton", True, True), ("auto", False, True), ("", False, True)],
)
def test_backend_choice(monkeypatch, value, on_cpu, on_cuda):
    monkeypatch.setenv("SPECDEC_BACKEND", value)
    assert use_triton(torch.device("cpu")) is on_cpu
    assert use_triton(torch.device("cuda")) is on_cuda


def test_bad_backend_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("SPECDEC_BACKEND", "cuda")
    with pytest.raises(ValueError, match="SPECDEC_BACKEND"):
        requested_backend()


def test_the_module_runs_as_the_cli():
    """`python -m specdec_fast` is the `specdec-fast` command, in a fresh interpreter, and needs
    none of the serve extra's server packages (as on the GPU machine's image, which lacks them:
    bench/gpu_suite.py's dry run imports the same way)."""
    sys.path.insert(0, str(BENCH_DIR))
    from gpu_suite import device_image_env

    result = subprocess.run(
        [sys.executable, "-m", "specdec_fast", "demo", "--help"],
        capture_output=True,
        text=True,
        check=False,
        env=os.environ | device_image_env(dict(os.environ)),
    )
    assert result.returncode == 0, result.stderr
    assert "usage: specdec-fast demo" in result.stdout


@pytest.mark.parametrize("command", ["demo", "generate", "bench", "serve"])
def test_cli_help(command, capsys):
    # In this interpreter: a fresh one per command would cost seconds of imports each.
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    assert f"usage: specdec-fast {command}" in capsys.readouterr().out
