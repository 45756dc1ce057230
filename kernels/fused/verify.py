"""Fused-torch `verify` for CPU tensors: the tree walk without a loop over the nodes.

Same semantics and random numbers as `reference/verify.py` (its docstring states them). Where the
reference walks the tree one level per iteration, this finds the accepted path in a fixed number
of batched ops: a node is taken when its token equals its parent's draw (the first such sibling in
node order) and so is every ancestor, which pointer jumping checks in ceil(log2 N) gathers. An
all-greedy call never computes a softmax or a random number: one pass for the argmax and one for
the validity of each row, then (the tensors being host memory) a walk down the rows' first
matching children in numpy, a few array operations per level accepted where the batched form takes
about forty tensor operations whatever the tree (most of a greedy step's verification cost at
batch 1 on the CPU). Sampled rows of deterministic trees on the CPU walk the same way, each row
drawing at its current node only (`_sampled_on_host`): a draw is a pass of hashing and filtering
over the vocabulary, so drawing at the visited nodes instead of all N saves most of a sampled
step's sampling. Sampled chains with draft probabilities take the batched form.
"""

import math

import numpy as np
import torch

from ..reference.verify import VerifyResult, kept_tokens
from ..rng import STREAM_ACCEPT, STREAM_SAMPLE, gumbel, node_keys, uniform


def _ancestors_all(flags: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
    """Bool `[B, N]`: `flags` holds at the node and at every ancestor (the root counts as True)."""
    num_nodes = parents.shape[1]
    ok = flags.clone()
    ok[:, 0] = True
    jump = parents.long().clamp(min=0)
    for _ in range(math.ceil(math.log2(num_nodes)) if num_nodes > 1 else 0):
        ok &= ok.gather(1, jump)
        jump = jump.gather(1, jump)
    return ok


def _first_among_siblings(flags: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
    """Bool `[B, N]`: `flags` holds at the node and at none of its earlier siblings."""
    num_nodes = parents.shape[1]
    node = torch.arange(num_nodes, device=parents.device)
    earlier = node[None, :] < node[:, None]  # [i, j]: j before i
    siblings = parents[:, :, None] == parents[:, None, :]
    return flags & ~(siblings & earlier & flags[:, None, :]).any(dim=-1)


def _path(taken: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From the bool `[B, N]` nodes of each path (root excluded, a chain in node order): the
    int32 `accepted_nodes` `[B, N]` (root first, then -1), int32 `num_accepted` and the last node
    (int64, 0 when only the root)."""
    batch, num_nodes = taken.shape
    node = torch.arange(num_nodes, device=taken.device)
    # Taken nodes first, in node order; the root is prepended below.
    order = torch.where(taken, node, num_nodes).sort(dim=1).values[:, : num_nodes - 1]
    count = taken.sum(dim=1)
    accepted = torch.full((batch, num_nodes), -1, dtype=torch.int32, device=taken.device)
    accepted[:, 0] = 0
    accepted[:, 1:] = torch.where(order < num_nodes, order, -1).to(torch.int32)
    last = torch.where(taken, node, 0).amax(dim=1)
    return accepted, count.to(torch.int32), last


def _scaled(raw, temperature, top_k, top_p) -> torch.Tensor:
    """`[B, K, V]`: the logits less their maximum, over the row's temperature (1 for greedy
    rows), -inf where top-k or top-p filters the token."""
    sampling = temperature > 0
    inv_t = torch.where(sampling, 1.0 / torch.where(sampling, temperature, 1.0), 1.0)
    scaled = (raw - raw.amax(dim=-1, keepdim=True)) * inv_t[:, None, None]
    vocab = raw.shape[-1]
    if bool((((top_k > 0) & (top_k < vocab)) | (top_p < 1)).any()):
        scaled = torch.where(kept_tokens(raw, scaled, top_k, top_p), scaled, float("-inf"))
    return scaled


def _node_samples(raw, temperature, top_k, top_p, seed, sequence):
    """Each node's draw `[B, N]`: the argmax for greedy rows, the Gumbel-max sample of the
    filtered target for the others; plus the scaled logits (-inf where filtered) and the noise
    of sampling rows for the chain rule (None when every row is greedy)."""
    greedy = raw.argmax(dim=-1)
    sampling = temperature > 0
    if not bool(sampling.any()):
        return greedy, None, None
    vocab = raw.shape[-1]
    scaled = _scaled(raw, temperature, top_k, top_p)
    node = torch.arange(raw.shape[1], device=raw.device)[None, :, None]
    key = node_keys(seed, sequence, node[:, :, 0], STREAM_SAMPLE)[:, :, None]
    noise = gumbel(key, torch.arange(vocab, device=raw.device)[None, None, :])
    sampled = (scaled + noise).argmax(dim=-1)
    return torch.where(sampling[:, None], sampled, greedy), scaled, noise


def _chain_rule(scaled, noise, draft_tokens, draft_probs, seed, sequence, draws):
    """Chains with draft probabilities: whether node n's child (n + 1) is accepted, and the
    token drawn from normalize(max(0, p - q)) at n if it is not (the node's own draw when that
    residual is empty). Both `[B, N]`, the last column unused."""
    batch, num_nodes, vocab = scaled.shape
    weights = scaled.exp()
    target = weights / weights.sum(dim=-1, keepdim=True)
    child_q = torch.zeros_like(target)
    child_q[:, :-1] = draft_probs[:, 1:].float()
    child_token = torch.zeros((batch, num_nodes, 1), dtype=torch.long, device=scaled.device)
    child_token[:, :-1, 0] = draft_tokens[:, 1:].long().clamp(0, vocab - 1)
    p_child = target.gather(-1, child_token)[..., 0]
    q_child = child_q.gather(-1, child_token)[..., 0]
    child_node = torch.arange(1, num_nodes + 1, device=scaled.device)[None, :]
    u = uniform(
        node_keys(seed, sequence, child_node, STREAM_ACCEPT),
        torch.zeros_like(child_node),
    )
    residual = (target - child_q).clamp(min=0.0)
    residual_token = (torch.where(residual > 0, residual.log(), float("-inf")) + noise).argmax(-1)
    empty = ~(residual > 0).any(dim=-1)
    return u * q_child < p_child, torch.where(empty, draws, residual_token)


def _greedy_roots(logits: torch.Tensor) -> VerifyResult:
    """Greedy plain decoding (one node, nothing drafted) on an accelerator: the argmax, or -1 for
    unusable rows."""
    raw = logits[:, 0].float()
    next_tokens = torch.where(torch.isfinite(raw.amax(dim=-1)), raw.argmax(dim=-1), -1)
    accepted_nodes = torch.zeros(logits.shape[:2], dtype=torch.int32, device=logits.device)
    num_accepted = torch.zeros(logits.shape[:1], dtype=torch.int32, device=logits.device)
    return VerifyResult(accepted_nodes, num_accepted, next_tokens)


def _greedy_on_host(
    raw: torch.Tensor, draft_tokens: torch.Tensor, parents: torch.Tensor
) -> VerifyResult:
    """`verify` when every row is greedy, for host tensors (plain decoding's one node too): from
    the root, follow the first child (node order) whose token is the current node's argmax, one
    level for all rows at a time; a row with a non-finite maximum at a real node is unusable (-1,
    nothing accepted), as in `verify_fused`. numpy's argmax is ~10x torch's on the CPU at a
    step's shapes ([1, 8, 4096]: 5 us against 55)."""
    batch, num_nodes, _ = raw.shape
    values, parent, tokens = raw.numpy(), parents.numpy(), draft_tokens.numpy()
    draws = values.argmax(axis=-1)
    # max propagates NaN, and is +inf with any +inf, -inf only when the whole row is -inf.
    unusable = (~np.isfinite(values.max(axis=-1)) & (parent != -2)).any(axis=1)
    rows = np.arange(batch)
    # matches[b, n]: node n is a real non-root node whose token is its parent's draw.
    matches = (parent >= 0) & (tokens == draws[rows[:, None], parent.clip(min=0)])
    node = np.zeros(batch, dtype=np.int64)
    counts = np.zeros(batch, dtype=np.int32)
    accepted = np.full((batch, num_nodes), -1, dtype=np.int32)
    accepted[:, 0] = 0
    alive = ~unusable
    for depth in range(1, num_nodes):
        step = matches & (parent == node[:, None])
        alive &= step.any(axis=1)
        if not alive.any():
            break
        node = np.where(alive, step.argmax(axis=1), node)
        accepted[:, depth] = np.where(alive, node, -1)
        counts += alive
    next_tokens = np.where(unusable, -1, draws[rows, node]).astype(np.int64)
    return VerifyResult(
        torch.from_numpy(accepted), torch.from_numpy(counts), torch.from_numpy(next_tokens)
    )


def _unusable(raw: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """Bool `[B]`: rows whose logits at some real node (`real` bool `[B, N]`) are unusable."""
    # amax propagates NaN and is +inf with any +inf, -inf only when the whole row is -inf.
    return (~torch.isfinite(raw.amax(dim=-1)) & real).any(dim=1)


def _draws_at(raw, node, temperature, top_k, top_p, seed, sequence) -> torch.Tensor:
    """Each row's draw `[B]` at its node `node` (int64 `[B]`): what `_node_samples` draws there,
    computed for that one node per row (the same elementwise ops, so the same numbers)."""
    rows = torch.arange(raw.shape[0])
    values = raw[rows, node][:, None]  # [B, 1, V]
    greedy = values.argmax(dim=-1)[:, 0]
    sampling = temperature > 0
    if not bool(sampling.any()):
        return greedy
    scaled = _scaled(values, temperature, top_k, top_p)
    key = node_keys(seed, sequence, node[:, None], STREAM_SAMPLE)[:, :, None]
    noise = gumbel(key, torch.arange(raw.shape[-1])[None, None, :])
    return torch.where(sampling, (scaled + noise).argmax(dim=-1)[:, 0], greedy)


def _sampled_on_host(
    raw, draft_tokens, parents, temperature, top_k, top_p, seed, sequence
) -> VerifyResult:
    """`verify` of deterministic trees (no draft probabilities) for host tensors, sampled rows
    among them: the walk of `_greedy_on_host`, each row drawing at its current node only. A
    draw over the vocabulary (top-k/top-p, Gumbel noise) costs about 2 ms per node at V = 49152
    on a 2-core CPU, so drawing at the nodes a walk visits (the accepted path and the node after
    it) instead of at every node of the tree makes a 15-node step's sampling 5-8x cheaper."""
    batch, num_nodes, _ = raw.shape
    real = parents != -2
    invalid = _unusable(raw, real)
    parent, tokens = parents.long(), draft_tokens.long()
    children = real & (torch.arange(num_nodes) >= 1)
    node = torch.zeros(batch, dtype=torch.int64)
    accepted = torch.full((batch, num_nodes), -1, dtype=torch.int32)
    accepted[:, 0] = 0
    counts = torch.zeros(batch, dtype=torch.int32)
    next_tokens = torch.zeros(batch, dtype=torch.int64)
    alive = ~invalid
    for depth in range(1, num_nodes + 1):
        draw = _draws_at(raw, node, temperature, top_k, top_p, seed, sequence)
        next_tokens = torch.where(alive, draw, next_tokens)
        step = children & (parent == node[:, None]) & (tokens == draw[:, None])
        alive = alive & step.any(dim=1)
        if depth == num_nodes or not bool(alive.any()):
            break
        node = torch.where(alive, step.int().argmax(dim=1), node)  # the first matching child
        accepted[:, depth] = torch.where(alive, node, -1).to(torch.int32)
        counts += alive.to(torch.int32)
    return VerifyResult(accepted, counts, torch.where(invalid, -1, next_tokens))


def verify_fused(
    logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    parents: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    temperature=None,
    top_k=None,
    top_p=None,
    seed=None,
) -> VerifyResult:
    """`verify` (same arguments and result) on validated arguments; scalars or `[B]` tensors for
    the sampling parameters, an int or int `[B]` seed (never None here)."""
    batch, num_nodes, _ = logits.shape
    device = logits.device
    all_greedy = (
        not bool(temperature.any()) if isinstance(temperature, torch.Tensor) else not temperature
    )
    if all_greedy and device.type == "cpu":
        return _greedy_on_host(logits.float(), draft_tokens, parents)
    if all_greedy and num_nodes == 1:
        return _greedy_roots(logits)

    def per_sequence(value, default, dtype):
        value = default if value is None else value
        if isinstance(value, torch.Tensor):
            return value.to(device=device, dtype=dtype).expand(batch)
        return torch.full((batch,), value, dtype=dtype, device=device)

    temperature = per_sequence(temperature, 0.0, torch.float32)
    top_k = per_sequence(top_k, 0, torch.int64)
    top_p = per_sequence(top_p, 1.0, torch.float32)
    # Under per-sequence seeds a sequence's random numbers follow its seed, not its batch slot.
    sequence = torch.arange(batch, device=device) * (not isinstance(seed, torch.Tensor))
    if not (isinstance(seed, torch.Tensor) and seed.dim() == 2):
        seed = per_sequence(seed, 0, torch.int64)

    raw = logits.float()
    if draft_probs is None and device.type == "cpu":
        return _sampled_on_host(
            raw, draft_tokens, parents, temperature, top_k, top_p, seed, sequence
        )
    real = parents != -2
    invalid = _unusable(raw, real)
    draws, scaled, noise = _node_samples(raw, temperature, top_k, top_p, seed, sequence)

    node = torch.arange(num_nodes, device=device)
    parent = parents.long().clamp(min=0)
    tokens = draft_tokens.long()
    # has_child[b, n]: some existing node has parent n.
    has_child = (real[:, :, None] & (parents.long()[:, :, None] == node)).any(dim=1)
    matches = real & (node >= 1) & (tokens == draws.gather(1, parent))
    taken = _ancestors_all(_first_among_siblings(matches, parents.long()), parents) & matches
    sampling = temperature > 0
    if draft_probs is not None and scaled is not None:
        accept, residual_token = _chain_rule(
            scaled, noise, draft_tokens, draft_probs, seed, sequence, draws
        )
        # A sampled chain takes its drafts while they are accepted: child n + 1 by accept[n].
        parent_accepts = torch.ones_like(accept)
        parent_accepts[:, 1:] = accept[:, :-1]
        chain_taken = real & (node >= 1) & parent_accepts.cumprod(dim=1).bool()
        taken = torch.where(sampling[:, None], chain_taken, taken)
    accepted_nodes, num_accepted, last = _path(taken)
    next_tokens = draws.gather(1, last[:, None])[:, 0]
    if draft_probs is not None and scaled is not None:
        rejected = has_child.gather(1, last[:, None])[:, 0]
        residual = residual_token.gather(1, last[:, None])[:, 0]
        next_tokens = torch.where(sampling & rejected, residual, next_tokens)
    accepted_nodes[invalid, 1:] = -1
    num_accepted = torch.where(invalid, 0, num_accepted)
    next_tokens = torch.where(invalid, -1, next_tokens)
    return VerifyResult(accepted_nodes, num_accepted, next_tokens)
