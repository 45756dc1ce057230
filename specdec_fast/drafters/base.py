"""The drafter protocol, and the tree proposal that every drafter returns.

One speculative step, as the engine runs it (docs/ARCHITECTURE.md, "Data flow of one step"):

1. `drafter.propose(state)` returns a `Proposal`: a tree of `N` nodes per active row, node 0 being
   the root (the last token already chosen, not yet in the target's cache; the engine writes it
   into column 0 itself, so a drafter's own value there is ignored), nodes in topological order,
   siblings in the order they should be tried (most likely first).
2. The target verifies the whole tree in one forward pass; `specdec_fast.kernels.verify` picks the
   accepted path and the next token; the target's KV cache is compacted to that path.
3. `drafter.update(state, outcome)` lets the drafter follow (its own cache, features, indexes).

A drafter is any object with these members (subclass `Drafter` for the defaults):

- `max_nodes: int`: the tree budget N, the tokens verified per step with the root included
  (2 to 128, tree attention's limit), so the verify forward has at most N tokens. Chains are
  sized by the tokens they draft, k: a chain of k tokens is a tree of N = k + 1 nodes
  (`DraftModelDrafter(num_tokens=k)`).
- `max_depth: int`: the deepest level a proposal may reach (a chain of k tokens has depth k),
  at most N - 1.
- `hidden_layers: tuple[int, ...]`: target layers whose hidden states the drafter reads (-1 is the
  final normed hidden state that feeds the LM head); the engine captures them at prefill and verify.
- `attach(target, max_cache_len)`: called once per `generate` before anything else; model-based
  drafters check that they fit the target and set up their own caches here. `max_cache_len`
  is the slots a row's steps may write: its KV capacity and one tree beyond it (a row with room
  for its root verifies a whole tree; what lands past the capacity is never kept).
- `begin(state)`: a new batch of requests starts; `state.tokens` holds the prompts and
  `state.hidden` the target's hidden states over the cached prompt tokens (all but the last).
- `propose(state) -> Proposal`.
- `update(state, outcome)`: after verification; `outcome.emitted[r]` are the tokens appended to
  row r
  (accepted drafts then the next token, truncated at a stop), `outcome.hidden` the hidden states of
  the verified nodes.
- `keep(rows)`: finished rows leave the batch; `rows` (a list of ints) indexes the rows that
  remain, in their new order.
- `join(state)`: rows join the running batch (continuous batching, `specdec_fast.serving`),
  appended after the drafter's rows in order; `state` describes only the newcomers, as `begin`'s
  does its batch (prompts, sampling parameters, roots, hidden states over their cached prompt
  tokens). The next `propose` sees the whole batch. Drafters with per-row state implement it;
  `supports_join` tells whether a drafter can serve continuous batching.

Drafters never read device tensors back to the host: what a step's outcome means on the host
(emitted tokens, the accepted node indices, the drafted counts) comes with the outcome, read
once by the engine, and host data goes up with `specdec_fast.transfer.to_device`.
- `end()`: the batch is done (a drafter with a global store may learn from the outputs here).
- `proposals_valid: bool` (optional, default False): the drafter's proposals are valid trees by
  construction, so the engine checks only their shapes (see `Drafter`). A malformed proposal
  never reaches the target: `generate` raises `DrafterError` naming the drafter
  (`specdec_fast.drafters.checks`).
- `reads_ahead: bool` (optional, default False): `update` reads only the outcome's device
  tensors (`proposal`, `accepted_nodes`, `num_accepted`, `next_tokens`, `hidden`), and `propose`
  and `update` read `state.tokens` only for the rows' lengths, which may fall short by up to
  `state.unread` tokens. The engine may then update the drafter as soon as a step is queued,
  before the step is read back, and queue the next step behind it (`generate`'s `read_ahead`):
  the outcome's host fields are None there.
- `read(state, outcome)` (optional): a drafter updated ahead gets the same outcome again once
  its step is read, with the host fields filled in (bookkeeping on the host, such as
  `GuardedDrafter`'s guard; nothing by default).
- `fallbacks: int` (optional, default 0): the times the current (or last) `generate` call fell
  back to plain decoding (`GuardedDrafter`'s events; a wrapper reports its inner drafter's),
  which `generate` reports in `SpecStats.fallbacks`.

Proposals of deterministic drafters (n-gram, suffix, Medusa, EAGLE, top-k draft trees) carry no
draft probabilities; a chain sampled from a draft model carries `draft_probs` so that verification
stays lossless when sampling.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from specdec_fast.kernels.tree_attention import MAX_TREE_NODES
from specdec_fast.kernels.validation import is_int
from specdec_fast.transfer import to_device

PAD_PARENT = -2


@dataclass
class Proposal:
    """A batch of draft trees.

    tokens: int64 [B, N]; column 0 holds the root token of each row.
    parents: int64 [B, N]; -1 for the root, the parent's node index (< own index) for a node,
        -2 for padding.
    draft_probs: optional float [B, N, V], chains only: row i is the draft distribution node i's
        token was sampled from.
    malformed: set by the proposal checks (`specdec_fast.drafters.checks.screen`), never by a
        drafter: bool [B] on the device, the rows whose tree broke a rule and was replaced by
        the root alone; read back with the step (`StepOutcome.malformed`).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    draft_probs: torch.Tensor | None = None
    malformed: torch.Tensor | None = None

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]


@dataclass
class DraftState:
    """What the engine tells a drafter about the active rows (in batch order).

    tokens: per row, every token so far (prompt and emitted); the last one is the root of the next
        tree and is not yet in the target's cache.
    temperature, top_k, top_p: float/int64/float [B] tensors on the device (0.0 = greedy).
    seed: int64 [B] per-row seeds (fixed for the call; vary randomness by position).
    device: the target's device.
    greedy: True when every row decodes greedily (known on the host).
    roots: int64 [B] on the device, each row's root (`tokens[r][-1]`), or None before prefill.
    hidden: target hidden states by layer index: after prefill, [B, T, H] over the cached prompt
        tokens (padded rows hold zeros after `prompt_lens[r] - 1`).
    unread: at most this many tokens per row are missing from `tokens`: those of steps queued
        but not read back yet (read-ahead, `Drafter.reads_ahead`); in `update`, the updated
        step's own included. 0 when every step is read before the drafter sees the next.
    """

    tokens: list[list[int]]
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    seed: torch.Tensor
    device: torch.device
    greedy: bool = True
    roots: torch.Tensor | None = None
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)
    unread: int = 0

    @property
    def batch_size(self) -> int:
        return len(self.tokens)

    @property
    def longest(self) -> int:
        """The most tokens a row may hold, unread ones included: what a drafter bounds its
        cache's lengths with (no device read)."""
        return max(len(row) for row in self.tokens) + self.unread


@dataclass
class StepOutcome:
    """The result of verifying one proposal.

    accepted_nodes: int32 [B, N], the accepted path as node indices, root first, then -1.
    num_accepted: int32 [B], accepted non-root nodes.
    next_tokens: int64 [B], the token sampled after the path.
    emitted: per row, the tokens appended this step (accepted drafts, then the next token),
        truncated after a stop; empty for rows that had already finished.
    hidden: target hidden states of the verified nodes by layer index, [B, N, H].
    accepted_paths: per row, the accepted path's node indices after the root, on the host
        (read back with the emitted tokens: a drafter needs no read of its own to follow it).
    drafted: per row, the draft nodes the tree offered (root excluded), on the host.
    malformed: the rows whose proposal the checks replaced by the root alone (see
        `Proposal.malformed`), on the host; empty when the proposal was not screened or passed.

    The host fields (`emitted`, `accepted_paths`, `drafted`, `malformed`) are None when the
    drafter is updated before the step is read (`Drafter.reads_ahead`).
    """

    proposal: Proposal
    accepted_nodes: torch.Tensor
    num_accepted: torch.Tensor
    next_tokens: torch.Tensor
    emitted: list[list[int]] | None
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)
    accepted_paths: list[list[int]] | None = field(default_factory=list)
    drafted: list[int] | None = field(default_factory=list)
    malformed: list[int] | None = field(default_factory=list)


class Drafter:
    """Base class with the protocol's defaults; subclasses implement `propose`.

    `proposals_valid`: whether every proposal is a valid tree by construction (tokens in the
    vocabulary, parents topological, draft probabilities distributions). The engine screens the
    values of every proposal of a drafter that does not declare it, with a few device ops per
    step and no read of its own (`specdec_fast.drafters.checks`); the built-in drafters declare
    it, and tests/test_drafter_checks.py runs them screened.
    """

    hidden_layers: tuple[int, ...] = ()
    proposals_valid: bool = False
    reads_ahead: bool = False

    def __init__(self, max_nodes: int, max_depth: int | None = None):
        require_int("max_nodes", max_nodes)
        if max_depth is not None:
            require_int("max_depth", max_depth)
        if max_nodes < 2:
            raise ValueError(
                f"max_nodes must be >= 2 (tokens verified per step, root included), got {max_nodes}"
            )
        if max_nodes > MAX_TREE_NODES:
            raise ValueError(
                f"max_nodes must be <= {MAX_TREE_NODES} (tree attention verifies at most "
                f"{MAX_TREE_NODES} nodes per step, root included), got {max_nodes}"
            )
        max_depth = max_nodes - 1 if max_depth is None else max_depth
        if not 1 <= max_depth < max_nodes:
            raise ValueError(
                f"max_depth must be in [1, max_nodes - 1 = {max_nodes - 1}], got {max_depth}"
            )
        self.max_nodes = int(max_nodes)
        self.max_depth = int(max_depth)

    def follow_paths_to(self, depth: int) -> None:
        """Let `update` follow accepted paths up to `depth` drafted nodes deep, deeper than this
        drafter's own trees reach: a `GraftedDrafter` verifies another drafter's branches beside
        this one's, and the accepted path may run down them. Called before `attach`. By default
        a drafter follows paths only as deep as its own trees (`max_depth`); drafters whose
        `update` takes a path of any depth override this."""
        if depth > self.max_depth:
            raise ValueError(
                f"{type(self).__name__} follows accepted paths at most max_depth = "
                f"{self.max_depth} deep, not {depth}: graft a shallower lookup onto it"
            )

    def attach(self, target, max_cache_len: int) -> None:
        """Bind to the target model of a `generate` call (lookup drafters need nothing)."""

    def begin(self, state: DraftState) -> None:
        """A new batch starts (stateless drafters need nothing)."""

    def propose(self, state: DraftState) -> Proposal:
        raise NotImplementedError

    def update(self, state: DraftState, outcome: StepOutcome) -> None:
        """Follow the accepted path (stateless drafters need nothing)."""

    def read(self, state: DraftState, outcome: StepOutcome) -> None:
        """After an `update` ahead of the read (`reads_ahead`): the step's outcome with its host
        fields, once read (nothing to do by default)."""

    def keep(self, rows: list[int]) -> None:
        """Finished rows left the batch (stateless drafters need nothing)."""

    def join(self, state: DraftState) -> None:
        """Rows described by `state` join the running batch after the drafter's rows (see the
        module doc). Stateless drafters need nothing; a drafter that overrides `begin` or `keep`
        keeps per-row state and must override this too to serve continuous batching."""
        if not supports_join(self):
            raise NotImplementedError(
                f"{type(self).__name__} keeps per-row state but does not implement join(state): "
                "rows cannot join its running batch (continuous batching)"
            )

    def end(self) -> None:
        """The batch is done."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(max_nodes={self.max_nodes}, max_depth={self.max_depth})"


def require_int(name: str, value) -> None:
    """TypeError naming `name` unless `value` is an integer (`kernels.validation.is_int`)."""
    if not is_int(value):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}")


def supports_join(drafter) -> bool:
    """Whether rows can join `drafter`'s running batch: it implements `join`, or it keeps no
    per-row state (a `Drafter` overriding neither `begin` nor `keep`)."""
    kind = type(drafter)
    join = getattr(kind, "join", None)
    if join is None:
        return False
    if join is not Drafter.join:
        return True
    return kind.begin is Drafter.begin and kind.keep is Drafter.keep


def reads_ahead(drafter) -> bool:
    """Whether `drafter` can be updated before its step is read back (`Drafter.reads_ahead`)."""
    return bool(getattr(drafter, "reads_ahead", False))


def fallbacks(drafter) -> int:
    """The fallbacks to plain decoding of `drafter`'s current or last call (`Drafter.fallbacks`,
    0 for a drafter that has none)."""
    return int(getattr(drafter, "fallbacks", 0))


def reads_back(drafter) -> bool:
    """Whether `drafter` takes a read-ahead step's host fields once read: its `read` does
    something (a `Drafter` that overrides it, or any other object that has one), so the step
    keeps the outcome for it; the others cost the step nothing more."""
    read = getattr(type(drafter), "read", None)
    return read is not None and read is not Drafter.read


def kept_rows(tensors: Sequence[torch.Tensor], rows: list[int]) -> tuple[torch.Tensor, ...]:
    """A drafter's per-row device tensors (`[B, ...]` each) of the rows `rows`, in that order:
    what its `keep` keeps."""
    index = to_device(rows, tensors[0].device)
    return tuple(tensor[index] for tensor in tensors)


def joined_rows(
    tensors: Sequence[torch.Tensor], newcomers: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, ...]:
    """A drafter's per-row device tensors with the newcomers' rows after the batch's: what its
    `join` holds."""
    return tuple(torch.cat(pair) for pair in zip(tensors, newcomers, strict=True))


def root_only(state: DraftState) -> Proposal:
    """The one-node tree of every row: verifying it is one step of plain decoding. Built on the
    device without reading anything: the engine writes each row's root into column 0."""
    batch = state.batch_size
    tokens = torch.zeros((batch, 1), dtype=torch.int64, device=state.device)
    return Proposal(tokens=tokens, parents=torch.full_like(tokens, -1))


def pack_trees(
    roots: Sequence[int],
    trees: Sequence[tuple[Sequence[int], Sequence[int]]],
    device: torch.device,
    num_nodes: int | None = None,
) -> Proposal:
    """Pad per-row trees into a `Proposal`.

    roots: the root token of each row.
    trees: per row, (tokens, parents) of its draft nodes in topological order; parents index the
        row's node list with the root as 0, so the first node's parent is 0.
    num_nodes: N of the result (root included); the smallest that fits when None.
    """
    longest = max((len(tokens) for tokens, _ in trees), default=0) + 1
    width = longest if num_nodes is None else num_nodes
    if width < longest:
        raise ValueError(f"num_nodes={num_nodes} cannot hold a tree of {longest} nodes")
    tokens = np.zeros((len(trees), width), dtype=np.int64)
    parents = np.full((len(trees), width), PAD_PARENT, dtype=np.int64)
    parents[:, 0] = -1
    tokens[:, 0] = list(roots)
    for row, (node_tokens, node_parents) in enumerate(trees):
        count = len(node_tokens)
        if count:
            tokens[row, 1 : count + 1] = node_tokens
            parents[row, 1 : count + 1] = node_parents
    return Proposal(tokens=to_device(tokens, device), parents=to_device(parents, device))


def with_roots(proposal: Proposal, roots: torch.Tensor, width: int) -> Proposal:
    """`proposal` with each row's root (`roots` int64 `[B]`) in column 0, whatever the drafter put
    there, widened to `width` nodes with padding nodes when it is narrower."""
    batch, nodes = proposal.tokens.shape
    pieces = [roots[:, None], proposal.tokens[:, 1:].to(torch.int64)]
    parents = proposal.parents.to(torch.int64)
    probs = proposal.draft_probs
    if width > nodes:
        pieces.append(roots.new_zeros((batch, width - nodes)))
        parents = torch.cat([parents, parents.new_full((batch, width - nodes), PAD_PARENT)], 1)
    if probs is not None and probs.shape[1] < parents.shape[1]:
        padding = probs.new_zeros((batch, parents.shape[1] - probs.shape[1], probs.shape[2]))
        probs = torch.cat([probs, padding], 1)
    return Proposal(torch.cat(pieces, dim=1), parents, probs, proposal.malformed)
