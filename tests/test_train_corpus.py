"""Corpus split, document packing and the tokenizer of the training code."""

import hashlib

import numpy as np
import pytest

from specdec_fast.train import corpus
from specdec_fast.train.tokenizer import (
    BOS_TOKEN,
    EOS_TOKEN,
    PAD_TOKEN,
    load_tokenizer,
    save_tokenizer,
    train_tokenizer,
)


def _fake_stdlib(root):
    files = [
        "os.py",
        "json/__init__.py",
        "json/decoder.py",
        "test/test_os.py",
        "idlelib/idle_test/test_x.py",
        "lib2to3/tests/data/f.py",
        "site-packages/pkg/mod.py",
        "email/data.txt",
    ] + [f"pkg{i}/mod{i}.py" for i in range(200)]
    for rel in files:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(f"# {rel}\nx = 1\n")
    return files


def test_heldout_rule_is_sha256_of_relative_path():
    for rel in ["os.py", "json/decoder.py", "asyncio/tasks.py"]:
        expected = int(hashlib.sha256(rel.encode()).hexdigest()[:8], 16) % 100 < 5
        assert corpus.is_heldout(rel) == expected


def test_splits_are_disjoint_sorted_and_skip_tests_and_site_packages(tmp_path):
    _fake_stdlib(tmp_path)
    train = corpus.list_files("train", tmp_path)
    heldout = corpus.list_files("heldout", tmp_path)
    assert train == sorted(train) and heldout == sorted(heldout)
    assert not set(train) & set(heldout)
    everything = set(train) | set(heldout)
    assert len(everything) == 203  # os.py, json/*.py and pkg*/mod*.py
    assert all(not rel.startswith(("test/", "site-packages/")) for rel in everything)
    assert all("idle_test" not in rel and "/tests/" not in rel for rel in everything)
    # 5% of 203 paths by hash: a wide band that a broken rule (0% or 50%) still misses.
    assert 2 <= len(heldout) <= 20
    with pytest.raises(ValueError, match="split"):
        corpus.list_files("validation", tmp_path)


def test_real_stdlib_split_holds_out_about_five_percent():
    train = corpus.list_files("train")
    heldout = corpus.list_files("heldout")
    assert len(train) > 300
    assert 0.02 < len(heldout) / (len(train) + len(heldout)) < 0.09


def test_pack_documents_wraps_each_document_in_bos_eos():
    stream = corpus.pack_documents([[5, 6], [7]], bos_id=0, eos_id=1)
    assert stream.dtype == np.int32
    assert stream.tolist() == [0, 5, 6, 1, 0, 7, 1]


def test_tokenizer_round_trip_and_special_tokens(tmp_path):
    texts = [f"def function_{i}(value):\n    return value * {i}\n" for i in range(300)]
    save_tokenizer(train_tokenizer(texts, vocab_size=4096), tmp_path)
    tokenizer = load_tokenizer(tmp_path)
    assert [tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token] == [
        BOS_TOKEN,
        EOS_TOKEN,
        PAD_TOKEN,
    ]
    assert [tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id] == [0, 1, 2]
    text = "def f(x):\n\treturn x  # ünïcode €\n"
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(texts, vocab_size=1000)
