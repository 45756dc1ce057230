"""Self-distillation of block drafters for a target: `block --flavour dflash|pard`.

The target runs over windows of the corpus' training split, and the drafter learns the target's
own next-token distributions (soft labels) at every position of blocks anchored in the window,
trained "as tested": each block sees exactly what it sees at inference.

- dflash: a fresh `DFlashHead`. A block anchored at c is `[x_c, MASK x (b - 1)]` at positions
  c .. c + b - 1; it attends to the context entries (fused target features) of positions < c and
  bidirectionally to itself. Block position j learns the target's distribution at c + j - 1 (the
  token x_{c+j}), j = 1 .. b - 1.
- pard: a causal LM (default: the bundled draft model) fine-tuned with mask tokens. The window's
  tokens keep their causal next-token loss (depth 1); a block anchored at c adds b - 1 masks at
  positions c + 1 .. c + b - 1 that see the tokens up to c and the block's earlier masks, and
  mask j learns the target's distribution at c + j (depth j + 1). Anchors subsample positions as
  PARD's conditional drop-token training does, at a fixed count per window.

Losses are soft cross-entropies over the full vocabulary, weighted `exp(-(d - 1) / loss_decay)`
at depth d (DFlash's decay, gamma 7 for b = 16). Anchors are a function of (seed, step), like the
batches, so runs are seeded and resumable as the other head commands (`checkpoint.pt`,
`train_log.jsonl`). Reported accuracy per depth is top-1 agreement with the target's greedy
token. `--out` exports the drafter in its public layout (bf16; with `--draft-vocab N` a DFlash head
drafts from the N most frequent tokens of the training stream), fits its best-first trees' depth
scale (`train.calibrate`, unless `--calibration-prompts 0`), and writes a README giving the
command, the held-out per-position agreement, the fit, the acceptance of a 16-node best-first tree
on held-out code prompts, and the size.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import torch
from torch import nn

from specdec_fast.drafters.pard import PardDraft
from specdec_fast.heads.block import DFlashHead

from .block_forward import dflash_block_outputs, pard_block_logits
from .block_report import EVAL_NODES, engine_acceptance, eval_prompts, write_readme
from .calibrate import DRAFT_VOCAB_SOURCE, add_calibration_arguments, calibrate_folder
from .generated import (
    DataOptions,
    add_data_arguments,
    data_description,
    data_options,
    training_stream,
)
from .heads import (
    HELDOUT_ROWS,
    HeadLoss,
    frequent_tokens,
    heldout_rows,
    heldout_top1,
    soft_cross_entropy,
    target_pass,
    train_module,
    training_target,
)
from .lm import TrainSettings
from .options import add_run_arguments, command_line, run_settings

FLAVOURS = ("dflash", "pard")
# Published defaults: DFlash's "-b16" heads, PARD's training `para_num`.
DEFAULT_BLOCK_SIZES = {"dflash": 16, "pard": 8}
# A fresh head learns at the head commands' rate; a pretrained draft model is fine-tuned.
DEFAULT_LR = {"dflash": 2e-3, "pard": 5e-4}
ANCHOR_SEED_STRIDE = 1_000_003


@dataclasses.dataclass
class BlockOptions(DataOptions):
    """What to train. block_size: tokens per block b (None: the flavour's default);
    num_layers, target_layers: the DFlash head's layers and the target layers it reads (None:
    the reference's default); num_kv_heads: the DFlash head's KV heads (None: the target's; more
    heads widen what a layer's attention carries from the context into the masks); init: the
    PARD model to start from; anchors: blocks per window;
    loss_decay: gamma of the per-depth weights; mask_token_id: None for the target's pad token;
    data: "corpus" (windows of the training split) or "generated" (the target's greedy
    continuations of `sequences` prompts of `prompt_len` tokens, `specdec_fast.train.generated`;
    blocks are then anchored in the continuations only)."""

    flavour: str
    block_size: int | None = None
    num_layers: int = 2
    num_kv_heads: int | None = None
    target_layers: list[int] | None = None
    init: str = "tiny-code-draft"
    anchors: int = 32
    loss_decay: float = 7.0
    mask_token_id: int | None = None

    def __post_init__(self):
        super().__post_init__()
        if self.flavour not in FLAVOURS:
            raise ValueError(f"flavour: expected one of {FLAVOURS}, got {self.flavour!r}")
        if self.block_size is None:
            self.block_size = DEFAULT_BLOCK_SIZES[self.flavour]
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {self.block_size}")
        if self.anchors < 1:
            raise ValueError(f"anchors must be >= 1, got {self.anchors}")
        if self.num_kv_heads is not None and self.num_kv_heads < 1:
            raise ValueError(f"num_kv_heads must be >= 1, got {self.num_kv_heads}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def build_block_model(options: BlockOptions, target) -> nn.Module:
    """A trainable fp32 module on the target's device: a fresh DFlash head, or the PARD model
    `options.init` with its mask token set."""
    config = target.config.get_text_config(decoder=True)
    mask = config.pad_token_id if options.mask_token_id is None else options.mask_token_id
    if mask is None:
        raise ValueError("mask_token_id: the target has no pad token to use as the mask; give one")
    if options.flavour == "dflash":
        overrides = {}
        if options.num_kv_heads is not None:
            heads = config.num_attention_heads
            if heads % options.num_kv_heads:
                raise ValueError(
                    f"num_kv_heads: {options.num_kv_heads} does not divide the target's "
                    f"{heads} attention heads"
                )
            overrides["num_key_value_heads"] = options.num_kv_heads
        module = DFlashHead.for_target(
            target,
            options.num_layers,
            options.block_size,
            mask,
            options.target_layers,
            **overrides,
        )
        # The head's outputs feed the target's LM head: start its final norm as the target's.
        with torch.no_grad():
            module.norm.weight.copy_(target.get_decoder().norm.weight)
    else:
        from specdec_fast.loading import load_model

        module = load_model(options.init, target.device, torch.float32)
        PardDraft(module, mask, options.block_size)  # validates the mask token and block size
        module.config.pard_token, module.config.block_size = mask, options.block_size
        module.set_attn_implementation("sdpa")
    return module.to(device=target.device, dtype=torch.float32)


def anchors_at(step: int, seed: int, batch: int, count: int, low: int, high: int):
    """int64 `[batch, count]` block anchors in [low, high], a function of (seed, step)."""
    if high < low:
        raise ValueError(f"seq_len is too short for blocks: anchors in [{low}, {high}]")
    generator = torch.Generator().manual_seed(seed * ANCHOR_SEED_STRIDE + step)
    return torch.randint(low, high + 1, (batch, count), generator=generator)


def depth_weights(depths: int, loss_decay: float) -> list[float]:
    return [math.exp(-d / loss_decay) for d in range(depths)]


def _depth_loss(logits, teacher, weight: float) -> tuple[torch.Tensor, int, int]:
    """Weighted soft cross-entropy of `logits` `[..., V]` against `teacher`, and the top-1
    matches and count."""
    mask = torch.ones(logits.shape[:-1], device=logits.device)
    loss = weight * soft_cross_entropy(logits, teacher, mask)
    matches = int((logits.argmax(-1) == teacher.argmax(-1)).sum())
    return loss, matches, mask.numel()


def block_loss(options: BlockOptions, module, target, rows, anchors) -> HeadLoss:
    """The loss of one batch of token rows `[B, L]` with blocks at `anchors` `[B, A]`."""
    size = options.block_size
    if options.flavour == "dflash":
        features, teacher = target_pass(target, rows, module.hidden_layers)
        outputs = dflash_block_outputs(module, target, features, rows, anchors)
        lm_head = target.get_output_embeddings()
        # The head is fp32; a bfloat16 target's LM head multiplies in its own precision.
        logits = lm_head(outputs[:, :, 1:].to(lm_head.weight.dtype)).float()
        # Block position j learns the target's distribution at anchor + j - 1.
        index = anchors[..., None] + torch.arange(size - 1, device=rows.device)
        per_depth = [
            (logits[:, :, j], _gather_positions(teacher, index[..., j])) for j in range(size - 1)
        ]
    else:
        _, teacher = target_pass(target, rows, ())
        real, masks = pard_block_logits(module, module.config.pard_token, size, rows, anchors)
        index = anchors[..., None] + torch.arange(1, size, device=rows.device)
        per_depth = [(real, teacher)] + [
            (masks[:, :, j], _gather_positions(teacher, index[..., j])) for j in range(size - 1)
        ]
    loss, correct, counts = 0.0, [], []
    for (logits, labels), weight in zip(
        per_depth, depth_weights(len(per_depth), options.loss_decay), strict=True
    ):
        depth_loss, matches, count = _depth_loss(logits, labels, weight)
        loss = loss + depth_loss
        correct.append(matches)
        counts.append(count)
    return HeadLoss(loss, correct, counts)


def _gather_positions(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`values[b, index[b, a]]`: values `[B, L, V]`, index int `[B, A]` -> `[B, A, V]`."""
    return values.gather(1, index[..., None].expand(-1, -1, values.shape[-1]))


def anchor_range(options: BlockOptions, seq_len: int) -> tuple[int, int]:
    """The anchors whose blocks have labels in a window of `seq_len` tokens (DFlash also needs
    one context entry); with generated data, the blocks that start in the continuation (the
    first is anchored at the prompt's last token)."""
    low = options.prompt_len - 1 if options.data == "generated" else 0
    if options.flavour == "dflash":
        return max(low, 1), seq_len - options.block_size + 1
    return low, seq_len - options.block_size


def train_block(
    options: BlockOptions,
    settings: TrainSettings,
    target,
    stream: np.ndarray,
    run_dir: str | Path,
    resume: bool = False,
    stop_at: int | None = None,
) -> tuple[nn.Module, int]:
    """Train a block drafter of `options.flavour` for the (frozen) `target` on windows of the
    int32 token `stream`; returns (fp32 module, steps done). See the module doc."""
    target.eval().requires_grad_(False)
    torch.manual_seed(settings.seed)
    module = build_block_model(options, target)

    def loss_at(step: int, rows: torch.Tensor) -> HeadLoss:
        low, high = anchor_range(options, rows.shape[1])
        anchors = anchors_at(step, settings.seed, rows.shape[0], options.anchors, low, high)
        return block_loss(options, module, target, rows, anchors.to(rows.device))

    steps = train_module(
        module,
        loss_at,
        options,
        settings,
        stream,
        run_dir,
        f"train block {options.flavour}",
        resume,
        stop_at,
    )
    return module, steps


def heldout_block_top1(options: BlockOptions, module, target, rows: list[torch.Tensor]):
    """Per-depth top-1 agreement with the target's greedy token over held-out token rows (fixed
    anchors per row)."""

    def loss_of(row: torch.Tensor) -> HeadLoss:
        low, high = anchor_range(options, row.shape[1])
        anchors = anchors_at(0, 0, 1, options.anchors, low, high).to(row.device)
        return block_loss(options, module, target, row, anchors)

    return heldout_top1(module, loss_of, rows)


def export_block(
    options: BlockOptions,
    module: nn.Module,
    tokenizer_dir: str | Path,
    out_dir: str | Path,
    draft_ids: list[int] | None = None,
) -> None:
    """Save the drafter in bf16 in its public layout, a DFlash head with the draft vocabulary
    `draft_ids` if given (`DFlashHead.set_draft_vocab`); a PARD model gets the target's
    tokenizer (`tokenizer_dir`), so that its folder loads as any HF model."""
    out_dir = Path(out_dir)
    bf16 = copy.deepcopy(module).to(device="cpu", dtype=torch.bfloat16).eval()
    if draft_ids is not None and options.flavour != "dflash":
        raise ValueError("draft_ids: only DFlash heads draft from a draft vocabulary")
    if options.flavour == "dflash":
        if draft_ids is not None:
            bf16.set_draft_vocab(draft_ids)
        bf16.save_pretrained(out_dir)
    else:
        from .tokenizer import load_tokenizer

        PardDraft(bf16, bf16.config.pard_token, options.block_size).save_pretrained(out_dir)
        load_tokenizer(tokenizer_dir).save_pretrained(str(out_dir))
    # safetensors writes 0600; installed package data must be readable by every user.
    for weights in out_dir.glob("*.safetensors"):
        weights.chmod(0o644)


DESCRIPTIONS = {
    "dflash": "A DFlash-style block drafter ({num_layers} layers over target layers {layers}, "
    "blocks of {block_size})",
    "pard": "A PARD-style block drafter (`{init}` fine-tuned to fill {masks} masks)",
}


def _run_block(args) -> int:
    options = BlockOptions(
        flavour=args.flavour,
        block_size=args.block_size,
        num_layers=args.num_layers,
        num_kv_heads=args.num_kv_heads,
        target_layers=args.target_layers,
        init=args.init,
        anchors=args.anchors,
        loss_decay=args.loss_decay,
        mask_token_id=args.mask_token_id,
        **data_options(args),
    )
    if args.draft_vocab < 0 or (args.draft_vocab and options.flavour != "dflash"):
        raise ValueError(
            f"--draft-vocab {args.draft_vocab}: a DFlash head's draft vocabulary, >= 0 "
            "(0: the whole vocabulary)"
        )
    args.lr = DEFAULT_LR[options.flavour] if args.lr is None else args.lr
    settings = run_settings(args)
    target_dir, target, stream = training_target(
        args.target, args.data_dir, args.target_dtype, args.data
    )
    stream = training_stream(options, settings, target, target_dir, stream, args.data_dir)
    module, steps_done = train_block(
        options, settings, target, stream, args.run_dir, resume=args.resume, stop_at=args.stop_at
    )
    if steps_done < settings.steps or args.out is None:
        return 0
    tokens = steps_done * settings.batch_size * settings.seq_len
    rows = heldout_rows(args, target_dir, target)
    agreement = heldout_block_top1(options, module, target, rows)
    out_dir = Path(args.out)
    draft_ids = None
    if args.draft_vocab:
        vocab = target.config.get_text_config(decoder=True).vocab_size
        draft_ids = frequent_tokens(stream, args.draft_vocab, vocab)
    export_block(options, module, target_dir, out_dir, draft_ids)
    chat = options.data == "chat"
    calibration = None
    if args.calibration_prompts > 0:
        calibration = calibrate_folder(
            out_dir,
            target,
            target_dir,
            prompts=args.calibration_prompts,
            new_tokens=args.calibration_tokens,
            used=options.sequences,
            seed=settings.seed,
            max_nodes=EVAL_NODES,
            chat=chat,
        ).to_dict()
    prompts = eval_prompts(args.target, args.eval_prompts, chat)
    layers = list(module.target_layers) if options.flavour == "dflash" else []
    info = {
        "command": command_line(),
        "flavour": options.flavour,
        "description": DESCRIPTIONS[options.flavour].format(
            **options.to_dict(), layers=layers, masks=options.block_size - 1
        ),
        "target": args.target,
        "options": options.to_dict(),
        "settings": dataclasses.asdict(settings),
        "tokens_trained": tokens,
        "data": data_description(options, settings, tokens),
        "heldout_top1": agreement,
        "draft_vocab": (
            {"size": args.draft_vocab, "source": DRAFT_VOCAB_SOURCE} if args.draft_vocab else None
        ),
        "heldout_windows": len(rows),
        "calibration": calibration,
        "heldout": HELDOUT_ROWS[chat],
        "engine": {
            **engine_acceptance(out_dir, target, prompts),
            "source": "held-out chat prompts" if chat else "held-out code prompts",
        },
        "parameters": sum(p.numel() for p in module.parameters()),
        "bytes": sum(p.stat().st_size for p in out_dir.glob("*.safetensors")),
    }
    (out_dir / "training_info.json").write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
    write_readme(out_dir, info)
    print(json.dumps({"heldout_top1": agreement, "engine": info["engine"]}), flush=True)
    return 0


def _layer_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None


def register_block_command(sub) -> None:
    """Add the `block` command to the training CLI."""
    parser = sub.add_parser("block", help="self-distill a DFlash- or PARD-style block drafter")
    parser.add_argument("--flavour", required=True, choices=FLAVOURS)
    parser.add_argument("--target", default="tiny-code", help="folder or bundled name")
    add_run_arguments(
        parser,
        batch_size=4,
        seq_len=256,
        lr=None,
        warmup_steps=10,
        checkpoint_minutes=3.0,
        log_every=5,
    )
    defaults = BlockOptions("dflash")
    parser.add_argument(
        "--block-size", type=int, help=f"tokens per block (default {DEFAULT_BLOCK_SIZES})"
    )
    parser.add_argument("--num-layers", type=int, default=defaults.num_layers, help="dflash")
    parser.add_argument(
        "--num-kv-heads", type=int, help="dflash: the head's KV heads (default: the target's)"
    )
    parser.add_argument(
        "--target-layers", type=_layer_list, help="dflash: comma-separated target layers"
    )
    parser.add_argument("--init", default=defaults.init, help="pard: the model to fine-tune")
    parser.add_argument("--anchors", type=int, default=defaults.anchors, help="blocks per window")
    parser.add_argument("--loss-decay", type=float, default=defaults.loss_decay)
    parser.add_argument("--mask-token-id", type=int, help="default: the target's pad token")
    parser.add_argument(
        "--draft-vocab",
        type=int,
        default=0,
        metavar="N",
        help="dflash: draft from the N most frequent tokens of the training stream (set at "
        "export: training sees the whole vocabulary; 0: the whole vocabulary)",
    )
    add_data_arguments(parser)
    parser.add_argument("--eval-windows", type=int, default=8, help="held-out windows")
    parser.add_argument("--eval-prompts", type=int, default=4, help="held-out code prompts")
    add_calibration_arguments(parser, prompt_seed=False)
    parser.set_defaults(run=_run_block)
