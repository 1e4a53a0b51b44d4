"""Speaker names: the one whole-word rule the whole package uses (SPEC read path 2).

A name matches text when it occurs, lowercased, with no word character (`\\w`) right before or right
after it. Question constraints (which speakers a question names), the `mention` speaker boost and
anything else that asks "does this text name that person" call `mentions`; nothing else compiles a
name pattern. Speaker sets are int64 bit masks per memory, so a memory holds at most `MAX_SPEAKERS`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from functools import lru_cache

MAX_SPEAKERS = 63  # bits 0..62 of an int64 stay non-negative


def normalise(name: str) -> str:
    """The form names are compared in: lowercased, outer whitespace dropped."""
    return name.lower().strip()


@lru_cache(maxsize=8192)
def name_pattern(name: str) -> re.Pattern[str]:
    """Whole-word pattern of a normalised name; lookarounds (not `\\b`) so names that start or end
    with a non-word character ("J.", "O'Neil") follow the same rule as plain ones."""
    return re.compile(r"(?<!\w)" + re.escape(name) + r"(?!\w)")


def mentions(text_lower: str, name: str) -> bool:
    """Whether lowercased text names the normalised `name` as a whole word.

    The substring test is implied by the match and spares most regex calls."""
    return name in text_lower and name_pattern(name).search(text_lower) is not None


def mentioned(text_lower: str, names: Iterable[str], min_chars: int) -> set[str]:
    """The normalised names of at least `min_chars` characters that lowercased text mentions."""
    found: set[str] = set()
    for name in names:
        low = normalise(name)
        if len(low) >= min_chars and mentions(text_lower, low):
            found.add(low)
    return found
