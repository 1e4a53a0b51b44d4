"""Pure date rules of the read path: query constraints (SPEC read path 2) and relative-date
resolution in excerpts (SPEC read path 9).

Shared by the batched path and the reference path; nothing here touches tensors or indexes.

Rules written down (each has a unit test with hand-computed dates in tests/retrieve/test_retrieve_dates.py):

Query constraints, from the lowercased question
- speaker: a known speaker name longer than 2 characters (BoostConfig.min_speaker_chars) that occurs
  as a whole word (`\\b` on both sides), compared lowercased.
- year: every `\\b20\\d\\d\\b`.
- month: full month names, 3-letter abbreviations and "sept", whole words. The modal verb "may" is
  a month only when it looks like a date: preceded by "in"/"of" ("in may", "of may"), by a word for a
  time of the year (last, early, late, mid, during, since, until, till, through, before, after: "last may",
  "early may", "mid-may"), by a day number ("8 may", "8th may"), or by another month and and/or/to/through
  or a dash, comma or slash ("march and may", "march-may"); or followed by a day number or a year ("may 8",
  "may 8th", "may 2023", "may, 2023") or by such a word or mark and another month ("may or june",
  "may-june", "may, june"). "What may Caroline do" is not a month.

Relative dates, resolved against the episode's session date (the anchor) and appended in
parentheses after the phrase, e.g. "yesterday" -> "yesterday (7 May 2023)":
- "yesterday" -> anchor - 1 day; "(the) day before yesterday" (or hyphenated) -> anchor - 2 days.
- "N days ago" / "N weeks ago" -> anchor - N days / - 7N days (N a numeral, a number word up to
  twelve, or "a"/"an" = 1).
- "last week" -> "the week before {anchor}".
- "last <weekday>" -> the latest such weekday strictly before the anchor (a Friday anchor's
  "last Friday" is 7 days earlier).
- "last/this/next month" -> the month name and year; "last/this/next year" -> the year.
- "N months ago" -> month arithmetic on (year, month), shown as "April 2023"; "N years ago" -> year.
Dates print as "8 May 2023" (day without a leading zero).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import date, datetime, timedelta
from typing import Any

from memfit_gpu.months import MONTH_NAMES, MONTH_NUMBER
from memfit_gpu.names import mentioned, mentions, normalise

# questions also write September "sept"
_MONTH_BY_WORD: dict[str, int] = {**MONTH_NUMBER, "sept": 9}

# the lookahead (every month word's first letter) changes nothing matched; it skips positions fast
_MONTH_WORD_RE = re.compile(r"(?=[jfmasond])\b(" + "|".join(sorted(_MONTH_BY_WORD, key=len, reverse=True)) + r")\b")
_YEAR_RE = re.compile(r"\b20\d\d\b")
# "may" counts as a month only in these contexts (see module docstring).
_OTHER_MONTHS = "|".join(sorted((w for w in _MONTH_BY_WORD if w != "may"), key=len, reverse=True))
_MAY_BEFORE_RE = re.compile(r"(?:\b(?:(?:in|of|last|during|since|until|till|through|before|after)\s+"
                            r"|(?:early|late|mid)(?:\s+|-))"
                            r"|\b\d{1,2}(?:st|nd|rd|th)?\s+"
                            r"|\b(?:" + _OTHER_MONTHS + r")(?:\s+(?:and|or|to|through)\s+|\s*[-–,/]\s*))$")
_MAY_AFTER_RE = re.compile(r"^(?:,?\s+(?:\d{1,2}(?:st|nd|rd|th)?\b|20\d\d\b|\d{4}\b)"
                           r"|(?:\s+(?:and|or|to|through)\s+|\s*[-–,/]\s*)(?:" + _OTHER_MONTHS + r")\b)")


@dataclass(frozen=True)
class QueryConstraints:
    """What a question names: speakers (lowercased names), years and months (1-12)."""

    speakers: frozenset[str] = frozenset()
    years: frozenset[int] = frozenset()
    months: frozenset[int] = frozenset()


def question_years(question: str) -> set[int]:
    return _years(question.lower())


def _years(text: str) -> set[int]:
    if "20" not in text:  # every year matched starts with it
        return set()
    return {int(m.group(0)) for m in _YEAR_RE.finditer(text)}


def question_months(question: str) -> set[int]:
    return _months(question.lower())


def _months(text: str) -> set[int]:
    months: set[int] = set()
    for match in _MONTH_WORD_RE.finditer(text):
        word = match.group(1)
        if word == "may":
            before, after = text[: match.start()], text[match.end():]
            if not (_MAY_BEFORE_RE.search(before) or _MAY_AFTER_RE.match(after)):
                continue
        months.add(_MONTH_BY_WORD[word])
    return months


def question_speakers(question: str, speakers: Iterable[str], min_chars: int = 3) -> set[str]:
    """Lowercased known speaker names the question mentions as whole words (SPEC: > 2 characters)."""
    return mentioned(question.lower(), speakers, min_chars)


def parse_constraints(question: str, speakers: Iterable[str], min_speaker_chars: int = 3) -> QueryConstraints:
    text = question.lower()
    return QueryConstraints(
        speakers=frozenset(mentioned(text, speakers, min_speaker_chars)),
        years=frozenset(_years(text)),
        months=frozenset(_months(text)),
    )


def text_mentions(text: str, name: str) -> bool:
    """Whole-word, case-insensitive occurrence of a (speaker) name in an episode's text."""
    return mentions(text.lower(), normalise(name))


# ---------------------------------------------------------------------------------------------
# Relative dates in excerpts (SPEC read path 9)

_NUMBER_WORDS = {
    "a": 1, "an": 1, "one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6,
    "seven": 7, "eight": 8, "nine": 9, "ten": 10, "eleven": 11, "twelve": 12,
}
_WEEKDAYS = ("monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday")
_NUM = r"(\d+|" + "|".join(_NUMBER_WORDS) + r")"

# The lookahead names every phrase's possible first character (y, d, a digit, a number word's, last/
# this/next): a no-op for what matches, it lets the engine skip most positions cheaply.
_RELATIVE_RE = re.compile(
    r"(?=[yaotfsenld\d])\b(?:"
    r"(?P<daybefore>day[\s-]+before[\s-]+yesterday)"  # before "yesterday": it holds it
    r"|(?P<yesterday>yesterday)"
    r"|(?P<n>" + _NUM[1:-1] + r")\s+(?P<unit>day|week|month|year)s?\s+ago"
    r"|(?P<lastweek>last\s+week)"
    r"|last\s+(?P<weekday>" + "|".join(_WEEKDAYS) + r")"
    r"|(?P<rel>last|this|next)\s+(?P<period>month|year)"
    r")\b",
    re.IGNORECASE,
)


def format_date(day: date) -> str:
    """8 May 2023 (no leading zero, full month name)."""
    return f"{day.day} {MONTH_NAMES[day.month - 1].capitalize()} {day.year}"


def recorded_date(when: Any) -> str:
    """A stored time (numpy datetime64) as excerpts print its day: "8 May 2023", or "unknown date" for a
    turn or summary stored without one (NaT)."""
    day = when.astype(object)
    return "unknown date" if day is None else format_date(day.date())


def format_month(year: int, month: int) -> str:
    return f"{MONTH_NAMES[month - 1].capitalize()} {year}"


def shift_month(year: int, month: int, delta: int) -> tuple[int, int]:
    index = year * 12 + (month - 1) + delta
    return index // 12, index % 12 + 1


def _number(token: str) -> int:
    token = token.lower()
    return int(token) if token.isdigit() else _NUMBER_WORDS[token]


def resolve_phrase(match: re.Match[str], anchor: date) -> str | None:
    """The resolved value for one relative-date phrase (without parentheses); None when it falls outside the
    calendar's years 1 to 9999 ("1000000 days ago", "yesterday" on 1 January of year 1): the phrase is then
    left as written, never an error that fails every read quoting the turn."""
    try:
        value = _resolve(match, anchor)
    except (OverflowError, ValueError):  # a day before 1 January 1 or after 9999, or a count past C's int
        return None
    year = int(value.rsplit(" ", 1)[-1])  # every value ends with its year: "8 May 2023", "May 2023", "2023"
    return value if 1 <= year <= 9999 else None


def _resolve(match: re.Match[str], anchor: date) -> str:
    groups = match.groupdict()
    if groups["daybefore"]:
        return format_date(anchor - timedelta(days=2))
    if groups["yesterday"]:
        return format_date(anchor - timedelta(days=1))
    if groups["n"]:
        count, unit = _number(groups["n"]), groups["unit"].lower()
        if unit == "day":
            return format_date(anchor - timedelta(days=count))
        if unit == "week":
            return format_date(anchor - timedelta(days=7 * count))
        if unit == "month":
            return format_month(*shift_month(anchor.year, anchor.month, -count))
        return str(anchor.year - count)
    if groups["lastweek"]:
        return f"the week before {format_date(anchor)}"
    if groups["weekday"]:
        target = _WEEKDAYS.index(groups["weekday"].lower())
        back = (anchor.weekday() - target) % 7 or 7
        return format_date(anchor - timedelta(days=back))
    delta = {"last": -1, "this": 0, "next": 1}[groups["rel"].lower()]
    if groups["period"].lower() == "month":
        return format_month(*shift_month(anchor.year, anchor.month, delta))
    return str(anchor.year + delta)


def resolve_relative_dates(text: str, anchor: date | datetime) -> str:
    """Append the resolved date in parentheses after every relative-date phrase of `text`."""
    if isinstance(anchor, datetime):
        anchor = anchor.date()
    def resolved(match: re.Match[str]) -> str:
        value = resolve_phrase(match, anchor)
        return match.group(0) if value is None else f"{match.group(0)} ({value})"

    return _RELATIVE_RE.sub(resolved, text)


def resolve_many(texts: Sequence[str], anchors: Sequence[date | datetime]) -> list[str]:
    """Batch form: one anchor per text."""
    if len(texts) != len(anchors):
        raise ValueError(f"resolve_many: {len(texts)} texts but {len(anchors)} anchors")
    return [resolve_relative_dates(t, a) for t, a in zip(texts, anchors, strict=False)]


def parse_iso(timestamp: str) -> datetime:
    """ISO 8601 timestamp of the schema (`2023-05-08T13:56:00`), with a clear error otherwise."""
    try:
        return datetime.fromisoformat(timestamp)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"not an ISO 8601 timestamp: {timestamp!r}") from exc
