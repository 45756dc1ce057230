"""A counted trie of token continuations, turned into a frequency-ranked draft tree.

Both lookup drafters collect continuations of the current context (n-gram matches, or the paths
under a suffix-tree node) and propose the most frequent ones as one tree: a node's score is the
empirical probability of its path, count(node) / count(all continuations), so a child never scores
above its parent and the best nodes always form a subtree rooted at the context.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence


class CountTrie:
    """Token paths with counts; children keep insertion order, which breaks count ties."""

    __slots__ = ("children", "count")

    def __init__(self) -> None:
        self.children: dict[int, CountTrie] = {}
        self.count = 0

    def insert(self, tokens: Sequence[int], weight: int = 1) -> None:
        """Add one continuation `tokens` with `weight`."""
        node = self
        node.count += weight
        for token in tokens:
            child = node.children.get(token)
            if child is None:
                child = node.children[token] = CountTrie()
            child.count += weight
            node = child

    def remove(self, tokens: Sequence[int], weight: int = 1) -> None:
        """Take back a continuation inserted earlier; nodes whose count reaches zero are dropped."""
        node = self
        node.count -= weight
        for token in tokens:
            child = node.children.get(token)
            if child is None:
                return
            child.count -= weight
            if child.count <= 0:
                del node.children[token]
                return
            node = child

    def descend(self, tokens: Sequence[int]) -> CountTrie | None:
        """The node reached by following `tokens`, or None."""
        node = self
        for token in tokens:
            node = node.children.get(token)
            if node is None:
                return None
        return node

    def best_tree(
        self, max_nodes: int, max_depth: int, min_prob: float = 0.0
    ) -> tuple[list[int], list[int]]:
        """The most probable paths below this node as a draft tree of at most `max_nodes` nodes,
        this node (the root) included.

        Returns (tokens, parents) of the `max_nodes - 1` draft nodes at most, in breadth-first
        order with siblings by descending count; parents index the tree's node list with the root
        as 0. Nodes whose path probability is below `min_prob` are cut.
        """
        if self.count <= 0:
            return [], []
        total = float(self.count)
        # Best-first search: a child never scores above its parent, so the first nodes popped are
        # the most probable ones and always include their ancestors.
        heap: list[tuple[float, int, int, int, int, CountTrie]] = []
        pushed = 0

        def push_children(node: CountTrie, depth: int, tree_index: int) -> None:
            nonlocal pushed
            if depth == max_depth:
                return
            for token, child in node.children.items():
                score = child.count / total
                if score >= min_prob and score > 0:
                    heapq.heappush(heap, (-score, depth + 1, pushed, token, tree_index, child))
                    pushed += 1

        picked: list[tuple[float, int, int, int, int]] = []  # score, depth, order, token, parent
        push_children(self, 0, 0)
        while heap and len(picked) < max_nodes - 1:
            neg_score, depth, order, token, parent, child = heapq.heappop(heap)
            picked.append((-neg_score, depth, order, token, parent))
            push_children(child, depth, len(picked))
        # Breadth-first, siblings by count: parents precede children and likelier siblings are
        # tried first by the verifier.
        order = sorted(
            range(len(picked)), key=lambda i: (picked[i][1], -picked[i][0], picked[i][2])
        )
        position = {0: 0} | {pick + 1: pos + 1 for pos, pick in enumerate(order)}
        tokens = [picked[i][3] for i in order]
        parents = [position[picked[i][4]] for i in order]
        return tokens, parents
