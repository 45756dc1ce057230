"""Draft heads that read the target's hidden states (Medusa, EAGLE-1/2, EAGLE-3, DFlash) and their
checkpoint loaders; the drafters that run them are in `specdec_fast.drafters`."""

from .block import DFlashHead, load_dflash_head
from .eagle import Eagle3Head, EagleHead, load_eagle_head
from .medusa import MedusaHeads, load_medusa_heads

__all__ = [
    "DFlashHead",
    "Eagle3Head",
    "EagleHead",
    "MedusaHeads",
    "load_dflash_head",
    "load_eagle_head",
    "load_medusa_heads",
]
