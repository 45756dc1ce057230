"""Held-out evaluation helpers: loss, greedy predictions, draft/target agreement and greedy
repetition."""

import math

import torch
from transformers import LlamaForCausalLM

from specdec_fast.train.evaluate import (
    code_prompt_repeats,
    greedy_agreement,
    loss_and_predictions,
    max_ngram_repeats,
)
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


def test_max_ngram_repeats_counts_the_most_frequent_ngram():
    assert max_ngram_repeats([1, 2, 3, 1, 2, 3, 1, 2], n=2) == 3
    assert max_ngram_repeats(list(range(20)), n=8) == 1
    assert max_ngram_repeats([5] * 20, n=8) == 13
    assert max_ngram_repeats([1, 2, 3], n=8) == 0


def test_code_prompt_repeats_measures_greedy_continuations_up_to_eos():
    from specdec_fast import bundled
    from specdec_fast.prompts import load_code_prompts
    from specdec_fast.train.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(bundled.path("tiny-code"))
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        model_config("tiny", len(tokenizer), 0, tokenizer.eos_token_id, tokenizer.pad_token_id)
    ).eval()
    counts = code_prompt_repeats(model, tokenizer, limit=2, new_tokens=20)
    expected = []
    for record in load_code_prompts(2):
        ids = tokenizer(record["prompt"], return_tensors="pt").input_ids
        new = []
        with torch.no_grad():
            for _ in range(20):
                token = int(model(ids).logits[0, -1].argmax())
                if token == tokenizer.eos_token_id:
                    break
                new.append(token)
                ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
        expected.append(max_ngram_repeats(new))
    assert counts == expected
