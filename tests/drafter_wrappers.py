"""Drafters that tests wrap around or stand in for real ones: a known-continuation chain and a
drafter attaching under its own compile choice."""

from collections.abc import Callable

from specdec_fast.compiled import compile_choice
from specdec_fast.drafters.base import Drafter, pack_trees
from specdec_fast.wrapping import WrappedDrafter


class OracleChain(Drafter):
    """Proposes a known continuation as a chain of `max_nodes - 1` tokens (a tree of `max_nodes`
    nodes): with the target's own greedy future, every node is accepted. `continuation_of(tokens)`
    returns the tokens that follow `tokens`."""

    def __init__(self, continuation_of: Callable[[list[int]], list[int]], max_nodes: int):
        super().__init__(max_nodes)
        self.continuation_of = continuation_of

    def propose(self, state):
        trees = []
        for tokens in state.tokens:
            ahead = self.continuation_of(tokens)[: self.max_nodes - 1]
            trees.append((ahead, list(range(len(ahead)))))
        return pack_trees([t[-1] for t in state.tokens], trees, state.device)


class AttachedUnder(WrappedDrafter):
    """The inner drafter attaches under its own compile choice, whatever the call's: a test can
    compile the drafter's steps and not the target's, or the other way round."""

    def __init__(self, inner: Drafter, compile: bool):
        super().__init__(inner)
        self.compile = compile

    def attach(self, target, max_cache_len: int) -> None:
        with compile_choice(self.compile):
            self.inner.attach(target, max_cache_len)
