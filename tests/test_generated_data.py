"""The target's greedy continuations as training data (`specdec_fast.train.generated`): prompts
drawn from the seed, sequences equal to HF greedy, the on-disk cache and its key, windows that
start at a sequence each, and the block command's `--data generated`."""

import dataclasses

import numpy as np
import pytest
from test_generate import hf_greedy
from tiny_models import repetitive_prompts, tiny_llama

from specdec_fast.loading import load_tokenizer
from specdec_fast.train import generated
from specdec_fast.train.block import BlockOptions, anchor_range, train_block
from specdec_fast.train.cli import build_parser
from specdec_fast.train.data import batch_at_step
from specdec_fast.train.generated import (
    GeneratedData,
    generated_data,
    generated_stream,
    generation_prompts,
    greedy_sequences,
    weights_digest,
)
from specdec_fast.train.heads import HeadOptions
from specdec_fast.train.lm import TrainSettings

VOCAB = 32
MASK = 5


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab_size=VOCAB, layers=2).eval()


@pytest.fixture(scope="module")
def target_dir(target, tmp_path_factory):
    folder = tmp_path_factory.mktemp("target")
    target.save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture(scope="module")
def stream():
    return np.array(sum(repetitive_prompts([40] * 20, VOCAB, seed=3), []), dtype=np.int32)


def test_prompts_are_windows_of_the_stream_drawn_from_the_seed(stream):
    data = GeneratedData(count=9, prompt_len=7, new_tokens=3, seed=4, prompts="windows")
    prompts = generation_prompts(stream, data)
    assert prompts.shape == (9, 7) and prompts.dtype == np.int64
    windows = {tuple(stream[s : s + 7]) for s in range(len(stream) - 6)}
    assert all(tuple(row) in windows for row in prompts)
    np.testing.assert_array_equal(prompts, generation_prompts(stream, data))
    other = generation_prompts(stream, dataclasses.replace(data, seed=5))
    assert not np.array_equal(prompts, other)
    with pytest.raises(ValueError, match="at least 7 tokens"):
        generation_prompts(stream[:6], data)
    with pytest.raises(ValueError, match="count must be >= 1"):
        GeneratedData(count=0)


def test_code_prompts_are_cut_from_the_training_modules():
    tokenizer = load_tokenizer("tiny-code")
    data = GeneratedData(count=6, prompt_len=40, new_tokens=8, seed=3)
    prompts = generation_prompts(None, data, tokenizer)
    assert prompts.shape == (6, 40)
    np.testing.assert_array_equal(prompts, generation_prompts(None, data, tokenizer))
    for row in prompts.tolist():
        # Each ends after a docstring's first line, as the shipped prompts do.
        last_lines = tokenizer.decode(row).splitlines()[-2:]
        assert last_lines[0].lstrip().startswith("def ") and '"""' in last_lines[1]
    with pytest.raises(ValueError, match="fewer than the 1000000 asked for"):
        generation_prompts(None, dataclasses.replace(data, count=10**6), tokenizer)
    with pytest.raises(ValueError, match="need the target's tokenizer"):
        generation_prompts(None, data)
    with pytest.raises(ValueError, match="prompts: expected one of"):
        GeneratedData(prompts="web")


def test_sequences_are_the_targets_greedy_continuations(target, stream):
    prompts = generation_prompts(
        stream, GeneratedData(count=70, prompt_len=9, new_tokens=6, prompts="windows")
    )
    rows = greedy_sequences(target, prompts, 6)  # two engine batches: 64 and 6
    assert rows.shape == (70, 15) and rows.dtype == np.int32
    picked = [0, 1, 63, 64, 69]
    assert rows[picked].tolist() == hf_greedy(target, prompts[picked].tolist(), 6)


def test_the_stream_is_cached_under_the_weights_and_the_settings(
    target, target_dir, stream, tmp_path, monkeypatch
):
    data = GeneratedData(count=5, prompt_len=8, new_tokens=4, seed=1, prompts="windows")
    packed = generated_stream(target, target_dir, stream, data, tmp_path)
    assert packed.shape == (5 * 12,) and len(list(tmp_path.glob("generated-*.npy"))) == 1

    def no_generation(*args):
        raise AssertionError("generated again")

    monkeypatch.setattr(generated, "greedy_sequences", no_generation)
    again = generated_stream(target, target_dir, stream, data, tmp_path)
    np.testing.assert_array_equal(again, packed)
    with pytest.raises(AssertionError, match="generated again"):
        generated_stream(target, target_dir, stream, dataclasses.replace(data, seed=2), tmp_path)
    with pytest.raises(ValueError, match="no safetensors weights"):
        weights_digest(tmp_path)


def test_block_training_on_generated_data(target, target_dir, stream, tmp_path):
    options = BlockOptions(
        "dflash",
        block_size=4,
        num_layers=1,
        target_layers=[0, 1],
        anchors=4,
        mask_token_id=MASK,
        data="generated",
        sequences=12,
        prompt_len=10,
        prompts="windows",
    )
    settings = TrainSettings(steps=3, batch_size=2, seq_len=24, lr=1e-2, warmup_steps=1)
    data = generated_data(options, settings)
    assert (data.count, data.prompt_len, data.new_tokens) == (12, 10, 14)
    packed = generated_stream(target, target_dir, stream, data, tmp_path)
    # Every training window starts at a sequence: its first tokens are a prompt.
    prompts = {tuple(p) for p in generation_prompts(stream, data).tolist()}
    rows = batch_at_step(packed, 0, settings.batch_size, settings.seq_len, settings.seed)
    assert all(tuple(row[:10]) in prompts for row in rows.tolist())
    # Blocks start at the prompt's last token or later.
    assert anchor_range(options, 25) == (9, 22)
    assert anchor_range(BlockOptions("dflash", block_size=4), 25) == (1, 22)
    pard = BlockOptions("pard", block_size=4, data="generated", prompt_len=10)
    assert anchor_range(pard, 25) == (9, 21)
    module, steps = train_block(options, settings, target, packed, tmp_path / "run")
    assert steps == 3
    with pytest.raises(ValueError, match="leaves no continuation"):
        generated_data(options, TrainSettings(steps=1, seq_len=10))
    with pytest.raises(ValueError, match="data: expected one of"):
        BlockOptions("pard", data="web")


def test_the_command_line_takes_generated_data():
    parser = build_parser()
    base = ["block", "--flavour", "pard", "--run-dir", "r", "--steps", "3"]
    args = parser.parse_args(base)
    assert (args.data, args.sequences, args.prompt_len, args.prompts) == (
        "corpus",
        4096,
        96,
        "code",
    )
    more = ["--data", "generated", "--sequences", "10", "--prompt-len", "5"]
    args = parser.parse_args([*base, *more])
    assert (args.data, args.sequences, args.prompt_len) == ("generated", 10, 5)
    with pytest.raises(SystemExit):
        parser.parse_args([*base, "--data", "web"])
    args = parser.parse_args(["eagle", "--run-dir", "r", "--steps", "3", *more])
    assert (args.data, args.sequences, args.prompt_len) == ("generated", 10, 5)
    with pytest.raises(ValueError, match="data: expected one of"):
        HeadOptions("eagle", data="web")


def test_the_description_counts_passes_over_the_generated_pool():
    """A run longer than one pass over the generated stream says so: the README's token count is
    what was trained, not how much data there is."""
    options = BlockOptions("dflash", data="generated", sequences=10, prompt_len=6)
    settings = TrainSettings(steps=15, batch_size=2, seq_len=8, lr=1e-3)
    text = generated.data_description(options, settings, 15 * 2 * 8)
    assert text.startswith("240 tokens trained (3 passes) over 80 tokens of the target's own")
    assert "2 tokens after each of 10 6-token code prompts" in text
