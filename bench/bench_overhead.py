"""Where a step's time goes, and our engine against HF, side by side in one process.

For each model (the bundled tiny-code target, and a Llama with random weights shaped like
SmolLM2-135M: 30 layers, hidden 576, 9 query / 3 KV heads, MLP 1536, vocab 49152, tied embeddings)
and each configuration (plain decoding and the n-gram drafter, at batch 1 and 8; on the bundled
pair also its DFlash block drafter, whose drafter share is its head's forward, and on a GPU
every other built-in drafter at batch 1):

1. **Step breakdown** (ms per step): wall time, model forward (the target runner's `verify`),
   sampler (`verify`), compaction, drafter (`propose` + `update`) and the engine (the rest), from
   timers wrapped around those calls in a run of its own. The engine overhead is the step minus
   its forward, as a share of the step. A second, untimed-inside run gives tokens/s (against
   plain decoding's at the same batch) and the host's share of a step: the step less the time
   the host waits in the step's read-back (`transfer.to_host`; on a GPU, the device time the
   host did not hide). A third and fourth count what a step dispatches outside compiled graphs
   and reads back (`step_ops.step_counts`, the rule of tests/test_step_budget.py; on a GPU the
   real device's dispatches).
2. **Peers**: tokens/s of our engine against HF `generate` (default dynamic cache, greedy), HF
   prompt lookup (`prompt_lookup_num_tokens=10`) for the n-gram drafter, and HF assisted
   generation for the draft-model chain (bundled pair), in alternating repeats (medians), at each
   thread count. Outputs are compared token for token.

    python bench/bench_overhead.py                 # both models, 1 and 2 threads (~20 min)
    python bench/bench_overhead.py --quick         # fewer repeats and tokens
    python bench/bench_overhead.py --tiny          # a 2-layer random model: the CI smoke run

On a CUDA machine the same runs go to the GPU (thread counts do not apply; one pass), and the
breakdown's timers synchronize the device around each timed call, so each part holds its own
GPU time: a host-bound step shows where the host's time goes (bench/gpu_suite.py --part
overhead).

Results: a table on stdout and JSON in bench/results/overhead-<device>.json (or --json PATH).
Compile times (each step shape compiles once per process) are reported, not timed.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from bench_generate import random_prompts
from common import RESULTS_DIR, bench_device, environment, sync, write_results
from step_ops import patch_everywhere, step_counts
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from specdec_fast import DraftModelDrafter, NGramDrafter, bundled, generate, transfer
from specdec_fast.cache import SpecKVCache
from specdec_fast.drafters.registry import DrafterSpec, bundled_specs
from specdec_fast.runner import kept_runner

HF_PROMPT_LOOKUP_TOKENS = 10
NGRAM_NODES = 8
# Against HF's prompt lookup (10-token chains): the default tree, and a 16-node one 15 deep. On the
# CPU a 16-row verify costs about what an 8-row one does and less than 10-15 rows (MKL's GEMM
# bands, `runner.MKL_SLOW_ROWS`), so the deeper tree is the one to run at batch 1.
NGRAM_VS_LOOKUP = ((NGRAM_NODES, None), (16, 15))
DRAFT_CHAIN = 4
BATCHES = (1, 8)
# The bundled DFlash head in the step breakdown of the bundled pair, at its best batch-1 budget on
# the CPU (bench/results/e2e_tiny-cpu.md).
BLOCK_SPEC = DrafterSpec.parse("block:tiny-code-dflash:8")
# On a GPU the breakdown also takes every other built-in drafter at the same budget: there the
# model drafters ran 6.6-10.4x slower than plain decoding (bench/NOTES.md, 2026-12-04), and the
# breakdown is what says where each one's step goes (issue 44's targets: >= 1.3x plain at batch 1).
# And the best drafter of the chat pair's demo: EAGLE-3 with the n-gram lookup grafted onto its
# trees, whose lookup reads the host's tokens every step (no read-ahead). Block drafters' chains
# are left out: a chain's step is its tree's forward, broken down beside the others, and a part
# has four minutes.
GRAFT_SPEC = DrafterSpec.parse(f"eagle:tiny-code-eagle3:{NGRAM_NODES}+ngram:{NGRAM_NODES}")
GPU_SPECS = (
    *(
        DrafterSpec(spec.kind, spec.path, DRAFT_CHAIN if spec.info.chain else NGRAM_NODES)
        for spec in bundled_specs()
        if spec.kind not in ("ngram", "block-chain") and spec.path != BLOCK_SPEC.path
    ),
    GRAFT_SPEC,
)
# Their batches: issue 44's GPU targets are at batch 1, and a part has four minutes.
GPU_BATCHES = (1,)


def gpu_specs(quick: bool) -> tuple[DrafterSpec, ...]:
    """The breakdown's other drafters on a GPU; --quick leaves out the suffix lookup (its step's
    host work is the n-gram lookup's, broken down at every batch), so that the default parts fit
    eight minutes."""
    return tuple(spec for spec in GPU_SPECS if not (quick and spec.kind == "suffix"))


@dataclass
class Model:
    name: str
    model: torch.nn.Module
    prompts: list[list[int]]
    draft: torch.nn.Module | None = None


def random_llama(shape: dict, seed: int, vocab: int) -> torch.nn.Module:
    config = LlamaConfig(
        vocab_size=vocab,
        tie_word_embeddings=True,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        **shape,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    model.generation_config = GenerationConfig(bos_token_id=None, eos_token_id=None)
    return model


SMOLLM2_SHAPE = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
)
TINY_SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)


def models(tiny: bool, batch: int, device: torch.device) -> list[Model]:
    if tiny:
        tiny_model = random_llama(TINY_SHAPE, 0, 256).to(device)
        return [Model("tiny random", tiny_model, random_prompts(batch, 40, 256))]
    out = []
    if "tiny-code" in bundled.available():
        from specdec_fast.loading import load_model, load_tokenizer
        from specdec_fast.prompts import load_code_prompts

        target = load_model("tiny-code", device)
        tokenizer = load_tokenizer("tiny-code")
        prompts = [
            [tokenizer.bos_token_id, *tokenizer.encode(r["prompt"], add_special_tokens=False)]
            for r in load_code_prompts(batch)
        ]
        draft = load_model("tiny-code-draft", device, target.dtype)
        out.append(Model("tiny-code", target, prompts, draft))
    smol = random_llama(SMOLLM2_SHAPE, 0, 49152).to(device)
    out.append(Model("SmolLM2-135M-shaped", smol, random_prompts(batch, 200, 49152)))
    return out


# ---------------------------------------------------------------- peers


def ours(setup: Model, drafter: Callable, batch: int, tokens: int) -> Callable[[], list]:
    prompts = setup.prompts[:batch]

    def run():
        out = generate(
            setup.model, prompts, drafter=drafter(), max_new_tokens=tokens, eos_token_id=[]
        )
        return [s.tolist() for s in out.sequences]

    return run


def hf(setup: Model, batch: int, tokens: int, **kwargs) -> Callable[[], list]:
    """HF `generate`, greedy, exactly `tokens` new tokens (no EOS stop), left-padded batches."""
    prompts = setup.prompts[:batch]
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    ids, mask = ids.to(setup.model.device), mask.to(setup.model.device)
    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=tokens,
        min_new_tokens=tokens,
        eos_token_id=None,
        pad_token_id=0,
        **{k: v for k, v in kwargs.items() if k != "assistant_model"},
    )
    extra = {"assistant_model": kwargs["assistant_model"]} if "assistant_model" in kwargs else {}

    def run():
        with torch.no_grad():
            out = setup.model.generate(ids, attention_mask=mask, generation_config=config, **extra)
        return [prompt + out[row, width:].tolist() for row, prompt in enumerate(prompts)]

    return run


@dataclass
class Comparison:
    model: str
    config: str
    batch: int
    threads: int
    ours: str
    peer: str
    ours_tokens_per_s: float
    peer_tokens_per_s: float
    ratio: float
    target: float
    identical: bool
    repeats: int
    ours_samples_s: list[float] = field(default_factory=list)
    peer_samples_s: list[float] = field(default_factory=list)

    @property
    def met(self) -> bool:
        return self.ratio >= self.target


def compare(name, config, batch, threads, ours_run, peer, peer_run, target, tokens, repeats):
    """Alternating repeats of our run and the peer's, after one warm-up each; medians."""
    first_ours, first_peer = ours_run(), peer_run()
    times = {"ours": [], "peer": []}
    for _ in range(repeats):
        for key, run in (("ours", ours_run), ("peer", peer_run)):
            start = time.perf_counter()
            run()
            times[key].append(time.perf_counter() - start)
    new_tokens = tokens * batch
    ours_rate = new_tokens / statistics.median(times["ours"])
    peer_rate = new_tokens / statistics.median(times["peer"])
    return Comparison(
        name,
        config,
        batch,
        threads,
        "specdec-fast",
        peer,
        ours_rate,
        peer_rate,
        ours_rate / peer_rate,
        target,
        first_ours == first_peer,
        repeats,
        times["ours"],
        times["peer"],
    )


# ---------------------------------------------------------------- step breakdown


@dataclass
class Breakdown:
    model: str
    config: str
    batch: int
    threads: int
    steps: int
    ms_per_step: dict[str, float]
    overhead_share: float
    compile_seconds: dict[str, float]
    # From the run without timers inside the step: tokens/s, the host's share of a step (the
    # step less the wait in its read-back), and the ratio to plain decoding at the same batch.
    tokens_per_s: float = 0.0
    tokens_per_step: float = 0.0
    host_share: float = 0.0
    vs_plain: float | None = None
    # Per steady-state step, dispatched outside compiled graphs and read back (step_ops).
    eager_ops_per_step: float = 0.0
    reads_per_step: float = 0.0


@contextmanager
def wrapped(owner, name: str, around: Callable[[], AbstractContextManager]):
    """Run every call of `owner.name` inside `around()` while the block runs."""
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        with around():
            return original(*args, **kwargs)

    own = name in vars(owner)  # a module's or class's own function, not an instance's method
    setattr(owner, name, wrapper)
    try:
        yield
    finally:
        if own:
            setattr(owner, name, original)
        else:
            delattr(owner, name)


@contextmanager
def timed(owner, name: str, bucket: dict[str, float], device: torch.device):
    """Wrap `owner.name` so that its wall time accumulates into `bucket[name]` (on CUDA with the
    device synchronized before and after, so the call's own GPU work counts to it)."""

    @contextmanager
    def clock():
        sync(device)
        start = time.perf_counter()
        try:
            yield
        finally:
            sync(device)
            bucket[name] = bucket.get(name, 0.0) + time.perf_counter() - start

    with wrapped(owner, name, clock):
        yield


def breakdown(setup: Model, config: str, make, batch: int, threads: int, tokens: int) -> Breakdown:
    import specdec_fast.step as step

    device = setup.model.device
    run = ours(setup, make, batch, tokens)
    run()  # warm: compiled steps exist, and the target's kept runner
    # The target's own runner, not the class: a drafter with a model of its own (PARD) verifies
    # through a runner too, and its forwards are the drafter's share.
    runner = kept_runner(setup.model)
    drafter = make()
    bucket: dict[str, float] = {}
    prompts = setup.prompts[:batch]
    with ExitStack() as stack:
        for owner, name in (
            (runner, "verify"),
            (runner, "prefill"),
            (step, "run_verify"),
            (SpecKVCache, "compact"),
        ):
            stack.enter_context(timed(owner, name, bucket, device))
        if drafter is not None:
            for name in ("propose", "update", "begin"):
                stack.enter_context(timed(drafter, name, bucket, device))
        start = time.perf_counter()
        out = generate(
            setup.model, prompts, drafter=drafter, max_new_tokens=tokens, eos_token_id=[]
        )
        sync(device)
        total = time.perf_counter() - start
    steps = out.stats.steps
    loop = total - bucket.get("prefill", 0.0) - bucket.get("begin", 0.0)
    parts = {
        "step": loop,
        "forward": bucket.get("verify", 0.0),
        "sampler": bucket.get("run_verify", 0.0),
        "compaction": bucket.get("compact", 0.0),
        "drafter": bucket.get("propose", 0.0) + bucket.get("update", 0.0),
    }
    parts["engine"] = parts["step"] - sum(v for k, v in parts.items() if k != "step")
    ms = {key: value / steps * 1e3 for key, value in parts.items()}
    rate, per_step, host_share = untimed_run(setup, make, batch, tokens)
    counts = step_counts(
        lambda n: generate(setup.model, prompts, drafter=make(), max_new_tokens=n, eos_token_id=[])
    )
    return Breakdown(
        setup.name,
        config,
        batch,
        threads,
        steps,
        ms,
        (ms["step"] - ms["forward"]) / ms["step"],
        dict(runner.compile_seconds) if runner is not None else {},
        rate,
        per_step,
        host_share,
        eager_ops_per_step=counts.ops_per_step,
        reads_per_step=counts.reads_per_step,
    )


def untimed_run(setup: Model, make, batch: int, tokens: int) -> tuple[float, float, float]:
    """Tokens/s and tokens per sequence-step of one `generate` with no timer inside its step but
    the read-back's, and the host's share of the call: the call less the time spent waiting in
    `transfer.to_host` (on a GPU the read-back waits for the device's queue to drain)."""
    waited = [0.0]
    read = transfer.to_host

    def timed_read(tensor, landed=None):
        start = time.perf_counter()
        try:
            return read(tensor, landed)
        finally:
            waited[0] += time.perf_counter() - start

    with ExitStack() as stack:
        patch_everywhere(stack, read, timed_read)
        prompts = setup.prompts[:batch]
        out = generate(setup.model, prompts, drafter=make(), max_new_tokens=tokens, eos_token_id=[])
    stats = out.stats
    return (
        stats.new_tokens / stats.wall_time,
        stats.mean_accepted_per_step,
        1 - waited[0] / stats.wall_time,
    )


# ---------------------------------------------------------------- main


def fmt_breakdown(records: list[Breakdown]) -> str:
    keys = ("step", "forward", "sampler", "compaction", "drafter", "engine")
    lines = [
        "| model | config | batch | threads | "
        + " | ".join(f"{k} ms" for k in keys)
        + " | overhead | host | tokens/s | vs plain | tokens/step | eager ops | reads |",
        "|---|---|---|---|" + "---|" * (len(keys) + 7),
    ]
    for r in records:
        cells = " | ".join(f"{r.ms_per_step[k]:.3f}" for k in keys)
        vs_plain = "-" if r.vs_plain is None else f"{r.vs_plain:.2f}x"
        lines.append(
            f"| {r.model} | {r.config} | {r.batch} | {r.threads} | {cells} "
            f"| {r.overhead_share:.1%} | {r.host_share:.0%} | {r.tokens_per_s:.1f} | {vs_plain} "
            f"| {r.tokens_per_step:.2f} | {r.eager_ops_per_step:.1f} | {r.reads_per_step:.2f} |"
        )
    return "\n".join(lines)


def fmt_comparisons(records: list[Comparison]) -> str:
    lines = [
        "| model | config | batch | threads | ours tok/s | peer | peer tok/s | ratio | target "
        "| met | identical |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        lines.append(
            f"| {r.model} | {r.config} | {r.batch} | {r.threads} | {r.ours_tokens_per_s:.1f} "
            f"| {r.peer} | {r.peer_tokens_per_s:.1f} | {r.ratio:.2f}x | >= {r.target:.2f}x "
            f"| {'yes' if r.met else 'NO'} | {r.identical} |"
        )
    return "\n".join(lines)


def run_size(tiny: bool, quick: bool) -> tuple[int, int]:
    """Alternating repeats and new tokens per run (`--tiny`, `--quick`, or the full run)."""
    return (2, 16) if tiny else (3, 48) if quick else (5, 96)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 repeats, fewer tokens")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer random model (CI)")
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    parser.add_argument("--repeats", type=int, default=None, help="alternating repeats (>= 5)")
    parser.add_argument("--models", default=None, help="comma-separated model names to keep")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    device = bench_device()
    repeats, tokens = run_size(args.tiny, args.quick)
    repeats = args.repeats or repeats
    setups = models(args.tiny, max(BATCHES), device)
    if args.models:
        setups = [setup for setup in setups if setup.name in args.models.split(",")]
    comparisons, breakdowns = [], []
    thread_counts = [int(t) for t in args.threads.split(",")]
    if device.type == "cuda":  # one pass: the host's thread count is not what a GPU run varies
        thread_counts = thread_counts[:1]
    for threads in thread_counts:
        torch.set_num_threads(threads)
        for setup in setups:
            # (label, drafter maker, batches); plain decoding first: the others' reference.
            configs = [("plain", lambda: None, BATCHES)]
            configs.append(
                (f"ngram N={NGRAM_NODES}", lambda: NGramDrafter(max_nodes=NGRAM_NODES), BATCHES)
            )
            if setup.name == "tiny-code" and BLOCK_SPEC.path in bundled.available():
                # The registry's factory loads the head once; each call builds a drafter.
                configs.append(
                    (f"dflash N={BLOCK_SPEC.size}", BLOCK_SPEC.factory(setup.model), BATCHES)
                )
            if setup.name == "tiny-code" and device.type == "cuda":
                configs += [
                    (spec.label(spec.size), spec.factory(setup.model), GPU_BATCHES)
                    for spec in gpu_specs(args.quick)
                ]
            for batch in BATCHES:
                plain_rate = None
                for config, make, batches in configs:
                    if batch not in batches:
                        continue
                    record = breakdown(setup, config, make, batch, threads, tokens)
                    plain_rate = plain_rate or record.tokens_per_s
                    record.vs_plain = record.tokens_per_s / plain_rate
                    breakdowns.append(record)
                    print(fmt_breakdown([record]).splitlines()[-1], flush=True)
                plain = ours(setup, lambda: None, batch, tokens)
                peer = hf(setup, batch, tokens)
                target = 1.1 if batch == 1 else 1.0
                comparisons.append(
                    compare(
                        setup.name,
                        "plain",
                        batch,
                        threads,
                        plain,
                        "HF generate",
                        peer,
                        target,
                        tokens,
                        repeats,
                    )
                )
                print(fmt_comparisons(comparisons[-1:]).splitlines()[-1], flush=True)
            lookup = hf(setup, 1, tokens, prompt_lookup_num_tokens=HF_PROMPT_LOOKUP_TOKENS)
            for nodes, depth in NGRAM_VS_LOOKUP:
                label = f"ngram N={nodes}" + (f" depth {depth}" if depth else "")
                ngram = ours(
                    setup,
                    lambda n=nodes, d=depth: NGramDrafter(max_nodes=n, max_depth=d),
                    1,
                    tokens,
                )
                comparisons.append(
                    compare(
                        setup.name,
                        label,
                        1,
                        threads,
                        ngram,
                        "HF prompt lookup",
                        lookup,
                        1.15,
                        tokens,
                        repeats,
                    )
                )
                print(fmt_comparisons(comparisons[-1:]).splitlines()[-1], flush=True)
            if setup.draft is not None:
                chain = ours(
                    setup,
                    lambda d=setup.draft: DraftModelDrafter(d, num_tokens=DRAFT_CHAIN),
                    1,
                    tokens,
                )
                assisted = hf(setup, 1, tokens, assistant_model=setup.draft)
                comparisons.append(
                    compare(
                        setup.name,
                        f"draft chain k={DRAFT_CHAIN}",
                        1,
                        threads,
                        chain,
                        "HF assisted",
                        assisted,
                        1.1,
                        tokens,
                        repeats,
                    )
                )
                print(fmt_comparisons(comparisons[-1:]).splitlines()[-1], flush=True)
    print("\n## Step breakdown (ms per step)\n")
    print(fmt_breakdown(breakdowns))
    print("\n## Against HF (medians of alternating repeats)\n")
    print(fmt_comparisons(comparisons))
    env = environment(device)
    write_results(
        args.json or RESULTS_DIR / f"overhead-{'tiny' if args.tiny else device.type}.json",
        "bench_overhead",
        env,
        [asdict(r) | {"met": r.met} for r in comparisons],
        breakdown=[asdict(r) for r in breakdowns],
        tokens=tokens,
        repeats=repeats,
    )


if __name__ == "__main__":
    main()
