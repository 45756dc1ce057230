"""End-to-end generation benchmarks: our engine with each drafter against HF in one run.

Peers, all greedy on the same prompts and the same number of new tokens:
- `ours plain`: our engine without a drafter (the baseline every speed-up is measured against);
- `ours <drafter>`: our engine with that drafter;
- `..., served`: the same through the server's scheduler (`run_served`, one request at a time);
- `HF generate`: `model.generate(do_sample=False)` with the default dynamic cache;
- `HF assisted (draft model)`: `generate(assistant_model=draft)` (HF supports batch 1 only);
- `HF prompt lookup`: `generate(prompt_lookup_num_tokens=k)` (batch 1 only).
HF peers run one prompt at a time; ours runs at the requested batch size (1 for a fair comparison
with HF's assisted modes). Every peer gets one untimed warm-up. Each record says whether its output
equals HF's greedy output token for token.

`interleave` times every peer over several rounds, in turns (each round in an order rotated by
one), as speed is measured on a shared machine: a record's tokens/s is the median of its rounds,
and a speed-up is the median of the per-round ratios (a peer against the reference of the same
round), so that a slow spell of the machine hits both sides of a ratio.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace

import torch
from common import sync

from specdec_fast import generate
from specdec_fast.drafters.base import Drafter
from specdec_fast.serving import Request, Scheduler


@dataclass
class E2ERecord:
    peer: str
    batch: int
    new_tokens: int
    seconds: float
    tokens_per_s: float
    acceptance: float | None = None
    tokens_per_step: float | None = None
    per_position: list[float] = field(default_factory=list)
    identical: bool | None = None
    # The same against our plain decoding (the engine's own promise), and the earliest token
    # index, over the prompts, at which the output departs from the reference's (None: it never
    # does, or there is no reference).
    identical_to_plain: bool | None = None
    first_difference: int | None = None
    speedup_vs_plain: float | None = None
    speedup_vs_hf: float | None = None
    # Tokens/s of each timed round (`interleave`), and whether every round emitted the same.
    round_tokens_per_s: list[float] = field(default_factory=list)
    repeatable: bool = True

    def __post_init__(self):
        if not self.round_tokens_per_s:
            self.round_tokens_per_s = [self.tokens_per_s]

    def to_dict(self) -> dict:
        return asdict(self)


def add_per_depth(offered: list[int], taken: list[int], seq) -> None:
    """Add a sequence's drafted (`position_offered`) and accepted (`position_accepted`) counts
    per tree depth to the running sums `offered` and `taken`, growing them as deeper levels
    appear."""
    for depth, (o, a) in enumerate(zip(seq.position_offered, seq.position_accepted, strict=True)):
        if depth == len(offered):
            offered.append(0)
            taken.append(0)
        offered[depth] += o
        taken[depth] += a


def run_ours(
    peer: str,
    target,
    prompts: Sequence[Sequence[int]],
    make_drafter: Callable[[], Drafter | None],
    max_new_tokens: int,
    batch: int,
    warm_up: bool = True,
    options: dict | None = None,
) -> tuple[E2ERecord, list[list[int]]]:
    """Our engine over `prompts` in batches of `batch`, after an untimed run of the first batch
    (unless `warm_up` is False): compiled steps meet their shapes (tree sizes, batch, lengths)
    there, not in the timed part. `options`: more arguments of `generate`."""
    options = options or {}
    if warm_up:
        with torch.no_grad():
            generate(
                target,
                [list(p) for p in prompts[:batch]],
                drafter=make_drafter(),
                max_new_tokens=max_new_tokens,
                eos_token_id=[],
                **options,
            )
    outputs: list[list[int]] = []
    stats = []
    sync(target.device)
    start = time.perf_counter()
    for first in range(0, len(prompts), batch):
        chunk = [list(p) for p in prompts[first : first + batch]]
        with torch.no_grad():
            out = generate(
                target,
                chunk,
                drafter=make_drafter(),
                max_new_tokens=max_new_tokens,
                eos_token_id=[],
                **options,
            )
        outputs += [s.tolist() for s in out.sequences]
        stats += out.stats.sequences
    sync(target.device)
    return _record(peer, batch, stats, time.perf_counter() - start), outputs


def run_served(
    peer: str,
    target,
    prompts: Sequence[Sequence[int]],
    make_drafter: Callable[[], Drafter | None],
    max_new_tokens: int,
    warm_up: bool = True,
    options: dict | None = None,
) -> tuple[E2ERecord, list[list[int]]]:
    """Our server's scheduler (`specdec_fast.serving.Scheduler`, without HTTP) over `prompts`,
    one request at a time (batch 1, as `run_ours` at batch 1: the scheduler's own cost per step
    beside `generate`'s loop), after an untimed request (unless `warm_up` is False). `options`:
    more arguments of the `Scheduler` (`read_ahead`). Its cache holds the longest prompt, the
    new tokens and a tree, as `generate`'s does: the compiled steps, whose shapes carry the
    cache's capacity, are then the ones `run_ours` compiled."""
    drafter = make_drafter()
    nodes = 1 if drafter is None else drafter.max_nodes
    capacity = max(len(prompt) for prompt in prompts) + max_new_tokens + nodes
    scheduler = Scheduler(
        target,
        {"route": drafter},
        max_batch=1,
        max_cache_len=capacity,
        eos_token_id=[],
        **(options or {}),
    )

    def serve(prompt: Sequence[int]):
        handle = scheduler.submit(Request(list(prompt), max_new_tokens, route="route"))
        scheduler.run_until_idle()
        return handle.completion

    try:
        if warm_up:
            serve(prompts[0])
        sync(target.device)
        start = time.perf_counter()
        completions = [serve(prompt) for prompt in prompts]
        sync(target.device)
        seconds = time.perf_counter() - start
    finally:
        scheduler.close()
    for completion in completions:
        if completion.finish_reason != "length":
            raise RuntimeError(f"{peer}: a request ended with {completion.finish_reason!r}")
    outputs = [[*prompt, *c.tokens] for prompt, c in zip(prompts, completions, strict=True)]
    return _record(peer, 1, [c.stats for c in completions], seconds), outputs


def _record(peer: str, batch: int, stats: Sequence, seconds: float) -> E2ERecord:
    """A timed run's record from its sequences' statistics (`SequenceStats`)."""
    steps = sum(seq.steps for seq in stats)
    accepted = sum(seq.accepted for seq in stats)
    drafted = sum(seq.drafted for seq in stats)
    new_tokens = sum(seq.new_tokens for seq in stats)
    offered: list[int] = []
    taken: list[int] = []
    for seq in stats:
        add_per_depth(offered, taken, seq)
    return E2ERecord(
        peer=peer,
        batch=batch,
        new_tokens=new_tokens,
        seconds=seconds,
        tokens_per_s=new_tokens / seconds,
        acceptance=accepted / drafted if drafted else None,
        tokens_per_step=(accepted + steps) / steps if steps else None,
        per_position=[a / o for a, o in zip(taken, offered, strict=True)],
    )


def run_hf(
    peer: str,
    target,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    warm_up: bool = True,
    **generate_kwargs,
) -> tuple[E2ERecord, list[list[int]]]:
    """HF `generate` one prompt at a time (greedy, no EOS stop), after one untimed warm-up
    (unless `warm_up` is False)."""
    base = copy.deepcopy(target.generation_config)
    # No EOS stop, so every peer generates the same number of tokens (ours: eos_token_id=[]).
    base.eos_token_id = None
    base.pad_token_id = base.pad_token_id or 0
    base.do_sample = False
    model_kwargs = {}
    for key, value in generate_kwargs.items():
        if hasattr(base, key):
            setattr(base, key, value)
        else:
            model_kwargs[key] = value

    def one(prompt: Sequence[int], tokens: int) -> list[int]:
        ids = torch.tensor([list(prompt)], device=target.device)
        config = copy.deepcopy(base)
        config.max_new_tokens = tokens
        with torch.no_grad():
            out = target.generate(
                ids, attention_mask=torch.ones_like(ids), generation_config=config, **model_kwargs
            )
        return out[0].tolist()

    if warm_up:
        one(prompts[0], 4)
    sync(target.device)
    start = time.perf_counter()
    outputs = [one(p, max_new_tokens) for p in prompts]
    sync(target.device)
    seconds = time.perf_counter() - start
    new_tokens = sum(len(o) - len(p) for o, p in zip(outputs, prompts, strict=True))
    return E2ERecord(peer, 1, new_tokens, seconds, new_tokens / seconds), outputs


Peer = Callable[[bool], tuple[E2ERecord, list[list[int]]]]


def interleave(
    peers: dict[str, Peer], rounds: int, report: Callable[[str], None] = print
) -> tuple[list[E2ERecord], dict[str, list[list[int]]]]:
    """Every peer `rounds` times, in turns: round r runs the peers in their order rotated by r.
    A peer is called with `warm_up=True` the first time only. Returns one record per peer (in
    the peers' order): its first round's counts (greedy rounds decode the same steps) with the
    median tokens/s and seconds and every round's tokens/s, and each peer's outputs
    (`repeatable` is False when a round emitted other tokens)."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    names = list(peers)
    runs: dict[str, list[E2ERecord]] = {name: [] for name in names}
    outputs: dict[str, list[list[int]]] = {}
    repeatable = dict.fromkeys(names, True)
    for index in range(rounds):
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            record, out = peers[name](not runs[name])
            runs[name].append(record)
            if name not in outputs:
                outputs[name] = out
            elif out != outputs[name]:
                repeatable[name] = False
            report(f"round {index + 1}/{rounds} {name}: {record.tokens_per_s:.1f} tokens/s")
    records = []
    for name in names:
        timed = runs[name]
        records.append(
            replace(
                timed[0],
                seconds=statistics.median(r.seconds for r in timed),
                tokens_per_s=statistics.median(r.tokens_per_s for r in timed),
                round_tokens_per_s=[r.tokens_per_s for r in timed],
                repeatable=repeatable[name],
            )
        )
    return records, outputs


def paired_ratio(record: E2ERecord, reference: E2ERecord) -> float:
    """`record`'s speed against `reference`'s: the median of the per-round ratios when both ran
    the same rounds (`interleave`), else the ratio of their tokens/s."""
    ours, theirs = record.round_tokens_per_s, reference.round_tokens_per_s
    if len(ours) == len(theirs) > 1:
        return statistics.median(a / b for a, b in zip(ours, theirs, strict=True))
    return record.tokens_per_s / reference.tokens_per_s


def first_difference(output: list[list[int]], reference: list[list[int]]) -> int | None:
    """The earliest token index, over the prompts, at which `output` departs from `reference`
    (a shorter or longer output departs where the shorter one ends); None if they are equal."""
    indices = []
    for ours, theirs in zip(output, reference, strict=True):
        if ours != theirs:
            common = min(len(ours), len(theirs))
            indices.append(next((i for i in range(common) if ours[i] != theirs[i]), common))
    return min(indices, default=None)


def compare(records: list[E2ERecord], outputs: dict[str, list[list[int]]]) -> None:
    """Fill in speed-ups (against `ours plain` and `HF generate`, `paired_ratio`), output
    identity with HF (every round's, for a record of several) and with our plain decoding, and
    where an output first departs from HF's (from ours plain's without HF)."""
    by_peer = {r.peer: r for r in records}
    plain, hf = by_peer.get("ours plain"), by_peer.get("HF generate")
    reference = outputs.get("HF generate") or outputs.get("ours plain")
    for record in records:
        if plain is not None:
            record.speedup_vs_plain = paired_ratio(record, plain)
        if "ours plain" in outputs:
            record.identical_to_plain = (
                outputs[record.peer] == outputs["ours plain"] and record.repeatable
            )
        if hf is not None:
            record.speedup_vs_hf = paired_ratio(record, hf)
        if reference is not None:
            record.identical = outputs[record.peer] == reference and record.repeatable
            record.first_difference = first_difference(outputs[record.peer], reference)


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(records: Sequence[E2ERecord]) -> str:
    lines = [
        "| peer | batch | tokens/s | tokens/s min-max | vs ours plain | vs HF generate "
        "| acceptance | tokens/step | identical to HF greedy | first difference "
        "| identical to ours plain |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        spread = f"{min(r.round_tokens_per_s):.1f}-{max(r.round_tokens_per_s):.1f}"
        lines.append(
            f"| {r.peer} | {r.batch} | {r.tokens_per_s:.1f} | {spread} "
            f"| {_fmt(r.speedup_vs_plain, '.2f')}x "
            f"| {_fmt(r.speedup_vs_hf, '.2f')}x | {_fmt(r.acceptance, '.1%')} "
            f"| {_fmt(r.tokens_per_step, '.2f')} | {_fmt(r.identical, '')} "
            f"| {_fmt(r.first_difference, '')} | {_fmt(r.identical_to_plain, '')} |"
        )
    return "\n".join(lines)
