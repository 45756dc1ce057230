"""The width a drafted tree is verified at (`ModelRunner.verify_width`): padding nodes added where
they make the step cheaper (MKL's 10-15-row band on fp32 CPU models), never changing an output."""

import pytest
import torch
from tiny_models import repetitive_prompts, tiny_llama

import specdec_fast.runner as runner_module
from specdec_fast import NGramDrafter, generate
from specdec_fast.onednn import ONEDNN_ENV, onednn_available
from specdec_fast.runner import ModelRunner

VOCAB = 96
NEW_TOKENS = 48
SLOW_ROWS = set(runner_module.MKL_SLOW_ROWS)

needs_mkl = pytest.mark.skipif(
    not torch.backends.mkl.is_available(), reason="the padding rule follows MKL's GEMM"
)


@pytest.fixture(autouse=True)
def mkl_linears(monkeypatch):
    """The widening is for torch's own float32 linear (MKL): eager runners send it to oneDNN
    (`specdec_fast.onednn`) unless SPECDEC_ONEDNN=0; compiled runners keep it."""
    monkeypatch.setenv(ONEDNN_ENV, "0")


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab_size=VOCAB)


def opened(model, capacity=64, **kwargs) -> ModelRunner:
    runner = ModelRunner(model, capacity, compile=False, **kwargs)
    runner.prefill(torch.tensor([[1, 2, 3]]), torch.ones(1, 3, dtype=torch.int64))
    return runner


@needs_mkl
@pytest.mark.parametrize(
    ("batch", "nodes", "width"),
    [
        (1, 1, 1),  # plain decoding of a few rows stays one node
        (8, 1, 1),
        (10, 1, 2),  # plain decoding of 10-15 rows: 2 nodes each
        (15, 1, 2),
        (16, 1, 1),
        (1, 8, 8),  # 8 rows: below the band
        (1, 10, 16),
        (1, 11, 16),
        (1, 15, 16),
        (1, 16, 16),
        (1, 20, 20),
        (2, 5, 8),  # 10 rows -> 16
        (2, 7, 8),
        (3, 4, 6),  # 12 rows -> 18
        (5, 2, 4),  # 10 rows -> 20
        (4, 4, 4),  # 16 rows already
    ],
)
def test_fp32_cpu_trees_in_mkls_slow_band_are_widened(target, batch, nodes, width):
    with opened(target) as runner:
        assert runner.verify_width(batch, nodes, widest=nodes) == width


def test_no_widening_off_fp32_in_exact_mode_or_without_room(target):
    bf16 = tiny_llama(vocab_size=VOCAB).to(torch.bfloat16)
    with opened(bf16) as runner:
        assert runner.verify_width(1, 11, widest=11) == 11
    with opened(target, exact=True) as runner:
        assert runner.verify_width(1, 11, widest=11) == 11
    # 2 prompt tokens cached, 17 slots: 11 nodes fit, 16 do not.
    with opened(target, capacity=17) as runner:
        assert runner.verify_width(1, 11, widest=11) == 11


def record_widths(monkeypatch) -> list[int]:
    widths = []
    verify = ModelRunner.verify

    def recording(self, tokens, parents, q_lens=None):
        widths.append(tokens.shape[1])
        return verify(self, tokens, parents, q_lens)

    monkeypatch.setattr(ModelRunner, "verify", recording)
    return widths


def run(target, temperature=0.0):
    prompts = repetitive_prompts([40], VOCAB, seed=5)
    out = generate(
        target,
        prompts,
        drafter=NGramDrafter(max_nodes=12, max_depth=11),
        max_new_tokens=NEW_TOKENS,
        temperature=temperature,
        seed=7,
        eos_token_id=[],
    )
    return [s.tolist() for s in out.sequences], out.stats


@needs_mkl
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_widened_steps_emit_what_unwidened_ones_do(target, monkeypatch, temperature):
    """The same call with the band on and off (an empty band): identical tokens, greedy and
    sampled with one seed, and the same accepted drafts; the widened run verified 16 nodes."""
    widths = record_widths(monkeypatch)
    widened, widened_stats = run(target, temperature)
    assert 16 in widths and not set(widths) & SLOW_ROWS
    monkeypatch.setattr(runner_module, "MKL_SLOW_ROWS", range(0))
    widths.clear()
    plain, plain_stats = run(target, temperature)
    assert 16 not in widths and set(widths) & SLOW_ROWS
    assert widened == plain
    first, second = widened_stats.sequences[0], plain_stats.sequences[0]
    assert (first.drafted, first.accepted) == (second.drafted, second.accepted)
    if temperature == 0.0:
        expected = target.generate(
            torch.tensor([plain[0][:40]]), do_sample=False, max_new_tokens=NEW_TOKENS
        )[0].tolist()
        assert widened[0] == expected


@needs_mkl
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_plain_decoding_of_12_rows_widened_emits_the_same(target, monkeypatch, temperature):
    """Plain decoding of 12 rows (ragged prompts, rows finishing at different steps through
    stops) runs 2-node steps in the band and 1-node steps outside it: the same tokens as with
    the band off, greedy and sampled with one seed."""
    widths = record_widths(monkeypatch)
    prompts = repetitive_prompts([9 + 3 * r for r in range(12)], VOCAB, seed=8)
    stops = [[5, 7]]

    def plain():
        out = generate(
            target,
            prompts,
            drafter=None,
            max_new_tokens=24,
            temperature=temperature,
            seed=3,
            stop=stops,
            eos_token_id=[],
        )
        return [s.tolist() for s in out.sequences]

    widened = plain()
    assert 2 in widths
    monkeypatch.setattr(runner_module, "MKL_SLOW_ROWS", range(0))
    widths.clear()
    assert plain() == widened and set(widths) == {1}


@pytest.mark.skipif(not onednn_available(), reason="this torch has no oneDNN")
def test_eager_runners_on_onednn_verify_at_the_trees_own_width(target, monkeypatch):
    monkeypatch.setenv(ONEDNN_ENV, "1")
    with opened(target) as runner:
        assert runner.verify_width(1, 11, widest=11) == 11
