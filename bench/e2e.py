"""End-to-end generation benchmarks: our engine with each drafter against HF in one run.

Peers, all greedy on the same prompts and the same number of new tokens:
- `ours plain`: our engine without a drafter (the baseline every speed-up is measured against);
- `ours <drafter>`: our engine with that drafter;
- `HF generate`: `model.generate(do_sample=False)` with the default dynamic cache;
- `HF assisted (draft model)`: `generate(assistant_model=draft)` (HF supports batch 1 only);
- `HF prompt lookup`: `generate(prompt_lookup_num_tokens=k)` (batch 1 only).
HF peers run one prompt at a time; ours runs at the requested batch size (1 for a fair comparison
with HF's assisted modes). Every peer gets one untimed warm-up. Each record says whether its output
equals HF's greedy output token for token.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch

from specdec_fast import generate
from specdec_fast.drafters.base import Drafter


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
    speedup_vs_plain: float | None = None
    speedup_vs_hf: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_ours(
    peer: str,
    target,
    prompts: Sequence[Sequence[int]],
    make_drafter: Callable[[], Drafter | None],
    max_new_tokens: int,
    batch: int,
) -> tuple[E2ERecord, list[list[int]]]:
    """Our engine over `prompts` in batches of `batch`, after an untimed run of the first batch:
    compiled steps meet their shapes (tree sizes, batch, lengths) there, not in the timed part."""
    with torch.no_grad():
        generate(
            target,
            [list(p) for p in prompts[:batch]],
            drafter=make_drafter(),
            max_new_tokens=max_new_tokens,
            eos_token_id=[],
        )
    outputs: list[list[int]] = []
    new_tokens, steps, accepted, drafted = 0, 0, 0, 0
    offered: list[int] = []
    taken: list[int] = []
    _sync(target.device)
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
            )
        outputs += [s.tolist() for s in out.sequences]
        new_tokens += out.stats.new_tokens
        for seq in out.stats.sequences:
            steps += seq.steps
            accepted += seq.accepted
            drafted += seq.drafted
            for depth, (o, a) in enumerate(
                zip(seq.position_offered, seq.position_accepted, strict=True)
            ):
                if depth == len(offered):
                    offered.append(0)
                    taken.append(0)
                offered[depth] += o
                taken[depth] += a
    _sync(target.device)
    seconds = time.perf_counter() - start
    record = E2ERecord(
        peer=peer,
        batch=batch,
        new_tokens=new_tokens,
        seconds=seconds,
        tokens_per_s=new_tokens / seconds,
        acceptance=accepted / drafted if drafted else None,
        tokens_per_step=(accepted + steps) / steps if steps else None,
        per_position=[a / o for a, o in zip(taken, offered, strict=True)],
    )
    return record, outputs


def run_hf(
    peer: str, target, prompts: Sequence[Sequence[int]], max_new_tokens: int, **generate_kwargs
) -> tuple[E2ERecord, list[list[int]]]:
    """HF `generate` one prompt at a time (greedy, no EOS stop), after one untimed warm-up."""
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

    one(prompts[0], 4)
    _sync(target.device)
    start = time.perf_counter()
    outputs = [one(p, max_new_tokens) for p in prompts]
    _sync(target.device)
    seconds = time.perf_counter() - start
    new_tokens = sum(len(o) - len(p) for o, p in zip(outputs, prompts, strict=True))
    return E2ERecord(peer, 1, new_tokens, seconds, new_tokens / seconds), outputs


def compare(records: list[E2ERecord], outputs: dict[str, list[list[int]]]) -> None:
    """Fill in speed-ups (against `ours plain` and `HF generate`) and output identity with HF."""
    by_peer = {r.peer: r for r in records}
    plain, hf = by_peer.get("ours plain"), by_peer.get("HF generate")
    reference = outputs.get("HF generate") or outputs.get("ours plain")
    for record in records:
        if plain is not None:
            record.speedup_vs_plain = record.tokens_per_s / plain.tokens_per_s
        if hf is not None:
            record.speedup_vs_hf = record.tokens_per_s / hf.tokens_per_s
        if reference is not None:
            record.identical = outputs[record.peer] == reference


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(records: Sequence[E2ERecord]) -> str:
    lines = [
        "| peer | batch | tokens/s | vs ours plain | vs HF generate | acceptance | tokens/step "
        "| identical to HF greedy |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        lines.append(
            f"| {r.peer} | {r.batch} | {r.tokens_per_s:.1f} | {_fmt(r.speedup_vs_plain, '.2f')}x "
            f"| {_fmt(r.speedup_vs_hf, '.2f')}x | {_fmt(r.acceptance, '.1%')} "
            f"| {_fmt(r.tokens_per_step, '.2f')} | {_fmt(r.identical, '')} |"
        )
    return "\n".join(lines)
