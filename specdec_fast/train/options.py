"""The options every training command shares (folders, schedule, seed, resume) and the command
line recorded in training_info.json."""

import argparse
import shlex
import sys

# The precisions a training command can run its (frozen) target in.
TARGET_DTYPES = ("float32", "bfloat16")


def command_line() -> str:
    """The running training command, as recorded with an exported model."""
    return shlex.join(["python", "-m", "specdec_fast.train", *sys.argv[1:]])


def add_run_arguments(
    parser: argparse.ArgumentParser,
    *,
    batch_size: int,
    seq_len: int,
    lr: float,
    warmup_steps: int,
    checkpoint_minutes: float,
    log_every: int = 10,
) -> None:
    """The options every training command shares: folders, schedule, seed, resume (read back
    with `run_settings`)."""
    parser.add_argument("--run-dir", required=True, help="checkpoint and log folder")
    parser.add_argument("--out", help="export the finished model to this folder")
    parser.add_argument("--data-dir", default="runs/data", help="token stream cache")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--batch-size", type=int, default=batch_size)
    parser.add_argument("--seq-len", type=int, default=seq_len)
    parser.add_argument("--lr", type=float, default=lr)
    parser.add_argument("--warmup-steps", type=int, default=warmup_steps)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=log_every)
    parser.add_argument("--checkpoint-minutes", type=float, default=checkpoint_minutes)
    parser.add_argument("--resume", action="store_true", help="continue from run-dir's checkpoint")
    parser.add_argument("--stop-at", type=int, help="stop (checkpointed) at this step")


def run_settings(args: argparse.Namespace):
    """The `TrainSettings` of options added by `add_run_arguments`."""
    from .lm import TrainSettings

    return TrainSettings(
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        seed=args.seed,
        log_every=args.log_every,
        checkpoint_minutes=args.checkpoint_minutes,
    )
