"""Triton kernels of `tree_attention`: a split-KV attention pass and the split combine.

Rows of a program are the query heads of one GQA group times the new tokens, token-major
(row r is token `r // GROUP`, query head `kv_head * GROUP + r % GROUP`), so each K/V tile is read
once for the whole group. The scores live in the log2 domain (`qk_scale` includes log2(e)).

Positions (for the sliding window): query row of new token i sits at `cache_len + depth_i`
(depth_i = i when causal); prefix slot k holds position k; new slot `cache_len + j` holds position
`cache_len + depth_j`. Since depth_j <= j, a key's position never exceeds its slot, so no slot below
the earliest visible position is ever needed: the kernel starts its tile loops there.
"""

import triton
import triton.language as tl

# Finite start for the running max: a row that has seen only masked keys keeps l == 0 without
# producing inf - inf = NaN in the rescale factor.
NEG_BIG = tl.constexpr(-1.0e30)
LOG2_E = tl.constexpr(1.4426950408889634)
# Below this |x|, tanh's Taylor series (through x^11) beats the exp form, which cancels near 0.
TANH_SERIES_BOUND = tl.constexpr(0.4)


@triton.jit
def _tanh(x):
    """tanh of fp32 `x` to about 3 ulp, from a polynomial and exp2 only.

    libdevice's tanh is an extern call that the Triton interpreter cannot run, and not every
    Triton has `tl.tanh`; this form runs the same compiled and interpreted.
    """
    magnitude = tl.abs(x)
    # Horner form of t - t^3/3 + 2t^5/15 - 17t^7/315 + 62t^9/2835 - 1382t^11/155925, on |x|
    # clamped to the series' range: beyond it the series is unused and must not overflow.
    t = tl.minimum(magnitude, TANH_SERIES_BOUND)
    t2 = t * t
    series = 0.021869488536155203 - 0.008863235529902197 * t2
    series = -0.05396825396825397 + series * t2
    series = 0.13333333333333333 + series * t2
    series = -0.3333333333333333 + series * t2
    series = t + t * t2 * series
    # (1 - e^{-2|x|}) / (1 + e^{-2|x|}): the exponent is never positive, so nothing overflows.
    decay = tl.exp2(-2.0 * LOG2_E * magnitude)
    away = (1.0 - decay) / (1.0 + decay)
    value = tl.where(magnitude < TANH_SERIES_BOUND, series, away)
    return tl.where(x < 0.0, -value, value)


@triton.jit
def _attend_tile(
    acc,
    m_i,
    l_i,
    q,
    k_tile_ptrs,
    v_tile_ptrs,
    load_mask,
    visible,
    qk_scale,
    softcap_log2,
    APPLY_MASK: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
):
    """Online-softmax update of (acc, m_i, l_i) by one K/V tile; `visible`: [BLOCK_M, BLOCK_N].

    With HAS_SOFTCAP the scaled scores s become `c * tanh(s / c)` before the mask, as in HF's
    Gemma2 eager attention; `softcap_log2` is c * log2(e), c carried into the log2 domain.
    """
    if load_mask is None:
        k = tl.load(k_tile_ptrs)
        v = tl.load(v_tile_ptrs)
    else:
        k = tl.load(k_tile_ptrs, mask=load_mask, other=0.0)
        v = tl.load(v_tile_ptrs, mask=load_mask, other=0.0)
    if DOT_UPCAST:
        k = k.to(tl.float32)
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    if HAS_SOFTCAP:
        scores = softcap_log2 * _tanh(scores * (1.0 / softcap_log2))
    if APPLY_MASK:
        scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    # P is rounded to the dtype of V as on tensor cores, also when the dot itself is upcast.
    p_low = p.to(v.dtype)
    if DOT_UPCAST:
        p_low = p_low.to(tl.float32)
        v = v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p_low, v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def tree_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    cache_lens_ptr,
    q_lens_ptr,
    mask_ptr,
    depths_ptr,
    part_out_ptr,
    part_lse_ptr,
    stride_qb,
    stride_qh,
    stride_qn,
    stride_kb,
    stride_kh,
    stride_kl,
    stride_vb,
    stride_vh,
    stride_vl,
    stride_ob,
    stride_oh,
    stride_on,
    stride_mb,
    stride_mi,
    stride_mw,
    stride_db,
    stride_dn,
    batch,
    num_kv_heads,
    num_new,
    capacity,
    num_splits,
    qk_scale,
    softcap_log2,
    window,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IS_TREE: tl.constexpr,
    MASK_WORDS: tl.constexpr,
    HAS_Q_LENS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    WRITE_PARTIAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
):
    """Grid: (row blocks * num_splits, B * Hkv); program (m, s) covers rows block m, split s.

    Split s attends to its share of the committed prefix's whole tiles; the last split also
    attends to the partial tile and the new tokens under the causal or tree mask. With one split
    the result goes straight to `out`; otherwise the normalized partial output (in the
    workspace's dtype) and its fp32 log2-sum-exp go to the workspace.
    HAS_WINDOW: row r sees positions above `q_pos_r - window`; the loops start at the block's
    earliest visible slot (splits share only the visible tiles) and mask per row from there on.
    Tree rows and keys take their depths from `depths_ptr` (int32 [B, N]).
    HAS_SOFTCAP: scores are soft-capped at `softcap_log2` (see `_attend_tile`).
    DOT_UPCAST feeds the dots fp32 operands: the Triton interpreter computes bf16 dots wrongly.
    """
    # Only the batch/head offsets can outgrow int32; row blocks and splits are small counts.
    pid_split_rows = tl.program_id(0)
    pid_batch_head = tl.program_id(1).to(tl.int64)
    num_row_blocks = tl.cdiv(GROUP * num_new, BLOCK_M)
    row_block = pid_split_rows % num_row_blocks
    split = pid_split_rows // num_row_blocks
    b = pid_batch_head // num_kv_heads
    kv_head = pid_batch_head % num_kv_heads

    # Clamped so that bad lengths (unchecked under graph capture) still read inside the cache.
    cache_len = tl.minimum(tl.maximum(tl.load(cache_lens_ptr + b), 0), capacity)
    q_len = tl.minimum(tl.maximum(tl.load(q_lens_ptr + b), 0), num_new) if HAS_Q_LENS else num_new

    rows = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
    token = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_exists = rows < GROUP * num_new
    row_live = row_exists & (token < q_len)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    offs_n = tl.arange(0, BLOCK_N)

    q_ptrs = q_ptr + b * stride_qb + head[:, None] * stride_qh + token[:, None] * stride_qn
    q = tl.load(q_ptrs + offs_d[None, :], mask=row_live[:, None] & d_ok[None, :], other=0.0)
    if DOT_UPCAST:
        q = q.to(tl.float32)
    k_base = k_ptr + b * stride_kb + kv_head * stride_kh + offs_d[None, :]
    v_base = v_ptr + b * stride_vb + kv_head * stride_vh + offs_d[None, :]

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    # A block made only of padding rows does no work (its rows are written as zeros below).
    block_live = row_block * BLOCK_M // GROUP < q_len

    # The window: row r sees key positions above row_floor[r]; no row of the block sees a slot
    # below first_slot (the least floor + 1 over the live rows), and none is read.
    first_slot = 0
    if HAS_WINDOW:
        if IS_TREE:
            depth = tl.load(depths_ptr + b * stride_db + token * stride_dn, mask=row_live, other=0)
        else:
            depth = token
        row_floor = cache_len + depth - window
        first_slot = tl.maximum(tl.min(tl.where(row_live, row_floor, capacity), 0) + 1, 0)

    # This split's share of the prefix's whole tiles from the first visible one on: without a
    # window every row sees them all, no mask needed. The last split's masked tiles (the
    # prefix's partial tile and the new tokens) count in the shares, so that it takes fewer
    # prefix tiles and ends with the others (at B1/L4096/N64 in 32-key tiles over 16 splits,
    # 8 + 2 tiles against 8 + 2 + 2 otherwise).
    full_tiles = cache_len // BLOCK_N
    first_tile = tl.minimum(first_slot // BLOCK_N, full_tiles)
    masked_keys = cache_len - full_tiles * BLOCK_N + tl.minimum(q_len, capacity - cache_len)
    tiles_per_split = tl.cdiv(full_tiles - first_tile + tl.cdiv(masked_keys, BLOCK_N), num_splits)
    lo = (first_tile + split * tiles_per_split) * BLOCK_N
    hi = tl.minimum(lo + tiles_per_split * BLOCK_N, full_tiles * BLOCK_N)
    hi = tl.where(block_live, tl.maximum(hi, lo), lo)
    full_tile_mask = None if BLOCK_D == HEAD_DIM else d_ok[None, :]
    for start in range(lo, hi, BLOCK_N):
        slots = start + offs_n
        if HAS_WINDOW:
            # The first tile may start below first_slot, on slots that may hold anything (NaN):
            # those columns read slot first_slot instead (no row sees them), so the loads stay
            # unmasked.
            tile_visible = slots[None, :] > row_floor[:, None]
            read_slots = tl.maximum(slots, first_slot)
        else:
            tile_visible = None
            read_slots = slots
        acc, m_i, l_i = _attend_tile(
            acc,
            m_i,
            l_i,
            q,
            k_base + read_slots[:, None] * stride_kl,
            v_base + read_slots[:, None] * stride_vl,
            full_tile_mask,
            tile_visible,
            qk_scale,
            softcap_log2,
            HAS_WINDOW,
            HAS_SOFTCAP,
            DOT_PRECISION,
            DOT_UPCAST,
        )

    # The last split also covers the prefix's partial tile and then the new tokens, under the
    # mask; new tokens count only below q_len (and causal rows never look past their block).
    new_hi = tl.minimum(q_len, capacity - cache_len)
    if not IS_TREE:
        new_hi = tl.minimum(new_hi, (row_block * BLOCK_M + BLOCK_M - 1) // GROUP + 1)
    masked_lo = full_tiles * BLOCK_N
    if HAS_WINDOW:
        masked_lo = tl.maximum(masked_lo, first_slot // BLOCK_N * BLOCK_N)
    masked_hi = tl.where((split == num_splits - 1) & block_live, cache_len + new_hi, masked_lo)
    if IS_TREE:
        # The rows' mask words (at most 4: N <= 128) stay in registers: gathering a
        # [BLOCK_M, BLOCK_N] tile of words per step would cost a pointer per element.
        mask_row = mask_ptr + b * stride_mb + token * stride_mi
        word0 = tl.load(mask_row, mask=row_exists, other=0)
        if MASK_WORDS > 1:
            word1 = tl.load(mask_row + stride_mw, mask=row_exists, other=0)
        if MASK_WORDS > 2:
            word2 = tl.load(mask_row + 2 * stride_mw, mask=row_exists, other=0)
        if MASK_WORDS > 3:
            word3 = tl.load(mask_row + 3 * stride_mw, mask=row_exists, other=0)
    # Not software-pipelined, which would double the shared memory: a tree (N <= 128) takes at
    # most three steps here; only a long causal prefill takes more (it is not the hot path).
    for start in tl.range(masked_lo, masked_hi, BLOCK_N, num_stages=1):
        slots = start + offs_n
        key_ok = slots < masked_hi
        new_token = tl.maximum(slots - cache_len, 0)
        is_new = slots >= cache_len
        if IS_TREE:
            word_index = (new_token // 32)[None, :]
            words = tl.where(word_index == 0, word0[:, None], 0)
            if MASK_WORDS > 1:
                words = tl.where(word_index == 1, word1[:, None], words)
            if MASK_WORDS > 2:
                words = tl.where(word_index == 2, word2[:, None], words)
            if MASK_WORDS > 3:
                words = tl.where(word_index == 3, word3[:, None], words)
            sees_new = ((words >> (new_token % 32)[None, :]) & 1) != 0
        else:
            sees_new = new_token[None, :] <= token[:, None]
        visible = (sees_new | ~is_new[None, :]) & key_ok[None, :]
        load_ok = key_ok
        if HAS_WINDOW:
            if IS_TREE:
                key_depth = tl.load(
                    depths_ptr + b * stride_db + new_token * stride_dn,
                    mask=is_new & key_ok,
                    other=0,
                )
                key_pos = tl.where(is_new, cache_len + key_depth, slots)
            else:
                key_pos = slots
            visible = visible & (key_pos[None, :] > row_floor[:, None])
            load_ok = key_ok & (slots >= first_slot)
        acc, m_i, l_i = _attend_tile(
            acc,
            m_i,
            l_i,
            q,
            k_base + slots[:, None] * stride_kl,
            v_base + slots[:, None] * stride_vl,
            load_ok[:, None] & d_ok[None, :],
            visible,
            qk_scale,
            softcap_log2,
            True,
            HAS_SOFTCAP,
            DOT_PRECISION,
            DOT_UPCAST,
        )

    seen = row_live & (l_i > 0.0)
    l_safe = tl.where(seen, l_i, 1.0)
    result = tl.where(seen[:, None], acc / l_safe[:, None], 0.0)
    store_mask = row_exists[:, None] & d_ok[None, :]
    if WRITE_PARTIAL:
        part_row = ((split * batch + b) * (num_kv_heads * GROUP) + head) * num_new + token
        part_ptrs = part_out_ptr + part_row[:, None] * HEAD_DIM + offs_d[None, :]
        tl.store(part_ptrs, result.to(part_out_ptr.dtype.element_ty), store_mask)
        lse = tl.where(seen, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(part_lse_ptr + part_row, lse, row_exists)
    else:
        out_ptrs = out_ptr + b * stride_ob + head[:, None] * stride_oh + token[:, None] * stride_on
        tl.store(out_ptrs + offs_d[None, :], result.to(out_ptr.dtype.element_ty), store_mask)


@triton.jit
def tree_attention_combine_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    stride_ob,
    stride_oh,
    stride_on,
    rows_per_split,
    num_q_heads,
    num_new,
    head_dim,
    num_splits,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Grid: (B * Hq, token blocks). Merge the splits' partial outputs weighted by their sums.

    Splits that saw nothing carry lse = -inf and weigh zero; a row no split saw becomes zeros.
    """
    pid_batch_head = tl.program_id(0).to(tl.int64)
    pid_tokens = tl.program_id(1)
    tokens = pid_tokens * BLOCK_T + tl.arange(0, BLOCK_T)
    token_ok = tokens < num_new
    offs_d = tl.arange(0, BLOCK_D)
    tile_mask = token_ok[:, None] & (offs_d < head_dim)[None, :]
    part_row = pid_batch_head * num_new + tokens

    lse_max = tl.full([BLOCK_T], float("-inf"), dtype=tl.float32)
    for split in range(num_splits):
        lse = tl.load(part_lse_ptr + split * rows_per_split + part_row, token_ok, float("-inf"))
        lse_max = tl.maximum(lse_max, lse)
    lse_ref = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    weight_sum = tl.zeros([BLOCK_T], dtype=tl.float32)
    for split in range(num_splits):
        row = split * rows_per_split + part_row
        weight = tl.exp2(tl.load(part_lse_ptr + row, token_ok, float("-inf")) - lse_ref)
        partial = tl.load(part_out_ptr + row[:, None] * head_dim + offs_d[None, :], tile_mask, 0.0)
        partial = partial.to(tl.float32)
        acc += weight[:, None] * partial
        weight_sum += weight
    result = tl.where(
        (weight_sum > 0.0)[:, None], acc / tl.maximum(weight_sum, 1e-30)[:, None], 0.0
    )
    b = pid_batch_head // num_q_heads
    head = pid_batch_head % num_q_heads
    out_ptrs = out_ptr + b * stride_ob + head * stride_oh + tokens[:, None] * stride_on
    tl.store(out_ptrs + offs_d[None, :], result.to(out_ptr.dtype.element_ty), tile_mask)
