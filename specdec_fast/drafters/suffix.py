"""Suffix-tree drafting over the request itself and a bounded store of earlier outputs."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from .base import Drafter, DraftState, Proposal, StepOutcome, pack_trees
from .trie import CountTrie


class SuffixIndex:
    """A depth-bounded suffix trie: every substring of length <= `depth` of the indexed sequences,
    with occurrence counts. Appending a token extends the `depth` open windows that end at it, so
    indexing grows one token at a time."""

    def __init__(self, depth: int):
        self.depth = depth
        self.root = CountTrie()

    def add(self, tokens: Sequence[int]) -> None:
        for start in range(len(tokens)):
            self.root.insert(tokens[start : start + self.depth])

    def discard(self, tokens: Sequence[int]) -> None:
        for start in range(len(tokens)):
            self.root.remove(tokens[start : start + self.depth])

    def longest_match(self, context: Sequence[int], max_match: int) -> tuple[int, CountTrie | None]:
        """The longest suffix of `context` (at most `max_match` tokens) present in the index that
        has continuations, and the node it ends at."""
        for length in range(min(max_match, len(context)), 0, -1):
            node = self.root.descend(context[len(context) - length :])
            if node is not None and node.children:
                return length, node
        return 0, None


class _RequestIndex(SuffixIndex):
    """The suffix index of one running request, extended as tokens are emitted."""

    def __init__(self, depth: int, tokens: Sequence[int]):
        super().__init__(depth)
        self.tokens: list[int] = []
        # Trie nodes of the windows ending at the last token, shortest first; each new token
        # extends those shorter than `depth`, so indexing costs O(depth) per token.
        self._open: list[CountTrie] = []
        self.extend(tokens)

    def extend(self, new_tokens: Sequence[int]) -> None:
        for token in new_tokens:
            self.tokens.append(token)
            self.root.count += 1
            extended = []
            for node in [self.root, *self._open[: self.depth - 1]]:
                child = node.children.get(token)
                if child is None:
                    child = node.children[token] = CountTrie()
                child.count += 1
                extended.append(child)
            self._open = extended


class SuffixDrafter(Drafter):
    """SuffixDecoding-style drafting.

    Each row keeps a suffix index of its prompt and output so far; a global index holds the outputs
    of earlier requests (at most `max_store_tokens` tokens; the oldest outputs are evicted first).
    At each step the longest suffix of the context (up to `max_match` tokens) is looked up in both
    indexes, and the continuations under the match are expanded into a tree of the most frequent
    paths (path probability = continuation count / match count), cut at `min_prob`. The index whose
    tree has the larger expected number of accepted tokens (sum of path probabilities) wins.

    max_nodes: the tree budget N, tokens verified per step with the root included (>= 2);
    max_depth: longest continuation (default: min(max_nodes - 1, 16)).
    """

    # Valid trees by construction (tests/test_drafter_checks.py): values go unchecked.
    proposals_valid = True

    def __init__(
        self,
        max_nodes: int = 16,
        max_depth: int | None = None,
        max_match: int = 16,
        min_prob: float = 0.1,
        max_store_tokens: int = 200_000,
    ):
        super().__init__(max_nodes, min(max_nodes - 1, 16) if max_depth is None else max_depth)
        if max_match < 1:
            raise ValueError(f"max_match must be >= 1, got {max_match}")
        if not 0.0 <= min_prob < 1.0:
            raise ValueError(f"min_prob must be in [0, 1), got {min_prob}")
        if max_store_tokens < 0:
            raise ValueError(f"max_store_tokens must be >= 0, got {max_store_tokens}")
        self.max_match = max_match
        self.min_prob = min_prob
        self.max_store_tokens = max_store_tokens
        self.store = SuffixIndex(max_match + self.max_depth)
        self._stored: deque[list[int]] = deque()
        self._stored_tokens = 0
        self._requests: list[_RequestIndex] = []
        self._prompt_lens: list[int] = []
        self._finished: list[list[int]] = []

    def follow_paths_to(self, depth: int) -> None:
        """Any depth: the indexes grow from the emitted tokens, whatever path emitted them."""

    def begin(self, state: DraftState) -> None:
        depth = self.max_match + self.max_depth
        self._requests = [_RequestIndex(depth, tokens) for tokens in state.tokens]
        self._prompt_lens = [len(tokens) for tokens in state.tokens]
        self._finished = []

    def join(self, state: DraftState) -> None:
        depth = self.max_match + self.max_depth
        self._requests += [_RequestIndex(depth, tokens) for tokens in state.tokens]
        self._prompt_lens += [len(tokens) for tokens in state.tokens]
        # A running batch may never end: the outputs of the rows that left go to the store now.
        for output in self._finished:
            self.remember(output)
        self._finished = []

    def update(self, state: DraftState, outcome: StepOutcome) -> None:
        for index, emitted in zip(self._requests, outcome.emitted, strict=True):
            index.extend(emitted)

    def keep(self, rows: list[int]) -> None:
        kept = set(rows)
        for row, (index, prompt_len) in enumerate(
            zip(self._requests, self._prompt_lens, strict=True)
        ):
            if row not in kept:
                self._finished.append(index.tokens[prompt_len:])
        self._requests = [self._requests[r] for r in rows]
        self._prompt_lens = [self._prompt_lens[r] for r in rows]

    def end(self) -> None:
        for index, prompt_len in zip(self._requests, self._prompt_lens, strict=True):
            self._finished.append(index.tokens[prompt_len:])
        for output in self._finished:
            self.remember(output)
        self._requests, self._prompt_lens, self._finished = [], [], []

    def remember(self, output: Sequence[int]) -> None:
        """Add an output to the global store, evicting the oldest ones beyond the size bound."""
        output = list(output)
        if not output or len(output) > self.max_store_tokens:
            return
        self.store.add(output)
        self._stored.append(output)
        self._stored_tokens += len(output)
        while self._stored_tokens > self.max_store_tokens:
            evicted = self._stored.popleft()
            self.store.discard(evicted)
            self._stored_tokens -= len(evicted)

    @property
    def stored_tokens(self) -> int:
        return self._stored_tokens

    def _tree(self, index: SuffixIndex, context: Sequence[int]) -> tuple[float, list, list]:
        _, node = index.longest_match(context, self.max_match)
        if node is None:
            return 0.0, [], []
        tokens, parents = node.best_tree(self.max_nodes, self.max_depth, self.min_prob)
        expected = sum(self._path_probs(node, tokens, parents))
        return expected, tokens, parents

    @staticmethod
    def _path_probs(node: CountTrie, tokens: list[int], parents: list[int]) -> list[float]:
        tries = [node]
        probs = []
        for token, parent in zip(tokens, parents, strict=True):
            child = tries[parent].children[token]
            tries.append(child)
            probs.append(child.count / node.count)
        return probs

    def propose(self, state: DraftState) -> Proposal:
        if len(self._requests) != state.batch_size:
            self.begin(state)
        trees = []
        for index, context in zip(self._requests, state.tokens, strict=True):
            own = self._tree(index, context)
            shared = self._tree(self.store, context)
            best = own if own[0] >= shared[0] else shared
            trees.append((best[1], best[2]))
        roots = [row[-1] for row in state.tokens]
        return pack_trees(roots, trees, state.device)
