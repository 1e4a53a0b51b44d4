"""Each rule of memfit_gpu/retrieve/dates.py against hand-computed dates.

Anchor 8 May 2023 is a Monday; 1 January 2023 is a Sunday.
"""

from __future__ import annotations

from datetime import date, datetime

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memfit_gpu.retrieve.dates import (
    format_date,
    parse_constraints,
    question_months,
    question_speakers,
    question_years,
    resolve_many,
    resolve_relative_dates,
    text_mentions,
)

MON = date(2023, 5, 8)
SUN_NEW_YEAR = date(2023, 1, 1)


@pytest.mark.parametrize(
    "text, anchor, expected",
    [
        ("I went there yesterday.", MON, "I went there yesterday (7 May 2023)."),
        # not "yesterday" inside it (it was resolved as yesterday: a day late)
        ("the day before yesterday we met", MON, "the day before yesterday (6 May 2023) we met"),
        ("Day before yesterday", SUN_NEW_YEAR, "Day before yesterday (30 December 2022)"),
        ("the day-before-yesterday", MON, "the day-before-yesterday (6 May 2023)"),
        ("Yesterday was fun", SUN_NEW_YEAR, "Yesterday (31 December 2022) was fun"),
        ("I moved 3 days ago", MON, "I moved 3 days ago (5 May 2023)"),
        ("I moved 1 day ago", MON, "I moved 1 day ago (7 May 2023)"),
        ("two weeks ago we met", MON, "two weeks ago (24 April 2023) we met"),
        ("a week ago", MON, "a week ago (1 May 2023)"),
        ("10 weeks ago", MON, "10 weeks ago (27 February 2023)"),
        ("last week I ran", MON, "last week (the week before 8 May 2023) I ran"),
        ("last Friday", MON, "last Friday (5 May 2023)"),
        ("last monday", MON, "last monday (1 May 2023)"),
        ("last Sunday", MON, "last Sunday (7 May 2023)"),
        ("last Saturday", SUN_NEW_YEAR, "last Saturday (31 December 2022)"),
        ("last Sunday", SUN_NEW_YEAR, "last Sunday (25 December 2022)"),
        ("last month", MON, "last month (April 2023)"),
        ("last month", SUN_NEW_YEAR, "last month (December 2022)"),
        ("this month", MON, "this month (May 2023)"),
        ("next month", datetime(2023, 12, 20, 9, 30), "next month (January 2024)"),
        ("last year", MON, "last year (2022)"),
        ("this year", MON, "this year (2023)"),
        ("next year", MON, "next year (2024)"),
        ("5 months ago", MON, "5 months ago (December 2022)"),
        ("three months ago", MON, "three months ago (February 2023)"),
        ("twelve months ago", MON, "twelve months ago (May 2022)"),
        ("two years ago", MON, "two years ago (2021)"),
        ("10 years ago", MON, "10 years ago (2013)"),
    ],
)
def test_each_relative_rule(text: str, anchor: date, expected: str) -> None:
    assert resolve_relative_dates(text, anchor) == expected


def test_non_phrases_untouched() -> None:
    text = "last weekend, the yesterdays, this week, weeks ago, a day"
    assert resolve_relative_dates(text, MON) == text


@pytest.mark.parametrize(("text", "anchor"), [
    ("The fossil formed 1000000 days ago.", MON),  # before 1 January of year 1: OverflowError
    ("That was 99999999999 days ago.", MON),  # past C's int: OverflowError
    ("1000000 years ago", MON),  # a year before 1
    ("5000000 months ago", MON),
    ("I met him yesterday.", date(1, 1, 1)),
    ("We move next year.", date(9999, 6, 1)),
    ("last month", date(1, 1, 5)),
])
def test_a_phrase_outside_the_calendar_is_left_as_written(text: str, anchor: date) -> None:
    """Such a turn's excerpt raised OverflowError in every search or answer that quoted it (a 500 from
    `memfit serve`, a failed run), until the turn was deleted."""
    assert resolve_relative_dates(text, anchor) == text
    # the phrases beside it are resolved as ever
    assert resolve_relative_dates("1000000 days ago and 3 days ago", MON) == "1000000 days ago and 3 days ago (5 May 2023)"


def test_several_phrases_and_batch() -> None:
    out = resolve_many(["yesterday and last year", "no dates"], [MON, SUN_NEW_YEAR])
    assert out == ["yesterday (7 May 2023) and last year (2022)", "no dates"]
    with pytest.raises(ValueError, match="2 texts but 1 anchors"):
        resolve_many(["a", "b"], [MON])


def test_format_date() -> None:
    assert format_date(date(2023, 5, 8)) == "8 May 2023"
    assert format_date(date(2022, 12, 31)) == "31 December 2022"


def test_years() -> None:
    assert question_years("What happened in 2022 and 2023?") == {2022, 2023}
    assert question_years("in 1999 or 20233 or a2022") == set()


@pytest.mark.parametrize(
    "question, months",
    [
        ("What did Melanie paint in January?", {1}),
        ("Where was she in Sept 2023?", {9}),
        ("in sep or oct", {9, 10}),
        ("What happened in may?", {5}),
        ("the end of May", {5}),
        ("on 8 May", {5}),
        ("on 8th may", {5}),
        ("may 7, 2023", {5}),
        ("may 2023", {5}),
        ("May, 2023", {5}),
        ("What may Caroline do next?", set()),
        ("May I ask you something", set()),
        ("she may be in june", {6}),
        # "may" after a word that names a time of the year, or beside another month
        ("What did she do last May?", {5}),
        ("early may", {5}),
        ("during May", {5}),
        ("between March and early May", {3, 5}),
        ("Which month, May or June?", {5, 6}),
        ("from april to may", {4, 5}),
        ("It may last", set()),
        ("They may or may not come", set()),
        ("this may help", set()),
        ("What did she do in mid-May?", {5}),
        ("late-May", {5}),
        ("march-may", {3, 5}),
        ("may-june", {5, 6}),
        ("May, June", {5, 6}),
        ("may, she said", set()),
        ("marching and decorating", set()),
        ("Mar and Dec", {3, 12}),
    ],
)
def test_months(question: str, months: set[int]) -> None:
    assert question_months(question) == months


def test_speakers_whole_word_and_min_length() -> None:
    names = ["Caroline", "Mel", "Jo", "Melanie"]
    assert question_speakers("What did Caroline and Melanie do?", names) == {"caroline", "melanie"}
    # "Mel" is not a whole word inside "Melanie"; "Jo" is too short.
    assert question_speakers("Did Melanie meet jo?", names) == {"melanie"}
    assert question_speakers("Did mel come?", names) == {"mel"}
    assert question_speakers("Did Jo come?", names, min_chars=2) == {"jo"}


def test_parse_constraints() -> None:
    c = parse_constraints("When did Caroline go to the LGBTQ support group in May 2023?", ["Caroline", "Melanie"])
    assert c.speakers == {"caroline"} and c.years == {2023} and c.months == {5}


def test_text_mentions() -> None:
    assert text_mentions("Speaker Caroline says: hi", "caroline")
    assert not text_mentions("Carolines", "caroline")


# ---------------------------------------------------------------- fast paths change nothing matched
_PIECES = ["yesterday", "Yesterday", "2", "٣", "a", "an", "one", "Twelve", "day", "days", "weeks", "month",
           "years", "ago", "AGO", "last", "Last", "this", "next", "week", "monday", "Friday", "may", "May",
           "sept", "in", "of", "8th", "2023", "the", "before", "june", "or", "early", "day-before-yesterday", "x", "ſ", "K", ",", ".", " ", "  ", "\n", "-"]


@settings(max_examples=400, deadline=None, derandomize=True)
@given(st.lists(st.sampled_from(_PIECES), max_size=14).map(" ".join))
def test_lookahead_regexes_match_what_the_plain_ones_match(text: str) -> None:
    import re

    from memfit_gpu.retrieve import dates
    from memfit_gpu.retrieve.pack import may_hold_relative_date

    anchor = date(2023, 5, 8)
    plain_relative = re.compile(dates._RELATIVE_RE.pattern.replace("(?=[yaotfsenld\\d])", "", 1), re.IGNORECASE)
    assert plain_relative.pattern != dates._RELATIVE_RE.pattern
    expected = plain_relative.sub(lambda m: f"{m.group(0)} ({dates.resolve_phrase(m, anchor)})", text)
    assert resolve_relative_dates(text, anchor) == expected
    if plain_relative.search(text):
        assert may_hold_relative_date(text.lower())  # the prefilter never hides a phrase
    plain_month = re.compile(dates._MONTH_WORD_RE.pattern.replace("(?=[jfmasond])", "", 1))
    low = text.lower()
    assert [m.span() for m in dates._MONTH_WORD_RE.finditer(low)] == [m.span() for m in plain_month.finditer(low)]
    assert question_years(text) == {int(m) for m in re.findall(r"\b20\d\d\b", low)}


def test_prefilter_sends_non_ascii_text_to_the_regex() -> None:
    from memfit_gpu.retrieve.pack import excerpt_body, may_hold_relative_date

    # re.IGNORECASE folds the long s onto "s", lower() does not: the substring test must not decide
    assert resolve_relative_dates("laſt week", date(2023, 5, 8)) == "laſt week (the week before 8 May 2023)"
    assert may_hold_relative_date("laſt week")
    assert not may_hold_relative_date("we met at the station")
    body = excerpt_body("DATE: 8 May, 2023 | Speaker Ann says: laſt week", date(2023, 5, 8), True)
    assert body == "Speaker Ann says: laſt week (the week before 8 May 2023)"
