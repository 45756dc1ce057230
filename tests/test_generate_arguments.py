"""`generate`'s one validation layer (`specdec_fast.arguments`): every malformed argument is a
TypeError or ValueError naming it, raised before anything is allocated; string stops are
tokenized or refused; concurrent calls on one model are refused clearly."""

import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_models import tiny_llama

from specdec_fast import DraftModelDrafter, NGramDrafter, generate
from specdec_fast.drafters.base import Drafter, root_only

VOCAB = 64
PROMPT = [3, 4, 5, 3, 4, 5, 3]


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab_size=VOCAB, hidden_size=16, layers=1)


def plain(model, prompt, tokens, **kwargs):
    out = generate(model, [prompt], drafter=None, max_new_tokens=tokens, eos_token_id=[], **kwargs)
    return out.sequences[0].tolist()[len(prompt) :]


class TooWide(Drafter):
    def __init__(self):
        self.max_nodes, self.max_depth = 200, 1

    def propose(self, state):
        return root_only(state)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"input_ids": [PROMPT * 80]},
            ValueError,
            r"input_ids: prompt 0 has 560 tokens, more than the model's "
            r"max_position_embeddings = 512",
        ),
        (
            {"max_new_tokens": None},
            TypeError,
            r"max_new_tokens: expected an int >= 0, got NoneType None",
        ),
        ({"max_new_tokens": 2.0}, TypeError, r"max_new_tokens: expected an int"),
        (
            {"max_cache_len": 10**6},
            ValueError,
            r"max_cache_len: expected at most the model's max_position_embeddings = 512",
        ),
        (
            {"max_cache_len": 6},
            ValueError,
            r"max_cache_len: 6 cannot hold the longest prompt \(7 tokens\)",
        ),
        ({"seed": "7"}, TypeError, r"seed: expected an int"),
        ({"seed": [1, 2]}, ValueError, r"seed: expected a scalar or 1 values, got 2"),
        (
            {"eos_token_id": "2"},
            TypeError,
            r"eos_token_id: expected None, an int token id or a list",
        ),
        ({"eos_token_id": VOCAB}, ValueError, r"eos_token_id: token ids outside \[0, 64\)"),
        (
            {"input_ids": [[1, "2", 3]]},
            TypeError,
            r"input_ids\[0\]\[1\]: expected an int token id, got str '2'",
        ),
        ({"input_ids": [1, 2, 3]}, TypeError, r"input_ids: expected a list of token lists"),
        ({"input_ids": torch.ones(1, 3)}, TypeError, r"input_ids: expected an integer tensor"),
        ({"temperature": 1e-40}, ValueError, r"temperature: expected"),
        ({"temperature": float("nan")}, ValueError, r"temperature: expected"),
        ({"top_k": 1.5}, TypeError, r"top_k: expected an int"),
        ({"stop": "the end"}, ValueError, r"stop: the string 'the end' needs a tokenizer"),
        ({"stop": [[1], 2.5]}, TypeError, r"stop\[1\]: expected a sequence of int token ids"),
        ({"drafter": TooWide()}, ValueError, r"drafter.max_nodes: expected an int in \[1, 128\]"),
        ({"drafter": "ngram"}, TypeError, r"drafter: expected None or a drafter"),
    ],
)
def test_malformed_arguments_name_themselves(target, kwargs, error, match):
    call = {"input_ids": [PROMPT], "drafter": None, "max_new_tokens": 4} | kwargs
    with pytest.raises(error, match=match):
        generate(target, **call)
    assert target.config._attn_implementation != "specdec_tree"


def test_built_in_drafters_refuse_trees_beyond_tree_attention():
    with pytest.raises(ValueError, match=r"max_nodes must be <= 128 \(tree attention"):
        NGramDrafter(max_nodes=200)


def test_drafter_constructors_name_a_wrong_argument(target):
    with pytest.raises(TypeError, match=r"max_nodes: expected an int, got str '8'"):
        NGramDrafter(max_nodes="8")
    with pytest.raises(TypeError, match=r"draft_model: expected a loaded model .*got str"):
        DraftModelDrafter("tiny-code-draft", num_tokens=2)
    with pytest.raises(TypeError, match=r"num_tokens: expected an int, got float 2.0"):
        DraftModelDrafter(target, num_tokens=2.0)
    with pytest.raises(ValueError, match=r"num_tokens and tree: give one"):
        DraftModelDrafter(target, num_tokens=2, tree="[[0], [1], [0, 0]]")
    assert DraftModelDrafter(target).num_tokens == 4  # a chain of 4 unless told otherwise


def test_a_kv_cache_beyond_memory_is_refused_with_its_bytes():
    model = tiny_llama(vocab_size=VOCAB, hidden_size=16, layers=1)
    model.config.max_position_embeddings = 2**62  # positions no longer bound the cache
    with pytest.raises(
        ValueError,
        match=r"max_new_tokens: the KV cache .* would take \d+ bytes \(.*TB\), more than the "
        r"machine's memory",
    ):
        generate(model, [PROMPT], drafter=None, max_new_tokens=2**40)


def test_a_long_default_cache_is_cut_to_the_positions(target):
    out = generate(target, [PROMPT], drafter=None, max_new_tokens=10**9, eos_token_id=[])
    assert out.stats.sequences[0].finish_reason == "cache"
    # Every token the model was fed sat at a position < 512; the last one emitted is not fed.
    assert len(out.sequences[0]) == 512 + 1
    # A drafter's trees near the last position are cut there: the same tokens. A prompt that
    # leaves room for fewer nodes than a tree is taken as plain decoding takes it.
    lookup = generate(
        target, [PROMPT], drafter=NGramDrafter(16), max_new_tokens=10**9, eos_token_id=[]
    )
    assert lookup.sequences[0].tolist() == out.sequences[0].tolist()
    long = out.sequences[0].tolist()[:510]
    tail = generate(target, [long], drafter=NGramDrafter(16), max_new_tokens=8, eos_token_id=[])
    assert tail.sequences[0].tolist() == out.sequences[0].tolist()


def test_any_int_seed_is_hashed(target):
    first = plain(target, PROMPT, 6, temperature=1.0, seed=2**100)
    assert first == plain(target, PROMPT, 6, temperature=1.0, seed=2**100)


class WordTokenizer:
    """`encode` of a fixed word list, for string stops."""

    def __init__(self, words):
        self.words = words

    def encode(self, text, add_special_tokens=True):
        return self.words[text]


def test_string_stops_are_tokenized_with_the_tokenizer(target):
    continuation = plain(target, PROMPT, 12)
    stop_at = continuation[4:6]
    tokenizer = WordTokenizer({"halt": stop_at})
    out = generate(
        target, [PROMPT], drafter=NGramDrafter(), max_new_tokens=12, eos_token_id=[],
        stop=["halt", [VOCAB - 1] * 3], tokenizer=tokenizer,
    )  # fmt: skip
    generated = out.sequences[0].tolist()[len(PROMPT) :]
    first = next(i for i in range(len(continuation)) if continuation[i : i + 2] == stop_at)
    assert generated == continuation[: first + 2]
    assert out.stats.sequences[0].finish_reason == "stop"


class Blocking(NGramDrafter):
    """An n-gram drafter that waits in its first `propose` until released."""

    def __init__(self):
        super().__init__()
        self.inside, self.release = threading.Event(), threading.Event()

    def propose(self, state):
        self.inside.set()
        assert self.release.wait(timeout=30)
        return super().propose(state)


def test_concurrent_generate_on_one_model_is_refused(target):
    """A second thread's call while one runs raises a RuntimeError saying so; the first call
    finishes exactly, and the model comes out with its own attention."""
    attention = target.config._attn_implementation
    drafter, results = Blocking(), {}

    def first():
        results["out"] = generate(
            target, [PROMPT], drafter=drafter, max_new_tokens=8, eos_token_id=[]
        )

    thread = threading.Thread(target=first)
    thread.start()
    assert drafter.inside.wait(timeout=30)
    try:
        with pytest.raises(
            RuntimeError,
            match="already driven by an open specdec-fast ModelRunner in another thread",
        ):
            generate(target, [PROMPT], drafter=None, max_new_tokens=4)
    finally:
        drafter.release.set()
        thread.join(timeout=60)
    assert results["out"].sequences[0].tolist()[len(PROMPT) :] == plain(target, PROMPT, 8)
    assert target.config._attn_implementation == attention


# Malformed values per argument: each must be refused with the argument's name in the message.
MALFORMED = {
    "input_ids": st.sampled_from(
        [
            [],
            [[]],
            [[-1, 2]],
            [[VOCAB]],
            [["a"]],
            "text",
            7,
            torch.zeros(2, 2, 2, dtype=torch.long),
            torch.ones(1, 3),
            [[1.5]],
        ]
    ),
    "max_new_tokens": st.one_of(
        st.integers(max_value=-1), st.floats(), st.none(), st.text(max_size=2), st.booleans()
    ),
    "temperature": st.one_of(
        st.just(10**400),
        st.floats(max_value=-1e-9),
        st.just(float("nan")),
        st.just(float("inf")),
        st.floats(min_value=1e-44, max_value=1e-39),
        st.text(max_size=2),
        st.lists(st.floats(0, 1), min_size=2, max_size=3),
    ),
    "top_k": st.one_of(st.integers(max_value=-1), st.floats(allow_nan=False), st.text(max_size=2)),
    "top_p": st.one_of(
        st.floats(max_value=0.0),
        st.floats(min_value=1.0001),
        st.just(float("nan")),
        st.text(max_size=2),
    ),
    "seed": st.one_of(
        st.floats(), st.text(max_size=2), st.lists(st.integers(0, 9), min_size=2, max_size=3)
    ),
    "eos_token_id": st.one_of(
        st.integers(max_value=-1),
        st.integers(min_value=VOCAB),
        st.floats(),
        st.text(min_size=1, max_size=2),
    ),
    "stop": st.sampled_from([[[]], "word", [1.5], {"a": 1}, [[VOCAB]], [["x"]], b"ab"]),
    "max_cache_len": st.one_of(
        st.integers(max_value=0), st.integers(min_value=513), st.floats(), st.text(max_size=2)
    ),
    "attention_mask": st.sampled_from([torch.ones(1, 3), [[1] * len(PROMPT)], "mask"]),
    "compile": st.sampled_from(["yes", 1, 0.0]),
    "on_tokens": st.sampled_from(["print", 3]),
}


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_random_malformed_arguments_are_named(target, data):
    name = data.draw(st.sampled_from(sorted(MALFORMED)), label="argument")
    value = data.draw(MALFORMED[name], label=name)
    call = {"input_ids": [PROMPT], "drafter": None, "max_new_tokens": 3, name: value}
    if name == "attention_mask":
        call["input_ids"] = torch.tensor([PROMPT])
    with pytest.raises((TypeError, ValueError)) as raised:
        generate(target, **call)
    assert str(raised.value).startswith(name), (name, value, raised.value)
    assert target.config._attn_implementation != "specdec_tree"
