"""Fitting a block drafter's best-first tree depth scale (`specdec_fast.train.calibrate`): the
drafted blocks are the engine's, the accepted lengths are greedy verification's, the fit picks
the grid's best, and the command records it where `BlockDrafter` reads it."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from test_block import BLOCK, MODELS, VOCAB, RecordingDrafter, shard_weights
from tiny_models import repetitive_prompts, tiny_llama

from specdec_fast import BlockDrafter, bundled, generate
from specdec_fast.drafters.block import load_block_model
from specdec_fast.train import calibrate
from specdec_fast.train.calibrate import (
    DEPTH_SCALES,
    Calibration,
    accepted_lengths,
    block_log_probs,
    chat_sequences,
    fit_depth_scale,
    training_draft_vocab,
)
from specdec_fast.train.cli import build_parser
from specdec_fast.trees import PAD_NODE, best_first_tree


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab_size=VOCAB, layers=4)


def test_accepted_lengths_follow_the_labelled_path():
    # Root 9; depth 1: 4 (node 1), 5 (node 2); depth 2 below 5: 6 (node 3); node 4 is padding.
    tokens = torch.tensor([[9, 4, 5, 6, 6]] * 4)
    parents = torch.tensor([[-1, 0, 0, 2, PAD_NODE]] * 4)
    labels = torch.tensor([[5, 6, 1], [4, 6, 1], [7, 6, 1], [5, 7, 1]])
    assert accepted_lengths(tokens, parents, labels).tolist() == [2, 1, 0, 1]


def test_a_drafter_sure_of_the_labels_accepts_its_tree_depth():
    labels = torch.tensor([[3, 1, 4, 1, 5], [2, 7, 1, 8, 2]])
    log_probs = torch.full((2, 5, 10), -20.0).scatter(2, labels[..., None], 0.0)
    for nodes, expected in ((2, 1), (4, 3), (16, 5)):
        tokens, parents = best_first_tree(log_probs, torch.zeros(2, dtype=torch.long), nodes)
        assert accepted_lengths(tokens, parents, labels).tolist() == [expected] * 2


@pytest.mark.parametrize("flavour", [*MODELS, "dflash-vocab"])
def test_the_blocks_are_what_the_engine_drafts(target, flavour):
    """Teacher-forced over the finished sequence, each block equals the engine's at the step
    whose root sat there (a draft vocabulary's: over its ids, -inf elsewhere)."""
    model = MODELS[flavour.split("-")[0]](target)
    ids = torch.arange(VOCAB)
    if flavour == "dflash-vocab":
        ids = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(3))[:20]
        model.set_draft_vocab(ids)
    drafter = RecordingDrafter(model, max_nodes=8)
    prompts = repetitive_prompts([11], VOCAB, seed=9)
    out = generate(target, prompts, drafter=drafter, max_new_tokens=24)
    rows = out.sequences[0][None].long()
    assert out.stats.accepted_tokens > 0
    off = torch.ones(VOCAB, dtype=torch.bool)
    off[ids] = False
    for tokens, logits in drafter.steps:
        anchors = torch.tensor([[len(tokens) - 1]])
        got = block_log_probs(model, target, rows, anchors)[0, 0]
        want = torch.log_softmax(logits, -1)
        torch.testing.assert_close(got[:, ids], want, rtol=1e-4, atol=1e-4)
        assert bool((got[:, off] == -torch.inf).all())


@pytest.mark.parametrize("flavour", list(MODELS))
def test_the_fit_takes_the_scale_whose_trees_accept_most(target, flavour):
    model = MODELS[flavour](target)
    prompt_len, new_tokens = 10, 22
    prompts = repetitive_prompts([prompt_len] * 3, VOCAB, seed=5)
    out = generate(target, prompts, drafter=None, max_new_tokens=new_tokens)
    sequences = torch.stack(out.sequences).long()
    fit = fit_depth_scale(model, target, sequences, prompt_len, max_nodes=10)
    depth = min(BLOCK - 1 if flavour == "dflash" else BLOCK, 9)
    assert fit.anchors == 3 * (prompt_len + new_tokens - 1 - depth - prompt_len + 1)
    assert set(fit.tokens_per_step) == set(DEPTH_SCALES)
    best = max(fit.tokens_per_step.values())
    assert fit.tokens_per_step[fit.depth_scale] == best
    assert all(fit.depth_scale >= s for s, v in fit.tokens_per_step.items() if v == best)
    # A 2-node tree is the top-1 token at depth 1 whatever the scale: its tokens per step are
    # 1 + the top-1 hit rate, counted here straight from the blocks.
    two = fit_depth_scale(model, target, sequences, prompt_len, max_nodes=2)
    anchors = torch.arange(prompt_len, prompt_len + new_tokens - 1 - 1 + 1).expand(3, -1)
    top1 = block_log_probs(model, target, sequences, anchors)[:, :, 0].argmax(-1)
    hits = (top1 == sequences.gather(1, anchors + 1)).float().mean().item()
    assert set(two.tokens_per_step.values()) == {round(1 + hits, 4)}
    assert two.depth_scale == 1.0  # ties keep the largest scale
    # Rows of their own lengths and prompt lengths: the anchors after each prompt.
    ragged = [sequences[0], sequences[1, :-5], sequences[2]]
    uneven = fit_depth_scale(model, target, ragged, [prompt_len, prompt_len, 14], max_nodes=10)
    assert uneven.anchors == fit.anchors - 5 - (14 - prompt_len)
    same = fit_depth_scale(model, target, list(sequences), [prompt_len] * 3, max_nodes=10)
    assert same == fit
    with pytest.raises(ValueError, match="leaves no room for a block"):
        fit_depth_scale(model, target, sequences[:, : prompt_len + 2], prompt_len)


def bundled_copy(name: str, tmp_path):
    """A writable copy of a bundled drafter's folder (skips without the bundled pair)."""
    if name not in bundled.available() or "tiny-code" not in bundled.available():
        pytest.skip("the bundled pair is not installed")
    folder = tmp_path / name
    shutil.copytree(bundled.path(name), folder)
    return folder


def run_command(argv: list[str]) -> int:
    """The command as `main` runs it, without `main`'s process-wide torch settings."""
    args = build_parser().parse_args(argv)
    return args.run(args)


@pytest.mark.slow
def test_the_command_records_the_scale_and_remeasures_the_engine(tmp_path, monkeypatch):
    folder = bundled_copy("tiny-code-pard", tmp_path)
    info = json.loads((folder / "training_info.json").read_text())
    info["engine"]["prompts"] = 1
    (folder / "training_info.json").write_text(json.dumps(info))
    argv = ["calibrate-block", "--drafter", str(folder), "--nodes", "4"]
    argv += ["--calibration-prompts", "2", "--calibration-tokens", "16"]
    monkeypatch.setattr("sys.argv", ["specdec_fast.train", *argv])
    assert run_command(argv) == 0
    info = json.loads((folder / "training_info.json").read_text())
    fit = info["calibration"]
    assert fit["max_nodes"] == 4 and fit["sequences"] == 2
    assert "calibrate-block --drafter" in fit["command"]
    config = json.loads((folder / "config.json").read_text())
    assert config["ddtree_depth_scale"] == fit["depth_scale"]
    assert info["engine"]["prompts"] == 1 and info["engine"]["identical"]
    assert f"depth scale {fit['depth_scale']:g}" in (folder / "README.md").read_text()
    from specdec_fast.loading import load_model

    target = load_model("tiny-code", torch.device("cpu"))
    assert load_block_model(folder, target).depth_scale == fit["depth_scale"]
    assert BlockDrafter.from_pretrained(folder, target).depth_scale == fit["depth_scale"]
    with pytest.raises(ValueError, match="at least one prompt"):
        run_command([*argv[:5], "--calibration-prompts", "0"])


@pytest.mark.slow
def test_the_command_fits_on_a_prompt_file_and_dry_runs(tmp_path, capsys):
    folder = bundled_copy("tiny-code-dflash", tmp_path)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    prompts = tmp_path / "mine.jsonl"
    lines = [{"prompt": "def add(a, b):\n    return"}, {"prompt": "import os\n\n\ndef main():\n"}]
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    argv = ["calibrate-block", "--drafter", str(folder), "--prompts", str(prompts), "--dry-run"]
    argv += ["--calibration-tokens", "12", "--nodes", "6"]
    assert run_command(argv) == 0
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before  # nothing written
    report = json.loads(capsys.readouterr().err.strip().splitlines()[-1])["calibration"]
    assert report["source"] == "prompts of mine.jsonl" and report["sequences"] == 2
    assert report["max_nodes"] == 6 and report["depth_scale"] in DEPTH_SCALES
    assert report["anchors"] == 2 * (12 - 5)  # after each prompt, room for 5 drafted tokens


def test_a_chat_drafter_is_fitted_on_the_chat_prompts_after_the_trained_ones(tmp_path, monkeypatch):
    """`chat_sequences`: the training split's chat prompts that a `--data chat` run on `used`
    of them did not draw (its prompts are a prefix of a larger run's), through the chat
    template, each followed by the target's greedy tokens. The standard library is a training
    module of eight documented functions here (parsing the real one costs 5 s)."""
    from specdec_fast.demo_chat import CHAT_TARGET
    from specdec_fast.loading import load_tokenizer
    from specdec_fast.text import encode_prompt
    from specdec_fast.train import corpus
    from specdec_fast.train.chat_data import chat_prompts

    if CHAT_TARGET not in bundled.available():
        pytest.skip("the chat target is not installed (bash run.sh setup installs it)")
    name = next(f"mod{i}.py" for i in range(100) if not corpus.is_heldout(f"mod{i}.py"))
    functions = (f'def turn_{i}(x):\n    """Turn the wheel {i} times."""\n' for i in range(8))
    (tmp_path / name).write_text("\n\n".join(functions))
    monkeypatch.setattr(corpus, "stdlib_root", lambda: tmp_path)
    used, held, new_tokens = 4, 2, 3
    drawn = chat_prompts("train", used + held, seed=1)
    assert drawn[:used] == chat_prompts("train", used, seed=1)
    assert not any(messages in drawn[:used] for messages in drawn[used:])
    tokenizer = load_tokenizer(CHAT_TARGET)
    target = tiny_llama(vocab_size=len(tokenizer), hidden_size=16, layers=1)
    rows, lens = chat_sequences(target, bundled.path(CHAT_TARGET), held, new_tokens, used, 1)
    want = [encode_prompt(tokenizer, messages=m, chat=True) for m in drawn[used:]]
    assert lens == [len(ids) for ids in want]
    assert [row[:n].tolist() for row, n in zip(rows, lens, strict=True)] == want
    assert [len(row) for row in rows] == [n + new_tokens for n in lens]


@pytest.mark.parametrize("data", ["chat", "generated"])
def test_the_command_fits_where_the_folder_trained(tmp_path, monkeypatch, data):
    """`calibrate-block` reads the folder's training_info.json: a chat drafter is fitted on
    held-back chat prompts, and past the prompts it trained on (`--used` overrides)."""
    folder = bundled_copy("tiny-code-dflash", tmp_path)
    info = json.loads((folder / "training_info.json").read_text())
    info["options"] |= {"data": data, "sequences": 7}
    (folder / "training_info.json").write_text(json.dumps(info))
    calls = []

    def recorded(*args, **kwargs):
        calls.append(kwargs)
        return Calibration(1.0, 16, 1, 1, {1.0: 1.0})

    monkeypatch.setattr(calibrate, "calibrate_folder", recorded)
    argv = ["calibrate-block", "--drafter", str(folder), "--dry-run"]
    assert run_command(argv) == 0 and run_command([*argv, "--used", "3"]) == 0
    chat = data == "chat"
    assert [(call["chat"], call["used"]) for call in calls] == [(chat, 7), (chat, 3)]


def test_the_draft_vocabulary_is_the_training_streams_most_frequent_tokens(tmp_path, monkeypatch):
    """`training_draft_vocab` rebuilds the stream a folder's training_info.json records (here a
    `--data corpus` run's, whose stream is the corpus': a stand-in) from the run's cache."""
    from specdec_fast.train import heads

    stream = np.array([5, 9, 9, 2, 9, 5, 7, 9] * 8, dtype=np.int32)
    calls = []

    def training_target(name, data_dir, dtype, data):
        calls.append((name, data_dir, dtype, data))
        return "dir", tiny_llama(vocab_size=VOCAB, hidden_size=16, layers=1), stream

    monkeypatch.setattr(heads, "training_target", training_target)
    info = json.loads((Path(bundled.path("tiny-code-dflash")) / "training_info.json").read_text())
    info["options"] |= {"data": "corpus", "target_dtype": "bfloat16"}
    assert training_draft_vocab(info, 6, tmp_path) == [9, 5, 2, 7, 0, 1]
    assert calls == [("tiny-code", str(tmp_path), "bfloat16", "corpus")]


@pytest.mark.slow
def test_the_command_gives_a_dflash_head_a_draft_vocabulary(tmp_path, monkeypatch):
    """`calibrate-block --draft-vocab N`: the head's weights gain `d2t` (the others unchanged),
    its config the size, its training_info.json and README the vocabulary, and the fit and the
    engine's re-measured acceptance run with it."""
    from specdec_fast.heads.checkpoint import read_safetensors
    from specdec_fast.loading import load_model

    folder = bundled_copy("tiny-code-dflash", tmp_path)
    info = json.loads((folder / "training_info.json").read_text())
    info["engine"]["prompts"] = 1
    (folder / "training_info.json").write_text(json.dumps(info))
    before = read_safetensors(folder)
    target = load_model("tiny-code", torch.device("cpu"))
    vocab = target.config.vocab_size
    frequent = torch.randperm(vocab, generator=torch.Generator().manual_seed(1))[:300].tolist()
    asked = []

    def training_draft_vocab(info, size, data_dir):
        asked.append((size, data_dir))
        return frequent[:size]

    monkeypatch.setattr(calibrate, "training_draft_vocab", training_draft_vocab)
    argv = ["calibrate-block", "--drafter", str(folder), "--nodes", "4", "--draft-vocab", "300"]
    argv += ["--calibration-prompts", "2", "--calibration-tokens", "16", "--data-dir", "cache"]
    monkeypatch.setattr("sys.argv", ["specdec_fast.train", *argv])
    assert run_command(argv) == 0
    assert asked == [(300, "cache")]
    after = read_safetensors(folder)
    assert after.keys() - before.keys() == {"d2t"}
    assert all(torch.equal(after[key], tensor) for key, tensor in before.items())
    assert json.loads((folder / "config.json").read_text())["draft_vocab_size"] == 300
    assert load_block_model(folder, target).draft_ids.tolist() == frequent
    info = json.loads((folder / "training_info.json").read_text())
    assert info["draft_vocab"]["size"] == 300 and info["engine"]["identical"]
    assert "draft vocabulary of 300 tokens" in (folder / "README.md").read_text()
    with pytest.raises(ValueError, match="--draft-vocab must be >= 1"):
        run_command([*argv[:3], "--draft-vocab", "0"])
    (folder / "training_info.json").unlink()
    with pytest.raises(ValueError, match="has no training_info.json"):
        run_command(argv)
    pard = bundled_copy("tiny-code-pard", tmp_path)
    with pytest.raises(ValueError, match="only DFlash heads draft from a draft vocabulary"):
        run_command(["calibrate-block", "--drafter", str(pard), *argv[3:]])


@pytest.mark.slow
def test_a_published_head_takes_a_draft_vocabulary_from_text(tmp_path, capsys):
    """`--vocab-text`: any DFlash head (here one without training_info.json, in sharded
    safetensors as published checkpoints are) drafts from the most frequent target tokens of
    a text; its `d2t` goes into a shard of its own, listed in the index."""
    from specdec_fast.heads.checkpoint import read_safetensors
    from specdec_fast.loading import load_model, load_tokenizer

    folder = bundled_copy("tiny-code-dflash", tmp_path)
    (folder / "training_info.json").unlink()
    shard_weights(folder, read_safetensors(folder), 4)
    text = tmp_path / "answers.txt"
    text.write_text("def add(a, b):\n    return a + b\n" * 30 + "import os\n" * 7)
    tokenizer = load_tokenizer("tiny-code")
    counts = np.bincount(tokenizer.encode(text.read_text(), add_special_tokens=False))
    seen = int((counts > 0).sum())
    prompts = tmp_path / "mine.jsonl"
    prompts.write_text(json.dumps({"prompt": "def add(a, b):\n    return"}) + "\n")
    argv = ["calibrate-block", "--drafter", str(folder), "--draft-vocab", str(seen + 3)]
    argv += ["--vocab-text", str(text), "--prompts", str(prompts), "--nodes", "4"]
    argv += ["--calibration-tokens", "12"]
    assert run_command(argv) == 0
    target = load_model("tiny-code", torch.device("cpu"))
    ids = load_block_model(folder, target).draft_ids.tolist()
    assert len(ids) == seen + 3 and set(ids[:seen]) == set(np.flatnonzero(counts).tolist())
    assert counts[ids[0]] == counts.max()
    assert ids[seen:] == [i for i in range(len(tokenizer)) if i >= len(counts) or not counts[i]][:3]
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert index["weight_map"]["d2t"] == calibrate.DRAFT_VOCAB_SHARD
    assert json.loads((folder / "config.json").read_text())["draft_vocab_size"] == seen + 3
    assert "answers.txt" in capsys.readouterr().err  # its token count, as it goes
    with pytest.raises(ValueError, match="give --draft-vocab"):
        run_command([*argv[:3], "--vocab-text", str(text)])
    with pytest.raises(ValueError, match="give --vocab-text FILE"):
        run_command(argv[:5])
