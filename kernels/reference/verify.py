"""Plain-torch reference of `verify`, and the semantics both backends share.

Semantics (the Triton kernels in `jit/verify.py` implement the same, drawing the same random
numbers):
- The target distribution at a node is `softmax(logits / temperature)` restricted to the tokens
  that survive top-k, then top-p (renormalized after each, as sampling one token at a time
  would apply them). Ties: top-k keeps every token whose logit is >= the k-th largest logit;
  top-p keeps every token whose logit is >= that of the first token (in descending order) at
  which the cumulative mass reaches `top_p`, i.e. token v survives iff the mass of tokens with a
  strictly larger logit is < top_p. Tied tokens are therefore all kept or all dropped, and the
  kept set never depends on the order of the vocabulary.
- Greedy (temperature 0): the token is the argmax of the logits, the lowest token id among ties;
  filters do not matter (they always keep the argmax).
- Sampling a node draws one token `y` from its filtered target with the Gumbel-max trick,
  `argmax_v (logits_v - max) / temperature + G_v`, with `G_v` from the counter-based hash of
  (seed, sequence, node, stream 0, v); "sequence" is the batch index under an int seed and 0
  under per-sequence seeds, so that a sequence's draws then follow its own seed wherever it sits
  in the batch. Per-node seeds (int64 `[B, N]`) key each node by its own seed alone (sequence
  and node 0), so a node's numbers do not depend on its index in the tree.
- Deterministic drafts (no `draft_probs`): the walk accepts the first child (node order) whose
  token is `y`, else emits `y`. This has exactly the law of trying the children in node order,
  accepting child x with probability p'(x) and removing x from the residual p' on rejection:
  P(first child accepted) = p(x1) = P(y = x1), and conditioned on `y != x1`, `y` follows p with
  x1 removed and renormalized, and so on; after every child is rejected, `y` is a sample from
  the final residual. A duplicate sibling is never taken (its token left the residual with the
  first). Greedy is the same walk with y = argmax. tests/test_verify_lossless.py checks the
  emitted distribution against the exact target.
- Chains with `draft_probs`: child i (token x, drawn from q = draft_probs[b, i]) is accepted iff
  `u * q(x) < p(x)` with u uniform from stream 1 of node i (probability min(1, p(x)/q(x))). At the
  first rejection the next token is drawn from normalize(max(0, p - q)) by Gumbel-max over
  `log(max(0, p - q))` with the parent's stream-0 noise (that noise is otherwise used only when
  the parent is the last node); if that residual is empty in floating point (p <= q everywhere),
  the parent's sample from p is used. If every draft is accepted, the bonus token is the last
  node's sample from p.
"""

from typing import NamedTuple

import torch

from ..rng import STREAM_ACCEPT, STREAM_SAMPLE, gumbel, node_keys, uniform


class VerifyResult(NamedTuple):
    """Outcome of one verification step for B sequences.

    accepted_nodes: int32 `[B, N]`, the accepted path as node indices, the root (0) first, then -1.
    num_accepted: int32 `[B]`, accepted non-root nodes.
    next_tokens: int64 `[B]`, the token after the path (the correction on a rejection, the bonus
        token after a leaf); -1 for a sequence whose logits were invalid when the check was off.
    """

    accepted_nodes: torch.Tensor
    num_accepted: torch.Tensor
    next_tokens: torch.Tensor


def per_sequence(value, batch: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A scalar or a `[B]` tensor as a `[B]` tensor of `dtype`."""
    if isinstance(value, torch.Tensor):
        return value.to(device=device, dtype=dtype).expand(batch)
    return torch.full((batch,), value, dtype=dtype, device=device)


def draw_seed() -> int:
    """A seed from torch's default generator, so that `torch.manual_seed` fixes the outcome."""
    return int(torch.randint(0, 2**62, ()).item())


def invalid_rows(logits: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
    """Bool `[B, N]`: existing nodes whose logits hold NaN or +inf, or only -inf."""
    has_nan_or_inf = (torch.isnan(logits) | torch.isposinf(logits)).any(dim=-1)
    all_neg_inf = torch.isneginf(logits).all(dim=-1)
    return (has_nan_or_inf | all_neg_inf) & (parents != -2)


def kept_tokens(
    logits: torch.Tensor, scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Bool `[B, N, V]`: tokens that survive top-k then top-p (ties as in the module docstring).

    `logits` fp32 `[B, N, V]`; `scaled` = (logits - max) / temperature; `top_k` int64 `[B]`
    (0 or >= V: off); `top_p` fp32 `[B]` (1: off).
    """
    vocab = logits.shape[-1]
    descending, order = logits.sort(dim=-1, descending=True)
    k = top_k[:, None, None].expand(*logits.shape[:2], 1)
    kth = descending.gather(-1, (k - 1).clamp(0, vocab - 1))
    kth = torch.where((k > 0) & (k < vocab), kth, float("-inf"))
    mass = torch.where(descending >= kth, scaled.gather(-1, order).exp(), 0.0)
    cumulative = mass.cumsum(dim=-1)
    target = top_p[:, None, None] * cumulative[..., -1:]
    first_reaching = (cumulative < target).sum(dim=-1, keepdim=True).clamp(max=vocab - 1)
    top_p_floor = torch.where(
        top_p[:, None, None] < 1, descending.gather(-1, first_reaching), float("-inf")
    )
    return logits >= torch.maximum(kth, top_p_floor)


def verify_reference(
    logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    parents: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    temperature=None,
    top_k=None,
    top_p=None,
    seed=None,
) -> VerifyResult:
    """One speculative verification step (see `specdec_fast.kernels.verify` and this module's
    docstring for the semantics); inputs are assumed valid (`verify` checks them).

    Args:
        logits: `[B, N, V]` fp32/bf16/fp16, the target's logits at each node.
        draft_tokens: int `[B, N]`, the token of each node (entry 0 unused).
        parents: int `[B, N]`, -1 for the root (node 0), `parents[b, i] < i`, -2 for padding.
        draft_probs: optional `[B, N, V]` float, the draft distribution of each node's token
            (chains only).
        temperature, top_k, top_p: scalars or `[B]` tensors (None: 0 = greedy, 0 = off, 1.0 = off).
        seed: int or int `[B]` tensor (None: drawn from torch's default generator).

    A sequence with an unusable logits row (`invalid_rows`) gets `next_tokens = -1` and an empty
    path, as from the kernels; `verify` turns that into an error. Materializes `[B, N, V]` fp32
    tensors: meant for tests and CPU use, not for speed.
    """
    batch, num_nodes, vocab = logits.shape
    device = logits.device
    temperature = per_sequence(
        0.0 if temperature is None else temperature, batch, torch.float32, device
    )
    top_k = per_sequence(0 if top_k is None else top_k, batch, torch.int64, device)
    top_p = per_sequence(1.0 if top_p is None else top_p, batch, torch.float32, device)
    # Under per-sequence seeds a sequence's random numbers follow its seed, not its batch slot.
    sequence = torch.arange(batch, device=device) * (not isinstance(seed, torch.Tensor))
    if not (isinstance(seed, torch.Tensor) and seed.dim() == 2):
        seed = per_sequence(draw_seed() if seed is None else seed, batch, torch.int64, device)

    raw = logits.float()
    real = parents != -2
    invalid = invalid_rows(raw, parents).any(dim=1)
    sampling = temperature > 0
    node_token = raw.argmax(dim=-1)
    accept = torch.zeros((batch, num_nodes), dtype=torch.bool, device=device)
    residual_token = torch.zeros_like(node_token)
    # Only sampling rows pay for the noise, the filters and the chain decisions.
    sampled_rows = sampling.nonzero()[:, 0]
    if sampled_rows.numel() > 0:
        sampled, chain = _sample_rows(
            raw[sampled_rows],
            draft_tokens[sampled_rows],
            None if draft_probs is None else draft_probs[sampled_rows],
            temperature[sampled_rows],
            top_k[sampled_rows],
            top_p[sampled_rows],
            seed[sampled_rows],
            sequence[sampled_rows],
        )
        node_token[sampled_rows] = sampled
        if chain is not None:
            accept[sampled_rows], residual_token[sampled_rows] = chain

    nodes = torch.arange(num_nodes, device=device)
    rows = torch.arange(batch, device=device)
    tokens = draft_tokens.long()
    current = torch.zeros(batch, dtype=torch.long, device=device)
    depth = torch.zeros(batch, dtype=torch.long, device=device)
    active = ~invalid
    accepted_nodes = torch.full((batch, num_nodes), -1, dtype=torch.int32, device=device)
    accepted_nodes[:, 0] = 0
    next_tokens = torch.full((batch,), -1, dtype=torch.int64, device=device)
    for _ in range(num_nodes):
        if not bool(active.any()):
            break
        children = real & (parents == current[:, None]) & (nodes > current[:, None])
        token_here = node_token[rows, current]
        matching = children & (tokens == token_here[:, None])
        child = torch.where(matching, nodes, num_nodes).amin(dim=1)
        advance = child < num_nodes
        emit = token_here
        if draft_probs is not None:
            first_child = torch.where(children, nodes, num_nodes).amin(dim=1)
            has_child = first_child < num_nodes
            chain_rows = sampling & has_child
            advance = torch.where(chain_rows, accept[rows, current], advance & ~sampling)
            child = torch.where(sampling, first_child, child)
            emit = torch.where(chain_rows, residual_token[rows, current], token_here)
        advance &= active
        stop = active & ~advance
        next_tokens = torch.where(stop, emit, next_tokens)
        depth = depth + advance.long()
        accepted_nodes[rows[advance], depth[advance]] = child[advance].int()
        current = torch.where(advance, child, current)
        active = advance
    return VerifyResult(accepted_nodes, depth.int(), next_tokens)


def _sample_rows(raw, draft_tokens, draft_probs, temperature, top_k, top_p, seed, sequence):
    """Sampling rows only (temperature > 0): each node's sample from its filtered target
    `[B', N]`, and for chains with draft probabilities the `_chain_decisions`, else None."""
    num_nodes, vocab = raw.shape[1:]
    scaled = (raw - raw.amax(dim=-1, keepdim=True)) * (1.0 / temperature)[:, None, None]
    if bool((((top_k > 0) & (top_k < vocab)) | (top_p < 1)).any()):
        scaled = torch.where(kept_tokens(raw, scaled, top_k, top_p), scaled, float("-inf"))
    node = torch.arange(num_nodes, device=raw.device)[None, :, None]
    vocab_ids = torch.arange(vocab, device=raw.device)[None, None, :]
    key = node_keys(seed, sequence, node[:, :, 0], STREAM_SAMPLE)[:, :, None]
    noise = gumbel(key, vocab_ids)
    sampled = (scaled + noise).argmax(dim=-1)
    if draft_probs is None:
        return sampled, None
    return sampled, _chain_decisions(
        scaled, noise, draft_tokens, draft_probs, seed, sequence, sampled
    )


def _chain_decisions(scaled, noise, draft_tokens, draft_probs, seed, sequence, node_token):
    """For each parent node n of a chain (child n + 1): whether the child is accepted, and the
    token drawn from normalize(max(0, p - q)) if it is not. Both `[B, N]`, last column unused.
    `scaled` is -inf on filtered-out tokens."""
    batch, num_nodes, _ = scaled.shape
    device = scaled.device
    weights = scaled.exp()
    target = weights / weights.sum(dim=-1, keepdim=True)
    child_probs = torch.zeros_like(target)
    child_probs[:, :-1] = draft_probs[:, 1:].float()
    child_tokens = torch.zeros((batch, num_nodes, 1), dtype=torch.long, device=device)
    # Padded children may hold any token: clamp for the gather, their decisions are never read.
    child_tokens[:, :-1, 0] = draft_tokens[:, 1:].long().clamp(0, scaled.shape[-1] - 1)
    p_child = target.gather(-1, child_tokens)[..., 0]
    q_child = child_probs.gather(-1, child_tokens)[..., 0]
    child_node = torch.arange(1, num_nodes + 1, device=device)[None, :]
    key = node_keys(seed, sequence, child_node, STREAM_ACCEPT)
    u = uniform(key, torch.zeros_like(child_node))
    accept = u * q_child < p_child
    residual = (target - child_probs).clamp(min=0.0)
    residual_key = torch.where(residual > 0, residual.log(), float("-inf")) + noise
    residual_token = residual_key.argmax(dim=-1)
    empty = ~(residual > 0).any(dim=-1)
    return accept, torch.where(empty, node_token, residual_token)
