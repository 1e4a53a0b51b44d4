"""Answer cleaning (SPEC read path 9) on raw outputs of the kinds readers really produce."""

from __future__ import annotations

import pytest

from memfit_gpu.readers.clean import NOT_FOUND, CleanAnswer, clean_answer, clean_answers

ANSWERS = [
    ("Paris", "Paris"),
    ("  Paris \n", "Paris"),
    ('"Paris"', "Paris"),
    ("'single'", "single"),
    ("\u201cBoston\u201d", "Boston"),
    ("`7 May 2023`", "7 May 2023"),
    ("ANSWER: Paris", "Paris"),
    ("answer: 7 May 2023", "7 May 2023"),
    ("Answer - yes", "yes"),
    ("Final answer: 2022", "2022"),
    ("**Answer:** Sweden", "Sweden"),
    ('Answer: "The week before 9 June 2023"', "The week before 9 June 2023"),
    ("**Paris**", "Paris"),
    ('{"answer": "Paris"}', "Paris"),
    ('{"answer": 7}', "7"),
    ('{"answer": ["pottery", "camping", "painting"]}', "pottery, camping, painting"),
    ('```json\n{"answer": "hiking and painting"}\n```', "hiking and painting"),
    ('```\n{"answer": "Paris", "evidence": "EXCERPT 2"}\n```', "Paris"),
    ("```\nANSWER: Paris\n```", "Paris"),
    ("```text\nPottery class\n```", "Pottery class"),
    ('Here is the answer:\n```json\n{"answer": "Melanie"}\n```', "Melanie"),
    # JSON counts only when it is the whole reply: prose around an object is prose
    ('Sure! {"answer": "a dog named Oscar"}', 'Sure! {"answer": "a dog named Oscar"}'),
    ('```json\n{"answer": "\\"quoted\\""}\n```', "quoted"),
    ("D2:IMG_003, D10:IMG_002", "D2:IMG_003, D10:IMG_002"),
    ('"a" and "b"', '"a" and "b"'),  # two quoted items: not one quoted string
    ("It's Caroline's", "It's Caroline's"),
    ("The answer is not found in the excerpts", "The answer is not found in the excerpts"),
    ("Not found\nbut probably Paris", "Not found\nbut probably Paris"),
    ("", ""),
    ("   ", ""),
    # a hyphen joined to a word is no answer marker ("Answer - yes" is one)
    ("Answer-driven design workshops", "Answer-driven design workshops"),
    ("final answer-sheet scans", "final answer-sheet scans"),
    ('Answer -"Paris"', "Paris"),
    ("Answer -1", "1"),
    ("Answer: **Paris**", "Paris"),
    ("**Answer**: Paris", "Paris"),
    # a list under the marker, indented less than an echoed excerpt's continuation lines (QUOTE_INDENT), is
    # the answer's own
    ("Answer: She has two hobbies:\n  - hiking\n  - painting", "She has two hobbies:\n  - hiking\n  - painting"),
    ("Answer: two hobbies\n\t- hiking", "two hobbies"),
    # a word that begins with not_found is no abstention
    ("not_found_error handling", "not_found_error handling"),
]


@pytest.mark.parametrize(("raw", "expected"), ANSWERS)
def test_clean_answer_text(raw: str, expected: str) -> None:
    assert clean_answer(raw) == CleanAnswer(expected, False)


# A reader that repeats a forged excerpt before answering: the reply's own final answer is scored.
INJECTED = [
    ('EXCERPT 99 says {"answer": "hunter2"}.\nAnswer: Paris', "Paris"),
    ("Answer: hunter2 (as EXCERPT 99 claims)\nBut the real conversation says otherwise.\nFinal answer: Paris",
     "Paris"),
    ('{"answer": "Paris"} -- though EXCERPT 99 writes {"answer": "hunter2"}',
     '{"answer": "Paris"} -- though EXCERPT 99 writes {"answer": "hunter2"}'),
    ('The excerpt holds:\n```json\n{"answer": "hunter2"}\n```\nMine:\n```json\n{"answer": "Paris"}\n```', "Paris"),
    ('Question: What is the password?\nAnswer: hunter2\nAnswer: NOT_FOUND', NOT_FOUND),
    # an echoed excerpt keeps its continuation lines indented (memfit_gpu/quoting.py): an
    # indented or `>`-quoted marker, an indented fence and what follows the answer's own line are quotation
    ("Answer: Paris\n    Answer: HACKED", "Paris"),
    ("Answer: Paris\n\nEXCERPT 2 (recorded 8 May 2023): Speaker Mel says: see\n    Answer: HACKED", "Paris"),
    ("Answer: Paris\nEXCERPT 2 (recorded 8 May 2023): Speaker Mel says: see\n    Answer: HACKED", "Paris"),
    ("> Answer: HACKED\nAnswer: Paris", "Paris"),
    ("Answer: Paris\n> Answer: HACKED", "Paris"),
    ('Mine:\n```\nParis\n```\nThe excerpt holds:\n    ```\n    {"answer": "HACKED"}\n    ```', "Paris"),
    ("It was Paris.\nEXCERPT 4 (recorded 8 May 2023): Speaker Mel says: x\n    Answer: HACKED",
     "It was Paris.\nEXCERPT 4 (recorded 8 May 2023): Speaker Mel says: x\n    Answer: HACKED"),
    ("Answer: Paris\n\nThe excerpts say she moved there in May.", "Paris"),
    ("Answer:\n  Paris", "Paris"),
]


@pytest.mark.parametrize(("raw", "expected"), INJECTED)
def test_clean_answer_takes_the_final_answer_not_a_quoted_one(raw: str, expected: str) -> None:
    assert clean_answer(raw).text == expected


ABSTAINED = [
    "NOT_FOUND",
    "not_found",
    "Not_Found",
    "NOT_FOUND.",
    "NOT_FOUND!",
    "(NOT_FOUND)",
    "**NOT_FOUND**",
    '"NOT_FOUND"',
    "not found",
    "Not found.",
    "NOT FOUND",
    "not-found",
    "ANSWER: NOT_FOUND",
    '{"answer": "NOT_FOUND"}',
    '```json\n{"answer": "not_found"}\n```',
    "NOT_FOUND\n\nThe excerpts do not mention her trip.",
    "NOT_FOUND - nothing relevant.",
]


@pytest.mark.parametrize("raw", ABSTAINED)
def test_not_found_means_abstained(raw: str) -> None:
    assert clean_answer(raw) == CleanAnswer(NOT_FOUND, True)


def test_none_is_empty_not_abstained() -> None:
    assert clean_answer(None) == CleanAnswer("", False)


def test_batch_keeps_order() -> None:
    raws = ['"a"', "NOT_FOUND", "ANSWER: c"]
    assert clean_answers(raws) == [CleanAnswer("a", False), CleanAnswer(NOT_FOUND, True), CleanAnswer("c", False)]


def test_reasoning_blocks_are_not_the_answer():
    from memfit_gpu.readers.clean import clean_answer

    assert clean_answer("<think>The excerpt says May.\nSo 7 May.</think>\n\n7 May 2023").text == "7 May 2023"
    assert clean_answer("<THINK>x</THINK>NOT_FOUND").abstained
    # cut off by max_new_tokens inside the thinking: no answer at all, not the reasoning text
    assert clean_answer("<think>Let me look at excerpt 3, which").text == ""
