"""The rows of a `generate` call that are still running, and everything the loop tracks per row.

`Batch` owns the per-row bookkeeping of the step loop: original row indices, the tokens of each
row (the drafter's `DraftState`), the generated tokens and stop rules, the cached lengths (a host
mirror of the cache's, used for the capacity stop), per-sequence statistics, each row's next root
(on the device) and the sampling parameters as `verify` takes them. `drop()` shrinks the runner,
the drafter and itself together when rows finish.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from specdec_fast.drafters.base import PAD_PARENT, DraftState, Proposal
from specdec_fast.kernels.verify import SamplingParams
from specdec_fast.requests import Sampling, StopRule
from specdec_fast.stats import SpecStats
from specdec_fast.transfer import to_device, to_host

TokenCallback = Callable[[int, list[int]], None]


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


def _uniform(values: torch.Tensor):
    """A Python scalar when every row has the same value (the kernels specialise on it)."""
    first = values[0].item()
    return first if bool((values == first).all()) else None


class Batch:
    """Active rows of one `generate` call (see the module doc).

    Args:
        prompts: the unpadded prompts, one token list per row.
        sampling: per-row sampling parameters (host tensors).
        rule: the stop rule shared by every row.
        stats: the call's statistics, one `SequenceStats` per original row.
        device: the model's device.
        capacity: the KV capacity per sequence; a row stops with reason "cache" when the next
            tree of `num_nodes` nodes would not fit.
        start: `time.perf_counter()` at the start of the call (TTFT origin).
        on_tokens: streaming callback `(row, new_tokens)`.
    """

    def __init__(
        self,
        prompts: list[list[int]],
        sampling: Sampling,
        rule: StopRule,
        stats: SpecStats,
        device: torch.device,
        capacity: int,
        num_nodes: int,
        start: float,
        on_tokens: TokenCallback | None = None,
    ):
        self.rows = list(range(len(prompts)))
        self.lengths = [len(prompt) - 1 for prompt in prompts]
        self.generated: list[list[int]] = [[] for _ in prompts]
        self.rule, self.stats, self.on_tokens = rule, stats, on_tokens
        self.capacity, self.num_nodes, self.start = capacity, num_nodes, start
        self.device = device
        # Uniform parameters travel as scalars: the kernels then skip per-row loads, and an
        # all-greedy batch never draws a random number.
        self._scalars = SamplingParams(
            _uniform(sampling.temperature), _uniform(sampling.top_k), _uniform(sampling.top_p), 0
        )
        self.all_greedy = self._scalars.temperature == 0.0
        self.state = DraftState(
            tokens=[list(prompt) for prompt in prompts],
            temperature=sampling.temperature.to(device),
            top_k=sampling.top_k.to(device),
            top_p=sampling.top_p.to(device),
            seed=sampling.seed.to(device),
            device=device,
            greedy=self.all_greedy,
        )
        self._root_parents: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def roots(self) -> torch.Tensor | None:
        """int64 `[B]` on the device: each active row's root, the last token chosen."""
        return self.state.roots

    @roots.setter
    def roots(self, roots: torch.Tensor) -> None:
        self.state.roots = roots

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
        any tree, so sampled speculation with deterministic drafts emits what plain sampling
        with the same seeds emits."""
        if self.all_greedy:
            return self._scalars
        state = self.state
        return SamplingParams(
            state.temperature if self._scalars.temperature is None else self._scalars.temperature,
            state.top_k if self._scalars.top_k is None else self._scalars.top_k,
            state.top_p if self._scalars.top_p is None else self._scalars.top_p,
            state.seed[:, None] + positions,
        )

    @staticmethod
    def read_back(proposal: Proposal, result, depths: torch.Tensor) -> HostStep:
        """The step's one device-to-host read: per row the next token and, for drafted trees,
        the accepted path (node indices and tokens) and the tree's size and depth. A static
        method: the serving scheduler reads its steps back the same way."""
        accepted_nodes, num_accepted, next_tokens = result
        flags = [] if proposal.malformed is None else [proposal.malformed.long()]
        if proposal.num_nodes == 1:
            if flags:
                tokens, flagged = to_host(torch.stack([next_tokens, *flags]))
            else:
                tokens, flagged = to_host(next_tokens), []
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
        path = proposal.tokens.gather(1, accepted_nodes.clamp(min=0).long())[:, 1:]
        drafted = (proposal.parents != PAD_PARENT).sum(dim=1) - 1
        offered_depth = depths.max(dim=1).values
        columns = [next_tokens, num_accepted.long(), drafted, offered_depth, *flags]
        host = torch.cat([torch.stack(columns, dim=1), path, accepted_nodes[:, 1:].long()], dim=1)
        rows = to_host(host)
        start, width = len(columns), path.shape[1]
        return HostStep(
            next_tokens=[row[0] for row in rows],
            num_accepted=[row[1] for row in rows],
            drafted=[row[2] for row in rows],
            depths=[row[3] for row in rows],
            paths=[row[start : start + row[1]] for row in rows],
            nodes=[row[start + width : start + width + row[1]] for row in rows],
            malformed=[r for r, row in enumerate(rows) if flags and row[4]],
        )

    def emit(self, host: HostStep, now: float) -> tuple[list[list[int]], list[int]]:
        """Append each row's accepted drafts and next token (cut at a stop); return what each
        row emitted and the active indices of the rows that finished."""
        emitted, finished = [], []
        for r, row in enumerate(self.rows):
            accepted = host.num_accepted[r]
            taken, reason = self.rule.take(
                self.generated[row], [*host.paths[r], host.next_tokens[r]]
            )
            self.lengths[r] += accepted + 1
            if reason is None and self.lengths[r] + self.num_nodes > self.capacity:
                reason = "cache"
            sequence = self.stats.sequences[row]
            sequence.record_step(host.depths[r], host.drafted[r], accepted)
            sequence.record_emission(len(taken), now, self.start)
            self.state.tokens[r].extend(taken)
            emitted.append(taken)
            if self.on_tokens is not None:
                self.on_tokens(row, taken)
            if reason is not None:
                sequence.finish_reason = reason
                finished.append(r)
        return emitted, finished

    def drop(self, finished: list[int], runner, drafter) -> None:
        """Remove the finished rows from the batch, the runner's cache and the drafter."""
        if not finished:
            return
        gone = set(finished)
        keep = [r for r in range(len(self.rows)) if r not in gone]
        self.rows = [self.rows[r] for r in keep]
        self.lengths = [self.lengths[r] for r in keep]
        if not keep:
            return
        index = to_device(keep, self.device)
        runner.keep(keep)
        state = self.state
        self.state = DraftState(
            tokens=[state.tokens[r] for r in keep],
            temperature=state.temperature[index],
            top_k=state.top_k[index],
            top_p=state.top_p[index],
            seed=state.seed[index],
            device=state.device,
            greedy=state.greedy,
            roots=state.roots[index],
        )
        if drafter is not None:
            drafter.keep(keep)
