"""The fixed-tile Triton matmul of exact mode (`specdec_fast.kernels.matmul`): each output row
is the same bits alone and among others (run under the interpreter here), close to `F.linear`,
and the kernel compiles for sm_90 (H100/H200) with Triton's own ptxas, without spilling."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from specdec_fast.kernels.matmul import matmul_fixed_tile

TESTS = Path(__file__).resolve().parent
# The engine's launch as sm90_compile.py binds launches: recorded on meta tensors, compiled for
# sm_90, registers and spills read with cuobjdump.
COMPILE_SCRIPT = """
import importlib, json, sys
from unittest import mock
import torch
sys.path.insert(0, {tests!r})
import sm90_compile
from specdec_fast.kernels.jit.matmul import matmul_kernel
launcher = importlib.import_module("specdec_fast.kernels.matmul")
rows = []
for dtype, bias in (("bfloat16", True), ("float32", False)):
    launches = []
    meta = dict(dtype=getattr(torch, dtype), device="meta")
    recorder = sm90_compile.Recorder(matmul_kernel, launches)
    with mock.patch.object(launcher, "matmul_kernel", recorder):
        launcher.matmul_fixed_tile(
            torch.empty(3, 576, **meta),
            torch.empty(1536, 576, **meta),
            torch.empty(1536, **meta) if bias else None,
        )
    kernel, args, kwargs = launches[0]
    sm90_compile.JOBS[:] = [(kernel, sm90_compile.bind(kernel, args, kwargs))]
    rows.append(dict(dtype=dtype, bias=bias, **sm90_compile.resources(0)))
print(json.dumps(rows))
"""


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_do_not_depend_on_the_call(dtype):
    torch.manual_seed(0)
    x = torch.randn(70, 80, dtype=dtype)
    weight, bias = torch.randn(50, 80, dtype=dtype), torch.randn(50, dtype=dtype)
    together = matmul_fixed_tile(x, weight, bias)
    for start, count in ((0, 1), (5, 3), (63, 2), (1, 69)):
        alone = matmul_fixed_tile(x[start : start + count].clone(), weight, bias)
        assert torch.equal(alone, together[start : start + count])
    reference = F.linear(x.double(), weight.double(), bias.double())
    if dtype == torch.bfloat16:
        # Within two bf16 ulps (the interpreter's conversion to bf16 need not round to nearest).
        torch.testing.assert_close(together.double(), reference, rtol=2**-6, atol=2**-6)
    else:
        # As far from the fp64 result as torch's own fp32 matmul, at most twice.
        plain = F.linear(x, weight, bias).double()
        error = (together.double() - reference).abs().max()
        assert error <= 2 * (plain - reference).abs().max() + 1e-6


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="x, weight"):
        matmul_fixed_tile(torch.randn(2, 3), torch.randn(4, 5))
    with pytest.raises(ValueError, match="bias"):
        matmul_fixed_tile(torch.randn(2, 3), torch.randn(4, 3), torch.randn(3))


def test_compiles_for_sm90_without_spilling():
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", COMPILE_SCRIPT.format(tests=str(TESTS))],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(result.stdout)
    assert [row["spill_bytes"] for row in rows] == [0, 0], rows
    assert all(row["programs_per_sm"] >= 1 for row in rows), rows
