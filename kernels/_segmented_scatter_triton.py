"""Triton kernel of `memfit_gpu.kernels.segmented_scatter` (imported on first launch, see _launch.py)."""

# no `from __future__ import annotations`: Triton < 3.4 reads a constexpr only from a real annotation

import triton
import triton.language as tl


@triton.jit
def segmented_scatter_kernel(
    acc_ptr,
    pair_base_ptr,
    pair_term_ptr,
    item_pair_ptr,
    item_start_ptr,
    term_ptr_ptr,
    post_col_ptr,
    post_weight_ptr,
    BLOCK: tl.constexpr,
):
    item = tl.program_id(0)
    pair = tl.load(item_pair_ptr + item)
    start = tl.load(item_start_ptr + item)
    term = tl.load(pair_term_ptr + pair)
    end = tl.load(term_ptr_ptr + term + 1)
    base = tl.load(pair_base_ptr + pair)
    idx = start + tl.arange(0, BLOCK)
    mask = idx < end
    col = tl.load(post_col_ptr + idx, mask=mask, other=0).to(tl.int64)
    weight = tl.load(post_weight_ptr + idx, mask=mask, other=0.0).to(tl.float64)
    # One posting per (term, doc), so a block never hits a slot twice; other pairs of the same query
    # may hit it concurrently, hence the atomic. The float64 sums are exact (see segmented_scatter),
    # so the order the atomics land in cannot change a bit.
    tl.atomic_add(acc_ptr + base + col, weight, mask=mask)
