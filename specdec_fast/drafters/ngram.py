"""Prompt-lookup drafting: continue the longest n-gram of the context that occurred before."""

from __future__ import annotations

import torch

from .base import Drafter, DraftState, Proposal, pack_trees
from .trie import CountTrie


class NGramDrafter(Drafter):
    """Propose what followed earlier occurrences of the context's last n tokens.

    For each row, the longest n in [min_n, max_n] whose last-n-token suffix occurs earlier in the
    row (prompt and output so far) wins; the continuations of its `max_matches` most recent
    occurrences are merged into one tree ranked by frequency (recency breaks ties), so several
    distinct continuations are all tried in one verification. Matching runs over the whole batch
    at once on a padded token tensor kept on the host.

    max_nodes: the tree budget N, tokens verified per step with the root included (>= 2).
    max_depth: longest continuation proposed (default: min(max_nodes - 1, 8)).
    """

    def __init__(
        self,
        max_nodes: int = 8,
        max_depth: int | None = None,
        min_n: int = 1,
        max_n: int = 4,
        max_matches: int = 8,
    ):
        super().__init__(max_nodes, min(max_nodes - 1, 8) if max_depth is None else max_depth)
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        if max_matches < 1:
            raise ValueError(f"max_matches must be >= 1, got {max_matches}")
        self.min_n = min_n
        self.max_n = max_n
        self.max_matches = max_matches
        self._history = torch.zeros(0, 0, dtype=torch.int64)
        self._lengths: list[int] = []

    def begin(self, state: DraftState) -> None:
        self._reset_history(state.batch_size)

    def _reset_history(self, batch_size: int) -> None:
        self._history = torch.zeros(batch_size, 0, dtype=torch.int64)
        self._lengths = [0] * batch_size

    def keep(self, rows: torch.Tensor) -> None:
        kept = rows.cpu().tolist()
        self._history = self._history[kept]
        self._lengths = [self._lengths[r] for r in kept]

    def _sync(self, tokens: list[list[int]]) -> None:
        """Append to the padded history whatever the rows gained since the last call."""
        if len(self._lengths) != len(tokens):
            self._reset_history(len(tokens))
        longest = max(len(row) for row in tokens)
        if longest > self._history.shape[1]:
            capacity = max(longest, 2 * self._history.shape[1])
            grown = torch.zeros(len(tokens), capacity, dtype=torch.int64)
            grown[:, : self._history.shape[1]] = self._history
            self._history = grown
        for row, row_tokens in enumerate(tokens):
            start = self._lengths[row]
            if len(row_tokens) > start:
                self._history[row, start : len(row_tokens)] = torch.as_tensor(row_tokens[start:])
                self._lengths[row] = len(row_tokens)

    def _match_positions(self) -> list[tuple[int, list[int]]]:
        """Per row: (n, starts of earlier occurrences of the last n tokens), newest first."""
        lengths = torch.as_tensor(self._lengths)
        width = int(lengths.max())
        history = self._history[:, :width]
        found: list[tuple[int, list[int]]] = [(0, [])] * len(self._lengths)
        pending = torch.ones(len(self._lengths), dtype=torch.bool)
        for n in range(self.max_n, self.min_n - 1, -1):
            if width <= n or not bool(pending.any()):
                continue
            offsets = (lengths - n).clamp(min=0)
            suffix = history.gather(1, offsets[:, None] + torch.arange(n)[None, :])
            windows = history.unfold(1, n, 1)  # [B, width - n + 1, n]
            hits = (windows == suffix[:, None, :]).all(-1)
            starts = torch.arange(windows.shape[1])
            # An occurrence must leave a token after it, which excludes the suffix itself.
            hits &= (starts[None, :] + n < lengths[:, None]) & (lengths[:, None] > n)
            hits &= pending[:, None]
            for row in hits.any(-1).nonzero().flatten().tolist():
                positions = hits[row].nonzero().flatten().flip(0)[: self.max_matches]
                found[row] = (n, positions.tolist())
                pending[row] = False
        return found

    def propose(self, state: DraftState) -> Proposal:
        self._sync(state.tokens)
        trees = []
        for row, (n, positions) in enumerate(self._match_positions()):
            trie = CountTrie()
            row_history = self._history[row]
            for start in positions:
                stop = min(start + n + self.max_depth, self._lengths[row])
                trie.insert(row_history[start + n : stop].tolist())
            trees.append(trie.best_tree(self.max_nodes, self.max_depth))
        roots = [row[-1] for row in state.tokens]
        return pack_trees(roots, trees, state.device)
