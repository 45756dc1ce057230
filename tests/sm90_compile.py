"""Compile every kernel launch the library makes for sm_90 (H100/H200) as Triton's JIT compiles it
there, without a GPU, and record each distinct launch's registers, spills, shared memory and
programs per SM.

The launchers (`launch_tree_attention`, `launch_verify`, kv_compact's `_launch`) run on meta
tensors laid out as the engine lays them out (caches as views of the `[layers, 2, B, Hkv, Lmax,
D]` tensor, q as HF's transposed `[B, N, Hq, D]`), with an H200's 132 SMs patched in; their
kernel launches are captured and bound exactly as the JIT binds them (16-byte alignment of
pointers, integers divisible by 16, integers equal to 1 as constants: what makes loads vectorized
and pipelined, and so what the register count depends on), deduplicated by that binding, and
compiled with Triton's own ptxas. cuobjdump gives registers and stack bytes (spills) per thread;
programs per SM follow from those, the warps and the shared memory, with sm_90's limits.

The sweep (`sweep_points`) is the shapes of Llama-3-8B/70B, Qwen2.5-7B (GQA 7), Mistral-7B
(window 4096), Gemma2-9B (head dim 256, soft-cap 50, window 4096 on local layers) and Phi-3-mini
(head dim 96, MHA) in fp16 and bf16: tree attention at B 1/8/32 over N 1 (decode), 16, 32, 33,
64, 65 (the engine's 64-node budget plus the root) and 128 (a causal prefill chunk); verify at
each model's vocabulary (fp32 and bf16 logits, greedy and sampled trees, chains with draft
probabilities, filters); kv_compact per model at B 1 and 32. Plus one point per configuration
`kernel_config` can pick over a generic grid (head dims 64-256, fp32 too), and every candidate
tile of the decode schedule (the tuning part may pick any of them).

Run without TRITON_INTERPRET (the JIT's binder is needed):
    python tests/sm90_compile.py keys             # the sweep's distinct launches, no compile
    python tests/sm90_compile.py compile IDS_JSON # compile those launch ids, print JSON rows
    python tests/sm90_compile.py table --write    # compile the whole sweep (3.5 minutes on
        # two cores, Triton's cache empty), print the table, write
        # bench/results/sm90_compile_table.{json,md}
    python tests/sm90_compile.py table --write --reuse   # the same, compiling only launches
        # the committed table lacks
"""

import argparse
import dataclasses
import hashlib
import importlib
import itertools
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from unittest import mock

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature

from specdec_fast.kernels.configs import overridden
from specdec_fast.kernels.jit.kv_compact import kv_compact_kernel
from specdec_fast.kernels.jit.tree_attention import (
    tree_attention_combine_kernel,
    tree_attention_kernel,
)
from specdec_fast.kernels.jit.verify import verify_stats_kernel, verify_walk_kernel

# The package exports functions named like these modules: reach the modules themselves.
attention_launcher = importlib.import_module("specdec_fast.kernels.tree_attention")
verify_launcher = importlib.import_module("specdec_fast.kernels.verify")
compact_launcher = importlib.import_module("specdec_fast.kernels.kv_compact")

TARGET = GPUTarget("cuda", 90, 32)
BACKEND = make_backend(TARGET)
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
TABLE = Path(__file__).resolve().parents[1] / "bench" / "results" / "sm90_compile_table"
H200_SMS = 132
# sm_90 per SM: 64K 32-bit registers (allocated per warp in units of 256), 228 KB of shared
# memory (1 KB reserved per program), 64 warps, 32 programs.
REGISTERS_PER_SM = 65536
REGISTER_UNIT = 256
SHARED_PER_SM = 233472
SHARED_RESERVED = 1024
WARPS_PER_SM = 64
PROGRAMS_PER_SM = 32
NUM_LAYERS = 2  # tree attention reads one layer's view of a cache this deep

# name: (query heads, KV heads, head dim, layers, vocabulary, attention kinds (window, softcap))
MODELS = {
    "llama3-8b": (32, 8, 128, 32, 128256, ((None, None),)),
    "llama3-70b": (64, 8, 128, 80, 128256, ((None, None),)),
    "qwen2.5-7b": (28, 4, 128, 28, 152064, ((None, None),)),
    "mistral-7b": (32, 8, 128, 32, 32768, ((4096, None),)),
    "gemma2-9b": (16, 8, 256, 42, 256000, ((None, 50.0), (4096, 50.0))),
    "phi3-mini": (32, 32, 96, 32, 32064, ((None, None),)),
}
HALF_DTYPES = ("float16", "bfloat16")
# (batch, prefix, N, tree): decode, trees of the nominal and the engine's sizes, a prefill chunk.
ATTENTION_SHAPES = [
    (batch, prefix, num_new, num_new > 1 and num_new != 128)
    for batch, prefix in ((1, 4096), (1, 16384), (8, 4096), (32, 2048))
    for num_new in (1, 16, 32, 33, 64, 65, 128)
]
# (kind, batch, N): verify shapes; kinds name the sampling setup (see `verify_point`).
VERIFY_KINDS = ("greedy-tree", "sampled-tree", "chain", "filtered-chain", "filtered-tree")
VERIFY_SHAPES = [
    (kind, batch, num_nodes)
    for kind in VERIFY_KINDS
    for batch in (1, 8, 32)
    for num_nodes in ((6,) if "chain" in kind else (33, 64, 65))
]


def attention_point(
    model,
    head_dim,
    dtype,
    batch,
    prefix,
    group,
    kv_heads,
    num_new,
    tree,
    features,
    splits=None,
    config=None,
):
    """A tree-attention launch; `config` (a KernelConfig's fields) forces the tiles."""
    window, softcap = features
    forced = {} if config is None else dict(config=config)
    return dict(
        op="tree_attention",
        model=model,
        head_dim=head_dim,
        dtype=dtype,
        batch=batch,
        prefix=prefix,
        num_kv_heads=kv_heads,
        group=group,
        num_new=num_new,
        tree=tree,
        window=window,
        softcap=softcap,
        q_lens=batch > 1,
        num_splits=splits,
        **forced,
    )


def model_points() -> list[dict]:
    points = []
    for model, (q_heads, kv_heads, head_dim, layers, vocab, kinds) in MODELS.items():
        group = q_heads // kv_heads
        for dtype, features, (batch, prefix, num_new, tree) in itertools.product(
            HALF_DTYPES, kinds, ATTENTION_SHAPES
        ):
            shape = (batch, prefix, group, kv_heads, num_new, tree, features)
            points.append(attention_point(model, head_dim, dtype, *shape))
        for logits_dtype, (kind, batch, num_nodes) in itertools.product(
            ("float32", "bfloat16"), VERIFY_SHAPES
        ):
            shape = dict(kind=kind, batch=batch, num_nodes=num_nodes)
            points.append(dict(op="verify", model=model, dtype=logits_dtype, vocab=vocab, **shape))
        for batch in (1, 32):
            cache = dict(layers=layers, num_kv_heads=kv_heads, head_dim=head_dim, prefix=4096)
            shape = dict(batch=batch, num_nodes=65)
            points.append(dict(op="kv_compact", model=model, dtype="bfloat16", **cache, **shape))
    return points


def generic_points() -> list[dict]:
    """One point per configuration `kernel_config` picks over head dims {64, 80, 96, 128, 192,
    256} x fp16/bf16/fp32 x GQA groups {1, 2, 3, 4, 8} x N {1, 17, 64, 65, 128} x plain or
    windowed and soft-capped: the k-th configuration's point is its members' k-th (mod their
    count); tree or causal, the batch and the splits rotate with k at different periods."""
    members = {}
    for head_dim, dtype, group, num_new, features in itertools.product(
        (64, 80, 96, 128, 192, 256),
        (*HALF_DTYPES, "float32"),
        (1, 2, 3, 4, 8),
        (1, 17, 64, 65, 128),
        ((None, None), (512, 50.0)),
    ):
        variant = features != (None, None)
        config = attention_launcher.kernel_config(
            head_dim, group, num_new, getattr(torch, dtype), variant
        )
        members.setdefault((dtype == "float32", config, variant), []).append(
            (head_dim, dtype, group, num_new, features)
        )
    points = []
    for k, candidates in enumerate(members.values()):
        head_dim, dtype, group, num_new, features = candidates[k % len(candidates)]
        batch, tree, splits = (1, 3)[k // 4 % 2], k // 2 % 2 == 0 and num_new > 1, (1, 4, 2)[k % 3]
        shape = (batch, 4096, group, 8, num_new, tree, features, splits)
        points.append(attention_point("generic", head_dim, dtype, *shape))
    return points


def decode_candidate_points() -> list[dict]:
    """Every candidate tile of tree attention's decode schedule (the tuning part may pick any),
    forced on its K/V width: a 64-node tree at GQA 4, B1 over 4096 keys, split 16 ways."""
    points = []
    for block_d, candidates in attention_launcher.DECODE_TILE_CANDIDATES.items():
        for tile in candidates:
            config = tile.config(attention_launcher.DECODE_ROWS, block_d)
            shape = (1, 4096, 4, 8, 64, True, (None, None), 16, dataclasses.asdict(config))
            for dtype in HALF_DTYPES:
                points.append(attention_point("decode-candidate", block_d, dtype, *shape))
    return points


def verify_candidate_points() -> list[dict]:
    """Every pair of verify's tuning candidates (race tiles, statistics programs per SM) on the
    tuning part's shapes: Llama-3's stochastic chain K=5 at B1 and B32, fp32 logits."""
    return [
        dict(
            op="verify",
            model="verify-candidate",
            dtype="float32",
            vocab=128256,
            kind="chain",
            batch=batch,
            num_nodes=6,
            configs={"verify_race_tiles": tiles, "verify_stats_programs_per_sm": programs},
        )
        for tiles, programs in itertools.product(
            verify_launcher.RACE_TILE_CANDIDATES, verify_launcher.STATS_PROGRAMS_CANDIDATES
        )
        for batch in (1, 32)
    ]


def sweep_points() -> list[dict]:
    return model_points() + generic_points() + decode_candidate_points() + verify_candidate_points()


def point_label(point: dict) -> str:
    """A short name for a point: model, op and shape."""
    if point["op"] == "tree_attention":
        shape = f"B{point['batch']}/L{point['prefix']}/N{point['num_new']}"
        shape += "" if point["tree"] else "c"
        shape += f"/w{point['window']}" if point["window"] else ""
        shape += "/cap" if point["softcap"] else ""
        if "config" in point:
            config = point["config"]
            shape += f"/n{config['block_n']}w{config['num_warps']}s{config['num_stages']}"
    elif point["op"] == "verify":
        shape = f"{point['kind']}/B{point['batch']}/N{point['num_nodes']}"
        if "configs" in point:
            shape += "/" + ",".join(f"{value}" for value in point["configs"].values())
    else:
        shape = f"B{point['batch']}"
    return f"{point['model']}:{point['op']}:{point['dtype']}:{shape}"


class Recorder:
    """Stands in for a kernel in a launcher: `kernel[grid](*args, **kwargs)` records the call."""

    def __init__(self, kernel, launches):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((self.kernel, args, kwargs))


def _recording(module, kernels, launches):
    patches = [
        mock.patch.object(module, kernel.__name__, Recorder(kernel, launches)) for kernel in kernels
    ]
    if hasattr(module, "sm_count"):  # kv_compact's launch does not depend on the GPU
        patches.append(mock.patch.object(module, "sm_count", lambda device: H200_SMS))
    return patches


def _launch_attention(point: dict) -> None:
    meta = dict(device="meta")
    batch, kv_heads, num_new, head_dim = (
        point[key] for key in ("batch", "num_kv_heads", "num_new", "head_dim")
    )
    dtype = getattr(torch, point["dtype"])
    capacity = point["prefix"] + num_new
    q = torch.empty(batch, num_new, point["group"] * kv_heads, head_dim, dtype=dtype, **meta)
    q = q.transpose(1, 2)
    kv = torch.empty(NUM_LAYERS, 2, batch, kv_heads, capacity, head_dim, dtype=dtype, **meta)
    cache_lens = torch.empty(batch, dtype=torch.int32, **meta)
    words = triton.cdiv(num_new, 32)
    mask = torch.empty(batch, num_new, words, dtype=torch.int32, **meta) if point["tree"] else None
    depths = torch.empty(batch, num_new, dtype=torch.int32, **meta) if point["tree"] else None
    attention_launcher.launch_tree_attention(
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
        config=attention_launcher.KernelConfig(**point["config"]) if "config" in point else None,
    )


def _launch_verify(point: dict) -> None:
    """The engine's call: fp32 (or bf16) logits, per-sequence temperature, filters and seeds
    where the kind has them; scalars for the greedy tree."""
    meta = dict(device="meta")
    batch, num_nodes, vocab, kind = (point[key] for key in ("batch", "num_nodes", "vocab", "kind"))
    dtype = getattr(torch, point["dtype"])
    logits = torch.empty(batch, num_nodes, vocab, dtype=dtype, **meta)
    tokens = torch.empty(batch, num_nodes, dtype=torch.int64, **meta)
    parents = torch.empty(batch, num_nodes, dtype=torch.int64, **meta)
    draft_probs = torch.empty_like(logits) if "chain" in kind else None
    per_sequence = torch.empty(batch, dtype=torch.float32, **meta)
    filtered = kind.startswith("filtered")
    params = verify_launcher.SamplingParams(
        temperature=0.0 if kind == "greedy-tree" else per_sequence,
        top_k=torch.empty(batch, dtype=torch.int64, **meta) if filtered else 0,
        top_p=per_sequence if filtered else 1.0,
        seed=torch.empty(batch, dtype=torch.int64, **meta),
    )
    with overridden(point.get("configs", {})):
        verify_launcher.launch_verify(logits, tokens, parents, draft_probs, params)


def _launch_compact(point: dict) -> None:
    meta = dict(device="meta")
    batch = point["batch"]
    shape = (point["layers"], 2, batch, point["num_kv_heads"], point["prefix"] + point["num_nodes"])
    kv = torch.empty(*shape, point["head_dim"], dtype=getattr(torch, point["dtype"]), **meta)
    lens = torch.empty(batch, dtype=torch.int32, **meta)
    nodes = torch.empty(batch, point["num_nodes"], dtype=torch.int32, **meta)
    compact_launcher._launch(kv, lens, nodes, lens)


OPS = {
    "tree_attention": (
        attention_launcher,
        (tree_attention_kernel, tree_attention_combine_kernel),
        _launch_attention,
    ),
    "verify": (verify_launcher, (verify_stats_kernel, verify_walk_kernel), _launch_verify),
    "kv_compact": (compact_launcher, (kv_compact_kernel,), _launch_compact),
}


def launches_of(point: dict) -> list:
    """(kernel, args, kwargs) of each launch that the op's launcher makes for `point`."""
    module, kernels, launch = OPS[point["op"]]
    launches = []
    patches = _recording(module, kernels, launches)
    for patch in patches:
        patch.start()
    try:
        launch(point)
    finally:
        for patch in patches:
            patch.stop()
    return launches


def bind(kernel, args, kwargs):
    """(options, signature, constexprs, attrs) exactly as the JIT computes them for a launch."""
    binder = create_function_from_signature(kernel.signature, kernel.params, BACKEND)
    bound_args, specialization, options = binder(*args, **kwargs)
    return kernel._pack_args(BACKEND, kwargs, bound_args, specialization, options)


def describe(kernel, binding) -> dict:
    """The binding in words: its id (a hash of everything the compiler sees: the kernel's source
    with the JIT functions it calls, as Triton's own cache keys it, and the binding), the
    argument types, the constants (constexprs and integers specialized to 1), the arguments
    known divisible by 16, and the launch options."""
    options, signature, constexprs, attrs = binding
    names = kernel.arg_names
    constants = {names[path[0]]: value for path, value in constexprs.items()}
    divisible = sorted(names[path[0]] for path, attr in attrs.items() if attr)
    # Library paths depend on where Triton is installed, not on the launch: file names only.
    settings = dict(options.__dict__)
    settings["extern_libs"] = tuple((name, Path(path).name) for name, path in options.extern_libs)
    full = repr(
        (kernel.__name__, kernel.cache_key, signature, constexprs, attrs, sorted(settings.items()))
    )
    return dict(
        id=hashlib.sha1(full.encode()).hexdigest()[:12],
        kernel=kernel.__name__,
        types={name: kind for name, kind in signature.items() if kind != "constexpr"},
        constants=constants,
        divisible_by_16=divisible,
        warps=options.num_warps,
        stages=options.num_stages,
        maxnreg=options.maxnreg,
    )


def distinct_launches(points: list[dict]) -> dict:
    """id -> (description, kernel, binding, labels of the points that make this launch)."""
    launches = {}
    for point in points:
        for kernel, args, kwargs in launches_of(point):
            binding = bind(kernel, args, kwargs)
            description = describe(kernel, binding)
            entry = launches.setdefault(description["id"], (description, kernel, binding, []))
            entry[3].append(point_label(point))
    return launches


def occupancy(regs: int, shared: int, warps: int) -> int:
    """Programs an sm_90 SM holds at once: the least of the register, shared-memory, warp and
    program limits."""
    per_warp = triton.cdiv(regs * 32, REGISTER_UNIT) * REGISTER_UNIT
    by_registers = REGISTERS_PER_SM // per_warp // warps
    by_shared = SHARED_PER_SM // (shared + SHARED_RESERVED)
    return min(by_registers, by_shared, WARPS_PER_SM // warps, PROGRAMS_PER_SM)


# The distinct launches to compile, filled before forking.
JOBS = []


def resources(job: int) -> dict:
    """Compile bound launch `JOBS[job]` for sm_90: registers and stack bytes per thread, shared
    bytes per program, programs per SM."""
    kernel, (options, signature, constexprs, attrs) = JOBS[job]
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
    regs = int(re.search(r"REG:(\d+)", usage).group(1))
    shared = compiled.metadata.shared
    return {
        "regs": regs,
        "spill_bytes": int(re.search(r"STACK:(\d+)", usage).group(1)),
        "shared_bytes": shared,
        "programs_per_sm": occupancy(regs, shared, options.num_warps),
    }


def compile_launches(launches: dict, ids: list[str]) -> list[dict]:
    """Compile the launches `ids` (two at a time: forked workers inherit JOBS); one row each:
    the description, the resources and the points that use it."""
    JOBS[:] = [(launches[i][1], launches[i][2]) for i in ids]
    with multiprocessing.get_context("fork").Pool(min(2, os.cpu_count() or 1)) as pool:
        usages = pool.map(resources, range(len(JOBS)))
    return [
        {**launches[i][0], **usage, "points": launches[i][3]}
        for i, usage in zip(ids, usages, strict=True)
    ]


def tiles(row: dict) -> str:
    """The tile constants and set flags of a launch, in one cell."""
    constants = row["constants"]
    parts = [
        f"{name.removeprefix('BLOCK_')}{value}"
        for name, value in constants.items()
        if name.startswith("BLOCK_")
    ]
    flags = [name for name, value in constants.items() if value is True]
    shape = [
        f"{name}={value}"
        for name, value in constants.items()
        if name in ("HEAD_DIM", "GROUP", "MASK_WORDS", "batch")
    ]
    return " ".join(parts + shape + flags)


def format_table(rows: list[dict]) -> str:
    """Markdown: a summary per kernel, then one row per distinct launch."""
    lines = [
        "| kernel | launches | max registers | spilling launches | min programs/SM |",
        "|---|---|---|---|---|",
    ]
    for kernel in dict.fromkeys(row["kernel"] for row in rows):
        mine = [row for row in rows if row["kernel"] == kernel]
        lines.append(
            f"| {kernel} | {len(mine)} | {max(r['regs'] for r in mine)} "
            f"| {sum(r['spill_bytes'] > 0 for r in mine)} "
            f"| {min(r['programs_per_sm'] for r in mine)} |"
        )
    lines += [
        "",
        "| id | kernel | tiles, shape, flags | warps/stages/maxnreg | regs | spill B "
        "| shared KB | programs/SM | points |",
        "|---" * 9 + "|",
    ]
    for row in rows:
        shown = ", ".join(row["points"][:3])
        more = f" (+{len(row['points']) - 3})" if len(row["points"]) > 3 else ""
        lines.append(
            f"| {row['id']} | {row['kernel']} | {tiles(row)} "
            f"| {row['warps']}/{row['stages']}/{row['maxnreg'] or '-'} | {row['regs']} "
            f"| {row['spill_bytes']} | {row['shared_bytes'] / 1024:.0f} "
            f"| {row['programs_per_sm']} | {shown}{more} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("keys", help="the sweep's distinct launches (no compile), as JSON")
    compile_parser = commands.add_parser("compile", help="compile launch ids, print JSON rows")
    compile_parser.add_argument("ids", help="JSON list of launch ids")
    table_parser = commands.add_parser("table", help="compile the whole sweep")
    table_parser.add_argument("--write", action="store_true", help=f"write {TABLE}.json/.md")
    table_parser.add_argument(
        "--reuse",
        action="store_true",
        help="keep the committed table's rows of launches it already has (their ids hash all "
        "the compiler sees, the kernel's source included) and compile only the others",
    )
    args = parser.parse_args()
    launches = distinct_launches(sweep_points())
    if args.command == "keys":
        print(json.dumps([{**entry[0], "points": entry[3]} for entry in launches.values()]))
        return
    if args.command == "compile":
        print(json.dumps(compile_launches(launches, json.loads(args.ids))))
        return
    known = {}
    if args.reuse and TABLE.with_suffix(".json").exists():
        known = {row["id"]: row for row in json.loads(TABLE.with_suffix(".json").read_text())}
    fresh = compile_launches(launches, [i for i in launches if i not in known])
    compiled = {row["id"]: row for row in fresh}
    rows = [compiled.get(i) or {**known[i], "points": launches[i][3]} for i in launches]
    table = format_table(rows)
    print(table)
    if args.write:
        lines = ",\n".join(json.dumps(row) for row in rows)  # a launch per line: diffs stay small
        TABLE.with_suffix(".json").write_text(f"[\n{lines}\n]\n")
        header = (
            "# sm_90 compile table\n\nEvery distinct kernel launch of the sweep in "
            "tests/sm90_compile.py, compiled for sm_90 with Triton "
            f"{triton.__version__}'s ptxas on the CPU (regenerate: `python tests/sm90_compile.py "
            "table --write`; tests/test_sm90_compile.py checks it against the code).\n\n"
        )
        TABLE.with_suffix(".md").write_text(header + table + "\n")


if __name__ == "__main__":
    sys.exit(main())
