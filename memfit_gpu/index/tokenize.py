"""The BM25 tokenizer (SPEC write path 2): lowercase `\\w+` runs (unicode), no stop words, no stemming.

Documents, questions and PRF queries all go through it, so a term means the same everywhere.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

TOKEN_PATTERN = re.compile(r"\w+")
_TOKEN = TOKEN_PATTERN
# A query is a question, not a document: BM25's exact scoring takes up to 65,536 known tokens a query and
# PRF adds its terms to it, so a longer query (a live search, an own-data question) is refused up front.
MAX_QUERY_TOKENS = 8192


def tokenize(text: str) -> list[str]:
    """Lowercase ``\\w+`` runs (unicode), no stop words, no stemming (SPEC write path 2)."""
    return _TOKEN.findall(text.lower())


def tokenize_many(texts: Sequence[str]) -> list[list[str]]:
    """`tokenize` over a batch of texts."""
    findall = _TOKEN.findall
    return [findall(text.lower()) for text in texts]


def query_length_problem(text: str) -> str | None:
    """Why `text` is too long to be a query (over MAX_QUERY_TOKENS tokens), or None."""
    if len(text) <= MAX_QUERY_TOKENS:  # fewer characters than the limit: fewer tokens too
        return None
    count = len(tokenize(text))
    if count <= MAX_QUERY_TOKENS:
        return None
    return f"{count:,} words; a query has at most {MAX_QUERY_TOKENS:,} (index.tokenize.MAX_QUERY_TOKENS)"
