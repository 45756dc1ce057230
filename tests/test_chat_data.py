"""Chat prompts made from documented functions, kept apart by split, and the demo's prompts."""

import pytest

from specdec_fast.demo_chat import load_demo_prompts
from specdec_fast.train import chat_data, corpus

MODULE = '''"""Tools for tests.

More words.
"""


def spin_wheel(size, colour):
    """Spin the wheel of the given size and colour.

    Returns the angle it stops at.
    """


def _private(x):
    """Never used in a prompt, being private."""


def terse(x):
    """too short"""
'''


@pytest.fixture
def root(tmp_path):
    """A module tree with one module in each split (the split is a hash of the path)."""
    names = [f"mod{i}.py" for i in range(200)]
    heldout = next(n for n in names if corpus.is_heldout(n))
    train = next(n for n in names if not corpus.is_heldout(n))
    for name in (heldout, train):
        (tmp_path / name).write_text(MODULE.replace("spin_wheel", name[:-3] + "_spin"))
    return tmp_path, train[:-3], heldout[:-3]


def test_prompts_come_only_from_their_split(root):
    folder, train, heldout = root
    functions = list(chat_data.documented_functions("train", folder))
    assert [(f.module, f.name) for f in functions] == [(train, f"{train}_spin")]
    assert functions[0].signature == f"{train}_spin(size, colour)"
    assert functions[0].summary == "Spin the wheel of the given size and colour."
    assert functions[0].module_summary == "Tools for tests."
    held = chat_data.chat_prompts("heldout", 1, root=folder)
    assert heldout in held[0][0]["content"] and train not in str(held)
    with pytest.raises(ValueError, match="1 documented functions, fewer than 2"):
        chat_data.chat_prompts("train", 2, root=folder)


def test_every_shape_is_a_chat(root):
    folder, train, _ = root
    item = next(chat_data.documented_functions("train", folder))
    for shape in chat_data.SHAPES:
        messages = chat_data.chat_messages(item, shape)
        assert [m["role"] for m in messages][-1] == "user"
        assert item.name in messages[-1]["content"]
    assert "Context:\nSpin the wheel" in chat_data.chat_messages(item, "rag")[0]["content"]
    assert len(chat_data.chat_messages(item, "turns")) == 3
    with pytest.raises(ValueError, match="shape: expected one of"):
        chat_data.chat_messages(item, "poem")


def test_the_demo_prompts_cover_the_five_shapes():
    records = load_demo_prompts()
    assert [r["task"] for r in records] == ["code", "json", "explain", "rag", "multi-turn"]
    assert len(records[-1]["messages"]) == 3


def test_answers_resume_from_their_store_and_extend(tmp_path, monkeypatch):
    """An interrupted run keeps the batches it finished (the store), a rerun generates only the
    rest, and what it returns equals an uninterrupted run's answers."""
    from tiny_models import repetitive_prompts, tiny_llama

    from specdec_fast import generate

    monkeypatch.setattr(chat_data, "GENERATE_BATCH", 2)
    target = tiny_llama(64, seed=3)
    prompts = repetitive_prompts([5, 9, 7, 12, 6], 64, seed=2)
    want = [
        generate(target, [p], drafter=None, max_new_tokens=6, compile=False).sequences[0].tolist()
        for p in prompts
    ]
    store = tmp_path / "answers.npz"
    batches = []

    def save_then_stop(answered):
        chat_data._save_answers(store, answered)
        batches.append(sorted(answered))
        if len(batches) == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        chat_data.answer_prompts(target, prompts, 6, [], on_batch=save_then_stop)
    done = chat_data._load_answers(store)
    assert sorted(done) == batches[0] and len(done) == 2  # the two shortest prompts
    assert all(done[i] == want[i] for i in done)
    generated = []
    real_generate = generate

    def counting(model, batch, **kwargs):
        generated.extend(batch)
        return real_generate(model, batch, **kwargs)

    monkeypatch.setattr("specdec_fast.engine.generate", counting)
    assert chat_data.answer_prompts(target, prompts, 6, [], done=done) == want
    assert len(generated) == 3 and all(
        p not in generated for i, p in enumerate(prompts) if i in done
    )
