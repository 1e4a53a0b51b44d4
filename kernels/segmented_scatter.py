"""Segmented scatter-add in float64: the inner loop of batched BM25 scoring.

Given (base, term) pairs and a CSR posting list per term (column, weight), add every posting's
weight into a flat float64 accumulator at the pair's base plus the posting's column:

    for p in pairs: for j in term_ptr[term[p]] .. term_ptr[term[p] + 1]:
        acc[base[p] + post_col[j]] += post_weight[j]

For BM25 a pair is one known query token, a term lives in exactly one memory, a column is a
document's position within that memory and the weight is its lucene term score. With base = query x
width the accumulator is a padded [queries, width] matrix; with base = the first slot of the query's
own segment it is ragged: each question's scores over its own memory only, nothing padded
(`BM25Index.search(kernels="triton")`).

Determinism: float32 weights are summed in float64 and the caller rounds to float32 once. When every
partial sum is exact in float64 (BM25Index puts its weights on a grid that guarantees it, see
`memfit_gpu.index.bm25`), the sum does not depend on the order of the additions, so the torch
reference (one ``index_add_``) and the kernel (atomic adds in whatever order the GPU schedules them)
give the same bits, run after run.

The torch reference materialises every (pair, posting) entry and does one ``index_add_``; the Triton
kernel (`_segmented_scatter_triton`) cuts every pair's posting run into blocks, one program per block,
and never materialises the expansion. `segmented_scatter_add` picks the kernel for CUDA tensors.
"""

from __future__ import annotations

import torch

from ._launch import device_guard, launch, launch_device, load, triton_available

__all__ = [
    "segmented_scatter_add",
    "segmented_scatter_add_torch",
    "segmented_scatter_add_triton",
    "triton_available",
]

BLOCK = 128  # postings per Triton program


def _check(acc: torch.Tensor, pair_base, pair_term, term_ptr, post_col, post_weight) -> None:
    if acc.dim() != 1 or not acc.is_contiguous() or acc.dtype != torch.float64:
        raise ValueError(f"acc must be a contiguous 1-D float64 tensor, got {tuple(acc.shape)} {acc.dtype}")
    if pair_term.numel() != pair_base.numel():
        raise ValueError(f"pair_base and pair_term must have one entry per pair: {pair_base.numel()}, {pair_term.numel()}")
    if post_col.numel() != post_weight.numel():
        raise ValueError(f"post_col ({post_col.numel()}) and post_weight ({post_weight.numel()}) differ in length")
    if term_ptr.dim() != 1 or term_ptr.numel() < 1:
        raise ValueError("term_ptr must be a 1-D CSR pointer array with at least one entry")


def _runs(pair_term: torch.Tensor, term_ptr: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(first posting, number of postings) of each pair's term."""
    starts = term_ptr.index_select(0, pair_term)
    return starts, term_ptr.index_select(0, pair_term + 1) - starts


def segmented_scatter_add_torch(
    acc: torch.Tensor,
    pair_base: torch.Tensor,
    pair_term: torch.Tensor,
    term_ptr: torch.Tensor,
    post_col: torch.Tensor,
    post_weight: torch.Tensor,
) -> torch.Tensor:
    """Reference: expand every pair into its postings, then one float64 index_add_ (in place)."""
    _check(acc, pair_base, pair_term, term_ptr, post_col, post_weight)
    if pair_base.numel() == 0:
        return acc
    starts, lengths = _runs(pair_term, term_ptr)
    # one host sync for the expansion size; the rest stays on the tensors' device
    total = int(lengths.sum())
    if total == 0:
        return acc
    device = acc.device
    # int32 indices halve the memory traffic of the expansion, which dominates on CPU
    small = max(acc.numel(), post_col.numel(), total) < 2**31 - 1
    index_dtype = torch.int32 if small else torch.long
    first_entry = torch.cumsum(lengths, 0) - lengths
    # posting index of each entry = its pair's term start + its offset inside the pair's run
    post_idx = torch.repeat_interleave((starts - first_entry).to(index_dtype), lengths, output_size=total)
    post_idx.add_(torch.arange(total, dtype=index_dtype, device=device))
    flat = torch.repeat_interleave(pair_base.to(index_dtype), lengths, output_size=total)
    flat.add_(post_col.to(index_dtype).index_select(0, post_idx))
    acc.index_add_(0, flat, post_weight.index_select(0, post_idx).double())
    return acc


def work_items(pair_term: torch.Tensor, term_ptr: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(pair, first posting) of every block of ``block`` postings: one Triton program each, so a
    frequent term's long run is spread over many programs instead of one."""
    starts, lengths = _runs(pair_term, term_ptr)
    blocks = (lengths + block - 1) // block
    total = int(blocks.sum())
    pair = torch.repeat_interleave(torch.arange(pair_term.numel(), device=pair_term.device), blocks, output_size=total)
    first = torch.cumsum(blocks, 0) - blocks
    offset = (torch.arange(total, device=pair_term.device) - first.index_select(0, pair)) * block
    return pair, starts.index_select(0, pair) + offset


def segmented_scatter_add_triton(
    acc: torch.Tensor,
    pair_base: torch.Tensor,
    pair_term: torch.Tensor,
    term_ptr: torch.Tensor,
    post_col: torch.Tensor,
    post_weight: torch.Tensor,
    block: int = BLOCK,
) -> torch.Tensor:
    """Triton kernel: one program per block of one pair's postings, float64 atomic adds (in place). `block`: a
    power of two (tl.arange's rule; anything else failed inside Triton's compiler)."""
    if isinstance(block, bool) or not isinstance(block, int) or block < 1 or block & (block - 1):
        raise ValueError(f"segmented_scatter_add_triton: block={block!r} must be a power of two (e.g. {BLOCK})")
    _check(acc, pair_base, pair_term, term_ptr, post_col, post_weight)
    device = launch_device(acc=acc, pair_base=pair_base, pair_term=pair_term, term_ptr=term_ptr,
                           post_col=post_col, post_weight=post_weight)
    if pair_base.numel() == 0:
        return acc
    with device_guard(device):
        term_ptr = term_ptr.long().contiguous()
        pair_term = pair_term.long().contiguous()
        item_pair, item_start = work_items(pair_term, term_ptr, block)
        if item_pair.numel() == 0:
            return acc
        launch("segmented_scatter", load("_segmented_scatter_triton").segmented_scatter_kernel,
               (item_pair.numel(),), device,
               acc, pair_base.long().contiguous(), pair_term, item_pair, item_start, term_ptr,
               post_col.contiguous(), post_weight.float().contiguous(), constexprs={"BLOCK": block})
    return acc


def segmented_scatter_add(
    acc: torch.Tensor,
    pair_base: torch.Tensor,
    pair_term: torch.Tensor,
    term_ptr: torch.Tensor,
    post_col: torch.Tensor,
    post_weight: torch.Tensor,
    backend: str = "auto",
) -> torch.Tensor:
    """Selector: ``auto`` = the Triton kernel for CUDA tensors when Triton is installed, else torch."""
    if backend == "auto":
        backend = "triton" if acc.is_cuda and triton_available() else "torch"
    if backend == "triton":
        return segmented_scatter_add_triton(acc, pair_base, pair_term, term_ptr, post_col, post_weight)
    if backend == "torch":
        return segmented_scatter_add_torch(acc, pair_base, pair_term, term_ptr, post_col, post_weight)
    raise ValueError(f"unknown segmented_scatter_add backend {backend!r}: expected auto, torch or triton")
