"""Drafter output is checked before the target runs (`specdec_fast.drafters.checks`): the engine
writes each row's root itself, a malformed proposal raises `DrafterError` naming the drafter,
`GuardedDrafter` falls back on one with its output unchanged, and the built-in drafters pass the
value screen they skip."""

import pytest
import torch
from drafter_wrappers import OracleChain
from tiny_models import repetitive_prompts, tiny_llama

from specdec_fast import DrafterError, bundled, generate
from specdec_fast.drafters.base import Proposal
from specdec_fast.drafters.registry import DrafterSpec
from specdec_fast.guardrails import GuardedDrafter

VOCAB = 96
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab_size=VOCAB)


@pytest.fixture(scope="module")
def prompts():
    return repetitive_prompts([9, 14], VOCAB, seed=2)


@pytest.fixture(scope="module")
def plain(target, prompts):
    out = generate(target, prompts, drafter=None, max_new_tokens=NEW_TOKENS, eos_token_id=[])
    return [s.tolist() for s in out.sequences]


def _one_hot(proposal: Proposal) -> torch.Tensor:
    return torch.nn.functional.one_hot(proposal.tokens, VOCAB).float()


def _set(tensor: torch.Tensor, index, value) -> torch.Tensor:
    tensor = tensor.clone()
    tensor[index] = value
    return tensor


# name -> (corrupt(proposal) -> proposal, what the error says)
CORRUPTIONS = {
    "token-beyond-vocab": (
        lambda p: Proposal(_set(p.tokens, (1, 2), VOCAB + 3), p.parents),
        r"draft_tokens\[1, 2\] = 99 is outside the vocabulary \[0, 96\)",
    ),
    "negative-token": (
        lambda p: Proposal(_set(p.tokens, (0, 1), -1), p.parents),
        r"draft_tokens\[0, 1\] = -1 is outside",
    ),
    "parent-after-child": (
        lambda p: Proposal(p.tokens, _set(p.parents, (0, 2), 3)),
        r"parents\[0, 2\] = 3: expected -2 \(padding\) or a parent in \[0, 2\)",
    ),
    "padded-parent": (
        lambda p: Proposal(p.tokens, _set(p.parents, (1, 1), -2)),
        r"parents\[1, 2\] = 1: that parent is a padded node",
    ),
    "root-parent": (
        lambda p: Proposal(p.tokens, _set(p.parents, (0, 0), 0)),
        r"parents\[0, 0\] = 0: the root must be node 0",
    ),
    "too-many-nodes": (
        lambda p: Proposal(
            torch.cat([p.tokens, p.tokens[:, -1:]], 1),
            torch.cat([p.parents, p.parents[:, -1:] + 1], 1),
        ),
        r"proposal.tokens: expected shape \[B = 2, N\] with 1 <= N <= max_nodes = 5, got \(2, 6\)",
    ),
    "float-tokens": (
        lambda p: Proposal(p.tokens.float(), p.parents),
        r"proposal.tokens: expected int32 or int64, got torch.float32",
    ),
    "draft-probs-shape": (
        lambda p: Proposal(p.tokens, p.parents, torch.zeros(2, 5, VOCAB + 1)),
        r"proposal.draft_probs: expected shape \[B, N, V\] = \(2, 5, 96\)",
    ),
    "negative-draft-probs": (
        lambda p: Proposal(p.tokens, p.parents, _set(_one_hot(p), (1, 3, 0), -0.5)),
        r"draft_probs\[1, 3\].*1 negative",
    ),
}


class Corrupting(OracleChain):
    """The target's own greedy future as a chain of 4 drafts, passed through `corrupt` from the
    second step on (so that a speculative step has been taken first)."""

    def __init__(self, target, corrupt=None):
        def continuation_of(tokens):
            out = generate(target, [tokens], drafter=None, max_new_tokens=4, eos_token_id=[])
            return out.sequences[0].tolist()[len(tokens) :]

        super().__init__(continuation_of, max_nodes=5)
        self.corrupt, self.steps = corrupt, 0

    def propose(self, state):
        proposal = super().propose(state)
        self.steps += 1
        return self.corrupt(proposal) if self.corrupt and self.steps >= 2 else proposal

    def __repr__(self):
        return "Corrupting()"


def test_the_engine_writes_the_root(target, prompts, plain):
    """A drafter that puts a wrong token in column 0 cannot change the output."""
    drafter = Corrupting(target, lambda p: Proposal(_set(p.tokens, (slice(None), 0), 5), p.parents))
    out = generate(target, prompts, drafter=drafter, max_new_tokens=NEW_TOKENS, eos_token_id=[])
    assert [s.tolist() for s in out.sequences] == plain
    assert out.stats.accepted_tokens > 0


@pytest.mark.parametrize("name", list(CORRUPTIONS))
def test_malformed_proposals_raise_a_drafter_error(target, prompts, name):
    corrupt, message = CORRUPTIONS[name]
    drafter = Corrupting(target, corrupt)
    with pytest.raises(
        DrafterError, match=r"Corrupting\(\) proposed an invalid tree: .*" + message
    ):
        generate(target, prompts, drafter=drafter, max_new_tokens=NEW_TOKENS, eos_token_id=[])
    assert target.config._attn_implementation != "specdec_tree"


@pytest.mark.parametrize("name", ["token-beyond-vocab", "parent-after-child", "draft-probs-shape"])
def test_guarded_drafter_falls_back_on_a_malformed_proposal(target, prompts, plain, name):
    drafter = GuardedDrafter(Corrupting(target, CORRUPTIONS[name][0]))
    out = generate(target, prompts, drafter=drafter, max_new_tokens=NEW_TOKENS, eos_token_id=[])
    assert [s.tolist() for s in out.sequences] == plain
    assert len(drafter.events) == 1 and "DrafterError" in drafter.events[0], drafter.events


def test_padded_nodes_may_hold_any_token(target, prompts, plain):
    """Padded nodes' tokens are never verified: the screen zeroes them instead of failing."""

    def pad_garbage(proposal):
        parents = _set(proposal.parents, (slice(None), slice(3, None)), -2)
        return Proposal(_set(proposal.tokens, (slice(None), slice(3, None)), 10**6), parents)

    out = generate(
        target,
        prompts,
        drafter=Corrupting(target, pad_garbage),
        max_new_tokens=NEW_TOKENS,
        eos_token_id=[],
    )
    assert [s.tolist() for s in out.sequences] == plain


def _screened(drafter):
    """`drafter` with its proposals_valid declaration withdrawn, so that the engine screens it."""
    inner = drafter
    while hasattr(inner, "inner"):
        inner = inner.inner
    inner.proposals_valid = False
    return drafter


BUILT_IN = [
    "ngram:6",
    "suffix:8",
    "draft:tiny-code-draft:3",
    "draft-tree:tiny-code-draft:6",
    "medusa:tiny-code-medusa:6",
    "eagle:tiny-code-eagle3:6",
]
# Block drafters run over an untrained DFlash head (`_makers`), by their tree mode: a best-first
# tree and a chain, each of 6 verified nodes.
BLOCK_TREES = {"block:{dflash}:6": "ddtree", "block-chain:{dflash}:5": "chain"}
CHECKED = [*BUILT_IN, *BLOCK_TREES]


def _makers(target) -> dict:
    """name -> a builder of fresh drafters, for every built-in kind; block drafters over an
    untrained DFlash head (best-first trees, and chains that carry draft_probs when sampling)."""
    from specdec_fast import BlockDrafter
    from specdec_fast.heads.block import DFlashHead

    makers = {spec: DrafterSpec.parse(spec).factory(target) for spec in BUILT_IN}
    torch.manual_seed(0)
    head = DFlashHead.for_target(target, num_layers=1, block_size=6)
    for name, tree in BLOCK_TREES.items():
        makers[name] = lambda tree=tree: BlockDrafter(head, max_nodes=6, tree=tree)
    return makers


@pytest.mark.skipif("tiny-code" not in bundled.available(), reason="bundled checkpoints missing")
@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
def test_built_in_drafters_pass_the_screen_they_skip(temperature):
    """Every built-in drafter declares `proposals_valid`; screened, it raises no DrafterError
    (sampled chains carry draft_probs) and emits the same tokens."""
    from specdec_fast.loading import load_model

    target = load_model("tiny-code", torch.device("cpu"))
    prompt = repetitive_prompts([20], target.config.vocab_size, seed=5)
    for name, make in _makers(target).items():
        runs = []
        for drafter in (make(), _screened(make())):
            assert drafter.proposals_valid is (len(runs) == 0), name
            out = generate(
                target,
                prompt,
                drafter=drafter,
                max_new_tokens=8,
                temperature=temperature,
                seed=1,
                eos_token_id=[],
            )
            runs.append(out.sequences[0].tolist())
        assert runs[0] == runs[1], name
