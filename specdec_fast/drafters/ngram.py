"""Prompt-lookup drafting: continue the longest n-gram of the context that occurred before."""

from __future__ import annotations

import numpy as np

from .base import Drafter, DraftState, Proposal, pack_trees
from .trie import CountTrie


class NGramDrafter(Drafter):
    """Propose what followed earlier occurrences of the context's last n tokens.

    For each row, the longest n in [min_n, max_n] whose last-n-token suffix occurs earlier in the
    row (prompt and output so far) wins; the continuations of its `max_matches` most recent
    occurrences are merged into one tree ranked by frequency (recency breaks ties), so several
    distinct continuations are all tried in one verification. Matching runs over the whole batch
    row by row on numpy arrays kept on the host, narrowing the occurrences of the last token one
    token further back at a time.

    A continuation that runs into the present (an occurrence ending p tokens before the last one)
    is continued with period p, as applying the same match again would predict: in a loop, every
    recent occurrence proposes the full depth instead of the few tokens left before the end.

    max_nodes: the tree budget N, tokens verified per step with the root included (>= 2).
    max_depth: longest continuation proposed (default: min(max_nodes - 1, 8)).
    """

    # Valid trees by construction (tests/test_drafter_checks.py): values go unchecked.
    proposals_valid = True

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
        self._history: list[np.ndarray] = []  # per row, its tokens so far (with spare room)
        self._lengths: list[int] = []

    def follow_paths_to(self, depth: int) -> None:
        """Any depth: the history grows from the rows' tokens, whatever path emitted them."""

    def begin(self, state: DraftState) -> None:
        self._reset_history(state.batch_size)

    def _reset_history(self, batch_size: int) -> None:
        self._history = [np.zeros(0, dtype=np.int64) for _ in range(batch_size)]
        self._lengths = [0] * batch_size

    def keep(self, rows: list[int]) -> None:
        self._history = [self._history[r] for r in rows]
        self._lengths = [self._lengths[r] for r in rows]

    def join(self, state: DraftState) -> None:
        # Empty histories: the next `_sync` fills them from the rows' tokens.
        self._history += [np.zeros(0, dtype=np.int64) for _ in range(state.batch_size)]
        self._lengths += [0] * state.batch_size

    def _sync(self, tokens: list[list[int]]) -> None:
        """Append to each row's history whatever it gained since the last call."""
        if len(self._lengths) != len(tokens):
            self._reset_history(len(tokens))
        for row, row_tokens in enumerate(tokens):
            start, stop = self._lengths[row], len(row_tokens)
            if stop <= start:
                continue
            history = self._history[row]
            if stop > len(history):
                grown = np.zeros(max(stop, 2 * len(history)), dtype=np.int64)
                grown[:start] = history[:start]
                self._history[row] = history = grown
            history[start:stop] = row_tokens[start:]
            self._lengths[row] = stop

    def _match(self, row: int) -> tuple[int, np.ndarray]:
        """(n, ends of the earlier occurrences of the row's last n tokens, newest first), for
        the longest n in [min_n, max_n] that occurs; (0, empty) when none does. An occurrence
        must leave a token after it, which excludes the suffix itself."""
        length = self._lengths[row]
        history = self._history[row][:length]
        ends = np.flatnonzero(history[:-1] == history[-1]) if length > 1 else history[:0]
        matched = 1
        best = (1, ends) if self.min_n == 1 else (0, ends[:0])
        while len(ends) and matched < min(self.max_n, length - 1):
            ends = ends[ends >= matched]
            ends = ends[history[ends - matched] == history[length - 1 - matched]]
            matched += 1
            if len(ends) and matched >= self.min_n:
                best = (matched, ends)
        return best[0], best[1][::-1][: self.max_matches]

    def propose(self, state: DraftState) -> Proposal:
        self._sync(state.tokens)
        trees = []
        for row in range(len(self._lengths)):
            n, ends = self._match(row)
            trie = CountTrie()
            history = self._history[row]
            length = self._lengths[row]
            for end in ends.tolist():
                stop = min(end + 1 + self.max_depth, length)
                continuation = history[end + 1 : stop]
                if stop == length:
                    continuation = np.resize(continuation, self.max_depth)
                trie.insert(continuation.tolist())
            trees.append(trie.best_tree(self.max_nodes, self.max_depth))
        roots = [row[-1] for row in state.tokens]
        return pack_trees(roots, trees, state.device)
