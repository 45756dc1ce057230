"""An 8B-shaped target's draft loop against its verify forward (issue 44's GPU target: the draft
loop <= 10% of the verify forward).

A Llama with random bf16 weights in Llama-3-8B's shape (bench_step.LLAMA_8B), an EAGLE-3 head and
a DFlash head (one layer, block 16) freshly initialized for it, at batch 1 over a 512-token
prompt: bench_overhead's step breakdown (ms per step: forward, sampler, compaction, drafter =
`propose` + `update`, engine) for plain decoding and each drafter at N = 8. Random weights accept
at random, so tokens per step come from the bundled pair (`--tau-json`: bench_overhead's JSON,
whose tiny-code EAGLE-3 and DFlash breakdowns at batch 1 measured them); the predicted speed-up
over plain decoding is then tau x plain step / speculative step. Without measured tokens per step,
the break-even tau (speculative step / plain step) is reported.

The memory floor of the target's share: at batch 1 a forward streams its weights, so the weight
bytes that a step's matmuls read (counted in a short eager run, `WeightReads`) set each part's
floor, and the drafter's bytes over the verify forward's are the drafter's share of the forward at
the floor. At N = 8 EAGLE-3 runs four head forwards a step (its update, then levels of 3, 6 and
9 nodes), each through the head's layer and its LM head, and its `fc` once: 20.6% of the 8B
forward's weight bytes with the published heads' 32K-token draft vocabulary (41.6% with the whole
128K), so the 10% target lies below its floor at this tree shape. DFlash reads its layer, its
`fc` and the layer's K and V projections again over the accepted context, and the target's LM
head once over the block: 10.2%, at the target. With a 32K-token draft vocabulary (the same
head's weights, `DFlashHead.set_draft_vocab`; as the real target's bundled head drafts from 8K
of its 49K ids) it reads a quarter of that LM head: `dflash-32k`, about 5%.

    python bench/bench_draft_loop.py [--tiny | --quick] [--tau-json overhead.json] [--json PATH]

`--tiny` (and any run on the CPU) uses bench_step's tiny shape: the CI smoke run.
"""

from __future__ import annotations

import argparse
import copy
import json
from collections import Counter
from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from bench_generate import random_prompts
from bench_overhead import Breakdown, Model, breakdown, fmt_breakdown, wrapped
from bench_step import DTYPE, LLAMA_8B, TINY, build_model
from common import RESULTS_DIR, bench_device, environment, write_results
from torch.utils._python_dispatch import TorchDispatchMode

from specdec_fast import BlockDrafter, EagleDrafter, generate
from specdec_fast.heads.block import DFlashHead
from specdec_fast.heads.eagle import Eagle3Head

# The tree budget of the bundled pair's breakdowns whose tokens per step stand in for acceptance.
NODES = 8
BLOCK_SIZE = 16
PROMPT = {True: 48, False: 512}  # tokens, by --tiny
NEW_TOKENS = {True: 12, False: 48}
QUICK_TOKENS = 24  # --quick (the GPU suite's quick run), on the 8B shape
# The bundled pair's breakdowns whose tokens per step stand for each drafter's acceptance (the
# bundled DFlash head's, which drafts from the whole vocabulary, for both DFlash heads).
TAU_CONFIGS = {
    "eagle3": "eagle:tiny-code-eagle3 N=8",
    "dflash": "dflash N=8",
    "dflash-32k": "dflash N=8",
}
# The EAGLE-3 head's draft vocabulary: the published heads for Llama-3.1-8B map 32K draft ids to
# the target's 128K (their `draft_vocab_size`); a smaller target keeps its whole vocabulary.
# `dflash-32k` drafts from as many ids, or from a quarter of a smaller target's.
DRAFT_VOCAB = 32000
# Drafters whose target steps are another's (the same target layers captured at the same N):
# only their head's own step compiles.
SHARED_TARGET_STEPS = ("dflash-32k",)
# New tokens of the eager run whose matmuls' weight reads are counted.
WEIGHT_TOKENS = 6
MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)


@dataclass
class DraftLoop:
    drafter: str
    plain_step_ms: float
    step_ms: float
    forward_ms: float
    drafter_ms: float
    drafter_share_of_forward: float  # the target: <= 0.10
    # The weight bytes that the drafter's matmuls read per step over the verify forward's: its
    # share of the forward at the memory floor (`WeightReads`).
    drafter_mb_per_step: float
    forward_mb_per_step: float
    floor_share_of_forward: float
    break_even_tau: float
    tau: float | None
    predicted_speedup: float | None


def measured_tau(path: Path | None) -> dict[str, float]:
    """Tokens per sequence-step of the bundled pair's EAGLE-3 and DFlash breakdowns at batch 1
    in bench_overhead's JSON (none where absent)."""
    if path is None or not path.exists():
        return {}
    records = json.loads(path.read_text()).get("breakdown", [])
    found = {}
    for name, config in TAU_CONFIGS.items():
        for record in records:
            if (record["model"], record["config"], record["batch"]) == ("tiny-code", config, 1):
                found[name] = record["tokens_per_step"]
    return found


class WeightReads(TorchDispatchMode):
    """Bytes of weights (the parameters of `modules`, and `extra` tensors: a DFlash head's rows
    of the target's LM head for its draft vocabulary) that matmuls read, by the role of the code
    that runs them (`role`, the outermost one counting): what a step streams from memory at
    batch 1, where activations and the short context's KV cache are small beside it."""

    def __init__(self, modules: list[torch.nn.Module], extra: list[torch.Tensor] = ()):
        super().__init__()
        weights = [*(p for module in modules for p in module.parameters()), *extra]
        self.weights = {weight.untyped_storage().data_ptr() for weight in weights}
        self.bytes: Counter[str] = Counter()
        self.roles: list[str] = []

    def role(self, owner, name: str, role: str) -> AbstractContextManager:
        """Count the matmuls inside `owner.name` calls to `role`."""

        @contextmanager
        def inside() -> Iterator[None]:
            self.roles.append(role)
            try:
                yield
            finally:
                self.roles.pop()

        return wrapped(owner, name, inside)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.roles and func in MATMULS:
            self.bytes[self.roles[0]] += sum(
                arg.nbytes
                for arg in args
                if isinstance(arg, torch.Tensor)
                and arg.untyped_storage().data_ptr() in self.weights
            )
        return func(*args, **(kwargs or {}))


def weight_reads(setup: Model, make, heads: list[torch.nn.Module]) -> tuple[float, float]:
    """(the drafter's, the verify forward's) weight MB per step, from an eager run (no compiled
    step, no CUDA graph: every operator dispatches, so each is seen) of `WEIGHT_TOKENS` tokens:
    the drafter's `propose` and `update`, the target runner's `verify` (a drafter's own runner
    counts as the drafter's)."""
    from specdec_fast.drafters.dflash import draft_rows
    from specdec_fast.runner import ModelRunner

    drafter = make()
    lm_head = setup.model.get_output_embeddings()
    narrow = [h for h in heads if isinstance(h, DFlashHead) and h.draft_ids is not None]
    rows = [draft_rows(head, lm_head, head.fc.weight.dtype)[1] for head in narrow]
    reads = WeightReads([setup.model, *heads], rows)
    with ExitStack() as stack:
        stack.enter_context(reads.role(ModelRunner, "verify", "forward"))
        for name in ("propose", "update"):
            stack.enter_context(reads.role(drafter, name, "drafter"))
        stack.enter_context(reads)
        out = generate(
            setup.model, setup.prompts[:1], drafter=drafter, max_new_tokens=WEIGHT_TOKENS,
            eos_token_id=[], compile=False, use_cuda_graphs=False,
        )  # fmt: skip
    steps = out.stats.steps
    return reads.bytes["drafter"] / steps / 1e6, reads.bytes["forward"] / steps / 1e6


def heads_for(target: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The EAGLE-3 head (the published draft vocabulary's size), the DFlash head, and the same
    DFlash head with a draft vocabulary (`DRAFT_VOCAB`) for `target`, freshly initialized
    (seeded), in `DTYPE` on its device."""
    device = target.device
    torch.manual_seed(0)
    vocab = target.config.vocab_size
    eagle3 = Eagle3Head.for_target(target, draft_ids=range(min(DRAFT_VOCAB, vocab)))
    eagle3 = eagle3.to(device, DTYPE).eval()
    dflash = DFlashHead.for_target(target, block_size=BLOCK_SIZE, mask_token_id=vocab - 1)
    dflash = dflash.to(device, DTYPE).eval()
    narrow = copy.deepcopy(dflash)
    narrow.set_draft_vocab(range(min(DRAFT_VOCAB, vocab // 4)))
    return {"eagle3": eagle3, "dflash": dflash, "dflash-32k": narrow}


def drafters(heads: dict[str, torch.nn.Module]) -> dict:
    return {
        "eagle3": lambda: EagleDrafter(heads["eagle3"], max_nodes=NODES),
        **{
            name: lambda head=heads[name]: BlockDrafter(head, max_nodes=NODES)
            for name in ("dflash", "dflash-32k")
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="bench_step's tiny shape (CI)")
    parser.add_argument(
        "--quick", action="store_true", help=f"{QUICK_TOKENS} new tokens a run on the 8B shape"
    )
    parser.add_argument("--tau-json", type=Path, default=None, help="bench_overhead's JSON")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    device = bench_device()
    tiny = args.tiny or device.type != "cuda"
    config = TINY if tiny else LLAMA_8B
    target = build_model(config, device)
    name = "tiny" if tiny else "Llama-3-8B-shaped"
    setup = Model(name, target, random_prompts(1, PROMPT[tiny], config["vocab_size"]))
    tokens = QUICK_TOKENS if args.quick and not tiny else NEW_TOKENS[tiny]
    heads = heads_for(target)
    records: list[Breakdown] = []
    floors = {}
    for label, make in {"plain": lambda: None, **drafters(heads)}.items():
        records.append(breakdown(setup, label, make, 1, torch.get_num_threads(), tokens))
        print(fmt_breakdown(records[-1:]).splitlines()[-1], flush=True)
        if label != "plain":
            floors[label] = weight_reads(setup, make, list(heads.values()))
    plain = records[0].ms_per_step["step"]
    for record in records:
        record.vs_plain = record.tokens_per_s / records[0].tokens_per_s
    taus = measured_tau(args.tau_json)
    loops = []
    for record in records[1:]:
        ms = record.ms_per_step
        tau = taus.get(record.config)
        drafter_mb, forward_mb = floors[record.config]
        loops.append(
            DraftLoop(
                record.config,
                plain,
                ms["step"],
                ms["forward"],
                ms["drafter"],
                ms["drafter"] / ms["forward"],
                drafter_mb,
                forward_mb,
                drafter_mb / forward_mb,
                ms["step"] / plain,
                tau,
                None if tau is None else tau * plain / ms["step"],
            )
        )
    print(f"\n## {name}: step breakdown (ms per step, batch 1, N = {NODES})\n")
    print(fmt_breakdown(records))
    print(
        "\n| drafter | drafter ms | forward ms | drafter / forward | target | weight MB drafter "
        "/ forward | floor share | step / plain step | tau (bundled pair) | predicted speed-up |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for loop in loops:
        tau = "-" if loop.tau is None else f"{loop.tau:.2f}"
        speedup = "-" if loop.predicted_speedup is None else f"{loop.predicted_speedup:.2f}x"
        print(
            f"| {loop.drafter} | {loop.drafter_ms:.3f} | {loop.forward_ms:.3f} "
            f"| {loop.drafter_share_of_forward:.1%} | <= 10% "
            f"| {loop.drafter_mb_per_step:.1f} / {loop.forward_mb_per_step:.1f} "
            f"| {loop.floor_share_of_forward:.1%} | {loop.break_even_tau:.2f} | {tau} | {speedup} |"
        )
    write_results(
        args.json or RESULTS_DIR / f"draft_loop-{'tiny' if tiny else device.type}.json",
        "bench_draft_loop",
        environment(device),
        [asdict(loop) for loop in loops],
        breakdown=[asdict(record) for record in records],
        model=name,
        new_tokens=tokens,
    )


if __name__ == "__main__":
    main()
