"""`generate`: speculative decoding of an HF causal LM, a drop-in for greedy or sampled generation.

`_decode` prefills the prompts, then runs `specdec_fast.step` until every row has finished: the
same step the serving scheduler runs (propose, verify, accept, compact, one read-back, emit,
drafter update), here with one lane (the drafter over every row) or none (plain decoding).

A proposal is checked before the target runs (`specdec_fast.drafters.checks`): its form on
the host, and, for drafters that do not declare `proposals_valid`, its values on the device, the
flags riding on the step's read-back; a malformed one raises `DrafterError` naming the drafter,
as does any exception of the drafter (`generate`'s lane raises what its drafter raised).

Rows that stop (EOS, a stop sequence, `max_new_tokens`, or a full cache) leave the batch, so they
cost nothing afterwards. The runner (compiled steps, CUDA graphs, cache storage) is kept on the
model between calls; the model's attention is switched for the call only, and restored on every
exit path, errors and interrupts included, for the target and the draft model alike.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import torch
from transformers import PreTrainedModel

from specdec_fast import graphs
from specdec_fast.arguments import check_generate_arguments
from specdec_fast.batch import SAMPLING_FIELDS, Batch, Row, TokenCallback, UnusableLogits
from specdec_fast.cache import model_shards
from specdec_fast.compiled import COMPILE_LOG, compile_choice
from specdec_fast.drafters.base import Drafter, fallbacks
from specdec_fast.parallel import check_agreement, check_tensor_parallel
from specdec_fast.requests import Sampling
from specdec_fast.runner import ModelRunner
from specdec_fast.stats import SpecStats
from specdec_fast.step import (
    Lane,
    drop,
    finish,
    first_unread,
    index_lanes,
    launch,
    queue_behind,
)


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
    stop: str | Sequence[int] | Sequence[Sequence[int] | str] | None = None,
    max_cache_len: int | None = None,
    tokenizer=None,
    on_tokens: TokenCallback | None = None,
    use_cuda_graphs: bool | None = None,
    compile: bool | None = None,
    exact: bool = False,
    read_ahead: bool | None = None,
) -> GenerateOutput:
    """Generate up to `max_new_tokens` tokens per sequence with speculative decoding.

    Greedy output (temperature 0) equals the target's own greedy decoding; sampled output has the
    target's distribution (temperature, then top-k, then top-p, per sequence).

    A target sharded over ranks (`specdec_fast.parallel.load_target`; every rank calls with the
    same arguments) runs eagerly (compile and CUDA graphs must be left unset or off), and each
    rank returns the whole output, checked to be every rank's (`parallel.check_agreement`).

    Args:
        model: an HF causal LM whose attention goes through `AttentionInterface`.
        input_ids: LongTensor [B, T] with `attention_mask` (left or right padding), or B token
            lists.
        drafter: a drafter (see `specdec_fast.drafters.base`); None decodes plainly through the
            same engine, the baseline every speed-up is measured against.
        max_new_tokens: an int >= 0.
        temperature, top_k, top_p, seed: scalars or one value per sequence; temperature 0 is
            greedy (else >= 2**-126), top_k 0 and top_p 1.0 are off, the rules `verify` applies
            (`kernels.validation.SAMPLING_RULES`). seed: any int (hashed per row); None draws one
            from torch's generator.
        eos_token_id: int or list; None uses `model.generation_config.eos_token_id`.
        stop: stop sequences, each token ids or a string; a flat list of ints is one sequence.
            A string is tokenized with `tokenizer` (`encode(text, add_special_tokens=False)`)
            and matches where the generated tokens contain exactly those tokens (text that
            tokenizes differently in context does not match); without a tokenizer a string is
            refused.
        max_cache_len: KV capacity per sequence; default: longest prompt + max_new_tokens, at
            most the model's `max_position_embeddings`. A sequence whose cache fills up stops
            with finish reason "cache", with the tokens plain decoding gives it (the storage
            holds one tree more, whose nodes past the capacity are never kept).
        tokenizer: the model's tokenizer, for string stops.
        on_tokens: called as `on_tokens(sequence_index, new_tokens)` whenever tokens are accepted
            (streaming); ITL statistics are measured at these moments.
        use_cuda_graphs: capture the target's verify steps and the drafter's device steps (draft
            loops, updates, tree steps) as CUDA graphs (default: on for CUDA models;
            `specdec_fast.graphs`).
        compile: run the model's forwards through `torch.compile` (default: `SPECDEC_COMPILE`,
            on). Each new step shape compiles once per process; the compiled steps are kept on
            the model for later calls (`ModelRunner.for_model`). The drafter's own models and
            steps (a draft model's, PARD's, a DFlash head's) follow the same choice.
        exact: make every target forward batch-invariant (`specdec_fast.exact`): each token's
            logits are then the same bits whether it is verified in a tree or decoded alone, at
            any batch size, so speculative output equals plain output of this mode bit for bit
            in any dtype. Runs eagerly (compile and CUDA graphs must be left unset or off);
            costs speed (docs/ARCHITECTURE.md, "Exact mode").
        read_ahead: queue each step before reading the step before, so the device never waits
            on the host between steps (default: on for CUDA models; a CPU has nothing to
            overlap): plain decoding, and drafters that read ahead (`Drafter.reads_ahead`:
            draft models, Medusa, EAGLE-1/2/3, DFlash and PARD), which follow each step
            from its device outcome; the others read every step. A row that stops then has
            made one step too many, which is dropped: the output is the same either way.

    Raises:
        TypeError, ValueError: naming the argument, the expected form and the value given, before
            anything is allocated (`specdec_fast.arguments`): prompt tokens outside the
            vocabulary, prompts beyond the model's positions, a KV cache larger than the
            device's memory, sampling parameters out of range, ...
        DrafterError: the drafter proposed a malformed tree (`specdec_fast.drafters.checks`).
        UnusableLogits: the target's logits of a sequence were NaN or infinite (a float16 model
            whose activations overflow), naming the sequence.
        RuntimeError: another thread is running `generate` on the same model.
    """
    start = time.perf_counter()
    sharded = model_shards(model) > 1
    if sharded:
        # A tensor-parallel target (`specdec_fast.parallel`) runs eagerly.
        check_tensor_parallel(
            model, drafter, compile=compile, use_cuda_graphs=use_cuda_graphs, exact=exact
        )
        compile = use_cuda_graphs = False
    arguments = check_generate_arguments(
        model,
        input_ids,
        drafter=drafter,
        max_new_tokens=max_new_tokens,
        attention_mask=attention_mask,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        eos_token_id=eos_token_id,
        stop=stop,
        max_cache_len=max_cache_len,
        tokenizer=tokenizer,
        on_tokens=on_tokens,
        use_cuda_graphs=use_cuda_graphs,
        compile=compile,
        exact=exact,
        read_ahead=read_ahead,
    )
    if read_ahead is None:
        read_ahead = model.device.type == "cuda"
    prompts, capacity = arguments.prompts, arguments.capacity
    sampling = arguments.sampling
    rows = [
        Row(
            list(prompt),
            arguments.rule,
            Sampling(*(getattr(sampling, name)[r : r + 1] for name in SAMPLING_FIELDS)),
            start,
            None if on_tokens is None else partial(on_tokens, r),
        )
        for r, prompt in enumerate(prompts)
    ]
    stats = SpecStats(
        sequences=[row.stats for row in rows],
        drafter=repr(drafter) if drafter is not None else None,
        memory_device=model.device.type,
    )
    if max_new_tokens > 0:
        if model.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(model.device)
        # Storage in whole blocks: calls of similar lengths then reuse one cache layout, so
        # compiled steps and CUDA graphs carry over; the stop rule still uses `capacity`.
        runner = ModelRunner.for_model(
            model,
            arguments.storage,
            use_cuda_graphs=use_cuda_graphs,
            compile=compile,
            exact=exact,
        )
        compiled_before = len(COMPILE_LOG)
        try:
            batch = Batch(model.device, capacity, arguments.max_nodes)
            _decode(runner, drafter, rows, batch, compile, read_ahead)
            stats.compiled = dict(COMPILE_LOG[compiled_before:])
        finally:
            try:
                if drafter is not None:
                    drafter.end()
            finally:
                runner.close()
        if drafter is not None:
            stats.fallbacks = fallbacks(drafter)
        if model.device.type == "cuda":
            stats.peak_memory_bytes = torch.cuda.max_memory_allocated(model.device)
    stats.wall_time = time.perf_counter() - start
    sequences = [
        torch.tensor(p + g, dtype=torch.int64)
        for p, g in zip(prompts, (row.generated for row in rows), strict=True)
    ]
    if sharded:
        check_agreement(sequences, model.device)
    return GenerateOutput(sequences, stats)


def _decode(
    runner: ModelRunner,
    drafter: Drafter | None,
    rows: list[Row],
    batch: Batch,
    compile: bool | None,
    read_ahead: bool,
) -> None:
    """Prefill `rows`, then steps until every row has finished. The drafter attaches under the
    call's compile and CUDA-graph choices (its own models and steps follow the target's). With
    `read_ahead`, and no drafter or one that reads ahead (`Drafter.reads_ahead`), each step is
    queued before the one before it is read (`step.queue_behind`), while no row can stop for
    its cache; rows that stop leave after the queued step is read."""
    if drafter is not None:
        with compile_choice(compile), graphs.choice(runner.use_cuda_graphs):
            drafter.attach(runner.model, batch.slots)
        runner.capture_hidden(drafter.hidden_layers)
    vocab = runner.model.config.get_text_config(decoder=True).vocab_size
    ids, mask = _pad_prompts([row.tokens for row in rows], runner.device)
    prefill = runner.prefill(ids, mask)
    batch.join(rows, prefill.root_tokens)
    lanes = []
    if drafter is not None:
        lane = Lane(drafter)
        lane.rows = list(rows)
        lanes.append(lane)
        index_lanes(batch, lanes)
        state = batch.state(lane.rows, lane.index)
        state.hidden = prefill.hidden_states
        drafter.begin(state)
    unread = first_unread(lanes, read_ahead)
    queued = None
    while batch:
        launched = queued or launch(runner, batch, lanes, vocab, unread)
        queued = queue_behind(runner, batch, lanes, vocab, launched)
        ahead_slots = queued.proposal.num_nodes if queued else 0
        report = finish(runner, batch, launched, vocab, ahead_slots)
        finished = report.finished
        if finished and queued is not None:
            # The queued step ran for the finished rows too: read it before they leave.
            finished = sorted(finished + finish(runner, batch, queued, vocab).finished)
            queued = None
        for row in drop(runner, batch, lanes, finished):
            if row.error is not None:
                raise UnusableLogits(f"sequence {rows.index(row)}: {row.error}")
