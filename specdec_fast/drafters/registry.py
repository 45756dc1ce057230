"""The drafter registry: every kind of drafter, its builder, default size, spec syntax and help.

The command line (`--drafter SPEC` and its help), the demo, the benchmarks and the harness all read
`REGISTRY`, so a spec means the same drafter and the same tree everywhere. A drafter SPEC is

    KIND[:SIZE]         for kinds that need no checkpoint (ngram, suffix)
    KIND:PATH[:SIZE]    for kinds built on a checkpoint (PATH: a folder, a .gguf file for draft
                        models, or a bundled name, see `specdec_fast.bundled`)
    none                plain decoding

SIZE is N, the tokens verified per step with the root included, except for chains, whose size is
their length k in drafted tokens (N = k + 1). `DrafterSpec.parse` reads a spec; `factory(target)`
loads its checkpoint once and returns a builder by size.

A tree spec may end in `+ngram[:N]` or `+suffix[:N]`: that lookup's tree grafted onto the
drafter's (`GraftedDrafter`), both verified in one step (`eagle:PATH:8+ngram:8`, N = 8 + 8 - 1).

Adding a drafter: its own module in `specdec_fast/drafters/` and one `DrafterKind` in `KINDS`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdec_fast import bundled
from specdec_fast.files import read_json
from specdec_fast.heads.block import is_dflash_config
from specdec_fast.heads.checkpoint import CONFIG_NAME
from specdec_fast.heads.eagle import is_eagle3_config, load_eagle_head
from specdec_fast.heads.medusa import MedusaHeads, load_medusa_heads
from specdec_fast.loading import load_model, resolve_model
from specdec_fast.trees import default_tree

from .base import Drafter
from .block import BlockDrafter, load_block_model
from .draft_model import DraftModelDrafter
from .eagle import EagleDrafter
from .graft import GraftedDrafter
from .medusa import MedusaDrafter
from .ngram import NGramDrafter
from .suffix import SuffixDrafter

PLAIN_SPECS = ("none", "plain")
CHECKPOINTS = ("none", "draft model", "trained")


@dataclass(frozen=True)
class DrafterKind:
    """One kind of drafter.

    name: the spec's KIND.
    help: one line for the command line's help.
    default_size: SIZE when the spec gives none.
    build: (checkpoint, size) -> drafter; checkpoint is what `load` returned (None without it).
    load: (PATH, target) -> the checkpoint the drafters are built on, loaded once per spec; None
        for kinds that take no PATH.
    chain: SIZE is a chain length k (N = k + 1) instead of a tree's N.
    tree_kind: the kind a `--tree N` sweep turns this one into (chains only).
    deterministic: proposals carry no draft probabilities, so sampled speculation can equal
        plain sampling with the same seed (a sampled chain cannot).
    bundled: checkpoints shipped for the bundled `tiny-code` target that this kind reads.
    checkpoint: what PATH is (`CHECKPOINTS`): "none" (no PATH), "draft model" (any small LM
        of the target's vocabulary: a benchmark with a random target and draft pair runs it),
        or "trained" (heads or a block drafter trained for the target, `python -m
        specdec_fast.train`).
    quick: in the short list of quick benchmarks (`kinds_for_benchmarks(quick=True)`): one kind
        per way of drafting that the others repeat (a lookup, a trained head's dynamic tree, a
        block drafter).
    """

    name: str
    help: str
    default_size: int
    build: Callable[[Any, int], Drafter]
    load: Callable[[str, Any], Any] | None = None
    chain: bool = False
    tree_kind: str | None = None
    deterministic: bool = True
    bundled: tuple[str, ...] = ()
    checkpoint: str = "none"
    quick: bool = False

    def __post_init__(self):
        if self.checkpoint not in CHECKPOINTS:
            raise ValueError(f"checkpoint: expected one of {CHECKPOINTS}, got {self.checkpoint!r}")
        if (self.checkpoint == "none") != (self.load is None):
            raise ValueError(f"{self.name}: a kind loads a checkpoint exactly when it names one")

    @property
    def size_name(self) -> str:
        return "K" if self.chain else "N"

    @property
    def syntax(self) -> str:
        path = ":PATH" if self.load is not None else ""
        return f"{self.name}{path}[:{self.size_name}]"

    def nodes(self, size: int) -> int:
        """N, the tokens verified per step, of a drafter of this kind at `size`."""
        return size + 1 if self.chain else size


def _draft_model(path: str, target):
    """A draft model (an HF causal LM). A folder that holds one of the heads is refused with the
    spec that takes it: transformers would load a causal LM from its config, with the head's
    weights left out."""
    folder, gguf_file = resolve_model(path)
    config = Path(folder) / CONFIG_NAME
    if gguf_file is None and config.is_file():
        fields = read_json(config)  # a file that is not JSON is named here
        for name, kind, matches in HEAD_LAYOUTS:
            if isinstance(fields, dict) and matches(fields):
                raise ValueError(
                    f"{path}: holds {name}, not a draft model (a causal LM); its spec is "
                    f"{kind}:{path}"
                )
    return load_model(path, target.device, target.dtype)


# The heads' layouts that a causal LM's loader would misread, by their config fields (DFlash's
# first: its config may carry a draft vocabulary, as EAGLE-3's does).
HEAD_LAYOUTS = (
    ("a DFlash block head", "block", is_dflash_config),
    ("an EAGLE-3 head", "eagle", is_eagle3_config),
    ("Medusa heads", "medusa", lambda fields: "medusa_num_heads" in fields),
)


def _medusa_heads(path: str, target) -> MedusaHeads:
    heads = load_medusa_heads(path, target.device, target.dtype)
    heads.check_target(target)
    return heads


def _ngram(_, size: int) -> Drafter:
    return NGramDrafter(max_nodes=size)


def _suffix(_, size: int) -> Drafter:
    return SuffixDrafter(max_nodes=size)


def _draft_chain(draft, size: int) -> Drafter:
    return DraftModelDrafter(draft, num_tokens=size)


def _draft_tree(draft, size: int) -> Drafter:
    return DraftModelDrafter(draft, tree=default_tree(size))


def _medusa(heads: MedusaHeads, size: int) -> Drafter:
    return MedusaDrafter(heads, default_tree(size, max_depth=heads.num_heads))


def _eagle(head, size: int) -> Drafter:
    return EagleDrafter(head, max_nodes=size)


def _block(model, size: int) -> Drafter:
    return BlockDrafter(model, max_nodes=size)


def _block_chain(model, size: int) -> Drafter:
    return BlockDrafter(model, max_nodes=size + 1, tree="chain")


KINDS = (
    DrafterKind(
        "ngram",
        "prompt lookup: repeated n-grams' continuations merged into a tree",
        8,
        _ngram,
        quick=True,
    ),
    DrafterKind(
        "suffix",
        "suffix-tree lookup over the request and earlier outputs",
        16,
        _suffix,
    ),
    DrafterKind(
        "draft",
        "a small draft model's chain of K tokens (sampled when sampling)",
        4,
        _draft_chain,
        load=_draft_model,
        chain=True,
        tree_kind="draft-tree",
        deterministic=False,
        bundled=("tiny-code-draft",),
        checkpoint="draft model",
    ),
    DrafterKind(
        "draft-tree",
        "a draft model's top-k expansion of the default static tree",
        16,
        _draft_tree,
        load=_draft_model,
        bundled=("tiny-code-draft",),
        checkpoint="draft model",
    ),
    DrafterKind(
        "medusa",
        "Medusa heads filling the default static tree (depth <= heads)",
        16,
        _medusa,
        load=_medusa_heads,
        bundled=("tiny-code-medusa",),
        checkpoint="trained",
    ),
    DrafterKind(
        "eagle",
        "an EAGLE-1/2 or EAGLE-3 head growing EAGLE-2 dynamic trees",
        16,
        _eagle,
        load=load_eagle_head,
        bundled=("tiny-code-eagle", "tiny-code-eagle3"),
        checkpoint="trained",
        quick=True,
    ),
    DrafterKind(
        "block",
        "a DFlash- or PARD-style block drafter's best-first (DDTree) tree",
        16,
        _block,
        load=load_block_model,
        bundled=("tiny-code-dflash", "tiny-code-pard"),
        checkpoint="trained",
        quick=True,
    ),
    DrafterKind(
        "block-chain",
        "a block drafter's chain of K tokens from one forward (sampled when sampling)",
        4,
        _block_chain,
        load=load_block_model,
        chain=True,
        tree_kind="block",
        deterministic=False,
        bundled=("tiny-code-dflash", "tiny-code-pard"),
        checkpoint="trained",
    ),
)
REGISTRY: dict[str, DrafterKind] = {kind.name: kind for kind in KINDS}


def kinds_with(*checkpoints: str) -> tuple[str, ...]:
    """The registered kinds whose checkpoint is one of `checkpoints` (`DrafterKind.checkpoint`),
    in registry order: e.g. what a random target and draft model pair can run."""
    return tuple(kind.name for kind in KINDS if kind.checkpoint in checkpoints)


def kinds_for_benchmarks(quick: bool = False) -> tuple[str, ...]:
    """The registered kinds a benchmark of trees runs, in registry order: every kind but the
    chains (whose size is a chain length, swept by the benchmarks that take one: a draft
    model's chain against HF's assisted generation on the same pair), only the `quick` ones
    when `quick`."""
    return tuple(kind.name for kind in KINDS if not kind.chain and (kind.quick or not quick))


def lookup_kinds() -> tuple[str, ...]:
    """The kinds a spec may graft onto a tree drafter's (`SPEC+KIND[:N]`): those that read no
    checkpoint and build trees (the lookups)."""
    return tuple(kind.name for kind in KINDS if kind.load is None and not kind.chain)


def spec_syntax() -> str:
    """Every spec form, for error messages: "none | ngram[:N] | ... | eagle:PATH[:N]", and the
    lookup graft."""
    grafts = "|".join(lookup_kinds())
    return " | ".join(["none", *(kind.syntax for kind in KINDS), f"SPEC+{{{grafts}}}[:N]"])


def spec_help() -> str:
    """The command line's help on drafter specs, one kind per line."""
    lines = [f"  {'none':<20} plain decoding"]
    lines += [
        f"  {kind.syntax:<20} {kind.help} [{kind.size_name}={kind.default_size}]" for kind in KINDS
    ]
    lines.append(
        f"  {'SPEC+ngram[:N]':<20} a tree SPEC with a lookup's tree grafted on, one verify for "
        f"both ({' or '.join(lookup_kinds())})"
    )
    return "\n".join(lines)


@dataclass(frozen=True)
class DrafterSpec:
    """A parsed drafter SPEC (see the module doc); kind "none" is plain decoding; `graft` the
    lookup grafted onto the drafter's trees (`SPEC+ngram:8`), or None."""

    kind: str
    path: str | None = None
    size: int | None = None
    graft: DrafterSpec | None = None

    @classmethod
    def parse(cls, spec: str) -> DrafterSpec:
        base, plus, lookup = spec.rpartition("+")
        if plus:
            return cls._grafted(spec, cls.parse(base), cls.parse(lookup))
        kind_name, _, rest = spec.partition(":")
        if kind_name in PLAIN_SPECS and not rest:
            return cls("none")
        kind = REGISTRY.get(kind_name)
        if kind is None:
            raise ValueError(f"drafter spec {spec!r}: expected {spec_syntax()}")
        if kind.load is None:
            return cls(kind.name, None, _size(spec, rest) if rest else None)
        if not rest:
            raise ValueError(f"drafter spec {spec!r}: expected {kind.syntax}")
        head, _, tail = rest.rpartition(":")
        if head and tail.isdigit():
            return cls(kind.name, head, _size(spec, tail))
        return cls(kind.name, rest, None)

    @classmethod
    def _grafted(cls, spec: str, base: DrafterSpec, lookup: DrafterSpec) -> DrafterSpec:
        if lookup.kind not in lookup_kinds() or lookup.graft is not None:
            raise ValueError(
                f"drafter spec {spec!r}: after '+' expected a lookup, "
                f"{' or '.join(f'{kind}[:N]' for kind in lookup_kinds())}"
            )
        if base.info is None or base.info.chain or base.graft is not None:
            raise ValueError(
                f"drafter spec {spec!r}: a lookup grafts onto one tree drafter's spec (not "
                "plain decoding, a chain, or another graft)"
            )
        return cls(base.kind, base.path, base.size, lookup)

    @property
    def info(self) -> DrafterKind | None:
        """The registry entry (None for plain decoding)."""
        return REGISTRY.get(self.kind)

    def resolved_size(self, size: int | None = None) -> int:
        """`size`, else the spec's own, else the kind's default (k for chains, N for trees)."""
        return size or self.size or self.info.default_size

    def nodes(self, size: int | None = None) -> int:
        """N, the tokens verified per step, at `size` (1 for plain decoding), a grafted
        lookup's nodes included."""
        if self.info is None:
            return 1
        own = self.info.nodes(self.resolved_size(size))
        return own if self.graft is None else own + self.graft.nodes() - 1

    def with_size(self, size: int | None) -> DrafterSpec:
        """The spec at another size of its drafter (a grafted lookup keeps its own)."""
        return DrafterSpec(self.kind, self.path, size, self.graft)

    def factory(self, target) -> Callable[[int | None], Drafter | None]:
        """Load the spec's checkpoint once for `target`; the result builds a drafter for a size
        (None: the spec's own, else the kind's default)."""
        kind = self.info
        if kind is None:
            return lambda size=None: None
        checkpoint = kind.load(self.path, target) if kind.load is not None else None
        if self.graft is None:
            return lambda size=None: kind.build(checkpoint, self.resolved_size(size))
        lookup = self.graft.factory(target)
        return lambda size=None: GraftedDrafter(
            kind.build(checkpoint, self.resolved_size(size)), lookup()
        )

    def build(self, target, size: int | None = None) -> Drafter | None:
        """The drafter for `target`; `size` (k or N) overrides the spec's own."""
        return self.factory(target)(size)

    def label(self, size: int | None = None) -> str:
        """A display name: `ngram N=8`, `draft:tiny-code-draft k=4 (N=5)`."""
        if self.info is None:
            return "plain"
        name = self.kind if self.path is None else f"{self.kind}:{Path(self.path).name}"
        size = self.resolved_size(size)
        if self.info.chain:
            return f"{name} k={size} (N={size + 1})"
        if self.graft is not None:
            return f"{name} N={size} + {self.graft.label()}"
        return f"{name} N={size}"

    def __str__(self) -> str:
        text = self.kind if self.path is None else f"{self.kind}:{self.path}"
        text = text if self.size is None else f"{text}:{self.size}"
        return text if self.graft is None else f"{text}+{self.graft}"


def bundled_specs() -> list[DrafterSpec]:
    """A spec of every kind over the bundled checkpoints installed (one per checkpoint), in
    registry order: the drafters of the bundled `tiny-code` target."""
    available = set(bundled.available())
    specs = []
    for kind in KINDS:
        if kind.load is None:
            specs.append(DrafterSpec(kind.name))
        specs += [DrafterSpec(kind.name, name) for name in kind.bundled if name in available]
    return specs


def _size(spec: str, text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"drafter spec {spec!r}: size must be a positive integer, got {text!r}")
    return int(text)
