"""The command line: `specdec-fast generate` on a small model folder written by the test."""

import json
import subprocess
import sys

import pytest
from tiny_models import tiny_llama
from tokenizers import ByteLevelBPETokenizer
from transformers import PreTrainedTokenizerFast

from specdec_fast.cli import main


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-model")
    text = ["def add(a, b):\n    return a + b\n", "for i in range(10):\n    print(i)\n"] * 20
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(text, vocab_size=300, min_frequency=1, special_tokens=["<eos>"])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>")
    tokenizer.save_pretrained(folder)
    tiny_llama(vocab_size=len(tokenizer)).save_pretrained(folder)
    return folder


def cli(*args):
    """Run the command line in a fresh interpreter, as a user would."""
    return subprocess.run(
        [sys.executable, "-m", "specdec_fast", *args], capture_output=True, text=True, check=False
    )


def cli_in_process(capsys, *args):
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("drafter", ["none", "ngram:4", "suffix", "draft:{model}:2"])
def test_generate_json(model_dir, drafter, capsys):
    code, out, err = cli_in_process(
        capsys,
        "generate",
        "--model",
        str(model_dir),
        "--drafter",
        drafter.format(model=model_dir),
        "--prompt",
        "def add(a, b):",
        "--max-new-tokens",
        "12",
        "--json",
        "--device",
        "cpu",
    )
    assert code == 0, err
    record = json.loads(out)
    assert record["prompt"] == "def add(a, b):"
    new_tokens = record["stats"]["new_tokens"]
    assert 1 <= new_tokens <= 12
    assert f"{new_tokens}/12 tokens" in err  # the progress line


def test_generate_text_output(model_dir):
    result = cli(
        "generate",
        "--model",
        str(model_dir),
        "--prompt",
        "for i in",
        "--max-new-tokens",
        "6",
        "--device",
        "cpu",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("for i in")
    assert "tok/s" in result.stdout


def test_missing_model_is_a_clear_error(tmp_path, capsys):
    code, _, err = cli_in_process(
        capsys, "generate", "--model", str(tmp_path / "nope"), "--prompt", "x"
    )
    assert code == 2
    assert "neither a folder nor a bundled model" in err
