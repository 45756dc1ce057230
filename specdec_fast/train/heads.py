"""Self-distillation of drafter heads for a target: `medusa`, `eagle` (EAGLE-1/2), `eagle3`.

The target runs over windows of the corpus' training split (held-out modules never enter it) and
the heads learn to predict the target's own next-token distributions (soft labels) further ahead:

- Medusa head d at position t learns the target's distribution at t + d + 1: the token d + 1
  levels below the root x_{t+1}.
- EAGLE heads train "as tested" over `unroll` steps: step 0 reads the target's features, step
  j > 0 the head's own step-(j - 1) outputs, and attends to the step-0 entries up to its root and
  to its own chain, exactly as a tree node at depth j does at inference. Step j at row t learns
  the target's distribution at t + j + 1 (soft cross-entropy over the full vocabulary for
  EAGLE-1/2, over the draft vocabulary for EAGLE-3, as the references do), and EAGLE-1/2 also
  regresses the target's feature there (smooth L1; loss weights 1 and 0.1 as in EAGLE).

Runs are seeded and resumable like `lm` (`checkpoint.pt`, `train_log.jsonl` in the run folder;
batches are a function of (seed, step)), on the GPU when there is one. Reported accuracy per head
(Medusa) or per step (EAGLE) is top-1 agreement with the target's own greedy choice.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache

from specdec_fast.heads.eagle import Eagle3Head, EagleHead, load_eagle_head
from specdec_fast.heads.medusa import MedusaHeads, load_medusa_heads
from specdec_fast.progress import Progress

from .data import batch_at_step
from .export import write_info
from .generated import (
    DataOptions,
    add_data_arguments,
    data_description,
    data_options,
    training_stream,
)
from .lm import (
    CHECKPOINT_NAME,
    LOG_NAME,
    TrainSettings,
    _load_checkpoint,
    _optimizer,
    _save_checkpoint,
    lr_at,
)
from .options import add_run_arguments, command_line, run_settings
from .progress import LOG_EVERY_S

# Each training command's checkpoints load as this registered drafter kind (tests hold every
# registered "trained" kind to a training command).
DRAFTER_KINDS = {"medusa": "medusa", "eagle": "eagle", "eagle3": "eagle"}
KINDS = tuple(DRAFTER_KINDS)
FINAL_NORM = -1
# Per-step weights of the unrolled losses (EAGLE-3's), and EAGLE's feature/token loss weights.
STEP_DECAY = 0.8
FEATURE_WEIGHT, TOKEN_WEIGHT = 1.0, 0.1


@dataclasses.dataclass
class HeadOptions(DataOptions):
    """What to train. num_heads/num_layers/own_projection: Medusa; unroll: EAGLE steps;
    draft_vocab: EAGLE-3's draft vocabulary (the most frequent training tokens); data,
    sequences, prompt_len: corpus windows or the target's greedy continuations of them
    (`specdec_fast.train.generated`); init: a head of this kind and shape to start from (a
    folder in the public layout or a bundled name; EAGLE-3 keeps its draft vocabulary)
    instead of fresh weights."""

    kind: str
    num_heads: int = 4
    num_layers: int = 1
    own_projection: bool = False
    unroll: int = 3
    draft_vocab: int = 2048
    init: str | None = None

    def __post_init__(self):
        super().__post_init__()
        if self.kind not in KINDS:
            raise ValueError(f"kind: expected one of {KINDS}, got {self.kind!r}")

    def to_dict(self) -> dict:
        """What a checkpoint records (and a resumed run must match), like a model config."""
        return dataclasses.asdict(self)


def frequent_tokens(stream: np.ndarray, count: int, vocab_size: int) -> list[int]:
    """The `count` most frequent ids of `stream` (ties by id), most frequent first."""
    counts = np.bincount(stream, minlength=vocab_size)
    order = np.lexsort((np.arange(vocab_size), -counts))
    return order[: min(count, vocab_size)].tolist()


def initial_head(options: HeadOptions, target) -> nn.Module:
    """The head `options.init` names, for `target` (fp32, on the target's device); ValueError
    when its kind or shape differs from `options`'."""
    what = f"--init {options.init}"
    if options.kind == "medusa":
        head = load_medusa_heads(options.init, target.device)
        found = (head.num_heads, head.num_layers, not head.shared_lm_head)
        wanted = (options.num_heads, options.num_layers, options.own_projection)
        if found != wanted:
            raise ValueError(
                f"{what}: (num_heads, num_layers, own_projection) = {found}, the run's {wanted}"
            )
    else:
        head = load_eagle_head(options.init, target)
        kind = "eagle3" if isinstance(head, Eagle3Head) else "eagle"
        if kind != options.kind:
            raise ValueError(f"{what}: an {kind} head, not an {options.kind} one")
        if kind == "eagle3" and head.draft_vocab_size != options.draft_vocab:
            raise ValueError(
                f"{what}: a {head.draft_vocab_size}-token draft vocabulary, the run's "
                f"--draft-vocab is {options.draft_vocab}"
            )
    return head.to(device=target.device, dtype=torch.float32)


def build_head(options: HeadOptions, target, stream: np.ndarray) -> nn.Module:
    """A freshly initialized head of `options.kind` for `target`, or `options.init`'s
    (`initial_head`); fp32, on the target's device."""
    if options.init is not None:
        return initial_head(options, target)
    config = target.config.get_text_config(decoder=True)
    if options.kind == "medusa":
        head = MedusaHeads(
            config.hidden_size,
            config.vocab_size,
            options.num_heads,
            options.num_layers,
            shared_lm_head=not options.own_projection,
        )
    elif options.kind == "eagle":
        head = EagleHead.for_target(target)
    else:
        draft_ids = frequent_tokens(stream, options.draft_vocab, config.vocab_size)
        head = Eagle3Head.for_target(target, draft_ids=draft_ids)
        # Start the draft LM head as the target's own, restricted to the draft vocabulary.
        with torch.no_grad():
            head.lm_head.weight.copy_(target.get_output_embeddings().weight[draft_ids])
            head.norm.weight.copy_(target.get_decoder().norm.weight)
    return head.to(device=target.device, dtype=torch.float32)


def target_layers(head: nn.Module) -> tuple[int, ...]:
    return getattr(head, "target_layers", (FINAL_NORM,))


@torch.no_grad()
def target_pass(target, rows: torch.Tensor, layers) -> tuple[dict, torch.Tensor]:
    """The target's hidden states `{layer: [B, L, H]}` (decoder-layer outputs; -1 = final norm)
    and logits `[B, L, V]` over token rows `[B, L]`."""
    decoder = target.get_decoder()
    modules = {
        layer: decoder.norm if layer == FINAL_NORM else decoder.layers[layer]
        for layer in set(layers)
    }
    captured = {}
    hooks = [
        module.register_forward_hook(
            lambda mod, args, out, layer=layer: captured.__setitem__(
                layer, out[0] if isinstance(out, tuple) else out
            )
        )
        for layer, module in modules.items()
    ]
    try:
        logits = target(input_ids=rows).logits
    finally:
        for hook in hooks:
            hook.remove()
    return {layer: captured[layer].float() for layer in modules}, logits.float()


def soft_cross_entropy(logits: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor):
    """Mean over `mask` of the cross-entropy of `logits` against softmax(`teacher`)."""
    per_token = -(torch.softmax(teacher, -1) * torch.log_softmax(logits.float(), -1)).sum(-1)
    return (per_token * mask).sum() / mask.sum().clamp(min=1)


@dataclasses.dataclass
class HeadLoss:
    loss: torch.Tensor
    correct: list[int]  # per head / step: top-1 matches of the target's greedy token
    counts: list[int]


def medusa_loss(heads: MedusaHeads, target, features: dict, logits: torch.Tensor) -> HeadLoss:
    hidden = features[FINAL_NORM]
    length = hidden.shape[1]
    loss, correct, counts = 0.0, [], []
    for d, head in enumerate(heads.heads):
        ahead = d + 1
        out = head(hidden[:, : length - ahead])
        if heads.shared_lm_head:
            out = target.get_output_embeddings()(out)
        teacher = logits[:, ahead:]
        mask = torch.ones(teacher.shape[:2], device=teacher.device)
        loss = loss + STEP_DECAY**d * soft_cross_entropy(out, teacher, mask)
        correct.append(int((out.argmax(-1) == teacher.argmax(-1)).sum()))
        counts.append(teacher.shape[0] * teacher.shape[1])
    return HeadLoss(loss, correct, counts)


def unroll_mask(length: int, step: int, device) -> torch.Tensor:
    """Bool `[1, 1, T, (step + 1) T]`: step `step`'s entry t sees step-0 entries <= t and its own
    chain's entries (entry t of steps 1..step)."""
    causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    own = torch.eye(length, dtype=torch.bool, device=device)
    return torch.cat([causal, *[own] * step], dim=1)[None, None]


def unrolled_outputs(head, target, features: dict, rows: torch.Tensor, unroll: int):
    """Head outputs of `unroll` training-time-test steps over token rows `[B, L]`.

    Step j's `[B, L - 1, h]` holds at row t the output of the depth-j chain node rooted at entry
    t (entry t + j of the sequence: token x_{t+j+1}, the previous step's output as its hidden
    state), meaningful for t < L - 1 - j; step 0 is the entries themselves.
    """
    batch, length = rows.shape
    entries = length - 1
    device = rows.device
    # SDPA takes the boolean unrolled mask as is (eager attention would add it to the scores).
    head.config._attn_implementation = "sdpa"
    embed = target.get_input_embeddings()
    position = torch.arange(entries, device=device)
    hidden = head.fuse([features[layer][:, :entries] for layer in head.target_layers])
    cache = DynamicCache()
    outputs = []
    for step in range(unroll):
        with torch.no_grad():
            embeds = embed(rows[:, (position + step + 1).clamp(max=length - 1)])
        hidden = head(
            hidden,
            embeds,
            (position + step)[None].expand(batch, -1),
            past_key_values=cache,
            attention_mask=unroll_mask(entries, step, device),
        )
        outputs.append(hidden)
    return outputs


def eagle_loss(head, target, features: dict, logits: torch.Tensor, rows: torch.Tensor, unroll):
    """Unrolled EAGLE loss over token rows `[B, L]` (see `unrolled_outputs`)."""
    batch, length = rows.shape
    entries = length - 1
    position = torch.arange(entries, device=rows.device)
    lm_head = target.get_output_embeddings()
    if head.version == 3:
        draft_ids = torch.arange(head.draft_vocab_size, device=rows.device) + head.d2t
    loss, correct, counts = 0.0, [], []
    for step, out in enumerate(unrolled_outputs(head, target, features, rows, unroll)):
        valid = position < entries - step
        ahead = (position + step + 1).clamp(max=length - 1)
        teacher = logits[:, ahead]
        greedy = teacher.argmax(-1)
        mask = valid[None].expand(batch, -1).float()
        draft_logits = head.logits(out, lm_head)
        if head.version == 3:
            mask = mask * head.t2d[greedy].float()
            step_loss = soft_cross_entropy(draft_logits, teacher[..., draft_ids], mask)
            predicted = draft_ids[draft_logits.argmax(-1)]
        else:
            target_feature = features[FINAL_NORM][:, ahead]
            regression = F.smooth_l1_loss(out.float(), target_feature, reduction="none").mean(-1)
            step_loss = TOKEN_WEIGHT * soft_cross_entropy(draft_logits, teacher, mask)
            step_loss = step_loss + FEATURE_WEIGHT * (regression * mask).sum() / mask.sum()
            predicted = draft_logits.argmax(-1)
        loss = loss + STEP_DECAY**step * step_loss
        correct.append(int(((predicted == greedy) & valid[None]).sum()))
        counts.append(int(valid.sum()) * batch)
    return HeadLoss(loss, correct, counts)


def head_loss(options: HeadOptions, head, target, rows: torch.Tensor) -> HeadLoss:
    features, logits = target_pass(target, rows, target_layers(head))
    if options.kind == "medusa":
        return medusa_loss(head, target, features, logits)
    return eagle_loss(head, target, features, logits, rows, options.unroll)


def _add(total: list[int] | None, more: list[int]) -> list[int]:
    return list(more) if total is None else [a + b for a, b in zip(total, more, strict=True)]


def _ratios(correct: list[int], counts: list[int]) -> list[float]:
    return [round(c / max(n, 1), 4) for c, n in zip(correct, counts, strict=True)]


def heldout_accuracy(options: HeadOptions, head, target, rows: list[torch.Tensor]) -> list[float]:
    """Top-1 agreement with the target's greedy token per head (Medusa) or step (EAGLE) over
    held-out token rows."""
    return heldout_top1(head, lambda row: head_loss(options, head, target, row), rows)


@torch.no_grad()
def heldout_top1(
    module: nn.Module, loss_of: Callable[[torch.Tensor], HeadLoss], rows: list[torch.Tensor]
) -> list[float]:
    """The top-1 agreement ratios of `loss_of(row [1, L])` summed over held-out token rows,
    with `module` in eval mode."""
    was_training = module.training
    module.eval()
    device = next(module.parameters()).device
    correct = counts = None
    for row in rows:
        result = loss_of(row[None].to(device))
        correct, counts = _add(correct, result.correct), _add(counts, result.counts)
    module.train(was_training)
    return _ratios(correct, counts)


def train_heads(
    options: HeadOptions,
    settings: TrainSettings,
    target,
    stream: np.ndarray,
    run_dir: str | Path,
    resume: bool = False,
    stop_at: int | None = None,
) -> tuple[nn.Module, int]:
    """Train a head of `options.kind` for the (frozen) `target` on windows of the int32 token
    `stream`; returns (fp32 head, steps done). See the module doc."""
    target.eval().requires_grad_(False)
    torch.manual_seed(settings.seed)
    head = build_head(options, target, stream)
    steps = train_module(
        head,
        lambda step, rows: head_loss(options, head, target, rows),
        options,
        settings,
        stream,
        run_dir,
        f"train {options.kind}",
        resume,
        stop_at,
    )
    return head, steps


def train_module(
    module: nn.Module,
    loss_at: Callable[[int, torch.Tensor], HeadLoss],
    options,
    settings: TrainSettings,
    stream: np.ndarray,
    run_dir: str | Path,
    desc: str,
    resume: bool = False,
    stop_at: int | None = None,
) -> int:
    """The seeded, resumable loop of every drafter command: `loss_at(step, rows)` on the
    batch of each step (int64 token rows `[batch_size, seq_len]` on the module's device, a
    function of (seed, step)), AdamW on `module`'s trainable parameters, a JSONL log with the
    per-position top-1 agreement, checkpoints recording `options.to_dict()` (a resumed run must
    match it). Returns the steps done."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    device = next(module.parameters()).device
    optimizer = _optimizer(module, settings)
    checkpoint = run_dir / CHECKPOINT_NAME
    step = 0
    if resume and checkpoint.exists():
        step = _load_checkpoint(checkpoint, module, optimizer, settings, options)
    end = settings.steps if stop_at is None else min(stop_at, settings.steps)
    tokens_per_step = settings.batch_size * settings.seq_len
    progress = Progress(
        settings.steps,
        initial=step,
        desc=desc,
        unit="step",
        min_interval_s=LOG_EVERY_S,
        log_every_s=LOG_EVERY_S,
    )
    last_checkpoint = time.monotonic()
    window_start, window_steps, loss_sum = time.monotonic(), 0, 0.0
    correct = counts = None
    module.train()
    with (run_dir / LOG_NAME).open("a") as log:
        while step < end:
            rows = batch_at_step(stream, step, settings.batch_size, settings.seq_len, settings.seed)
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, settings)
            result = loss_at(step, rows.to(device))
            optimizer.zero_grad(set_to_none=True)
            result.loss.backward()
            torch.nn.utils.clip_grad_norm_(module.parameters(), settings.grad_clip)
            optimizer.step()
            step += 1
            window_steps += 1
            loss_sum += result.loss.item()
            correct, counts = _add(correct, result.correct), _add(counts, result.counts)
            if step % settings.log_every == 0 or step == end:
                elapsed = time.monotonic() - window_start
                record = {
                    "step": step,
                    "loss": round(loss_sum / window_steps, 5),
                    "top1": _ratios(correct, counts),
                    "lr": lr_at(step - 1, settings),
                    "tokens": step * tokens_per_step,
                    "tokens_per_s": round(window_steps * tokens_per_step / elapsed, 1),
                    "time": time.time(),
                }
                log.write(json.dumps(record) + "\n")
                log.flush()
                progress.update(
                    window_steps,
                    loss=f"{record['loss']:.3f}",
                    top1="/".join(f"{a:.2f}" for a in record["top1"]),
                )
                window_start, window_steps, loss_sum = time.monotonic(), 0, 0.0
                correct = counts = None
            if time.monotonic() - last_checkpoint > settings.checkpoint_minutes * 60:
                _save_checkpoint(checkpoint, module, optimizer, step, settings, options)
                last_checkpoint = time.monotonic()
    progress.close()
    _save_checkpoint(checkpoint, module, optimizer, step, settings, options)
    return step


def export_heads(head: nn.Module, out_dir: str | Path, info: dict) -> None:
    """Save `head` in bf16 in its public layout, with `training_info.json` and a README."""
    out_dir = Path(out_dir)
    bf16 = copy.deepcopy(head).to(device="cpu", dtype=torch.bfloat16)
    bf16.save_pretrained(out_dir)
    # safetensors writes 0600; installed package data must be readable by every user.
    for weights in out_dir.glob("*.safetensors"):
        weights.chmod(0o644)
    info = {**info, "parameters": sum(p.numel() for p in head.parameters())}
    write_info(out_dir, info)
    accuracy = ", ".join(
        f"{'head' if info['kind'] == 'medusa' else 'step'} {i + 1}: {value:.1%}"
        for i, value in enumerate(info.get("heldout_top1", []))
    )
    (out_dir / "README.md").write_text(
        f"# {out_dir.name}\n\n"
        f"{info['description']}, self-distilled from the bundled target `{info['target']}` "
        f"({info['parameters']:,} parameters, bf16).\n\n"
        f"Trained with:\n\n```\n{info['command']}\n```\n\n"
        f"Data: {info['data']}.\n\n"
        f"Held-out top-1 agreement with the target's greedy token ({info['heldout_tokens']:,} "
        f"tokens of {info.get('heldout', 'held-out modules')}): {accuracy}.\n"
    )


# What the held-out rows are cut from (`heldout_rows`), with chat data or without.
HELDOUT_ROWS = {True: "the target's answers to held-out chat prompts", False: "held-out modules"}

DESCRIPTIONS = {
    "medusa": "Medusa-1 heads ({num_heads} heads of {num_layers} residual block(s), {projection})",
    "eagle": "An EAGLE-1/2 head (one decoder layer over token and final hidden state)",
    "eagle3": "An EAGLE-3 head (target layers {layers} fused, {draft_vocab}-token draft vocab)",
}


def fp32_target(name: str, dtype: str = "float32") -> tuple[str, nn.Module]:
    """(folder, model on the GPU when there is one, fp32 unless `dtype` says otherwise) of a
    training command's model (`--target`, a folder or bundled name)."""
    from specdec_fast.loading import load_model, resolve_path

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return resolve_path(name), load_model(name, device, dtype)


def training_target(
    name: str, data_dir: str, dtype: str = "float32", data: str = "corpus"
) -> tuple[str, nn.Module, np.ndarray | None]:
    """`fp32_target` (in `dtype`) and the training split's token stream (cached in `data_dir`;
    None for `data` "chat", which does not read it)."""
    from .data import token_stream

    target_dir, target = fp32_target(name, dtype)
    if data == "chat":
        return target_dir, target, None
    return target_dir, target, token_stream("train", target_dir, data_dir)


def heldout_rows(args, target_dir: str, target=None) -> list[torch.Tensor]:
    """`--eval-windows` held-out token rows of `--seq-len` + 1 tokens: of the corpus' held-out
    split, or with `--data chat` of the target's answers to held-out chat prompts (one per
    window: `chat_data.heldout_stream`)."""
    from .data import token_stream
    from .evaluate import _windows

    if args.data == "chat":
        from .chat_data import heldout_stream

        stream = heldout_stream(target, target_dir, args, args.data_dir)
    else:
        stream = token_stream("heldout", target_dir, args.data_dir)
    return _windows(stream, args.seq_len, args.eval_windows)


def _run_heads(args) -> int:
    options = HeadOptions(
        kind=args.kind,
        num_heads=args.num_heads,
        num_layers=args.num_layers,
        own_projection=args.own_projection,
        unroll=args.unroll,
        draft_vocab=args.draft_vocab,
        init=args.init,
        **data_options(args),
    )
    settings = run_settings(args)
    target_dir, target, stream = training_target(
        args.target, args.data_dir, args.target_dtype, args.data
    )
    stream = training_stream(options, settings, target, target_dir, stream, args.data_dir)
    head, steps_done = train_heads(
        options, settings, target, stream, args.run_dir, resume=args.resume, stop_at=args.stop_at
    )
    if steps_done < settings.steps or args.out is None:
        return 0
    tokens = steps_done * settings.batch_size * settings.seq_len
    rows = heldout_rows(args, target_dir, target)
    accuracy = heldout_accuracy(options, head, target, rows)
    description = DESCRIPTIONS[options.kind].format(
        **dataclasses.asdict(options),
        projection="own projections" if options.own_projection else "sharing the target's LM head",
        layers=list(target_layers(head)),
    )
    if options.init is not None:
        description += f", fine-tuned from `{options.init}`"
    info = {
        "command": command_line(),
        "kind": options.kind,
        "description": description,
        "target": args.target,
        "options": dataclasses.asdict(options),
        "settings": dataclasses.asdict(settings),
        "tokens_trained": tokens,
        "data": data_description(options, settings, tokens),
        "heldout_top1": accuracy,
        "heldout_tokens": sum(row.numel() - 1 for row in rows),
        "heldout": HELDOUT_ROWS[options.data == "chat"],
    }
    export_heads(head, args.out, info)
    print(json.dumps({"heldout_top1": accuracy}), flush=True)
    return 0


def register_head_commands(sub) -> None:
    """Add the `medusa`, `eagle` and `eagle3` commands to the training CLI."""
    helps = {
        "medusa": "self-distill Medusa heads for a target",
        "eagle": "self-distill an EAGLE-1/2 head for a target",
        "eagle3": "self-distill an EAGLE-3 head for a target",
    }
    for kind in KINDS:
        parser = sub.add_parser(kind, help=helps[kind])
        parser.add_argument("--target", default="tiny-code", help="folder or bundled name")
        add_run_arguments(
            parser,
            batch_size=4,
            seq_len=256,
            lr=2e-3,
            warmup_steps=10,
            checkpoint_minutes=3.0,
            log_every=5,
        )
        parser.add_argument("--eval-windows", type=int, default=8, help="held-out windows")
        parser.add_argument(
            "--init", help="start from this head (folder or bundled name) instead of fresh weights"
        )
        add_data_arguments(parser)
        defaults = HeadOptions(kind)
        if kind == "medusa":
            parser.add_argument("--num-heads", type=int, default=defaults.num_heads)
            parser.add_argument("--num-layers", type=int, default=defaults.num_layers)
            parser.add_argument(
                "--own-projection",
                action="store_true",
                help="give each head its own vocabulary projection (Medusa-1's full variant)",
            )
        else:
            parser.add_argument(
                "--unroll", type=int, default=defaults.unroll, help="training-time-test steps"
            )
        if kind == "eagle3":
            parser.add_argument("--draft-vocab", type=int, default=defaults.draft_vocab)
        parser.set_defaults(
            run=_run_heads,
            kind=kind,
            **{key: value for key, value in dataclasses.asdict(defaults).items() if key != "kind"},
        )
