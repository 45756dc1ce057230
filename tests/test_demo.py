"""`specdec-fast demo --model tiny-code`: the bundled pair with every bundled drafter, and a
user's own model (chat prompts when it has a template); both checks (greedy speculation equals
plain decoding, sampled speculation with deterministic drafts equals plain sampling) set the exit
status. The default demo, on the real chat target: tests/test_chat_target.py."""

import pytest
import torch
from test_cli import CHAT_TEMPLATE, tiny_tokenizer
from tiny_models import tiny_llama

from specdec_fast import NGramDrafter, bundled, generate
from specdec_fast.cli import main
from specdec_fast.demo import SAMPLE_SEED, SAMPLE_TEMPERATURE
from specdec_fast.drafters.registry import bundled_specs
from specdec_fast.loading import load_model, load_tokenizer
from specdec_fast.prompts import load_chat_prompts
from specdec_fast.text import encode_prompt, stop_token_ids

NEW_TOKENS = 8


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-chat-model")
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    tiny_llama(vocab_size=len(tokenizer), initializer_range=0.1).save_pretrained(folder)
    return folder


def table(out: str) -> dict[str, list[str]]:
    """The result table's rows by drafter name: the cells after the name."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("drafter ")) + 2
    rows = {}
    for line in lines[start:]:
        if not line.strip():
            break
        name, *cells = line.rsplit(maxsplit=6)
        rows[name.strip()] = cells
    return rows


@pytest.mark.skipif("tiny-code" not in bundled.available(), reason="no bundled target")
def test_demo_on_the_bundled_pair(capsys):
    code = main(
        [
            "demo",
            "--model",
            "tiny-code",
            "--prompts",
            "1",
            "--max-new-tokens",
            str(NEW_TOKENS),
            "--device",
            "cpu",
        ]
    )
    out = capsys.readouterr().out
    rows = table(out)
    assert list(rows) == ["plain", *(spec.label() for spec in bundled_specs())]
    assert all(cells[-2] in ("yes", "ref") for cells in rows.values())  # greedy is exact
    assert all(cells[-1] in ("yes", "ref", "-") for cells in rows.values())  # sampled, equal
    assert code == 0
    assert "held-out code prompts" in out and "sampled completion, temperature 0.7" in out
    assert rows["draft:tiny-code-draft k=4 (N=5)"][-1] == "-"  # a sampled chain: not checked


def test_demo_on_your_own_chat_model_checks_the_sampled_output(chat_model_dir, capsys):
    code = main(
        ["demo", "--model", str(chat_model_dir), "--prompts", "2", "--max-new-tokens",
         str(NEW_TOKENS), "--device", "cpu", "--drafter", "ngram", "--drafter",
         f"draft:{chat_model_dir}:2"]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    assert "your model" in out and "2 chat prompts (chat template)" in out
    assert load_chat_prompts(1)[0]["messages"][0]["content"] in out
    rows = table(out)
    assert list(rows) == ["plain", "ngram N=8", f"draft:{chat_model_dir.name} k=2 (N=3)"]
    # The sampled column says what plain and speculative sampling with that seed really give.
    target = load_model(str(chat_model_dir), torch.device("cpu"))
    tokenizer = load_tokenizer(str(chat_model_dir))
    ids = encode_prompt(tokenizer, messages=load_chat_prompts(1)[0]["messages"])
    samples = [
        generate(
            target, [ids], drafter=drafter, max_new_tokens=NEW_TOKENS,
            temperature=SAMPLE_TEMPERATURE, seed=SAMPLE_SEED,
            eos_token_id=stop_token_ids(target, tokenizer),
        ).sequences[0].tolist()
        for drafter in (None, NGramDrafter(max_nodes=8))
    ]  # fmt: skip
    assert samples[0] == samples[1] and rows["ngram N=8"][-1] == "yes"
    summary = next(line for line in out.splitlines() if line.startswith("sampled output"))
    assert summary.endswith(rows["ngram N=8"][-1])


def test_demo_without_a_template_uses_the_code_prompts(chat_model_dir, capsys):
    code = main(
        ["demo", "--model", str(chat_model_dir), "--no-chat", "--prompts", "1",
         "--max-new-tokens", "4", "--device", "cpu"]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0 and "1 held-out code prompts" in out
    assert list(table(out)) == ["plain", "ngram N=8", "suffix N=16"]
