"""The drafter registry: spec parsing, one tree per budget everywhere, and every registered kind
walked through parse -> build -> a greedy exactness check on a tiny model."""

from pathlib import Path

import pytest
import torch
from test_medusa import random_heads
from tiny_models import repetitive_prompts, tiny_llama

from specdec_fast import bundled, generate
from specdec_fast.cli import build_parser
from specdec_fast.drafters.registry import (
    KINDS,
    REGISTRY,
    DrafterSpec,
    bundled_specs,
    kinds_with,
    spec_help,
)
from specdec_fast.heads.block import DFlashHead
from specdec_fast.heads.eagle import Eagle3Head, EagleHead
from specdec_fast.trees import default_tree

VOCAB = 32
HIDDEN = 48


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab_size=VOCAB, hidden_size=HIDDEN, layers=3)


def _draft_folder(folder, target):
    tiny_llama(vocab_size=VOCAB, hidden_size=32, seed=1).save_pretrained(folder)


def _medusa_folder(folder, target):
    random_heads(HIDDEN, VOCAB, num_heads=3).save_pretrained(folder)


def _eagle_folder(folder, target):
    torch.manual_seed(0)
    EagleHead.for_target(target).save_pretrained(folder)


def _block_folder(folder, target):
    torch.manual_seed(0)
    DFlashHead.for_target(target, mask_token_id=1).save_pretrained(folder)


# A checkpoint writer per kind that takes a PATH; a new kind without one fails the walk below.
CHECKPOINTS = {
    "draft": _draft_folder,
    "draft-tree": _draft_folder,
    "medusa": _medusa_folder,
    "eagle": _eagle_folder,
    "block": _block_folder,
    "block-chain": _block_folder,
}


@pytest.fixture(scope="module")
def prompts():
    return repetitive_prompts([13, 7], VOCAB, seed=3)


# A capacity below what the prompts and their 24 new tokens take: rows stop for their cache.
CAPPED = 22


@pytest.fixture(scope="module")
def plain(target, prompts):
    with torch.no_grad():
        out = generate(target, prompts, drafter=None, max_new_tokens=24)
    return [s.tolist() for s in out.sequences]


@pytest.fixture(scope="module")
def capped(target, prompts):
    with torch.no_grad():
        out = generate(target, prompts, drafter=None, max_new_tokens=24, max_cache_len=CAPPED)
    assert [s.finish_reason for s in out.stats.sequences] == ["cache", "cache"]
    return [s.tolist() for s in out.sequences]


@pytest.mark.parametrize("kind", list(REGISTRY))
@pytest.mark.parametrize("sized", [False, True], ids=["default-size", "size-5"])
def test_every_kind_parses_builds_and_is_exact(
    kind, sized, target, prompts, plain, capped, tmp_path
):
    """Greedy, each kind's output is plain decoding's, and so it is where the rows stop for
    their cache: trees verified near the capacity write into the storage beyond it (the
    drafter's own caches too) and are cut at it."""
    info = REGISTRY[kind]
    text = kind
    if info.load is not None:
        assert kind in CHECKPOINTS, f"the walk needs a checkpoint writer for {kind!r}"
        CHECKPOINTS[kind](tmp_path, target)
        text = f"{kind}:{tmp_path}"
    if sized:
        text += ":5"
    spec = DrafterSpec.parse(text)
    assert str(spec) == text and DrafterSpec.parse(str(spec)) == spec
    size = 5 if sized else info.default_size
    drafter = spec.build(target)
    # The budget is the verified N everywhere: a chain of k verifies k + 1.
    assert drafter.max_nodes == spec.nodes() == (size + 1 if info.chain else size)
    with torch.no_grad():
        out = generate(target, prompts, drafter=drafter, max_new_tokens=24)
    assert [s.tolist() for s in out.sequences] == plain
    assert out.stats.drafted_tokens > 0
    with torch.no_grad():
        out = generate(target, prompts, drafter=drafter, max_new_tokens=24, max_cache_len=CAPPED)
    assert [s.tolist() for s in out.sequences] == capped


def test_a_budget_is_the_same_tree_for_every_static_kind(target, tmp_path):
    _medusa_folder(tmp_path / "medusa", target)
    _draft_folder(tmp_path / "draft", target)
    medusa = DrafterSpec.parse(f"medusa:{tmp_path / 'medusa'}:8").build(target)
    draft_tree = DrafterSpec.parse(f"draft-tree:{tmp_path / 'draft'}:8").build(target)
    # Medusa's tree is the default tree of the budget, capped at its 3 heads, not a trimmed one.
    assert medusa.tree == default_tree(8, max_depth=3) and medusa.tree.num_nodes == 8
    assert draft_tree.tree == default_tree(8) and draft_tree.tree.num_nodes == 8


@pytest.mark.parametrize(
    ("spec", "kind", "path", "size"),
    [
        ("ngram", "ngram", None, None),
        ("suffix:32", "suffix", None, 32),
        ("draft:/a/b", "draft", "/a/b", None),
        ("draft:/a/b:3", "draft", "/a/b", 3),
        ("draft:model.gguf", "draft", "model.gguf", None),
        ("draft-tree:tiny-code-draft:16", "draft-tree", "tiny-code-draft", 16),
        ("medusa:some/heads:8", "medusa", "some/heads", 8),
        ("eagle:tiny-code-eagle3", "eagle", "tiny-code-eagle3", None),
        ("block:tiny-code-dflash:16", "block", "tiny-code-dflash", 16),
        ("none", "none", None, None),
        ("plain", "none", None, None),
    ],
)
def test_spec_parsing(spec, kind, path, size):
    parsed = DrafterSpec.parse(spec)
    assert (parsed.kind, parsed.path, parsed.size) == (kind, path, size)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("magic", "expected none \\| ngram\\[:N\\] \\| suffix"),
        ("draft", "expected draft:PATH\\[:K\\]"),
        ("ngram:0", "size must be a positive integer"),
        ("ngram:x", "size must be a positive integer"),
    ],
)
def test_bad_specs_name_the_spec_and_the_syntax(spec, message):
    with pytest.raises(ValueError, match=f"drafter spec {spec!r}: {message}"):
        DrafterSpec.parse(spec)


def test_help_and_labels_come_from_the_registry():
    text = spec_help()
    for kind in KINDS:
        assert kind.syntax in text and kind.help in text
    assert DrafterSpec.parse("ngram").label() == "ngram N=8"
    assert DrafterSpec.parse("draft:x/tiny-draft").label(3) == "draft:tiny-draft k=3 (N=4)"
    assert DrafterSpec("none").label() == "plain" and DrafterSpec("none").nodes() == 1


def test_bundled_specs_cover_every_kind_with_its_installed_checkpoints():
    specs = bundled_specs()
    available = set(bundled.available())
    expected = [
        (kind.name, name)
        for kind in KINDS
        for name in ((None,) if kind.load is None else kind.bundled)
        if name is None or name in available
    ]
    assert [(s.kind, s.path) for s in specs] == expected


def test_every_list_of_drafters_names_every_registered_kind(monkeypatch):
    """The tests that cover every drafter keep their own lists (their own sizes): each names
    every registered kind, and a kind registered without being added to them fails here."""
    from built_in_drafters import DRAFTERS, missing_kinds
    from test_drafter_checks import CHECKED

    for specs in (DRAFTERS, CHECKED):
        assert missing_kinds(specs) == set()
    monkeypatch.setitem(REGISTRY, "new", KINDS[0])
    assert missing_kinds(DRAFTERS) == {"new"}


def test_benchmark_lists_are_the_registry_kinds_and_take_a_new_one(monkeypatch):
    """The GPU suite's tiny-pair runs take every kind of tree (all but the chains; the quick run
    the kinds tagged `quick`) and the CLI's `bench` without --drafter every kind that needs no
    checkpoint, read from the registry: a kind registered later is in them."""
    import dataclasses

    from bench_smoke import import_bench

    from specdec_fast import cli
    from specdec_fast.drafters import registry

    suite = import_bench(monkeypatch, "gpu_suite")

    def e2e_kinds(quick):
        command = suite.e2e_command(Path("work"), quick, dry_run=False)
        return tuple(command[command.index("--kinds") + 1].split(","))

    def bench_help():
        bench = build_parser()._subparsers._group_actions[0].choices["bench"]
        return next(a.help for a in bench._actions if "--drafter" in a.option_strings)

    assert e2e_kinds(False) == ("ngram", "suffix", "draft-tree", "medusa", "eagle", "block")
    assert e2e_kinds(True) == ("ngram", "eagle", "block")
    assert cli.bench_default_kinds() == ("ngram", "suffix")
    assert bench_help().endswith("default: ngram and suffix")
    new = dataclasses.replace(REGISTRY["ngram"], name="new", quick=False)
    monkeypatch.setattr(registry, "KINDS", (*KINDS, new))
    assert e2e_kinds(False)[-1] == "new" and "new" not in e2e_kinds(True)
    assert cli.bench_default_kinds() == ("ngram", "suffix", "new")
    assert bench_help().endswith("default: ngram and suffix and new")


def test_every_trained_kind_has_a_training_command():
    """Training's head commands load as registered kinds, and every kind whose checkpoint is
    trained for the target has a command (`train block` for the block drafters' trees and
    chains)."""
    from specdec_fast.train.heads import DRAFTER_KINDS

    assert set(DRAFTER_KINDS.values()) <= set(REGISTRY)
    assert set(kinds_with("trained")) == {*DRAFTER_KINDS.values(), "block", "block-chain"}
    assert kinds_with("none", "draft model") == ("ngram", "suffix", "draft", "draft-tree")


def _eagle3_folder(folder, target):
    torch.manual_seed(0)
    Eagle3Head.for_target(target, list(range(VOCAB // 2)), target_layers=(0, 1, 2)).save_pretrained(
        folder
    )


@pytest.mark.parametrize(
    ("write", "kind"),
    [(_block_folder, "block"), (_eagle3_folder, "eagle"), (_medusa_folder, "medusa")],
    ids=["dflash", "eagle3", "medusa"],
)
@pytest.mark.parametrize("chain", ["draft", "draft-tree"])
def test_a_draft_spec_over_a_heads_folder_names_the_heads_spec(
    target, tmp_path, write, kind, chain
):
    """Not transformers' report of a causal LM loaded without the head's weights."""
    write(tmp_path, target)
    with pytest.raises(ValueError, match=f"not a draft model .*; its spec is {kind}:{tmp_path}$"):
        DrafterSpec.parse(f"{chain}:{tmp_path}").build(target)
