"""Speaker names: the one whole-word rule the whole package uses (SPEC read path 2); user ids: the one
alphabet a live memory and its server take them in.

A name matches text when it occurs, lowercased, with no word character (`\\w`) right before or right
after it. Question constraints (which speakers a question names), the `mention` speaker boost and
anything else that asks "does this text name that person" call `mentions`; nothing else compiles a
name pattern. Speaker sets are int64 bit masks per memory, so a memory holds at most `MAX_SPEAKERS`.

A live memory's user ids (memfit_gpu.Memory, `memfit serve`, API keys) follow USER_ID_RULE: they travel
in URL paths and key files, so an id is one path segment that needs no percent-encoding and reads the
same however often a proxy or client decodes it (no `%`, `/`, dot segments or spaces).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from functools import lru_cache

MAX_SPEAKERS = 63  # bits 0..62 of an int64 stay non-negative

USER_ID_MAX = 128
# a live memory's speaker names, turn ids and session ids: labels, not text. A turn's text counts against its
# user's serve.max_text_mb_per_user; these are stored beside it (and a speaker name enters every prompt that
# quotes its turns), so they are bounded here.
LABEL_MAX = 256
USER_ID_RULE = (f"1 to {USER_ID_MAX} characters, ASCII letters, digits and _ - . @ : only, starting with a "
                "letter or digit")
_USER_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@:-]*")


def user_id_problem(user_id: object) -> str | None:
    """Why `user_id` is not a valid live user id (USER_ID_RULE), or None when it is."""
    if not isinstance(user_id, str):
        return f"a user id is a string, got {type(user_id).__name__}"
    if len(user_id) > USER_ID_MAX or _USER_ID.fullmatch(user_id) is None:
        return f"user id {ascii(user_id[:40])}{'...' if len(user_id) > 40 else ''} is not valid: {USER_ID_RULE}"
    return None


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
