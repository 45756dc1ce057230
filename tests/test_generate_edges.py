"""`generate` on stops, streaming, statistics and bad input."""

import json

import pytest
import torch
from drafter_wrappers import OracleChain
from tiny_models import repetitive_prompts, tiny_llama

from specdec_fast import DraftModelDrafter, NGramDrafter, SpecStats, UnusableLogits, generate

VOCAB = 96


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab_size=VOCAB)


def plain_continuation(model, prompt, tokens):
    out = generate(model, [prompt], drafter=None, max_new_tokens=tokens, eos_token_id=[])
    return out.sequences[0].tolist()[len(prompt) :]


def test_eos_and_stop_sequences_cut_inside_an_accepted_path(target):
    prompt = repetitive_prompts([10], VOCAB, seed=1)[0]
    future = plain_continuation(target, prompt, 30)
    full = prompt + future

    def continuation(tokens):
        return full[len(tokens) :]

    eos = future[5]
    first_eos = future.index(eos)
    out = generate(
        target, [prompt], drafter=OracleChain(continuation, 13), max_new_tokens=30, eos_token_id=eos
    )
    assert out.sequences[0].tolist() == full[: len(prompt) + first_eos + 1]
    assert out.stats.sequences[0].finish_reason == "eos"
    stop = future[7:9]
    out = generate(
        target,
        [prompt],
        drafter=OracleChain(continuation, 13),
        max_new_tokens=30,
        eos_token_id=[],
        stop=[stop],
    )
    generated = out.sequences[0].tolist()[len(prompt) :]
    assert generated[-2:] == stop
    assert generated == future[: len(generated)]
    assert out.stats.sequences[0].finish_reason == "stop"


def test_rows_finish_independently_and_streaming_sees_every_token(target):
    prompts = repetitive_prompts([4, 9, 13], VOCAB, seed=2)
    streamed = {row: [] for row in range(3)}
    out = generate(
        target,
        prompts,
        drafter=NGramDrafter(),
        max_new_tokens=[5, 20, 11][0] + 15,
        eos_token_id=[],
        on_tokens=lambda row, toks: streamed[row].extend(toks),
    )
    for row, prompt in enumerate(prompts):
        assert streamed[row] == out.sequences[row].tolist()[len(prompt) :]
        assert len(streamed[row]) == 20


def test_stats_are_complete_and_json_ready(target):
    prompts = repetitive_prompts([6, 12], VOCAB, seed=3)
    out = generate(
        target, prompts, drafter=NGramDrafter(max_nodes=4), max_new_tokens=16, eos_token_id=[]
    )
    stats = out.stats
    assert isinstance(stats, SpecStats)
    summary = stats.summary()
    for key in (
        "acceptance_rate",
        "mean_accepted_tokens_per_step",
        "per_position_acceptance",
        "ttft_s",
        "tpot_s",
        "itl_s",
        "tokens_per_second",
        "fallbacks",
        "steps",
        "drafted_tokens",
        "accepted_tokens",
        "peak_memory_bytes",
    ):
        assert key in summary
    assert set(summary["itl_s"]) == {"p50", "p95", "p99"}
    assert stats.new_tokens == 32
    assert len(stats.itl) == 2 * 15  # every token after the first of each sequence
    assert all(x >= 0 for x in stats.itl)
    assert stats.mean_accepted_per_step >= 1.0
    json.dumps(stats.to_dict())


def test_sampling_is_reproducible_with_a_seed(target):
    prompts = repetitive_prompts([5, 8], VOCAB, seed=4)
    runs = [
        generate(
            target,
            prompts,
            drafter=NGramDrafter(),
            max_new_tokens=12,
            temperature=1.0,
            top_p=0.9,
            seed=123,
            eos_token_id=[],
        ).sequences
        for _ in range(2)
    ]
    assert [s.tolist() for s in runs[0]] == [s.tolist() for s in runs[1]]


def test_max_new_tokens_zero_returns_the_prompts(target):
    out = generate(target, [[1, 2, 3]], drafter=NGramDrafter(), max_new_tokens=0)
    assert out.sequences[0].tolist() == [1, 2, 3]
    assert out.stats.new_tokens == 0


def test_full_cache_stops_the_sequence(target):
    prompt = repetitive_prompts([10], VOCAB, seed=5)[0]
    out = generate(
        target, [prompt], drafter=None, max_new_tokens=50, max_cache_len=20, eos_token_id=[]
    )
    assert out.stats.sequences[0].finish_reason == "cache"
    # 20 slots hold the prompt and all but the last generated token (the uncached root).
    assert out.sequences[0].tolist() == prompt + plain_continuation(target, prompt, 50)[:11]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"input_ids": [[]]}, "prompt 0 has no tokens"),
        ({"input_ids": []}, "batch is empty"),
        ({"input_ids": [[1, 2, 500]]}, "outside"),
        ({"input_ids": torch.zeros(2, 3, 4, dtype=torch.long)}, r"\[B, T\]"),
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"temperature": [0.0, 1.0, 1.0]}, "temperature"),
        ({"max_cache_len": 4}, "max_cache_len"),
        ({"stop": [[]]}, "stop"),
    ],
)
def test_bad_input_is_a_clear_error(target, kwargs, match):
    call = {"input_ids": [[1, 2, 3, 4, 5, 6]], "drafter": None, "max_new_tokens": 4} | kwargs
    with pytest.raises(ValueError, match=match):
        generate(target, **call)
    assert target.config._attn_implementation != "specdec_tree"


def test_mismatched_draft_vocabulary_is_named(target):
    other = tiny_llama(vocab_size=VOCAB + 4, hidden_size=32, seed=9)
    with pytest.raises(ValueError, match="vocabularies differ in size: draft 100, target 96"):
        generate(target, [[1, 2, 3]], drafter=DraftModelDrafter(other), max_new_tokens=4)
    assert other.config._attn_implementation != "specdec_tree"


def test_model_without_the_attention_interface_is_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    class NoInterface(GPT2LMHeadModel):
        _supports_attention_backend = False

    model = NoInterface(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).eval()
    with pytest.raises(ValueError, match=r"gpt2|attention"):
        generate(model, [[1, 2, 3]], drafter=None, max_new_tokens=2)


class FailingDraft(DraftModelDrafter):
    """A draft-model chain that raises `error` in one of its protocol calls."""

    def __init__(self, draft, where: str, error: BaseException):
        super().__init__(draft, num_tokens=2)
        self.where, self.error = where, error

    def _maybe_fail(self, where: str) -> None:
        if where == self.where:
            raise self.error

    def begin(self, state):
        super().begin(state)
        self._maybe_fail("begin")

    def propose(self, state):
        self._maybe_fail("propose")
        return super().propose(state)

    def update(self, state, outcome):
        super().update(state, outcome)
        self._maybe_fail("update")


@pytest.mark.parametrize("where", ["begin", "propose", "update"])
@pytest.mark.parametrize(
    "error", [RuntimeError("drafter failed"), KeyboardInterrupt()], ids=["error", "interrupt"]
)
def test_models_leave_a_failed_generate_as_they_entered(target, where, error):
    """Whatever a drafter raises, and wherever: the target and the draft model get their own
    attention back, answer plain HF calls, and serve the next `generate` exactly."""
    draft = tiny_llama(vocab_size=VOCAB, hidden_size=32, layers=1, seed=5)
    prompt = repetitive_prompts([9], VOCAB, seed=4)[0]
    attention = target.config._attn_implementation, draft.config._attn_implementation
    with pytest.raises(type(error)):
        generate(target, [prompt], drafter=FailingDraft(draft, where, error), max_new_tokens=8)
    assert (target.config._attn_implementation, draft.config._attn_implementation) == attention
    with torch.no_grad():
        for model in (target, draft):
            model(torch.tensor([prompt]))  # raises if our attention were still switched on
    out = generate(
        target, [prompt], drafter=DraftModelDrafter(draft, num_tokens=2), max_new_tokens=8
    )
    assert out.sequences[0].tolist()[len(prompt) :] == plain_continuation(target, prompt, 8)


def overflowing_float16_model():
    """A float16 `tiny_llama` whose MLP outputs overflow float16 (beyond 65504): its logits
    are NaN from the first step."""
    model = tiny_llama(vocab_size=VOCAB)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.down_proj.weight.mul_(3000.0)
    return model.half()


@pytest.mark.parametrize(
    "drafter, temperature, read_ahead", [(None, 0.0, False), (4, 1.0, False), (None, 0.0, True)]
)
def test_logits_that_overflow_float16_are_a_clear_error(drafter, temperature, read_ahead):
    # The verify kernel marks such a row with next token -1: before the engine looked, the
    # next step embedded -1 (IndexError eagerly, an inductor bounds assertion when compiled).
    # With read-ahead the step queued behind that row must not embed it either.
    model = overflowing_float16_model()
    with pytest.raises(UnusableLogits, match=r"^sequence 0: the target's logits were NaN or inf"):
        generate(
            model,
            repetitive_prompts([9, 6], VOCAB, seed=1),
            drafter=None if drafter is None else NGramDrafter(drafter),
            max_new_tokens=8,
            temperature=temperature,
            seed=0,
            read_ahead=read_ahead,
        )


@pytest.mark.parametrize("read_ahead", [False, True])
def test_the_sequence_whose_logits_are_nan_is_named(target, read_ahead):
    clean = [5, 6, 7, 5, 6, 7]
    poison = next(t for t in range(VOCAB) if t not in clean + plain_continuation(target, clean, 6))
    model = tiny_llama(vocab_size=VOCAB)
    with torch.no_grad():
        model.model.embed_tokens.weight[poison] = float("nan")
    with pytest.raises(UnusableLogits, match=r"^sequence 1: .* after 0 generated tokens"):
        generate(
            model,
            [clean, [poison, *clean]],
            drafter=None,
            max_new_tokens=6,
            eos_token_id=[],
            read_ahead=read_ahead,
        )
