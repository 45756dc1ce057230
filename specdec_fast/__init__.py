"""specdec-fast: fast, lossless speculative decoding for Hugging Face causal LMs."""

from importlib.metadata import PackageNotFoundError, version

from .drafters import (
    Drafter,
    DraftModelDrafter,
    DraftState,
    EagleDrafter,
    MedusaDrafter,
    NGramDrafter,
    Proposal,
    StepOutcome,
    SuffixDrafter,
)
from .engine import GenerateOutput, generate
from .stats import SequenceStats, SpecStats

try:
    __version__ = version("specdec-fast")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0"

__all__ = [
    "DraftModelDrafter",
    "DraftState",
    "Drafter",
    "EagleDrafter",
    "GenerateOutput",
    "MedusaDrafter",
    "NGramDrafter",
    "Proposal",
    "SequenceStats",
    "SpecStats",
    "StepOutcome",
    "SuffixDrafter",
    "__version__",
    "generate",
]
