"""Shared reading helpers for the loaders: JSON with file-naming errors, typed field access, dates.

Every failure is a DataError that names the file, the item and the field, so a broken download
or a hand-edited file points at the exact spot instead of a KeyError deep in a loader.
"""

from __future__ import annotations

import json
import json.decoder
import json.scanner
import math
import re
from datetime import datetime
from pathlib import Path
from typing import Any

from memfit_gpu.data.schema import HUGE_TURN_CHARS, DataError, Memory, unique_turn_id
from memfit_gpu.months import MONTH_NUMBER

_MISSING = object()

_LOCOMO_DATE = re.compile(
    r"^\s*(\d{1,2}):(\d{2})\s*([ap])\.?m\.?\s+on\s+(\d{1,2})\s+([A-Za-z]+),?\s+(\d{4})\s*$", re.IGNORECASE
)
_LONGMEMEVAL_DATE = re.compile(
    r"^\s*(\d{4})/(\d{1,2})/(\d{1,2})\s*(?:\([A-Za-z]+\))?\s*(?:(\d{1,2}):(\d{2}))?\s*$"
)
_ISO_DAY = re.compile(r"^\s*(\d{4})-(\d{1,2})-(\d{1,2})\s*$")


class DuplicateKeyError(ValueError):
    """A JSON object that writes one key twice. Python's json keeps the last value and drops the first without a
    word, so a hand-edited or merged file would load with data silently lost."""

    def __init__(self, key: str, lineno: int | None = None, colno: int | None = None):
        self.key, self.lineno, self.colno = key, lineno, colno
        at = f" at line {lineno} column {colno}" if lineno is not None else ""
        super().__init__(f"key {key!r} appears twice in the object{at}")


def _refuse_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise DuplicateKeyError(key)
            seen.add(key)
    return obj


def _locate_duplicate(text: str) -> DuplicateKeyError:
    """The first object of `text` that writes a key twice, with its line and column. The C parser's pairs hook
    is not told where an object starts, so the text is parsed again (only on this error path) by json's
    pure-Python scanner, whose object parser is: it finds the same object, the innermost first, as the hook."""
    decoder = json.JSONDecoder()

    def parse_object(s_and_end: tuple[str, int], strict: bool, scan_once: Any, object_hook: Any,
                     object_pairs_hook: Any, memo: Any = None) -> tuple[list[tuple[str, Any]], int]:
        pairs, end = json.decoder.JSONObject(s_and_end, strict, scan_once, None, list, memo)
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                start = s_and_end[1] - 1  # the object's "{"
                raise DuplicateKeyError(key, text.count("\n", 0, start) + 1, start - text.rfind("\n", 0, start))
            seen.add(key)
        return pairs, end

    decoder.parse_object = parse_object  # type: ignore[attr-defined]
    decoder.scan_once = json.scanner.py_make_scanner(decoder)  # type: ignore[attr-defined]
    try:
        decoder.decode(text)
    except DuplicateKeyError as exc:
        return exc
    raise AssertionError("the C parser found a repeated key the Python scanner does not")  # pragma: no cover


def loads(data: str | bytes) -> Any:
    """json.loads refusing an object that writes a key twice (DuplicateKeyError naming the key, the line and
    the column of its object); JSONDecodeError as json.loads raises it."""
    try:
        return json.loads(data, object_pairs_hook=_refuse_duplicate_keys)
    except DuplicateKeyError:
        text = data if isinstance(data, str) else data.decode(json.detect_encoding(data))
        raise _locate_duplicate(text) from None


def json_error_text(exc: json.JSONDecodeError, line: bool = True) -> str:
    """What is wrong and where: "Expecting value at line 3 column 5" (`line` False: "... at column 5", for one
    line of a JSON Lines file)."""
    where = f"line {exc.lineno} column {exc.colno}" if line else f"column {exc.colno}"
    # Some messages already end in "at" ("Unterminated string starting at"): the position completes them.
    return f"{exc.msg} {where}" if exc.msg.endswith(" at") else f"{exc.msg} at {where}"


def read_json(path: Path) -> Any:
    """Parse a JSON file; a file that is not JSON, or that writes a key twice in one object, is a DataError
    naming the file and the position."""
    try:
        with open(path, "rb") as handle:
            return loads(handle.read())
    except json.JSONDecodeError as exc:
        raise DataError(str(path), None, None, f"not valid JSON ({json_error_text(exc)})") from exc
    except DuplicateKeyError as exc:
        raise DataError(str(path), None, exc.key, f"written twice in the object at line {exc.lineno} column "
                                                  f"{exc.colno} (JSON would keep the last value and lose the first "
                                                  "silently)") from None
    except UnicodeDecodeError as exc:
        raise DataError(str(path), None, None, f"not UTF-8 text ({exc})") from exc


def check_turns(benchmark: str, memory: Memory, problems: list[str]) -> None:
    """Turn quirks every loader reports the same way (Benchmark.problems), after a memory is read.

    - A turn id seen twice in one memory: the later turns get `unique_turn_id` ids ("D1:3#dup2"), so the
      store, packs and images can tell them apart; evidence keeps the id as written, and retrieval
      diagnostics count any turn carrying it (`written_turn_id`) as that gold turn.
    - An empty (or whitespace-only) turn: kept, so turn ids and neighbours stay as in the benchmark.
    - A turn longer than HUGE_TURN_CHARS: kept whole in the store; its excerpt is cut to
      pack.max_excerpt_chars when a reader sees it.
    Then the memory's questions (`check_questions`).
    """
    seen: dict[str, int] = {}
    taken = {turn.turn_id for turn in memory.turns()}
    renamed: list[str] = []
    empty: list[str] = []
    for turn in memory.turns():
        written = turn.turn_id
        if not turn.text.strip():
            empty.append(written)
        if len(turn.text) > HUGE_TURN_CHARS:
            problems.append(f"{benchmark} {memory.memory_id}: turn {written} holds {len(turn.text):,} characters "
                            f"(more than {HUGE_TURN_CHARS:,}): kept; its excerpt is cut to pack.max_excerpt_chars")
        count = seen.get(written, 0) + 1
        seen[written] = count
        if count > 1:
            number = count
            while unique_turn_id(written, number) in taken:
                number += 1
            turn.turn_id = unique_turn_id(written, number)
            taken.add(turn.turn_id)
            renamed.append(f"{written} -> {turn.turn_id}")
    if renamed:
        problems.append(f"{benchmark} {memory.memory_id}: turn ids repeated within the memory, later turns renamed "
                        f"({', '.join(renamed[:10])}{' ...' if len(renamed) > 10 else ''}); evidence naming such "
                        "an id matches every turn that carries it")
    if empty:
        problems.append(f"{benchmark} {memory.memory_id}: {len(empty)} empty turn{'s' if len(empty) > 1 else ''} "
                        f"({', '.join(empty[:10])}{' ...' if len(empty) > 10 else ''}): kept")
    check_questions(benchmark, memory, problems)


def check_questions(benchmark: str, memory: Memory, problems: list[str]) -> None:
    """Questions that cannot be scored, reported the same way by every loader and excluded from scoring
    (`Question.evaluated` False, the reason in `extra["excluded"]`; `select_questions` never selects
    them, whichever categories it is given): an empty (or whitespace-only) question, an empty gold answer,
    and every question of a memory whose conversation holds no text at all. A question the benchmark does
    not score by default (LoCoMo's category 5) is checked too: a category list can select it for scoring."""
    conversation_empty = not any(turn.text.strip() for turn in memory.turns())
    excluded: dict[str, list[str]] = {}
    for question in memory.questions:
        if conversation_empty:
            why = "the conversation is empty"
        elif not question.question.strip():
            why = "the question is empty"
        elif not question.answer.strip():
            why = "the gold answer is empty"
        else:
            continue
        question.evaluated = False
        question.extra["excluded"] = why
        excluded.setdefault(why, []).append(question.question_id)
    for why, ids in excluded.items():
        problems.append(f"{benchmark} {memory.memory_id}: {why} for {len(ids)} question{'s' if len(ids) > 1 else ''} "
                        f"({', '.join(ids[:10])}{' ...' if len(ids) > 10 else ''}): excluded from scoring")


def type_name(types: type | tuple[type, ...]) -> str:
    if isinstance(types, tuple):
        return " or ".join(t.__name__ for t in types)
    return types.__name__


def get(
    obj: dict[str, Any],
    key: str,
    types: type | tuple[type, ...],
    file: Path | str,
    item: str | int | None,
    field_path: str | None = None,
    default: Any = _MISSING,
) -> Any:
    """obj[key] checked against `types`; missing (without a default) or mistyped -> DataError.

    `field_path` is how the field is named in the error (e.g. "qa[3].question"); defaults to key.
    bool is rejected where int is asked for, since JSON true/false is never a count or an answer.
    """
    name = field_path or key
    if not isinstance(obj, dict):
        raise DataError(
            str(file),
            item,
            name.rsplit(".", 1)[0] if "." in name else None,
            f"expected an object, got {type(obj).__name__}",
        )
    if key not in obj or obj[key] is None:
        if default is not _MISSING:
            return default
        raise DataError(str(file), item, name, "required field is missing")
    value = obj[key]
    wanted = types if isinstance(types, tuple) else (types,)
    if isinstance(value, bool) and bool not in wanted:
        raise DataError(str(file), item, name, f"expected {type_name(types)}, got bool")
    if not isinstance(value, wanted):
        raise DataError(str(file), item, name, f"expected {type_name(types)}, got {type(value).__name__}")
    return value


def answer_text(value: Any, file: Path | str, item: str | int | None, field_path: str) -> str:
    """Gold answers are strings or integers (LoCoMo, LongMemEval): both become text. NaN and Infinity (which
    Python's json reads, and 1e400 reads as infinity) are refused: they would be scored as the text "nan"."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise DataError(str(file), item, field_path, f"expected str or int, got {type(value).__name__}")
    if isinstance(value, float) and not math.isfinite(value):
        raise DataError(str(file), item, field_path, f"{value} is not a finite number")
    return value if isinstance(value, str) else str(value)


def str_list(value: Any, file: Path | str, item: str | int | None, field_path: str) -> list[str]:
    """A list of strings; a bare string is accepted as a one-element list."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise DataError(str(file), item, field_path, f"expected a list of str, got {value!r:.80}")
    return list(value)


def _iso(year: int, month: int, day: int, hour: int = 0, minute: int = 0) -> str:
    return datetime(year, month, day, hour, minute).isoformat()


def parse_locomo_date(text: str) -> str | None:
    """'1:56 pm on 8 May, 2023' -> '2023-05-08T13:56:00'; None when it does not parse."""
    match = _LOCOMO_DATE.match(text)
    if not match:
        return None
    hour, minute, half, day, month_name, year = match.groups()
    month = MONTH_NUMBER.get(month_name.lower())
    hour_24 = int(hour) % 12 + (12 if half.lower() == "p" else 0)
    if month is None or int(hour) > 12:
        return None
    try:
        return _iso(int(year), month, int(day), hour_24, int(minute))
    except ValueError:
        return None


def parse_longmemeval_date(text: str) -> str | None:
    """'2023/05/27 (Sat) 21:08' -> '2023-05-27T21:08:00'; None when it does not parse."""
    match = _LONGMEMEVAL_DATE.match(text)
    if not match:
        return None
    year, month, day, hour, minute = match.groups()
    try:
        return _iso(int(year), int(month), int(day), int(hour or 0), int(minute or 0))
    except ValueError:
        return None


def parse_iso_day(text: str) -> str | None:
    """'2024-06-17' -> '2024-06-17T00:00:00' (MemGallery session dates); None when it does not parse."""
    match = _ISO_DAY.match(text)
    if not match:
        return None
    try:
        return _iso(*(int(g) for g in match.groups()))
    except ValueError:
        return None
