"""Held-out evaluation: mean next-token loss, draft/target greedy agreement, and greedy
repetition on the shipped code prompts.

The held-out stream is the corpus' held-out split packed like the training data and cut into
non-overlapping windows of `seq_len + 1` tokens, in file-list order; `max_windows` keeps a prefix.
Models are evaluated in fp32 from their stored (bf16) weights.

A small fixed sample of held-out source (`heldout_sample.json` in the target folder, written
by `write_heldout_sample`) travels with the package, so tests can check a checkpoint on any
interpreter, whose own stdlib may differ from the one the models were trained on.
"""

import json
from collections import Counter
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from specdec_fast.engine import generate
from specdec_fast.prompts import load_code_prompts

from . import corpus
from .data import num_windows, token_stream
from .export import read_info, write_info
from .tokenizer import load_tokenizer

SAMPLE_NAME = "heldout_sample.json"
SAMPLE_FILES = 6
SAMPLE_CHARS = 4000
# The demo's criterion for a believable completion: no 8-token sequence 3 or more times in 64
# greedy tokens.
REPEAT_NGRAM = 8
REPEAT_NEW_TOKENS = 64


def load_model(path: str | Path) -> torch.nn.Module:
    """A checkpoint folder's causal LM in fp32, in eval mode."""
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def _windows(stream: np.ndarray, seq_len: int, max_windows: int | None) -> list[torch.Tensor]:
    count = num_windows(stream, seq_len)
    count = count if max_windows is None else min(count, max_windows)
    return [
        torch.from_numpy(stream[i * seq_len : i * seq_len + seq_len + 1].astype(np.int64))
        for i in range(count)
    ]


@torch.no_grad()
def loss_and_predictions(
    model: torch.nn.Module, rows: list[torch.Tensor]
) -> tuple[float, list[torch.Tensor]]:
    """Mean next-token cross-entropy (nats) over 1-D int64 token rows of any lengths, and each
    row's greedy predictions (int64 `[len(row) - 1]`)."""
    total, count, predictions = 0.0, 0, []
    for row in rows:
        logits = model(input_ids=row[None, :-1]).logits[0].float()
        total += F.cross_entropy(logits, row[1:], reduction="sum").item()
        count += row.numel() - 1
        predictions.append(logits.argmax(-1))
    return total / count, predictions


def mean_loss(model: torch.nn.Module, rows: list[torch.Tensor]) -> float:
    """Mean next-token cross-entropy (nats) over 1-D int64 token rows of any lengths."""
    return loss_and_predictions(model, rows)[0]


def greedy_agreement(
    target_predictions: list[torch.Tensor], draft_predictions: list[torch.Tensor]
) -> float:
    """Share of positions where the draft's argmax equals the target's on the same text.

    A proxy for greedy speculative acceptance (which conditions on the target's own outputs).
    """
    agree = sum(
        int((t == d).sum()) for t, d in zip(target_predictions, draft_predictions, strict=True)
    )
    return agree / sum(t.numel() for t in target_predictions)


def write_heldout_sample(out_path: str | Path) -> None:
    """Save the fixed held-out sample: the first `SAMPLE_CHARS` characters of the first
    `SAMPLE_FILES` held-out modules (file-list order) that are at least that long."""
    root = corpus.stdlib_root()
    sample = {"files": [], "texts": []}
    for rel in corpus.list_files("heldout", root):
        text = (root / rel).read_text(encoding="utf-8", errors="replace")
        if len(text) >= SAMPLE_CHARS:
            sample["files"].append(rel)
            sample["texts"].append(text[:SAMPLE_CHARS])
        if len(sample["files"]) == SAMPLE_FILES:
            break
    Path(out_path).write_text(json.dumps(sample, indent=1) + "\n")


def sample_rows(model_dir: str | Path, sample_path: str | Path) -> list[torch.Tensor]:
    """The sample texts encoded as `BOS text EOS` with the tokenizer of `model_dir`."""
    tokenizer = load_tokenizer(model_dir)
    texts = json.loads(Path(sample_path).read_text())["texts"]
    return [
        torch.tensor(
            [tokenizer.bos_token_id, *tokenizer.encode(text, add_special_tokens=False)]
            + [tokenizer.eos_token_id]
        )
        for text in texts
    ]


def max_ngram_repeats(tokens: list[int], n: int = REPEAT_NGRAM) -> int:
    """How often the most frequent n-gram of `tokens` occurs (0 when there is none)."""
    grams = Counter(tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1))
    return max(grams.values(), default=0)


@torch.no_grad()
def code_prompt_repeats(
    model, tokenizer, limit: int | None = None, new_tokens: int = REPEAT_NEW_TOKENS
) -> list[int]:
    """`max_ngram_repeats` of the model's greedy continuation (up to `new_tokens`, ending at
    EOS) of each shipped code prompt, the demo's prompts first: one batch through the engine's
    plain decoding (greedy, each row the model's own greedy continuation)."""
    prompts = [tokenizer(record["prompt"]).input_ids for record in load_code_prompts(limit)]
    eos = tokenizer.eos_token_id
    with torch.no_grad():
        out = generate(model, prompts, drafter=None, max_new_tokens=new_tokens, eos_token_id=eos)
    counts = []
    for prompt, sequence in zip(prompts, out.sequences, strict=True):
        new = sequence[len(prompt) :].tolist()
        if eos in new:
            new = new[: new.index(eos)]
        counts.append(max_ngram_repeats(new))
    return counts


def evaluate_models(
    model_dir: str | Path,
    draft_dir: str | Path | None,
    data_dir: str | Path,
    seq_len: int,
    max_windows: int | None = None,
    record_command: str | None = None,
) -> dict:
    """Held-out and sample losses of `model_dir` (and of `draft_dir`, with their agreement).

    With `record_command`, each folder's training_info.json receives its own results under
    "evaluation", together with that command.
    """
    stream = token_stream("heldout", model_dir, data_dir)
    rows = _windows(stream, seq_len, max_windows)
    sample_path = Path(model_dir) / SAMPLE_NAME
    if not sample_path.exists():
        write_heldout_sample(sample_path)
    samples = sample_rows(model_dir, sample_path)
    folders = (
        {"model": model_dir} if draft_dir is None else {"model": model_dir, "draft": draft_dir}
    )
    results, predictions = {}, {}
    for role, folder in folders.items():
        model = load_model(folder)
        heldout_loss, predictions[role] = loss_and_predictions(model, rows)
        results[role] = {
            "heldout_loss": round(heldout_loss, 4),
            "sample_loss": round(mean_loss(model, samples), 4),
            "heldout_tokens": sum(row.numel() - 1 for row in rows),
            "heldout_files": len(corpus.list_files("heldout")),
            "seq_len": seq_len,
            f"code_prompt_max_{REPEAT_NGRAM}gram_repeats": code_prompt_repeats(
                model, load_tokenizer(folder)
            ),
        }
    if draft_dir is not None:
        agreement = round(greedy_agreement(predictions["model"], predictions["draft"]), 4)
        for role in folders:
            results[role]["greedy_agreement_draft_vs_target"] = agreement
    if record_command is not None:
        for role, folder in folders.items():
            write_info(
                folder,
                {**read_info(folder), "evaluation": {**results[role], "command": record_command}},
            )
    return results
