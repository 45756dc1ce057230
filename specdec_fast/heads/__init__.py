"""Draft heads that read the target's hidden states (Medusa, EAGLE-1/2, EAGLE-3) and their
checkpoint loaders; the drafters that run them are in `specdec_fast.drafters`."""

from .eagle import Eagle3Head, EagleHead, load_eagle_head
from .medusa import MedusaHeads, load_medusa_heads

__all__ = ["Eagle3Head", "EagleHead", "MedusaHeads", "load_eagle_head", "load_medusa_heads"]
