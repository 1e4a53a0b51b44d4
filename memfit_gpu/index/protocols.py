"""What the read path asks of an index, as Protocols, and the argument rules every BM25 enforces.

`LexicalIndex` is implemented by `BM25Index` (batched torch, `index/bm25.py`) and `ReferenceBM25` (the
readable oracle, `index/bm25_reference.py`): same arguments, same results, same errors, so the read
path never asks which one it holds. `DenseSearch` is `DenseIndex` (`index/dense.py`).

Conventions of both: rows are global integers in add order across memories, never reused (a deleted
row is tombstoned); every query belongs to one memory and only reaches that memory's rows; results
are (scores [Q, k], rows [Q, k]) sorted by score descending, ties by lower row, missing slots score 0
and row -1. A term id names one (memory, token) pair, numbered in order of first appearance.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import torch

KERNELS = ("torch", "triton")
TERM_ORDERS = ("idf", "alphabetical")


class LexicalIndex(Protocol):
    """BM25 over many memories (lucene scoring with per-memory statistics, SPEC write path 2)."""

    device: torch.device
    has_kernels: bool  # whether search(kernels="triton") exists (retrieve.kernels)

    @property
    def num_rows(self) -> int:
        """Rows ever added (deleted rows included)."""
        ...

    def add(self, tokens: list[list[str]], memory_idx: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Append one document per token list to its memory; returns the new row ids (CPU long)."""
        ...

    def delete(self, rows: Sequence[int] | torch.Tensor) -> None:
        """Tombstone rows: they leave results and their memory's N, df and avgdl. Repeats are no-ops."""
        ...

    def search(self, queries: list[list[str]], memory_idx: Sequence[int] | torch.Tensor, k: int,
               kernels: str = "torch") -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k rows with score > 0 of each query's memory: (scores [Q, k] float32, rows [Q, k] long)."""
        ...

    def search_encoded(self, pair_query: torch.Tensor, pair_term: torch.Tensor,
                       memory_idx: Sequence[int] | torch.Tensor, k: int,
                       kernels: str = "torch") -> tuple[torch.Tensor, torch.Tensor]:
        """`search` for queries given as (query index, term id) pairs, query indexes ascending."""
        ...

    def scores(self, queries: list[list[str]],
               memory_idx: Sequence[int] | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every live row's score per query, in row order: (scores [Q, D], rows [Q, D]), 0 / -1 padded."""
        ...

    def idf(self, tokens: list[list[str]], memory_idx: Sequence[int] | torch.Tensor) -> list[list[float]]:
        """idf of each token within its list's memory (a token the memory lacks has df = 0)."""
        ...

    def doc_tokens(self, rows: Sequence[int] | torch.Tensor) -> list[list[str]]:
        """Distinct tokens of each row, in first-occurrence order."""
        ...

    def feedback_terms(self, rows: torch.Tensor, min_chars: int, terms: int,
                       term_order: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Per query, the first `terms` distinct terms of its rows [Q, D] (-1 pads) with at least
        `min_chars` characters, in `term_order` ("idf": idf descending, ties by token; "alphabetical"):
        (query index, term id) pairs, query by query, ready for `search_encoded`."""
        ...

    def term_tokens(self, term_ids: torch.Tensor) -> list[str]:
        """The token of each term id."""
        ...

    def memory_stats(self, memory_idx: int) -> tuple[int, float]:
        """(live documents N, avgdl) of one memory."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Plain tensors, lists and numbers (`torch.load(weights_only=True)` reads them back)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def to(self, device: str | torch.device) -> LexicalIndex: ...


class DenseSearch(Protocol):
    """Inner-product search over L2-normalised vectors (cosine), partitioned by memory."""

    @property
    def size(self) -> int:
        """Rows ever added (deleted rows included)."""
        ...

    def add(self, vectors: np.ndarray | torch.Tensor, memory_idx: Sequence[int] | np.ndarray | torch.Tensor) -> np.ndarray:
        """Append one row per vector to its memory; returns the new row ids."""
        ...

    def delete(self, rows: Sequence[int] | np.ndarray | torch.Tensor) -> None: ...

    def search(self, queries: np.ndarray | torch.Tensor, memory_idx: Sequence[int] | np.ndarray | torch.Tensor,
               k: int, min_score: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k live rows of each query's memory with cosine > min_score: (scores [Q, k], rows [Q, k])."""
        ...

    def vectors(self, rows: Sequence[int] | np.ndarray) -> np.ndarray:
        """The stored vectors of rows [n, dim] float32."""
        ...


# ---------------------------------------------------------------------------------------------------
# Argument rules both BM25 implementations enforce, with the same messages.

def as_int_list(values: Sequence[int] | torch.Tensor) -> list[int]:
    """Row or memory numbers as a list of Python ints (a tensor of any shape is flattened)."""
    if isinstance(values, torch.Tensor):
        return [int(v) for v in values.reshape(-1).tolist()]
    return [int(v) for v in values]


def check_batch(items: Sequence[Any], memory_idx: Sequence[int] | torch.Tensor, what: str) -> list[int]:
    """One memory (>= 0) per item; returns the memories as ints."""
    mems = as_int_list(memory_idx)
    if len(mems) != len(items):
        raise ValueError(f"BM25: {len(items)} {what} but {len(mems)} memory_idx entries; give one memory per item")
    bad = [i for i, m in enumerate(mems) if m < 0]
    if bad:
        raise ValueError(f"BM25: memory_idx must be >= 0; item {bad[0]} has {mems[bad[0]]}")
    return mems


def check_k(k: int) -> int:
    if int(k) < 1:
        raise ValueError(f"BM25 search: k must be >= 1, got {k}")
    return int(k)


def check_kernels(kernels: str) -> str:
    if kernels not in KERNELS:
        raise ValueError(f"BM25 search: kernels={kernels!r} is not one of {', '.join(KERNELS)}")
    return kernels


def check_term_order(term_order: str) -> str:
    if term_order not in TERM_ORDERS:
        raise ValueError(f"BM25 feedback_terms: term_order={term_order!r} is not one of {', '.join(TERM_ORDERS)}")
    return term_order


def check_pairs(pair_query: torch.Tensor, pair_term: torch.Tensor, n_queries: int, n_terms: int) -> None:
    """`search_encoded` pairs: query indexes ascending and below the number of queries, known term ids."""
    if pair_query.numel() != pair_term.numel():
        raise ValueError(f"BM25 search_encoded: {pair_query.numel()} query indexes but {pair_term.numel()} term ids")
    if not pair_query.numel():
        return
    if bool((pair_query[1:] < pair_query[:-1]).any()) or int(pair_query[-1]) >= n_queries:
        raise ValueError("BM25 search_encoded: query indexes must be ascending and below the number of queries")
    for bad in (int(pair_term.max()), int(pair_term.min())):
        if not 0 <= bad < n_terms:
            raise ValueError(f"BM25 search_encoded: term id {bad} does not exist")

