"""Segmented scatter-add: the inner loop of batched BM25 scoring.

Given (row, term, scale) pairs and a CSR posting list per term (column, weight), add
``scale * weight`` into ``out[row, column]`` for every posting of every pair's term:

    for p in pairs: for j in term_ptr[term[p]] .. term_ptr[term[p] + 1]:
        out[row[p], post_col[j]] += scale[p] * post_weight[j]

For BM25, a row is a query, a term lives in exactly one memory, a column is a document's position
within that memory and the weight is the lucene term score, so ``out`` ends as the padded
[queries, docs-of-memory] score matrix. The torch reference materialises every (pair, posting)
entry and does one ``index_add_``; the Triton kernel walks each pair's posting range in blocks with
atomic adds and never materialises the expansion. `segmented_scatter_add` picks the kernel for CUDA
tensors and the reference elsewhere.

Triton is imported lazily, on the first kernel launch, so that ``TRITON_INTERPRET=1`` can still be
set by a caller (tests run the kernel on CPU tensors that way) and CPU-only installs need no Triton.
"""

from __future__ import annotations

import functools

import torch

__all__ = [
    "segmented_scatter_add",
    "segmented_scatter_add_torch",
    "segmented_scatter_add_triton",
    "triton_available",
]


def _check(out: torch.Tensor, pair_row, pair_term, pair_scale, term_ptr, post_col, post_weight) -> None:
    if out.dim() != 2 or not out.is_contiguous() or out.dtype != torch.float32:
        raise ValueError(f"out must be a contiguous 2-D float32 tensor, got {tuple(out.shape)} {out.dtype}")
    n_pairs = pair_row.numel()
    if pair_term.numel() != n_pairs or pair_scale.numel() != n_pairs:
        raise ValueError(
            f"pair_row, pair_term and pair_scale must have one entry per pair: "
            f"{n_pairs}, {pair_term.numel()}, {pair_scale.numel()}"
        )
    if post_col.numel() != post_weight.numel():
        raise ValueError(f"post_col ({post_col.numel()}) and post_weight ({post_weight.numel()}) differ in length")
    if term_ptr.dim() != 1 or term_ptr.numel() < 1:
        raise ValueError("term_ptr must be a 1-D CSR pointer array with at least one entry")


def segmented_scatter_add_torch(
    out: torch.Tensor,
    pair_row: torch.Tensor,
    pair_term: torch.Tensor,
    pair_scale: torch.Tensor,
    term_ptr: torch.Tensor,
    post_col: torch.Tensor,
    post_weight: torch.Tensor,
) -> torch.Tensor:
    """Reference: expand every pair into its postings, then one index_add_ into ``out`` (in place)."""
    _check(out, pair_row, pair_term, pair_scale, term_ptr, post_col, post_weight)
    if pair_row.numel() == 0:
        return out
    starts = term_ptr.index_select(0, pair_term)
    lengths = term_ptr.index_select(0, pair_term + 1) - starts
    # one host sync for the expansion size; the rest stays on the tensors' device
    total = int(lengths.sum())
    if total == 0:
        return out
    device = out.device
    # int32 indices halve the memory traffic of the expansion, which dominates on CPU
    small = max(out.numel(), post_col.numel(), total) < 2**31 - 1
    index_dtype = torch.int32 if small else torch.long
    first_entry = torch.cumsum(lengths, 0) - lengths
    # posting index of each entry = its pair's term start + its offset inside the pair's run
    post_idx = torch.repeat_interleave((starts - first_entry).to(index_dtype), lengths, output_size=total)
    post_idx.add_(torch.arange(total, dtype=index_dtype, device=device))
    flat = torch.repeat_interleave((pair_row * out.shape[1]).to(index_dtype), lengths, output_size=total)
    flat.add_(post_col.to(index_dtype).index_select(0, post_idx))
    values = post_weight.float().index_select(0, post_idx)
    if not bool((pair_scale == 1).all()):
        values.mul_(torch.repeat_interleave(pair_scale.float(), lengths, output_size=total))
    out.view(-1).index_add_(0, flat, values)
    return out


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def segmented_scatter_kernel(
        out_ptr,
        out_stride,
        pair_row_ptr,
        pair_term_ptr,
        pair_scale_ptr,
        term_ptr_ptr,
        post_col_ptr,
        post_weight_ptr,
        BLOCK: tl.constexpr,
    ):
        pair = tl.program_id(0)
        row = tl.load(pair_row_ptr + pair).to(tl.int64)
        term = tl.load(pair_term_ptr + pair).to(tl.int64)
        scale = tl.load(pair_scale_ptr + pair)
        start = tl.load(term_ptr_ptr + term)
        end = tl.load(term_ptr_ptr + term + 1)
        row_base = out_ptr + row * out_stride
        for block_start in range(start, end, BLOCK):
            idx = block_start + tl.arange(0, BLOCK)
            mask = idx < end
            col = tl.load(post_col_ptr + idx, mask=mask, other=0).to(tl.int64)
            weight = tl.load(post_weight_ptr + idx, mask=mask, other=0.0)
            # one posting per (term, doc), so a block never hits a column twice; other pairs of the
            # same query may hit it concurrently, hence the atomic
            tl.atomic_add(row_base + col, weight * scale, mask=mask)

    return segmented_scatter_kernel


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def segmented_scatter_add_triton(
    out: torch.Tensor,
    pair_row: torch.Tensor,
    pair_term: torch.Tensor,
    pair_scale: torch.Tensor,
    term_ptr: torch.Tensor,
    post_col: torch.Tensor,
    post_weight: torch.Tensor,
    block: int = 128,
) -> torch.Tensor:
    """Triton kernel: one program per pair, walking its term's postings ``block`` at a time (in place).

    Float atomics make the summation order (and so the last bit) vary between runs on a GPU.
    """
    _check(out, pair_row, pair_term, pair_scale, term_ptr, post_col, post_weight)
    n_pairs = pair_row.numel()
    if n_pairs == 0:
        return out
    _kernel()[(n_pairs,)](
        out,
        out.stride(0),
        pair_row.contiguous(),
        pair_term.contiguous(),
        pair_scale.float().contiguous(),
        term_ptr.long().contiguous(),
        post_col.contiguous(),
        post_weight.float().contiguous(),
        BLOCK=block,
    )
    return out


def segmented_scatter_add(
    out: torch.Tensor,
    pair_row: torch.Tensor,
    pair_term: torch.Tensor,
    pair_scale: torch.Tensor,
    term_ptr: torch.Tensor,
    post_col: torch.Tensor,
    post_weight: torch.Tensor,
    backend: str = "auto",
) -> torch.Tensor:
    """Selector: ``auto`` = the Triton kernel for CUDA tensors when Triton is installed, else torch."""
    if backend == "auto":
        backend = "triton" if out.is_cuda and triton_available() else "torch"
    if backend == "triton":
        return segmented_scatter_add_triton(out, pair_row, pair_term, pair_scale, term_ptr, post_col, post_weight)
    if backend == "torch":
        return segmented_scatter_add_torch(out, pair_row, pair_term, pair_scale, term_ptr, post_col, post_weight)
    raise ValueError(f"unknown segmented_scatter_add backend {backend!r}: expected auto, torch or triton")
