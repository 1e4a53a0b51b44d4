"""Pseudo-relevance feedback terms (SPEC read path 6).

From the top `docs` episodes of the first stage take their distinct tokens of at least
`min_token_chars` characters (tokens longer than 3), then keep `terms` of them:
- term_order "idf": highest idf in the question's memory first, ties by token text (the paper);
- term_order "alphabetical": the first ones in alphabetical order (the released code's bug).
The PRF query is these terms in that order: each term once for BM25, and their space-joined text
for the dense encoder.

The index picks the terms (`LexicalIndex.feedback_terms`: the batched BM25 reads them from its
postings in one tensor pass, the reference BM25 one question at a time); `choose_terms` is the same
rule for one question written out, which the per-question reference path uses.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from memfit_gpu.index.protocols import LexicalIndex
from memfit_gpu.retrieve.pack import split_by_counts


def choose_terms(token_lists: Sequence[Sequence[str]], idf: dict[str, float] | None, terms: int,
                 term_order: str) -> list[str]:
    """Terms for one question from the token lists of its feedback episodes.

    Args:
        token_lists: the feedback episodes' tokens (already cut to `min_token_chars`).
        idf: the idf of every candidate token in the question's memory (only for "idf").
        terms: how many to keep.
        term_order: "idf" or "alphabetical".
    """
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


def feedback_terms_batch(bm25: LexicalIndex, doc_rows: torch.Tensor, min_chars: int, terms: int,
                         term_order: str) -> tuple[list[list[str]], tuple[torch.Tensor, torch.Tensor]]:
    """PRF terms of every question from its feedback rows doc_rows [Q, D] (-1 pads).

    Returns the terms per question and the same queries as (question, term id) pairs for
    `search_encoded`."""
    query, term = bm25.feedback_terms(doc_rows, min_chars, terms, term_order)
    counts = torch.bincount(query.cpu(), minlength=doc_rows.shape[0]).tolist()  # the pairs come query by query
    return split_by_counts(bm25.term_tokens(term), counts), (query, term)
