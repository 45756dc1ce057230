"""`generate`: speculative decoding of an HF causal LM, a drop-in for greedy or sampled generation.

The loop (DESIGN.md, "Data flow of one step"), for the rows still running:

    proposal = drafter.propose(state)            tree [B, N] rooted at each row's last token
    out      = runner.verify(tokens, parents)    target logits [B, N, V] in one forward
    result   = kernels.verify(out.logits, ...)   accepted path + next token, lossless
    runner.cache.compact(...)                    the cache keeps the prefix + the accepted path
    drafter.update(state, outcome)

Only the emitted tokens are read back to the host each step. Rows that stop (EOS, a stop sequence,
`max_new_tokens`, or a full cache) leave the batch, so they cost nothing afterwards.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from specdec_fast.drafters.base import Drafter, DraftState, StepOutcome, root_only
from specdec_fast.kernels.verify import verify
from specdec_fast.requests import (
    Sampling,
    StopRule,
    check_token_ids,
    prompts_from_input,
    step_seeds,
)
from specdec_fast.runner import ModelRunner
from specdec_fast.stats import SequenceStats, SpecStats

TokenCallback = Callable[[int, list[int]], None]


@dataclass
class GenerateOutput:
    """sequences: B 1-D LongTensors, each the unpadded prompt plus the generated tokens (stops
    included, nothing after them). stats: the run's `SpecStats`."""

    sequences: list[torch.Tensor]
    stats: SpecStats


def _pad_prompts(prompts: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.int64)
    mask = torch.zeros(len(prompts), width, dtype=torch.int64)
    for row, prompt in enumerate(prompts):
        ids[row, : len(prompt)] = torch.as_tensor(prompt)
        mask[row, : len(prompt)] = 1
    return ids.to(device), mask.to(device)


def _default_eos(model: PreTrainedModel):
    config = getattr(model, "generation_config", None)
    return getattr(config, "eos_token_id", None)


def generate(
    model: PreTrainedModel,
    input_ids: torch.Tensor | Sequence[Sequence[int]],
    *,
    drafter: Drafter | None,
    max_new_tokens: int,
    attention_mask: torch.Tensor | None = None,
    temperature: float | Sequence[float] | torch.Tensor = 0.0,
    top_k: int | Sequence[int] | torch.Tensor = 0,
    top_p: float | Sequence[float] | torch.Tensor = 1.0,
    seed: int | Sequence[int] | torch.Tensor | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    stop: Sequence[int] | Sequence[Sequence[int]] | None = None,
    max_cache_len: int | None = None,
    on_tokens: TokenCallback | None = None,
    use_cuda_graphs: bool | None = None,
) -> GenerateOutput:
    """Generate up to `max_new_tokens` tokens per sequence with speculative decoding.

    Greedy output (temperature 0) equals the target's own greedy decoding; sampled output has the
    target's distribution (temperature, then top-k, then top-p, per sequence).

    Args:
        model: an HF causal LM whose attention goes through `AttentionInterface`.
        input_ids: LongTensor [B, T] with `attention_mask` (left or right padding), or B token
            lists.
        drafter: a drafter (see `specdec_fast.drafters.base`); None decodes plainly through the
            same engine, the baseline every speed-up is measured against.
        temperature, top_k, top_p, seed: scalars or one value per sequence; temperature 0 is
            greedy, top_k 0 and top_p 1.0 are off. seed None draws one from torch's generator.
        eos_token_id: int or list; None uses `model.generation_config.eos_token_id`.
        stop: stop token sequences (a flat list of ints is one sequence).
        max_cache_len: KV capacity per sequence; default: longest prompt + max_new_tokens + the
            tree size. A sequence whose cache fills up stops with finish reason "cache".
        on_tokens: called as `on_tokens(sequence_index, new_tokens)` whenever tokens are accepted
            (streaming); ITL statistics are measured at these moments.
        use_cuda_graphs: capture verify steps as CUDA graphs (default: on for CUDA models).
    """
    start = time.perf_counter()
    prompts = prompts_from_input(input_ids, attention_mask)
    vocab_size = model.config.get_text_config(decoder=True).vocab_size
    check_token_ids(prompts, vocab_size)
    batch = len(prompts)
    rule = StopRule(
        _default_eos(model) if eos_token_id is None else eos_token_id, stop, max_new_tokens
    )
    sampling = Sampling.build(batch, temperature, top_k, top_p, seed)
    num_nodes = drafter.max_nodes if drafter is not None else 1
    longest = max(len(p) for p in prompts)
    capacity = max_cache_len or longest + max_new_tokens + num_nodes
    if longest - 1 + num_nodes > capacity:
        raise ValueError(
            f"max_cache_len={capacity} cannot hold the longest prompt ({longest} tokens) plus a "
            f"tree of {num_nodes} nodes"
        )

    stats = SpecStats(
        sequences=[SequenceStats(prompt_tokens=len(p)) for p in prompts],
        drafter=repr(drafter) if drafter is not None else None,
        memory_device=model.device.type,
    )
    generated: list[list[int]] = [[] for _ in prompts]
    if max_new_tokens == 0:
        stats.wall_time = time.perf_counter() - start
        return GenerateOutput([torch.tensor(p) for p in prompts], stats)
    if model.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(model.device)

    with ModelRunner(model, capacity, use_cuda_graphs=use_cuda_graphs) as runner:
        if drafter is not None:
            drafter.attach(model, capacity)
            runner.capture_hidden(drafter.hidden_layers)
        ids, mask = _pad_prompts(prompts, model.device)
        prefill = runner.prefill(ids, mask)
        rows = list(range(batch))  # original index of each active row
        state = DraftState(
            tokens=[list(p) for p in prompts],
            temperature=sampling.temperature.to(model.device),
            top_k=sampling.top_k.to(model.device),
            top_p=sampling.top_p.to(model.device),
            seed=sampling.seed.to(model.device),
            device=model.device,
            hidden=prefill.hidden_states,
        )
        if drafter is not None:
            drafter.begin(state)
        step = 0
        lengths = [len(p) - 1 for p in prompts]  # cached tokens per active row (host mirror)
        while rows:
            proposal = drafter.propose(state) if drafter is not None else root_only(state)
            out = runner.verify(proposal.tokens, proposal.parents)
            host_sampling = sampling.select(rows)
            result = verify(
                out.logits,
                proposal.tokens,
                proposal.parents,
                draft_probs=proposal.draft_probs,
                temperature=state.temperature,
                top_k=state.top_k,
                top_p=state.top_p,
                seed=step_seeds(host_sampling.seed, rows, step).to(model.device),
                validate=model.device.type != "cuda",
            )
            runner.cache.compact(
                result.accepted_nodes, result.num_accepted, validate=model.device.type != "cuda"
            )
            path = proposal.tokens.gather(1, result.accepted_nodes.clamp(min=0).long())
            drafted = (proposal.parents >= 0).sum(dim=1)
            offered_depth = out.depths.max(dim=1).values
            # The only device-to-host read of a step: the path, the next token, the path length
            # and the tree's size and depth (for the statistics).
            host = torch.cat(
                [
                    path,
                    result.next_tokens[:, None],
                    result.num_accepted[:, None].long(),
                    drafted[:, None],
                    offered_depth[:, None],
                ],
                dim=1,
            ).cpu()
            now = time.perf_counter()
            emitted, finished = [], []
            for r, row in enumerate(rows):
                next_token, accepted, num_drafted, depth = host[r, -4:].tolist()
                candidates = host[r, 1 : accepted + 1].tolist() + [next_token]
                taken, reason = rule.take(generated[row], candidates)
                lengths[r] += accepted + 1
                if reason is None and lengths[r] + num_nodes > capacity:
                    reason = "cache"
                emitted.append(taken)
                seq_stats = stats.sequences[row]
                seq_stats.record_step(depth, num_drafted, accepted)
                seq_stats.record_emission(len(taken), now, start)
                state.tokens[r].extend(taken)
                if on_tokens is not None:
                    on_tokens(row, taken)
                if reason is not None:
                    seq_stats.finish_reason = reason
                    finished.append(r)
            if drafter is not None:
                drafter.update(
                    state,
                    StepOutcome(
                        proposal=proposal,
                        accepted_nodes=result.accepted_nodes,
                        num_accepted=result.num_accepted,
                        next_tokens=result.next_tokens,
                        emitted=emitted,
                        hidden=out.hidden_states,
                    ),
                )
            step += 1
            if finished:
                keep = [r for r in range(len(rows)) if r not in set(finished)]
                rows = [rows[r] for r in keep]
                lengths = [lengths[r] for r in keep]
                if not rows:
                    break
                keep_index = torch.tensor(keep, dtype=torch.int64, device=model.device)
                runner.keep(keep_index)
                state = _select_state(state, keep, keep_index)
                if drafter is not None:
                    drafter.keep(keep_index)
        if drafter is not None:
            drafter.end()
    if model.device.type == "cuda":
        stats.peak_memory_bytes = torch.cuda.max_memory_allocated(model.device)
    stats.wall_time = time.perf_counter() - start
    sequences = [
        torch.tensor(p + g, dtype=torch.int64) for p, g in zip(prompts, generated, strict=True)
    ]
    return GenerateOutput(sequences, stats)


def _select_state(state: DraftState, keep: list[int], keep_index: torch.Tensor) -> DraftState:
    return DraftState(
        tokens=[state.tokens[r] for r in keep],
        temperature=state.temperature[keep_index],
        top_k=state.top_k[keep_index],
        top_p=state.top_p[keep_index],
        seed=state.seed[keep_index],
        device=state.device,
        hidden={},
    )
