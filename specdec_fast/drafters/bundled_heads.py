"""Drafters over the heads bundled for the `tiny-code` target, for the demo and the benchmarks."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from specdec_fast import bundled
from specdec_fast.heads.eagle import load_eagle_head
from specdec_fast.heads.medusa import load_medusa_heads
from specdec_fast.trees import default_tree

from .base import Drafter
from .eagle import EagleDrafter
from .medusa import MedusaDrafter

EAGLE_HEADS = {"tiny-code-eagle": "eagle-2", "tiny-code-eagle3": "eagle-3"}


def bundled_head_drafters(
    target, budgets: Sequence[int] = (16,)
) -> dict[str, Callable[[], Drafter]]:
    """Factories of Medusa and EAGLE drafters, by display name, for each tree budget, over the
    bundled heads that are installed (heads are loaded once, on the target's device and dtype)."""
    available = bundled.available()
    drafters: dict[str, Callable[[], Drafter]] = {}
    if "tiny-code-medusa" in available:
        heads = load_medusa_heads("tiny-code-medusa", target.device, target.dtype)
        heads.check_target(target)
        for n in budgets:
            tree = default_tree(n, max_depth=heads.num_heads)
            drafters[f"medusa N={n}"] = lambda tree=tree: MedusaDrafter(heads, tree)
    for name, label in EAGLE_HEADS.items():
        if name in available:
            head = load_eagle_head(name, target)
            for n in budgets:
                drafters[f"{label} N={n}"] = lambda head=head, n=n: EagleDrafter(head, max_nodes=n)
    return drafters
