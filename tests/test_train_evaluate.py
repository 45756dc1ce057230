"""Held-out evaluation helpers: loss, greedy predictions and draft/target agreement."""

import math

import torch
from transformers import LlamaForCausalLM

from specdec_fast.train.evaluate import greedy_agreement, loss_and_predictions
from specdec_fast.train.lm import model_config


def test_agreement_counts_matching_positions():
    target = [torch.tensor([1, 2, 3]), torch.tensor([4])]
    draft = [torch.tensor([1, 0, 3]), torch.tensor([5])]
    assert greedy_agreement(target, draft) == 0.5


def test_fresh_model_loss_is_near_uniform_and_predictions_are_argmax():
    torch.manual_seed(0)
    model = LlamaForCausalLM(model_config("tiny", 4096, 0, 1, 2)).eval()
    rows = [torch.randint(3, 4096, (17,)), torch.randint(3, 4096, (5,))]
    loss, predictions = loss_and_predictions(model, rows)
    # Initial weights are small (std 0.02), so logits are nearly flat: loss close to ln(V).
    assert abs(loss - math.log(4096)) < 0.1
    assert [p.shape[0] for p in predictions] == [16, 4]
    with torch.no_grad():
        expected = model(input_ids=rows[0][None, :-1]).logits[0].argmax(-1)
    assert torch.equal(predictions[0], expected)
    assert greedy_agreement(predictions, predictions) == 1.0
