"""End-to-end generation: each drafter against our plain decoding, HF `generate` and HF assisted
generation (draft model and prompt lookup), on the same prompts, in one run.

Models: `--target`/`--draft` folders or bundled names (default: the bundled tiny-code pair when it
is installed); `--random` builds a small random Llama pair from configs instead (what the CPU smoke
test uses). Prompts: the shipped held-out code prompts, or random repetitive token prompts with
`--random`.

Run as `python bench/bench_generate.py [--quick] [--json PATH]`, or under pytest-benchmark:
`pytest bench/bench_generate.py --benchmark-only` (one group, one test per peer).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from common import RESULTS_DIR, bench_device, environment, write_results
from e2e import E2ERecord, compare, format_table, run_hf, run_ours

from specdec_fast import bundled
from specdec_fast.drafters.registry import REGISTRY, DrafterSpec, kinds_with

# The registered kinds a target and a draft model allow (no trained heads), at default sizes.
PAIR_KINDS = kinds_with("none", "draft model")


@dataclass
class Setup:
    target: torch.nn.Module
    draft: torch.nn.Module
    prompts: list[list[int]]
    max_new_tokens: int
    label: str


def random_pair(device: torch.device, vocab: int = 512):
    """A small random Llama target and a smaller draft with the same vocabulary."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    def build(hidden: int, layers: int, seed: int):
        config = LlamaConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=hidden // 4,
            max_position_embeddings=1024,
            initializer_range=0.3,
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=None,
        )
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(device).eval()
        model.generation_config = GenerationConfig(
            bos_token_id=None, eos_token_id=None, pad_token_id=None
        )
        return model

    return build(128, 4, 0), build(64, 1, 1)


def random_prompts(count: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    prompts = []
    for _ in range(count):
        motif = torch.randint(vocab, (5,), generator=generator).tolist()
        noise = torch.randint(vocab, (length,), generator=generator).tolist()
        prompts.append(
            [m if i % 3 else n for i, (m, n) in enumerate(zip(motif * length, noise, strict=False))]
        )
    return prompts


def make_setup(quick: bool, random: bool, target: str | None, draft: str | None) -> Setup:
    device = bench_device()
    count, new_tokens = (2, 24) if quick else (8, 128)
    use_bundled = not random and target is None and "tiny-code" in bundled.available()
    if random or (target is None and not use_bundled):
        target_model, draft_model = random_pair(device)
        prompts = random_prompts(count, 48, target_model.config.vocab_size)
        return Setup(target_model, draft_model, prompts, new_tokens, "random llama pair")
    from specdec_fast.loading import load_model, load_tokenizer
    from specdec_fast.prompts import load_code_prompts

    target_name = target or "tiny-code"
    target_model = load_model(target_name, device)
    draft_model = load_model(draft or "tiny-code-draft", device, target_model.dtype)
    tokenizer = load_tokenizer(target_name)
    prompts = [
        [tokenizer.bos_token_id, *tokenizer.encode(r["prompt"], add_special_tokens=False)]
        for r in load_code_prompts(count)
    ]
    return Setup(target_model, draft_model, prompts, new_tokens, f"{target_name} pair")


def peers(setup: Setup) -> dict[str, Callable[[], tuple[E2ERecord, list[list[int]]]]]:
    """Every peer, by name, as a thunk returning (record, outputs)."""
    t, d, p, n = setup.target, setup.draft, setup.prompts, setup.max_new_tokens
    ours = {"ours plain": lambda: None} | {
        f"ours {DrafterSpec(kind).label()}": lambda kind=REGISTRY[kind]: kind.build(
            d if kind.load is not None else None, kind.default_size
        )
        for kind in PAIR_KINDS
    }
    table = {
        name: (lambda name=name, make=make: run_ours(name, t, p, make, n, 1))
        for name, make in ours.items()
    }
    for name in ("ours plain", f"ours {DrafterSpec('ngram').label()}"):
        batched = f"{name}, batched"
        table[batched] = lambda batched=batched, make=ours[name]: run_ours(
            batched, t, p, make, n, len(p)
        )
    table["HF generate"] = lambda: run_hf("HF generate", t, p, n)
    table["HF assisted (draft model)"] = lambda: run_hf(
        "HF assisted (draft model)", t, p, n, assistant_model=d
    )
    table["HF prompt lookup"] = lambda: run_hf(
        "HF prompt lookup", t, p, n, prompt_lookup_num_tokens=4
    )
    return table


def run_all(setup: Setup) -> list[E2ERecord]:
    records, outputs = [], {}
    for name, thunk in peers(setup).items():
        record, out = thunk()
        records.append(record)
        outputs[name] = out
    compare(records, outputs)
    return records


PEER_NAMES = [
    "ours plain",
    *(f"ours {DrafterSpec(kind).label()}" for kind in PAIR_KINDS),
    "ours plain, batched",
    f"ours {DrafterSpec('ngram').label()}, batched",
    "HF generate",
    "HF assisted (draft model)",
    "HF prompt lookup",
]


@pytest.fixture(scope="module")
def bench_setup():
    return make_setup(quick=True, random=not bundled.available(), target=None, draft=None)


@pytest.mark.parametrize("peer", PEER_NAMES)
def test_generate_peer(benchmark, bench_setup, peer):
    benchmark.group = f"generate {bench_setup.label}"
    thunk = peers(bench_setup)[peer]
    record, _ = benchmark.pedantic(thunk, rounds=1, iterations=1)
    benchmark.extra_info.update(record.to_dict())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 prompts, 24 new tokens")
    parser.add_argument("--random", action="store_true", help="a random Llama pair")
    parser.add_argument("--target", default=None, help="folder or bundled name")
    parser.add_argument("--draft", default=None, help="folder or bundled name")
    parser.add_argument(
        "--json", type=Path, default=None, help="default: bench/results/bench_generate.json"
    )
    args = parser.parse_args()
    torch.manual_seed(0)
    setup = make_setup(args.quick, args.random, args.target, args.draft)
    records = run_all(setup)
    env = environment(bench_device())
    print(
        f"end-to-end generation, {setup.label}, {len(setup.prompts)} prompts x "
        f"{setup.max_new_tokens} new tokens, greedy, on {env['gpu'] or 'CPU'} ({env['date']})"
    )
    print(format_table(records))
    write_results(
        args.json or RESULTS_DIR / "bench_generate.json",
        "bench_generate",
        env,
        [r.to_dict() for r in records],
        setup=setup.label,
        prompts=len(setup.prompts),
        max_new_tokens=setup.max_new_tokens,
    )


if __name__ == "__main__":
    main()
