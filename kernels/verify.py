"""Lossless verification sampling over draft trees: greedy, speculative sampling, top-k/top-p.

Public entry point: `verify` (validation, backend choice, launcher). The Triton kernels are in
`jit/verify.py` (random numbers in `jit/rng.py`), the plain-torch reference and the precise
semantics (ties, the acceptance rules, why they are lossless) in `reference/verify.py`.

Two launches per call for any batch: per-slice vocabulary statistics, then the tree walks (one
program per sequence, or several that split a rejected chain node's residual race over the
vocabulary). No softmax over the vocabulary is written to memory; random numbers come from a hash
of (seed, sequence, node, stream, counter), so a call with a seed tensor can be captured in a
CUDA graph and replayed, and the Triton kernels and the reference draw the same numbers.
"""

from dataclasses import dataclass

import torch
import triton

from . import interpreter_compat  # noqa: F401  (interpreted kernels need it before launch)
from .backend import backend_for, sm_count
from .configs import tuned_configs
from .fused.verify import verify_fused
from .jit.verify import NUM_FIELDS, verify_stats_kernel, verify_walk_kernel
from .ops import define_op
from .reference.verify import (
    VerifyResult,
    draw_seed,
    invalid_rows,
    verify_reference,
)
from .validation import (
    SAMPLING_RULES,
    check_sampling_scalar,
    check_tensor,
    is_int,
    raise_first_problem,
    sampling_values_valid,
    tree_problems,
    values_checkable,
)

LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)
MAX_NODES = 1024
# Token ids travel through the fp32 statistics workspace, exact below 2**24.
MAX_VOCAB = 2**24
# Candidate keys tested per pass of the top-k/top-p threshold search (17-way bisection, about
# 8 passes over the row); a power of two, as tl.arange requires.
NUM_THRESHOLDS = 16
# Vocabulary slices per row in the statistics launch, at most: the walk merges them in registers,
# and 128 of them spilled in the filtered chain walk at 255 registers.
MAX_STATS_SPLITS = 64
# Chains with draft probabilities and no filters of at most this many nodes decide every node's
# acceptance at once in the walk (`_accepted_prefix`: an N x N comparison per sequence in
# registers), not one node per round of loads.
MAX_PARALLEL_CHAIN = 16
# Walk tiles per slice of the split residual race that the tuning part may choose from
# (`configs.json`'s `verify_race_tiles`): B32's 9 slices of 14 tiles (the race spread only to
# two programs per SM) were the suspect of its 228 us on an H200.
RACE_TILE_CANDIDATES = (2, 4, 8, 16)
# Statistics programs per SM that the launcher aims for (`verify_stats_programs_per_sm`): at
# B32 4 gave 3 slices of 21 tiles per row, 2.2 waves of the 8-warp kernel (two per SM).
STATS_PROGRAMS_CANDIDATES = (4, 8, 16)


@dataclass(frozen=True)
class SamplingParams:
    """Per-sequence parameters as the kernels take them: a Python scalar or a `[B]` tensor."""

    temperature: float | torch.Tensor
    top_k: int | torch.Tensor
    top_p: float | torch.Tensor
    seed: int | torch.Tensor

    @property
    def all_greedy(self) -> bool:
        return not isinstance(self.temperature, torch.Tensor) and self.temperature == 0.0

    @property
    def has_filters(self) -> bool:
        """Whether any sequence may filter (tensors are not read, so they count as filtering)."""
        top_k_off = not isinstance(self.top_k, torch.Tensor) and self.top_k == 0
        top_p_off = not isinstance(self.top_p, torch.Tensor) and self.top_p == 1.0
        return not self.all_greedy and not (top_k_off and top_p_off)


def _param_tensor(name: str, value: torch.Tensor, batch: int, floating: bool, device) -> None:
    dtypes = (
        (torch.float32, torch.float64, torch.float16, torch.bfloat16) if floating else INDEX_DTYPES
    )
    check_tensor(name, value, shape=(batch,), dims="[B]", dtypes=dtypes, device=device)


def sampling_params(batch, num_nodes, device, temperature, top_k, top_p, seed) -> SamplingParams:
    """Scalars are checked here, tensors for shape, dtype and device (values: `_check_values`),
    both by the rules of `validation.SAMPLING_RULES`."""
    if temperature is None:
        temperature = 0.0
    if isinstance(temperature, torch.Tensor):
        _param_tensor("temperature", temperature, batch, True, device)
    else:
        temperature = check_sampling_scalar("temperature", temperature)
    if top_k is None:
        top_k = 0
    if isinstance(top_k, torch.Tensor):
        _param_tensor("top_k", top_k, batch, False, device)
    else:
        # >= V is off anyway; the clamp keeps the kernel argument in int32.
        top_k = min(check_sampling_scalar("top_k", top_k), 2**31 - 1)
    if top_p is None:
        top_p = 1.0
    if isinstance(top_p, torch.Tensor):
        _param_tensor("top_p", top_p, batch, True, device)
    else:
        top_p = check_sampling_scalar("top_p", top_p)
    if seed is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise ValueError(
                "seed: a CUDA graph would replay the seed drawn at capture; pass an int64 [B] "
                "tensor and update it between replays"
            )
        seed = draw_seed()
    if isinstance(seed, torch.Tensor):
        if seed.dim() == 2:
            check_tensor(
                "seed",
                seed,
                shape=(batch, num_nodes),
                dims="[B, N] (per-node seeds)",
                dtypes=(torch.int64,),
                device=device,
            )
        else:
            _param_tensor("seed", seed, batch, False, device)
    elif not is_int(seed) or not -(2**63) <= seed < 2**63:
        raise ValueError(
            f"seed: expected an int64, an int [B] tensor or an int64 [B, N] tensor, got {seed!r}"
        )
    else:
        seed = int(seed)
    return SamplingParams(temperature, top_k, top_p, seed)


def _check_shapes(logits, draft_tokens, parents, draft_probs) -> None:
    """Shape, dtype and device checks: free, so they always run."""
    check_tensor("logits", logits, shape=(-1, -1, -1), dims="[B, N, V]", dtypes=LOGIT_DTYPES)
    batch, num_nodes, vocab = logits.shape
    if not 1 <= num_nodes <= MAX_NODES:
        raise ValueError(f"logits: expected 1 <= N <= {MAX_NODES} nodes, got N = {num_nodes}")
    if not 1 <= vocab < MAX_VOCAB:
        raise ValueError(f"logits: expected 1 <= V < {MAX_VOCAB}, got V = {vocab}")
    for name, tensor in (("draft_tokens", draft_tokens), ("parents", parents)):
        check_tensor(
            name,
            tensor,
            shape=(batch, num_nodes),
            dims="[B, N]",
            dtypes=INDEX_DTYPES,
            device=logits.device,
        )
    if draft_probs is not None:
        check_tensor(
            "draft_probs",
            draft_probs,
            shape=tuple(logits.shape),
            dims="[B, N, V]",
            dtypes=LOGIT_DTYPES,
            device=logits.device,
        )


def _check_values(logits, draft_tokens, parents, draft_probs, params: SamplingParams) -> None:
    """Checks that read the trees and parameter tensors: one host read, more to word an error."""
    problems = tree_problems(draft_tokens, parents, logits.shape[2], draft_probs)
    for name in SAMPLING_RULES:
        values = getattr(params, name)
        if isinstance(values, torch.Tensor):
            problems.append(
                (
                    ~sampling_values_valid(name, values),
                    lambda b, name=name, values=values: (
                        f"{name}[{b}] = {values[b].item()}: expected {SAMPLING_RULES[name]}"
                    ),
                )
            )
    raise_first_problem(problems)


def _raise_for_invalid_rows(logits: torch.Tensor, parents: torch.Tensor) -> None:
    """ValueError naming the first (sequence, node) whose logits cannot be sampled."""
    bad = invalid_rows(logits.float(), parents)
    if not bool(bad.any()):
        raise ValueError("logits: a sequence could not be sampled (next_tokens = -1)")
    b, i = (int(index) for index in bad.nonzero()[0])
    row = logits[b, i].float()
    raise ValueError(
        f"logits[{b}, {i}]: expected finite values (-inf allowed, not everywhere), got "
        f"{int(torch.isnan(row).sum())} NaN, {int(torch.isposinf(row).sum())} +inf and "
        f"{int(torch.isneginf(row).sum())} -inf of V = {row.numel()}"
    )


@dataclass(frozen=True)
class LaunchConfig:
    """Tiles and grids of the two kernels for one problem shape."""

    block_v: int  # vocabulary tile of the statistics kernel
    block_rows: int  # node rows per statistics program
    num_splits: int  # vocabulary slices per row (statistics programs per row block)
    block_seqs: int  # sequences per walk program
    walk_block_v: int  # vocabulary tile of the walk's passes over one row
    search_block_v: int  # vocabulary tile of the threshold search (x NUM_THRESHOLDS keys)
    stats_warps: int = 4
    walk_warps: int = 4
    race_splits: int = 1  # vocabulary slices of a rejected chain node's residual race
    # ptxas's per-thread register cap for the walk (None: its own choice, which spilled up to
    # 200 bytes in the filtered chain walk even below 255 registers)
    walk_max_registers: int | None = None


def launch_config(
    batch: int, num_nodes: int, vocab: int, sm_count: int | None, split_residual: bool = False
) -> LaunchConfig:
    """On a GPU (`sm_count` SMs): one row per statistics program, and enough vocabulary slices
    per row for about `verify_stats_programs_per_sm` programs per SM (tuned; a B=1 chain still
    spreads its few rows over the whole
    GPU); one sequence per walk program and, with `split_residual` (chains with draft
    probabilities and no filters), the residual race of a rejected node split into slices of
    at most `verify_race_tiles` walk tiles and enough for two programs per SM; the walk on 8
    warps with ptxas allowed all 255 registers, 128 for the split chain walk (spill-free in
    every launch of bench/results/sm90_compile_table.md). Under the interpreter
    (`sm_count` None), where every program costs Python overhead: many rows and sequences per
    program, one slice."""
    rows = batch * num_nodes
    vocab_pow2 = triton.next_power_of_2(vocab)
    if sm_count is None:
        # Every interpreted operation (nested jit calls too) has a fixed Python cost: wide tiles.
        block_v = min(vocab_pow2, 4096)
        return LaunchConfig(
            block_v=block_v,
            block_rows=min(triton.next_power_of_2(rows), max(1, 16384 // block_v)),
            num_splits=1,
            block_seqs=min(triton.next_power_of_2(batch), 256),
            walk_block_v=min(vocab_pow2, 4096),
            search_block_v=min(vocab_pow2, 256),
        )
    block_v = min(vocab_pow2, 2048)
    block_rows = min(triton.next_power_of_2(rows), max(1, 2048 // block_v))
    row_programs = triton.cdiv(rows, block_rows)
    num_splits = min(
        triton.cdiv(vocab, block_v),
        triton.cdiv(tuned_configs()["verify_stats_programs_per_sm"] * sm_count, row_programs),
        MAX_STATS_SPLITS,
    )
    walk_block_v = min(vocab_pow2, 1024)
    race_splits = 1
    if split_residual:
        # Enough slices for two programs per SM, and at least enough that none races more than
        # the tuned number of walk tiles (each program's walk costs one round of loads).
        race_tiles = tuned_configs()["verify_race_tiles"]
        wanted = max(
            triton.cdiv(2 * sm_count, batch), triton.cdiv(vocab, race_tiles * walk_block_v)
        )
        race_splits = min(triton.cdiv(vocab, walk_block_v), wanted)
    return LaunchConfig(
        block_v=block_v,
        block_rows=block_rows,
        num_splits=max(1, num_splits),
        block_seqs=1,
        walk_block_v=walk_block_v,
        search_block_v=min(vocab_pow2, 128),
        stats_warps=8 if block_v * block_rows >= 2048 else 4,
        walk_warps=8,
        race_splits=max(1, race_splits),
        # The split chain walk (its accepted prefix decided at once) took 133-152 registers,
        # one program per SM; capped at 128 it holds two, spill-free (sm90_compile_table.md).
        walk_max_registers=128 if split_residual else 255,
    )


def _scalar_or_tensor(value, placeholder: torch.Tensor):
    """(pointer, stride, scalar, per-sequence flag) kernel arguments for one parameter."""
    if isinstance(value, torch.Tensor):
        return value, value.stride(0), 0, True
    return placeholder, 0, value, False


def launch_verify(
    logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    parents: torch.Tensor,
    draft_probs: torch.Tensor | None,
    params: SamplingParams,
    config: LaunchConfig | None = None,
) -> VerifyResult:
    """Run the two Triton kernels on validated arguments; `config` overrides the heuristic (tests
    use it to run GPU-like tilings under the interpreter)."""
    batch, num_nodes, vocab = logits.shape
    device = logits.device
    if config is None:
        split_residual = draft_probs is not None and not params.has_filters
        config = launch_config(batch, num_nodes, vocab, sm_count(device), split_residual)
    slice_len = triton.cdiv(triton.cdiv(vocab, config.num_splits), config.block_v) * config.block_v
    num_splits = triton.cdiv(vocab, slice_len)
    race_slice_len = config.walk_block_v * triton.cdiv(
        triton.cdiv(vocab, config.race_splits), config.walk_block_v
    )
    race_splits = triton.cdiv(vocab, race_slice_len)
    rows = batch * num_nodes
    stats = torch.empty((NUM_FIELDS, rows, num_splits), dtype=torch.float32, device=device)
    # The split residual race's winners per slice (value, token) and arrival counters.
    race = torch.empty((2, race_splits, batch), dtype=torch.float32, device=device)
    arrivals = torch.empty((batch,), dtype=torch.int32, device=device)
    accepted_nodes = torch.empty((batch, num_nodes), dtype=torch.int32, device=device)
    num_accepted = torch.empty((batch,), dtype=torch.int32, device=device)
    next_tokens = torch.empty((batch,), dtype=torch.int64, device=device)
    temperature = _scalar_or_tensor(params.temperature, parents)
    top_k = _scalar_or_tensor(params.top_k, parents)
    top_p = _scalar_or_tensor(params.top_p, parents)
    seed = _scalar_or_tensor(params.seed, parents)
    per_node_seeds = isinstance(params.seed, torch.Tensor) and params.seed.dim() == 2
    seed_node_stride = params.seed.stride(1) if per_node_seeds else 0
    block_n = triton.next_power_of_2(num_nodes)

    verify_stats_kernel[(triton.cdiv(rows, config.block_rows), num_splits)](
        logits,
        parents,
        temperature[0],
        seed[0],
        stats,
        arrivals,
        temperature[2],
        seed[2],
        rows,
        num_nodes,
        vocab,
        slice_len,
        *logits.stride(),
        *parents.stride(),
        temperature[1],
        seed[1],
        seed_node_stride,
        stats.stride(0),
        stats.stride(1),
        TEMPERATURE_PER_SEQUENCE=temperature[3],
        SEED_PER_SEQUENCE=seed[3],
        SEED_PER_NODE=per_node_seeds,
        ALL_GREEDY=params.all_greedy,
        NEED_SUMEXP=params.has_filters or draft_probs is not None,
        RACE_LEAVES_ONLY=draft_probs is not None,
        ZERO_ARRIVALS=race_splits > 1,
        BLOCK_R=config.block_rows,
        BLOCK_V=config.block_v,
        BLOCK_N=block_n,
        num_warps=config.stats_warps,
    )
    probs = logits if draft_probs is None else draft_probs
    verify_walk_kernel[(triton.cdiv(batch, config.block_seqs), race_splits)](
        logits,
        draft_tokens,
        parents,
        probs,
        temperature[0],
        top_k[0],
        top_p[0],
        seed[0],
        stats,
        race,
        arrivals,
        accepted_nodes,
        num_accepted,
        next_tokens,
        temperature[2],
        top_k[2],
        top_p[2],
        seed[2],
        batch,
        num_nodes,
        vocab,
        num_splits,
        race_splits,
        race_slice_len,
        *logits.stride(),
        *draft_tokens.stride(),
        *parents.stride(),
        *probs.stride(),
        temperature[1],
        top_k[1],
        top_p[1],
        seed[1],
        seed_node_stride,
        stats.stride(0),
        stats.stride(1),
        race.stride(0),
        race.stride(1),
        *accepted_nodes.stride(),
        TEMPERATURE_PER_SEQUENCE=temperature[3],
        TOP_K_PER_SEQUENCE=top_k[3],
        TOP_P_PER_SEQUENCE=top_p[3],
        SEED_PER_SEQUENCE=seed[3],
        SEED_PER_NODE=per_node_seeds,
        HAS_FILTERS=params.has_filters,
        HAS_DRAFT_PROBS=draft_probs is not None,
        SPLIT_RACE=race_splits > 1,
        CHAIN_PARALLEL=draft_probs is not None
        and not params.has_filters
        and num_nodes <= MAX_PARALLEL_CHAIN,
        BLOCK_B=config.block_seqs,
        BLOCK_N=block_n,
        BLOCK_S=triton.next_power_of_2(num_splits),
        BLOCK_RS=triton.next_power_of_2(race_splits),
        BLOCK_V=config.walk_block_v,
        SEARCH_BLOCK_V=config.search_block_v,
        NUM_THRESHOLDS=NUM_THRESHOLDS,
        num_warps=config.walk_warps,
        maxnreg=config.walk_max_registers,
    )
    return VerifyResult(accepted_nodes, num_accepted, next_tokens)


def flatten_params(params: SamplingParams) -> tuple:
    """`(tensor or None, scalar)` per parameter, in the order of the custom op's schema."""
    flat = []
    for value, default in (
        (params.temperature, 0.0),
        (params.top_k, 0),
        (params.top_p, 1.0),
        (params.seed, 0),
    ):
        tensor = isinstance(value, torch.Tensor)
        flat += [value if tensor else None, default if tensor else value]
    return tuple(flat)


def run_verify(
    logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    parents: torch.Tensor,
    draft_probs: torch.Tensor | None,
    params: SamplingParams,
) -> VerifyResult:
    """The backend's implementation (see `backend.py`) on arguments `verify` validated: what the
    custom op `specdec_fast::verify` runs, and what the engine calls once a step is validated."""
    backend = backend_for(logits.device)
    if backend == "triton" and logits.shape[0] > 0:
        return launch_verify(logits, draft_tokens, parents, draft_probs, params)
    implementation = verify_fused if backend == "fused" else verify_reference
    return implementation(
        logits,
        draft_tokens,
        parents,
        draft_probs,
        params.temperature,
        params.top_k,
        params.top_p,
        params.seed,
    )


def verify(
    logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    parents: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    temperature=None,
    top_k=None,
    top_p=None,
    seed=None,
    *,
    validate: bool = True,
) -> VerifyResult:
    """Verify B draft trees against the target's logits and choose the tokens to emit.

    Emitted tokens of sequence b: the draft tokens of `accepted_nodes[b, 1 : num_accepted[b] + 1]`,
    then `next_tokens[b]`. They are distributed exactly as sampling the (filtered) target one token
    at a time; greedy rows emit exactly the target's argmax path (the lowest token id among ties).

    Args:
        logits: `[B, N, V]` fp32, bf16 or fp16, any strides: the target's logits at each node (the
            distribution of that node's child). N <= 1024, V < 2**24.
        draft_tokens: int32/int64 `[B, N]`, the token of each node (entry 0, the root, unused).
        parents: int32/int64 `[B, N]`: -1 for node 0 (the root, the last token already chosen),
            `parents[b, i] < i` for the others (topological order), -2 for padded nodes, which
            are ignored. Chains have `parents[b, i] = i - 1`.
        draft_probs: optional `[B, N, V]` fp32/bf16/fp16, the draft distribution each node's token
            was sampled from (chains only): classic speculative sampling. Without it drafts are
            deterministic proposals (Medusa, EAGLE, n-gram and top-k trees).
        temperature: float or floating `[B]`; 0 (the default) is greedy. Greedy and sampling rows
            may be mixed.
        top_k: int or int `[B]`; 0 (the default) or >= V is off. Ties with the k-th logit are kept.
        top_p: float or floating `[B]` in (0, 1]; 1 (the default) is off. Filters apply after the
            temperature, top-k first (see `reference/verify.py` for the exact tie rule).
        seed: int or int32/int64 `[B]`; None draws one from torch's default generator (so
            `torch.manual_seed` fixes the outcome). Same inputs and seed give the same result on
            either backend up to float rounding at near-ties. An int seed is mixed with each
            sequence's batch index; a `[B]` seed alone keys its sequence's draws, which then do
            not depend on the batch slot (equal seeds on equal rows draw alike). An int64
            `[B, N]` seed keys each node by its own seed alone, whatever its index: the engine
            passes (row seed + the node's position), so a token sampled at a given position
            draws the same numbers in any tree, and sampled speculation with deterministic
            drafts emits exactly what plain sampling with the same seed emits. Reusing a seed
            reuses the random numbers: change it every step. Under CUDA graph capture pass a
            tensor and update it in place between replays.
        validate: read the trees, parameter tensors and (after the launch) the outcome to raise
            clear errors. That synchronizes a CUDA device, so the engine passes False; checks that
            read values are skipped during graph capture either way. With the checks off the
            kernels stay in bounds, and a sequence whose logits are unusable gets
            `next_tokens = -1`, never a token.

    Returns:
        VerifyResult(accepted_nodes int32 `[B, N]`, num_accepted int32 `[B]`, next_tokens int64
        `[B]`).

    Raises:
        ValueError: on shapes, dtypes, devices or parameters out of range; and, when validating,
        on parents that are not topological or do not have node 0 as the only root, draft tokens
        outside the vocabulary, draft_probs with a tree that is not a chain or with rows (of
        existing nodes after the root) that are not distributions (NaN, negative entries, or a
        sum off 1 by more than 1e-3 in fp32, 1e-2 in 16 bits), and logits rows (of existing
        nodes) with NaN, +inf or nothing but -inf.
    """
    _check_shapes(logits, draft_tokens, parents, draft_probs)
    batch = logits.shape[0]
    params = sampling_params(batch, logits.shape[1], logits.device, temperature, top_k, top_p, seed)
    checking = validate and values_checkable(logits)
    if checking and batch > 0:
        _check_values(logits, draft_tokens, parents, draft_probs, params)
    if torch.compiler.is_compiling():
        result = VerifyResult(
            *torch.ops.specdec_fast.verify(
                logits, draft_tokens, parents, draft_probs, *flatten_params(params)
            )
        )
    else:
        result = run_verify(logits, draft_tokens, parents, draft_probs, params)
    # Unusable logits rows are found by the pass that reads them, which marks the sequence with
    # next_tokens = -1: checking the outcome costs no second read of the logits.
    if checking and bool((result.next_tokens < 0).any()):
        _raise_for_invalid_rows(logits, parents)
    return result


def _verify_fake(logits: torch.Tensor, *args) -> tuple[torch.Tensor, ...]:
    batch, num_nodes = logits.shape[:2]
    return (
        logits.new_empty((batch, num_nodes), dtype=torch.int32),
        logits.new_empty((batch,), dtype=torch.int32),
        logits.new_empty((batch,), dtype=torch.int64),
    )


@define_op(
    "verify(Tensor logits, Tensor draft_tokens, Tensor parents, Tensor? draft_probs, "
    "Tensor? temperature, float temperature_value, Tensor? top_k, int top_k_value, "
    "Tensor? top_p, float top_p_value, Tensor? seed, int seed_value) "
    "-> (Tensor, Tensor, Tensor)",
    _verify_fake,
)
def verify_op(
    logits,
    draft_tokens,
    parents,
    draft_probs,
    temperature,
    temperature_value,
    top_k,
    top_k_value,
    top_p,
    top_p_value,
    seed,
    seed_value,
) -> tuple[torch.Tensor, ...]:
    """`specdec_fast::verify`: `run_verify` on the parameters `flatten_params` flattened."""
    params = SamplingParams(
        temperature_value if temperature is None else temperature,
        top_k_value if top_k is None else top_k,
        top_p_value if top_p is None else top_p,
        seed_value if seed is None else seed,
    )
    return tuple(run_verify(logits, draft_tokens, parents, draft_probs, params))
