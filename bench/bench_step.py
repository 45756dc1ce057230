"""Whole-model step benchmark: one decode or verify step of an 8B-shaped Llama, ours against HF.

The model is Llama-3-8B's shape (hidden 4096, 32 layers, 32 query / 8 KV heads, head dim 128,
intermediate 14336, vocab 128256) with random bf16 weights drawn on the device (normal, std
0.02; norms 1), nothing downloaded. At each point (batch B, context L) the KV cache holds L random
tokens per row, and each step is timed at that fixed context:

- `ours`: `ModelRunner.verify` over a `SpecKVCache` whose K/V are random and whose `cache_lens`
  are set to L (no prefill forward). N = 1 is the root alone: our plain decode step. N > 1 is a
  verify step of `default_tree(N)` (specdec_fast.trees, a static best-first tree of N nodes, root
  included, depth <= 8). On CUDA the runner replays its own CUDA graph, as in the engine; the
  timed call includes the runner's input copies and checks. `verify` never advances
  `cache_lens`; an untimed reset before every call also puts back the runner's host-side length
  bound, so repeated steps do identical work.
- `HF static cache`: HF's best plain decoding: a one-token forward over transformers'
  `StaticCache` (capacity L + 1, its K/V random, its length reset to L before every call),
  compiled as `generate` compiles it for a static cache (`model.get_compiled_call`: inductor,
  mode "reduce-overhead"). If compilation fails, the error is recorded and the eager forward is
  timed instead, labelled "eager". The prefill and the compile are not timed.

Each step is timed per call with CUDA events (graphs are replayed inside the call, so a graph of
graphs is not possible); medians, min and max in milliseconds.

Floors, from the copy bandwidth and the bf16 matmul rate measured in the same run
(bench/common.py): bytes = every weight except the input embedding (a step reads only its B * N
rows, which are counted) + the K/V of the prefix read + the new K/V written + the fp32 logits
written; FLOPs = 2 * matmul parameters * B * N + 4 * B * N * Hq * D * L per layer (attention over
the prefix). floor = max(bytes / bandwidth, FLOPs / rate). The weights-only floor is reported too.

Targets (shared ANCHORS.md): our decode step <= 1.2x its floor; a 64-node verify <= 1.25x our
decode step at the same B and L (marked unreachable where the verify's own floor is above that).

The bundled tiny-code pair end to end with every drafter is bench/bench_e2e_tiny.py's job (the
GPU suite runs both); nothing of it is repeated here.

Run as `python bench/bench_step.py [--quick] [--tiny] [--no-hf] [--json PATH]`. On a CPU it
always runs the tiny config (hidden 64, 2 layers), timed with perf_counter and without CUDA
graphs or compilation: a code-path check whose numbers mean nothing.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch
from common import (
    RESULTS_DIR,
    Timer,
    bench_device,
    copy_bandwidth,
    describe_error,
    environment,
    floor_us,
    matmul_rate,
    write_results,
)
from transformers import LlamaConfig, LlamaForCausalLM, StaticCache

from specdec_fast.runner import ModelRunner
from specdec_fast.trees import default_tree

LLAMA_8B = {
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
}
TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 512,
    "max_position_embeddings": 256,
}
DTYPE = torch.bfloat16
INIT_STD = 0.02
OURS = "ours"
HF_COMPILED = "HF static cache, compiled (reduce-overhead)"
HF_EAGER = "HF static cache, eager"
DECODE_LIMIT = 1.2
VERIFY_LIMIT = 1.25
TARGET_NODES = 64  # ANCHORS' verify target: a 64-node tree, the root included
# The compiled path warms up through cudagraph trees' warm-up run and recording.
HF_WARMUP = 5


@dataclass(frozen=True)
class Point:
    """One (batch, context): our steps at each of `nodes`, and HF's decode step when `hf`."""

    batch: int
    context: int
    nodes: tuple[int, ...]
    hf: bool

    @property
    def label(self) -> str:
        return f"B{self.batch}/L{self.context}"


def plan(tiny: bool, quick: bool, compiled: bool = False) -> tuple[dict, list[Point], int]:
    """(config kwargs, points, timed repetitions). HF (one compile of about a minute per new
    shape) runs at B1/L1024 in the full plan only (ANCHORS.md has its figures). N = 65 is a
    64-node tree plus a root, what the engine verified while budgets left the root out.
    `compiled`: our runner's compiled steps (about 45 s of inductor per graph, one graph per
    batch class and step kind), at B1 (--quick) or B1 and B8. --quick stays near 2 minutes on an
    H200 either way, the full plans near 3."""
    if tiny:
        return TINY, [Point(batch, 32, (1, 8), not compiled) for batch in (1, 3)], 5
    if compiled:
        points = [Point(1, 1024, (1, 64), False)]
        if not quick:
            points = [Point(1, 1024, (1, 64), False), Point(8, 1024, (1, 64), False)]
        return LLAMA_8B, points, 10 if quick else 30
    if quick:
        points = [
            Point(1, 1024, (1, 16, 64, 65), False),
            Point(32, 1024, (1, 64, 65), False),
            Point(1, 4096, (1, 64), False),
        ]
        return LLAMA_8B, points, 10
    points = [Point(1, 1024, (1, 16, 32, 64, 65), True)]
    points += [Point(batch, 1024, (1, 16, 64, 65), False) for batch in (8, 32)]
    points += [Point(batch, 4096, (1, 64, 65), False) for batch in (1, 32)]
    return LLAMA_8B, points, 30


def llama_config(config_kwargs: dict) -> LlamaConfig:
    return LlamaConfig(
        **config_kwargs,
        initializer_range=INIT_STD,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def build_model(config_kwargs: dict, device: torch.device, seed: int = 0) -> LlamaForCausalLM:
    """A Llama with random bf16 weights built on `device`: matrices normal(0, INIT_STD), never
    zeros (they would hide unwritten outputs and can run faster than real data), norms 1."""
    with torch.device(device):
        model = LlamaForCausalLM._from_config(llama_config(config_kwargs), dtype=DTYPE).eval()
    generator = torch.Generator(device).manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() >= 2:
                parameter.normal_(0.0, INIT_STD, generator=generator)
    return model


@dataclass(frozen=True)
class StepCost:
    """The fewest bytes one step moves and the FLOPs it does (see the module doc)."""

    weight_bytes: int
    kv_bytes: int
    logits_bytes: int
    flops: int

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes + self.logits_bytes


@dataclass(frozen=True)
class Footprint:
    """What a step's cost depends on, read off a model once.

    fixed_bytes: every parameter except the input embedding (included when tied to the output).
    row_bytes: one row of the input embedding (0 when tied: the whole matrix is in fixed_bytes).
    matmul_params: parameters of the matrix products (every >= 2-D weight but the input embedding).
    kv_token_bytes: K and V of one token over all layers.
    """

    fixed_bytes: int
    row_bytes: int
    matmul_params: int
    kv_token_bytes: int
    num_layers: int
    num_q_heads: int
    head_dim: int
    vocab_size: int

    def step(self, batch: int, context: int, nodes: int) -> StepCost:
        tokens = batch * nodes
        attention_flops = 4 * tokens * self.num_q_heads * self.head_dim * context * self.num_layers
        return StepCost(
            weight_bytes=self.fixed_bytes + tokens * self.row_bytes,
            kv_bytes=batch * (context + nodes) * self.kv_token_bytes,
            logits_bytes=tokens * self.vocab_size * 4,
            flops=2 * self.matmul_params * tokens + attention_flops,
        )


def footprint(model: LlamaForCausalLM) -> Footprint:
    """The model's `Footprint` (works on the meta device: nothing is read)."""
    config = model.config
    embedding = model.get_input_embeddings().weight
    tied = embedding is model.get_output_embeddings().weight
    fixed_bytes, matmul_params = 0, 0
    for parameter in model.parameters():
        if parameter is embedding and not tied:
            continue
        fixed_bytes += parameter.numel() * parameter.element_size()
        if parameter.dim() >= 2:
            matmul_params += parameter.numel()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_token_bytes = (
        config.num_hidden_layers
        * 2
        * config.num_key_value_heads
        * head_dim
        * embedding.element_size()
    )
    return Footprint(
        fixed_bytes=fixed_bytes,
        row_bytes=0 if tied else embedding.shape[1] * embedding.element_size(),
        matmul_params=matmul_params,
        kv_token_bytes=kv_token_bytes,
        num_layers=config.num_hidden_layers,
        num_q_heads=config.num_attention_heads,
        head_dim=head_dim,
        vocab_size=config.vocab_size,
    )


@dataclass
class StepRecord:
    """One timed step, in milliseconds; `error` is set when it failed, `note` says why a peer
    fell back (e.g. HF's compile error)."""

    peer: str
    batch: int
    context: int
    nodes: int
    cost: StepCost
    weights_floor_ms: float
    memory_floor_ms: float
    compute_floor_ms: float
    median_ms: float | None = None
    min_ms: float | None = None
    max_ms: float | None = None
    error: str | None = None
    note: str | None = None
    vs_floor: float | None = None
    vs_decode: float | None = None
    hf_vs_ours: float | None = None

    @property
    def floor_ms(self) -> float:
        return max(self.memory_floor_ms, self.compute_floor_ms)

    @property
    def label(self) -> str:
        return f"B{self.batch}/L{self.context}/N{self.nodes}"

    def to_dict(self) -> dict:
        return {**asdict(self), "floor_ms": self.floor_ms}


def new_record(peer: str, point: Point, nodes: int, fp: Footprint, device) -> StepRecord:
    cost = fp.step(point.batch, point.context, nodes)
    return StepRecord(
        peer=peer,
        batch=point.batch,
        context=point.context,
        nodes=nodes,
        cost=cost,
        weights_floor_ms=floor_us(cost.weight_bytes, device) / 1e3,
        memory_floor_ms=floor_us(cost.total_bytes, device) / 1e3,
        compute_floor_ms=cost.flops / matmul_rate(str(device)) * 1e3,
    )


START = time.perf_counter()


def log(message: str) -> None:
    print(f"[{time.perf_counter() - START:7.1f}s] {message}", file=sys.stderr, flush=True)


def measure(record: StepRecord, make_timer: Callable[[], Timer], reps: int) -> None:
    """Time one step into `record`; a failure becomes its error and the run goes on."""
    try:
        median, low, high = make_timer().measure(reps)
        record.median_ms, record.min_ms, record.max_ms = median / 1e3, low / 1e3, high / 1e3
        log(f"{record.peer} {record.label}: {record.median_ms:.3f} ms")
    except Exception as error:  # one failing shape or peer is a result, not the end of the run
        record.error = describe_error(error)
        log(f"{record.peer} {record.label}: {record.error}")


def tree_inputs(batch: int, nodes: int, vocab: int, device, seed: int = 0):
    """(tokens, parents) int64 `[B, N]`: random tokens on the root alone (N = 1) or on
    `default_tree(N)` (root included), the same tree in every row."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(vocab, (batch, nodes), generator=generator)
    tree = (-1,) if nodes == 1 else default_tree(nodes).node_parents
    parents = torch.tensor(tree, dtype=torch.int64).expand(batch, -1).contiguous()
    return tokens.to(device), parents.to(device)


def time_ours(
    model, point: Point, fp: Footprint, reps: int, compiled: bool = False
) -> list[StepRecord]:
    """Our step at each N over one random cache of `point.context` tokens per row, through the
    model's kept runner (`compiled`: its compiled steps, reused by the later points)."""
    device = model.device
    records = [new_record(OURS, point, nodes, fp, device) for nodes in point.nodes]
    runner = ModelRunner.for_model(model, point.context + max(point.nodes), compile=compiled)
    try:
        # One-token prompts allocate the cache and cache nothing; then its K/V are drawn and
        # its lengths set, instead of a prefill forward over the context.
        runner.prefill(torch.zeros(point.batch, 1, dtype=torch.int64, device=device))
        runner.cache.kv.normal_()
        lengths = torch.full((point.batch,), point.context, dtype=torch.int32, device=device)

        def reset() -> None:
            runner.cache.commit_lengths(lengths, point.context)

        for record in records:
            tokens, parents = tree_inputs(point.batch, record.nodes, fp.vocab_size, device)
            step = partial(runner.verify, tokens, parents)
            measure(record, partial(Timer, step, device, capture=False, reset=reset), reps)
    except Exception as error:  # the cache could not be set up: every N of the point fails
        for record in records:
            if record.median_ms is None and record.error is None:
                record.error = describe_error(error)
        log(f"{OURS} {point.label}: {describe_error(error)}")
    finally:
        runner.close()
    return records


class HFPeer:
    """HF's one-token forward over a `StaticCache`, compiled as `generate` compiles it (on
    CUDA); after a compile failure, the eager forward for this and every later point."""

    def __init__(self, model: LlamaForCausalLM):
        self.model = model
        self.compile = model.device.type == "cuda"
        self.compile_error: str | None = None

    def time(self, point: Point, fp: Footprint, reps: int) -> StepRecord:
        model, device = self.model, self.model.device
        peer = HF_COMPILED if self.compile else HF_EAGER
        record = new_record(peer, point, 1, fp, device)
        try:
            cache = StaticCache(config=model.config, max_cache_len=point.context + 1)
            cache.early_initialization(
                point.batch, model.config.num_key_value_heads, fp.head_dim, model.dtype, device
            )
            for layer in cache.layers:
                layer.keys.normal_()
                layer.values.normal_()
            tokens, _ = tree_inputs(point.batch, 1, fp.vocab_size, device)

            def reset() -> None:
                for layer in cache.layers:
                    layer.cumulative_length.fill_(point.context)

            def eager() -> None:
                model(input_ids=tokens, past_key_values=cache, use_cache=True)

            def make_timer() -> Timer:
                if self.compile:
                    compiled = model.get_compiled_call(None)

                    def step() -> None:
                        torch.compiler.cudagraph_mark_step_begin()
                        compiled(input_ids=tokens, past_key_values=cache, use_cache=True)

                    try:
                        return Timer(step, device, HF_WARMUP, capture=False, reset=reset)
                    except Exception as error:  # a failing compile is a result: time eager
                        self.compile, self.compile_error = False, describe_error(error)
                        log(f"{HF_COMPILED} {point.label}: {self.compile_error}; timing eager")
                        record.peer = HF_EAGER
                return Timer(eager, device, capture=False, reset=reset)

            measure(record, make_timer, reps)
            if self.compile_error is not None:
                record.note = f"compile failed: {self.compile_error}"
        except Exception as error:
            record.error = describe_error(error)
            log(f"{record.peer} {point.label}: {record.error}")
        return record


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def compare(records: list[StepRecord]) -> None:
    """Fill in each step over its floor, our verify over our decode, HF's decode over ours."""
    decode = {
        (r.batch, r.context): r.median_ms
        for r in records
        if r.peer == OURS and r.nodes == 1 and r.median_ms is not None
    }
    for record in records:
        if record.median_ms is None:
            continue
        record.vs_floor = record.median_ms / record.floor_ms
        ours = decode.get((record.batch, record.context))
        if ours is None:
            continue
        if record.peer == OURS and record.nodes > 1:
            record.vs_decode = record.median_ms / ours
        elif record.peer != OURS:
            record.hf_vs_ours = record.median_ms / ours


def _verdict(ratio: float | None, limit: float) -> str:
    if ratio is None:
        return "no data"
    return "pass" if ratio <= limit else "fail"


def check_targets(records: list[StepRecord]) -> list[dict]:
    """Per (B, L): decode <= DECODE_LIMIT x floor; verify at N = TARGET_NODES (else the largest
    N) <= VERIFY_LIMIT x decode, "unreachable" where that verify's floor is above the limit."""
    ours = {(r.batch, r.context, r.nodes): r for r in records if r.peer == OURS}
    targets = []
    for (batch, context, nodes), decode in ours.items():
        if nodes != 1:
            continue
        shape = f"B{batch}/L{context}"
        targets.append(
            {
                "target": f"decode <= {DECODE_LIMIT}x floor",
                "shape": shape,
                "ratio": decode.vs_floor,
                "limit": DECODE_LIMIT,
                "verdict": _verdict(decode.vs_floor, DECODE_LIMIT),
            }
        )
        sizes = [n for b, c, n in ours if (b, c) == (batch, context)]
        widest = TARGET_NODES if TARGET_NODES in sizes else max(sizes)
        if widest == 1:
            continue
        verify = ours[batch, context, widest]
        verdict = _verdict(verify.vs_decode, VERIFY_LIMIT)
        if decode.median_ms is not None and verify.floor_ms > VERIFY_LIMIT * decode.median_ms:
            verdict = (
                f"unreachable (floor {verify.floor_ms:.2f} ms > {VERIFY_LIMIT} x "
                f"{decode.median_ms:.2f} ms)"
            )
        targets.append(
            {
                "target": f"verify N={widest} <= {VERIFY_LIMIT}x decode",
                "shape": shape,
                "ratio": verify.vs_decode,
                "limit": VERIFY_LIMIT,
                "verdict": verdict,
            }
        )
    return targets


def _ms(record: StepRecord | None) -> str:
    if record is None:
        return "-"
    if record.error is not None:
        return f"fails ({record.error.split(':')[0]})"
    return f"{record.median_ms:.3f} ({record.min_ms:.3f}-{record.max_ms:.3f})"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def format_tables(records: list[StepRecord], targets: list[dict]) -> str:
    """The step table (ms, median (min-max)) and the target table, in markdown."""
    hf = {(r.batch, r.context): r for r in records if r.peer != OURS}
    lines = [
        "| B | L | N | weights floor ms | floor ms | ours ms | ours/floor | ours/decode "
        "| HF ms | HF/ours |",
        "|---" * 10 + "|",
    ]
    for r in records:
        if r.peer != OURS:
            continue
        peer = hf.get((r.batch, r.context)) if r.nodes == 1 else None
        bound = "compute" if r.compute_floor_ms > r.memory_floor_ms else "memory"
        lines.append(
            f"| {r.batch} | {r.context} | {r.nodes} | {r.weights_floor_ms:.3f} "
            f"| {r.floor_ms:.3f} ({bound}) | {_ms(r)} | {_ratio(r.vs_floor)} "
            f"| {_ratio(r.vs_decode)} | {_ms(peer)} "
            f"| {_ratio(peer.hf_vs_ours) if peer else '-'} |"
        )
    lines += ["", "| target | shape | ratio | verdict |", "|---|---|---|---|"]
    lines += [
        f"| {t['target']} | {t['shape']} | {_ratio(t['ratio'])} | {t['verdict']} |" for t in targets
    ]
    return "\n".join(lines)


def run(
    tiny: bool, quick: bool, hf: bool = True, compiled: bool = False
) -> tuple[list[StepRecord], list[dict], dict, str]:
    """Every point of the plan: (records, targets, setup, HF peer label)."""
    device = bench_device()
    config_kwargs, points, reps = plan(tiny, quick, compiled)
    log(
        f"measured: copy {copy_bandwidth(str(device)) / 1e9:.0f} GB/s, "
        f"matmul {matmul_rate(str(device)) / 1e12:.1f} TFLOP/s"
    )
    model = build_model(config_kwargs, device)
    fp = footprint(model)
    log(f"model built on {device}: {fp.fixed_bytes / 1e9:.2f} GB read per step besides rows")
    hf_peer = HFPeer(model)
    records: list[StepRecord] = []
    with torch.no_grad():
        for point in points:
            records += time_ours(model, point, fp, reps, compiled)
            free_memory(device)
            if hf and point.hf:
                records.append(hf_peer.time(point, fp, reps))
                free_memory(device)
    compare(records)
    setup = {
        "model": config_kwargs,
        "dtype": str(DTYPE),
        "init_std": INIT_STD,
        "tiny": tiny,
        "quick": quick,
        "compiled": compiled,
        "reps": reps,
        "points": [asdict(point) for point in points],
        "tree": "N = 1: the root alone; N > 1: default_tree(N), root included",
        "units": "milliseconds per step",
        "hf_compile_error": hf_peer.compile_error,
    }
    return records, check_targets(records), setup, HF_COMPILED if hf_peer.compile else HF_EAGER


def test_step(benchmark):
    """pytest-benchmark mode: the --quick plan on CUDA, the tiny one on the CPU, run once."""
    tiny = bench_device().type != "cuda"
    benchmark.group = "whole-model step"
    records, targets, _, _ = benchmark.pedantic(run, args=(tiny, True), rounds=1, iterations=1)
    benchmark.extra_info["records"] = [r.to_dict() for r in records]
    benchmark.extra_info["targets"] = targets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="B 1 and 32, N 1 to 65, no HF")
    parser.add_argument(
        "--compile", action="store_true", help="our runner's compiled steps (B 1, and 8 in full)"
    )
    parser.add_argument("--tiny", action="store_true", help="tiny config (always on a CPU)")
    parser.add_argument("--no-hf", action="store_true", help="skip HF's peer (and its compile)")
    parser.add_argument("--json", type=Path, default=None, help="default: results/bench_step.json")
    args = parser.parse_args()
    device = bench_device()
    tiny = args.tiny or device.type != "cuda"
    if device.type != "cuda":
        # Tiny tensors: a second intra-op thread only adds spin-waits on a shared machine.
        torch.set_num_threads(1)
    records, targets, setup, hf_label = run(
        tiny, args.quick, hf=not args.no_hf and not args.compile, compiled=args.compile
    )
    env = environment(device)
    what = "tiny Llama" if tiny else "8B-shaped Llama"
    print(
        f"Whole-model step, {what}, random bf16 weights, on {env['gpu'] or 'CPU'} ({env['date']})"
    )
    print(f"torch {env['torch']}, triton {env['triton']}, transformers {env['transformers']}")
    if device.type != "cuda":
        print("CPU: perf_counter, no CUDA graphs; these numbers mean nothing")
    print(f"our steps: {'compiled' if args.compile else 'eager'}, CUDA graphs on CUDA")
    print(
        f"ms per step, median (min-max) of {setup['reps']}; HF = {hf_label}, decode only; "
        f"floor = max(bytes at {env['copy_bandwidth_GBps']} GB/s, FLOPs at "
        f"{matmul_rate(str(device)) / 1e12:.3g} TFLOP/s)"
    )
    print(format_tables(records, targets))
    write_results(
        args.json or RESULTS_DIR / "bench_step.json",
        "bench_step",
        env,
        [r.to_dict() for r in records],
        setup=setup,
        targets=targets,
    )


if __name__ == "__main__":
    main()
