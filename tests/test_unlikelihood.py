"""Unlikelihood fine-tuning against greedy repetition: the repeat mask, the loss, its effect on a
looping model, exact resume and the training prompts."""

import json
import sys

import numpy as np
import pytest
import torch
from transformers import LlamaForCausalLM

from specdec_fast.train.lm import LOG_NAME, model_config
from specdec_fast.train.prompts import training_prompts
from specdec_fast.train.unlikelihood import (
    UnlikelihoodSettings,
    greedy_continuations,
    repeated_ngram_mask,
    train_unlikelihood,
    unlikelihood_loss,
)

VOCAB = 512
PROMPT_LEN = 12


def _model(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(model_config("tiny", VOCAB, 0, 1, 2))


def _stream() -> np.ndarray:
    return np.random.default_rng(0).integers(3, VOCAB, size=4000).astype(np.int32)


def _prompts(count: int = 16) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(1).integers(3, VOCAB, size=(count, PROMPT_LEN)))


def _settings(steps: int, **overrides) -> UnlikelihoodSettings:
    fields = dict(
        steps=steps,
        batch_size=2,
        seq_len=32,
        lr=1e-2,
        warmup_steps=0,
        log_every=1,
        ul_batch=4,
        prompt_len=PROMPT_LEN,
        new_tokens=24,
        ngram=2,
    )
    return UnlikelihoodSettings(**{**fields, **overrides})


def test_mask_marks_the_tokens_of_ngrams_seen_before_and_only_after_the_prompt():
    rows = torch.tensor([[5, 6, 7, 5, 6, 8, 5, 6], [1, 2, 3, 4, 5, 6, 7, 8]])
    mask = repeated_ngram_mask(rows, start=0, n=2)
    # (5, 6) recurs at 3-4 and 6-7; nothing recurs in the second row.
    assert mask[0].tolist() == [False, False, False, True, True, False, True, True]
    assert not mask[1].any()
    # A repeat that straddles the prompt's end marks only its continuation part.
    assert repeated_ngram_mask(rows, start=4, n=2)[0].tolist() == [0, 0, 0, 0, 1, 0, 1, 1]
    assert not repeated_ngram_mask(rows, start=0, n=3).any()


def test_loss_is_the_mean_of_minus_log_one_minus_p_over_marked_tokens():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11, dtype=torch.float64)
    rows = torch.randint(0, 11, (2, 6))
    mask = torch.zeros(2, 6, dtype=torch.bool)
    mask[0, 2] = mask[1, 5] = True
    probs = logits.softmax(-1)
    expected = (
        -(torch.log(1 - probs[0, 1, rows[0, 2]]) + torch.log(1 - probs[1, 4, rows[1, 5]])) / 2
    )
    assert float(unlikelihood_loss(logits, rows, mask)) == pytest.approx(float(expected))
    # Nothing marked: zero, and still part of the graph.
    logits.requires_grad_(True)
    zero = unlikelihood_loss(logits, rows, torch.zeros_like(mask))
    assert float(zero.detach()) == 0.0 and zero.requires_grad
    # A probability of 1 stays finite.
    certain = torch.full((1, 1, 3), -1e4, dtype=torch.float64)
    certain[0, 0, 1] = 0.0
    value = unlikelihood_loss(certain, torch.tensor([[0, 1]]), torch.tensor([[False, True]]))
    assert torch.isfinite(value) and float(value) > 10


def test_a_gradient_step_on_the_loss_lowers_the_marked_tokens_probability_only():
    torch.manual_seed(0)
    rows = torch.randint(0, 9, (1, 7))
    logits = torch.randn(1, 6, 9)
    logits[0, 2, rows[0, 3]] += 5.0  # a confident repeat, as in a loop
    logits.requires_grad_(True)
    mask = torch.zeros(1, 7, dtype=torch.bool)
    mask[0, 3] = True
    unlikelihood_loss(logits, rows, mask).backward()
    before = logits.detach().softmax(-1)
    after = (logits.detach() - 1.0 * logits.grad).softmax(-1)
    assert before[0, 2, rows[0, 3]] > 0.5
    assert after[0, 2, rows[0, 3]] < before[0, 2, rows[0, 3]] - 0.1
    # Only the position predicting the marked token moves.
    untouched = [t for t in range(6) if t != 2]
    torch.testing.assert_close(after[0, untouched], before[0, untouched])


def test_training_runs_both_losses_and_logs_the_repeated_share(tmp_path):
    """A random tiny model loops under greedy decoding (every continuation token sits in a
    repeated bigram), so the unlikelihood term is active from the first step. Whether the
    fine-tune breaks a real model's loops is checked on the bundled target
    (tests/test_bundled.py)."""
    model = _model()
    steps = train_unlikelihood(model, _settings(4), _stream(), _prompts(), tmp_path)
    assert steps == 4
    records = [json.loads(line) for line in (tmp_path / LOG_NAME).read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert {"loss", "unlikelihood", "repeated_share", "lr", "grad_norm"} <= set(records[0])
    assert records[0]["repeated_share"] > 0.3 and records[0]["unlikelihood"] > 0
    # The language-modelling loss on random tokens starts near ln(512) = 6.24 nats.
    assert 5.5 < records[0]["loss"] < 7.0


def test_resume_reproduces_an_uninterrupted_run(tmp_path):
    stream, prompts = _stream(), _prompts()
    whole = _model()
    train_unlikelihood(whole, _settings(6), stream, prompts, tmp_path / "whole")
    split = _model()
    assert train_unlikelihood(split, _settings(6), stream, prompts, tmp_path / "s", stop_at=2) == 2
    resumed = _model()
    steps = train_unlikelihood(resumed, _settings(6), stream, prompts, tmp_path / "s", resume=True)
    assert steps == 6
    for name, value in whole.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[name], value, rtol=0, atol=0)
    with pytest.raises(ValueError, match="trained with"):
        train_unlikelihood(_model(), _settings(7), stream, prompts, tmp_path / "s", resume=True)
    with pytest.raises(ValueError, match="ul_batch"):
        train_unlikelihood(_model(), _settings(2, ul_batch=17), stream, prompts, tmp_path / "x")


def test_training_prompts_end_after_a_docstrings_first_line():
    from specdec_fast import bundled
    from specdec_fast.train.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(bundled.path("tiny-code"))
    body = "\n".join(f"x_{i} = {i}" for i in range(80))
    text = f'{body}\n\ndef f(a):\n    """Add one."""\n    return a + 1\n'
    rows = training_prompts([text, "no function here\n"], tokenizer, 20)
    assert rows.shape == (1, 20)
    assert tokenizer.decode(rows[0].tolist()).endswith('def f(a):\n    """Add one."""\n')
    with pytest.raises(ValueError, match="no training prompt"):
        training_prompts(["x = 1\n"], tokenizer, 20)


def test_greedy_continuations_extend_each_prompt_by_its_argmax_and_keep_the_mode():
    model = _model().train()
    prompts = _prompts(3)
    rows = greedy_continuations(model, prompts, 5)
    assert rows.shape == (3, PROMPT_LEN + 5) and torch.equal(rows[:, :PROMPT_LEN], prompts)
    assert model.training
    model.eval()
    with torch.no_grad():
        predicted = model(rows[:, :-1]).logits.argmax(-1)[:, PROMPT_LEN - 1 :]
    assert torch.equal(predicted, rows[:, PROMPT_LEN:])


def test_the_command_fine_tunes_a_bundled_model_and_records_the_run(tmp_path, monkeypatch):
    """`python -m specdec_fast.train unlikelihood` end to end on the bundled draft, 2 steps."""
    from specdec_fast import bundled
    from specdec_fast.train.cli import build_parser
    from specdec_fast.train.export import read_info

    out = tmp_path / "out"
    argv = ["unlikelihood", "--model", "tiny-code-draft", "--run-dir", str(tmp_path / "run")]
    argv += ["--out", str(out), "--data-dir", str(tmp_path / "data"), "--steps", "2"]
    argv += ["--ul-batch", "2", "--batch-size", "1", "--seq-len", "64"]
    monkeypatch.setattr(sys, "argv", ["python -m specdec_fast.train", *argv])  # what is recorded
    # Parsed and run as `main` does, without its process-wide thread and denormal settings.
    args = build_parser().parse_args(argv)
    assert args.run(args) == 0
    info = read_info(out)
    base = read_info(bundled.path("tiny-code-draft"))
    assert info["command"] == base["command"] and "evaluation" not in info
    # The bundled draft was fine-tuned once already: the history grows by this run.
    assert info["unlikelihood"][:-1] == base["unlikelihood"]
    run = info["unlikelihood"][-1]
    assert run["settings"]["steps"] == 2 and run["training_prompts"] > 100
    assert run["command"] == "python -m specdec_fast.train " + " ".join(argv)
    tuned = LlamaForCausalLM.from_pretrained(out)
    assert tuned.config.num_hidden_layers == 2 and (out / "tokenizer.json").exists()
