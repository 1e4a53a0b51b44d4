"""ReferenceBM25: the readable oracle of `BM25Index` (index/bm25.py), plain Python, one query at a time.

Same scoring (bm25s's ``lucene`` form with every statistic taken per memory, see index/bm25.py), the
same `LexicalIndex` methods and errors (index/protocols.py), float64 arithmetic over dict postings, with
BM25Index's rounding: each posting's weight a float32 on the 2^-32 grid, their sum exact, the score
rounded once to float32, ties in that score broken by the lower row (protocols.py).
Term ids are numbered the way BM25Index numbers them, per (memory, token) in order of first
appearance, so `feedback_terms` and `search_encoded` give the same pairs and rows on both. Nothing
here is fast: tests hold the batched index to it, and `index.bm25_backend: reference` runs a whole
retrieval on it.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from memfit_gpu.index.bm25_postings import _GRID_BITS
from memfit_gpu.index.protocols import (
    as_int_list,
    check_batch,
    check_k,
    check_kernels,
    check_pairs,
    check_term_order,
)

__all__ = ["ReferenceBM25"]


def _grid_weight(weight: float) -> float:
    """bm25_postings._on_grid for one weight: the float32 nearest it, on the 2^-_GRID_BITS grid (half to even,
    as Python's round)."""
    scale = float(2 ** _GRID_BITS)
    return round(float(np.float32(weight)) * scale) / scale


class ReferenceBM25:
    """The readable oracle: dict postings per memory, one query at a time, float64 arithmetic."""

    has_kernels = False  # no Triton path: retrieve.kernels=triton is refused, auto takes torch

    def __init__(self, k1: float = 1.5, b: float = 0.75, device: str | torch.device = "cpu"):
        self.k1 = float(k1)
        self.b = float(b)
        self.device = torch.device(device)
        self._postings: dict[int, dict[str, dict[int, int]]] = {}  # memory -> token -> row -> tf
        self._row_memory: list[int] = []
        self._row_len: list[int] = []
        self._row_tokens: list[list[str]] = []  # distinct tokens, first-occurrence order
        self._deleted: set[int] = set()
        self._term_id: dict[tuple[int, str], int] = {}  # (memory, token) -> term id
        self._term_key: list[tuple[int, str]] = []  # term id -> (memory, token)

    @property
    def num_rows(self) -> int:
        return len(self._row_memory)

    def _name_terms(self, mem: int, tokens: Sequence[str]) -> None:
        for token in tokens:
            if (mem, token) not in self._term_id:
                self._term_id[(mem, token)] = len(self._term_key)
                self._term_key.append((mem, token))

    def add(self, tokens: list[list[str]], memory_idx: Sequence[int] | torch.Tensor) -> torch.Tensor:
        mems = check_batch(tokens, memory_idx, "token lists")
        new_rows = []
        for doc_tokens, mem in zip(tokens, mems, strict=True):
            row = len(self._row_memory)
            counts = Counter(doc_tokens)
            memory_postings = self._postings.setdefault(mem, {})
            for token, tf in counts.items():
                memory_postings.setdefault(token, {})[row] = tf
            self._row_memory.append(mem)
            self._row_len.append(len(doc_tokens))
            self._row_tokens.append(list(counts))
            self._name_terms(mem, list(counts))
            new_rows.append(row)
        return torch.tensor(new_rows, dtype=torch.long)

    def delete(self, rows: Sequence[int] | torch.Tensor) -> None:
        for row in as_int_list(rows):
            if not 0 <= row < self.num_rows:
                raise IndexError(f"BM25 delete: row {row} does not exist (rows 0..{self.num_rows - 1})")
            self._deleted.add(row)

    def _live_rows(self, mem: int) -> list[int]:
        return [r for r, m in enumerate(self._row_memory) if m == mem and r not in self._deleted]

    def memory_stats(self, memory_idx: int) -> tuple[int, float]:
        rows = self._live_rows(memory_idx)
        return len(rows), (sum(self._row_len[r] for r in rows) / len(rows) if rows else 0.0)

    def _idf(self, token: str, mem: int, n_docs: int) -> float:
        rows = self._postings.get(mem, {}).get(token, {})
        df = sum(1 for r in rows if r not in self._deleted)
        return math.log(1.0 + (n_docs - df + 0.5) / (df + 0.5))

    def idf(self, tokens: list[list[str]], memory_idx: Sequence[int] | torch.Tensor) -> list[list[float]]:
        mems = check_batch(tokens, memory_idx, "token lists")
        return [[self._idf(t, m, self.memory_stats(m)[0]) for t in toks] for toks, m in zip(tokens, mems, strict=True)]

    def doc_tokens(self, rows: Sequence[int] | torch.Tensor) -> list[list[str]]:
        return [list(self._row_tokens[r]) for r in as_int_list(rows)]

    def term_tokens(self, term_ids: torch.Tensor) -> list[str]:
        return [self._term_key[t][1] for t in as_int_list(term_ids)]

    def feedback_terms(self, rows: torch.Tensor, min_chars: int, terms: int,
                       term_order: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Per query: the distinct tokens of its rows with at least `min_chars` characters, sorted by
        token ("alphabetical") or by idf in the row's memory descending, then token ("idf"); the first
        `terms` of them, as (query index, term id) pairs."""
        check_term_order(term_order)
        row_lists = [[r for r in query_rows if r >= 0] for query_rows in torch.as_tensor(rows).tolist()]
        empty = torch.zeros(0, dtype=torch.long, device=self.device)
        picked = [r for query_rows in row_lists for r in query_rows]
        if not picked or terms <= 0:
            return empty, empty
        if max(picked) >= self.num_rows:
            raise IndexError(f"BM25 feedback_terms: row {max(picked)} does not exist (rows 0..{self.num_rows - 1})")
        live_docs: dict[int, int] = {}  # memory -> N, once per call
        pair_query: list[int] = []
        pair_term: list[int] = []
        for query, query_rows in enumerate(row_lists):
            pool = {self._term_id[(self._row_memory[r], t)] for r in query_rows for t in self._row_tokens[r]
                    if len(t) >= min_chars}

            def order(term: int) -> tuple[Any, ...]:
                mem, token = self._term_key[term]
                if term_order == "alphabetical":
                    return token, term
                if mem not in live_docs:
                    live_docs[mem] = self.memory_stats(mem)[0]
                return -self._idf(token, mem, live_docs[mem]), token, term

            chosen = sorted(pool, key=order)[:terms]
            pair_query.extend([query] * len(chosen))
            pair_term.extend(chosen)
        return (torch.tensor(pair_query, dtype=torch.long, device=self.device),
                torch.tensor(pair_term, dtype=torch.long, device=self.device))

    def _score_one(self, query: list[str], mem: int) -> dict[int, float]:
        """Each row's score as BM25Index gives it (module doc): a float64 sum of grid weights would tie where
        the float32 scores tie and rank by rounding noise where they did not, and differ by 1 ulp."""
        n_docs, avgdl = self.memory_stats(mem)
        scores: dict[int, float] = {}
        postings = self._postings.get(mem, {})
        for token in query:  # each occurrence counts
            idf = self._idf(token, mem, n_docs)
            for row, tf in postings.get(token, {}).items():
                if row in self._deleted:
                    continue
                norm = self.k1 * (1.0 - self.b + self.b * self._row_len[row] / avgdl)
                scores[row] = scores.get(row, 0.0) + _grid_weight(idf * tf / (tf + norm))
        return {row: float(np.float32(score)) for row, score in scores.items()}

    def scores(
        self, queries: list[list[str]], memory_idx: Sequence[int] | torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        mems = check_batch(queries, memory_idx, "queries")
        live = [self._live_rows(m) for m in mems]
        width = max((len(r) for r in live), default=0)
        out = torch.zeros((len(queries), width), dtype=torch.float32)
        rows_out = torch.full((len(queries), width), -1, dtype=torch.long)
        for qi, (query, mem, rows) in enumerate(zip(queries, mems, live, strict=True)):
            scored = self._score_one(query, mem)
            for col, row in enumerate(rows):
                out[qi, col] = scored.get(row, 0.0)
                rows_out[qi, col] = row
        return out.to(self.device), rows_out.to(self.device)

    @staticmethod
    def _check_no_kernels(kernels: str) -> None:
        if check_kernels(kernels) != "torch":
            raise ValueError("ReferenceBM25 has no Triton kernels: retrieve.kernels=triton needs "
                             "index.bm25_backend=torch")

    def search(
        self, queries: list[list[str]], memory_idx: Sequence[int] | torch.Tensor, k: int, kernels: str = "torch"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        k = check_k(k)
        self._check_no_kernels(kernels)
        mems = check_batch(queries, memory_idx, "queries")
        out = torch.zeros((len(queries), k), dtype=torch.float32)
        rows_out = torch.full((len(queries), k), -1, dtype=torch.long)
        for qi, (query, mem) in enumerate(zip(queries, mems, strict=True)):
            scored = self._score_one(query, mem)
            ranked = sorted(((s, r) for r, s in scored.items() if s > 0), key=lambda sr: (-sr[0], sr[1]))[:k]
            for col, (score, row) in enumerate(ranked):
                out[qi, col] = score
                rows_out[qi, col] = row
        return out.to(self.device), rows_out.to(self.device)

    def search_encoded(
        self, pair_query: torch.Tensor, pair_term: torch.Tensor, memory_idx: Sequence[int] | torch.Tensor, k: int,
        kernels: str = "torch",
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`search` on the tokens the pairs name, query by query."""
        k = check_k(k)
        self._check_no_kernels(kernels)
        mems = as_int_list(memory_idx)
        pair_query = torch.as_tensor(pair_query, dtype=torch.long).cpu()
        pair_term = torch.as_tensor(pair_term, dtype=torch.long).cpu()
        check_pairs(pair_query, pair_term, len(mems), len(self._term_key))
        queries: list[list[str]] = [[] for _ in mems]
        for query, term in zip(pair_query.tolist(), pair_term.tolist(), strict=True):
            mem, token = self._term_key[term]
            if mem != mems[query]:
                raise ValueError("BM25 search_encoded: a term id belongs to another memory than its query")
            queries[query].append(token)
        return self.search(queries, mems, k)

    def state_dict(self) -> dict[str, Any]:
        return {
            "k1": self.k1,
            "b": self.b,
            "postings": {m: {t: dict(r) for t, r in p.items()} for m, p in self._postings.items()},
            "row_memory": list(self._row_memory),
            "row_len": list(self._row_len),
            "row_tokens": [list(t) for t in self._row_tokens],
            "deleted": sorted(self._deleted),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.k1, self.b = float(state["k1"]), float(state["b"])
        self._postings = {int(m): {t: dict(r) for t, r in p.items()} for m, p in state["postings"].items()}
        self._row_memory = list(state["row_memory"])
        self._row_len = list(state["row_len"])
        self._row_tokens = [list(t) for t in state["row_tokens"]]
        self._deleted = set(state["deleted"])
        # term ids follow from the rows in add order (as `add` gave them)
        self._term_id, self._term_key = {}, []
        for mem, tokens in zip(self._row_memory, self._row_tokens, strict=True):
            self._name_terms(mem, tokens)

    def to(self, device: str | torch.device) -> ReferenceBM25:
        self.device = torch.device(device)
        return self
