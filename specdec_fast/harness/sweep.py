"""The benchmark sweep: a plain-decoding baseline, then one cell per (drafter, size, batch).

Every cell decodes the whole prompt set with `generate`, `batch` prompts at a time (prompts are
grouped by `max_new_tokens` first, in file order), taking turns chunk by chunk with plain decoding
of the same prompts (a paired measurement, robust to a machine whose speed drifts), and is compared
with that baseline: speed-up of tokens/s and of TPOT, exact match of greedy outputs, quality
checks (a greedy divergence is told apart as a near-tie when the target's logits of the two
tokens at the first differing position, under the baseline's context, are closer than
`BenchConfig.near_tie_gap`). Plain decoding paired with itself gives each batch size's noise.
Adaptive cells (one `AdaptiveDrafter` around the largest size of each drafter, with a calibrated
`CostModel`, serving the whole concurrency sweep as it would serve a service's traffic) run at
every batch size; the report shows their ratio to the baseline next to the noise.

The sweep records every failed request with its error (`failed_requests`), warm-ups included,
and goes on; `bench` then fails (`harness.FailedRequests`). The compile rule and the ETA are
`harness.plan`'s.
"""

from __future__ import annotations

import resource
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from specdec_fast.adaptive import BUDGETS, PLAIN, AdaptiveDrafter, CostModel
from specdec_fast.compiled import COMPILE_LOG, compile_choice
from specdec_fast.drafters.base import Drafter
from specdec_fast.drafters.registry import DrafterSpec
from specdec_fast.engine import GenerateOutput, generate
from specdec_fast.guardrails import Guardrails
from specdec_fast.harness.checks import passes
from specdec_fast.harness.plan import (
    CompileChoice,
    Eta,
    cell_steps,
    choose_compile,
    step_shapes,
)
from specdec_fast.harness.prompts import PromptRecord
from specdec_fast.stats import SequenceStats, SpecStats, percentile
from specdec_fast.text import decode, encode_prompt, stop_token_ids, use_chat

# Output-length and prompt-length buckets (tokens) of the report's splits.
OUTPUT_BUCKETS = ((32, "<=32"), (128, "33-128"), (512, "129-512"))
PROMPT_BUCKETS = ((128, "<=128"), (512, "129-512"), (2048, "513-2048"))
# A greedy divergence whose two tokens' logits differ by less than this is a near-tie: a flip
# that reduction order alone can cause (a bf16 logit near 10 is only resolved to 0.06).
NEAR_TIE_GAP = 0.1


@dataclass
class BenchConfig:
    """What to sweep.

    drafters: drafter SPECs (see `specdec_fast.drafters.registry`).
    sizes: chain lengths k, the tokens drafted per step: a chain drafter (`draft:PATH`) drafts a
        chain of k, a tree drafter a tree of N = k + 1 nodes (root included).
    trees: tree budgets N (root included), which turn a chain kind into its tree kind
        (`draft:PATH` into `draft-tree:PATH`).
    batches: concurrency levels (prompts decoded together).
    adaptive: also run an `AdaptiveDrafter` cell per drafter and batch.
    max_new_tokens: default for prompts without their own.
    price_per_hour: device price, for the cost per 1K output tokens.
    repeats: runs of the prompt set per cell; each chunk's fastest run counts (the least
        disturbed by other load).
    noise_floor: the smallest relative noise assumed; the noise of a batch size is how far
        plain decoding paired with itself strays from a ratio of 1.
    chat: apply the tokenizer's chat template (None: when it has one; see `specdec_fast.text`).
    keep_special_tokens: keep special tokens in the decoded outputs that checks judge.
    exact: decode in exact mode (`generate(..., exact=True)`): every greedy output must then
        equal the baseline's.
    compile: compile the steps (None: decided by `decide_compile`, printed at the start).
    near_tie_gap: the logit gap under which a greedy divergence counts as a near-tie.
    """

    drafters: list[str]
    sizes: list[int] = field(default_factory=lambda: [1, 2, 3])
    trees: list[int] = field(default_factory=list)
    batches: list[int] = field(default_factory=lambda: [1, 4])
    adaptive: bool = True
    max_new_tokens: int = 64
    price_per_hour: float | None = None
    repeats: int = 1
    noise_floor: float = 0.05
    seed: int = 0
    warmup: bool = True
    guardrails: Guardrails | None = None
    chat: bool | None = None
    keep_special_tokens: bool = False
    exact: bool = False
    compile: bool | None = None
    near_tie_gap: float = NEAR_TIE_GAP

    def __post_init__(self) -> None:
        # A value given twice is one point of the grid (as sizes and trees are), in the order
        # first given: a repeated drafter or batch would run its cells twice.
        self.drafters = list(dict.fromkeys(self.drafters))
        self.batches = list(dict.fromkeys(self.batches))

    def cells(self) -> list[tuple[str, DrafterSpec, int, bool]]:
        """(name, spec, size, adaptive) of every speculative cell, batch excluded; `size` is the
        spec's own (k for chains, N for trees, as in the name `draft:PATH:k`, `ngram:N`). A SPEC
        with its own size (`suffix:16`) is one configuration; the others sweep `sizes` and
        `trees`."""
        out = []
        for text in self.drafters:
            parsed = DrafterSpec.parse(text)
            if parsed.info is None:
                raise ValueError(
                    f"drafters: {text!r} is plain decoding, the baseline of every cell"
                )
            spec = parsed.with_size(None)
            tree_spec = DrafterSpec(parsed.info.tree_kind or spec.kind, spec.path, None, spec.graft)
            # A chain length k: k drafted tokens, which a tree drafter spends on N = k + 1 nodes.
            chain = parsed.info.chain
            grid = [(spec, k if chain else k + 1) for k in sorted(set(self.sizes))]
            grid += [(tree_spec, n) for n in sorted(set(self.trees))]
            if parsed.size is not None:
                grid = [(spec, parsed.size)]
            # Named by the spec at the size (a grafted lookup's after it): `--drafter` takes it.
            out += [(str(s.with_size(size)), s, size, False) for s, size in grid]
            if self.adaptive:
                top, largest = max(grid, key=lambda cell: cell[0].nodes(cell[1]))
                out.append((f"adaptive({top.with_size(largest)})", top, largest, True))
        return out


@dataclass
class Encoded:
    record: PromptRecord
    index: int
    ids: list[int]
    max_new_tokens: int


@dataclass
class CellRun:
    """The raw outcome of decoding the prompt set once."""

    stats: SpecStats
    outputs: dict[int, list[int] | None]  # prompt index -> generated tokens (None: failed)
    sequences: dict[int, SequenceStats]
    errors: dict[int, str]
    wall_s: float  # compilations excluded
    steps: int = 0  # verify steps of its `generate` calls (each call: its longest row's)
    budgets: list[int] = field(default_factory=list)  # adaptive cells: every step's budget
    explorations: int = 0  # adaptive cells: requests that explored


def encode_prompts(
    records: list[PromptRecord],
    tokenizer,
    max_new_tokens: int,
    chat: bool | None = None,
    max_positions: int | None = None,
) -> list[Encoded]:
    """Token ids of every record (`specdec_fast.text.encode_prompt`); errors name the record,
    one longer than the model's `max_positions` included (before anything runs)."""
    out = []
    for index, record in enumerate(records):
        try:
            ids = encode_prompt(tokenizer, record.prompt, record.messages, chat)
        except ValueError as error:
            raise ValueError(f"prompt {record.id!r}: {error}") from None
        if max_positions is not None and len(ids) > max_positions:
            raise ValueError(
                f"prompt {record.id!r}: {len(ids)} tokens, more than the model's "
                f"max_position_embeddings = {max_positions}"
            )
        out.append(Encoded(record, index, ids, record.max_new_tokens or max_new_tokens))
    return out


def batches_of(prompts: list[Encoded], batch: int) -> list[list[Encoded]]:
    """Chunks of `batch` prompts sharing `max_new_tokens`, in file order within a length."""
    by_length: dict[int, list[Encoded]] = {}
    for prompt in prompts:
        by_length.setdefault(prompt.max_new_tokens, []).append(prompt)
    return [
        group[i : i + batch]
        for _, group in sorted(by_length.items())
        for i in range(0, len(group), batch)
    ]


@dataclass
class _Chunk:
    """One `generate` call: its wall time less the compilations it made, and its output, or the
    error it raised."""

    wall: float
    out: GenerateOutput | None = None
    error: str | None = None


def describe_error(error: BaseException) -> str:
    """`Type: message (file:line in function)`, the frame that raised it: a failed request's
    entry in the report, enough to find its cause."""
    text = f"{type(error).__name__}: {error}"
    frames = traceback.extract_tb(error.__traceback__)
    if frames:
        where = frames[-1]
        text += f" ({Path(where.filename).name}:{where.lineno} in {where.name})"
    return text


def _decode_chunk(
    model,
    chunk: list[Encoded],
    drafter: Drafter | None,
    seed: int,
    stop: list[int] | None,
    exact: bool,
) -> _Chunk:
    compiled_before = len(COMPILE_LOG)
    start = time.perf_counter()
    try:
        with torch.no_grad():
            out = generate(
                model,
                [p.ids for p in chunk],
                drafter=drafter,
                max_new_tokens=chunk[0].max_new_tokens,
                temperature=[p.record.temperature for p in chunk],
                seed=[seed + p.index for p in chunk],
                eos_token_id=stop,
                exact=exact,
            )
    except Exception as error:  # noqa: BLE001 - a failed request is reported, then fails the run
        wall = time.perf_counter() - start - compile_since(compiled_before)
        return _Chunk(wall, error=describe_error(error))
    return _Chunk(time.perf_counter() - start - compile_since(compiled_before), out)


def compile_since(index: int) -> float:
    """Seconds of the compilations logged since `COMPILE_LOG[index]`."""
    return sum(seconds for _, seconds in COMPILE_LOG[index:])


def _merge(model, chunks: list[list[Encoded]], results: list[_Chunk], drafter) -> CellRun:
    outputs: dict[int, list[int] | None] = {}
    sequences: dict[int, SequenceStats] = {}
    errors: dict[int, str] = {}
    merged = SpecStats(
        drafter=repr(drafter) if drafter is not None else None, memory_device=model.device.type
    )
    for chunk, result in zip(chunks, results, strict=True):
        if result.out is None:
            for p in chunk:
                outputs[p.index] = None
                errors[p.index] = result.error
            continue
        stats = result.out.stats
        for p, sequence, seq_stats in zip(
            chunk, result.out.sequences, stats.sequences, strict=True
        ):
            outputs[p.index] = sequence[len(p.ids) :].tolist()
            sequences[p.index] = seq_stats
        merged.sequences.extend(stats.sequences)
        merged.fallbacks += stats.fallbacks
        if stats.peak_memory_bytes is not None:
            merged.peak_memory_bytes = max(merged.peak_memory_bytes or 0, stats.peak_memory_bytes)
    merged.wall_time = sum(result.wall for result in results)
    steps = sum(result.out.stats.steps for result in results if result.out is not None)
    return CellRun(merged, outputs, sequences, errors, merged.wall_time, steps)


def decode_paired(
    model,
    prompts: list[Encoded],
    batch: int,
    drafters: list[Drafter | None],
    seed: int,
    repeats: int = 1,
    stop: list[int] | None = None,
    exact: bool = False,
) -> list[CellRun]:
    """Decode every prompt `batch` at a time once per drafter (None: plain), the drafters taking
    turns chunk by chunk, so that all of them meet the same machine conditions (a paired
    measurement: drift and other load cancel out of their ratios).

    Each drafter instance serves all its chunks (its state carries over, as in a service). With
    `repeats`, each chunk keeps its fastest run per drafter; a chunk that fails in any run counts
    its prompts as errors (the sweep goes on). `stop`: EOS ids (None: the model's own); `exact`:
    exact mode."""
    chunks = batches_of(prompts, batch)
    best: list[list[_Chunk | None]] = [[None] * len(chunks) for _ in drafters]
    for _ in range(repeats):
        for index, chunk in enumerate(chunks):
            for side, drafter in enumerate(drafters):
                result = _decode_chunk(model, chunk, drafter, seed, stop, exact)
                kept = best[side][index]
                if kept is None or (
                    kept.error is None and (result.error or result.wall < kept.wall)
                ):
                    best[side][index] = result
    return [
        _merge(model, chunks, results, drafter)
        for results, drafter in zip(best, drafters, strict=True)
    ]


def cell_metrics(run: CellRun, requests: int, price_per_hour: float | None) -> dict:
    """The headline figures of one run (SpecStats summary plus rates, errors and cost)."""
    summary = run.stats.summary()
    # The merged statistics' own `steps` is one call's (its longest row's): the run made several.
    summary["steps"] = run.steps
    new_tokens = summary["new_tokens"]
    summary["requests_per_second"] = requests / run.wall_s if run.wall_s else None
    summary["error_rate"] = len(run.errors) / requests if requests else 0.0
    summary["cost_per_1k_output_tokens"] = (
        price_per_hour / 3600.0 * run.wall_s / new_tokens * 1000.0
        if price_per_hour is not None and new_tokens
        else None
    )
    summary["host_peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return summary


def _bucket(value: int, buckets) -> str:
    for bound, label in buckets:
        if value <= bound:
            return label
    return f">{buckets[-1][0]}"


def split_keys(prompt: Encoded) -> dict[str, str]:
    record = prompt.record
    return {
        "task": record.task,
        "output_length": _bucket(prompt.max_new_tokens, OUTPUT_BUCKETS),
        "temperature": "greedy" if record.temperature == 0 else f"t={record.temperature:g}",
        "prompt_length": _bucket(len(prompt.ids), PROMPT_BUCKETS),
    }


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def split_metrics(prompts: list[Encoded], run: CellRun, baseline: CellRun) -> dict:
    """Per split kind and value: acceptance, tokens per step, TPOT p50 and the TPOT speed-up
    against the baseline's sequences of the same split."""
    groups: dict[str, dict[str, list[int]]] = {}
    for prompt in prompts:
        for kind, value in split_keys(prompt).items():
            groups.setdefault(kind, {}).setdefault(value, []).append(prompt.index)
    out: dict[str, dict] = {}
    for kind, values in groups.items():
        out[kind] = {}
        for value, indices in sorted(values.items()):
            seqs = [run.sequences[i] for i in indices if i in run.sequences]
            base = [baseline.sequences[i] for i in indices if i in baseline.sequences]
            stats = SpecStats(sequences=seqs)
            tpot = [s.tpot for s in seqs if s.tpot is not None]
            base_tpot = [s.tpot for s in base if s.tpot is not None]
            out[kind][value] = {
                "prompts": len(indices),
                "acceptance_rate": stats.acceptance_rate,
                "mean_accepted_tokens_per_step": stats.mean_accepted_per_step,
                "tpot_p50_s": percentile(tpot, 50),
                "speedup_tpot": _mean(base_tpot) / _mean(tpot) if tpot and base_tpot else None,
            }
    return out


def _detok(tokenizer, tokens: list[int] | None, keep_special_tokens: bool) -> str | None:
    return None if tokens is None else decode(tokenizer, tokens, keep_special_tokens)


def logit_gap(model, context: list[int], first: int, second: int) -> float:
    """|logit(first) - logit(second)| of the target's next-token logits after `context` (one
    plain HF forward, fp32 logits)."""
    ids = torch.tensor([context], device=model.device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, -1].float()
    return abs(float(logits[first] - logits[second]))


def quality(
    prompts: list[Encoded],
    run: CellRun,
    baseline: CellRun,
    tokenizer,
    keep_special_tokens: bool = False,
    model=None,
    near_tie_gap: float = NEAR_TIE_GAP,
) -> dict:
    """Greedy exact match against the baseline, check pass counts, and every divergence (checks
    judge the outputs decoded without special tokens unless `keep_special_tokens`). With the
    target `model`, each greedy divergence gets the logit gap of its two tokens at the first
    differing position under the baseline's context, and counts as a near-tie below
    `near_tie_gap` (a divergence where one output stopped has no gap: it counts as real)."""
    pairs, contexts = [], []
    for prompt in prompts:
        ours, theirs = run.outputs.get(prompt.index), baseline.outputs.get(prompt.index)
        if ours is None or theirs is None:
            continue
        texts = [_detok(tokenizer, tokens, keep_special_tokens) for tokens in (ours, theirs)]
        pairs.append((prompt.record, ours, theirs, *texts))
        contexts.append(prompt.ids)
    return compare_outputs(pairs, model, contexts, near_tie_gap)


def compare_outputs(pairs, model=None, contexts=None, near_tie_gap: float = NEAR_TIE_GAP) -> dict:
    """`quality`'s figures over (record, ours, theirs, ours_text, theirs_text) pairs: outputs
    (token lists or texts) compared for equality, texts judged by the record's check. With the
    target `model` and each pair's prompt ids (`contexts`), greedy token divergences get their
    logit gap and near-tie verdict (see `quality`)."""
    divergences, greedy, equal = [], 0, 0
    checked, base_pass, cell_pass, regressions = 0, 0, 0, 0
    near_ties = 0
    for index, (record, ours, theirs, ours_text, theirs_text) in enumerate(pairs):
        regressed = False
        if record.check is not None:
            checked += 1
            was = passes(record.check, theirs_text, theirs_text)
            now = passes(record.check, ours_text, theirs_text)
            base_pass += was
            cell_pass += now
            regressed = was and not now
            regressions += regressed
        greedy_row = record.temperature == 0
        greedy += greedy_row
        same = ours == theirs
        equal += greedy_row and same
        if (greedy_row and not same) or regressed:
            first = next(
                (i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b),
                min(len(ours), len(theirs)),
            )
            gap = None
            if model is not None and not same and first < min(len(ours), len(theirs)):
                context = contexts[index] + list(theirs[:first])
                gap = logit_gap(model, context, theirs[first], ours[first])
            near_tie = gap is not None and gap < near_tie_gap
            near_ties += near_tie
            divergences.append(
                {
                    "prompt_id": record.id,
                    "task": record.task,
                    "prompt": record.text,
                    "baseline_output": theirs_text,
                    "speculative_output": ours_text,
                    "first_differing_token": first,
                    "greedy": greedy_row,
                    "quality_regression": regressed,
                    "logit_gap": gap,
                    "near_tie": near_tie,
                }
            )
    return {
        "greedy_prompts": greedy,
        "greedy_exact_matches": equal,
        "checked_prompts": checked,
        "baseline_check_passes": base_pass,
        "speculative_check_passes": cell_pass,
        "quality_regressions": regressions,
        "near_tie_gap": near_tie_gap,
        "near_tie_divergences": near_ties,
        "real_divergences": len(divergences) - near_ties,
        "divergences": divergences,
    }


def guardrail_verdict(guardrails: Guardrails, cell: dict, baseline: dict, splits: dict) -> dict:
    """Would each task's route policy (the default policy for the cell overall) let this cell
    speculate? Lists the bounds each would break. A task's route is judged on its acceptance;
    TPOT, errors and quality on the cell's requests together (the "all" row). A policy whose
    `fallback_action` is "log_only" keeps speculating, its broken bounds listed."""
    verdicts = {}
    routes = {"all": (guardrails.default, cell, None)}
    for task, figures in splits.get("task", {}).items():
        routes[task] = (guardrails.policy(task), figures, task)
    for route, (policy, figures, task) in routes.items():
        broken = []
        rate = figures.get("acceptance_rate")
        if rate is not None and rate < policy.min_acceptance_rate:
            broken.append(f"acceptance {rate:.3f} < {policy.min_acceptance_rate}")
        if task is None:
            base_p95, p95 = baseline["tpot_s"]["p95"], cell["tpot_s"]["p95"]
            if base_p95 and p95 and p95 / base_p95 - 1 > policy.max_tpot_p95_regression:
                broken.append(f"TPOT p95 {p95 / base_p95 - 1:+.1%}")
            if cell["error_rate"] > policy.max_error_rate:
                broken.append(f"error rate {cell['error_rate']:.3f}")
            if cell["quality_regressions"] > policy.max_quality_regression_cases:
                broken.append(f"{cell['quality_regressions']} quality regressions")
        speculate = not broken or policy.fallback_action == "log_only"
        verdicts[route] = {"speculate": speculate, "broken": broken}
    return verdicts


def run_sweep(
    model,
    tokenizer,
    records: list[PromptRecord],
    config: BenchConfig,
    make_drafter: Callable[[DrafterSpec, int], Drafter | None] | None = None,
    progress: bool = True,
) -> dict:
    """Run the whole sweep and return the report as a JSON-ready dict (see `harness.report`).

    make_drafter(spec, size): builds a drafter for the target (default: the spec's factory,
    which loads each spec's checkpoint once), called once per cell before anything runs
    (`build_drafters`); the cell's drafter serves each of its batch sizes. Cells run batch size
    by batch size, each drafter's sizes together, so that a compiled step shape (batch 1 or
    more, each drafter's trees) is compiled by the first cell that meets it and reused by the
    others; each cell's shapes are warmed once, outside the timed runs, and compilation is
    reported apart from measured time.
    A failed request is recorded with its error (`failed_requests`); the sweep goes on."""
    if make_drafter is None:
        factories: dict[DrafterSpec, Callable] = {}

        def make_drafter(spec: DrafterSpec, size: int) -> Drafter | None:
            if spec not in factories:
                factories[spec] = spec.factory(model)
            return factories[spec](size)

    def say(line: str) -> None:
        if progress:
            print(f"bench: {line}", file=sys.stderr, flush=True)

    positions = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
    prompts = encode_prompts(records, tokenizer, config.max_new_tokens, config.chat, positions)
    stop = stop_token_ids(model, tokenizer)
    cells = config.cells()
    drafters = build_drafters(cells, make_drafter)
    # Batch size by batch size, each one's baseline (None) first.
    schedule = [(batch, cell) for batch in config.batches for cell in [None, *cells]]
    runs = 2 * config.repeats  # every cell is paired with plain decoding
    eta = Eta(
        [
            (batch, cell_steps([c[0].max_new_tokens for c in batches_of(prompts, batch)], runs))
            for batch, _ in schedule
        ]
    )
    choice = decide_compile(model, prompts, config, cells, eta)
    say(choice.rule)
    started = time.perf_counter()
    with compile_choice(choice.compile):
        report = _run_cells(
            model,
            tokenizer,
            prompts,
            config,
            cells,
            schedule,
            drafters,
            eta,
            stop,
            say,
            choice.compile,
        )
    report["timing"] |= {
        "compile_choice": asdict(choice),
        "total_s": time.perf_counter() - started,
    }
    failed = report["failed_requests"]
    say(
        f"{len(schedule)} cells in {report['timing']['total_s']:.0f} s "
        f"({report['timing']['measured_s']:.0f} s measured, "
        f"{report['timing']['compile_s']:.0f} s compiling), {len(failed)} failed requests"
    )
    return report


def build_drafters(
    cells: list, make_drafter: Callable[[DrafterSpec, int], Drafter | None]
) -> dict[str, Drafter]:
    """Every cell's drafter by cell name (an adaptive cell's wrapped in its `AdaptiveDrafter`
    later), built before anything is timed: a size that a drafter refuses (a block chain longer
    than the block's positions) fails the sweep at its start, every such cell named, rather than
    after the cells before it have run. Cells refused for one reason (a checkpoint that does not
    load refuses every size) are named together, with the reason once."""
    built, refused = {}, {}
    sized, failed = set(), set()  # drafters (specs without their size) built / refused
    for name, spec, size, _ in cells:
        drafter = str(spec.with_size(None))
        try:
            built[name] = make_drafter(spec, size)
            sized.add(drafter)
        except ValueError as error:
            refused.setdefault(str(error), []).append(name)
            failed.add(drafter)
    if refused:
        # A drafter that builds at some sizes and not at others: the grid asks too much of it.
        hint = (
            " (leave those sizes out of the grid, or give the drafter spec its own size)"
            if sized & failed
            else ""
        )
        reasons = "; ".join(f"{', '.join(names)}: {message}" for message, names in refused.items())
        raise ValueError(f"these cells' drafters cannot be built{hint}: {reasons}")
    return built


# Tokens of the eager probe that decides whether a CPU sweep compiles.
PROBE_TOKENS = 16


def decide_compile(
    model, prompts: list[Encoded], config: BenchConfig, cells: list, eta: Eta
) -> CompileChoice:
    """`config.compile` when given; eager in exact mode; compiled on a GPU; on the CPU, by the
    measured cost of an eager step (`plan.choose_compile`). The probe step is timed in CPU
    seconds, as the compilations are counted: on a machine shared with other jobs both stretch
    alike in wall time, and the decision does not swing with the load."""
    if config.exact:
        return CompileChoice(False, "exact mode: eager steps")
    if config.compile is not None:
        return CompileChoice(config.compile, f"compile={config.compile} (given)")
    if model.device.type != "cpu":
        return CompileChoice(True, f"{model.device.type}: compiled steps")
    probe = [prompts[0].ids]
    with torch.no_grad():
        # The first eager call pays one-off costs (the attention switch, allocations).
        generate(model, probe, drafter=None, max_new_tokens=2, eos_token_id=[], compile=False)
        start = time.process_time()
        generate(
            model, probe, drafter=None, max_new_tokens=PROBE_TOKENS, eos_token_id=[], compile=False
        )
    step_s = (time.process_time() - start) / PROBE_TOKENS
    kinds = len({spec.kind for _, spec, _, _ in cells})
    return choose_compile(step_s, eta.total_steps, step_shapes(config.batches, cells, kinds))


def _run_cells(
    model, tokenizer, prompts, config, cells, schedule, drafters, eta, stop, say, compiled
):
    """The baseline and cells of `schedule` in order (`run_sweep`), under the compile choice
    (`compiled`), with each cell's drafter from `drafters` (`build_drafters`)."""
    repeats = config.repeats
    compiled_at_start = len(COMPILE_LOG)
    cost_model = None
    calibration_s = 0.0
    if any(adaptive for *_, adaptive in cells):
        largest = max(spec.nodes(size) for _, spec, size, adaptive in cells if adaptive)
        budgets = [b for b in BUDGETS if b < largest] + [largest]
        start = time.perf_counter()
        cost_model = CostModel().calibrate(model, config.batches, budgets)
        calibration_s = time.perf_counter() - start
    warmed: set[tuple] = set()
    totals = {"warmup_s": 0.0, "measured_s": 0.0}
    failed: list[dict] = []

    def warm_key(batch: int, cell: tuple | None) -> tuple:
        # Batch 1 and larger batches compile apart; larger ones share their shapes.
        return (min(batch, 2), "baseline" if cell is None else cell[0])

    def warm(key: tuple, drafter: Drafter | None, batch: int) -> float:
        """Decode the first `batch` prompts once per `warm_key`: the first call of a shape
        compiles it. Eager, a few tokens warm the caches. Compiled, the whole chunk: rows that
        finish early leave a batch of 2+ rows down to one, and a one-row step left over from a
        larger batch compiles graphs of its own (the draft model's chains compiled 60 s inside
        timed runs when the warm-up decoded 8 tokens). Its failed requests count as any other
        (their side says "warm-up"): the warm-up is where compilations, and their failures, are."""
        if not config.warmup or key in warmed:
            return 0.0
        warmed.add(key)
        start = time.perf_counter()
        chunk = prompts[:batch] if compiled else [replace_tokens(p, 8) for p in prompts[:batch]]
        (run,) = decode_paired(model, chunk, batch, [drafter], 0, stop=stop, exact=config.exact)
        side = "plain warm-up" if drafter is None else "speculative warm-up"
        failed.extend(_failures(chunk, key[1], batch, [run], (side,)))
        return time.perf_counter() - start

    def finished(label: str, batch: int, warm_s: float, runs: list[CellRun], log: tuple) -> dict:
        """Log the cell's line and return its timing; `log`: the `COMPILE_LOG` indices before
        and after its warm-up."""
        compiled, warmed_at = log
        measured = sum(run.wall_s for run in runs)
        timing = {
            "warmup_s": warm_s,
            "compile_s": compile_since(compiled),
            # Compilations inside the timed runs: shapes the warm-up did not meet (left out of
            # `measured_s`, but in the per-token latencies of the step that compiled).
            "timed_compile_s": compile_since(warmed_at),
            "measured_s": measured,
        }
        totals["warmup_s"] += warm_s
        totals["measured_s"] += measured
        eta.finished(measured, warm_s)
        pending = {warm_key(b, c) for b, c in schedule[eta.done :]} - warmed
        left = eta.seconds_left(len(pending) if config.warmup else 0)
        errors = sum(len(run.errors) for run in runs)
        say(
            f"{eta.done}/{len(schedule)} {label} b={batch}: {measured:.1f} s measured, "
            f"warm-up {warm_s:.1f} s, compiling {timing['compile_s']:.1f} s "
            f"({timing['timed_compile_s']:.1f} s of it in timed runs)"
            + (f", {errors} FAILED requests" if errors else "")
            + (f"; eta {left:.0f} s" if left is not None and eta.done < len(schedule) else "")
        )
        return timing

    baseline_metrics: dict[int, dict] = {}
    noise: dict[int, float] = {}
    adaptive_drafters: dict[str, AdaptiveDrafter] = {}
    report_cells = []
    for batch, cell in schedule:
        compiled = len(COMPILE_LOG)
        if cell is None:
            warm_s = warm(warm_key(batch, None), None, batch)
            log = (compiled, len(COMPILE_LOG))
            # Plain against plain, paired like every cell: how far from 1.0 a ratio strays by
            # chance is the noise that every speed-up at this batch size is judged against.
            baseline, again = decode_paired(
                model, prompts, batch, [None, None], config.seed, repeats, stop, config.exact
            )
            failed += _failures(prompts, "baseline", batch, [baseline, again])
            rates = [baseline.stats.tokens_per_second or 0.0, again.stats.tokens_per_second or 0.0]
            noise[batch] = max(config.noise_floor, abs(1.0 - min(rates) / max(max(rates), 1e-9)))
            metrics = cell_metrics(baseline, len(prompts), config.price_per_hour)
            metrics["plain_vs_plain_tokens_per_second"] = rates
            metrics["timing"] = finished("baseline", batch, warm_s, [baseline, again], log)
            baseline_metrics[batch] = metrics
            continue
        name, spec, size, adaptive = cell
        if adaptive:
            # One adaptive drafter serves the whole concurrency sweep, as one would serve a
            # service's traffic: what it learned at one batch size carries over.
            if name not in adaptive_drafters:
                adaptive_drafters[name] = AdaptiveDrafter(drafters[name], cost_model)
            drafter = adaptive_drafters[name]
        else:
            drafter = drafters[name]
        warm_s = warm(warm_key(batch, cell), drafter, batch)
        log = (compiled, len(COMPILE_LOG))
        warm_steps = len(drafter.chosen) if adaptive else 0
        warm_explorations = drafter.explorations if adaptive else 0
        reference, run = decode_paired(
            model, prompts, batch, [None, drafter], config.seed, repeats, stop, config.exact
        )
        failed += _failures(prompts, name, batch, [reference, run])
        if adaptive:
            run.budgets = drafter.chosen[warm_steps:]
            run.explorations = drafter.explorations - warm_explorations
        timing = finished(name, batch, warm_s, [reference, run], log)
        record = _cell_record(
            name, spec, size, adaptive, batch, prompts, run, tokenizer, config, reference, model
        )
        record["timing"] = timing
        report_cells.append(record)
    return {
        "config": {
            "drafters": config.drafters,
            "sizes": config.sizes,
            "trees": config.trees,
            "batches": config.batches,
            "adaptive": config.adaptive,
            "max_new_tokens": config.max_new_tokens,
            "price_per_hour": config.price_per_hour,
            "repeats": config.repeats,
            "noise_floor": config.noise_floor,
            "seed": config.seed,
            "chat": use_chat(tokenizer, config.chat),
            "keep_special_tokens": config.keep_special_tokens,
            "exact": config.exact,
            "near_tie_gap": config.near_tie_gap,
        },
        "prompts": [p.record.to_dict() | {"prompt_tokens": len(p.ids)} for p in prompts],
        "noise": {str(b): n for b, n in noise.items()},
        # The calls each concurrency made: prompts decode together only with others of the
        # same max_new_tokens, so a group smaller than the concurrency runs at its own size.
        "formed_batches": {
            str(b): [len(chunk) for chunk in batches_of(prompts, b)] for b in config.batches
        },
        "baseline": {str(b): m for b, m in baseline_metrics.items()},
        "cost_model": cost_model.to_dict() if cost_model is not None else None,
        "cells": report_cells,
        "failed_requests": failed,
        "guardrails": _policies(config.guardrails) if config.guardrails else None,
        "timing": {
            "compile_s": compile_since(compiled_at_start),
            "calibration_s": calibration_s,
            **totals,
        },
    }


def _failures(
    prompts: list[Encoded],
    cell: str,
    batch: int,
    runs: list[CellRun],
    sides: tuple[str, ...] = ("plain", "speculative"),
) -> list[dict]:
    """Every failed request of `runs` (by default a cell's paired plain run and its own; `sides`
    names each run): cell, batch, prompt, the side that failed and its error."""
    ids = {p.index: p.record.id for p in prompts}
    return [
        {
            "cell": cell,
            "batch": batch,
            "side": side,
            "prompt_id": ids[index],
            "error": error,
        }
        for side, run in zip(sides, runs, strict=True)
        for index, error in sorted(run.errors.items())
    ]


def _policies(guardrails: Guardrails) -> dict:
    return {
        "default": asdict(guardrails.default),
        "routes": {name: asdict(policy) for name, policy in guardrails.policies.items()},
    }


def replace_tokens(prompt: Encoded, max_new_tokens: int) -> Encoded:
    return Encoded(prompt.record, prompt.index, prompt.ids, max_new_tokens)


def _cell_record(
    name, spec, size, adaptive, batch, prompts, run, tokenizer, config, baseline, model
) -> dict:
    """The report entry of one cell; `baseline`: its paired plain run; `model`: the target
    (for the logit gaps of divergences)."""
    metrics = cell_metrics(run, len(prompts), config.price_per_hour)
    base_metrics = cell_metrics(baseline, len(prompts), config.price_per_hour)
    q = quality(
        prompts,
        run,
        baseline,
        tokenizer,
        config.keep_special_tokens,
        model=model,
        near_tie_gap=config.near_tie_gap,
    )
    metrics["quality_regressions"] = q["quality_regressions"]
    splits = split_metrics(prompts, run, baseline)
    base_rate = base_metrics["tokens_per_second"]
    base_tpot, tpot = base_metrics["tpot_s"]["p50"], metrics["tpot_s"]["p50"]
    record = {
        "name": name,
        "drafter": str(spec),
        "size": size,
        "nodes": spec.nodes(size),
        "batch": batch,
        "adaptive": adaptive,
        "metrics": metrics,
        "speedup": metrics["tokens_per_second"] / base_rate
        if base_rate and metrics["tokens_per_second"]
        else None,
        "speedup_tpot_p50": base_tpot / tpot if base_tpot and tpot else None,
        "paired_baseline_tokens_per_second": base_rate,
        "splits": splits,
        "quality": q,
        "errors": {str(i): e for i, e in run.errors.items()},
    }
    if adaptive:
        chosen = run.budgets
        record["adaptive_budgets"] = {
            "steps": len(chosen),
            "plain_steps": sum(1 for b in chosen if b == PLAIN),
            "mean_budget": _mean([float(b) for b in chosen]),
            "explorations": run.explorations,
        }
    if config.guardrails is not None:
        record["guardrails"] = guardrail_verdict(config.guardrails, metrics, base_metrics, splits)
    return record
