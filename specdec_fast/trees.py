"""Draft-tree shapes: static trees from top-k index paths, dynamic (EAGLE-2) trees, trees from a
block drafter's distributions, validation.

A static tree is a set of paths of top-k ranks below the root: `(0,)` is the most likely token
after the root, `(0, 1)` the second most likely token after that one, and so on. Three spellings
are accepted (`parse_tree`): Medusa's `medusa_choices` (a list of lists, e.g.
`[[0], [0, 0], [1], [0, 1]]`), vLLM's `speculative_token_tree` string (e.g.
`"[(0,), (1,), (0, 0)]"`), and parent pointers (`StaticTree.from_parents`). A drafter fills such a
tree with tokens (Medusa: the top-k of head d at depth d) and the verifier walks it. Every form
gives the same structure: parents, depths, positions, ancestor masks, root-to-leaf paths.

A dynamic tree (EAGLE-2, `DynamicTreeBuilder`) is grown per step from the draft's own scores:
level by level, the k best frontier nodes by cumulative log-probability each get their top-k
children; at the end the best `max_nodes - 1` candidates overall by cumulative score form the
tree under the root.

Block drafters (DFlash, PARD) give one draft distribution per position of a block instead of a
tree's levels; `best_first_tree` (DDTree-style: the paths with the highest product of marginals),
`block_chain` (top-1) and `sampled_block_chain` (sampled, with the draft probabilities that keep
verification lossless) turn them into proposals.

Sizes count the root everywhere: a tree of N nodes (`StaticTree.num_nodes`, `default_tree(N)`,
a budget `max_nodes=N`) is the root plus N - 1 draft nodes, so verifying it costs exactly N
tokens of the target's forward.
"""

from __future__ import annotations

import ast
import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specdec_fast import graphs
from specdec_fast.kernels.rng import gumbel, stream_key
from specdec_fast.transfer import host_resident, to_device, to_host_array

# Probability that the rank-r candidate is the right token, used only to shape the default trees
# (a profile typical of trained Medusa/EAGLE heads: most mass on the top-1, a long thin tail).
DEFAULT_RANK_PROBS = (0.60, 0.14, 0.06, 0.035, 0.02, 0.012, 0.008, 0.005)
# The parent of a padded node, one that does not exist (as in `Proposal`).
PAD_NODE = -2


@dataclass(frozen=True)
class StaticTree:
    """A tree of top-k rank paths, in topological order (by depth, then lexicographic).

    Node 0 is the implicit root; the fields below list the draft nodes 1..N-1.
    paths: per draft node, its rank path from the root.
    parents: per draft node, the index of its parent in the node list with the root as 0, so
        `parents[i]` refers to node `parents[i]` and draft node i is node i + 1.
    depths: per draft node, its depth (1 for the root's children).
    ranks: per draft node, its own rank among its siblings' candidates (the path's last entry).
    """

    paths: tuple[tuple[int, ...], ...]
    parents: tuple[int, ...]
    depths: tuple[int, ...]
    ranks: tuple[int, ...]

    @property
    def num_nodes(self) -> int:
        """N: the nodes of the tree, root included (the tokens one verify step costs)."""
        return len(self.paths) + 1

    @property
    def max_depth(self) -> int:
        return max(self.depths, default=0)

    @property
    def max_rank(self) -> int:
        """Candidates needed per node: 1 + the largest rank used."""
        # No `max(..., default=)`: compiled draft loops read this, and dynamo cannot trace it.
        return max(self.ranks) + 1 if self.ranks else 0

    def to_choices(self) -> list[list[int]]:
        return [list(path) for path in self.paths]

    def to_token_tree_string(self) -> str:
        return "[" + ", ".join(_tuple_repr(path) for path in self.paths) + "]"

    @property
    def node_parents(self) -> tuple[int, ...]:
        """Per node, root included: -1 for the root, then `parents` (the `Proposal` layout)."""
        return (-1, *self.parents)

    @property
    def positions(self) -> tuple[int, ...]:
        """Per node, root included: its depth, i.e. its position offset after the root's."""
        return (0, *self.depths)

    def ancestor_mask(self) -> torch.Tensor:
        """Bool `[N, N]` over the nodes, root included: `[i, j]` says node j is node i or one of
        its ancestors (the tree-attention mask of the verify step)."""
        size = self.num_nodes
        mask = torch.eye(size, dtype=torch.bool)
        for node, parent in enumerate(self.parents, start=1):
            mask[node] |= mask[parent]
        return mask

    def leaf_paths(self) -> list[tuple[int, ...]]:
        """Node-index paths from the root (0) to every leaf, in node order of the leaves."""
        has_child = set(self.parents)
        paths = []
        for leaf in range(1, self.num_nodes):
            if leaf in has_child:
                continue
            path, node = [leaf], leaf
            while node:
                node = self.parents[node - 1]
                path.append(node)
            paths.append(tuple(reversed(path)))
        return paths

    @classmethod
    def from_choices(
        cls, choices: Iterable[Sequence[int]], max_nodes: int | None = None
    ) -> StaticTree:
        """Build from `medusa_choices`-style rank paths (the draft nodes; the root is implicit);
        raises ValueError on duplicates, missing ancestors, negative ranks, empty paths, or a tree
        of more than `max_nodes` nodes, root included."""
        paths = [tuple(int(rank) for rank in path) for path in choices]
        if not paths:
            raise ValueError("a tree needs at least one path")
        seen = set()
        for path in paths:
            if not path:
                raise ValueError("empty path: the root is implicit, list only draft nodes")
            if any(rank < 0 for rank in path):
                raise ValueError(f"negative rank in path {list(path)}")
            if path in seen:
                raise ValueError(f"duplicate path {list(path)}")
            seen.add(path)
        for path in paths:
            if len(path) > 1 and path[:-1] not in seen:
                raise ValueError(f"path {list(path)} has no parent path {list(path[:-1])}")
        _check_budget(len(paths) + 1, max_nodes)
        ordered = sorted(paths, key=lambda path: (len(path), path))
        index = {path: i + 1 for i, path in enumerate(ordered)}
        parents = tuple(index[path[:-1]] if len(path) > 1 else 0 for path in ordered)
        return cls(
            paths=tuple(ordered),
            parents=parents,
            depths=tuple(len(path) for path in ordered),
            ranks=tuple(path[-1] for path in ordered),
        )

    @classmethod
    def from_token_tree_string(cls, text: str, max_nodes: int | None = None) -> StaticTree:
        """Build from vLLM's `speculative_token_tree`, e.g. "[(0,), (1,), (0, 0)]"."""
        try:
            value = ast.literal_eval(text)
        except (SyntaxError, ValueError) as error:
            raise ValueError(f"cannot parse token tree {text!r}: {error}") from None
        if not isinstance(value, list | tuple) or not all(
            isinstance(path, list | tuple) and all(isinstance(r, int) for r in path)
            for path in value
        ):
            raise ValueError(f"token tree must be a list of tuples of ints, got {text!r}")
        return cls.from_choices(value, max_nodes)

    @classmethod
    def from_parents(cls, parents: Sequence[int], max_nodes: int | None = None) -> StaticTree:
        """Build from parent pointers over the nodes, root included (`[-1, 0, 0, 1, ...]`: node 0
        is the root, every other node's parent comes before it). Siblings get ranks in node
        order, and the nodes are renumbered in the canonical order (by depth, then rank path).
        Raises ValueError on a missing root, a parent that does not come first, or more than
        `max_nodes` nodes, root included."""
        parents = [int(p) for p in parents]
        if not parents or parents[0] != -1:
            raise ValueError(f"parents: expected -1 (the root) first, got {parents[:1]}")
        paths: list[tuple[int, ...]] = [()]
        children = [0] * len(parents)
        for node, parent in enumerate(parents[1:], start=1):
            if not 0 <= parent < node:
                raise ValueError(
                    f"parents: node {node} has parent {parent}; expected a node in [0, {node})"
                )
            paths.append((*paths[parent], children[parent]))
            children[parent] += 1
        return cls.from_choices(paths[1:], max_nodes)

    @classmethod
    def chain(cls, num_tokens: int) -> StaticTree:
        """The top-1 chain of `num_tokens` drafted tokens (a tree of `num_tokens + 1` nodes)."""
        return cls.from_choices([[0] * depth for depth in range(1, num_tokens + 1)])


TreeSpec = StaticTree | Sequence[Sequence[int]] | str


def parse_tree(tree: TreeSpec, max_nodes: int | None = None) -> StaticTree:
    """A `StaticTree` from any of its spellings: a `StaticTree`, `medusa_choices` rank paths, or
    a `speculative_token_tree` string; raises ValueError on a malformed tree or one of more than
    `max_nodes` nodes, root included."""
    if isinstance(tree, StaticTree):
        _check_budget(tree.num_nodes, max_nodes)
        return tree
    if isinstance(tree, str):
        return StaticTree.from_token_tree_string(tree, max_nodes)
    return StaticTree.from_choices(tree, max_nodes)


def _check_budget(num_nodes: int, max_nodes: int | None) -> None:
    if max_nodes is not None and num_nodes > max_nodes:
        raise ValueError(
            f"tree has {num_nodes} nodes (root included), over the budget of {max_nodes}"
        )


def _tuple_repr(path: tuple[int, ...]) -> str:
    return "(" + ", ".join(str(r) for r in path) + ("," if len(path) == 1 else "") + ")"


def best_static_tree(
    num_nodes: int,
    rank_probs: Sequence[float] = DEFAULT_RANK_PROBS,
    max_depth: int | None = None,
) -> StaticTree:
    """The tree of `num_nodes` nodes (root included) with the largest expected accepted length
    when the rank-r candidate at any node is right with probability `rank_probs[r]`
    independently of depth: a path's value is the product of its ranks' probabilities, and the
    best `num_nodes - 1` draft nodes are taken best-first (a child never scores above its
    parent, so the result is a tree)."""
    if num_nodes < 2:
        raise ValueError(f"num_nodes must be >= 2 (the root and a draft node), got {num_nodes}")
    heap = [(-rank_probs[r], (r,)) for r in range(len(rank_probs))]
    heapq.heapify(heap)
    chosen: list[tuple[int, ...]] = []
    while heap and len(chosen) < num_nodes - 1:
        neg_value, path = heapq.heappop(heap)
        chosen.append(path)
        if max_depth is None or len(path) < max_depth:
            for r, prob in enumerate(rank_probs):
                heapq.heappush(heap, (neg_value * prob, (*path, r)))
    return StaticTree.from_choices(chosen)


DEFAULT_BUDGETS = (8, 16, 32, 64)


def default_tree(num_nodes: int, max_depth: int = 8) -> StaticTree:
    """A good static tree of `num_nodes` nodes, root included (8, 16, 32 and 64 are the tuned
    defaults; any other budget gets the same construction); `max_depth` caps it (e.g. at
    Medusa's head count)."""
    return best_static_tree(num_nodes, DEFAULT_RANK_PROBS, max_depth=max_depth)


# EAGLE-2 shapes per node budget N (root included): (depth, top-k). Candidates k + (depth - 1) k^2
# exceed the N - 1 draft nodes, so the final selection has room to choose; the frontier (k nodes
# per level) stays small.
DYNAMIC_TREE_SHAPES = {8: (4, 3), 16: (5, 4), 32: (6, 6), 64: (7, 8)}


def dynamic_tree_shape(max_nodes: int) -> tuple[int, int]:
    """(depth, top_k) for a dynamic tree of `max_nodes` nodes, root included: the tuned shape of
    the nearest default budget at or above it (the largest one beyond 64), depth capped at the
    `max_nodes - 1` draft nodes."""
    if max_nodes < 2:
        raise ValueError(f"max_nodes must be >= 2 (the root and a draft node), got {max_nodes}")
    budget = min(
        (b for b in DYNAMIC_TREE_SHAPES if b >= max_nodes), default=max(DYNAMIC_TREE_SHAPES)
    )
    depth, top_k = DYNAMIC_TREE_SHAPES[budget]
    return min(depth, max_nodes - 1), top_k


def check_dynamic_tree(top_k: int, depth: int, max_nodes: int) -> None:
    """Raise ValueError unless a dynamic tree of these arguments (`max_nodes` counting the root)
    can be built."""
    if top_k < 1 or depth < 1 or max_nodes < 2:
        raise ValueError(
            f"top_k and depth must be >= 1 and max_nodes >= 2, got {top_k}, {depth} and {max_nodes}"
        )
    candidates = top_k + (depth - 1) * top_k * top_k
    if max_nodes - 1 > candidates:
        raise ValueError(
            f"max_nodes={max_nodes} needs {max_nodes - 1} draft nodes, over the {candidates} "
            f"candidates that top_k={top_k} and depth={depth} produce (top_k + (depth - 1) * "
            "top_k^2)"
        )


class DynamicTreeBuilder:
    """Grows a batch of EAGLE-2 dynamic trees from the draft's top-k scores, level by level.

    Usage, for B rows: `tokens = start(scores [B, k], tokens [B, k])` with the root's top-k
    children; then per further level, `tokens, source = expand(scores [B, k, k], tokens [B, k, k])`
    where row i holds the top-k children of frontier node i (scores are the draft's
    log-probabilities, not cumulative). Each call returns the new frontier: the k candidates of
    the level with the best cumulative scores (int64 `[B, k]`) and, from `expand`, which node of
    the previous frontier each one hangs from (int64 `[B, k]`). `finish(roots)` keeps the
    `max_nodes - 1` best candidates overall and returns `(tokens, parents)`, int64
    `[B, max_nodes]` in topological order (by depth, then best first), node 0 being the root.

    Candidates are numbered in the order they come: the root's k children, then per level the k
    children of each frontier node in frontier order. A child's cumulative score never exceeds
    its parent's, and ties go to the earlier (never deeper) candidate, in the frontier's choice
    and the final one alike, so the kept set always contains every kept node's parent.
    Everything is batched tensor work with shapes fixed by (B, k, depth, max_nodes): no host
    reads, so the whole build runs inside a compiled draft step (`EagleDrafter`); the
    plain-Python builder in tests/test_trees.py is its oracle.
    """

    def __init__(self, top_k: int, depth: int, max_nodes: int):
        check_dynamic_tree(top_k, depth, max_nodes)
        self.top_k, self.depth, self.max_nodes = top_k, depth, max_nodes
        self._levels = 0

    def start(self, scores: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The root's children: scores float `[B, k]`, tokens int `[B, k]`."""
        self._check("scores", scores, (self.top_k,))
        self._check("tokens", tokens, (self.top_k,))
        scores = self._log_probs(scores)
        batch = scores.shape[0]
        self._scores, self._tokens = [scores], [tokens.long()]
        self._parents = [torch.full_like(tokens, -1, dtype=torch.long)]
        self._depths = [torch.ones(batch, self.top_k, dtype=torch.long, device=scores.device)]
        self._frontier = torch.arange(self.top_k, device=scores.device).expand(batch, -1)
        self._frontier_scores = scores
        self._count, self._levels = self.top_k, 1
        return tokens.long()

    def expand(
        self, scores: torch.Tensor, tokens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The frontier's children: scores float `[B, k, k]`, tokens int `[B, k, k]`."""
        if not 1 <= self._levels < self.depth:
            raise RuntimeError(
                f"expand: call start first, and at most depth - 1 = {self.depth - 1} times"
            )
        k = self.top_k
        self._check("scores", scores, (k, k))
        self._check("tokens", tokens, (k, k))
        cumulative = (self._frontier_scores[:, :, None] + self._log_probs(scores)).flatten(1)
        flat_tokens = tokens.long().flatten(1)
        self._scores.append(cumulative)
        self._tokens.append(flat_tokens)
        self._parents.append(self._frontier.repeat_interleave(k, dim=1))
        self._levels += 1
        self._depths.append(torch.full_like(flat_tokens, self._levels))
        # A stable sort, not topk (whose order among equal values is unspecified): ties go to
        # the earlier candidate, on every device and in compiled graphs alike.
        best = cumulative.sort(dim=1, descending=True, stable=True).indices[:, :k]
        self._frontier = self._count + best
        self._frontier_scores = cumulative.gather(1, best)
        self._count += k * k
        return flat_tokens.gather(1, best), best // k

    def finish(self, roots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The best `max_nodes - 1` candidates as a tree under `roots` (int `[B]`)."""
        if self._levels == 0:
            raise RuntimeError("finish: call start first")
        scores = torch.cat(self._scores, dim=1)
        tokens = torch.cat(self._tokens, dim=1)
        parents = torch.cat(self._parents, dim=1)
        depths = torch.cat(self._depths, dim=1)
        drafted = self.max_nodes - 1
        if drafted > scores.shape[1]:
            raise RuntimeError(
                f"finish: {scores.shape[1]} candidates after {self._levels} levels, fewer than "
                f"the {drafted} draft nodes of max_nodes={self.max_nodes}"
            )
        # Stable: among equal scores the earlier candidate (never deeper) comes first.
        chosen = scores.sort(dim=1, descending=True, stable=True).indices[:, :drafted]
        by_depth = depths.gather(1, chosen).sort(dim=1, stable=True).indices
        chosen = chosen.gather(1, by_depth)
        batch = chosen.shape[0]
        node_of = torch.full_like(tokens, -1)
        node_ids = torch.arange(1, self.max_nodes, device=chosen.device).expand(batch, -1)
        node_of.scatter_(1, chosen, node_ids)
        parent_candidates = parents.gather(1, chosen)
        parent_nodes = torch.where(
            parent_candidates < 0, 0, node_of.gather(1, parent_candidates.clamp(min=0))
        )
        root_parent = torch.full((batch, 1), -1, dtype=torch.long, device=chosen.device)
        out_tokens = torch.cat([roots.long().reshape(batch, 1), tokens.gather(1, chosen)], dim=1)
        return out_tokens, torch.cat([root_parent, parent_nodes], dim=1)

    @staticmethod
    def _log_probs(scores: torch.Tensor) -> torch.Tensor:
        # Log-probabilities are <= 0 (so a child never outranks its parent); NaN ranks last.
        return torch.nan_to_num(scores.float(), nan=-torch.inf).clamp(max=0.0)

    def _check(self, name: str, tensor: torch.Tensor, tail: tuple[int, ...]) -> None:
        if tensor.dim() != 1 + len(tail) or tuple(tensor.shape[1:]) != tail:
            dims = ", ".join(["B", *map(str, tail)])
            raise ValueError(
                f"{name}: expected shape [{dims}] (top_k={self.top_k}), got {tuple(tensor.shape)}"
            )


# --- trees from a block drafter's per-position distributions -------------------------------------
#
# A block drafter (DFlash, PARD) gives, in one forward, the draft distribution of each of the next
# D tokens: position d (1-based depth) holds q_d, a marginal that does not depend on the tokens
# drafted at depths < d. The builders below turn logits `[B, D, V]` (position d - 1 holds q_d)
# into proposals of N nodes, root included, without reading anything back to the host.


def block_chain(
    logits: torch.Tensor, roots: torch.Tensor, num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-1 chain: `num_tokens` <= D drafted tokens, the argmax of each position.

    logits: float `[B, D, V]`; roots: int `[B]`. Returns int64 `(tokens, parents)`, each
    `[B, num_tokens + 1]`, node 0 being the root.
    """
    _check_block("logits", logits, num_tokens)
    batch = logits.shape[0]
    drafted = logits[:, :num_tokens].argmax(dim=-1)
    tokens = torch.cat([roots.long().reshape(batch, 1), drafted], dim=1)
    parents = torch.arange(-1, num_tokens, device=logits.device).expand(batch, -1).contiguous()
    return tokens, parents


def sample_draft_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seed: torch.Tensor,
    positions: torch.Tensor,
    stream: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw a draft token from softmax(logits / T) at each of D positions of B rows, by
    Gumbel-max with counter-based noise keyed by (row seed + position, `stream`) on the device,
    as `verify` keys its own streams per node; rows at temperature 0 take the argmax.

    logits: float `[B, D, V]`; temperature: float `[B]`; seed: int64 `[B]`; positions: int64
    `[B, D]`, each drawn token's position in its sequence (fresh noise per position); stream: the
    caller's random stream (`verify` uses 0 and 1). Returns the tokens (int64 `[B, D]`) and the
    distributions they were drawn from (`[B, D, V]`; one-hot for greedy rows), which is what
    `verify` needs as `draft_probs` to stay lossless.
    """
    sampled = (temperature > 0)[:, None, None]
    scaled = logits / torch.where(temperature > 0, temperature, 1.0)[:, None, None]
    vocab = torch.arange(logits.shape[-1], device=logits.device)
    key = stream_key((seed[:, None] + positions)[:, :, None], 0, 0, stream)
    drawn = (scaled + gumbel(key, vocab)).argmax(dim=-1)
    greedy = logits.argmax(dim=-1)
    # A scatter, not `F.one_hot`: off CUDA that reads the indices' range back to the host.
    one_hot = torch.zeros_like(logits).scatter_(-1, greedy[..., None], 1.0)
    probs = torch.where(sampled, torch.softmax(scaled, dim=-1), one_hot)
    return torch.where(sampled[..., 0], drawn, greedy), probs


def sampled_block_chain(
    logits: torch.Tensor,
    roots: torch.Tensor,
    num_tokens: int,
    temperature: torch.Tensor,
    seed: torch.Tensor,
    root_positions: torch.Tensor,
    stream: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A chain of `num_tokens` <= D tokens sampled from the positions' distributions (see
    `sample_draft_tokens`), with the draft probabilities that `verify` takes for chains.

    logits: float `[B, D, V]`; roots: int `[B]`; temperature: float `[B]`; seed: int64 `[B]`;
    root_positions: int64 `[B]`, the root's position (node d sits at root_position + d).
    Returns int64 `(tokens, parents)` `[B, num_tokens + 1]` and `draft_probs`
    `[B, num_tokens + 1, V]` (row 0, the root's, zeros).
    """
    tokens, parents = block_chain(logits, roots, num_tokens)
    depths = torch.arange(1, num_tokens + 1, device=logits.device)
    positions = root_positions.long()[:, None] + depths
    drawn, probs = sample_draft_tokens(logits[:, :num_tokens], temperature, seed, positions, stream)
    tokens = torch.cat([tokens[:, :1], drawn], dim=1)
    draft_probs = torch.cat([torch.zeros_like(probs[:, :1]), probs], dim=1)
    return tokens, parents, draft_probs


def best_first_tree(
    log_probs: torch.Tensor, roots: torch.Tensor, max_nodes: int, depth_scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The DDTree-style tree of `max_nodes` nodes, root included: the `max_nodes - 1` token
    paths with the highest product of per-position marginals, `q_1(x_1) q_2(x_2) ... q_d(x_d)`.

    `depth_scale` s calibrates that product for drafters whose deeper marginals are
    underconfident: a path scores `q_1(x_1) (q_2(x_2) ... q_d(x_d)) ** s`. With s = 1 (the
    default) it is DDTree's product. A block drafter's marginal at depth d >= 2 averages over
    the tokens before it, so it is flatter than the odds that the token follows once those
    tokens are right; s < 1 moves nodes from the long tail of depth 1 to the likely paths
    below it (`specdec_fast.train.calibrate` fits s for a checkpoint). Any s > 0 keeps the
    ordering below.

    Node d's candidates are the K = min(max_nodes - 1, V) most likely tokens of q_d. Best-first
    over rank paths: popping a node pushes its first child (rank 0 one level deeper) and its next
    sibling (rank + 1 at its level); both score no higher than it, so the pops come out in
    decreasing score and every node after its parent and its better siblings. The tree is thus
    in topological order with siblings most likely first (the order `verify` tries them), and
    its first n nodes are the best tree of n nodes (what a wrapper trimming it keeps). Ties go to
    the candidate pushed first. Rows whose candidates run out are padded (parent -2).

    log_probs: float `[B, D, V]`, log q_d at position d - 1 (-inf allowed); roots: int `[B]`.
    Returns int64 `(tokens, parents)` `[B, max_nodes]`, on `log_probs`' device. Traced by
    `torch.compile` (a block drafter's compiled step) or captured as a CUDA graph
    (`graphs.capturing`), the pops are device rounds inside the graph
    (`best_first_on_device`): no read. Eagerly, they run on a heap per row on the host
    (`_best_first_on_host`); on an accelerator after one read of the top-K candidates.
    """
    if max_nodes < 2:
        raise ValueError(f"max_nodes must be >= 2 (the root and a draft node), got {max_nodes}")
    check_depth_scale(depth_scale)
    _check_block("log_probs", log_probs, 1)
    width = min(max_nodes - 1, log_probs.shape[2])
    # Finite scores: -inf stays for empty frontier slots only.
    top = log_probs.float().nan_to_num(nan=-1e30).clamp(min=-1e30).topk(width, dim=-1)
    values = top.values
    if depth_scale != 1.0:
        values = torch.cat([values[:, :1], values[:, 1:] * depth_scale], dim=1)
    if torch.compiler.is_compiling() or graphs.capturing():
        return best_first_on_device(values, top.indices, roots, max_nodes)
    if host_resident(log_probs):
        return _best_first_on_host(values, top.indices, roots, max_nodes)
    # Eagerly on an accelerator the heap runs on the host, after one read of the top-K (values
    # and candidates packed, both exact in float64) and before one upload: the device rounds
    # launch about 10 small kernels a node outside a graph (the batched form before them, 45 a
    # node, made the block drafters' eager GPU steps 8-10 ms against 0.6 for plain decoding,
    # bench/NOTES.md, 2026-12-04); the heap takes 0.02 ms at B = 1 and 2.4 ms at B = 64 for
    # 16 nodes.
    packed = to_host_array(torch.stack([values.double(), top.indices.double()]))
    scores, ids = packed[0].astype(np.float32), packed[1].astype(np.int64)
    placeholder = np.zeros(roots.shape[0], dtype=np.int64)
    tree = _best_first_heaps(scores, ids, placeholder, max_nodes)
    tokens, parents = to_device(np.stack(tree), log_probs.device).unbind(0)
    tokens[:, 0] = roots
    return tokens, parents


def best_first_on_device(
    values: torch.Tensor, candidates: torch.Tensor, roots: torch.Tensor, max_nodes: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`_best_first_heaps`'s pops as `max_nodes - 1` rounds of device ops of static shapes, for
    a compiled step: no host read, the same trees (ties and padding included).

    The heap becomes a frontier of `2 * max_nodes - 1` fixed slots per row: the first holds the
    top candidate of position 1, and round n (the pop of node n) writes the child it pushes to
    slot `2n - 1` and the sibling to slot `2n`, so slot order is push order and a round's
    argmax (first index among equal scores) pops what the heap pops. A pop of an empty frontier
    (every slot -inf) lands on the first slot, whose token pads the row as the heap's does.

    values: float32 `[B, D, K]`, each position's top-K log-probabilities in decreasing order
    (finite; scaled by the depth scale past position 1); candidates: int64 `[B, D, K]`, their
    tokens; roots: int `[B]`. Returns int64 `(tokens, parents)` `[B, max_nodes]`.
    """
    batch, depth, width = values.shape
    cells = depth * width
    flat_values, flat_ids = values.flatten(1), candidates.flatten(1)  # [B, D * K]
    slots = 2 * max_nodes - 1
    # Per slot: the candidate's score, its parent's score, its cell (level * K + rank) and its
    # parent node.
    score = values.new_full((batch, slots), -torch.inf)
    score[:, 0] = flat_values[:, 0]
    base = torch.zeros_like(score)
    cell = torch.zeros(batch, slots, dtype=torch.int64, device=values.device)
    parent = torch.zeros_like(cell)
    tokens, parents = [roots.long()[:, None]], [torch.full_like(cell[:, :1], -1)]
    for node in range(1, max_nodes):
        best = score.argmax(dim=1, keepdim=True)
        best_score, best_base = score.gather(1, best), base.gather(1, best)
        best_cell, best_parent = cell.gather(1, best), parent.gather(1, best)
        found = best_score > -torch.inf
        tokens.append(flat_ids.gather(1, best_cell))
        parents.append(torch.where(found, best_parent, PAD_NODE))
        score = score.scatter(1, best, -torch.inf)
        # The first child (rank 0 one level deeper) and the next sibling (rank + 1).
        child_cell = best_cell - best_cell % width + width
        sibling_cell = best_cell + 1
        pushed_cell = torch.cat([child_cell, sibling_cell], dim=1)  # [B, 2]
        allowed = found & torch.cat([child_cell < cells, sibling_cell % width != 0], dim=1)
        pushed_base = torch.cat([best_score, best_base], dim=1)
        gained = flat_values.gather(1, pushed_cell.clamp(max=cells - 1))
        pushed = slice(2 * node - 1, 2 * node + 1)
        score[:, pushed] = torch.where(allowed, pushed_base + gained, -torch.inf)
        base[:, pushed] = pushed_base
        cell[:, pushed] = pushed_cell
        parent[:, pushed] = torch.cat([torch.full_like(best_parent, node), best_parent], dim=1)
    return torch.cat(tokens, dim=1), torch.cat(parents, dim=1)


def check_depth_scale(depth_scale: float) -> None:
    """Raise ValueError unless `depth_scale` is a finite number > 0."""
    number = isinstance(depth_scale, int | float) and not isinstance(depth_scale, bool)
    if not (number and 0 < depth_scale < float("inf")):
        raise ValueError(f"depth_scale must be a finite number > 0, got {depth_scale!r}")


def _best_first_on_host(
    values: torch.Tensor, candidates: torch.Tensor, roots: torch.Tensor, max_nodes: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`best_first_tree` from the top-K `values`/`candidates` `[B, D, K]` in host memory."""
    tree = _best_first_heaps(values.numpy(), candidates.numpy(), roots.numpy(), max_nodes)
    return torch.from_numpy(tree[0]), torch.from_numpy(tree[1])


def _best_first_heaps(
    scores: np.ndarray, ids: np.ndarray, roots: np.ndarray, max_nodes: int
) -> tuple[np.ndarray, np.ndarray]:
    """The best-first pops with a heap per row, from float32 top-K `scores` and their token
    `ids` `[B, D, K]`: scores summed in float32, ties to the candidate pushed first, exhausted
    rows padded with the top token of position 1. Returns int64 `(tokens, parents)`."""
    batch, depth, width = scores.shape
    tokens = np.zeros((batch, max_nodes), dtype=np.int64)
    parents = np.full((batch, max_nodes), PAD_NODE, dtype=np.int64)
    tokens[:, 0], parents[:, 0] = roots, -1
    for row in range(batch):
        score, token = scores[row], ids[row]
        # (-score, push order, level, rank, parent node, parent's score)
        heap = [(-score[0, 0], 0, 0, 0, 0, np.float32(0.0))]
        pushed = 1
        for node in range(1, max_nodes):
            if not heap:
                tokens[row, node:] = token[0, 0]
                break
            negative, _, level, rank, parent, base = heapq.heappop(heap)
            best = -negative
            tokens[row, node], parents[row, node] = token[level, rank], parent
            if level + 1 < depth:
                child = -(best + score[level + 1, 0])
                heapq.heappush(heap, (child, pushed, level + 1, 0, node, best))
                pushed += 1
            if rank + 1 < width:
                sibling = -(base + score[level, rank + 1])
                heapq.heappush(heap, (sibling, pushed, level, rank + 1, parent, base))
                pushed += 1
    return tokens, parents


def _check_block(name: str, tensor: torch.Tensor, num_tokens: int) -> None:
    if tensor.dim() != 3 or tensor.shape[1] < 1:
        raise ValueError(f"{name}: expected shape [B, D, V] with D >= 1, got {tuple(tensor.shape)}")
    if not 1 <= num_tokens <= tensor.shape[1]:
        raise ValueError(
            f"num_tokens must be in [1, D = {tensor.shape[1]}] (the block's positions), got "
            f"{num_tokens}"
        )
