"""Training loop for the bundled Llama causal LMs: seeded, resumable, CPU or GPU.

A run folder holds `checkpoint.pt` (model, optimizer, step, RNG; written atomically every few
minutes and at the end) and `train_log.jsonl` (one line per logged step). The batch of every step
is a function of (seed, step), so a resumed run reproduces an uninterrupted one exactly.
"""

import dataclasses
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from specdec_fast.files import read_torch

from .data import batch_at_step
from .progress import StepLog

# Llama shapes: grouped-query attention, head_dim in {32, 64} (the tree-attention kernel's sizes).
PRESETS = {
    "target": dict(
        hidden_size=256,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=704,
    ),
    "draft": dict(
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=320,
    ),
    # For tests and smoke runs only.
    "tiny": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        intermediate_size=128,
    ),
}
CHECKPOINT_NAME = "checkpoint.pt"
LOG_NAME = "train_log.jsonl"


def model_config(
    preset: str, vocab_size: int, bos_token_id: int, eos_token_id: int, pad_token_id: int
) -> LlamaConfig:
    """The LlamaConfig of `preset` (context 2048, tied embeddings) for a given tokenizer."""
    if preset not in PRESETS:
        raise ValueError(f"preset: expected one of {sorted(PRESETS)}, got {preset!r}")
    return LlamaConfig(
        vocab_size=vocab_size,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        **PRESETS[preset],
    )


@dataclasses.dataclass
class TrainSettings:
    steps: int
    batch_size: int = 16
    seq_len: int = 512
    lr: float = 3e-3
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    log_every: int = 10
    checkpoint_minutes: float = 5.0


def lr_at(step: int, settings: TrainSettings) -> float:
    """Linear warmup to `lr`, then cosine decay to `lr * min_lr_ratio` at the last step."""
    if step < settings.warmup_steps:
        return settings.lr * (step + 1) / settings.warmup_steps
    progress = (step - settings.warmup_steps) / max(settings.steps - settings.warmup_steps, 1)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
    return settings.lr * (settings.min_lr_ratio + (1.0 - settings.min_lr_ratio) * cosine)


def _optimizer(model: torch.nn.Module, settings: TrainSettings) -> torch.optim.AdamW:
    # Decay matrices only; norms' gains stay undecayed.
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": settings.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=settings.lr, betas=(0.9, 0.95), eps=1e-8)


def _save_checkpoint(path: Path, model, optimizer, step: int, settings, config) -> None:
    state = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "step": step,
        "cpu_rng": torch.get_rng_state(),
        "settings": dataclasses.asdict(settings),
        "config": config.to_dict(),
    }
    tmp_path = path.with_suffix(".tmp")
    torch.save(state, tmp_path)
    tmp_path.replace(path)


def _load_checkpoint(path: Path, model, optimizer, settings, config) -> int:
    state = read_torch(path)
    if state["config"] != config.to_dict():
        raise ValueError(f"{path}: the checkpoint's model config differs from this run's")
    if state["settings"] != dataclasses.asdict(settings):
        raise ValueError(
            f"{path}: the checkpoint was trained with {state['settings']}, "
            f"this run asks for {dataclasses.asdict(settings)}"
        )
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["cpu_rng"])
    return state["step"]


def train_lm(
    config: LlamaConfig,
    settings: TrainSettings,
    stream: np.ndarray,
    run_dir: str | Path,
    resume: bool = False,
    stop_at: int | None = None,
    device: torch.device | None = None,
) -> tuple[LlamaForCausalLM, int]:
    """Train a causal LM on windows of the int32 token `stream`; return (fp32 model, steps done).

    With `resume`, continue from `run_dir/checkpoint.pt` when it exists. `stop_at` ends the run
    early at that step (checkpointed), e.g. to split a long run into sessions.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(settings.seed)
    model = LlamaForCausalLM(config).to(device)
    optimizer = _optimizer(model, settings)
    checkpoint = run_dir / CHECKPOINT_NAME
    step = 0
    if resume and checkpoint.exists():
        step = _load_checkpoint(checkpoint, model, optimizer, settings, config)
    end = settings.steps if stop_at is None else min(stop_at, settings.steps)
    # bf16 autocast on the GPU; fp32 on the CPU, where bf16 matmuls are slow.
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    tokens_per_step = settings.batch_size * settings.seq_len
    log = StepLog(
        run_dir / LOG_NAME, settings.steps, step, tokens_per_step, f"train {run_dir.name}"
    )
    last_checkpoint = time.monotonic()
    model.train()
    while step < end:
        rows = batch_at_step(stream, step, settings.batch_size, settings.seq_len, settings.seed)
        rows = rows.to(device)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, settings)
        with autocast:
            logits = model(input_ids=rows[:, :-1]).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), rows[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), settings.grad_clip)
        optimizer.step()
        step += 1
        log.add(loss.item())
        if step % settings.log_every == 0 or step == end:
            log.record(step, lr=lr_at(step - 1, settings), grad_norm=round(float(grad_norm), 4))
        if time.monotonic() - last_checkpoint > settings.checkpoint_minutes * 60:
            _save_checkpoint(checkpoint, model, optimizer, step, settings, config)
            last_checkpoint = time.monotonic()
    log.close()
    _save_checkpoint(checkpoint, model, optimizer, step, settings, config)
    return model, step
