"""KV-cache compaction: the accepted path's K/V move next to the committed prefix, in one launch.

Grid: axis 0 walks (layer, K or V, block of heads), axis 1 is the sequence. Every program copies
the accepted rows of its heads in chunks of BLOCK_T path positions; the kernel copies raw bits, so
the launcher hands it the cache viewed as integers of the element's width.
"""

import triton
import triton.language as tl


@triton.jit
def kv_compact_kernel(
    kv_ptr,
    cache_lens_ptr,
    accepted_nodes_ptr,
    num_accepted_ptr,
    num_heads,
    max_len,
    head_dim,
    programs_per_sequence,
    stride_kv_layer,
    stride_kv_kind,
    stride_kv_batch,
    stride_kv_head,
    stride_kv_slot,
    stride_kv_dim,
    stride_cache_lens,
    stride_accepted_batch,
    stride_accepted_node,
    stride_num_accepted,
    RANK_SHIFT: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    work = tl.program_id(0).to(tl.int64)
    batch = tl.program_id(1).to(tl.int64)
    num_head_blocks = tl.cdiv(num_heads, BLOCK_H)
    layer = work // (2 * num_head_blocks)
    kind = (work // num_head_blocks) % 2
    head_block = work % num_head_blocks

    num_accepted = tl.load(num_accepted_ptr + batch * stride_num_accepted)
    # cache_lens[b] is read and advanced in this same launch by every program of sequence b, in no
    # guaranteed order. Each program adds one unit above the length bits (2**RANK_SHIFT > Lmax) in
    # one atomic: the old value gives the committed length (low bits) and this program's arrival
    # rank (high bits). The last to arrive knows every other program has read the length, so it
    # alone writes the advanced length, and no program ever sees a partly updated one. Atomics on
    # one address are totally ordered and the final store depends on this program's own atomic,
    # so relaxed ordering suffices (no other memory is shared between programs) and lets the
    # loads around the atomic overlap it.
    ticket = tl.atomic_add(
        cache_lens_ptr + batch * stride_cache_lens, 1 << RANK_SHIFT, sem="relaxed"
    )
    cache_len = ticket & ((1 << RANK_SHIFT) - 1)
    arrival_rank = ticket >> RANK_SHIFT

    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    row_base = (
        kv_ptr
        + layer * stride_kv_layer
        + kind * stride_kv_kind
        + batch * stride_kv_batch
        + heads[:, None, None] * stride_kv_head
        + dims[None, None, :] * stride_kv_dim
    )
    lanes = (heads[:, None, None] < num_heads) & (dims[None, None, :] < head_dim)

    # Overlap safety. Path position t copies slot c + a[t] to slot c + t, and a is strictly
    # increasing from a[0] = 0, so a[t] >= t: every destination lies at or below its source.
    # Read-after-write: a chunk reads slots c + a[t] >= c + t >= c + (its first t), above every
    # slot that earlier chunks wrote, so no read ever sees this launch's writes (prefetching reads
    # early stays safe too). Write-after-read: a write to slot c + t may clobber the source of an
    # earlier position t' (a[t'] = t); if t' is in an earlier chunk its read finished before that
    # chunk's barrier, and if it is in this chunk the barrier between the gather and the scatter
    # orders every thread's reads before any thread's writes. Programs never share a
    # (layer, K/V, sequence, head) row, so no other program touches these slots.
    # t = 0 (the root onto itself) is always a no-op, hence the start at 1.
    chunk_start = 1
    while chunk_start <= num_accepted:
        steps = chunk_start + tl.arange(0, BLOCK_T)
        on_path = steps <= num_accepted
        nodes = tl.load(
            accepted_nodes_ptr + batch * stride_accepted_batch + steps * stride_accepted_node,
            mask=on_path,
            other=0,
        )
        source = cache_len + nodes
        target = cache_len + steps
        # Positions whose node already sits in place (a chain's accepted prefix) move nothing; the
        # slot bounds keep memory safe when the caller skipped validation.
        moves = on_path & (nodes != steps) & (source >= 0) & (source < max_len) & (target < max_len)
        mask = lanes & moves[None, :, None]
        rows = tl.load(
            row_base + source.to(tl.int64)[None, :, None] * stride_kv_slot,
            mask=mask,
        )
        tl.debug_barrier()
        tl.store(row_base + target.to(tl.int64)[None, :, None] * stride_kv_slot, rows, mask=mask)
        chunk_start += BLOCK_T

    tl.store(
        cache_lens_ptr + batch * stride_cache_lens,
        cache_len + num_accepted + 1,
        mask=arrival_rank == programs_per_sequence - 1,
    )
