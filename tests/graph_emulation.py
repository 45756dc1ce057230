"""CUDA-graph semantics on the CPU, for tests: `traced_capture` stands in for
`specdec_fast.graphs.capture`. It traces the step once with `torch.fx` (`make_fx` on the real
tensors: the trace runs the step, which is that call's real step) and each later replay runs the
trace, so Python runs only at capture, as under a CUDA graph: a step that changes Python state, or
branches on values it reads back, or keeps a tensor that later calls replace, replays what the
capture saw. The trace holds the very tensors the step read besides its arguments, so in-place
updates of a cache go to the cache; the replay copies its results into the outputs the capture
returned, as a graph's replay rewrites its output memory.

`emulated_graphs` makes the CPU capturable inside the block (`graphs.capturable`): runners then
capture by default, and drafters attached under their choice
with the plain-torch kernels (the fused CPU attention reads the cache lengths back to size its
work, which a trace would freeze; the Triton kernels on a GPU do not), and counts the captures
and replays."""

from collections import Counter
from contextlib import contextmanager

import pytest
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._pytree import tree_flatten

from specdec_fast import graphs

# Captures and replays of every emulated graph in this process (a graph captured in one block
# is replayed in later ones: runners and drafters keep theirs).
COUNTS: Counter = Counter()
# Non-empty while a step is traced (`graphs.capturing` then answers yes).
TRACING: list[bool] = []


def traced_capture(step, args, pool):
    ran = []

    def recorded(*inputs):
        ran.append(step(*inputs))
        return ran[0]

    TRACING.append(True)
    try:
        traced = make_fx(recorded)(*args)
    finally:
        TRACING.pop()
    outputs = ran[0]
    skip = [True]  # the trace ran the captured call's step: its first replay has nothing to do

    def replay():
        COUNTS["replays"] += 1
        if skip.pop() if skip else False:
            return
        fresh = traced(*args)
        for static, value in zip(tree_flatten(outputs)[0], tree_flatten(fresh)[0], strict=True):
            if static is not None:
                static.copy_(value)

    COUNTS["captures"] += 1
    return replay, outputs, pool


@contextmanager
def emulated_graphs():
    """Yields a function that returns the captures and replays since the block began."""
    start = Counter(COUNTS)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPECDEC_BACKEND", "torch")
        patch.setattr(graphs, "capture", traced_capture)
        patch.setattr(graphs, "capturable", lambda device: True)
        patch.setattr(graphs, "capturing", lambda: bool(TRACING))
        yield lambda: COUNTS - start
