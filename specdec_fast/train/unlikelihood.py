"""Sequence-level unlikelihood fine-tuning against greedy repetition (Welleck et al., 2019,
"Neural Text Generation with Unlikelihood Training", section 5.2).

A small LM decoded greedily falls into loops (`#\\n#\\n...`, the same import line again). Each
step here continues a batch of training-split prompts greedily with the model itself, marks the
continuation tokens that lie inside an n-gram already seen earlier in the row, and lowers their
probability with the unlikelihood loss `-log(1 - p(token))`, while a language-modelling loss on
corpus windows keeps the model's distribution close to the data. Only training-split modules
feed it; the held-out modules (the demo's prompts) stay unseen.

A run folder holds `checkpoint.pt` and `train_log.jsonl` as `lm` runs do. The prompts and the
corpus windows of a step are functions of (seed, step), and the continuations are functions of
the model, so a resumed run repeats an uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from .data import batch_at_step
from .lm import (
    CHECKPOINT_NAME,
    LOG_NAME,
    TrainSettings,
    _load_checkpoint,
    _optimizer,
    _save_checkpoint,
    lr_at,
)
from .options import add_run_arguments
from .progress import StepLog
from .prompts import training_prompts

# Probabilities this close to 1 would make -log(1 - p) unbounded.
_MAX_PROBABILITY = 1.0 - 1e-5


@dataclasses.dataclass
class UnlikelihoodSettings(TrainSettings):
    """`batch_size`/`seq_len`: the corpus windows of the language-modelling loss; `ul_batch`
    prompts of `prompt_len` tokens continued greedily by `new_tokens` each step; repeats are
    n-grams of `ngram` tokens; the step's loss is `lm + ul_weight * unlikelihood`."""

    ul_batch: int = 8
    prompt_len: int = 96
    new_tokens: int = 64
    ngram: int = 4
    ul_weight: float = 1.0


def repeated_ngram_mask(rows: torch.Tensor, start: int, n: int) -> torch.Tensor:
    """Bool `[batch, length]`: tokens at positions >= `start` inside an n-gram of `n` tokens
    that already occurred earlier in the same row (prompt included)."""
    mask = torch.zeros(rows.shape, dtype=torch.bool)
    for row, tokens in enumerate(rows.tolist()):
        seen = set()
        for i in range(len(tokens) - n + 1):
            gram = tuple(tokens[i : i + n])
            if gram in seen and i + n > start:
                mask[row, max(i, start) : i + n] = True
            seen.add(gram)
    return mask


def unlikelihood_loss(logits: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor):
    """Mean `-log(1 - p(rows[t] | rows[:t]))` over the positions `t` where `mask` is set
    (`logits[:, t - 1]` predicts `rows[:, t]`); 0 when none is."""
    targets, marked = rows[:, 1:], mask[:, 1:]
    if not marked.any():
        return logits.sum() * 0.0
    log_probs = logits.float().log_softmax(-1).gather(-1, targets[..., None])[..., 0]
    probs = log_probs.exp().clamp(max=_MAX_PROBABILITY)
    return -torch.log1p(-probs[marked]).mean()


@torch.no_grad()
def greedy_continuations(model, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """`[batch, prompt_len + new_tokens]`: the prompts and the model's greedy continuation,
    decoded with its KV cache (no stop token: loops past an EOS are loops too)."""
    was_training = model.training
    model.eval()
    rows = model.generate(
        prompts,
        attention_mask=torch.ones_like(prompts),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=model.config.pad_token_id,
    )
    model.train(was_training)
    return rows


def train_unlikelihood(
    model,
    settings: UnlikelihoodSettings,
    stream: np.ndarray,
    prompts: torch.Tensor,
    run_dir: str | Path,
    resume: bool = False,
    stop_at: int | None = None,
) -> int:
    """Fine-tune `model` (fp32, on the CPU or a GPU) in place; return the steps done.

    With `resume`, continue from `run_dir/checkpoint.pt` when it exists; `stop_at` ends the run
    early at that step (checkpointed)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    device = next(model.parameters()).device
    if settings.ul_batch > len(prompts):
        raise ValueError(
            f"ul_batch: expected at most {len(prompts)} (the prompts), got {settings.ul_batch}"
        )
    optimizer = _optimizer(model, settings)
    checkpoint = run_dir / CHECKPOINT_NAME
    step = 0
    if resume and checkpoint.exists():
        step = _load_checkpoint(checkpoint, model, optimizer, settings, model.config)
    end = settings.steps if stop_at is None else min(stop_at, settings.steps)
    tokens_per_step = settings.batch_size * settings.seq_len
    log = StepLog(
        run_dir / LOG_NAME, settings.steps, step, tokens_per_step, f"unlikelihood {run_dir.name}"
    )
    last_checkpoint = time.monotonic()
    model.train()
    while step < end:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, settings)
        picked = np.random.default_rng([settings.seed, step]).choice(
            len(prompts), settings.ul_batch, replace=False
        )
        generated = greedy_continuations(model, prompts[picked].to(device), settings.new_tokens)
        mask = repeated_ngram_mask(generated.cpu(), settings.prompt_len, settings.ngram)
        logits = model(input_ids=generated[:, :-1]).logits
        ul = unlikelihood_loss(logits, generated, mask.to(device))
        rows = batch_at_step(stream, step, settings.batch_size, settings.seq_len, settings.seed)
        rows = rows.to(device)
        logits = model(input_ids=rows[:, :-1]).logits
        lm = F.cross_entropy(logits.float().flatten(0, 1), rows[:, 1:].flatten())
        loss = lm + settings.ul_weight * ul
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), settings.grad_clip)
        optimizer.step()
        step += 1
        log.add(lm.item())
        if step % settings.log_every == 0 or step == end:
            log.record(
                step,
                lr=lr_at(step - 1, settings),
                grad_norm=round(float(grad_norm), 4),
                unlikelihood=round(ul.item(), 4),
                repeated_share=round(mask[:, settings.prompt_len :].float().mean().item(), 4),
            )
        if time.monotonic() - last_checkpoint > settings.checkpoint_minutes * 60:
            _save_checkpoint(checkpoint, model, optimizer, step, settings, model.config)
            last_checkpoint = time.monotonic()
    log.close()
    _save_checkpoint(checkpoint, model, optimizer, step, settings, model.config)
    return step


def _run_unlikelihood(args) -> int:
    from . import corpus
    from .export import export_checkpoint, read_info
    from .heads import training_target
    from .options import command_line, run_settings
    from .tokenizer import load_tokenizer

    settings = UnlikelihoodSettings(
        **dataclasses.asdict(run_settings(args)),
        ul_batch=args.ul_batch,
        prompt_len=args.prompt_len,
        new_tokens=args.new_tokens,
        ngram=args.ngram,
        ul_weight=args.ul_weight,
    )
    model_dir, model, stream = training_target(args.model, args.data_dir)
    base_info = read_info(model_dir)
    tokenizer = load_tokenizer(model_dir)
    prompts = training_prompts(corpus.read_texts("train"), tokenizer, settings.prompt_len)
    steps_done = train_unlikelihood(
        model, settings, stream, prompts, args.run_dir, resume=args.resume, stop_at=args.stop_at
    )
    if steps_done < settings.steps or args.out is None:
        return 0
    base_info.pop("evaluation", None)
    run = {
        "command": command_line(),
        "settings": dataclasses.asdict(settings),
        "training_prompts": len(prompts),
        "tokens_trained": steps_done
        * (settings.batch_size * settings.seq_len + settings.ul_batch * settings.new_tokens),
    }
    # One entry per fine-tune, oldest first: tuning a tuned model keeps the history.
    info = {**base_info, "unlikelihood": [*base_info.get("unlikelihood", []), run]}
    export_checkpoint(model, model_dir, args.out, info)
    print(f"model exported to {args.out}", file=sys.stderr)
    return 0


def register_unlikelihood_command(sub) -> None:
    """Add the `unlikelihood` command to the training CLI."""
    parser = sub.add_parser(
        "unlikelihood", help="fine-tune a causal LM against its own greedy repetition loops"
    )
    parser.add_argument("--model", default="tiny-code", help="folder or bundled name to tune")
    add_run_arguments(
        parser, batch_size=4, seq_len=512, lr=3e-4, warmup_steps=10, checkpoint_minutes=3.0
    )
    defaults = UnlikelihoodSettings(steps=0)
    parser.add_argument("--ul-batch", type=int, default=defaults.ul_batch, help="prompts per step")
    parser.add_argument("--prompt-len", type=int, default=defaults.prompt_len)
    parser.add_argument("--new-tokens", type=int, default=defaults.new_tokens)
    parser.add_argument("--ngram", type=int, default=defaults.ngram, help="repeat n-gram size")
    parser.add_argument("--ul-weight", type=float, default=defaults.ul_weight)
    parser.set_defaults(run=_run_unlikelihood)
