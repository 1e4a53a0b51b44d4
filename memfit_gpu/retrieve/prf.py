"""Pseudo-relevance feedback terms (SPEC read path 6).

From the top `docs` episodes of the first stage take their distinct tokens of at least
`min_token_chars` characters (tokens longer than 3), then keep `terms` of them:
- term_order "idf": highest idf in the question's memory first, ties by token text (the paper);
- term_order "alphabetical": the first ones in alphabetical order (the released code's bug).
The PRF query is these terms in that order: each term once for BM25, and their space-joined text
for the dense encoder.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from memfit_gpu.retrieve.pack import split_by_counts


def choose_terms(token_lists: Sequence[Sequence[str]], idf: dict[str, float] | None, terms: int,
                 term_order: str) -> list[str]:
    """Terms for one question from the token lists of its feedback episodes."""
    pool = set()
    for tokens in token_lists:
        pool.update(tokens)
    if term_order == "alphabetical":
        return sorted(pool)[:terms]
    if term_order != "idf":
        raise ValueError(f"retrieve.prf.term_order={term_order!r} is not one of idf, alphabetical")
    if idf is None:
        raise ValueError("term_order idf needs the idf of every candidate token")
    return sorted(pool, key=lambda t: (-idf[t], t))[:terms]


def _choose_by_key(token_lists: Sequence[Sequence[str]], key: dict[str, tuple[float, str]], terms: int) -> list[str]:
    """`choose_terms` (idf order) with the sort keys (-idf, token) precomputed per memory."""
    pool = set()
    for tokens in token_lists:
        pool.update(tokens)
    return sorted(pool, key=key.__getitem__)[:terms]


def choose_terms_batch(token_lists: Sequence[Sequence[Sequence[str]]], memory_idx: Sequence[int], bm25,
                       terms: int, term_order: str) -> list[list[str]]:
    """`choose_terms` for every question; one idf call for all distinct (memory, token) pairs."""
    if term_order == "idf":
        wanted: dict[int, set[str]] = {}
        for lists, m in zip(token_lists, memory_idx, strict=False):
            bucket = wanted.setdefault(m, set())
            for tokens in lists:
                bucket.update(tokens)
        mems = sorted(wanted)
        token_rows = [sorted(wanted[m]) for m in mems]
        values = bm25.idf(token_rows, mems) if mems else []
        keys = {m: {t: (-v, t) for t, v in zip(toks, vals, strict=True)}
                for m, toks, vals in zip(mems, token_rows, values, strict=True)}
        return [_choose_by_key(lists, keys[m], terms) if lists else []
                for lists, m in zip(token_lists, memory_idx, strict=True)]
    return [choose_terms(lists, None, terms, term_order) for lists in token_lists]


def feedback_terms_batch(bm25: Any, doc_rows: torch.Tensor, memory_idx: Sequence[int], min_chars: int, terms: int,
                         term_order: str) -> tuple[list[list[str]], tuple[torch.Tensor, torch.Tensor] | None]:
    """PRF terms of every question from its feedback rows doc_rows [Q, D] (-1 pads).

    Returns the terms per question and, from a `BM25Index`, the same queries as (question, term id)
    pairs for `search_encoded`: the index picks them from its postings in one tensor pass. Any other
    index (`ReferenceBM25`) goes through its `doc_tokens` and `idf` (pairs None)."""
    n_q = doc_rows.shape[0]
    if hasattr(bm25, "feedback_terms"):
        query, term = bm25.feedback_terms(doc_rows, min_chars, terms, term_order)
        counts = torch.bincount(query.cpu(), minlength=n_q).tolist()  # the pairs come query by query
        return split_by_counts(bm25.term_tokens(term), counts), (query, term)
    docs = [[r for r in rows if r >= 0] for rows in doc_rows.tolist()]
    flat = [[t for t in toks if len(t) >= min_chars] for toks in bm25.doc_tokens([r for rows in docs for r in rows])]
    lists = split_by_counts(flat, [len(rows) for rows in docs])
    return choose_terms_batch(lists, memory_idx, bm25, terms, term_order), None
