"""The BM25 tokenizer (SPEC write path 2): lowercase `\\w+` runs (unicode), no stop words, no stemming.

Documents, questions and PRF queries all go through it, so a term means the same everywhere.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

_TOKEN = re.compile(r"\w+")


def tokenize(text: str) -> list[str]:
    """Lowercase ``\\w+`` runs (unicode), no stop words, no stemming (SPEC write path 2)."""
    return _TOKEN.findall(text.lower())


def tokenize_many(texts: Sequence[str]) -> list[list[str]]:
    """`tokenize` over a batch of texts."""
    findall = _TOKEN.findall
    return [findall(text.lower()) for text in texts]
