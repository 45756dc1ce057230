"""Prompt-lookup drafting: continue the longest n-gram of the context that occurred before."""

from __future__ import annotations

import numpy as np

from specdec_fast import graphs
from specdec_fast.compiled import compile_by_default

from .base import Drafter, DraftState, Proposal, StepOutcome, pack_trees, require_int
from .ngram_device import DeviceLookup, LookupShape
from .trie import CountTrie


class NGramDrafter(Drafter):
    """Propose what followed earlier occurrences of the context's last n tokens.

    For each row, the longest n in [min_n, max_n] whose last-n-token suffix occurs earlier in the
    row (prompt and output so far) wins; the continuations of its `max_matches` most recent
    occurrences are merged into one tree ranked by frequency (recency breaks ties), so several
    distinct continuations are all tried in one verification.

    A continuation that runs into the present (an occurrence ending p tokens before the last one)
    is continued with period p, as applying the same match again would predict: in a loop, every
    recent occurrence proposes the full depth instead of the few tokens left before the end.

    The lookup runs on the host (`HostLookup`, numpy) or on the device (`DeviceLookup` in
    `specdec_fast.drafters.ngram_device`: the same trees, built from a token history kept on the
    device and appended from each step's device outcome, so the drafter reads nothing and reads
    ahead, `Drafter.reads_ahead`; compiled steps when the call compiles, replayed as CUDA graphs
    of the drafter's own when it captures, `graphs.chosen()`). `attach` chooses.

    max_nodes: the tree budget N, tokens verified per step with the root included (>= 2).
    max_depth: longest continuation proposed (default: min(max_nodes - 1, 8)).
    device_lookup: look up on the device; None (default): on a CUDA target whose call compiles
        (`generate`'s default there), where a step left unread overlaps the next one, and on the
        host elsewhere: on the CPU the numpy lookup is the faster (bench/NOTES.md), and
        uncompiled on CUDA (exact mode, `compile=False`) the device lookup is about 300 small
        kernels a step (one graph replay when the call captures, but as many kernels on the
        device), where the compiled one fuses them. Every proposal of a device lookup is
        `max_nodes` wide (padded); the host's is as wide as the batch's largest tree.
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
        device_lookup: bool | None = None,
    ):
        require_int("max_nodes", max_nodes)
        super().__init__(max_nodes, min(max_nodes - 1, 8) if max_depth is None else max_depth)
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        if max_matches < 1:
            raise ValueError(f"max_matches must be >= 1, got {max_matches}")
        if device_lookup not in (None, True, False):
            raise ValueError(f"device_lookup must be None or a bool, got {device_lookup!r}")
        self.min_n = min_n
        self.max_n = max_n
        self.max_matches = max_matches
        self.device_lookup = device_lookup
        # The rows' histories and their lookup: on the host until `attach` chooses.
        self._lookup: HostLookup | DeviceLookup = HostLookup(self.lookup_shape)

    @property
    def reads_ahead(self) -> bool:
        """A device lookup follows a step from its device outcome (`Drafter.reads_ahead`)."""
        return self._lookup.reads_ahead

    @property
    def lookup_shape(self) -> LookupShape:
        """The lookup's parameters."""
        return LookupShape(self.min_n, self.max_n, self.max_matches, self.max_depth, self.max_nodes)

    def attach(self, target, max_cache_len: int) -> None:
        compile = compile_by_default()
        on_device = self.device_lookup
        if on_device is None:
            on_device = target.device.type == "cuda" and compile
        shape = self.lookup_shape
        if on_device:
            self._lookup = DeviceLookup(shape, max_cache_len, compile, graphs.chosen())
        else:
            self._lookup = HostLookup(shape)

    def follow_paths_to(self, depth: int) -> None:
        """Any depth: the history grows from the rows' tokens, whatever path emitted them."""

    def begin(self, state: DraftState) -> None:
        self._lookup.begin(state)

    def keep(self, rows: list[int]) -> None:
        self._lookup.keep(rows)

    def join(self, state: DraftState) -> None:
        self._lookup.join(state)

    def propose(self, state: DraftState) -> Proposal:
        return self._lookup.propose(state)

    def update(self, state: DraftState, outcome: StepOutcome) -> None:
        self._lookup.update(state, outcome)

    def end(self) -> None:
        self._lookup.end()


class HostLookup:
    """`NGramDrafter`'s lookup on the host: each row's tokens in a numpy array (with spare room),
    synced from the rows' tokens at each `propose`, matched row by row, narrowing the
    occurrences of the last token one token further back at a time, and a `CountTrie` per row."""

    reads_ahead = False

    def __init__(self, shape: LookupShape):
        self.shape = shape
        self._history: list[np.ndarray] = []
        self._lengths: list[int] = []

    def begin(self, state: DraftState) -> None:
        self._reset(state.batch_size)

    def _reset(self, batch_size: int) -> None:
        self._history = [np.zeros(0, dtype=np.int64) for _ in range(batch_size)]
        self._lengths = [0] * batch_size

    def keep(self, rows: list[int]) -> None:
        self._history = [self._history[r] for r in rows]
        self._lengths = [self._lengths[r] for r in rows]

    def join(self, state: DraftState) -> None:
        # Empty histories: the next `_sync` fills them from the rows' tokens.
        self._history += [np.zeros(0, dtype=np.int64) for _ in range(state.batch_size)]
        self._lengths += [0] * state.batch_size

    def update(self, state: DraftState, outcome: StepOutcome) -> None:
        """Nothing: the next `propose` takes the step's tokens from the rows' tokens."""

    def end(self) -> None:
        """Nothing to release."""

    def _sync(self, tokens: list[list[int]]) -> None:
        """Append to each row's history whatever it gained since the last call."""
        if len(self._lengths) != len(tokens):
            self._reset(len(tokens))
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
        shape = self.shape
        length = self._lengths[row]
        history = self._history[row][:length]
        ends = np.flatnonzero(history[:-1] == history[-1]) if length > 1 else history[:0]
        matched = 1
        best = (1, ends) if shape.min_n == 1 else (0, ends[:0])
        while len(ends) and matched < min(shape.max_n, length - 1):
            ends = ends[ends >= matched]
            ends = ends[history[ends - matched] == history[length - 1 - matched]]
            matched += 1
            if len(ends) and matched >= shape.min_n:
                best = (matched, ends)
        return best[0], best[1][::-1][: shape.max_matches]

    def propose(self, state: DraftState) -> Proposal:
        self._sync(state.tokens)
        depth = self.shape.max_depth
        trees = []
        for row in range(len(self._lengths)):
            n, ends = self._match(row)
            trie = CountTrie()
            history = self._history[row]
            length = self._lengths[row]
            for end in ends.tolist():
                stop = min(end + 1 + depth, length)
                continuation = history[end + 1 : stop]
                if stop == length:
                    continuation = np.resize(continuation, depth)
                trie.insert(continuation.tolist())
            trees.append(trie.best_tree(self.shape.max_nodes, depth))
        roots = [row[-1] for row in state.tokens]
        return pack_trees(roots, trees, state.device)
