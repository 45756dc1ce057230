"""Calibrating a block drafter's best-first trees: fitting the depth scale (`calibrate-block`).

`specdec_fast.trees.best_first_tree` scores a path by `q_1(x_1) (q_2(x_2) ... q_d(x_d)) ** s`.
A block drafter's marginal at depth d >= 2 averages over the tokens before it, and a drafter
self-distilled on the target's soft distributions is flatter still than the odds that its top
tokens are the target's greedy ones; with s = 1 a 16-node tree spends most of its nodes on the
long tail of depth 1. This module fits s for a checkpoint, for greedy verification:

- data: the target's greedy continuations of code prompts of the training split held back from
  training (`generated.heldback_prompts`: the last ones in the order a `--data generated` run
  draws them; none of them is a shipped held-out prompt, on which acceptance is reported), or
  for a drafter trained on a chat target's answers (`--data chat`), of the training split's
  chat prompts after the ones it trained on, through the chat template (`chat_sequences`);
- at every position of a continuation, the drafter's block is drafted as the engine drafts it
  when a step's root lands there (teacher-forced: the context is the continuation before it);
- for each s of a grid, the tree of `max_nodes` nodes is built, and its accepted length is the
  longest path of it that the continuation follows: what a greedy step accepts there;
- s is the grid value with the most tokens per step (accepted length + 1) on average, the
  larger s on ties (s = 1 unless another value does better).

    python -m specdec_fast.train calibrate-block --drafter specdec_fast/bundled/tiny-code-dflash

writes `ddtree_depth_scale` into the drafter's `config.json` (read by `BlockDrafter`), and, for a
folder of ours, the fit into `training_info.json` with the engine's acceptance re-measured.
`--prompts FILE.jsonl` fits on the first `--calibration-prompts` prompts of a file in the bench's
format instead (a target of your own, whose training prompts are not the bundled corpus'), and
`--dry-run` reports the fit without writing.

`--draft-vocab N` first gives a DFlash head a draft vocabulary (`DFlashHead.draft_ids`), from
which it then drafts, reading N rows of the target's LM head a step instead of all; the fit and
the engine's acceptance are measured with it. The N tokens are the most frequent of the stream a
head of ours trained on (rebuilt from `--data-dir`, the training run's cache, or generated anew
there), or, for any head (a published one too), of text files in the target's tokens
(`--vocab-text FILE`, repeatable: what the target writes, its answers or documents like them).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from specdec_fast.drafters.block import load_block_model
from specdec_fast.drafters.pard import PardDraft
from specdec_fast.heads.block import DEPTH_SCALE_FIELD, DFlashHead, draft_vocab_offsets
from specdec_fast.heads.checkpoint import SAFETENSORS_INDEX, SAFETENSORS_NAME, read_safetensors
from specdec_fast.progress import Progress
from specdec_fast.trees import best_first_tree

from .block_forward import dflash_block_outputs, pard_block_logits
from .block_report import engine_acceptance, eval_prompts, write_readme
from .generated import GeneratedData, greedy_sequences, heldback_prompts
from .heads import fp32_target, target_pass
from .options import command_line
from .progress import LOG_EVERY_S
from .tokenizer import load_tokenizer

# Candidate scales, largest first (ties keep the larger).
DEPTH_SCALES = (1.0, 0.7, 0.5, 0.35, 0.25, 0.18, 0.12, 0.08, 0.05)
CALIBRATION_NODES = 16
CALIBRATION_PROMPTS = 64
CALIBRATION_NEW_TOKENS = 64
# Rows drafted per batch (each row drafts a block at each of its positions).
ROWS_PER_BATCH = 4
# What a draft vocabulary chosen here or by the training command is (training_info.json).
DRAFT_VOCAB_SOURCE = "the most frequent tokens of its training stream"
# The shard that holds a sharded checkpoint's `d2t` (`write_draft_vocab`).
DRAFT_VOCAB_SHARD = "draft-vocab.safetensors"


@dataclass(frozen=True)
class Calibration:
    """A fitted depth scale and what it rests on: `tokens_per_step` per scale of the grid (the
    bonus token included), over `anchors` drafted blocks of `sequences` continuations of the
    prompts `source` describes."""

    depth_scale: float
    max_nodes: int
    sequences: int
    anchors: int
    tokens_per_step: dict[float, float]
    source: str = ""

    def to_dict(self) -> dict:
        fields = asdict(self)
        fields["tokens_per_step"] = {f"{s:g}": v for s, v in self.tokens_per_step.items()}
        return fields


def block_log_probs(
    model: DFlashHead | PardDraft, target, rows: torch.Tensor, anchors: torch.Tensor
) -> torch.Tensor:
    """float32 log q `[B, A, D, V]` of the blocks rooted at `anchors` (int64 `[B, A]`) of token
    rows `[B, L]`: depth d at index d - 1, D = b - 1 (DFlash) or b (PARD)."""
    with torch.no_grad():
        if isinstance(model, DFlashHead):
            features, _ = target_pass(target, rows, model.hidden_layers)
            outputs = dflash_block_outputs(model, target, features, rows, anchors)
            lm_head = target.get_output_embeddings()
            logits = lm_head(outputs[:, :, 1:].to(lm_head.weight.dtype))
            if model.draft_ids is not None:  # the engine drafts from these ids alone
                off = torch.ones(logits.shape[-1], dtype=torch.bool, device=logits.device)
                off[model.draft_ids.to(logits.device)] = False
                logits = logits.masked_fill(off, -torch.inf)
        else:
            real, masks = pard_block_logits(
                model.model, model.mask_token_id, model.block_size, rows, anchors
            )
            index = anchors[..., None].expand(-1, -1, real.shape[-1])
            logits = torch.cat([real.gather(1, index)[:, :, None], masks], dim=2)
    return torch.log_softmax(logits.float(), dim=-1)


def accepted_lengths(tokens: torch.Tensor, parents: torch.Tensor, labels: torch.Tensor):
    """int64 `[M]`: per tree (`tokens`/`parents` `[M, N]` as `best_first_tree` returns them),
    the depth of the longest path from the root whose tokens are `labels` `[M, D]`."""
    tokens, parents, labels = tokens.numpy(), parents.numpy(), labels.numpy()
    count = len(tokens)
    node = np.zeros(count, dtype=np.int64)
    length = np.zeros(count, dtype=np.int64)
    alive = np.ones(count, dtype=bool)
    for depth in range(labels.shape[1]):
        match = (parents == node[:, None]) & (tokens == labels[:, depth : depth + 1])
        match[:, 0] = False
        found = match.any(axis=1) & alive
        node = np.where(found, match.argmax(axis=1), node)
        length += found
        alive = found
    return length


def fit_depth_scale(
    model: DFlashHead | PardDraft,
    target,
    sequences: Sequence[torch.Tensor],
    prompt_lens: int | Sequence[int],
    max_nodes: int = CALIBRATION_NODES,
    scales: tuple[float, ...] = DEPTH_SCALES,
) -> Calibration:
    """The depth scale of `scales` whose `max_nodes`-node trees accept the most tokens per step
    over greedy continuations (see the module doc): `sequences` are int64 token rows (a `[S, L]`
    tensor or 1-D rows of any lengths), each a prompt of `prompt_lens` tokens (one count for
    all, or one per row) and the target's greedy continuation of it."""
    positions = model.block_size - 1 if isinstance(model, DFlashHead) else model.block_size
    depth = min(positions, max_nodes - 1)
    if isinstance(prompt_lens, int):
        prompt_lens = [prompt_lens] * len(sequences)
    rows = list(zip(sequences, prompt_lens, strict=True))
    for row, prompt_len in rows:
        if len(row) - 1 - depth < prompt_len:
            raise ValueError(
                f"a sequence of {len(row)} tokens after a {prompt_len}-token prompt leaves no "
                f"room for a block of {depth} drafted tokens"
            )
    accepted = {scale: 0 for scale in scales}
    anchors_seen = 0
    progress = Progress(
        len(rows),
        desc="calibrate",
        unit="seq",
        min_interval_s=LOG_EVERY_S,
        log_every_s=LOG_EVERY_S,
    )
    # Rows of one (length, prompt length) draft together.
    shapes: dict[tuple[int, int], list[torch.Tensor]] = {}
    for row, prompt_len in rows:
        shapes.setdefault((len(row), prompt_len), []).append(row)
    for (length, prompt_len), group in shapes.items():
        for start in range(0, len(group), ROWS_PER_BATCH):
            batch = torch.stack(group[start : start + ROWS_PER_BATCH]).long().to(target.device)
            anchors = torch.arange(prompt_len, length - depth, device=batch.device)
            anchors = anchors.expand(len(batch), -1)
            log_probs = block_log_probs(model, target, batch, anchors)[:, :, :depth]
            offsets = anchors[..., None] + torch.arange(1, depth + 1, device=batch.device)
            labels = batch.gather(1, offsets.flatten(1)).view(-1, depth).cpu()
            log_probs, roots = log_probs.flatten(0, 1).cpu(), batch.gather(1, anchors).flatten()
            for scale in scales:
                tokens, parents = best_first_tree(log_probs, roots.cpu(), max_nodes, scale)
                accepted[scale] += int(accepted_lengths(tokens, parents, labels).sum())
            anchors_seen += len(labels)
            progress.update(len(batch))
    progress.close()
    per_step = {scale: round(1 + accepted[scale] / anchors_seen, 4) for scale in scales}
    best = max(scales, key=lambda scale: (per_step[scale], scale))
    return Calibration(best, max_nodes, len(rows), anchors_seen, per_step)


def write_depth_scale(folder: str | Path, calibration: Calibration) -> None:
    """Record the fitted scale in `folder/config.json` (`ddtree_depth_scale`)."""
    path = Path(folder) / "config.json"
    config = json.loads(path.read_text())
    config[DEPTH_SCALE_FIELD] = calibration.depth_scale
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def write_draft_vocab(folder: str | Path, draft_ids: Sequence[int]) -> None:
    """Give the DFlash head saved in `folder` the draft vocabulary `draft_ids`
    (`DFlashHead.set_draft_vocab`): `d2t` in its weights (in its one safetensors file, or for a
    sharded checkpoint in a shard of its own, `DRAFT_VOCAB_SHARD`, listed in the index),
    `draft_vocab_size` in its config; every other tensor and field as it was."""
    folder = Path(folder)
    path = folder / "config.json"
    config = json.loads(path.read_text())
    d2t = draft_vocab_offsets(draft_ids, config["vocab_size"])
    single, index = folder / SAFETENSORS_NAME, folder / SAFETENSORS_INDEX
    if single.is_file():
        state = {**read_safetensors(folder), "d2t": d2t}
        save_file(state, str(single), metadata={"format": "pt"})
        single.chmod(0o644)
    elif index.is_file():
        save_file({"d2t": d2t}, str(folder / DRAFT_VOCAB_SHARD), metadata={"format": "pt"})
        (folder / DRAFT_VOCAB_SHARD).chmod(0o644)
        listing = json.loads(index.read_text())
        listing["weight_map"]["d2t"] = DRAFT_VOCAB_SHARD
        index.write_text(json.dumps(listing, indent=2) + "\n")
    else:
        raise ValueError(f"{folder}: no {SAFETENSORS_NAME} nor {SAFETENSORS_INDEX}")
    config["draft_vocab_size"] = d2t.numel()
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def text_draft_vocab(
    target_dir, paths: Sequence[str | Path], size: int, vocab_size: int
) -> list[int]:
    """The `size` most frequent ids (`heads.frequent_tokens`) below `vocab_size` (the target's)
    of UTF-8 text files in the target's tokens (its tokenizer at `target_dir`, no special
    tokens)."""
    from specdec_fast.loading import load_tokenizer as load_model_tokenizer

    from .heads import frequent_tokens

    tokenizer = load_model_tokenizer(str(target_dir))
    counted = []
    for path in paths:
        ids = tokenizer.encode(Path(path).read_text(encoding="utf-8"), add_special_tokens=False)
        print(f"{path}: {len(ids):,} tokens", file=sys.stderr, flush=True)
        counted.append(np.asarray(ids, dtype=np.int64))
    stream = np.concatenate(counted) if counted else np.zeros(0, dtype=np.int64)
    stream = stream[stream < vocab_size]
    if len(stream) == 0:
        raise ValueError(f"--vocab-text: {list(map(str, paths))} hold no tokens")
    return frequent_tokens(stream, size, vocab_size)


def training_draft_vocab(info: dict, size: int, data_dir: str | Path) -> list[int]:
    """The `size` most frequent ids (`heads.frequent_tokens`; ties by id, then ids the stream
    lacks, by id) of the stream a drafter of ours trained on, as its training_info.json
    (`info`) records it, rebuilt from the run's cache `data_dir` (or generated anew there)."""
    from .generated import DataOptions, training_stream
    from .heads import frequent_tokens, training_target
    from .lm import TrainSettings

    trained = info["options"]
    fields = [field.name for field in dataclasses.fields(DataOptions)]
    options = DataOptions(**{name: trained[name] for name in fields if name in trained})
    settings = TrainSettings(**info["settings"])
    target_dir, target, stream = training_target(
        info["target"], str(data_dir), options.target_dtype, options.data
    )
    stream = training_stream(options, settings, target, target_dir, stream, data_dir)
    vocab = target.config.get_text_config(decoder=True).vocab_size
    return frequent_tokens(stream, size, vocab)


def calibration_sequences(target, target_dir, prompts: int, new_tokens: int, used: int, seed: int):
    """int64 `[prompts, prompt_len + new_tokens]`: the target's greedy continuations of the code
    prompts held back from a run on `used` of them (`generated.heldback_prompts`)."""
    rows = heldback_prompts(
        load_tokenizer(target_dir), GeneratedData.prompt_len, prompts, used, seed
    )
    return torch.from_numpy(greedy_sequences(target, rows, new_tokens)).long()


def file_sequences(target, target_dir, path: str | Path, count: int, new_tokens: int):
    """(the target's greedy continuations of the first `count` prompts of a JSONL prompt file,
    their prompt lengths): the prompts as `specdec-fast bench` reads and encodes them."""
    from specdec_fast.harness.prompts import load_prompts
    from specdec_fast.loading import load_tokenizer as load_model_tokenizer
    from specdec_fast.text import encode_prompt

    tokenizer = load_model_tokenizer(str(target_dir))
    ids = [encode_prompt(tokenizer, r.prompt, r.messages) for r in load_prompts(path)[:count]]
    return _continued(target, ids, new_tokens)


def chat_sequences(target, target_dir, prompts: int, new_tokens: int, used: int, seed: int):
    """(the target's greedy continuations of the `prompts` chat prompts of the training split
    held back from a `--data chat` run on `used` of them, their prompt lengths): the ones after
    the first `used` in the order the run draws them (`chat_data.chat_prompts`), through the
    target's chat template."""
    from specdec_fast.loading import load_tokenizer as load_model_tokenizer

    from .chat_data import chat_prompt_ids

    tokenizer = load_model_tokenizer(str(target_dir))
    ids = chat_prompt_ids(tokenizer, "train", used + prompts, seed, start=used)
    return _continued(target, ids, new_tokens)


def _continued(target, ids: list[list[int]], new_tokens: int):
    """(each prompt of `ids` with the target's `new_tokens` greedy tokens after it, as int64
    rows, the prompts' lengths)."""
    from specdec_fast.engine import generate

    with torch.no_grad():
        out = generate(target, ids, drafter=None, max_new_tokens=new_tokens, eos_token_id=[])
    return [row.long() for row in out.sequences], [len(row) for row in ids]


def calibrate_folder(
    folder: str | Path,
    target,
    target_dir,
    *,
    prompts: int = CALIBRATION_PROMPTS,
    new_tokens: int = CALIBRATION_NEW_TOKENS,
    used: int = GeneratedData.count,
    seed: int = 0,
    max_nodes: int = CALIBRATION_NODES,
    prompt_file: str | Path | None = None,
    chat: bool = False,
    write: bool = True,
    draft_ids: Sequence[int] | None = None,
) -> Calibration:
    """Fit the depth scale of the drafter saved in `folder` on `prompts` prompts: held back
    from training (code prompts, `calibration_sequences`, or with `chat` chat prompts,
    `chat_sequences`), or the first ones of `prompt_file` (JSONL, the bench's format), with
    the draft vocabulary `draft_ids` when given (a DFlash head's); record both in its folder
    unless `write` is False, and report the fit on stderr."""
    if prompts < 1 or new_tokens < 1:
        raise ValueError(
            f"calibration needs at least one prompt and one new token, got {prompts} prompts "
            f"of {new_tokens} new tokens"
        )
    model = load_block_model(folder, target)
    if draft_ids is not None:
        if not isinstance(model, DFlashHead):
            raise ValueError(f"{folder}: only DFlash heads draft from a draft vocabulary")
        model.set_draft_vocab(draft_ids)
    if prompt_file is None and chat:
        sequences, prompt_lens = chat_sequences(target, target_dir, prompts, new_tokens, used, seed)
        source = "training-split chat prompts held back from training"
    elif prompt_file is None:
        sequences = calibration_sequences(target, target_dir, prompts, new_tokens, used, seed)
        prompt_lens: int | list[int] = GeneratedData.prompt_len
        source = "training-split code prompts held back from training"
    else:
        sequences, prompt_lens = file_sequences(
            target, target_dir, prompt_file, prompts, new_tokens
        )
        source = f"prompts of {Path(prompt_file).name}"
    calibration = fit_depth_scale(model, target, sequences, prompt_lens, max_nodes)
    calibration = dataclasses.replace(calibration, source=source)
    if write:
        if draft_ids is not None:
            write_draft_vocab(folder, draft_ids)
        write_depth_scale(folder, calibration)
    print(json.dumps({"calibration": calibration.to_dict()}), file=sys.stderr, flush=True)
    return calibration


def add_calibration_arguments(parser, prompt_seed: bool = True) -> None:
    """The fit's options; `prompt_seed` adds `--calibration-seed` (a training command orders
    the prompts by its own `--seed`)."""
    parser.add_argument(
        "--calibration-prompts",
        type=int,
        default=CALIBRATION_PROMPTS,
        help="held-back training prompts the tree's depth scale is fitted on (0: no fit)",
    )
    parser.add_argument(
        "--calibration-tokens",
        type=int,
        default=CALIBRATION_NEW_TOKENS,
        help="greedy tokens generated after each",
    )
    if not prompt_seed:
        return
    parser.add_argument(
        "--calibration-seed",
        type=int,
        default=0,
        help="the prompt order's seed (the training run's --seed)",
    )


def _run_calibrate(args) -> int:
    target_dir, target = fp32_target(args.target)
    folder = Path(args.drafter)
    info_path = folder / "training_info.json"
    info = json.loads(info_path.read_text()) if info_path.is_file() else None
    # A folder of ours says what it trained on: chat or code prompts, and how many.
    trained = info["options"] if info is not None else {}
    chat = trained.get("data") == "chat"
    used = args.used if args.used is not None else trained.get("sequences", GeneratedData.count)
    draft_ids, source = None, DRAFT_VOCAB_SOURCE
    if args.vocab_text and args.draft_vocab is None:
        raise ValueError("--vocab-text: the source of --draft-vocab's tokens; give --draft-vocab")
    if args.draft_vocab is not None:
        if args.draft_vocab < 1:
            raise ValueError(f"--draft-vocab must be >= 1, got {args.draft_vocab}")
        if args.vocab_text:
            vocab = target.config.get_text_config(decoder=True).vocab_size
            draft_ids = text_draft_vocab(target_dir, args.vocab_text, args.draft_vocab, vocab)
            names = ", ".join(Path(path).name for path in args.vocab_text)
            source = f"the most frequent tokens of {names}"
        elif info is None:
            raise ValueError(
                f"--draft-vocab: {folder} has no training_info.json, which says what the head "
                "trained on (the draft vocabulary is that stream's most frequent tokens); give "
                "--vocab-text FILE to count a text's tokens instead"
            )
        else:
            draft_ids = training_draft_vocab(info, args.draft_vocab, args.data_dir)
    calibration = calibrate_folder(
        folder,
        target,
        target_dir,
        prompts=args.calibration_prompts,
        new_tokens=args.calibration_tokens,
        used=used,
        seed=args.calibration_seed,
        max_nodes=args.nodes,
        prompt_file=args.prompts,
        chat=chat,
        write=not args.dry_run,
        draft_ids=draft_ids,
    )
    if info is not None and not args.dry_run:
        info["calibration"] = {**calibration.to_dict(), "command": command_line()}
        if draft_ids is not None:
            info["draft_vocab"] = {"size": len(draft_ids), "source": source}
        prompts = eval_prompts(info["target"], info["engine"]["prompts"], chat)
        info["engine"] = {**info["engine"], **engine_acceptance(folder, target, prompts)}
        info_path.write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
        write_readme(folder, info)
        print(json.dumps({"engine": info["engine"]}), flush=True)
    return 0


def register_calibrate_command(sub) -> None:
    """Add the `calibrate-block` command to the training CLI."""
    parser = sub.add_parser(
        "calibrate-block", help="fit a block drafter's best-first tree depth scale"
    )
    parser.add_argument("--drafter", required=True, help="the drafter's folder (rewritten)")
    parser.add_argument(
        "--prompts",
        help="a JSONL prompt file (`prompt` or chat `messages` per line, as for `specdec-fast "
        "bench`) to fit on instead of held-back training prompts: for a target of your own",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="report the fit without writing anything"
    )
    parser.add_argument("--target", default="tiny-code", help="folder or bundled name")
    parser.add_argument("--nodes", type=int, default=CALIBRATION_NODES, help="tree budget N")
    parser.add_argument(
        "--used",
        type=int,
        help="training prompts the drafter trained on (--sequences), not calibrated on "
        f"(default: its training_info.json's, else {GeneratedData.count})",
    )
    parser.add_argument(
        "--draft-vocab",
        type=int,
        metavar="N",
        help="dflash: draft from the N most frequent tokens of the head's training stream (its "
        "training_info.json says which), rebuilt from --data-dir, or of --vocab-text",
    )
    parser.add_argument(
        "--vocab-text",
        action="append",
        metavar="FILE",
        help="--draft-vocab's tokens from this UTF-8 text (repeatable) in the target's tokens, "
        "for any DFlash head (a published one too)",
    )
    parser.add_argument(
        "--data-dir", default="runs/data", help="the training run's cache (--draft-vocab)"
    )
    add_calibration_arguments(parser)
    parser.set_defaults(run=_run_calibrate)
