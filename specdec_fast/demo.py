"""`specdec-fast demo`: plain decoding against every drafter, on the bundled models or your own.

Without `--model` (or with `--model smollm2-135m-instruct`): the real chat target with the
drafters trained for it, against HF `generate` (`specdec_fast.demo_chat`). With `--model
tiny-code`: the bundled tiny-code target completes held-out code prompts with every registered
drafter over its bundled checkpoints. With `--model PATH`: your model (folder, `.gguf` file or
bundled name), with the drafters given by `--drafter` (default: those that need no checkpoint),
on the shipped chat prompts when its tokenizer has a chat template, else on the code prompts.

For each drafter it prints, side by side with plain decoding: acceptance rate, mean accepted tokens
per step, tokens/s, the speed-up, and whether the greedy output is identical to plain decoding (it
must be: greedy speculation is exact; the exit status is 1 otherwise). It then samples one
completion of the first prompt (temperature 0.7, a fixed seed) plainly and with every drafter
whose proposals are deterministic (no draft probabilities), and checks that each equals the
plain sample token for token: random numbers are keyed by (seed, token position), so lossless
speculation over deterministic drafts draws exactly what plain sampling draws (exit status 1
otherwise too).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from specdec_fast import bundled
from specdec_fast.compiled import compile_by_default
from specdec_fast.demo_chat import CHAT_NEW_TOKENS, CHAT_TARGET, run_chat_demo
from specdec_fast.drafters.base import Drafter
from specdec_fast.drafters.registry import KINDS, DrafterSpec, bundled_specs
from specdec_fast.engine import generate
from specdec_fast.loading import load_model, load_tokenizer, pick_device
from specdec_fast.progress import Progress
from specdec_fast.prompts import load_chat_prompts, load_code_prompts
from specdec_fast.text import decode, encode_prompt, stop_token_ids, use_chat

BUNDLED_TARGET = "tiny-code"
SAMPLE_TEMPERATURE = 0.7
SAMPLE_SEED = 1234


@dataclass
class DemoPrompt:
    """ids: the encoded prompt; title and shown: how the demo prints it."""

    ids: list[int]
    title: str
    shown: str


@dataclass
class DemoRow:
    name: str
    sequences: list[list[int]]
    seconds: float
    new_tokens: int
    acceptance: float | None
    tokens_per_step: float | None
    deterministic: bool = True
    sampled: list[int] | None = None  # the sampled completion of the first prompt


def demo_drafters(target, specs: Sequence[DrafterSpec]) -> dict[str, tuple[Callable, bool]]:
    """Plain decoding and each spec (checkpoints loaded once), by display name: (make a drafter,
    whether its proposals are deterministic)."""
    drafters: dict[str, tuple[Callable[[], Drafter | None], bool]] = {"plain": (lambda: None, True)}
    for spec in specs:
        drafters[spec.label()] = (spec.factory(target), spec.info.deterministic)
    return drafters


def run(
    prompts: list[list[int]],
    target,
    make_drafter,
    max_new_tokens: int,
    stop: list[int],
    temperature: float = 0.0,
    seed: int | None = None,
) -> tuple[list[list[int]], object, float]:
    """(sequences, stats, seconds) of one `generate` call with a fresh drafter."""
    start = time.perf_counter()
    with torch.no_grad():
        out = generate(
            target,
            prompts,
            drafter=make_drafter(),
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            seed=seed,
            eos_token_id=stop,
        )
    return [s.tolist() for s in out.sequences], out.stats, time.perf_counter() - start


def _fmt(value: float | None, spec: str) -> str:
    """`value` formatted with `spec` ("8.1%"), or a dash of the same width."""
    return format(value, spec) if value is not None else "-".rjust(int(spec.split(".")[0]))


def _prompts(tokenizer, count: int, chat: bool) -> list[DemoPrompt]:
    """The shipped chat prompts as chat messages, or the held-out code prompts as raw text."""
    if chat:
        return [
            DemoPrompt(
                encode_prompt(tokenizer, messages=record["messages"], chat=True),
                f"chat prompt {number} ({record['id']})",
                record["messages"][-1]["content"],
            )
            for number, record in enumerate(load_chat_prompts(count), start=1)
        ]
    return [
        DemoPrompt(
            encode_prompt(tokenizer, record["prompt"], chat=False),
            f"prompt {number} ({record['source']}), last lines",
            "\n".join(record["prompt"].rstrip("\n").splitlines()[-4:]),
        )
        for number, record in enumerate(load_code_prompts(count), start=1)
    ]


def main(
    num_prompts: int | None = None,
    max_new_tokens: int | None = None,
    device: str | None = None,
    *,
    model: str | None = None,
    dtype: str = "auto",
    chat: bool | None = None,
    keep_special_tokens: bool = False,
    drafters: Sequence[DrafterSpec] | None = None,
    rounds: int = 2,
    threads: int | None = None,
) -> int:
    """Run the demo; returns the exit status (0 when greedy speculation was exact everywhere).
    rounds: the chat demo's timed rounds (`demo_chat.run_chat_demo`; the others run once);
    threads: torch's CPU threads."""
    if model in (None, CHAT_TARGET):
        return run_chat_demo(
            CHAT_NEW_TOKENS if max_new_tokens is None else max_new_tokens,
            rounds,
            device,
            dtype=dtype,
            threads=threads,
            drafters=drafters,
            num_prompts=num_prompts,
        )
    num_prompts = num_prompts or 4
    max_new_tokens = max_new_tokens if max_new_tokens is not None else 64
    own_model = model != BUNDLED_TARGET
    if not own_model and BUNDLED_TARGET not in bundled.available():
        print(
            f"specdec-fast demo: the bundled target {BUNDLED_TARGET!r} is missing from this "
            "install (give --model PATH)",
            file=sys.stderr,
        )
        return 2
    device = pick_device(device)
    if threads is not None:
        torch.set_num_threads(threads)
    elif device.type == "cpu" and not own_model:
        # The bundled models are tiny: one intra-op thread beats several, whose synchronization
        # costs more than these matmuls (and stalls badly when the machine is shared).
        torch.set_num_threads(1)
    torch.manual_seed(0)
    name = model or BUNDLED_TARGET
    target = load_model(name, device, dtype)
    tokenizer = load_tokenizer(name)
    chat = use_chat(tokenizer, chat)
    if drafters is None:
        drafters = (
            [DrafterSpec(kind.name) for kind in KINDS if kind.load is None]
            if own_model
            else bundled_specs()
        )
    prompts = _prompts(tokenizer, num_prompts, chat)
    ids = [p.ids for p in prompts]
    stop = stop_token_ids(target, tokenizer)
    which = "your model" if own_model else "the bundled tiny-code target"
    kind = "chat prompts (chat template)" if chat else "held-out code prompts"
    print(
        f"specdec-fast demo: {which} ({name}) on {device}, {len(prompts)} {kind}, "
        f"{max_new_tokens} new tokens each, greedy; then one sample at temperature "
        f"{SAMPLE_TEMPERATURE}, seed {SAMPLE_SEED}; model steps "
        f"{'compiled' if compile_by_default() else 'eager (--compile compiles them)'}\n"
    )
    table = demo_drafters(target, drafters)
    rows = []
    with Progress(2 * len(table), desc="demo", unit="run") as bar:
        for label, (make, deterministic) in table.items():
            # One untimed warm-up run per drafter, so every row is measured warm.
            run(ids[:1], target, make, 4, stop)
            sequences, stats, seconds = run(ids, target, make, max_new_tokens, stop)
            bar.update(1, drafter=label)
            row = DemoRow(
                label,
                sequences,
                seconds,
                stats.new_tokens,
                stats.acceptance_rate,
                stats.mean_accepted_per_step,
                deterministic,
            )
            if deterministic:
                sampled, _, _ = run(
                    ids[:1], target, make, max_new_tokens, stop, SAMPLE_TEMPERATURE, SAMPLE_SEED
                )
                row.sampled = sampled[0]
            bar.update(1, drafter=label)
            rows.append(row)
    return _report(rows, prompts, tokenizer, keep_special_tokens)


def _report(rows: list[DemoRow], prompts: list[DemoPrompt], tokenizer, keep: bool) -> int:
    baseline = rows[0]
    first = prompts[0]
    start = len(first.ids)
    print(f"--- {first.title} ---")
    print(first.shown)
    print("--- greedy completion (identical for every drafter marked yes) ---")
    print(decode(tokenizer, baseline.sequences[0][start:], keep))
    print(f"--- sampled completion, temperature {SAMPLE_TEMPERATURE}, seed {SAMPLE_SEED} ---")
    print(decode(tokenizer, baseline.sampled[start:], keep))
    print("---\n")
    width = max(len(row.name) for row in rows) + 2
    header = (
        f"{'drafter':<{width}}{'accept':>8}{'tok/step':>10}{'tok/s':>9}{'speed-up':>10}"
        f"{'greedy =':>10}{'sampled =':>11}"
    )
    print(header)
    print("-" * len(header))
    base_rate = baseline.new_tokens / baseline.seconds
    for row in rows:
        rate = row.new_tokens / row.seconds
        same = "ref" if row is baseline else _yes(row.sequences == baseline.sequences)
        if row is baseline or row.sampled is None:
            sampled = "ref" if row is baseline else "-"
        else:
            sampled = _yes(row.sampled == baseline.sampled)
        print(
            f"{row.name:<{width}}{_fmt(row.acceptance, '8.1%')}{_fmt(row.tokens_per_step, '10.2f')}"
            f"{rate:9.1f}{rate / base_rate:9.2f}x{same:>10}{sampled:>11}"
        )
    identical = all(row.sequences == baseline.sequences for row in rows)
    checked = [row for row in rows[1:] if row.sampled is not None]
    sampled_same = all(row.sampled == baseline.sampled for row in checked)
    print(
        "\ngreedy speculative output identical to plain decoding:",
        "yes, for every drafter" if identical else "NO",
    )
    print(
        "sampled output identical to plain sampling with the same seed (deterministic drafters):",
        _yes(sampled_same) if checked else "no such drafter",
    )
    print("  ('-': not checked, a chain sampled with draft probabilities: lossless, not equal)")
    return 0 if identical and sampled_same else 1


def _yes(same: bool) -> str:
    return "yes" if same else "NO"
