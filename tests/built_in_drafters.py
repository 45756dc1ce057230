"""The built-in drafters as registry specs over the bundled tiny-code family, for tests that
cover every drafter (the step's budget, served outputs against `generate`'s). The block drafters
run over untrained checkpoints in the bundled layouts, written by `write_untrained_blocks`."""

from pathlib import Path

import torch
from tiny_models import first_layers

from specdec_fast import PardDraft
from specdec_fast.drafters.registry import REGISTRY, DrafterSpec
from specdec_fast.heads.block import DFlashHead
from specdec_fast.loading import load_model

DRAFTERS = [
    "none",
    "ngram:8",
    "suffix:16",
    "draft:tiny-code-draft:4",
    "draft-tree:tiny-code-draft:8",
    "medusa:tiny-code-medusa:8",
    "eagle:tiny-code-eagle:8",
    "eagle:tiny-code-eagle3:8",
    "eagle:tiny-code-eagle:8+ngram:8",
    "block:{dflash}:8",
    "block:{pard}:8",
    "block-chain:{dflash}:4",
]


def write_untrained_blocks(target, folder: Path, draft_layers: int | None = None) -> dict[str, str]:
    """A DFlash head for `target` (seeded), drafting from a draft vocabulary of two thirds of the
    target's ids (as the real target's bundled head does), and the bundled draft model as a
    PARD model (its pad token as the mask; cut to its first `draft_layers` layers when given),
    saved under `folder`; returns the `{dflash}`/`{pard}` spec fields. Heads without a draft
    vocabulary are tests/test_block.py's, and `tiny-code-dflash`."""
    torch.manual_seed(0)
    dflash, pard = folder / "dflash", folder / "pard"
    head = DFlashHead.for_target(target, num_layers=1, block_size=8)
    vocab = target.config.vocab_size
    head.set_draft_vocab(torch.randperm(vocab)[: 2 * vocab // 3])
    head.save_pretrained(dflash)
    draft = load_model("tiny-code-draft", target.device)
    if draft_layers is not None:
        draft = first_layers(draft, draft_layers)
    PardDraft(draft, draft.config.pad_token_id).save_pretrained(pard)
    return {"dflash": str(dflash), "pard": str(pard)}


def missing_kinds(specs: list[str]) -> set[str]:
    """The registered kinds that no spec of `specs` names (a spec may carry `{dflash}`/`{pard}`
    fields and, after a space, a note): what a list of drafters kept beside the registry, with
    sizes of its own, has forgotten."""
    named = {DrafterSpec.parse(s.split()[0].format(dflash="x", pard="x")).kind for s in specs}
    return set(REGISTRY) - named
