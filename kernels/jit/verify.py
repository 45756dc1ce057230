"""Triton kernels of `verify`: per-slice vocabulary statistics, then a per-sequence tree walk.

Launch 1, `verify_stats_kernel`, grid (row blocks, vocabulary slices): one pass over each slice of
each node's logits, writing per (row, slice) the raw max and its first argmax, the sum of
exp((l - max) / T) (when needed), the Gumbel-max race winner over the unfiltered target
(token, logit, noise) and a flag for NaN/+inf. Nothing of size V is written.

Launch 2, `verify_walk_kernel`, grid (sequence blocks, race slices): merges the slices of the
node it stands on and walks the tree from the root. The expensive cases stay exact with passes
over one row of V for just the node that needs them: top-k/top-p thresholds (a multiway
bisection on the logits' order-preserving integer keys, counting tokens and mass above
NUM_THRESHOLDS candidate keys per pass), a race restricted to the kept tokens when the
unfiltered winner was cut, and the race over max(0, p - q) at a rejected chain node. That last
race can be split over the vocabulary: every program of a sequence walks the same (cheap) path,
races its own slice, and the last to arrive (an atomic counter that launch 1 zeroes) merges the
slices' winners and writes the outputs.

Both kernels handle blocks of rows/sequences (BLOCK_R / BLOCK_B) so the launcher can use one row
per program on a GPU and many per program under the interpreter; every per-row decision is a
mask, and loops over V run only when some row of the block needs them.

Cost: greedy rows, deterministic drafts without filters and fully accepted chains never pass
over V in the walk. A rejected chain node costs one pass over its row (per element a hash, three
logs and an exp), spread over the race slices (at B1 on an H200, 126 programs of 1024 tokens:
bench/NOTES.md has the estimate; at B32, slices of `verify_race_tiles` tiles, 32 of 4 by
default, where 9 programs of 14 tiles each raced before); top-k/top-p cost about 8 passes per
bisection per visited node, in one program per sequence. Every race-slice program walks the
chain again, so that walk is made cheap: without filters a chain's accepted prefix is decided
for all nodes in one round of loads (`_accepted_prefix`), not one round per accepted node.
"""

import triton
import triton.language as tl

from .rng import gumbel, stream_key, uniform

# Fields of the statistics workspace, fp32 [NUM_FIELDS, B * N, num_splits].
FIELD_MAX = tl.constexpr(0)  # max raw logit of the slice (-inf when empty)
FIELD_ARGMAX = tl.constexpr(1)  # its first index (token ids are exact in fp32 below 2**24)
FIELD_SUMEXP = tl.constexpr(2)  # sum of exp((l - FIELD_MAX) * inv_t)
FIELD_RACE_TOKEN = tl.constexpr(3)  # race winner, -1 when the slice raced nothing
FIELD_RACE_LOGIT = tl.constexpr(4)  # its raw logit
FIELD_RACE_NOISE = tl.constexpr(5)  # its Gumbel noise
FIELD_BAD = tl.constexpr(6)  # 1 when the slice holds NaN or +inf
NUM_FIELDS = 7

STREAM_SAMPLE = tl.constexpr(0)
STREAM_ACCEPT = tl.constexpr(1)
KEY_BELOW_ALL = tl.constexpr(-(2**31) - 1)  # an int64 key below every int32 key


@triton.jit
def _per_sequence(ptr, stride, value, seqs, mask, DTYPE: tl.constexpr, PER_SEQUENCE: tl.constexpr):
    """`ptr[seqs * stride]` where `mask` when the parameter is a tensor, else `value` broadcast;
    as DTYPE."""
    if PER_SEQUENCE:
        result = tl.load(ptr + seqs * stride, mask=mask, other=0).to(DTYPE)
    else:
        result = (tl.zeros(seqs.shape, DTYPE) + value).to(DTYPE)
    return result


@triton.jit
def _stream_sequence(seqs, SEED_PER_SEQUENCE: tl.constexpr):
    """The sequence part of the random-stream key: the batch index under a shared int seed, 0
    under per-sequence seeds (a sequence's numbers then follow its seed, not its batch slot)."""
    return seqs * 0 if SEED_PER_SEQUENCE else seqs


@triton.jit
def _node_key(seed_ptr, node_stride, seed, seqs, stream_seqs, node, mask, stream,
              SEED_PER_NODE: tl.constexpr):  # fmt: skip
    """uint32 key of `node`'s random stream `stream`: from (seed, sequence, node), or with
    per-node seeds (`seed_ptr` int64 [B, N], rows at `seqs`) from the node's own seed alone."""
    if SEED_PER_NODE:
        node_seed = tl.load(seed_ptr + node * node_stride, mask=mask, other=0).to(tl.int64)
        key = stream_key(node_seed, node * 0, node * 0, stream)
    else:
        key = stream_key(seed, stream_seqs, node, stream)
    return key


@triton.jit
def _inverse_temperature(temperature, sampling):
    """1 / T, correctly rounded like torch's division, and 1 for greedy rows (never used)."""
    return tl.where(sampling, tl.math.div_rn(1.0, tl.where(sampling, temperature, 1.0)), 1.0)


@triton.jit
def _order_key(logit):
    """int32 key with the order of the fp32 values (-0.0 and 0.0 share a key)."""
    bits = logit.to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return tl.where(logit == 0.0, 0, key)


@triton.jit
def _load_chunk(row_ptr, stride_v, v0, end, rows_mask, BLOCK_V: tl.constexpr):
    """Vocabulary ids `[BLOCK_V]` from v0, their mask `[R, BLOCK_V]` (rows_mask and < end) and
    the fp32 logits of each row there (-inf where masked)."""
    cols = v0 + tl.arange(0, BLOCK_V)
    mask = rows_mask[:, None] & (cols < end)[None, :]
    logit = tl.load(row_ptr[:, None] + cols[None, :] * stride_v, mask=mask, other=float("-inf"))
    return cols, mask, logit.to(tl.float32)


@triton.jit
def verify_stats_kernel(
    logits_ptr,
    parents_ptr,
    temperature_ptr,
    seed_ptr,
    stats_ptr,
    arrivals_ptr,
    temperature_value,
    seed_value,
    num_rows,
    num_nodes,
    vocab,
    slice_len,
    stride_lb,
    stride_ln,
    stride_lv,
    stride_pb,
    stride_pn,
    stride_temperature,
    stride_seed,
    stride_seed_node,
    stride_sf,
    stride_sr,
    TEMPERATURE_PER_SEQUENCE: tl.constexpr,
    SEED_PER_SEQUENCE: tl.constexpr,
    SEED_PER_NODE: tl.constexpr,
    ALL_GREEDY: tl.constexpr,
    NEED_SUMEXP: tl.constexpr,
    RACE_LEAVES_ONLY: tl.constexpr,
    ZERO_ARRIVALS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Grid: (row blocks, vocabulary slices). ZERO_ARRIVALS: the root rows' first slice also
    zeroes the walk's arrival counters (int32 [B] at `arrivals_ptr`), so launch 2 finds them at
    0 on every call and every graph replay."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    split = tl.program_id(1).to(tl.int64)
    in_range = rows < num_rows
    seqs = rows // num_nodes
    nodes = rows % num_nodes
    parent = tl.load(parents_ptr + seqs * stride_pb + nodes * stride_pn, mask=in_range, other=-2)
    live = in_range & (parent != -2)
    start = split * slice_len
    end = tl.minimum(start + slice_len, vocab)
    row_ptr = logits_ptr + seqs * stride_lb + nodes * stride_ln

    temperature = _per_sequence(
        temperature_ptr,
        stride_temperature,
        temperature_value,
        seqs,
        live,
        tl.float32,
        TEMPERATURE_PER_SEQUENCE,
    )
    sampling = live & (temperature > 0)
    inv_t = _inverse_temperature(temperature, sampling)
    racing = sampling
    if RACE_LEAVES_ONLY:
        # Chains with draft probabilities need a sample from p only at the last node.
        others = tl.arange(0, BLOCK_N)
        other_parents = tl.load(
            parents_ptr + seqs[:, None] * stride_pb + others[None, :] * stride_pn,
            mask=live[:, None] & (others[None, :] < num_nodes),
            other=-2,
        )
        has_child = tl.max((other_parents == nodes[:, None]).to(tl.int32), axis=1) > 0
        racing = sampling & ~has_child
    seed = _per_sequence(seed_ptr, stride_seed, seed_value, seqs, live, tl.int64, SEED_PER_SEQUENCE)
    key = _node_key(
        seed_ptr + seqs * stride_seed,
        stride_seed_node,
        seed,
        seqs,
        _stream_sequence(seqs, SEED_PER_SEQUENCE),
        nodes,
        live,
        STREAM_SAMPLE,
        SEED_PER_NODE,
    )
    any_sampling = tl.max(sampling.to(tl.int32), axis=0) > 0
    any_racing = tl.max(racing.to(tl.int32), axis=0) > 0

    run_max = tl.full((BLOCK_R,), float("-inf"), tl.float32)
    run_arg = tl.zeros((BLOCK_R,), tl.int32)
    run_sum = tl.zeros((BLOCK_R,), tl.float32)
    bad = tl.zeros((BLOCK_R,), tl.int32)
    best_token = tl.full((BLOCK_R,), -1, tl.int32)
    best_logit = tl.full((BLOCK_R,), float("-inf"), tl.float32)
    best_noise = tl.zeros((BLOCK_R,), tl.float32)
    for v0 in range(start, end, BLOCK_V):
        cols, mask, logit = _load_chunk(row_ptr, stride_lv, v0, end, live, BLOCK_V)
        is_nan = logit != logit
        bad = tl.maximum(bad, tl.max((is_nan | (logit == float("inf"))).to(tl.int32), axis=1))
        logit = tl.where(is_nan, float("-inf"), logit)
        chunk_max = tl.max(logit, axis=1)
        chunk_arg = (tl.argmax(logit, axis=1) + v0).to(tl.int32)
        run_arg = tl.where(chunk_max > run_max, chunk_arg, run_arg)
        new_max = tl.maximum(run_max, chunk_max)
        if not ALL_GREEDY:
            if NEED_SUMEXP and any_sampling:
                shift = tl.where(new_max == float("-inf"), 0.0, new_max)
                run_sum = run_sum * tl.exp((run_max - shift) * inv_t) + tl.sum(
                    tl.exp((logit - shift[:, None]) * inv_t[:, None]), axis=1
                )
            if any_racing:
                noise = gumbel(key[:, None], cols[None, :])
                shift = tl.where(chunk_max == float("-inf"), 0.0, chunk_max)
                race = (logit - shift[:, None]) * inv_t[:, None] + noise
                race = tl.where(mask & racing[:, None], race, float("-inf"))
                winner = (tl.argmax(race, axis=1) + v0).to(tl.int32)
                won = cols[None, :] == winner[:, None]
                won_logit = tl.max(tl.where(won, logit, float("-inf")), axis=1)
                won_noise = tl.max(tl.where(won, noise, float("-inf")), axis=1)
                # Compare with the running winner through the logit difference, free of any shift.
                raced = best_token >= 0
                gain = tl.where(
                    raced, (won_logit - tl.where(raced, best_logit, 0.0)) * inv_t, float("inf")
                )
                better = (tl.max(race, axis=1) > float("-inf")) & (gain > best_noise - won_noise)
                best_token = tl.where(better, winner, best_token)
                best_logit = tl.where(better, won_logit, best_logit)
                best_noise = tl.where(better, won_noise, best_noise)
        run_max = new_max

    if ZERO_ARRIVALS:
        tl.store(
            arrivals_ptr + seqs,
            tl.zeros((BLOCK_R,), tl.int32),
            mask=in_range & (nodes == 0) & (split == 0),
        )
    out = stats_ptr + rows * stride_sr + split
    tl.store(out + FIELD_MAX * stride_sf, run_max, mask=in_range)
    tl.store(out + FIELD_ARGMAX * stride_sf, run_arg.to(tl.float32), mask=in_range)
    tl.store(out + FIELD_SUMEXP * stride_sf, run_sum, mask=in_range)
    tl.store(out + FIELD_RACE_TOKEN * stride_sf, best_token.to(tl.float32), mask=in_range)
    tl.store(out + FIELD_RACE_LOGIT * stride_sf, best_logit, mask=in_range)
    tl.store(out + FIELD_RACE_NOISE * stride_sf, best_noise, mask=in_range)
    tl.store(out + FIELD_BAD * stride_sf, bad.to(tl.float32), mask=in_range)


@triton.jit
def _node_stats(stats_ptr, stride_sf, stride_sr, rows, active, inv_t, num_splits, BLOCK_S):
    """Merge the slices of one row per sequence: (max, argmax, sum of exp((l - max) * inv_t),
    race winner token or -1, its logit). The max is 0 for inactive rows, so no lane makes NaN."""
    splits = tl.arange(0, BLOCK_S)
    mask = active[:, None] & (splits < num_splits)[None, :]
    base = stats_ptr + rows[:, None] * stride_sr + splits[None, :]
    slice_max = tl.load(base + FIELD_MAX * stride_sf, mask=mask, other=float("-inf"))
    slice_arg = tl.load(base + FIELD_ARGMAX * stride_sf, mask=mask, other=0.0).to(tl.int32)
    slice_sum = tl.load(base + FIELD_SUMEXP * stride_sf, mask=mask, other=0.0)
    race_token = tl.load(base + FIELD_RACE_TOKEN * stride_sf, mask=mask, other=-1.0).to(tl.int32)
    race_logit = tl.load(base + FIELD_RACE_LOGIT * stride_sf, mask=mask, other=float("-inf"))
    race_noise = tl.load(base + FIELD_RACE_NOISE * stride_sf, mask=mask, other=0.0)

    row_max = tl.max(slice_max, axis=1)
    # Slices cover increasing token ranges: the first slice holding the max has the first argmax.
    first = tl.argmax(slice_max, axis=1)
    argmax = tl.sum(tl.where(splits[None, :] == first[:, None], slice_arg, 0), axis=1)
    shift = tl.where(row_max == float("-inf"), 0.0, row_max)
    sumexp = tl.sum(slice_sum * tl.exp((slice_max - shift[:, None]) * inv_t[:, None]), axis=1)
    race = tl.where(
        race_token >= 0, (race_logit - shift[:, None]) * inv_t[:, None] + race_noise, float("-inf")
    )
    won = splits[None, :] == tl.argmax(race, axis=1)[:, None]
    winner = tl.max(tl.where(won, race_token, -1), axis=1)
    winner_logit = tl.max(tl.where(won, race_logit, float("-inf")), axis=1)
    return shift, argmax, sumexp, winner, winner_logit


@triton.jit
def _bisect_key(
    row_ptr,
    stride_v,
    vocab,
    row_max,
    inv_t,
    low,
    low_mass,
    high,
    limit,
    by_count,
    need,
    BLOCK_V: tl.constexpr,
    NUM_THRESHOLDS: tl.constexpr,
):
    """Smallest int32 key t in (low, high] with stat(key > t) < limit, per row where `need`.

    stat is the count of tokens (`by_count`) or their mass exp((l - row_max) * inv_t). `low`
    (int64) must fail the test and `high` pass it. Each pass over the row tests NUM_THRESHOLDS
    evenly spaced keys, so a 2**32 range takes about 32 / log2(NUM_THRESHOLDS + 1) passes.
    Returns (t, mass of the tokens with key >= t).
    """
    steps = tl.arange(0, NUM_THRESHOLDS).to(tl.int64) + 1
    high = high.to(tl.int64)
    searching = need & (high - low > 1)
    while tl.max(searching.to(tl.int32), axis=0) > 0:
        thresholds = low[:, None] + steps[None, :] * (high - low)[:, None] // (NUM_THRESHOLDS + 1)
        thresholds32 = thresholds.to(tl.int32)
        count = tl.zeros(thresholds.shape, tl.float32)
        mass = tl.zeros(thresholds.shape, tl.float32)
        for v0 in range(0, vocab, BLOCK_V):
            cols, mask, logit = _load_chunk(row_ptr, stride_v, v0, vocab, searching, BLOCK_V)
            weight = tl.exp((logit - row_max[:, None]) * inv_t[:, None])
            above = (_order_key(logit)[:, :, None] > thresholds32[:, None, :]) & mask[:, :, None]
            count += tl.sum(above.to(tl.float32), axis=1)
            mass += tl.sum(tl.where(above, weight[:, :, None], 0.0), axis=1)
        passes = tl.where(by_count[:, None], count, mass) < limit[:, None]
        new_high = tl.min(tl.where(passes, thresholds, high[:, None]), axis=1)
        new_low = tl.max(tl.where(passes, low[:, None], thresholds), axis=1)
        # Mass only shrinks as the threshold rises: the highest failing one has the least.
        new_low_mass = tl.min(tl.where(passes, float("inf"), mass), axis=1)
        moved_low = new_low > low
        low_mass = tl.where(searching & moved_low, new_low_mass, low_mass)
        low = tl.where(searching, new_low, low)
        high = tl.where(searching, new_high, high)
        searching = need & (high - low > 1)
    return high.to(tl.int32), low_mass


@triton.jit
def _filter_threshold(
    row_ptr,
    stride_v,
    vocab,
    row_max,
    inv_t,
    sumexp,
    top_k,
    top_p,
    need,
    BLOCK_V: tl.constexpr,
    NUM_THRESHOLDS: tl.constexpr,
):
    """Key threshold of the top-k then top-p kept set (key >= threshold) and its mass."""
    max_key = _order_key(row_max)
    below_all = tl.zeros(row_max.shape, tl.int64) + KEY_BELOW_ALL
    by_k = need & (top_k > 0) & (top_k < vocab)
    k_key, k_mass = _bisect_key(
        row_ptr,
        stride_v,
        vocab,
        row_max,
        inv_t,
        below_all,
        sumexp,
        max_key,
        top_k.to(tl.float32),
        by_k,
        by_k,
        BLOCK_V,
        NUM_THRESHOLDS,
    )
    k_key = tl.where(by_k, k_key, KEY_BELOW_ALL + 1)
    k_mass = tl.where(by_k, k_mass, sumexp)
    by_p = need & (top_p < 1.0)
    p_key, p_mass = _bisect_key(
        row_ptr,
        stride_v,
        vocab,
        row_max,
        inv_t,
        k_key.to(tl.int64) - 1,
        k_mass,
        max_key,
        top_p * k_mass,
        tl.zeros(by_p.shape, tl.int1),
        by_p,
        BLOCK_V,
        NUM_THRESHOLDS,
    )
    return tl.where(by_p, p_key, k_key), tl.where(by_p, p_mass, k_mass)


@triton.jit
def _race_pass(
    row_ptr,
    stride_v,
    draft_ptr,
    stride_dv,
    lo,
    hi,
    row_max,
    inv_t,
    threshold,
    kept_mass,
    key,
    need,
    minus_draft,
    BLOCK_V: tl.constexpr,
):
    """Gumbel-max over the vocabulary ids [lo, hi) of one row per sequence where `need`: the kept
    tokens (key >= threshold) of the target p, or, where `minus_draft`, max(0, p - q) with q read
    at `draft_ptr`.

    Returns (the winning race value, -inf when nothing has positive weight; the winning token,
    the first on ties, -1 when nothing has positive weight).
    """
    best = tl.full(row_max.shape, float("-inf"), tl.float32)
    best_token = tl.full(row_max.shape, -1, tl.int32)
    end = tl.where(tl.max(need.to(tl.int32), axis=0) > 0, hi, lo)
    for v0 in range(lo, end, BLOCK_V):
        cols, mask, logit = _load_chunk(row_ptr, stride_v, v0, hi, need, BLOCK_V)
        kept = mask & (_order_key(logit) >= threshold[:, None])
        scaled = tl.where(kept, (logit - row_max[:, None]) * inv_t[:, None], float("-inf"))
        draft = tl.load(
            draft_ptr[:, None] + cols[None, :] * stride_dv,
            mask=mask & minus_draft[:, None],
            other=0.0,
        ).to(tl.float32)
        residual = tl.exp(scaled) / kept_mass[:, None] - draft
        log_weight = tl.where(
            minus_draft[:, None],
            tl.where(residual > 0, tl.log(tl.where(residual > 0, residual, 1.0)), float("-inf")),
            scaled,
        )
        race = log_weight + gumbel(key[:, None], cols[None, :])
        chunk_best = tl.max(race, axis=1)
        better = chunk_best > best
        best_token = tl.where(better, (tl.argmax(race, axis=1) + v0).to(tl.int32), best_token)
        best = tl.maximum(best, chunk_best)
    return best, best_token


@triton.jit
def _node_distribution(
    stats_ptr,
    stride_sf,
    stride_sr,
    rows,
    row_ptr,
    stride_v,
    vocab,
    active,
    inv_t,
    num_splits,
    top_k,
    top_p,
    filtered,
    HAS_FILTERS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    SEARCH_BLOCK_V: tl.constexpr,
    NUM_THRESHOLDS: tl.constexpr,
):
    """The target distribution at one node per sequence (`rows` of the workspace, logits at
    `row_ptr`): (shifted max, argmax, unfiltered race winner and its logit, key threshold of the
    kept set, and its mass, 1 where there is none)."""
    row_max, argmax, sumexp, race_token, race_logit = _node_stats(
        stats_ptr, stride_sf, stride_sr, rows, active, inv_t, num_splits, BLOCK_S
    )
    threshold = tl.full(row_max.shape, KEY_BELOW_ALL + 1, tl.int32)
    kept_mass = sumexp
    if HAS_FILTERS:
        threshold, kept_mass = _filter_threshold(
            row_ptr,
            stride_v,
            vocab,
            row_max,
            inv_t,
            sumexp,
            top_k,
            top_p,
            active & filtered,
            SEARCH_BLOCK_V,
            NUM_THRESHOLDS,
        )
    kept_mass = tl.where(kept_mass > 0, kept_mass, 1.0)  # greedy and inactive rows
    return row_max, argmax, race_token, race_logit, threshold, kept_mass


@triton.jit
def _own_sample(
    row_ptr,
    stride_v,
    vocab,
    row_max,
    inv_t,
    threshold,
    kept_mass,
    key,
    wants_sample,
    sampling,
    argmax,
    race_token,
    race_logit,
    BLOCK_V: tl.constexpr,
):
    """A node's own sample y: the argmax for greedy rows; for sampling rows the unfiltered race
    winner when the filters kept it, else (one pass, where `wants_sample`) a race over the kept
    tokens."""
    winner_kept = (race_token >= 0) & (_order_key(race_logit) >= threshold)
    _, raced = _race_pass(
        row_ptr,
        stride_v,
        row_ptr,
        stride_v,
        0,
        vocab,
        row_max,
        inv_t,
        threshold,
        kept_mass,
        key,
        wants_sample & ~winner_kept,
        tl.zeros(wants_sample.shape, tl.int1),
        BLOCK_V,
    )
    return tl.where(sampling, tl.where(winner_kept, race_token, raced), argmax)


@triton.jit
def _flat(values, BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr):
    """`[BLOCK_B]` per-sequence values repeated per node, flattened to `[BLOCK_B * BLOCK_N]`."""
    return tl.reshape(tl.broadcast_to(values[:, None], (BLOCK_B, BLOCK_N)), (BLOCK_B * BLOCK_N,))


@triton.jit
def _accepted_prefix(
    logits_ptr,
    draft_probs_ptr,
    seed_ptr,
    stats_ptr,
    seqs,
    parents,
    tokens,
    real,
    active,
    sampling,
    inv_t,
    seed,
    stream_seqs,
    num_nodes,
    vocab,
    num_splits,
    stride_lb,
    stride_ln,
    stride_lv,
    stride_db,
    stride_dn,
    stride_dv,
    stride_seed,
    stride_seed_node,
    stride_sf,
    stride_sr,
    SEED_PER_NODE: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """The walk's accepted prefix of a chain with draft probabilities and no filters, decided for
    every node at once: (node the walk stops at, its depth, the path `[BLOCK_B, BLOCK_N]`).

    Each node's decision is the walk's own (the same statistics merge, acceptance test u * q(x)
    < p(x) with the same random numbers, greedy rows' argmax match), computed for all nodes in
    one round of loads instead of one round per accepted node; the walk then only follows the
    decisions in registers, and the main loop runs from the stopping node (it decides there
    again, alike, and emits). So a sequence's latency no longer grows with its accepted length.
    """
    nodes = tl.arange(0, BLOCK_N)
    flat_nodes = tl.reshape(
        tl.broadcast_to(nodes[None, :], (BLOCK_B, BLOCK_N)), (BLOCK_B * BLOCK_N,)
    )
    flat_seqs = _flat(seqs, BLOCK_B, BLOCK_N)
    flat_active = _flat(active, BLOCK_B, BLOCK_N)
    flat_sampling = _flat(sampling, BLOCK_B, BLOCK_N)
    flat_inv_t = _flat(inv_t, BLOCK_B, BLOCK_N)
    # Each node's first child (the walk's `first_child`), among the real later nodes.
    is_child = (
        real[:, None, :]
        & (parents[:, None, :] == nodes[None, :, None])
        & (nodes[None, None, :] > nodes[None, :, None])
    )
    first_child = tl.min(tl.where(is_child, nodes[None, None, :], BLOCK_N), axis=2)
    child_token = tl.sum(
        tl.where(nodes[None, None, :] == first_child[:, :, None], tokens[:, None, :], 0), axis=2
    )
    first_child = tl.reshape(first_child, (BLOCK_B * BLOCK_N,))
    draft = tl.reshape(child_token, (BLOCK_B * BLOCK_N,))
    node_live = flat_active & tl.reshape(real, (BLOCK_B * BLOCK_N,))
    row_max, argmax, sumexp, _, _ = _node_stats(
        stats_ptr,
        stride_sf,
        stride_sr,
        flat_seqs * num_nodes + flat_nodes,
        node_live,
        flat_inv_t,
        num_splits,
        BLOCK_S,
    )
    kept_mass = tl.where(sumexp > 0, sumexp, 1.0)
    has_child = node_live & (first_child < BLOCK_N)
    chain = has_child & flat_sampling
    draft_ok = chain & (draft >= 0) & (draft < vocab)
    row_ptr = logits_ptr + flat_seqs * stride_lb + flat_nodes * stride_ln
    draft_logit = tl.load(row_ptr + draft * stride_lv, mask=draft_ok, other=float("-inf"))
    draft_logit = draft_logit.to(tl.float32)
    # No filters: every token is kept (the walk's threshold is below every key).
    p_draft = tl.exp((draft_logit - row_max) * flat_inv_t) / kept_mass
    child_probs_ptr = draft_probs_ptr + flat_seqs * stride_db + first_child * stride_dn
    q_draft = tl.load(child_probs_ptr + draft * stride_dv, mask=draft_ok, other=1.0)
    accept_key = _node_key(
        seed_ptr + flat_seqs * stride_seed, stride_seed_node, _flat(seed, BLOCK_B, BLOCK_N),
        flat_seqs, _flat(stream_seqs, BLOCK_B, BLOCK_N), first_child, chain, STREAM_ACCEPT,
        SEED_PER_NODE,
    )  # fmt: skip
    u = uniform(accept_key, first_child * 0)
    chain_accept = draft_ok & (u * q_draft.to(tl.float32) < p_draft)
    # Greedy rows advance to the first child holding the argmax.
    greedy_match = (
        real[:, None, :]
        & (parents[:, None, :] == nodes[None, :, None])
        & (nodes[None, None, :] > nodes[None, :, None])
        & (tokens[:, None, :] == tl.reshape(argmax, (BLOCK_B, BLOCK_N))[:, :, None])
    )
    matched = tl.reshape(
        tl.min(tl.where(greedy_match, nodes[None, None, :], BLOCK_N), axis=2),
        (BLOCK_B * BLOCK_N,),
    )
    advance = node_live & tl.where(chain, chain_accept, ~flat_sampling & (matched < BLOCK_N))
    child = tl.where(chain, first_child, matched)
    advance = tl.reshape(advance, (BLOCK_B, BLOCK_N))
    child = tl.reshape(child, (BLOCK_B, BLOCK_N))

    current = tl.zeros((BLOCK_B,), tl.int32)
    depth = tl.zeros((BLOCK_B,), tl.int32)
    path = tl.where(nodes[None, :] == 0, 0, tl.full((BLOCK_B, BLOCK_N), -1, tl.int32))
    here = nodes[None, :] == current[:, None]
    going = active & (tl.max(tl.where(here, advance.to(tl.int32), 0), axis=1) > 0)
    while tl.max(going.to(tl.int32), axis=0) > 0:
        step = tl.sum(tl.where(here, child, 0), axis=1)
        depth += going.to(tl.int32)
        path = tl.where(going[:, None] & (nodes[None, :] == depth[:, None]), step[:, None], path)
        current = tl.where(going, step, current)
        here = nodes[None, :] == current[:, None]
        going = going & (tl.max(tl.where(here, advance.to(tl.int32), 0), axis=1) > 0)
    return current, depth, path


@triton.jit
def verify_walk_kernel(
    logits_ptr,
    tokens_ptr,
    parents_ptr,
    draft_probs_ptr,
    temperature_ptr,
    top_k_ptr,
    top_p_ptr,
    seed_ptr,
    stats_ptr,
    race_ptr,
    arrivals_ptr,
    accepted_ptr,
    num_accepted_ptr,
    next_tokens_ptr,
    temperature_value,
    top_k_value,
    top_p_value,
    seed_value,
    batch,
    num_nodes,
    vocab,
    num_splits,
    race_splits,
    race_slice_len,
    stride_lb,
    stride_ln,
    stride_lv,
    stride_tb,
    stride_tn,
    stride_pb,
    stride_pn,
    stride_db,
    stride_dn,
    stride_dv,
    stride_temperature,
    stride_top_k,
    stride_top_p,
    stride_seed,
    stride_seed_node,
    stride_sf,
    stride_sr,
    stride_rf,
    stride_rs,
    stride_ab,
    stride_an,
    TEMPERATURE_PER_SEQUENCE: tl.constexpr,
    TOP_K_PER_SEQUENCE: tl.constexpr,
    TOP_P_PER_SEQUENCE: tl.constexpr,
    SEED_PER_SEQUENCE: tl.constexpr,
    SEED_PER_NODE: tl.constexpr,
    HAS_FILTERS: tl.constexpr,
    HAS_DRAFT_PROBS: tl.constexpr,
    SPLIT_RACE: tl.constexpr,
    CHAIN_PARALLEL: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_RS: tl.constexpr,
    BLOCK_V: tl.constexpr,
    SEARCH_BLOCK_V: tl.constexpr,
    NUM_THRESHOLDS: tl.constexpr,
):
    """Grid: (sequence blocks, race_splits). Every program of a sequence block walks its trees
    the same way; with SPLIT_RACE program s races the residual max(0, p - q) of a rejected chain
    node over its own slice of the vocabulary ([s, s + 1) x race_slice_len), publishes its winner
    in `race_ptr` (fp32 [2, race_splits, B]: value, token) and counts itself in `arrivals_ptr`
    (int32 [B], zeroed by launch 1). The last program of a sequence to arrive merges the slices
    (the highest value, the lowest slice on ties: the same winner as one pass over the row) and
    alone writes the outputs."""
    seqs = tl.program_id(0).to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B)
    seq_ok = seqs < batch
    nodes = tl.arange(0, BLOCK_N)
    tree_mask = seq_ok[:, None] & (nodes < num_nodes)[None, :]
    parents = tl.load(
        parents_ptr + seqs[:, None] * stride_pb + nodes[None, :] * stride_pn,
        mask=tree_mask,
        other=-2,
    ).to(tl.int32)
    tokens = tl.load(
        tokens_ptr + seqs[:, None] * stride_tb + nodes[None, :] * stride_tn,
        mask=tree_mask,
        other=-1,
    ).to(tl.int32)
    real = parents != -2

    temperature = _per_sequence(
        temperature_ptr,
        stride_temperature,
        temperature_value,
        seqs,
        seq_ok,
        tl.float32,
        TEMPERATURE_PER_SEQUENCE,
    )
    top_k = _per_sequence(
        top_k_ptr, stride_top_k, top_k_value, seqs, seq_ok, tl.int64, TOP_K_PER_SEQUENCE
    )
    top_p = _per_sequence(
        top_p_ptr, stride_top_p, top_p_value, seqs, seq_ok, tl.float32, TOP_P_PER_SEQUENCE
    )
    seed = _per_sequence(
        seed_ptr, stride_seed, seed_value, seqs, seq_ok, tl.int64, SEED_PER_SEQUENCE
    )
    stream_seqs = _stream_sequence(seqs, SEED_PER_SEQUENCE)
    sampling = temperature > 0
    inv_t = _inverse_temperature(temperature, sampling)
    filtered = sampling & ((top_k > 0) | (top_p < 1.0))

    # A sequence with any unusable row (NaN, +inf, all -inf) emits nothing but -1.
    splits = tl.arange(0, BLOCK_S)
    rows = seqs[:, None] * num_nodes + nodes[None, :]
    cell = stats_ptr + rows[:, :, None] * stride_sr + splits[None, None, :]
    cell_mask = real[:, :, None] & (splits < num_splits)[None, None, :]
    slice_bad = tl.load(cell + FIELD_BAD * stride_sf, mask=cell_mask, other=0.0)
    slice_max = tl.load(cell + FIELD_MAX * stride_sf, mask=cell_mask, other=float("-inf"))
    row_bad = (tl.max(slice_bad, axis=2) > 0) | (tl.max(slice_max, axis=2) == float("-inf"))
    active = seq_ok & (tl.max((real & row_bad).to(tl.int32), axis=1) == 0)

    next_tokens = tl.full((BLOCK_B,), -1, tl.int64)
    if CHAIN_PARALLEL:
        current, depth, path = _accepted_prefix(
            logits_ptr,
            draft_probs_ptr,
            seed_ptr,
            stats_ptr,
            seqs,
            parents,
            tokens,
            real,
            active,
            sampling,
            inv_t,
            seed,
            stream_seqs,
            num_nodes,
            vocab,
            num_splits,
            stride_lb,
            stride_ln,
            stride_lv,
            stride_db,
            stride_dn,
            stride_dv,
            stride_seed,
            stride_seed_node,
            stride_sf,
            stride_sr,
            SEED_PER_NODE,
            BLOCK_B,
            BLOCK_N,
            BLOCK_S,
        )
    else:
        current = tl.zeros((BLOCK_B,), tl.int32)
        depth = tl.zeros((BLOCK_B,), tl.int32)
        path = tl.where(nodes[None, :] == 0, 0, tl.full((BLOCK_B, BLOCK_N), -1, tl.int32))
    race_lo = tl.program_id(1) * race_slice_len
    race_hi = tl.minimum(race_lo + race_slice_len, vocab)
    # SPLIT_RACE: the rejected chain nodes whose residual this program raced over its slice.
    pending = tl.zeros((BLOCK_B,), tl.int1)
    pending_best = tl.full((BLOCK_B,), float("-inf"), tl.float32)
    pending_token = tl.full((BLOCK_B,), -1, tl.int32)
    while tl.max(active.to(tl.int32), axis=0) > 0:
        row_ptr = logits_ptr + seqs * stride_lb + current * stride_ln
        row_max, argmax, race_token, race_logit, threshold, kept_mass = _node_distribution(
            stats_ptr,
            stride_sf,
            stride_sr,
            seqs * num_nodes + current,
            row_ptr,
            stride_lv,
            vocab,
            active,
            inv_t,
            num_splits,
            top_k,
            top_p,
            filtered,
            HAS_FILTERS,
            BLOCK_S,
            SEARCH_BLOCK_V,
            NUM_THRESHOLDS,
        )
        children = real & (parents == current[:, None]) & (nodes[None, :] > current[:, None])
        seed_row = seed_ptr + seqs * stride_seed
        sample_key = _node_key(
            seed_row, stride_seed_node, seed, seqs, stream_seqs, current, seq_ok, STREAM_SAMPLE,
            SEED_PER_NODE,
        )  # fmt: skip

        chain = tl.zeros((BLOCK_B,), tl.int1)
        chain_accept = tl.zeros((BLOCK_B,), tl.int1)
        first_child = tl.min(tl.where(children, nodes[None, :], BLOCK_N), axis=1)
        residual_token = tl.full((BLOCK_B,), -1, tl.int32)
        if HAS_DRAFT_PROBS:
            # Classic speculative sampling on the one child: accept iff u * q(x) < p(x).
            chain = active & sampling & (first_child < BLOCK_N)
            draft = tl.sum(tl.where(nodes[None, :] == first_child[:, None], tokens, 0), axis=1)
            draft_ok = chain & (draft >= 0) & (draft < vocab)
            draft_logit = tl.load(
                row_ptr + draft * stride_lv, mask=draft_ok, other=float("-inf")
            ).to(tl.float32)
            p_draft = tl.where(
                _order_key(draft_logit) >= threshold,
                tl.exp((draft_logit - row_max) * inv_t) / kept_mass,
                0.0,
            )
            child_probs_ptr = draft_probs_ptr + seqs * stride_db + first_child * stride_dn
            q_draft = tl.load(child_probs_ptr + draft * stride_dv, mask=draft_ok, other=1.0)
            accept_key = _node_key(
                seed_row, stride_seed_node, seed, seqs, stream_seqs, first_child, chain,
                STREAM_ACCEPT, SEED_PER_NODE,
            )  # fmt: skip
            u = uniform(accept_key, first_child * 0)
            chain_accept = draft_ok & (u * q_draft.to(tl.float32) < p_draft)
            rejected = chain & ~chain_accept
            slice_best, residual_token = _race_pass(
                row_ptr,
                stride_lv,
                child_probs_ptr,
                stride_dv,
                race_lo,
                race_hi,
                row_max,
                inv_t,
                threshold,
                kept_mass,
                sample_key,
                rejected,
                chain,
                BLOCK_V,
            )
            if SPLIT_RACE:
                # The residual is known once every slice has arrived, after the walk; until
                # then a placeholder token (>= 0) stands for it.
                pending = pending | rejected
                pending_best = tl.where(rejected, slice_best, pending_best)
                pending_token = tl.where(rejected, residual_token, pending_token)
                residual_token = tl.where(rejected, 0, residual_token)

        # The node's own sample y: the argmax, or the unfiltered race winner when the filters
        # kept it, else a race over the kept tokens.
        wants_sample = active & sampling & (~chain | ((~chain_accept) & (residual_token < 0)))
        sample = _own_sample(
            row_ptr,
            stride_lv,
            vocab,
            row_max,
            inv_t,
            threshold,
            kept_mass,
            sample_key,
            wants_sample,
            sampling,
            argmax,
            race_token,
            race_logit,
            BLOCK_V,
        )

        matching = children & (tokens == sample[:, None])
        matched = tl.min(tl.where(matching, nodes[None, :], BLOCK_N), axis=1)
        advance = active & tl.where(chain, chain_accept, matched < BLOCK_N)
        child = tl.where(chain, first_child, matched)
        emit = tl.where(chain & (residual_token >= 0), residual_token, sample)
        stop = active & ~advance
        next_tokens = tl.where(stop, emit.to(tl.int64), next_tokens)
        depth += advance.to(tl.int32)
        path = tl.where(advance[:, None] & (nodes[None, :] == depth[:, None]), child[:, None], path)
        current = tl.where(advance, child, current)
        active = advance

    writes = seq_ok
    if SPLIT_RACE:
        slot = race_ptr + tl.program_id(1) * stride_rs + seqs
        tl.store(slot, pending_best, mask=seq_ok)
        tl.store(slot + stride_rf, pending_token.to(tl.float32), mask=seq_ok)
        # The barrier orders every thread's stores before the (one-thread) atomic, whose release
        # then publishes them; its acquire lets the last to arrive see every slice (read past
        # L1, which holds none of them anyway).
        tl.debug_barrier()
        arrived = tl.atomic_add(arrivals_ptr + seqs, 1, mask=seq_ok, sem="acq_rel")
        writes = seq_ok & (arrived == race_splits - 1)
        merging = writes & pending
        race_slices = tl.arange(0, BLOCK_RS)
        cells = race_ptr + race_slices[None, :] * stride_rs + seqs[:, None]
        cell_ok = merging[:, None] & (race_slices < race_splits)[None, :]
        slice_best = tl.load(cells, mask=cell_ok, other=float("-inf"), cache_modifier=".cg")
        slice_token = tl.load(cells + stride_rf, mask=cell_ok, other=-1.0, cache_modifier=".cg")
        won = race_slices[None, :] == tl.argmax(slice_best, axis=1)[:, None]
        residual_token = tl.max(tl.where(won, slice_token, -1.0), axis=1).to(tl.int32)
        residual_token = tl.where(tl.max(slice_best, axis=1) > float("-inf"), residual_token, -1)
        # Nothing of positive weight in the residual (p = q): the node's own sample, as above.
        fallback = merging & (residual_token < 0)
        row_ptr = logits_ptr + seqs * stride_lb + current * stride_ln
        row_max, argmax, race_token, race_logit, threshold, kept_mass = _node_distribution(
            stats_ptr,
            stride_sf,
            stride_sr,
            seqs * num_nodes + current,
            row_ptr,
            stride_lv,
            vocab,
            fallback,
            inv_t,
            num_splits,
            top_k,
            top_p,
            filtered,
            HAS_FILTERS,
            BLOCK_S,
            SEARCH_BLOCK_V,
            NUM_THRESHOLDS,
        )
        sample = _own_sample(
            row_ptr,
            stride_lv,
            vocab,
            row_max,
            inv_t,
            threshold,
            kept_mass,
            _node_key(
                seed_ptr + seqs * stride_seed,
                stride_seed_node,
                seed,
                seqs,
                stream_seqs,
                current,
                seq_ok,
                STREAM_SAMPLE,
                SEED_PER_NODE,
            ),  # fmt: skip
            fallback,
            sampling,
            argmax,
            race_token,
            race_logit,
            BLOCK_V,
        )
        emit = tl.where(residual_token >= 0, residual_token, sample)
        next_tokens = tl.where(merging, emit.to(tl.int64), next_tokens)

    tl.store(
        accepted_ptr + seqs[:, None] * stride_ab + nodes[None, :] * stride_an,
        path,
        mask=tree_mask & writes[:, None],
    )
    tl.store(num_accepted_ptr + seqs, depth, mask=writes)
    tl.store(next_tokens_ptr + seqs, next_tokens, mask=writes)
