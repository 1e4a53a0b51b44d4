"""Top-k of every question's own score segment, with the exact BM25 tie order.

Scores are ragged: question q owns ``acc[seg_ptr[q] : seg_ptr[q + 1]]``, the float64 BM25 sums of
its memory's documents in position order (`segmented_scatter` with per-question bases). Each sum is
rounded to float32 once, then the top k with score > 0 are chosen by score descending, ties by the
lower position (= the lower row: positions follow row order inside a memory). Column j of question q
is row ``rows_by_memory[row_start[q] + j]``. Missing slots hold score 0 and row -1.

The order is one int64 key per score: BM25 scores are >= 0, so their float32 bit patterns order like
the floats; the low 32 bits hold the reversed column, so a larger key is a higher score, then a
lower column (`score_keys`). The torch reference pads the segments into a [Q, longest] block and runs
one ``topk`` over the keys (`padded_topk`, which BM25Index's torch path uses for its padded blocks
too); the Triton kernel (`_segment_topk_triton`) keeps a running top-k per question while it walks
the segment, never building the padded block.

Routing: the kernel holds K_PAD = max(16, next power of two >= k) keys and ranks a [K_PAD, K_PAD]
matrix per block, so its cost grows with K_PAD squared: K_PAD >= 128 spills registers, and compiling
it ahead of time for sm_90a with Triton 3.6 took 8.2 s at K_PAD 128, 28.5 s at 256 and 6 min 53 s at
512. The read path asks for retrieve.scan_top_k (60 by default: K_PAD 64). So
`segment_topk_triton` runs the kernel for k <= TRITON_MAX_K (64) and the torch reference, on the same
device and with the same bits, above it; `segment_topk_kernel` is the kernel at any k, which only the
GPU check's optional last stage (`kernels_wide`) calls with k > 64.
"""

from __future__ import annotations

import torch

from ._launch import device_guard, launch, launch_device, load, next_power_of_two

__all__ = ["TRITON_MAX_K", "padded_topk", "score_keys", "segment_topk_kernel", "segment_topk_torch",
           "segment_topk_triton"]

# The largest k the Triton path runs as a kernel (K_PAD 64); larger k takes the torch reference (module doc).
TRITON_MAX_K = 64


def score_keys(block: torch.Tensor) -> torch.Tensor:
    """int64 keys of a [Q, W] float32 block of scores >= 0: float bits << 32 | reversed column."""
    width = block.shape[1]
    key = block.contiguous().view(torch.int32).long()
    key.bitwise_left_shift_(32)
    key.add_((1 << 32) - 1 - torch.arange(width, dtype=torch.long, device=block.device))
    return key


def padded_topk(block: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores, columns) [Q, min(k, W)] of a [Q, W] float32 block of scores >= 0, best first, ties
    by the lower column; zero scores are included (the caller masks them)."""
    cols = torch.topk(score_keys(block), min(k, block.shape[1]), dim=1).indices
    return torch.gather(block, 1, cols), cols


def _check(acc: torch.Tensor, seg_ptr: torch.Tensor, row_start: torch.Tensor, k: int) -> int:
    if acc.dim() != 1 or acc.dtype != torch.float64:
        raise ValueError(f"acc must be a 1-D float64 tensor, got {tuple(acc.shape)} {acc.dtype}")
    n_q = seg_ptr.numel() - 1
    if seg_ptr.dim() != 1 or n_q < 0:
        raise ValueError("seg_ptr must be a 1-D pointer array with one entry more than there are questions")
    if row_start.numel() != n_q:
        raise ValueError(f"row_start has {row_start.numel()} entries for {n_q} questions")
    if k < 1:
        raise ValueError(f"segment top-k: k must be >= 1, got {k}")
    return n_q


def segment_topk_torch(acc: torch.Tensor, seg_ptr: torch.Tensor, row_start: torch.Tensor,
                       rows_by_memory: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: the segments padded into one block, rounded, one key topk. (scores [Q,k], rows [Q,k])."""
    n_q = _check(acc, seg_ptr, row_start, k)
    device = acc.device
    top_scores = torch.zeros((n_q, k), dtype=torch.float32, device=device)
    top_rows = torch.full((n_q, k), -1, dtype=torch.long, device=device)
    lengths = seg_ptr[1:] - seg_ptr[:-1]
    width = int(lengths.max()) if n_q else 0
    if width == 0:
        return top_scores, top_rows
    cols = torch.arange(width, device=device)
    inside = cols < lengths[:, None]
    block = torch.zeros((n_q, width), dtype=torch.float32, device=device)
    block[inside] = acc[int(seg_ptr[0]) : int(seg_ptr[-1])].float()  # segments are consecutive, in order
    vals, top_cols = padded_topk(block, k)
    hit = vals > 0
    rows = rows_by_memory[torch.where(hit, row_start[:, None] + top_cols, 0)]
    kk = vals.shape[1]
    top_scores[:, :kk] = torch.where(hit, vals, 0.0)
    top_rows[:, :kk] = torch.where(hit, rows, -1)
    return top_scores, top_rows


def segment_topk_triton(acc: torch.Tensor, seg_ptr: torch.Tensor, row_start: torch.Tensor,
                        rows_by_memory: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton path: the kernel for k <= TRITON_MAX_K, else the torch reference on the same device
    (the same bits; see the module doc for why)."""
    _check(acc, seg_ptr, row_start, k)
    launch_device(acc=acc, seg_ptr=seg_ptr, row_start=row_start, rows_by_memory=rows_by_memory)
    if k > TRITON_MAX_K:
        return segment_topk_torch(acc, seg_ptr, row_start, rows_by_memory, k)
    return segment_topk_kernel(acc, seg_ptr, row_start, rows_by_memory, k)


def segment_topk_kernel(acc: torch.Tensor, seg_ptr: torch.Tensor, row_start: torch.Tensor,
                        rows_by_memory: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel at any k: one program per question, a running top-k over blocks of its segment."""
    n_q = _check(acc, seg_ptr, row_start, k)
    device = launch_device(acc=acc, seg_ptr=seg_ptr, row_start=row_start, rows_by_memory=rows_by_memory)
    top_scores = torch.zeros((n_q, k), dtype=torch.float32, device=device)
    top_rows = torch.full((n_q, k), -1, dtype=torch.long, device=device)
    if n_q == 0 or acc.numel() == 0:  # no documents: nothing to rank (and no address to pass)
        return top_scores, top_rows
    # an empty tensor may have no address to pass; with no documents no row is ever read
    rows = rows_by_memory.long().contiguous() if rows_by_memory.numel() else torch.full((1,), -1, device=device)
    with device_guard(device):
        launch("segment_topk", load("_segment_topk_triton").segment_topk_kernel, (n_q,), device,
               acc.contiguous(), seg_ptr.long().contiguous(), row_start.long().contiguous(), rows,
               top_scores, top_rows, k, constexprs={"K_PAD": max(16, next_power_of_two(k))})
    return top_scores, top_rows
