"""Hybrid candidates (SPEC read path 1), vectorised over a padded [Q, C] union.

Each signal's top-`scan_top_k` lists (BM25 score > 0, cosine > 0) are merged per question; a
candidate absent from one list has raw 0 for that signal. Each signal is min-max normalised over
the question's union: norm = (raw - min) / (max - min). Degenerate case (max == min, e.g. a union
of one candidate, or all raw values equal): norm = 1.0 where raw > 0, else 0.0 — an equal positive
signal is full evidence, an absent one none. fused = alpha * dense_norm + (1 - alpha) * bm25_norm.

Arithmetic is float64 in exactly this order, so the reference path (plain Python floats) computes
bit-identical scores. Candidates come out sorted by score descending, ties by lower row.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from memfit_gpu.index.protocols import DenseSearch, LexicalIndex
from memfit_gpu.retrieve.stages import StageKey, tick

_BIG = torch.iinfo(torch.long).max


@dataclass
class Hits:
    """A padded per-question candidate list. Pads have row -1 and score -inf."""

    rows: torch.Tensor  # [Q, C] long
    bm25: torch.Tensor  # [Q, C] float64 raw (0 = not in the BM25 list)
    dense: torch.Tensor  # [Q, C] float64 raw (0 = not in the dense list)
    fused: torch.Tensor  # [Q, C] float64
    boost: torch.Tensor  # [Q, C] float64 (0 until boosts are added)
    score: torch.Tensor  # [Q, C] float64 fused + boost; -inf on pads

    @property
    def valid(self) -> torch.Tensor:
        return self.rows >= 0

    def take(self, cols: torch.Tensor) -> Hits:
        """Gather columns [Q, K] (pads: -1 index gives a pad)."""
        if cols.numel() == 0 or int(cols.min()) >= 0:  # a permutation or cut: nothing to pad
            return Hits(*(t.gather(1, cols) for t in (self.rows, self.bm25, self.dense, self.fused, self.boost,
                                                      self.score)))
        safe = cols.clamp(min=0)
        pad = cols < 0

        def g(t: torch.Tensor, fill: float | int) -> torch.Tensor:
            return torch.where(pad, torch.as_tensor(fill, dtype=t.dtype), t.gather(1, safe))

        return Hits(g(self.rows, -1), g(self.bm25, 0.0), g(self.dense, 0.0), g(self.fused, 0.0),
                    g(self.boost, 0.0), g(self.score, float("-inf")))

    def ranked(self) -> Hits:
        """By score descending, ties by row ascending, for hits already in row order (as `fuse` and
        `add_boosts` return them): one stable sort suffices."""
        return self.take(self.score.argsort(dim=1, descending=True, stable=True))

    def sorted(self) -> Hits:
        """By score descending, ties by row ascending (pads last), from any order."""
        key_rows = torch.where(self.valid, self.rows, _BIG)
        by_row = key_rows.argsort(dim=1, stable=True)
        by_score = self.score.gather(1, by_row).argsort(dim=1, descending=True, stable=True)
        return self.take(by_row.gather(1, by_score))  # one gather per field for both sorts

    def head(self, k: int) -> Hits:
        cols = torch.arange(min(k, self.rows.shape[1])).expand(self.rows.shape[0], -1)
        return self.take(cols)

    def counts(self) -> torch.Tensor:
        return self.valid.sum(1)


def minmax(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Min-max over each row's valid entries; max == min gives 1 where value > 0, else 0."""
    if values.shape[1] == 0:
        return values
    lo = torch.where(valid, values, torch.inf).amin(1, keepdim=True)
    hi = torch.where(valid, values, -torch.inf).amax(1, keepdim=True)
    span = hi - lo
    flat = span <= 0
    norm = (values - lo) / torch.where(flat, 1.0, span)
    norm = torch.where(flat, (values > 0).double(), norm)
    return torch.where(valid, norm, 0.0)


def fuse(bm25_scores: torch.Tensor, bm25_rows: torch.Tensor, dense_scores: torch.Tensor,
         dense_rows: torch.Tensor, alpha: float) -> Hits:
    """Union of the two top-k lists per question, normalised and fused, in ROW order (pads last);
    `.ranked()` gives score order (ties by lower row)."""
    n_q = bm25_rows.shape[0]
    rows = torch.cat([bm25_rows.long(), dense_rows.long()], 1)
    zeros_b = torch.zeros_like(dense_scores, dtype=torch.float64)
    zeros_d = torch.zeros_like(bm25_scores, dtype=torch.float64)
    b = torch.cat([bm25_scores.double(), zeros_b], 1)
    d = torch.cat([zeros_d, dense_scores.double()], 1)
    key = torch.where(rows >= 0, rows, _BIG)
    key_sorted, order = key.sort(dim=1, stable=True)
    b, d = b.gather(1, order), d.gather(1, order)
    new = torch.ones_like(key_sorted, dtype=torch.bool)
    new[:, 1:] = key_sorted[:, 1:] != key_sorted[:, :-1]
    group = new.long().cumsum(1) - 1
    width = int(group.max()) + 1 if group.numel() else 0
    out_rows = torch.full((n_q, width), _BIG, dtype=torch.long).scatter(1, group, key_sorted)
    # Each row occurs at most once per list, so each group sums one real value and zeros: exact.
    out_b = torch.zeros((n_q, width), dtype=torch.float64).scatter_add(1, group, b)
    out_d = torch.zeros((n_q, width), dtype=torch.float64).scatter_add(1, group, d)
    valid = out_rows != _BIG
    out_rows = torch.where(valid, out_rows, -1)
    keep = int(valid.sum(1).max()) if n_q else 0  # valid groups come first (rows sorted ascending)
    out_rows, out_b, out_d, valid = out_rows[:, :keep], out_b[:, :keep], out_d[:, :keep], valid[:, :keep]
    fused = alpha * minmax(out_d, valid) + (1 - alpha) * minmax(out_b, valid)
    fused = torch.where(valid, fused, 0.0)
    score = torch.where(valid, fused, -torch.inf)
    return Hits(out_rows, torch.where(valid, out_b, 0.0), torch.where(valid, out_d, 0.0), fused,
                torch.zeros_like(fused), score)


def hybrid_search(bm25: LexicalIndex, dense: DenseSearch, tokens: Sequence[list[str]], embeddings: torch.Tensor,
                  memory_idx: Sequence[int], scan_top_k: int, alpha: float, min_cosine: float = 0.0,
                  timings: dict[str, float] | None = None,
                  encoded: tuple[torch.Tensor, torch.Tensor] | None = None, timing_prefix: str = "") -> Hits:
    """One BM25 search and one dense search for all queries, then `fuse` (row order).

    encoded: the BM25 queries as (query index, term id) pairs (`LexicalIndex.feedback_terms`), used
    instead of re-encoding `tokens`. timings: when given, wall seconds of the three parts are added
    under `bm25`, `dense`, `fuse` (each after `timing_prefix`)."""
    timings = {} if timings is None else timings
    clock = time.perf_counter()
    if encoded is not None:
        b_scores, b_rows = bm25.search_encoded(encoded[0], encoded[1], list(memory_idx), scan_top_k)
    else:
        b_scores, b_rows = bm25.search(list(tokens), list(memory_idx), scan_top_k)
    clock = tick(timings, timing_prefix + StageKey.BM25, clock, b_rows.device)
    d_scores, d_rows = dense.search(embeddings, list(memory_idx), scan_top_k, min_score=min_cosine)
    clock = tick(timings, timing_prefix + StageKey.DENSE, clock, d_rows.device)
    hits = fuse(b_scores.cpu(), b_rows.cpu(), d_scores.cpu(), d_rows.cpu(), alpha)
    tick(timings, timing_prefix + StageKey.FUSE, clock)
    return hits
