"""`generate`: speculative decoding of an HF causal LM, a drop-in for greedy or sampled generation.

One step, for the rows still running (DESIGN.md, "Data flow of one step"), is the loop body of
`_decode`:

    proposal = drafter.propose(state)             tree [B, N]; the engine writes each row's root
    out      = runner.verify(tokens, parents)     target logits [B, N, V] in one (compiled) forward
    result   = kernels.verify(out.logits, ...)    accepted path + next token, lossless
    cache.compact(result)                         the cache keeps the prefix + the accepted path
    batch.emit(read back)                         the one blocking device-to-host read of a step
    drafter.update(state, outcome)
    batch.drop(finished)                          runner, state and drafter shrink together

Rows that stop (EOS, a stop sequence, `max_new_tokens`, or a full cache) leave the batch, so they
cost nothing afterwards. The runner (compiled steps, CUDA graphs, cache storage) is kept on the
model between calls; the model's attention is switched for the call only, and restored on every
exit path, errors and interrupts included, for the target and the draft model alike.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from specdec_fast.batch import Batch, TokenCallback
from specdec_fast.drafters.base import Drafter, StepOutcome
from specdec_fast.kernels.verify import run_verify
from specdec_fast.requests import Sampling, StopRule, check_token_ids, prompts_from_input
from specdec_fast.runner import COMPILE_LOG, ModelRunner
from specdec_fast.stats import SequenceStats, SpecStats

CACHE_BLOCK = 256


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
    compile: bool | None = None,
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
        compile: run the model's forwards through `torch.compile` (default: `SPECDEC_COMPILE`,
            on). Each new step shape compiles once per process; the compiled steps are kept on
            the model for later calls (`ModelRunner.for_model`).
    """
    start = time.perf_counter()
    prompts = prompts_from_input(input_ids, attention_mask)
    vocab_size = model.config.get_text_config(decoder=True).vocab_size
    check_token_ids(prompts, vocab_size)
    rule = StopRule(
        _default_eos(model) if eos_token_id is None else eos_token_id, stop, max_new_tokens
    )
    sampling = Sampling.build(len(prompts), temperature, top_k, top_p, seed)
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
    batch = Batch(
        prompts, sampling, rule, stats, model.device, capacity, num_nodes, start, on_tokens
    )
    if max_new_tokens > 0:
        if model.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(model.device)
        # Storage in whole blocks: calls of similar lengths then reuse one cache layout, so
        # compiled steps and CUDA graphs carry over; the stop rule still uses `capacity`.
        storage = -(-capacity // CACHE_BLOCK) * CACHE_BLOCK
        runner = ModelRunner.for_model(
            model, storage, use_cuda_graphs=use_cuda_graphs, compile=compile
        )
        compiled_before = len(COMPILE_LOG)
        try:
            _decode(runner, drafter, batch, capacity)
            stats.compiled = dict(COMPILE_LOG[compiled_before:])
        finally:
            try:
                if drafter is not None:
                    drafter.end()
            finally:
                runner.close()
        if model.device.type == "cuda":
            stats.peak_memory_bytes = torch.cuda.max_memory_allocated(model.device)
    stats.wall_time = time.perf_counter() - start
    sequences = [
        torch.tensor(p + g, dtype=torch.int64)
        for p, g in zip(prompts, batch.generated, strict=True)
    ]
    return GenerateOutput(sequences, stats)


def _decode(runner: ModelRunner, drafter: Drafter | None, batch: Batch, capacity: int) -> None:
    """Prefill, then speculative steps until every row of `batch` has finished."""
    if drafter is not None:
        drafter.attach(runner.model, capacity)
        runner.capture_hidden(drafter.hidden_layers)
    ids, mask = _pad_prompts(batch.state.tokens, runner.device)
    prefill = runner.prefill(ids, mask)
    batch.roots = prefill.root_tokens
    if drafter is not None:
        batch.state.hidden = prefill.hidden_states
        drafter.begin(batch.state)
        batch.state.hidden = {}
    while batch:
        if drafter is None:
            proposal = batch.plain_proposal()
        else:
            proposal = batch.with_roots(drafter.propose(batch.state), runner.use_cuda_graphs)
        out = runner.verify(proposal.tokens, proposal.parents)
        result = run_verify(
            out.logits,
            proposal.tokens,
            proposal.parents,
            proposal.draft_probs,
            batch.sampling_params(out.positions),
        )
        runner.cache.compact(result.accepted_nodes, result.num_accepted, validate=False)
        host = batch.read_back(proposal, result, out.depths)
        emitted, finished = batch.emit(host, time.perf_counter())
        runner.cache.bound_lengths(max(batch.lengths))
        if drafter is not None:
            outcome = StepOutcome(
                proposal, *result, emitted, out.hidden_states, host.nodes, host.drafted
            )
            drafter.update(batch.state, outcome)
        batch.roots = result.next_tokens
        batch.drop(finished, runner, drafter)
