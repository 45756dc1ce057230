"""Prompt lookup on the device: `NGramDrafter`'s match and tree as fixed-shape tensor ops.

The rows' tokens live in a device buffer, `history` int64 `[B, S]` with `lengths` int64 `[B]`,
appended from each step's device outcome (`append_step`), so the drafter follows a step without
reading it and reads ahead (`Drafter.reads_ahead`). `lookup_trees` builds the tree that the host
lookup builds (numpy matching and a `CountTrie`, the oracle: tests/test_ngram_device.py), ties
and padding included, for every row at once and with no read:

1. the ends of the occurrences of the last n tokens, for every n up to `max_n` at once (each a
   mask over the history narrowed one token further back), the longest n with one kept, and its
   `max_matches` newest ends (a top-k over their positions);
2. each occurrence's continuation of `max_depth` tokens, continued with its period where it runs
   into the present;
3. the trie of the continuations without building it: node (m, d) is continuation m's prefix of
   d + 1 tokens, owned by the first continuation with that prefix; its count is the number of
   continuations sharing the prefix;
4. the trie's best-first search as a sort. `CountTrie.best_tree` pops nodes by (count
   descending, depth, push order), and a node is pushed when its parent is popped, siblings in
   the order of their first insertion. So among the nodes of one depth its order is (count
   descending, its parent's order, its owner): ranked depth by depth. The first `max_nodes - 1`
   nodes by (count descending, depth, rank) are the tree (a child never comes before its parent),
   laid out breadth-first by (depth, rank) as the host lays them out.

The tensors are `[B, S]`, `[B, M, M, D]` and `[B, MD, MD]` (M = `max_matches`, D =
`max_depth`), small but many: uncompiled, the lookup is about 280 operators (the loops over n
and depth unrolled) and the append 17. So `NGramDrafter` looks up on the device by default only
where the call compiles; `DeviceLookup` holds the history and runs both steps, each replayed as
a CUDA graph when the call captures.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specdec_fast.compiled import CompiledSteps
from specdec_fast.graphs import StepGraphs
from specdec_fast.transfer import to_device

from .base import PAD_PARENT, DraftState, Proposal, StepOutcome, joined_rows, kept_rows

# The lookup's compiled steps by compile choice, shared by every device lookup of the process
# (each `generate` call of a registry spec makes a new drafter): a shape compiles once.
_STEPS: dict[bool, CompiledSteps] = {}


@dataclass(frozen=True)
class LookupShape:
    """The lookup's parameters (`NGramDrafter`'s), constants of its compiled step."""

    min_n: int
    max_n: int
    max_matches: int
    max_depth: int
    max_nodes: int


class DeviceLookup:
    """`NGramDrafter`'s lookup on the device: the rows' tokens int64 `[B, width]` and lengths
    int64 `[B]` (the last column takes writes past the end), appended by `append_step` from each
    step's device outcome and looked up by `lookup_trees`, each a compiled step when `compile`,
    replayed as CUDA graphs of this lookup's own when `capture` (a replay's outputs are this
    lookup's history)."""

    reads_ahead = True

    def __init__(self, shape: LookupShape, max_cache_len: int, compile: bool, capture: bool):
        self.shape = shape
        # Every token a row holds, its root included, and the column for writes past them.
        self.width = max(max_cache_len + 2, shape.max_matches)
        self._steps = _STEPS.setdefault(compile, CompiledSteps("ngram", compile))
        self._graphs = StepGraphs("ngram", capture, on_capture=self._steps.record)
        self._tokens: torch.Tensor | None = None
        self._lengths: torch.Tensor | None = None

    def begin(self, state: DraftState) -> None:
        self._tokens, self._lengths = self._uploaded(state)

    def _uploaded(self, state: DraftState) -> tuple[torch.Tensor, torch.Tensor]:
        """The history of `state`'s rows (their whole tokens: prompts at `begin`/`join`)."""
        lengths = [len(row) for row in state.tokens]
        if max(lengths) > self.width - 1:
            raise ValueError(
                f"a row of {max(lengths)} tokens is longer than the cache this drafter was "
                f"attached for ({self.width - 2} tokens and its root)"
            )
        tokens = np.zeros((len(lengths), self.width), dtype=np.int64)
        for row, row_tokens in enumerate(state.tokens):
            tokens[row, : len(row_tokens)] = row_tokens
        return to_device(tokens, state.device), to_device(np.array(lengths), state.device)

    def keep(self, rows: list[int]) -> None:
        self._tokens, self._lengths = kept_rows((self._tokens, self._lengths), rows)

    def join(self, state: DraftState) -> None:
        joined = joined_rows((self._tokens, self._lengths), self._uploaded(state))
        self._tokens, self._lengths = joined

    def propose(self, state: DraftState) -> Proposal:
        label = f"lookup B={state.batch_size}"
        args = (self.shape, self._tokens, self._lengths)
        return Proposal(*self._run("lookup", label, lookup_trees, args))

    def update(self, state: DraftState, outcome: StepOutcome) -> None:
        proposal = outcome.proposal
        label = f"append B={state.batch_size} N={proposal.num_nodes}"
        args = (self._tokens, self._lengths, proposal.tokens, outcome.accepted_nodes)
        args += (outcome.num_accepted, outcome.next_tokens)
        self._tokens, self._lengths = self._run("append", label, append_step, args)

    def end(self) -> None:
        self._tokens = self._lengths = None

    def _run(self, kind: str, label: str, step, args: tuple):
        """`step(*args)`: compiled when the call compiles, replayed as a CUDA graph when it
        captures."""
        return self._graphs.run(kind, label, self._steps.run, kind, label, step, *args)


def lookup_trees(
    shape: LookupShape, history: torch.Tensor, lengths: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's lookup tree: (tokens, parents) int64 `[B, max_nodes]`, the root (the row's
    last token) in column 0, unused columns padding (token 0, parent -2).

    history: int64 `[B, S]`, each row's tokens in its first `lengths[b]` columns (>= 1), with
        S >= `max_matches`.
    """
    ends = _newest_ends(shape, history, lengths)
    paths, valid = _continuations(shape, history, lengths, ends)
    return _best_trees(shape, history.gather(1, lengths[:, None] - 1), paths, valid)


def _newest_ends(shape: LookupShape, history: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """`[B, max_matches]`: the ends of the earlier occurrences of each row's last n tokens, for
    the longest n in [min_n, max_n] that occurs, newest first; -1 past the last one. An
    occurrence must leave a token after it (so not the suffix itself), and n stays below the
    row's length, as the host's narrowing does."""
    positions = torch.arange(history.shape[1], device=history.device)[None]
    last = lengths[:, None] - 1

    def back(k: int) -> torch.Tensor:  # [B, 1]: the token k before each row's last
        return history.gather(1, (last - k).clamp(min=0))

    match = (positions < last) & (history == back(0))
    chosen = torch.zeros_like(match)
    for n in range(1, shape.max_n + 1):
        if n > 1:
            earlier = torch.roll(history, n - 1, dims=1)  # earlier[:, e] = history[:, e - n + 1]
            match = match & (positions >= n - 1) & (earlier == back(n - 1)) & (last >= n)
        if n >= shape.min_n:  # the longest n with an occurrence wins
            chosen = torch.where(match.any(dim=1, keepdim=True), match, chosen)
    scores = torch.where(chosen, positions, -1)
    return scores.topk(shape.max_matches, dim=1).values


def _continuations(
    shape: LookupShape, history: torch.Tensor, lengths: torch.Tensor, ends: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(paths int64 `[B, M, D]`, valid bool `[B, M]`): the `max_depth` tokens after each end; one
    that runs into the present (an end p tokens before the last) repeats with period p."""
    batch, matches = ends.shape
    valid = ends >= 0
    period = (lengths[:, None] - 1 - ends).clamp(min=1)[..., None]
    steps = torch.arange(shape.max_depth, device=history.device)
    index = (ends[..., None] + 1 + steps % period).clamp(0, history.shape[1] - 1)
    paths = history.gather(1, index.flatten(1)).view(batch, matches, shape.max_depth)
    return paths, valid


def _best_trees(
    shape: LookupShape, roots: torch.Tensor, paths: torch.Tensor, valid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The `CountTrie` of `paths` (inserted in order), `best_tree(max_nodes, max_depth)`, packed
    with `roots` `[B, 1]`: see the module doc, steps 3 and 4."""
    batch, matches, depth = paths.shape
    device = paths.device
    # shared[b, m, m2, d]: paths m and m2 agree up to depth d.
    shared = (paths[:, :, None, :] == paths[:, None, :, :]).int().cummin(dim=3).values.bool()
    shared = shared & valid[:, :, None, None] & valid[:, None, :, None]
    counts = shared.sum(dim=2)  # [B, M, D]
    owner = shared.int().argmax(dim=2)  # [B, M, D]: the first path with m's prefix
    ids = torch.arange(matches, device=device)
    is_node = valid[..., None] & (owner == ids[None, :, None])

    ranks = []
    parent_rank = torch.zeros_like(counts[:, :, 0])
    for d in range(depth):
        count = counts[:, :, d]
        before = _before(_pair(-count), _pair(parent_rank), _pair(ids[None]))
        rank = (before & is_node[:, :, d, None]).sum(dim=1)
        ranks.append(rank)
        parent_rank = rank.gather(1, owner[:, :, d])

    flat_counts, flat_nodes = counts.flatten(1), is_node.flatten(1)
    flat_ranks = torch.stack(ranks, dim=2).flatten(1)
    depths = torch.arange(depth, device=device).repeat(matches)[None]
    layout = (_pair(depths), _pair(flat_ranks))  # breadth-first, by rank within a depth
    order = (_before(_pair(-flat_counts), *layout) & flat_nodes[:, :, None]).sum(dim=1)
    picked = flat_nodes & (order < shape.max_nodes - 1)
    position = 1 + (_before(*layout) & picked[:, :, None]).sum(dim=1)

    # Node (m, d)'s parent is node (owner[m, d - 1], d - 1); the root's children hang at 0.
    parent_index = owner[:, :, :-1] * depth + torch.arange(depth - 1, device=device)
    parent_position = position.gather(1, parent_index.flatten(1)).view(batch, matches, depth - 1)
    parents = torch.cat([torch.zeros_like(counts[:, :, :1]), parent_position], dim=2).flatten(1)

    width = shape.max_nodes
    column = torch.where(picked, position, width)  # the rest to a column cut off below
    tokens = paths.new_zeros((batch, width + 1)).scatter(1, column, paths.flatten(1))
    links = parents.new_full((batch, width + 1), PAD_PARENT).scatter(1, column, parents)
    tokens = torch.cat([roots, tokens[:, 1:width]], dim=1)
    links = torch.cat([torch.full_like(roots, -1), links[:, 1:width]], dim=1)
    return tokens, links


def _pair(key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`key` `[B, K]` as the (first, second) pair of `_before`: `[B, K, 1]` and `[B, 1, K]`."""
    return key[:, :, None], key[:, None, :]


def _before(*keys: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """`[B, K, K]`: whether item y (dim 1) sorts before item x (dim 2), lexicographically over
    `keys` (`_pair`s), each ascending."""
    before = torch.zeros((), dtype=torch.bool, device=keys[0][0].device)
    tied = torch.ones((), dtype=torch.bool, device=keys[0][0].device)
    for first, second in keys:
        before = before | (tied & (first < second))
        tied = tied & (first == second)
    return before


def append_step(
    history: torch.Tensor,
    lengths: torch.Tensor,
    tokens: torch.Tensor,
    accepted_nodes: torch.Tensor,
    num_accepted: torch.Tensor,
    next_tokens: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(history, lengths)` with each row's accepted drafts and next token appended (a step's
    device outcome: the proposal's `tokens` `[B, N]`, `accepted_nodes` `[B, N]`, `num_accepted`
    and `next_tokens` `[B]`), as new tensors (a captured step's outputs). The last column of
    `history` takes what would run past it, and lengths stop there: a row that long has filled
    its cache."""
    size = history.shape[1]
    steps = torch.arange(tokens.shape[1], device=tokens.device)[None]
    accepted = num_accepted.long()[:, None]
    path = tokens.gather(1, accepted_nodes[:, 1:].long().clamp(min=0))
    following = next_tokens[:, None]
    values = torch.where(steps == accepted, following, torch.cat([path, following], dim=1))
    index = lengths[:, None] + steps
    index = torch.where((steps <= accepted) & (index < size - 1), index, size - 1)
    lengths = (lengths + accepted[:, 0] + 1).clamp(max=size - 1)
    return history.scatter(1, index, values), lengths
