"""The causal-LM training loop: batches, schedule, learning, exact resume, progress output."""

import json

import numpy as np
import pytest
import torch

from specdec_fast.train.data import batch_at_step, num_windows
from specdec_fast.train.lm import LOG_NAME, TrainSettings, lr_at, model_config, train_lm

VOCAB = 4096


@pytest.fixture(autouse=True)
def one_thread():
    # Tiny models gain nothing from threads, and on a shared CPU extra threads only stall.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _stream(length: int = 4000) -> np.ndarray:
    # Learnable text: a fixed random 17-token phrase repeated, with noise tokens in between.
    rng = np.random.default_rng(0)
    phrase = rng.integers(3, VOCAB, size=17)
    pieces = [np.concatenate([phrase, rng.integers(3, VOCAB, size=3)]) for _ in range(length // 20)]
    return np.concatenate(pieces).astype(np.int32)


def _tiny_config():
    return model_config("tiny", VOCAB, bos_token_id=0, eos_token_id=1, pad_token_id=2)


def _settings(steps: int) -> TrainSettings:
    return TrainSettings(steps=steps, batch_size=4, seq_len=32, warmup_steps=3, log_every=1)


def test_batches_depend_only_on_step_and_cover_each_window_once_per_epoch():
    stream = np.arange(1001, dtype=np.int32)
    windows = num_windows(stream, 10)
    steps_per_epoch = windows // 4
    rows = [batch_at_step(stream, step, 4, 10, seed=3) for step in range(steps_per_epoch)]
    assert all(torch.equal(rows[s], batch_at_step(stream, s, 4, 10, seed=3)) for s in range(3))
    starts = torch.cat([r[:, 0] for r in rows]).tolist()
    assert len(set(starts)) == len(starts) == steps_per_epoch * 4
    assert all(start % 10 == 0 for start in starts)
    # Each row is a contiguous slice: the input and its shifted target.
    assert torch.equal(rows[0][:, 1:] - rows[0][:, :-1], torch.ones(4, 10, dtype=torch.int64))
    assert not torch.equal(rows[0], batch_at_step(stream, 0, 4, 10, seed=4))
    with pytest.raises(ValueError, match="stream"):
        batch_at_step(stream[:30], 0, 4, 10, seed=0)


def test_lr_warms_up_then_decays_to_the_floor():
    settings = TrainSettings(steps=100, lr=1e-3, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(0, settings) == pytest.approx(1e-4)
    assert lr_at(9, settings) == pytest.approx(1e-3)
    assert lr_at(55, settings) == pytest.approx(0.55e-3)
    assert lr_at(100, settings) == pytest.approx(1e-4)


def test_training_decreases_loss_and_logs(tmp_path):
    _, steps = train_lm(_tiny_config(), _settings(30), _stream(), tmp_path)
    assert steps == 30
    losses = [json.loads(line)["loss"] for line in (tmp_path / LOG_NAME).read_text().splitlines()]
    assert len(losses) == 30
    # Uniform guessing costs ln(4096) = 8.3 nats; the repeated phrase makes ~85% of tokens
    # predictable, so 30 steps must bring the loss well below the start.
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 1.0


def test_resume_reproduces_an_uninterrupted_run(tmp_path):
    stream = _stream()
    whole, _ = train_lm(_tiny_config(), _settings(8), stream, tmp_path / "whole")
    _, stopped = train_lm(_tiny_config(), _settings(8), stream, tmp_path / "split", stop_at=3)
    assert stopped == 3
    resumed, steps = train_lm(_tiny_config(), _settings(8), stream, tmp_path / "split", resume=True)
    assert steps == 8
    for (name, expected), actual in zip(
        whole.state_dict().items(), resumed.state_dict().values(), strict=True
    ):
        assert torch.equal(expected, actual), name
    with pytest.raises(ValueError, match="settings|trained with"):
        train_lm(_tiny_config(), _settings(9), stream, tmp_path / "split", resume=True)
