"""Drafters: objects that propose draft trees for the target to verify (protocol in `base`)."""

from .base import Drafter, DraftState, Proposal, StepOutcome, pack_trees
from .block import BlockDrafter
from .checks import DrafterError
from .draft_model import DraftModelDrafter
from .eagle import EagleDrafter
from .graft import GraftedDrafter
from .medusa import MedusaDrafter
from .ngram import NGramDrafter
from .pard import PardDraft
from .suffix import SuffixDrafter

__all__ = [
    "BlockDrafter",
    "DraftModelDrafter",
    "DraftState",
    "Drafter",
    "DrafterError",
    "EagleDrafter",
    "GraftedDrafter",
    "MedusaDrafter",
    "NGramDrafter",
    "PardDraft",
    "Proposal",
    "StepOutcome",
    "SuffixDrafter",
    "pack_trees",
]
