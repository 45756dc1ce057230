"""`python -m specdec_fast.train COMMAND`: tokenizer, lm, eval, the head commands, block,
calibrate-block, unlikelihood, prompts.

Each command is a registrar that adds its subparser and sets `run`; further commands (drafter
heads) append their registrar to `REGISTRARS`.
"""

import argparse
import json
import sys
from collections.abc import Callable

import torch

from .options import add_run_arguments, command_line, run_settings


def _run_tokenizer(args) -> int:
    from . import corpus
    from .tokenizer import save_tokenizer, train_tokenizer

    save_tokenizer(train_tokenizer(corpus.read_texts("train"), args.vocab_size), args.out)
    print(f"tokenizer saved to {args.out}", file=sys.stderr)
    return 0


def register_tokenizer(sub) -> None:
    parser = sub.add_parser("tokenizer", help="train the byte-level BPE on the corpus' train split")
    parser.add_argument("--out", required=True, help="output folder (tokenizer.json, config)")
    parser.add_argument("--vocab-size", type=int, default=4096, help="4096 to 8192")
    parser.set_defaults(run=_run_tokenizer)


def _run_lm(args) -> int:
    import dataclasses

    from . import corpus
    from .data import token_stream
    from .export import export_checkpoint
    from .lm import model_config, train_lm
    from .tokenizer import load_tokenizer

    tokenizer = load_tokenizer(args.tokenizer)
    config = model_config(
        args.preset,
        len(tokenizer),
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
    )
    settings = run_settings(args)
    stream = token_stream("train", args.tokenizer, args.data_dir)
    model, steps_done = train_lm(
        config, settings, stream, args.run_dir, resume=args.resume, stop_at=args.stop_at
    )
    if steps_done < settings.steps or args.out is None:
        return 0
    info = {
        "command": command_line(),
        "preset": args.preset,
        "settings": dataclasses.asdict(settings),
        "tokens_trained": steps_done * settings.batch_size * settings.seq_len,
        "train_tokens_in_corpus": int(len(stream)),
        "heldout_percent": corpus.HELDOUT_PERCENT,
    }
    export_checkpoint(model, args.tokenizer, args.out, info)
    print(f"model exported to {args.out}", file=sys.stderr)
    return 0


def register_lm(sub) -> None:
    parser = sub.add_parser("lm", help="train a causal LM preset and export it")
    parser.add_argument("--preset", required=True, choices=["target", "draft", "tiny"])
    parser.add_argument("--tokenizer", required=True, help="folder written by `tokenizer`")
    add_run_arguments(
        parser, batch_size=8, seq_len=1024, lr=3e-3, warmup_steps=30, checkpoint_minutes=5.0
    )
    parser.set_defaults(run=_run_lm)


def _run_eval(args) -> int:
    from .evaluate import evaluate_models

    record_command = command_line() if args.record else None
    results = evaluate_models(
        args.model, args.draft, args.data_dir, args.seq_len, args.max_windows, record_command
    )
    print(json.dumps(results, indent=2))
    return 0


def register_eval(sub) -> None:
    parser = sub.add_parser(
        "eval", help="held-out loss of a model folder (and draft/target greedy agreement)"
    )
    parser.add_argument("--model", required=True, help="checkpoint folder")
    parser.add_argument("--draft", help="a draft checkpoint folder to compare with --model")
    parser.add_argument("--data-dir", default="runs/data", help="token stream cache")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--max-windows", type=int, help="evaluate only the first N windows")
    parser.add_argument(
        "--record", action="store_true", help="write the results into training_info.json"
    )
    parser.set_defaults(run=_run_eval)


def register_heads(sub) -> None:
    from .heads import register_head_commands

    register_head_commands(sub)


def register_block(sub) -> None:
    from .block import register_block_command

    register_block_command(sub)


def register_calibrate(sub) -> None:
    from .calibrate import register_calibrate_command

    register_calibrate_command(sub)


def register_unlikelihood(sub) -> None:
    from .unlikelihood import register_unlikelihood_command

    register_unlikelihood_command(sub)


def register_prompts(sub) -> None:
    from .prompts import register_prompts as register

    register(sub)


def register_chat_data(sub) -> None:
    from .chat_data import register_chat_data_command

    register_chat_data_command(sub)


REGISTRARS: list[Callable] = [
    register_tokenizer,
    register_lm,
    register_eval,
    register_heads,
    register_block,
    register_calibrate,
    register_unlikelihood,
    register_prompts,
    register_chat_data,
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m specdec_fast.train", description="Train the bundled model family."
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="CPU threads for torch (the CPU may be shared)"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for register in REGISTRARS:
        register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    # Late in a run, gradients and optimizer moments go subnormal; x86 arithmetic on
    # subnormals is about 3x slower per training step here. Flush them to zero.
    torch.set_flush_denormal(True)
    return args.run(args)
