"""tree_attention's kernels compile for sm_90 (H100/H200) without spilling registers, checked on
the CPU with Triton's own ptxas (tests/sm90_compile.py), as the JIT specializes them on a GPU.

The grid is every launch the library makes for head dims {64, 80, 96, 128, 192, 256} x
{fp16, bf16, fp32} x GQA groups {1, 2, 3, 4, 8} x N in {1, 17, 64, 128}, tree and causal, with
and without a window and a soft-cap. All of it compiles in about an hour; this test compiles one
representative per distinct tile configuration (the tiles, warps and stages `kernel_config` picks,
per dtype width and per kernel variant), the other axes rotating through their values, plus the
benchmarks' anchor shapes.
"""

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton

from specdec_fast.kernels.tree_attention import kernel_config

SCRIPT = Path(__file__).with_name("sm90_compile.py")
HEAD_DIMS = (64, 80, 96, 128, 192, 256)
DTYPES = ("float16", "bfloat16", "float32")
GROUPS = (1, 2, 3, 4, 8)
NUM_NEW = (1, 17, 64, 128)
# (window, softcap): the plain kernel, each feature alone, both.
FEATURES = ((None, None), (512, None), (None, 50.0), (512, 50.0))


def point(head_dim, dtype, group, num_new, tree, features, *, batch=1, kv_heads=8, splits=1):
    window, softcap = features
    return dict(
        head_dim=head_dim,
        dtype=dtype,
        batch=batch,
        num_kv_heads=kv_heads,
        group=group,
        num_new=num_new,
        tree=tree,
        window=window,
        softcap=softcap,
        q_lens=batch > 1,
        num_splits=splits,
    )


# Llama-3-8B's verify at B1 (8 splits) and B8 (one); Mistral-7B's windowed verify; Gemma2-9B's
# soft-capped verify; Gemma3-1B's local layer verifying 16 nodes and decoding.
ANCHORS = [
    point(128, "bfloat16", 4, 64, True, FEATURES[0], splits=8),
    point(128, "bfloat16", 4, 64, True, FEATURES[0], batch=8),
    point(128, "bfloat16", 4, 64, True, (4096, None), splits=4),
    point(256, "bfloat16", 2, 64, True, (None, 50.0), splits=4),
    point(256, "bfloat16", 4, 16, True, (512, None), kv_heads=1, splits=16),
    point(256, "bfloat16", 4, 1, False, (512, None), kv_heads=1, splits=8),
]


def representative_points() -> list[dict]:
    """One grid point per distinct (dtype width, KernelConfig, windowed or capped): the k-th
    configuration's point is its members' k-th (mod their count); tree or causal, the batch (and
    so q_lens) and the splits rotate with k at different periods."""
    members = {}
    for head_dim, dtype, group, num_new, features in itertools.product(
        HEAD_DIMS, DTYPES, GROUPS, NUM_NEW, FEATURES
    ):
        features_on = features != (None, None)
        config = kernel_config(head_dim, group, num_new, getattr(torch, dtype), features_on)
        key = (dtype == "float32", config, features_on)
        members.setdefault(key, []).append((head_dim, dtype, group, num_new, features))
    points = []
    for k, candidates in enumerate(members.values()):
        head_dim, dtype, group, num_new, features = candidates[k % len(candidates)]
        points.append(
            point(
                head_dim,
                dtype,
                group,
                num_new,
                tree=k // 2 % 2 == 0,
                features=features,
                batch=(1, 3)[k // 4 % 2],
                splits=(1, 4, 2)[k % 3],
            )
        )
    return points


@pytest.mark.slow
def test_kernels_compile_for_sm90_without_spilling():
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this Triton build ships no ptxas")
    points = ANCHORS + representative_points()
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, str(SCRIPT), json.dumps(points)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    launches = json.loads(result.stdout)
    kernels = [launch for launch in launches if launch["kernel"] == "tree_attention_kernel"]
    # Every representative is its own launch (their tiles or variants differ).
    assert len(kernels) >= len(points) - len(ANCHORS)
    spills = [(points[launch["point"]], launch) for launch in launches if launch["stack"] != 0]
    assert spills == [], json.dumps(spills, indent=1)

