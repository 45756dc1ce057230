"""Exact mode on the CPU: its speed cost against the default mode, and 0-difference counts.

Two parts, on bf16 models:
- speed: a random SmolLM2-135M-shaped Llama (30 layers, hidden 576, 9/3 heads, intermediate
  1536, vocabulary 49152), plain decoding and an n-gram drafter at batch 1 and 4, default mode
  and exact mode run in turns (alternating, `--repeats` times; both eager, as exact mode always
  is), median tokens/s of each and the cost of exact mode (default/exact wall time - 1);
- equality: for the bundled tiny-code target (every bundled drafter) and the SmolLM2-shaped model
  (n-gram, suffix tree, a random draft model as a chain and as a tree), `--prompts` prompts at
  every batch size of `--batches`: how many speculative outputs differ from plain output of the
  same mode, in exact mode (the target: 0) and, for contrast, in the default mode.

Writes bench/results/exact-cpu.{json,md} (or `--out`). The committed figures come from
    python bench/bench_exact.py --prompts 64 --threads 1
(about an hour on two busy cores); the defaults (16 prompts) take a few minutes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from bench_overhead import SMOLLM2_SHAPE, TINY_SHAPE
from common import RESULTS_DIR, environment, write_results
from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

from specdec_fast import (
    DraftModelDrafter,
    NGramDrafter,
    SuffixDrafter,
    bundled,
    generate,
)
from specdec_fast.drafters.registry import bundled_specs
from specdec_fast.loading import load_model

SMOL_SHAPE = dict(SMOLLM2_SHAPE, vocab_size=49152)
DRAFT_TREE = [(0,), (1,), (0, 0), (1, 0), (0, 1), (0, 0, 0)]
BUNDLED, SMOL = "bundled tiny-code", "random SmolLM2-135M-shaped"
# New tokens per prompt of the equality runs (the SmolLM2-shaped model is 30 layers deep).
EQUALITY_TOKENS = {BUNDLED: 32, SMOL: 8}


def random_llama(seed: int, **shape) -> LlamaForCausalLM:
    config = LlamaConfig(
        **shape,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval().to(torch.bfloat16)
    model.generation_config = GenerationConfig(eos_token_id=None, pad_token_id=None)
    return model


def smol_model(tiny: bool = False) -> LlamaForCausalLM:
    """The SmolLM2-135M-shaped model; with `tiny` (the GPU suite's dry run), `bench_overhead`'s
    2-layer shape at the same vocabulary: the same code, a fraction of the CPU's time."""
    return random_llama(0, **(SMOL_SHAPE | TINY_SHAPE if tiny else SMOL_SHAPE))


def smol_draft() -> LlamaForCausalLM:
    shape = dict(SMOL_SHAPE, hidden_size=128, intermediate_size=256, num_hidden_layers=2)
    return random_llama(1, **(shape | dict(num_attention_heads=4, num_key_value_heads=2)))


def motif_prompts(count: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Ragged prompts (16-48 tokens) of short repeated motifs, so lookup drafters find matches."""
    generator = torch.Generator().manual_seed(seed)
    prompts = []
    for _ in range(count):
        size = int(torch.randint(3, 8, (1,), generator=generator))
        motif = torch.randint(vocab_size, (size,), generator=generator)
        length = int(torch.randint(16, 49, (1,), generator=generator))
        prompts.append((motif.tolist() * length)[:length])
    return prompts


def code_prompts(count: int, tokenizer) -> list[list[int]]:
    """Ragged prompts (16-48 tokens) cut from the bundled target's held-out code."""
    texts = json.loads(Path(bundled.path("tiny-code"), "heldout_sample.json").read_text())
    ids = [tokenizer.encode(text) for text in texts["texts"]]
    generator = torch.Generator().manual_seed(0)
    prompts = []
    for index in range(count):
        source = ids[index % len(ids)]
        length = int(torch.randint(16, 49, (1,), generator=generator))
        start = int(torch.randint(0, max(1, len(source) - length), (1,), generator=generator))
        prompts.append(source[start : start + length])
    return prompts


def decode_all(model, prompts, drafter, batch: int, new_tokens: int, exact: bool):
    """Every prompt, `batch` at a time: the sequences and each call's TPOT p50 (s)."""
    sequences, tpots = [], []
    for start in range(0, len(prompts), batch):
        out = generate(
            model,
            prompts[start : start + batch],
            drafter=drafter,
            max_new_tokens=new_tokens,
            exact=exact,
            compile=False,
        )
        sequences += out.sequences
        tpots.append(out.stats.summary()["tpot_s"]["p50"])
    return sequences, tpots


def count_differences(model, prompts, drafters: dict, batches, new_tokens: int) -> list[dict]:
    rows = []
    for batch in batches:
        plain = {
            exact: decode_all(model, prompts, None, batch, new_tokens, exact)[0]
            for exact in (True, False)
        }
        for name, make in drafters.items():
            row = {"drafter": name, "batch": batch, "prompts": len(prompts)}
            for exact in (True, False):
                spec = decode_all(model, prompts, make(), batch, new_tokens, exact)[0]
                row["exact" if exact else "default"] = sum(
                    not torch.equal(a, b) for a, b in zip(plain[exact], spec, strict=True)
                )
            rows.append(row)
            print(row, flush=True)
    return rows


def speed(model, prompts, batches, new_tokens: int, repeats: int) -> list[dict]:
    """Median tokens/s (prefill included) and TPOT p50 of default and exact mode, run in turns
    on the same prompts."""
    cells = {"plain": lambda: None, "ngram N=8": lambda: NGramDrafter(max_nodes=8)}
    rows = []
    for batch in batches:
        chunk = prompts[:batch]
        for name, make in cells.items():
            times = {True: [], False: []}
            tpots = {True: [], False: []}
            decode_all(model, chunk, make(), batch, 4, True)  # warm-up of both modes
            decode_all(model, chunk, make(), batch, 4, False)
            for _ in range(repeats):
                for exact in (False, True):
                    start = time.perf_counter()
                    _, tpot = decode_all(model, chunk, make(), batch, new_tokens, exact)
                    times[exact].append(time.perf_counter() - start)
                    tpots[exact] += tpot
            tokens = batch * new_tokens
            default, exact = statistics.median(times[False]), statistics.median(times[True])
            row = {
                "cell": name,
                "batch": batch,
                "default_tokens_per_s": tokens / default,
                "exact_tokens_per_s": tokens / exact,
                "default_s": [min(times[False]), default, max(times[False])],
                "exact_s": [min(times[True]), exact, max(times[True])],
                "exact_cost": exact / default - 1,
                "default_tpot_s": statistics.median(tpots[False]),
                "exact_tpot_s": statistics.median(tpots[True]),
            }
            row["exact_tpot_cost"] = row["exact_tpot_s"] / row["default_tpot_s"] - 1
            rows.append(row)
            print(row, flush=True)
    return rows


def markdown(env: dict, args, speed_rows: list[dict], equality: dict) -> str:
    lines = [
        f"# Exact mode on {args.device} ({env['date']})",
        "",
        f"torch {env['torch']}, transformers {env['transformers']}, {args.threads or 'default'} "
        f"torch threads, bf16. Command: `python bench/bench_exact.py --prompts {args.prompts} "
        f"--threads {args.threads} --device {args.device}`.",
        "",
        "## Speed: random SmolLM2-135M-shaped Llama",
        "",
        f"{args.speed_tokens} new tokens per prompt, prompts of 16-48 tokens, {args.repeats} "
        "alternating repeats, medians (min-max); both modes eager. Wall time includes the "
        "prefill (exact mode runs it on row tiles too); TPOT is the decode-only time per token.",
        "",
        "| cell | batch | default tok/s | exact tok/s | default s | exact s | exact cost "
        "| default TPOT ms | exact TPOT ms | exact TPOT cost |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in speed_rows:
        spread = [
            f"{r[key][1]:.2f} ({r[key][0]:.2f}-{r[key][2]:.2f})" for key in ("default_s", "exact_s")
        ]
        lines.append(
            f"| {r['cell']} | {r['batch']} | {r['default_tokens_per_s']:.1f} "
            f"| {r['exact_tokens_per_s']:.1f} | {spread[0]} | {spread[1]} "
            f"| {r['exact_cost']:+.0%} | {r['default_tpot_s'] * 1e3:.1f} "
            f"| {r['exact_tpot_s'] * 1e3:.1f} | {r['exact_tpot_cost']:+.0%} |"
        )
    for model, rows in equality.items():
        lines += [
            "",
            f"## Speculative vs plain output: {model}",
            "",
            f"Sequences (of {rows[0]['prompts']} prompts) whose speculative output differs from "
            f"plain output of the same mode, {args.equality_tokens or EQUALITY_TOKENS[model]} new "
            "tokens, greedy.",
            "",
            "| drafter | batch | exact mode | default mode |",
            "|---|---|---|---|",
        ]
        lines += [
            f"| {r['drafter']} | {r['batch']} | {r['exact']} | {r['default']} |" for r in rows
        ]
        total = sum(r["exact"] for r in rows)
        runs = sum(r["prompts"] for r in rows)
        lines += ["", f"Exact mode: {total} differences in {runs} speculative outputs."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=16, help="prompts per model (16)")
    parser.add_argument("--batches", default="1,4,16", help="equality batch sizes (1,4,16)")
    parser.add_argument("--repeats", type=int, default=5, help="speed repeats per mode (5)")
    parser.add_argument("--speed-tokens", type=int, default=32, help="speed: new tokens (32)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--out", default=str(RESULTS_DIR / "exact-cpu"), help="path stem")
    parser.add_argument(
        "--device", default="cpu", help="cpu, or cuda: exact mode's CUDA path (GPU suite part)"
    )
    parser.add_argument(
        "--equality-tokens", type=int, default=None, help="new tokens of the equality runs"
    )
    parser.add_argument("--json", default=None, help="also write the JSON results here")
    parser.add_argument(
        "--tiny", action="store_true", help="the SmolLM2-shaped model at 2 layers (a smoke run)"
    )
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    device = torch.device(args.device)
    env = environment(device)
    smol = smol_model(args.tiny).to(device)
    speed_rows = speed(
        smol, motif_prompts(4, SMOL_SHAPE["vocab_size"]), [1, 4], args.speed_tokens, args.repeats
    )

    tokenizer = AutoTokenizer.from_pretrained(bundled.path("tiny-code"))
    target = load_model(bundled.path("tiny-code"), device, "bfloat16")
    bundled_drafters = {
        str(spec): (lambda spec=spec: spec.build(target)) for spec in bundled_specs()
    }
    draft = smol_draft().to(device)
    smol_drafters = {
        "ngram": lambda: NGramDrafter(max_nodes=8),
        "suffix": lambda: SuffixDrafter(max_nodes=8),
        "draft chain k=4": lambda: DraftModelDrafter(draft, num_tokens=4),
        "draft tree N=7": lambda: DraftModelDrafter(draft, tree=DRAFT_TREE),
    }
    smol_prompts = motif_prompts(args.prompts, SMOL_SHAPE["vocab_size"], seed=1)
    equality = {
        BUNDLED: count_differences(
            target,
            code_prompts(args.prompts, tokenizer),
            bundled_drafters,
            batches,
            args.equality_tokens or EQUALITY_TOKENS[BUNDLED],
        ),
        SMOL: count_differences(
            smol,
            smol_prompts,
            smol_drafters,
            batches,
            args.equality_tokens or EQUALITY_TOKENS[SMOL],
        ),
    }
    out = Path(args.out)
    write_results(out.with_suffix(".json"), "exact", env, speed_rows, equality=equality)
    if args.json:
        write_results(Path(args.json), "exact", env, speed_rows, equality=equality)
    out.with_suffix(".md").write_text(markdown(env, args, speed_rows, equality))
    print(f"wrote {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
