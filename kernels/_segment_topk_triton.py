"""Triton kernel of `memfit_gpu.kernels.segment_topk` (imported on first launch, see _launch.py)."""

# no `from __future__ import annotations`: Triton < 3.4 reads a constexpr only from a real annotation

import triton
import triton.language as tl


@triton.jit
def segment_topk_kernel(
    acc_ptr,
    seg_ptr_ptr,
    row_start_ptr,
    rows_ptr,
    out_score_ptr,
    out_row_ptr,
    k,
    K_PAD: tl.constexpr,
):
    q = tl.program_id(0).to(tl.int64)
    start = tl.load(seg_ptr_ptr + q)
    end = tl.load(seg_ptr_ptr + q + 1)
    lane = tl.arange(0, K_PAD)
    # int64 constants built in int64: a literal 0xFFFFFFFF would be typed uint32
    low32 = (tl.full([K_PAD], 1, tl.int64) << 32) - 1
    # The running top keys, descending. Every real key is > 0; empty slots hold distinct negative keys
    # (-1 - lane here, below -K_PAD in a block), so all candidates of a merge are distinct.
    best = -1 - lane.to(tl.int64)
    for block_start in range(start, end, K_PAD):
        idx = block_start + lane
        inside = idx < end
        # the float64 sum rounded to float32 once, exactly as the torch path's `.float()`
        score = tl.load(acc_ptr + idx, mask=inside, other=0.0).to(tl.float32)
        bits = score.to(tl.int32, bitcast=True).to(tl.int64)
        key = (bits << 32) | (low32 - (idx - start))
        key = tl.where(inside & (score > 0), key, -1 - K_PAD - lane.to(tl.int64))
        # merge only a block that beats the current k-th best (after the first blocks, rarely)
        if tl.max(key, axis=0) > tl.min(best, axis=0):
            # rank of each candidate among best and block (how many are larger): the ranks are a
            # permutation, so slot j of the new best is the one candidate of rank j. Comparisons and
            # sums only: no sort network (cheap on a GPU for K_PAD <= 64, the largest the read path launches:
            # segment_topk.TRITON_MAX_K; and in the interpreter).
            rank_best = lane + tl.sum((key[None, :] > best[:, None]).to(tl.int32), axis=1)
            rank_key = tl.sum((best[None, :] > key[:, None]).to(tl.int32), axis=1) + tl.sum(
                (key[None, :] > key[:, None]).to(tl.int32), axis=1)
            best = tl.sum(tl.where(rank_best[None, :] == lane[:, None], best[None, :], 0), axis=1) + tl.sum(
                tl.where(rank_key[None, :] == lane[:, None], key[None, :], 0), axis=1)
    found = best >= 0
    score = (best >> 32).to(tl.int32).to(tl.float32, bitcast=True)
    col = low32 - (best & low32)
    row_start = tl.load(row_start_ptr + q)
    row = tl.load(rows_ptr + row_start + col, mask=found, other=-1)
    keep = lane < k
    tl.store(out_score_ptr + q * k + lane, tl.where(found, score, 0.0), mask=keep)
    tl.store(out_row_ptr + q * k + lane, tl.where(found, row, -1), mask=keep)
