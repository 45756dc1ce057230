"""Chat prompts made from the installed standard library, and the target's own answers to them.

A chat target's drafters learn what it writes after its chat template: its answers. The prompts
come from text installed here, the docstrings of the standard library's functions (`corpus`), in
the demo's five shapes (`SHAPES`): write code, answer in JSON, explain, answer from a quoted
context (RAG), and a second turn after a first exchange. A split's prompts come only from that
split's modules: `train` prompts never quote a held-out module, and the held-out evaluation
prompts (`split="heldout"`) and the demo's hand-written prompts never enter training.

`chat_stream` has the target answer `count` training prompts (greedy, up to `answer_tokens`
tokens, stopping at its end-of-turn token) through the engine in batches, and packs each
`prompt + answer` end to end into one int32 stream, cached under a key of the target's weights
and the settings. Training windows then cut across sequences, as corpus windows cut across
modules.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch

from specdec_fast.progress import Progress

from . import corpus
from .progress import LOG_EVERY_S

SHAPES = ("code", "json", "explain", "rag", "turns")
GENERATE_BATCH = 32
# Prompts are drawn in an order of their own (an offset from the batches' seed stream).
PROMPT_SEED_OFFSET = 104_729


@dataclasses.dataclass(frozen=True)
class Documented:
    """A documented function of a standard-library module."""

    module: str
    name: str
    signature: str
    summary: str  # the docstring's first line
    doc: str  # the docstring's first paragraphs, up to about 600 characters
    module_summary: str


def _module_name(relpath: str) -> str:
    return relpath.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def _paragraphs(doc: str, limit: int = 600) -> str:
    kept, size = [], 0
    for paragraph in doc.split("\n\n"):
        if kept and size + len(paragraph) > limit:
            break
        kept.append(paragraph.strip())
        size += len(paragraph)
    return "\n\n".join(kept)


def documented_functions(split: str, root: Path | None = None) -> Iterator[Documented]:
    """The public documented functions of `split`'s modules (file-list order), whose
    docstring's first line reads as a sentence."""
    root = corpus.stdlib_root() if root is None else Path(root)
    for relpath in corpus.list_files(split, root):
        try:
            tree = ast.parse((root / relpath).read_text(encoding="utf-8"))
        except (UnicodeDecodeError, SyntaxError, ValueError):
            continue
        module = _module_name(relpath)
        module_doc = (ast.get_docstring(tree) or "").strip()
        module_summary = module_doc.split("\n", 1)[0].strip()
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = (ast.get_docstring(node) or "").strip()
            summary = doc.split("\n", 1)[0].strip()
            if len(summary) < 20 or not summary[0].isupper() or not summary.endswith("."):
                continue
            arguments = ", ".join(a.arg for a in node.args.args if a.arg != "self")
            yield Documented(
                module,
                node.name,
                f"{node.name}({arguments})",
                summary,
                _paragraphs(doc),
                module_summary,
            )


def chat_messages(item: Documented, shape: str) -> list[dict]:
    """The chat messages of one prompt of `shape` about `item`."""
    lower = item.summary[0].lower() + item.summary[1:]
    if shape == "code":
        return [
            {
                "role": "user",
                "content": f"Write a Python function `{item.signature}`. It should do this: "
                f"{lower} Keep it short.",
            }
        ]
    if shape == "json":
        return [
            {
                "role": "user",
                "content": 'Answer with a JSON object with the keys "name", "arguments" and '
                f'"purpose" for the Python function `{item.module}.{item.signature}`, '
                f"documented as: {item.summary}",
            }
        ]
    if shape == "explain":
        return [
            {
                "role": "user",
                "content": f"Explain to a beginner what `{item.module}.{item.name}` does and "
                f"when to use it. Its documentation says: {item.summary}",
            }
        ]
    if shape == "rag":
        return [
            {
                "role": "user",
                "content": "Answer the question from the context, and quote the sentence "
                f"that supports your answer.\n\nContext:\n{item.doc}\n\n"
                f"Question: what does `{item.name}` do?",
            }
        ]
    if shape == "turns":
        about = item.module_summary or f"The {item.module} module of the standard library."
        return [
            {"role": "user", "content": f"What is the Python module `{item.module}` for?"},
            {"role": "assistant", "content": about},
            {
                "role": "user",
                "content": f"Show me a short example that calls `{item.module}.{item.name}`.",
            },
        ]
    raise ValueError(f"shape: expected one of {SHAPES}, got {shape!r}")


def chat_prompts(
    split: str, count: int, seed: int = 0, root: Path | None = None
) -> list[list[dict]]:
    """`count` chat prompts (message lists) of `split` (of the modules under `root`, default
    the standard library), shapes in turn over functions drawn from `seed`; ValueError when the
    split documents fewer functions than `count`."""
    items = list(documented_functions(split, root))
    if len(items) < count:
        raise ValueError(f"{split}: {len(items)} documented functions, fewer than {count}")
    order = np.random.default_rng([seed, PROMPT_SEED_OFFSET]).permutation(len(items))[:count]
    return [chat_messages(items[i], SHAPES[n % len(SHAPES)]) for n, i in enumerate(order)]


def chat_prompt_ids(
    tokenizer, split: str, count: int, seed: int = 0, start: int = 0
) -> list[list[int]]:
    """The ids of `chat_prompts(split, count, seed)` from the `start`-th on, through the
    tokenizer's chat template."""
    from specdec_fast.text import encode_prompt

    return [
        encode_prompt(tokenizer, messages=messages, chat=True)
        for messages in chat_prompts(split, count, seed)[start:]
    ]


@dataclasses.dataclass(frozen=True)
class ChatData:
    """The target's greedy answers (up to `answer_tokens` each) to `count` prompts of `split`."""

    count: int = 1024
    answer_tokens: int = 192
    seed: int = 0
    split: str = "train"


def answer_prompts(
    target,
    prompts: list[list[int]],
    answer_tokens: int,
    stop: list[int],
    done: dict[int, list[int]] | None = None,
    on_batch: Callable[[dict[int, list[int]]], None] | None = None,
) -> list[list[int]]:
    """Each prompt followed by the target's greedy answer (the engine's plain decoding, up to
    `answer_tokens` tokens or its end-of-turn token included), in batches of similar length.

    `done` holds sequences already answered, by prompt index (they are not generated again);
    `on_batch` is called with every sequence answered so far after each batch (a store that
    makes a long run resumable)."""
    from specdec_fast.engine import generate

    answered = dict(done or {})
    todo = [i for i in range(len(prompts)) if i not in answered]
    todo.sort(key=lambda i: len(prompts[i]))
    progress = Progress(
        len(prompts),
        desc="answer",
        unit="seq",
        min_interval_s=LOG_EVERY_S,
        log_every_s=LOG_EVERY_S,
    )
    progress.update(len(prompts) - len(todo))
    with torch.no_grad():
        for start in range(0, len(todo), GENERATE_BATCH):
            batch = todo[start : start + GENERATE_BATCH]
            out = generate(
                target,
                [prompts[i] for i in batch],
                drafter=None,
                max_new_tokens=answer_tokens,
                eos_token_id=stop,
                compile=False,
            )
            for i, sequence in zip(batch, out.sequences, strict=True):
                answered[i] = sequence.tolist()
            if on_batch is not None:
                on_batch(answered)
            progress.update(len(batch))
    progress.close()
    return [answered[i] for i in range(len(prompts))]


def _save_atomically(path: Path, save: Callable[[BinaryIO], None]) -> None:
    """`save(file)` into a temporary file, then moved to `path` (a reader never sees half)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as file:
        save(file)
    tmp.replace(path)


def _load_answers(path: Path) -> dict[int, list[int]]:
    """The answers store (`chat_stream`): sequences by prompt index."""
    if not path.exists():
        return {}
    with np.load(path) as store:
        index, lengths, tokens = store["index"], store["lengths"], store["tokens"]
    ends = np.cumsum(lengths)
    return {
        int(i): tokens[end - length : end].tolist()
        for i, length, end in zip(index, lengths, ends, strict=True)
    }


def _save_answers(path: Path, answered: dict[int, list[int]]) -> None:
    index = sorted(answered)
    lengths = np.array([len(answered[i]) for i in index], dtype=np.int64)
    tokens = np.concatenate([np.asarray(answered[i], dtype=np.int32) for i in index])
    _save_atomically(
        path, lambda file: np.savez(file, index=np.array(index), lengths=lengths, tokens=tokens)
    )


def chat_stream(target, target_dir: str | Path, data: ChatData, cache_dir) -> np.ndarray:
    """The int32 stream of `data`'s prompts and answers packed end to end (module doc),
    generated once and cached under `cache_dir`.

    The answers also go, batch by batch, into a store keyed without `count` (prompt i is the
    same prompt for any count): an interrupted run resumes where it stopped, and a larger
    `count` generates only the prompts it adds."""
    from .data import weights_digest
    from .tokenizer import load_tokenizer

    settings = json.dumps(dataclasses.asdict(data), sort_keys=True) + str(target.dtype)
    digest = weights_digest(target_dir)
    key = hashlib.sha256((digest + settings).encode()).hexdigest()[:16]
    cache_file = Path(cache_dir) / f"chat-{data.split}-{key}.npy"
    if cache_file.exists():
        return np.load(cache_file)
    from specdec_fast.text import stop_token_ids

    shared = dataclasses.asdict(data)
    del shared["count"]
    store_key = digest + json.dumps(shared, sort_keys=True) + str(target.dtype)
    store = Path(cache_dir) / (
        f"chat-{data.split}-answers-{hashlib.sha256(store_key.encode()).hexdigest()[:16]}.npz"
    )
    tokenizer = load_tokenizer(target_dir)
    prompts = chat_prompt_ids(tokenizer, data.split, data.count, data.seed)
    stop = stop_token_ids(target, tokenizer)
    done = {i: s for i, s in _load_answers(store).items() if i < len(prompts)}
    sequences = answer_prompts(
        target,
        prompts,
        data.answer_tokens,
        stop,
        done,
        lambda answered: _save_answers(store, answered),
    )
    packed = np.concatenate([np.asarray(s, dtype=np.int32) for s in sequences])
    _save_atomically(cache_file, lambda file: np.save(file, packed))
    return packed


def heldout_stream(target, target_dir: str | Path, args, cache_dir) -> np.ndarray:
    """The packed stream of the target's answers to `args.eval_windows` held-out chat prompts
    (never trained on: their functions live in held-out modules)."""
    data = ChatData(args.eval_windows, args.answer_tokens, args.seed, split="heldout")
    return chat_stream(target, target_dir, data, cache_dir)


def _run_chat_data(args) -> int:
    from specdec_fast.loading import load_model, pick_device, resolve_path

    target_dir = resolve_path(args.target)
    target = load_model(args.target, pick_device(None), args.target_dtype)
    data = ChatData(args.sequences, args.answer_tokens, args.seed, args.split)
    stream = chat_stream(target, target_dir, data, args.data_dir)
    print(f"{len(stream):,} tokens of {data.count} prompts and answers", flush=True)
    return 0


def register_chat_data_command(sub) -> None:
    """Add `chat-data`: generate (and cache) what `--data chat` trains on ahead of the runs."""
    from .options import TARGET_DTYPES

    parser = sub.add_parser("chat-data", help="the target's answers to chat prompts (cached)")
    parser.add_argument("--target", required=True, help="folder or bundled name")
    parser.add_argument("--data-dir", default="runs/data", help="the cache the runs read")
    parser.add_argument("--sequences", type=int, default=ChatData.count)
    parser.add_argument("--answer-tokens", type=int, default=ChatData.answer_tokens)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--split", choices=corpus.SPLITS, default="train")
    parser.add_argument("--target-dtype", choices=TARGET_DTYPES, default=TARGET_DTYPES[0])
    parser.set_defaults(run=_run_chat_data)
