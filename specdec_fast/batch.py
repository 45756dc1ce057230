"""The rows being decoded, and what a step knows of them on the host and on the device.

A `Row` is one sequence in flight on the host: its tokens (the drafter's `DraftState.tokens`
row), its generated tokens and stop rule, its committed cache length (a host mirror of the
cache's, used for the capacity stop), its `SequenceStats` and its streaming callback. `generate`
makes one per prompt; the serving scheduler one per request (`serving.scheduler._Row` adds the
request's handle and lane).

A `Batch` is the rows of one running batch in slot order, with each row's next root on the
device and the sampling parameters as `verify` takes them. It emits a step's read-back into its
rows (`emit`: stop rules, finish reasons, statistics, streaming), and rows join (`join`) and
leave (`keep`) it between steps. The step itself (`specdec_fast.step`) is the same for
`generate` and the scheduler.

A row whose target logits the verify kernel could not use (NaN or +inf: a float16 model whose
activations overflow) emits nothing more: it finishes with reason `FAILED` and `Row.error` says
why. `generate` raises `UnusableLogits` for it; the scheduler ends that request alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from specdec_fast.drafters.base import PAD_PARENT, DraftState, Proposal
from specdec_fast.kernels.verify import SamplingParams
from specdec_fast.requests import Sampling, StopRule
from specdec_fast.stats import SequenceStats
from specdec_fast.transfer import HostCopy, to_device

TokenCallback = Callable[[int, list[int]], None]
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "seed")
# The finish reason of a row that ended on an error (`Row.error`).
FAILED = "error"


class UnusableLogits(RuntimeError):
    """`generate`: the target's logits of a sequence were NaN or +inf, so no token follows."""


def unusable_logits_error(generated: int) -> str:
    """Why a row whose logits the verify kernel marked unusable stopped (`Row.error`)."""
    return (
        f"the target's logits were NaN or infinite after {generated} generated tokens, so no "
        "token can be chosen: its activations overflowed (float16's largest value is 65504; "
        "load the model in bfloat16 or float32) or its weights hold NaN or inf"
    )


@dataclass
class HostStep:
    """What one step reads back, per active row: the next token, the accepted drafts (count,
    tokens, node indices after the root), and the tree's drafted nodes and depth; and the rows
    the proposal checks flagged (`Proposal.malformed`)."""

    next_tokens: list[int]
    num_accepted: list[int]
    drafted: list[int]
    depths: list[int]
    paths: list[list[int]]
    nodes: list[list[int]]
    malformed: list[int]


class StepRead:
    """A step's read-back on its way to the host (`read_back`); `wait()` blocks until it has
    landed and returns the step's `HostStep`."""

    def __init__(self, copy: HostCopy, unpack: Callable[[list], HostStep]):
        self._copy, self._unpack = copy, unpack

    def wait(self) -> HostStep:
        return self._unpack(self._copy.wait())


def read_back(proposal: Proposal, result, depths: torch.Tensor) -> StepRead:
    """The step's one device-to-host read, started (`StepRead.wait` finishes it): per row the
    next token and, for drafted trees, the accepted path (node indices and tokens) and the
    tree's size and depth, and the flags of the proposal checks when the proposal carries them.

    The device packs it all with four operators (a GPU launches each): the tree's size and depth
    reductions and one concatenation, which also widens every column to int64; the path's
    tokens are picked on the host from the tree's, read with it."""
    accepted_nodes, num_accepted, next_tokens = result
    flags = [] if proposal.malformed is None else [proposal.malformed[:, None]]
    if proposal.num_nodes == 1:
        packed = torch.stack([next_tokens, proposal.malformed.long()]) if flags else next_tokens
        return StepRead(HostCopy(packed), partial(_plain_step, bool(flags)))
    nodes = (proposal.parents != PAD_PARENT).sum(dim=1, keepdim=True)
    offered_depth = depths.amax(dim=1, keepdim=True)
    columns = [next_tokens[:, None], num_accepted[:, None], nodes, offered_depth, *flags]
    packed = torch.cat([*columns, accepted_nodes, proposal.tokens], dim=1)
    unpack = partial(_tree_step, len(columns), proposal.num_nodes, bool(flags))
    return StepRead(HostCopy(packed), unpack)


def _plain_step(flags: bool, values: list) -> HostStep:
    """The `HostStep` of one-node trees: `values` the next tokens, or those and the flags."""
    tokens, flagged = values if flags else (values, [])
    zeros = [0] * len(tokens)
    return HostStep(
        tokens,
        zeros,
        zeros,
        zeros,
        [[] for _ in tokens],
        [[] for _ in tokens],
        [r for r, flag in enumerate(flagged) if flag],
    )


def _tree_step(start: int, width: int, flags: bool, rows: list) -> HostStep:
    """The `HostStep` of drafted trees from `read_back`'s packed rows: `start` columns, then
    the accepted node indices and the tree's `width` tokens."""
    # Node indices of the accepted drafts (after the root), then their tokens in the tree's.
    accepted = [row[start + 1 : start + 1 + row[1]] for row in rows]
    paths = [
        [row[start + width + node] for node in nodes]
        for row, nodes in zip(rows, accepted, strict=True)
    ]
    return HostStep(
        next_tokens=[row[0] for row in rows],
        num_accepted=[row[1] for row in rows],
        drafted=[row[2] - 1 for row in rows],
        depths=[row[3] for row in rows],
        paths=paths,
        nodes=accepted,
        malformed=[r for r, row in enumerate(rows) if flags and row[4]],
    )


class Row:
    """One sequence in flight (see the module doc).

    Args:
        tokens: the prompt; the row then extends this list with what it emits.
        rule: its stop rule.
        sampling: its sampling parameters, host tensors `[1]` (`Sampling`).
        start: `time.perf_counter()` its TTFT is measured from.
        on_tokens: called with each step's new tokens.
    """

    def __init__(
        self,
        tokens: list[int],
        rule: StopRule,
        sampling: Sampling,
        start: float,
        on_tokens: Callable[[list[int]], None] | None = None,
    ):
        self.tokens = tokens
        self.generated: list[int] = []
        self.rule = rule
        self.sampling = sampling
        self.greedy = float(sampling.temperature[0]) == 0.0
        self.stats = SequenceStats(prompt_tokens=len(tokens))
        self.start = start
        self.on_tokens = on_tokens
        # Committed cache slots: the prompt but its last token (the first root), then accepted.
        self.cached = len(tokens) - 1
        self.error: str | None = None  # why it ended, when its finish reason is FAILED


def _uniform(values: torch.Tensor):
    """A Python scalar when every row has the same value (the kernels specialise on it)."""
    first = values[0].item()
    return first if bool((values == first).all()) else None


class Batch:
    """The running rows, in slot order (see the module doc).

    Args:
        device: the model's device.
        capacity: the KV capacity per sequence: a row stops with reason "cache" once it has
            cached `capacity` tokens, its last step's tokens cut there, so that it emits what
            plain decoding would (a tree verified near the capacity writes beyond it, into
            the `slots` of the storage).
        max_nodes: the nodes of the widest tree a step may verify (the verify width may pad it).
    """

    def __init__(self, device: torch.device, capacity: int, max_nodes: int):
        self.device, self.capacity, self.max_nodes = device, capacity, max_nodes
        self.rows: list[Row] = []
        # int64 [B] on the device: each row's root, the last token chosen (not yet cached).
        self.roots = torch.zeros(0, dtype=torch.int64, device=device)
        self._sampling = Sampling(
            torch.zeros(0), torch.zeros(0, dtype=torch.int64), torch.zeros(0),
            torch.zeros(0, dtype=torch.int64),
        )  # fmt: skip
        self._params: SamplingParams | None = None  # the same on the device, `[B]` each
        self._scalars = SamplingParams(None, None, None, 0)  # the values shared by every row
        self.all_greedy = True
        self._root_parents: dict[int, torch.Tensor] = {}  # int64 [B, 1] of -1, by batch size
        self.read_at = 0.0  # `time.perf_counter()` when the last step was read (`step.finish`)

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def slots(self) -> int:
        """The KV slots a row's steps may write: its capacity and one tree beyond it (a row
        that has room for its root verifies a whole tree)."""
        return self.capacity + self.max_nodes - 1

    @property
    def most_cached(self) -> int:
        """The most cache slots a row holds, as the host mirrors them (`Row.cached`)."""
        return max(row.cached for row in self.rows)

    def join(self, rows: list[Row], roots: torch.Tensor) -> None:
        """`rows` join after the batch's rows; `roots` int64 `[len(rows)]` on the device."""
        self.rows = self.rows + rows
        self.roots = torch.cat([self.roots, roots])
        sampling = [self._sampling, *(row.sampling for row in rows)]
        self._sampling = Sampling(
            *(torch.cat([getattr(part, name) for part in sampling]) for name in SAMPLING_FIELDS)
        )
        self._params = None  # uploaded when a step first needs them
        # Uniform parameters travel as scalars: the kernels then skip per-row loads, and an
        # all-greedy batch never draws a random number.
        self._scalars = SamplingParams(
            *(_uniform(getattr(self._sampling, name)) for name in SAMPLING_FIELDS[:3]), 0
        )
        self.all_greedy = all(row.greedy for row in self.rows)

    def keep(self, positions: list[int]) -> None:
        """Keep only the rows at `positions` (in that order). Parameters uniform over the batch
        stay uniform over its rows: only `all_greedy` may change."""
        self.rows = [self.rows[p] for p in positions]
        self.all_greedy = all(row.greedy for row in self.rows)
        index = to_device(positions, self.device)
        self.roots = self.roots[index]
        host_index = torch.tensor(positions, dtype=torch.int64)
        self._sampling = Sampling(
            *(getattr(self._sampling, name)[host_index] for name in SAMPLING_FIELDS)
        )
        if self._params is not None:
            params = self._params
            self._params = SamplingParams(*(getattr(params, n)[index] for n in SAMPLING_FIELDS))

    def params(self) -> SamplingParams:
        """Every row's sampling parameters as device tensors `[B]`."""
        if self._params is None:
            self._params = SamplingParams(
                *(
                    to_device(tensor.numpy(), self.device, tensor.dtype)
                    for tensor in (getattr(self._sampling, name) for name in SAMPLING_FIELDS)
                )
            )
        return self._params

    def state(self, rows: list[Row], index: torch.Tensor | None) -> DraftState:
        """What a drafter sees of `rows`, at batch positions `index` (None: the whole batch)."""
        params = self.params()
        values = (params.temperature, params.top_k, params.top_p, params.seed, self.roots)
        greedy = self.all_greedy
        if index is not None:
            values = tuple(tensor[index] for tensor in values)
            greedy = all(row.greedy for row in rows)
        temperature, top_k, top_p, seed, roots = values
        tokens = [row.tokens for row in rows]
        return DraftState(tokens, temperature, top_k, top_p, seed, self.device, greedy, roots)

    def plain_proposal(self) -> Proposal:
        """The one-node tree of every row (a step of plain decoding), built on the device."""
        batch = len(self.rows)
        parents = self._root_parents.get(batch)
        if parents is None:
            parents = torch.full((batch, 1), -1, dtype=torch.int64, device=self.device)
            self._root_parents[batch] = parents
        return Proposal(self.roots[:, None], parents)

    def sampling_params(self, positions: torch.Tensor) -> SamplingParams:
        """What `verify` takes for this step: per-node seeds, each row's seed plus the node's
        position (`positions` int64 `[B, N]`). Every position draws its own numbers, the same in
        any tree and any batch, so sampled speculation with deterministic drafts emits what
        plain sampling with the same seeds emits."""
        if self.all_greedy:
            return SamplingParams(0.0, 0, 1.0, 0)
        params, scalars = self.params(), self._scalars
        return SamplingParams(
            params.temperature if scalars.temperature is None else scalars.temperature,
            params.top_k if scalars.top_k is None else scalars.top_k,
            params.top_p if scalars.top_p is None else scalars.top_p,
            params.seed[:, None] + positions,
        )

    def emit(self, host: HostStep, now: float) -> tuple[list[list[int]], list[int]]:
        """Append each row's accepted drafts and next token (cut at its stop); return what each
        row emitted and the batch positions of the rows that finished (their finish reason
        set in their statistics). Rows that had finished emit nothing more."""
        emitted, finished = [], []
        for r, row in enumerate(self.rows):
            if row.stats.finish_reason is not None:
                # It finished at the step before and has not left yet: a step queued before
                # that step's read (`generate`'s read-ahead) ran for it too; that is dropped.
                emitted.append([])
                continue
            if host.next_tokens[r] < 0:
                # The verify kernel's mark of logits it cannot use (its contract: next token
                # -1, nothing accepted); the next step would embed -1.
                row.error = unusable_logits_error(len(row.generated))
                row.stats.finish_reason = FAILED
                emitted.append([])
                finished.append(r)
                continue
            accepted = host.num_accepted[r]
            # A tree's nodes past the capacity were verified in the slots beyond it: cut there.
            room = self.capacity - row.cached
            made = [*host.paths[r], host.next_tokens[r]][:room]
            taken, reason = row.rule.take(row.generated, made)
            row.cached += min(accepted + 1, room)
            if reason is None and row.cached >= self.capacity:
                reason = "cache"
            row.stats.record_step(host.depths[r], host.drafted[r], accepted)
            row.stats.record_emission(len(taken), now, row.start)
            row.tokens.extend(taken)
            emitted.append(taken)
            if row.on_tokens is not None:
                row.on_tokens(taken)
            if reason is not None:
                row.stats.finish_reason = reason
                finished.append(r)
        return emitted, finished
