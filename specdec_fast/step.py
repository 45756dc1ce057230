"""One speculative step over a running batch: the loop body of `generate` and of the serving
scheduler alike (docs/ARCHITECTURE.md, "Data flow of one step").

    proposals = lane.drafter.propose(state)         per lane, checked (`drafters.checks`)
    tree      = one tree per row                    each lane's at its rows, the root alone at
                                                    the others (plain decoding); roots in
                                                    column 0, padded to the runner's width
    out       = runner.verify(tree)                 target logits [B, N, V] in one forward
    result    = kernels.verify(out.logits, ...)     accepted path + next token, lossless
    cache.compact(result)                           the cache keeps the prefix + the path
    batch.roots = result.next_tokens                the next roots stay on the device
    read      = read_back(...)                      the step's one device-to-host read, started
    host      = read.wait()                         ... and waited for
    batch.emit(host)                                stop rules, finish reasons, stats, streaming
    lane.drafter.update(state, outcome)             per lane, over its rows (with read-ahead at
                                                    the launch, and `read(state, outcome)` here)

then `drop` takes the finished rows out of the batch, the runner's cache and every lane.
`launch` is the device half (up to the started read) and `finish` the host half; their `vocab`
is the target's vocabulary size (for the proposal checks). `generate` and the scheduler may
queue the next step between the two halves (`read_ahead`, `queue_behind`): the device then
never waits for the host between steps. They do so for plain decoding and for drafters that
read ahead (`Drafter.reads_ahead`, `first_unread`), which `launch` then updates at once
from the step's device outcome, before its read; `finish` gives them the outcome again with its
host fields (`Drafter.read`).

A `Lane` is a drafter and the rows it drafts for: `generate` has one over every row (or none, for
plain decoding); the scheduler one per route, each over that route's speculating rows. A lane's
drafter failing (an exception in `propose`, `update`, `read` or `keep`, or a malformed proposal
that the checks replaced by plain steps) goes to `Lane.fail`: `generate`'s lanes raise, the
scheduler's move their rows to plain decoding. Nothing between two steps reads the device: the
next roots are the verify kernel's output and the cache lengths are advanced by the compaction
kernel, on the device; the host mirrors the lengths from the read-back (`Row.cached`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import torch

from specdec_fast.batch import Batch, HostStep, Row, StepRead, read_back
from specdec_fast.drafters.base import (
    PAD_PARENT,
    Drafter,
    DraftState,
    Proposal,
    StepOutcome,
    reads_ahead,
    reads_back,
    with_roots,
)
from specdec_fast.drafters.checks import checked, malformed_error, screens_values
from specdec_fast.kernels.verify import SamplingParams, VerifyResult, run_verify
from specdec_fast.runner import ModelRunner, VerifyOutput
from specdec_fast.transfer import to_device


class Lane:
    """A drafter and the rows it drafts for, in batch order (its drafter's batch is exactly
    these rows); `positions` and `index` place them in the batch (`index_lanes`)."""

    def __init__(self, drafter: Drafter):
        self.drafter = drafter
        self.rows: list[Row] = []
        self.positions: list[int] = []
        self.index: torch.Tensor | None = None  # `positions` on the device; None: every row

    def fail(self, where: str, error: Exception, verified: bool = False) -> None:
        """The drafter failed in `where` ("propose", "update", "read", "keep"): raise `error`
        (a lane that survives its drafter's failures overrides this). `verified`: the step had
        verified the lane's proposal (the checks flagged it after the forward, or `update` or
        `read` raised), so the step's report holds its figures (`Drafted.failed`)."""
        raise error


@dataclass
class Drafted:
    """A lane's part in a step: the state its drafter saw (and sees again in `update`), its
    proposal as the drafter made it and as checked, at the batch `positions` its rows held;
    `failed` once the lane's drafter failed after proposing; `outcome` the one it was updated
    with ahead of the read (read-ahead) when its drafter takes the host fields later
    (`reads_back`), which `finish` completes for its `read`."""

    lane: Lane
    state: DraftState
    positions: list[int]
    index: torch.Tensor | None
    drafted: Proposal
    proposal: Proposal
    failed: bool = False
    outcome: StepOutcome | None = None


@dataclass
class StepReport:
    """What a step did, on the host: the read-back, each row's emitted tokens, the batch
    positions of the rows that finished, the lanes whose proposals were verified, and the
    step's seconds (propose to update)."""

    host: HostStep
    emitted: list[list[int]]
    finished: list[int]
    drafted: list[Drafted] = field(default_factory=list)
    seconds: float = 0.0


def index_lanes(batch: Batch, lanes: list[Lane]) -> None:
    """Each lane's batch positions, after rows joined or left."""
    position = {id(row): p for p, row in enumerate(batch.rows)}
    for lane in lanes:
        lane.positions = [position[id(row)] for row in lane.rows]
        whole = lane.positions == list(range(len(batch.rows)))
        lane.index = None if whole else to_device(lane.positions, batch.device)


@dataclass
class Launched:
    """A step queued on the device (`launch`): its forward, acceptance and compaction, and its
    read-back on the way to the host; `updated` once its drafters followed it (read-ahead)."""

    drafts: list[Drafted]
    proposal: Proposal
    result: VerifyResult
    out: VerifyOutput
    read: StepRead
    start: float
    updated: bool = False


def launch(
    runner: ModelRunner, batch: Batch, lanes: list[Lane], vocab: int, unread: int | None = None
) -> Launched:
    """The device half of a step (the module doc's lines up to the read-back, which it starts
    without waiting for): it leaves the next roots in `batch.roots`, so another step can be
    queued before this one is read (`generate`'s read-ahead).

    `unread`: None to update the lanes' drafters after the read (`finish`); with read-ahead, the
    tokens per row that steps queued before this one and not yet read may have added (0 for
    none): the drafters, which must read ahead (`Drafter.reads_ahead`), see it in their state
    (`DraftState.unread`) and are updated here, from the step's device outcome."""
    start = time.perf_counter()
    drafts = []
    for lane in lanes:
        if not lane.rows:
            continue
        state = batch.state(lane.rows, lane.index)
        state.unread = unread or 0
        try:
            drafted = lane.drafter.propose(state)
            proposal = checked(lane.drafter, drafted, state, vocab)
        except Exception as error:  # noqa: BLE001 - the lane decides (`Lane.fail`)
            lane.fail("propose", error)
            continue
        drafts.append(Drafted(lane, state, list(lane.positions), lane.index, drafted, proposal))
    proposal = _assemble(runner, batch, drafts)
    out = runner.verify(proposal.tokens, proposal.parents)
    result = _verify(out, proposal, batch.sampling_params(out.positions), drafts)
    runner.cache.compact(result.accepted_nodes, result.num_accepted, validate=False)
    batch.roots = result.next_tokens
    read = read_back(proposal, result, out.depths)
    launched = Launched(drafts, proposal, result, out, read, start, unread is not None)
    if launched.updated:
        for draft in drafts:
            # The step's own tokens are unread too: at most its tree's nodes per row.
            ahead = replace(draft.state, unread=draft.state.unread + draft.proposal.num_nodes)
            _update(draft, launched, ahead)
    return launched


def first_unread(lanes: list[Lane], read_ahead: bool) -> int | None:
    """`launch`'s `unread` for a step with none queued before it: 0 (the next step may then be
    queued before this one is read) with `read_ahead` where every lane with rows has a drafter
    that reads ahead (`Drafter.reads_ahead`), else None."""
    ahead = read_ahead and all(reads_ahead(lane.drafter) for lane in lanes if lane.rows)
    return 0 if ahead else None


def queue_behind(
    runner: ModelRunner, batch: Batch, lanes: list[Lane], vocab: int, launched: Launched
) -> Launched | None:
    """`launch` the next step behind `launched` before `launched` is read (read-ahead), or None
    where it may not be queued: `launched`'s drafters were not updated at its launch
    (`unread` was None: `first_unread`), or some row could stop for its cache at
    `launched` (a step queued behind it would then write that row's cache beyond what a step
    after a read could). Finish the two in order; rows that finish at the first leave after
    the second is read (`Batch.emit` drops what it made for them)."""
    if not launched.updated:
        return None
    # The most tokens a row commits at `launched`: a tree's path and the next token. A row that
    # may reach its capacity there may stop; one that does not has room for its root, and a
    # queued tree fits the slots beyond it.
    commits = batch.max_nodes if any(lane.rows for lane in lanes) else 1
    if batch.most_cached + commits >= batch.capacity:
        return None
    # A row whose logits were unusable has root -1 (the verify kernel's mark), which the
    # queued step must not embed; what it makes for that row is dropped with it.
    batch.roots = batch.roots.clamp(min=0)
    return launch(runner, batch, lanes, vocab, launched.proposal.num_nodes)


def finish(
    runner: ModelRunner, batch: Batch, launched: Launched, vocab: int, ahead: int = 0
) -> StepReport:
    """The host half of a `launch`ed step: wait for its read-back, emit, update the drafters.
    `ahead`: the cache slots a step queued after this one reserved (its verify width; 0 for
    none). The report's seconds run from the step's launch, or from the read of the step
    before it when that came later (steps queued behind one another count no time twice)."""
    host = launched.read.wait()
    drafts = launched.drafts
    flagged = set(host.malformed)
    for draft in drafts:
        if flagged.intersection(draft.positions) and screens_values(draft.lane.drafter):
            # The screen replaced the flagged rows by plain steps: the output is unchanged.
            draft.failed = True
            error = malformed_error(draft.lane.drafter, draft.drafted, vocab)
            draft.lane.fail("propose", error, verified=True)
    emitted, finished = batch.emit(host, time.perf_counter())
    runner.cache.bound_lengths(batch.most_cached + ahead)
    for draft in drafts:
        if draft.failed:
            continue
        if launched.updated:
            if draft.lane.rows:  # not moved to plain decoding since (the scheduler's lanes)
                _read(draft, host, emitted)
        else:
            _update(draft, launched, draft.state, host, emitted)
    now = time.perf_counter()
    seconds = now - max(launched.start, batch.read_at)
    batch.read_at = now
    return StepReport(host, emitted, finished, drafts, seconds)


def drop(runner: ModelRunner, batch: Batch, lanes: list[Lane], leaving: list[int]) -> list[Row]:
    """The rows at batch positions `leaving` leave the batch, the runner's cache and their
    lanes (each lane's drafter keeps its other rows; a lane left without rows keeps nothing);
    returns them. Every launched step must have been read (`finish`)."""
    if not leaving:
        return []
    gone = set(leaving)
    left = [batch.rows[p] for p in leaving]
    keep = [p for p in range(len(batch.rows)) if p not in gone]
    runner.keep(keep)
    batch.keep(keep)
    if batch.rows:
        # Every step was read: the rows left bound the cache's lengths, not a longer one that
        # left (its cache full), which would cost the next step's room check a device read.
        runner.cache.bound_lengths(batch.most_cached)
    gone_rows = {id(row) for row in left}
    for lane in lanes:
        kept = [i for i, row in enumerate(lane.rows) if id(row) not in gone_rows]
        if len(kept) == len(lane.rows):
            continue
        lane.rows = [lane.rows[i] for i in kept]
        if lane.rows:
            try:
                lane.drafter.keep(kept)
            except Exception as error:  # noqa: BLE001 - the lane decides (`Lane.fail`)
                lane.fail("keep", error)
    index_lanes(batch, lanes)
    return left


def _assemble(runner: ModelRunner, batch: Batch, drafts: list[Drafted]) -> Proposal:
    """One tree per row: each lane's proposal at its rows, the root alone at the others,
    every row's root in column 0, padded to the width the runner picks."""
    roots = batch.roots
    if not drafts:
        plain = batch.plain_proposal()
        width = runner.verify_width(len(batch), 1, batch.max_nodes)
        return plain if width == 1 else with_roots(plain, roots, width)
    widest = max(draft.proposal.num_nodes for draft in drafts)
    width = runner.verify_width(len(batch), widest, batch.max_nodes)
    if len(drafts) == 1 and drafts[0].index is None:
        return with_roots(drafts[0].proposal, roots, width)
    rows = len(batch)
    tokens = torch.zeros((rows, width), dtype=torch.int64, device=batch.device)
    parents = torch.full_like(tokens, PAD_PARENT)
    tokens[:, 0] = roots
    parents[:, 0] = -1
    draft_probs = malformed = None
    for draft in drafts:
        sub, where = draft.proposal, draft.index
        nodes = sub.num_nodes
        tokens[where, 1:nodes] = sub.tokens[:, 1:].to(torch.int64)
        parents[where, :nodes] = sub.parents.to(torch.int64)
        if sub.draft_probs is not None:
            if draft_probs is None:
                draft_probs = sub.draft_probs.new_zeros((rows, width, sub.draft_probs.shape[2]))
            draft_probs[where, :nodes] = sub.draft_probs
        if sub.malformed is not None:
            if malformed is None:
                malformed = torch.zeros(rows, dtype=torch.bool, device=batch.device)
            malformed[where] = sub.malformed
    return Proposal(tokens, parents, draft_probs, malformed)


def _subset(params: SamplingParams, index: torch.Tensor) -> SamplingParams:
    return SamplingParams(
        *(v[index] if isinstance(v, torch.Tensor) else v for v in
          (params.temperature, params.top_k, params.top_p, params.seed))
    )  # fmt: skip


def _verify(
    out: VerifyOutput, proposal: Proposal, params: SamplingParams, drafts: list[Drafted]
) -> VerifyResult:
    """`kernels.verify` of the step: one call, or, when some lane's trees carry draft
    probabilities (sampled chains, the only trees that may) beside other rows, one call for
    each such lane and one for the other rows."""
    chained = [draft for draft in drafts if draft.proposal.draft_probs is not None]
    if not chained or (len(drafts) == 1 and drafts[0].index is None):
        return run_verify(
            out.logits, proposal.tokens, proposal.parents, proposal.draft_probs, params
        )
    batch, width = proposal.tokens.shape
    device = proposal.tokens.device
    accepted = torch.full((batch, width), -1, dtype=torch.int32, device=device)
    num_accepted = torch.zeros(batch, dtype=torch.int32, device=device)
    next_tokens = torch.zeros(batch, dtype=torch.int64, device=device)
    groups = [(draft.index, proposal.draft_probs) for draft in chained]
    in_chains = {p for draft in chained for p in draft.positions}
    rest = [p for p in range(batch) if p not in in_chains]
    if rest:
        groups.append((to_device(rest, device), None))
    for index, probs in groups:
        part = run_verify(
            out.logits[index],
            proposal.tokens[index],
            proposal.parents[index],
            None if probs is None else probs[index],
            _subset(params, index),
        )
        accepted[index], num_accepted[index], next_tokens[index] = part
    return VerifyResult(accepted, num_accepted, next_tokens)


# StepOutcome's fields read back from the device (None when a drafter is updated ahead).
HOST_FIELDS = ("emitted", "accepted_paths", "drafted", "malformed")


def _host_fields(draft: Drafted, host: HostStep, emitted: list[list[int]]) -> dict:
    """The outcome's host fields for the lane's rows, from the step's read-back."""
    if draft.index is None:  # the lane has every row, in batch order
        return {
            "emitted": emitted,
            "accepted_paths": host.nodes,
            "drafted": host.drafted,
            "malformed": host.malformed,
        }
    positions, bad = draft.positions, set(host.malformed)
    return {
        "emitted": [emitted[p] for p in positions],
        "accepted_paths": [host.nodes[p] for p in positions],
        "drafted": [host.drafted[p] for p in positions],
        "malformed": [i for i, p in enumerate(positions) if p in bad],
    }


def _update(
    draft: Drafted,
    launched: Launched,
    state: DraftState,
    host: HostStep | None = None,
    emitted: list[list[int]] | None = None,
) -> None:
    """The lane's drafter follows its rows' step, over its own tree width; from the device
    outcome alone when `host` is None (read-ahead: the host fields are None, and the outcome
    is kept for `_read`)."""
    proposal, result, out = launched.proposal, launched.result, launched.out
    width = draft.proposal.num_nodes
    where = slice(None) if draft.index is None else draft.index
    ahead = host is None
    outcome = StepOutcome(
        Proposal(
            proposal.tokens[where, :width],
            proposal.parents[where, :width],
            draft.proposal.draft_probs,
            draft.proposal.malformed,
        ),
        result.accepted_nodes[where, :width],
        result.num_accepted[where],
        result.next_tokens[where],
        hidden={layer: h[where, :width] for layer, h in out.hidden_states.items()},
        **(dict.fromkeys(HOST_FIELDS) if ahead else _host_fields(draft, host, emitted)),
    )
    if ahead and reads_back(draft.lane.drafter):
        draft.outcome = outcome
    _tell(draft, "update", state, outcome)


def _read(draft: Drafted, host: HostStep, emitted: list[list[int]]) -> None:
    """A lane updated ahead of the read whose drafter takes the host fields (`reads_back`)
    gets its outcome again with them (`Drafter.read`)."""
    if draft.outcome is not None:
        outcome = replace(draft.outcome, **_host_fields(draft, host, emitted))
        _tell(draft, "read", draft.state, outcome)


def _tell(draft: Drafted, member: str, state: DraftState, outcome: StepOutcome) -> None:
    """The lane's drafter's `update` or `read`; a failure goes to the lane (`Lane.fail`)."""
    try:
        getattr(draft.lane.drafter, member)(state, outcome)
    except Exception as error:  # noqa: BLE001 - the step was verified: the lane decides
        draft.failed = True
        draft.lane.fail(member, error, verified=True)
