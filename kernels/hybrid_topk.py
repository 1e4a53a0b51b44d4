"""Fused hybrid + boosts + top-k (SPEC read path 1-2): one launch for a whole batch of questions.

Per question, from its BM25 top list and its dense top list (rows -1 padded): the union of the two
lists, each signal min-max normalised over the union, fused = alpha * dense + (1 - alpha) * bm25,
plus the speaker / month / year boosts read from per-row metadata, then the first k candidates by
score descending, ties by the lower row (or all of them in row order). Lists are ragged through
their -1 pads; one program per question.

The torch reference, which stays the oracle, is the batched read path's own code:
`memfit_gpu.retrieve.hybrid.fuse` -> `memfit_gpu.retrieve.boosts.add_boosts` -> `Hits.ranked()` ->
`Hits.head(k)`. The kernel forms every float64 value with the same operations in the same order
(no fused multiply-add), so both give the same bits; tests/kernels/test_kernels.py checks it on random
ragged batches under the Triton interpreter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._launch import device_guard, launch, launch_device, load, next_power_of_two

__all__ = ["BoostInputs", "hybrid_topk_triton"]


@dataclass
class BoostInputs:
    """The boosts of one batch, as tensors on the kernel's device (retrieve.boosts.constraint_tensors
    for the questions' side; the view's row metadata for the rows' side)."""

    speaker: float
    month: float
    year: float
    speaker_bits: torch.Tensor  # [Q] long: bit s = the question names speaker s of its memory
    years: torch.Tensor  # [Q, Y] long, -1 padded
    months: torch.Tensor  # [Q, M] long, -1 padded
    row_speaker_mask: torch.Tensor  # [R] long (empty = no row matches a speaker)
    row_year: torch.Tensor  # [R] long (empty = no row has a year)
    row_month: torch.Tensor  # [R] long (empty = no row has a month)


def _row_table(values: torch.Tensor, fill: int, size: int, device: torch.device) -> torch.Tensor:
    # the torch path reads an empty table as "no match" for every row: the same, as a filled table
    if values.numel():
        return values.long().contiguous()
    return torch.full((max(size, 1),), fill, dtype=torch.long, device=device)


def hybrid_topk_triton(b_scores: torch.Tensor, b_rows: torch.Tensor, d_scores: torch.Tensor, d_rows: torch.Tensor,
                       alpha: float, k: int | None = None, by_row: bool = False,
                       boosts: BoostInputs | None = None) -> tuple[torch.Tensor, ...]:
    """(rows, bm25, dense, fused, boost, score) [Q, W]: rows long (-1 pads), the rest float64 (pads 0,
    score -inf), W = min(k, the largest union) as `Hits.head(k)` cuts it; k None = every candidate.

    b_scores/b_rows [Q, KB] and d_scores/d_rows [Q, KD]: each question's two top lists, float32 scores."""
    n_q, kb = b_rows.shape
    kd = d_rows.shape[1]
    if b_scores.shape != b_rows.shape or d_scores.shape != d_rows.shape or d_rows.shape[0] != n_q:
        raise ValueError(f"hybrid_topk: lists of shapes {tuple(b_scores.shape)}, {tuple(b_rows.shape)}, "
                         f"{tuple(d_scores.shape)}, {tuple(d_rows.shape)} do not pair up")
    device = launch_device(b_scores=b_scores, b_rows=b_rows, d_scores=d_scores, d_rows=d_rows)
    width = kb + kd if k is None else int(k)
    if width < 1:
        raise ValueError(f"hybrid_topk: k must be >= 1, got {k}")
    rows = torch.full((n_q, width), -1, dtype=torch.long, device=device)
    bm25 = torch.zeros((n_q, width), dtype=torch.float64, device=device)
    dense, fused, boost = torch.zeros_like(bm25), torch.zeros_like(bm25), torch.zeros_like(bm25)
    score = torch.full((n_q, width), float("-inf"), dtype=torch.float64, device=device)
    outs = (rows, bm25, dense, fused, boost, score)
    if n_q == 0:
        return tuple(t[:, :0] for t in outs)
    # float64 scalars travel in a tensor: a Python float kernel argument would be passed as float32
    values = (boosts.speaker, boosts.month, boosts.year) if boosts is not None else (0.0, 0.0, 0.0)
    params = torch.tensor([alpha, 1 - alpha, *values], dtype=torch.float64, device=device)
    if boosts is not None:
        for name in ("speaker_bits", "years", "months", "row_speaker_mask", "row_year", "row_month"):
            launch_device(b_rows=b_rows, **{name: getattr(boosts, name)})
        every_row = torch.cat([b_rows.reshape(-1), d_rows.reshape(-1)])
        n_rows = int(every_row.max()) + 1 if every_row.numel() else 1
        question_side = (boosts.speaker_bits.long().contiguous(), boosts.years.long().contiguous(),
                         boosts.months.long().contiguous())
        row_side = (_row_table(boosts.row_speaker_mask, 0, n_rows, device),
                    _row_table(boosts.row_year, -2, n_rows, device), _row_table(boosts.row_month, -2, n_rows, device))
        n_years, n_months = question_side[1].shape[1], question_side[2].shape[1]
    else:
        dummy = torch.zeros(1, dtype=torch.long, device=device)
        question_side, row_side = (dummy, dummy, dummy), (dummy, dummy, dummy)
        n_years = n_months = 0
    with device_guard(device):
        launch(
            "hybrid_topk", load("_hybrid_topk_triton").hybrid_topk_kernel, (n_q,), device,
            b_scores.float().contiguous(), b_rows.long().contiguous(), d_scores.float().contiguous(),
            d_rows.long().contiguous(), params, *question_side, *row_side, *outs,
            kb, kd, n_years, n_months, width,
            constexprs={"KBP": max(16, next_power_of_two(kb)), "KDP": max(16, next_power_of_two(kd)),
                        "BOOSTS": boosts is not None, "BY_ROW": by_row},
            enable_fp_fusion=False,  # alpha * d + (1 - alpha) * b rounds each product, as torch does
        )
    used = int((rows >= 0).sum(1).max())
    return tuple(t[:, :used] for t in outs)
