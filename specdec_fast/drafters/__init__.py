"""Drafters: objects that propose draft trees for the target to verify (protocol in `base`)."""

from .base import Drafter, DraftState, Proposal, StepOutcome, pack_trees
from .draft_model import DraftModelDrafter
from .eagle import EagleDrafter
from .medusa import MedusaDrafter
from .ngram import NGramDrafter
from .suffix import SuffixDrafter

__all__ = [
    "DraftModelDrafter",
    "DraftState",
    "Drafter",
    "EagleDrafter",
    "MedusaDrafter",
    "NGramDrafter",
    "Proposal",
    "StepOutcome",
    "SuffixDrafter",
    "pack_trees",
]
