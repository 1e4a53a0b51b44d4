"""LongMemEval (S, M and oracle files; xiaowu0162/longmemeval-cleaned) -> Benchmark.

Every question owns its haystack, so each question is its own memory (memory_id = question_id).
Sessions are sorted by date (stable): the oracle file lists them out of order, and nothing downstream
may assume file order is time order. Turn ids are f"{session_id}:{n}" with n counting from 1 within
the session as stored in the file, so they stay stable whatever the sort does.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tqdm import tqdm

from memfit_gpu.data._read import answer_text, check_turns, get, parse_longmemeval_date, read_json, str_list
from memfit_gpu.data.schema import Benchmark, DataError, Memory, Question, Session, Turn

NAME = "longmemeval"
ROLES = ("user", "assistant")  # the roles of LongMemEval's chat turns; any other is reported

# Official file names per split (the cleaned release first, then the original names).
SPLIT_FILES: dict[str, tuple[str, ...]] = {
    "s": ("longmemeval_s_cleaned.json", "longmemeval_s.json"),
    "m": ("longmemeval_m_cleaned.json", "longmemeval_m.json"),
    "oracle": ("longmemeval_oracle.json",),
}


def load_longmemeval(paths: Path | Iterable[Path]) -> Benchmark:
    """Load one file or several (a folder of samples); a question id seen twice is kept once."""
    files = [Path(paths)] if isinstance(paths, (str, Path)) else [Path(p) for p in paths]
    if not files:
        raise DataError("(no file)", None, None, "no LongMemEval file to load")
    source = str(files[0]) if len(files) == 1 else str(files[0].parent)
    benchmark = Benchmark(name=NAME, source=source)
    seen: set[str] = set()
    for path in files:
        data = read_json(path)
        if not isinstance(data, list):
            raise DataError(str(path), None, None, f"expected a list of questions, got {type(data).__name__}")
        for index, record in enumerate(
            tqdm(data, desc=f"longmemeval {path.name}", unit="question", leave=False, disable=None)
        ):
            # A skipped duplicate is still checked, but its own quirks are not reported.
            record_problems: list[str] = []
            memory = _load_record(record, index, path, record_problems)
            if memory.memory_id in seen:
                benchmark.problems.append(
                    f"longmemeval {path.name} item {index}: question_id {memory.memory_id!r} already loaded: skipped"
                )
                continue
            seen.add(memory.memory_id)
            benchmark.problems.extend(record_problems)
            benchmark.memories.append(memory)
    return benchmark


def _date(value: str, path: Path, index: int, field_path: str) -> str:
    iso = parse_longmemeval_date(value)
    if iso is None:
        raise DataError(str(path), index, field_path, f"date {value!r} is not like '2023/05/27 (Sat) 21:08'")
    return iso


def _load_record(record: Any, index: int, path: Path, problems: list[str]) -> Memory:
    if not isinstance(record, dict):
        raise DataError(str(path), index, None, f"expected an object, got {type(record).__name__}")
    question_id = get(record, "question_id", str, path, index)
    session_ids = str_list(
        get(record, "haystack_session_ids", list, path, index), path, index, "haystack_session_ids"
    )
    dates = str_list(get(record, "haystack_dates", list, path, index), path, index, "haystack_dates")
    raw_sessions = get(record, "haystack_sessions", list, path, index)
    if not len(session_ids) == len(dates) == len(raw_sessions):
        raise DataError(
            str(path),
            index,
            "haystack_sessions",
            f"{len(raw_sessions)} sessions, {len(session_ids)} haystack_session_ids, {len(dates)} haystack_dates: "
            "the three lists must have the same length",
        )

    sessions: list[Session] = []
    used_ids: set[str] = set()
    for s_index, (session_id, date_text, raw_turns) in enumerate(
        zip(session_ids, dates, raw_sessions, strict=True)
    ):
        where = f"haystack_sessions[{s_index}]"
        if not isinstance(raw_turns, list):
            raise DataError(
                str(path), index, where, f"expected a list of turns, got {type(raw_turns).__name__}"
            )
        if session_id in used_ids:
            # Turn ids must be unique within a memory; a repeated session id would collide.
            renamed = f"{session_id}#{s_index}"
            problems.append(
                f"longmemeval {question_id}: session id {session_id!r} repeated: renamed {renamed!r}"
            )
            session_id = renamed
        used_ids.add(session_id)
        timestamp = _date(date_text, path, index, f"haystack_dates[{s_index}]")
        session = Session(session_id=session_id, date_text=date_text, timestamp=timestamp)
        for t_index, raw_turn in enumerate(raw_turns):
            t_where = f"{where}[{t_index}]"
            has_answer = get(
                raw_turn, "has_answer", bool, path, index, f"{t_where}.has_answer", default=False
            )
            turn = Turn(
                turn_id=f"{session_id}:{t_index + 1}",
                speaker=get(raw_turn, "role", str, path, index, f"{t_where}.role"),
                text=get(raw_turn, "content", str, path, index, f"{t_where}.content"),
                timestamp=timestamp,
                date_text=date_text,
            )
            if has_answer:
                turn.extra["has_answer"] = True
            session.turns.append(turn)
        sessions.append(session)
    # Stable: sessions with the same timestamp keep their file order.
    sessions.sort(key=lambda s: s.timestamp)

    question_date_text = get(record, "question_date", str, path, index)
    answer_sessions = str_list(
        get(record, "answer_session_ids", list, path, index, default=[]), path, index, "answer_session_ids"
    )
    missing = [s for s in answer_sessions if s not in used_ids]
    if missing:
        problems.append(
            f"longmemeval {question_id}: answer_session_ids {missing} are not in the haystack: kept"
        )
    question = Question(
        question_id=question_id,
        memory_id=question_id,
        question=get(record, "question", str, path, index),
        answer=answer_text(get(record, "answer", (str, int, float), path, index), path, index, "answer"),
        category=get(record, "question_type", str, path, index),
        evidence=[t.turn_id for s in sessions for t in s.turns if t.extra.get("has_answer")],
        evidence_sessions=answer_sessions,
        question_date=_date(question_date_text, path, index, "question_date"),
        abstention=question_id.endswith("_abs"),
        extra={"question_date_text": question_date_text},
    )
    memory = Memory(
        memory_id=question_id, sessions=sessions, questions=[question], speakers=["user", "assistant"]
    )
    other_roles = sorted({t.speaker for t in memory.turns()} - set(ROLES))
    if other_roles:
        problems.append(
            f"longmemeval {question_id}: turns with role {', '.join(map(repr, other_roles))} (not user or assistant): "
            "kept, the role is the speaker"
        )
    check_turns(NAME, memory, problems)
    return memory
