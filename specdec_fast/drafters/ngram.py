"""Prompt-lookup drafting: continue the longest n-gram of the context that occurred before."""

from __future__ import annotations

import numpy as np
import torch

from specdec_fast import graphs
from specdec_fast.compiled import CompiledSteps, compile_by_default
from specdec_fast.transfer import to_device

from .base import Drafter, DraftState, Proposal, StepOutcome, pack_trees
from .ngram_device import LookupShape, append_step, lookup_trees
from .trie import CountTrie

# The device lookup's compiled steps by compile choice, shared by every n-gram drafter of the
# process (each `generate` call of a registry spec makes a new one): a shape compiles once.
_DEVICE_STEPS: dict[bool, CompiledSteps] = {}


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

    The lookup runs on the host (numpy) or on the device (`specdec_fast.drafters.ngram_device`:
    the same trees, built from a token history kept on the device and appended from each step's
    device outcome, so the drafter reads nothing and reads ahead, `Drafter.reads_ahead`). There
    the lookup and the append are compiled steps when the call compiles, replayed as CUDA
    graphs of the drafter's own when it captures (`graphs.chosen()`).

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
        super().__init__(max_nodes, min(max_nodes - 1, 8) if max_depth is None else max_depth)
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        if max_matches < 1:
            raise ValueError(f"max_matches must be >= 1, got {max_matches}")
        self.min_n = min_n
        self.max_n = max_n
        self.max_matches = max_matches
        if device_lookup not in (None, True, False):
            raise ValueError(f"device_lookup must be None or a bool, got {device_lookup!r}")
        self.device_lookup = device_lookup
        self._history: list[np.ndarray] = []  # per row, its tokens so far (with spare room)
        self._lengths: list[int] = []
        # The device lookup, once attached: its compiled steps, their graphs, the history's
        # width, the rows' tokens int64 [B, width] (the last column takes writes past the end)
        # and lengths int64 [B].
        self._on_device = False
        self._steps: CompiledSteps | None = None
        self._graphs: graphs.StepGraphs | None = None
        self._width = 0
        self._device_tokens: torch.Tensor | None = None
        self._device_lengths: torch.Tensor | None = None

    @property
    def reads_ahead(self) -> bool:
        """A device lookup follows a step from its device outcome (`Drafter.reads_ahead`)."""
        return self._on_device

    @property
    def lookup_shape(self) -> LookupShape:
        """The device lookup's parameters."""
        return LookupShape(self.min_n, self.max_n, self.max_matches, self.max_depth, self.max_nodes)

    def attach(self, target, max_cache_len: int) -> None:
        compile = compile_by_default()
        if self.device_lookup is None:
            self._on_device = target.device.type == "cuda" and compile
        else:
            self._on_device = self.device_lookup
        if self._on_device:
            # Every token a row holds, its root included, and the column for writes past them.
            self._width = max(max_cache_len + 2, self.max_matches)
            self._steps = _DEVICE_STEPS.setdefault(compile, CompiledSteps("ngram", compile))
            # The drafter's own graphs (a replay's outputs are this drafter's history).
            record = self._steps.record
            self._graphs = graphs.StepGraphs("ngram", graphs.chosen(), on_capture=record)

    def follow_paths_to(self, depth: int) -> None:
        """Any depth: the history grows from the rows' tokens, whatever path emitted them."""

    def begin(self, state: DraftState) -> None:
        if self._on_device:
            self._device_tokens, self._device_lengths = self._uploaded(state)
        else:
            self._reset_history(state.batch_size)

    def _reset_history(self, batch_size: int) -> None:
        self._history = [np.zeros(0, dtype=np.int64) for _ in range(batch_size)]
        self._lengths = [0] * batch_size

    def _uploaded(self, state: DraftState) -> tuple[torch.Tensor, torch.Tensor]:
        """The device history of `state`'s rows (their whole tokens: prompts at `begin`/`join`)."""
        lengths = [len(row) for row in state.tokens]
        if max(lengths) > self._width - 1:
            raise ValueError(
                f"a row of {max(lengths)} tokens is longer than the cache this drafter was "
                f"attached for ({self._width - 2} tokens and its root)"
            )
        tokens = np.zeros((len(lengths), self._width), dtype=np.int64)
        for row, row_tokens in enumerate(state.tokens):
            tokens[row, : len(row_tokens)] = row_tokens
        return to_device(tokens, state.device), to_device(np.array(lengths), state.device)

    def keep(self, rows: list[int]) -> None:
        if self._on_device:
            index = to_device(rows, self._device_tokens.device)
            self._device_tokens = self._device_tokens[index]
            self._device_lengths = self._device_lengths[index]
            return
        self._history = [self._history[r] for r in rows]
        self._lengths = [self._lengths[r] for r in rows]

    def join(self, state: DraftState) -> None:
        if self._on_device:
            tokens, lengths = self._uploaded(state)
            self._device_tokens = torch.cat([self._device_tokens, tokens])
            self._device_lengths = torch.cat([self._device_lengths, lengths])
            return
        # Empty histories: the next `_sync` fills them from the rows' tokens.
        self._history += [np.zeros(0, dtype=np.int64) for _ in range(state.batch_size)]
        self._lengths += [0] * state.batch_size

    def update(self, state: DraftState, outcome: StepOutcome) -> None:
        """A device lookup appends the step's accepted tokens from its device outcome; the host
        lookup takes them from the rows' tokens at the next `propose`."""
        if self._on_device:
            proposal = outcome.proposal
            args = (self._device_tokens, self._device_lengths, proposal.tokens)
            args += (outcome.accepted_nodes, outcome.num_accepted, outcome.next_tokens)
            label = f"append B={state.batch_size} N={proposal.num_nodes}"
            appended = self._run("append", label, append_step, args)
            self._device_tokens, self._device_lengths = appended

    def _run(self, kind: str, label: str, step, args: tuple):
        """A device step: compiled when the call compiles, replayed as a CUDA graph when it
        captures (`graphs.chosen()`)."""
        return self._graphs.run(kind, label, self._steps.run, kind, label, step, *args)

    def end(self) -> None:
        self._device_tokens = self._device_lengths = None

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
        if self._on_device:
            label = f"lookup B={state.batch_size}"
            args = (self.lookup_shape, self._device_tokens, self._device_lengths)
            return Proposal(*self._run("lookup", label, lookup_trees, args))
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
