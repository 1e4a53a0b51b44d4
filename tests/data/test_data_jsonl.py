"""The own-data jsonl format (memfit_gpu/data/jsonl.py): what it refuses by file, line and field, what it
reads that other benchmarks never hold, and how the default selection treats its questions. Files are
written here; the example file is tested in tests/test_seams.py."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from memfit_gpu.cli import main
from memfit_gpu.config import DataConfig
from memfit_gpu.data import select_from_config
from memfit_gpu.data.jsonl import read, to_jsonl

TURNS = [{"speaker": "Ann", "text": "I keep bees in the garden."}, {"speaker": "Bo", "text": "How many hives?"},
         {"speaker": "Ann", "text": "Three hives, since May."}]


def _write(tmp_path: Path, *records: dict[str, Any], raw: bool = False) -> Path:
    path = tmp_path / "own.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=not raw) + "\n" for r in records), encoding="utf-8")
    return path


def _memory(questions: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return copy.deepcopy({"user_id": "u", "sessions": [{"session_id": "s1", "turns": TURNS}], "questions": questions,
                          **extra})


def test_the_default_selection_keeps_own_datas_evaluated_questions_and_no_label_is_special(tmp_path: Path) -> None:
    """The default excluded category "5" (LoCoMo's adversarial label) was applied to own data, and a question
    marked `evaluated: false` was scored anyway (any category list marks what it keeps scored)."""
    questions = [{"question": "How many hives?", "answer": "3", "category": "5"},
                 {"question": "Since when?", "answer": "May", "category": 5},
                 {"question": "Who keeps bees?", "answer": "Ann", "category": "who", "evaluated": False}]
    benchmark, report = read(_write(tmp_path, _memory(questions)))
    assert report.problems == []
    chosen = select_from_config(benchmark, DataConfig(benchmark="jsonl"))
    assert [(q.question, q.evaluated) for q in chosen.questions()] == [("How many hives?", True), ("Since when?", True)]
    named = select_from_config(benchmark, DataConfig(benchmark="jsonl", include_categories=["who"]))
    assert [(q.question, q.evaluated) for q in named.questions()] == [("Who keeps bees?", True)]
    every = select_from_config(benchmark, DataConfig(benchmark="jsonl", exclude_categories=[]))
    assert len(every.questions()) == 3


def test_a_raw_line_separator_inside_a_string_is_text_not_a_line_end(tmp_path: Path) -> None:
    """`to_jsonl` writes U+2028 and U+0085 raw; reading cut lines there (splitlines), so the file it wrote was
    refused as broken JSON, on line numbers that were not the file's."""
    text = "Three hives,\u2028since May.\u0085Honey in June."
    path = _write(tmp_path, _memory([], sessions=[{"session_id": "s1", "turns": [{"speaker": "Ann", "text": text}]}]),
                  raw=True)
    assert len(path.read_text(encoding="utf-8").split("\n")) == 2  # one line and the final newline
    benchmark, report = read(path)
    assert report.problems == [] and benchmark.memories[0].turns()[0].text == text
    again = tmp_path / "again.jsonl"
    again.write_text(to_jsonl(benchmark.memories), encoding="utf-8")
    assert read(again)[0].memories[0].turns()[0].text == text


@pytest.mark.parametrize(("change", "field", "reason"), [
    (lambda m: m["sessions"][0]["turns"][1].update(text="\ud800 hives"), "sessions[0].turns[1].text",
     "holds a lone surrogate (U+D800) at character 0"),
    (lambda m: m["questions"][0].update(question="How many \udc00?"), "questions[0].question", "lone surrogate"),
    (lambda m: m["questions"][0].update(answer="\ud83d"), "questions[0].answer", "lone surrogate"),
    (lambda m: m.update(speakers=["Ann", "\ud800"]), "speakers[1]", "lone surrogate"),
    (lambda m: m["questions"][0].update(answer=float("nan")), "questions[0].answer", "nan is not a finite number"),
    (lambda m: m["questions"][0].update(answer=float("inf")), "questions[0].answer", "inf is not a finite number"),
    (lambda m: m.update(speakers=[f"s{i}" for i in range(63)]), "speakers",
     "65 speakers (the list and the turns'); a memory holds at most 63"),
    (lambda m: m["questions"][0].update(question="bees " * 9000), "questions[0].question",
     "9,000 words; a query has at most 8,192"),
    (lambda m: m["questions"][0].update(category="Overall"), "questions[0].category",
     "'Overall' is no category label: results have a row per label and one `overall`"),
    (lambda m: m["questions"][0].update(category=" "), "questions[0].category", "' ' is no category label"),
])
def test_what_a_run_could_not_store_or_read_is_refused_by_validate(tmp_path: Path, capsys, change: Any, field: str,
                                                                   reason: str) -> None:
    """Each passed `memfit data validate` and then failed the run with a traceback (UnicodeEncodeError in
    the store's log, the store's 63-speaker limit, BM25's per-query limit) or became the gold "nan"."""
    record = _memory([{"question": "How many hives?", "answer": "3", "category": "count"}])
    change(record)
    path = _write(tmp_path, record)
    benchmark, report = read(path)
    assert len(report.errors) == 1, report.errors
    assert report.errors[0].startswith(f"{path}, item line 1 (user 'u'), field '{field}': ") and reason in report.errors[0]
    assert main(["data", "validate", str(path)]) == 2
    assert capsys.readouterr().err.startswith(f"memfit data: error: {path}: 1 error(s)")


def test_validate_lists_the_questions_a_run_leaves_unscored(tmp_path: Path, capsys) -> None:
    """validate said "ok, 2 questions, 0 warnings" and the run scored one: an empty gold answer, an empty
    conversation and a huge turn are quirks a run handles, and they are listed as warnings too."""
    record = _memory([{"question": "How many hives?", "answer": "   ", "category": "count"},
                      {"question": "Since when?", "answer": "May", "category": "when"}])
    path = _write(tmp_path, record)
    assert main(["data", "validate", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == ["warning: jsonl u: the gold answer is empty for 1 question (u:q0): excluded from scoring",
                   f"ok: {path}: 1 memories, 3 turns, 2 questions (1 scored by default), 1 warning(s)"]


def test_a_key_written_twice_on_a_line_is_an_error_naming_the_line_and_the_key(tmp_path: Path, capsys) -> None:
    """`"answer": "Rex", "answer": "Max"` validated ok and loaded Max: Python's json keeps the last value."""
    line = json.dumps(_memory([{"question": "Pet?", "answer": "Rex", "category": "pet"}]))
    path = tmp_path / "own.jsonl"
    path.write_text(line.replace('"answer": "Rex"', '"answer": "Rex", "answer": "Max"') + "\n", encoding="utf-8")
    column = line.index('{"question": "Pet?"') + 1
    benchmark, report = read(path)
    assert report.errors == [f"{path}, item line 1, field 'answer': written twice in the object at column {column} "
                             "(JSON would keep the last value and lose the first silently)"]
    assert main(["data", "validate", str(path)]) == 2
    assert capsys.readouterr().err.startswith(f"memfit data: error: {path}: 1 error(s)")


def test_a_session_repeating_the_id_of_the_entry_before_it_is_a_warning(tmp_path: Path, capsys) -> None:
    """Sessions `s1, s1` validated ok with no word and were stored as one session. One id may have several
    entries (a live memory's export writes interleaved sessions so, and they read back as they were): two in a
    row are never written so, and are now a warning; apart, as an export writes them, they are not."""
    turns = [dict(turn, turn_id=f"t{n}") for n, turn in enumerate(TURNS)]
    record = _memory([], sessions=[{"session_id": "s1", "turns": turns[:1]}, {"session_id": "s1", "turns": turns[1:]}])
    path = _write(tmp_path, record)
    benchmark, report = read(path)
    warning = (f"{path}, item line 1 (user 'u'), field 'sessions[1].session_id': 's1' is also the id of sessions[0], "
               "the entry before it: both are read as one session (give this one its own session_id if it is another)")
    assert (report.errors, benchmark.problems) == ([], [warning])
    assert main(["data", "validate", str(path)]) == 0
    assert capsys.readouterr().out.splitlines()[0] == f"warning: {warning}"
    # a session without an id takes S<n>, which the entry before may have taken
    record = _memory([], sessions=[{"session_id": "S2", "turns": turns[:1]}, {"turns": turns[1:]}])
    assert read(_write(tmp_path, record))[0].problems == [
        f"{path}, item line 1 (user 'u'), field 'sessions[1].session_id': its default id 'S2' is also the id of "
        "sessions[0], the entry before it: both are read as one session (give this one its own session_id if it is "
        "another)"]
    interleaved = _memory([], sessions=[{"session_id": "A", "turns": turns[:1]}, {"session_id": "B", "turns": turns[1:2]},
                                        {"session_id": "A", "turns": turns[2:]}])
    assert read(_write(tmp_path, interleaved))[0].problems == []
