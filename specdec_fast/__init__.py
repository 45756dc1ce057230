"""specdec-fast: fast, lossless speculative decoding for Hugging Face causal LMs."""

from importlib.metadata import PackageNotFoundError, version

from . import bundled
from .adaptive import AdaptiveDrafter, CostModel
from .batch import UnusableLogits
from .drafters import (
    BlockDrafter,
    Drafter,
    DrafterError,
    DraftModelDrafter,
    DraftState,
    EagleDrafter,
    GraftedDrafter,
    MedusaDrafter,
    NGramDrafter,
    PardDraft,
    Proposal,
    StepOutcome,
    SuffixDrafter,
)
from .engine import GenerateOutput, generate
from .guardrails import GuardedDrafter, GuardrailPolicy, Guardrails
from .metrics import SpecMetrics, prometheus_text
from .stats import SequenceStats, SpecStats

try:
    __version__ = version("specdec-fast")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0"

__all__ = [
    "AdaptiveDrafter",
    "BlockDrafter",
    "CostModel",
    "DraftModelDrafter",
    "DraftState",
    "Drafter",
    "DrafterError",
    "EagleDrafter",
    "GenerateOutput",
    "GraftedDrafter",
    "GuardedDrafter",
    "GuardrailPolicy",
    "Guardrails",
    "MedusaDrafter",
    "NGramDrafter",
    "PardDraft",
    "Proposal",
    "SequenceStats",
    "SpecMetrics",
    "SpecStats",
    "StepOutcome",
    "SuffixDrafter",
    "UnusableLogits",
    "__version__",
    "bundled",
    "generate",
    "prometheus_text",
]
