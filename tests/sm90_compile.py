"""Compile tree_attention's kernels for sm_90 as Triton's JIT compiles them on an H100/H200, without
a GPU, and report each distinct launch's local-memory bytes (register spills).

Run as a script in a process where Triton is not interpreting (TRITON_INTERPRET unset):
`python tests/sm90_compile.py POINTS_JSON`, where each point describes one `tree_attention` call:
`{"head_dim", "dtype" ("float16" | "bfloat16" | "float32"), "batch", "num_kv_heads", "group",
"num_new", "tree", "window" (int | null), "softcap" (float | null), "q_lens", "num_splits"}`.
The real launcher runs on meta tensors laid out as the engine lays them out (caches as views of
the `[layers, 2, B, Hkv, Lmax, D]` tensor, q as HF's transposed `[B, N, Hq, D]`); its kernel
launches are captured and bound exactly as the JIT binds them (16-byte alignment of pointers,
integers divisible by 16, integers equal to 1 as constants: what makes loads vectorized and
pipelined, and so what the register count depends on), deduplicated by that binding, and
compiled with Triton's own ptxas. Prints one JSON list: per distinct launch, the index of the
first point that produced it, the kernel, its tiles, and the registers and stack bytes (spills)
that cuobjdump reports.
"""

import importlib
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
from unittest import mock

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature

from specdec_fast.kernels.jit.tree_attention import (
    tree_attention_combine_kernel,
    tree_attention_kernel,
)

# The package exports a function named like the module: reach the module itself.
launcher = importlib.import_module("specdec_fast.kernels.tree_attention")
TARGET = GPUTarget("cuda", 90, 32)
BACKEND = make_backend(TARGET)
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
NUM_LAYERS = 2
PREFIX = 4096


class Recorder:
    """Stands in for a kernel in the launcher: `kernel[grid](*args, **kwargs)` records the call."""

    def __init__(self, kernel, launches):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((self.kernel, args, kwargs))


def launches_of(point: dict) -> list:
    """(kernel, args, kwargs) of each launch that `launch_tree_attention` makes for `point`."""
    meta = dict(device="meta")
    batch, num_kv_heads, num_new, head_dim = (
        point["batch"],
        point["num_kv_heads"],
        point["num_new"],
        point["head_dim"],
    )
    dtype = getattr(torch, point["dtype"])
    capacity = PREFIX + num_new
    num_q_heads = point["group"] * num_kv_heads
    q = torch.empty(batch, num_new, num_q_heads, head_dim, dtype=dtype, **meta).transpose(1, 2)
    kv = torch.empty(NUM_LAYERS, 2, batch, num_kv_heads, capacity, head_dim, dtype=dtype, **meta)
    cache_lens = torch.empty(batch, dtype=torch.int32, **meta)
    words = -(-num_new // 32)
    mask = torch.empty(batch, num_new, words, dtype=torch.int32, **meta) if point["tree"] else None
    depths = torch.empty(batch, num_new, dtype=torch.int32, **meta) if point["tree"] else None
    launches = []
    with (
        mock.patch.object(
            launcher, "tree_attention_kernel", Recorder(tree_attention_kernel, launches)
        ),
        mock.patch.object(
            launcher,
            "tree_attention_combine_kernel",
            Recorder(tree_attention_combine_kernel, launches),
        ),
    ):
        launcher.launch_tree_attention(
            q,
            kv[1, 0],
            kv[1, 1],
            cache_lens,
            mask,
            cache_lens if point["q_lens"] else None,
            head_dim**-0.5,
            point["num_splits"],
            softcap=point["softcap"],
            window=point["window"],
            q_depths=depths,
        )
    return launches


def bind(kernel, args, kwargs):
    """(options, signature, constexprs, attrs) exactly as the JIT computes them for a launch."""
    binder = create_function_from_signature(kernel.signature, kernel.params, BACKEND)
    bound_args, specialization, options = binder(*args, **kwargs)
    return kernel._pack_args(BACKEND, kwargs, bound_args, specialization, options)


# The distinct launches: (index of the first point, kernel, binding), filled before forking.
JOBS = []


def resources(job: int) -> dict:
    """Compile bound launch `JOBS[job]` for sm_90; its registers and stack bytes per thread."""
    _, kernel, (options, signature, constexprs, attrs) = JOBS[job]
    source = ASTSource(kernel, signature, constexprs, attrs)
    compiled = triton.compile(source, target=TARGET, options=options.__dict__)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage = subprocess.run(
            [CUOBJDUMP, "--dump-resource-usage", cubin.name],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    return {
        "regs": int(re.search(r"REG:(\d+)", usage).group(1)),
        "stack": int(re.search(r"STACK:(\d+)", usage).group(1)),
    }


def main(points: list[dict]) -> list[dict]:
    distinct = {}
    for index, point in enumerate(points):
        for kernel, args, kwargs in launches_of(point):
            binding = bind(kernel, args, kwargs)
            distinct.setdefault(repr((kernel.__name__, binding)), (index, kernel, binding))
    JOBS[:] = distinct.values()
    # Forked workers inherit JOBS; compiling is most of the time.
    with multiprocessing.get_context("fork").Pool(min(2, os.cpu_count() or 1)) as pool:
        usages = pool.map(resources, range(len(JOBS)))
    report = []
    for (index, kernel, binding), usage in zip(JOBS, usages, strict=True):
        options, signature, constexprs, _ = binding
        tiles = {
            name: constexprs[(position,)]
            for position, name in enumerate(kernel.arg_names)
            if name.startswith("BLOCK_")
        }
        report.append(
            dict(point=index, kernel=kernel.__name__, tiles=tiles, warps=options.num_warps, **usage)
        )
    return report


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
