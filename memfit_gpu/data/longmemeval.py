"""LongMemEval (S, M and oracle files; xiaowu0162/longmemeval-cleaned) -> Benchmark.

Every question owns its haystack, so each question is its own memory (memory_id = question_id).
Sessions are sorted by date (stable): the oracle file lists them out of order, and nothing downstream
may assume file order is time order. Turn ids are f"{session_id}:{n}" with n counting from 1 within
the session as stored in the file, so they stay stable whatever the sort does.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

from tqdm import tqdm

from memfit_gpu.data._read import answer_text, check_turns, get, parse_longmemeval_date, read_json, str_list
from memfit_gpu.data.schema import Benchmark, DataError, Memory, Question, Session, Turn
from memfit_gpu.data.spec import BenchmarkSpec, PublishedShape

NAME = "longmemeval"
ROLES = ("user", "assistant")  # the roles of LongMemEval's chat turns; any other is reported

# Official file names per split (the cleaned release first, then the original names).
SPLIT_FILES: dict[str, tuple[str, ...]] = {
    "s": ("longmemeval_s_cleaned.json", "longmemeval_s.json"),
    "m": ("longmemeval_m_cleaned.json", "longmemeval_m.json"),
    "oracle": ("longmemeval_oracle.json",),
}


def load_longmemeval(paths: Path | Iterable[Path]) -> Benchmark:
    """Load one file or several (a folder of samples). A question id seen twice is kept once when both records
    read the same (sample files may share a question); two different records with one id are a DataError."""
    files = [Path(paths)] if isinstance(paths, (str, Path)) else [Path(p) for p in paths]
    if not files:
        raise DataError("(no file)", None, None, "no LongMemEval file to load")
    source = str(files[0]) if len(files) == 1 else str(files[0].parent)
    benchmark = Benchmark(name=NAME, source=source)
    seen: dict[str, tuple[Path, int, Memory]] = {}  # question id -> where it was first read, and what
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
                first_path, first_index, first = seen[memory.memory_id]
                if memory != first:  # which of the two is the question? keeping either would score a guess
                    first_at = f"item {first_index}" + (f" of {first_path}" if first_path != path else "")
                    raise DataError(str(path), index, "question_id",
                                    f"{memory.memory_id!r} is also the question_id of {first_at}, a different "
                                    "record: each question needs its own id")
                benchmark.problems.append(
                    f"longmemeval {path.name} item {index}: question_id {memory.memory_id!r} already loaded (the same "
                    "record): skipped"
                )
                continue
            seen[memory.memory_id] = (path, index, memory)
            benchmark.problems.extend(record_problems)
            benchmark.memories.append(memory)
    return benchmark


def _date(value: str, path: Path, index: int, field_path: str) -> str:
    iso = parse_longmemeval_date(value)
    if iso is None:
        raise DataError(str(path), index, field_path, f"date {value!r} is not like '2023/05/27 (Sat) 21:08'")
    return iso


def _question_type(record: dict[str, Any], path: Path, index: int) -> str:
    """The question's type, one the official scorer reports: another (a typo such as `temporal_reasoning`)
    would be scored and averaged as a category of its own."""
    value = get(record, "question_type", str, path, index)
    if value not in QUESTION_TYPES:
        close = difflib.get_close_matches(value, QUESTION_TYPES, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise DataError(str(path), index, "question_type",
                        f"{value!r} is not a LongMemEval question type ({', '.join(QUESTION_TYPES)}){hint}")
    return value


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
        category=_question_type(record, path, index),
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


def _split_files(folder: Path, split: str | None) -> list[Path]:
    """Files to read from a LongMemEval folder: the asked split, else the first official split present
    (s, oracle, m: S is the benchmark the paper reports), else every *.json (sample folders)."""
    if split is not None:
        if split not in SPLIT_FILES:
            raise ValueError(f"unknown LongMemEval split {split!r}: choose one of {', '.join(SPLIT_FILES)}")
        candidates = [folder / name for name in SPLIT_FILES[split]]
        return [next(p for p in candidates if p.is_file())] if any(p.is_file() for p in candidates) else []
    for key in ("s", "oracle", "m"):
        for name in SPLIT_FILES[key]:
            if (folder / name).is_file():
                return [folder / name]
    return sorted(p for p in folder.glob("*.json") if p.is_file())


def files_in(root: Path, split: str | None = None) -> list[Path]:
    """`root` itself, or the split's file (else every *.json) in `root` or a data folder's longmemeval/."""
    if root.is_file():
        return [root]
    for folder in (root, root / "longmemeval"):
        files = _split_files(folder, split) if folder.is_dir() else []
        if files:
            return files
    return []


# The question types the official scorer reports (xiaowu0162/LongMemEval src/evaluation/print_qa_metrics.py
# type2acc); a question id ending in _abs is an abstention question of its type.
QUESTION_TYPES = ("single-session-user", "single-session-preference", "single-session-assistant", "multi-session",
                  "temporal-reasoning", "knowledge-update")
# Wu et al. 2024: 500 questions, each its own history, S ~115k tokens (~50 sessions), M ~1.5M tokens (~500
# sessions); with synth's ~11 turns a session that is ~209 (S) and ~273 (M) LLM tokens a turn, ~0.75 words
# a token, plus ~10 tokens of the DATE/Speaker prefix: the BM25 tokens an episode has.
_S = PublishedShape("longmemeval-s", memories=500, questions=500, tokens_per_episode=167.0, sample_memories=8)
SPEC = BenchmarkSpec(
    name=NAME, title="LongMemEval", load=load_longmemeval, files_in=files_in,
    layout="longmemeval/longmemeval_{s,m,oracle}*.json", fetchable=True, splits=tuple(SPLIT_FILES),
    default_split="s", categories={t: t for t in QUESTION_TYPES},
    category_source="xiaowu0162/LongMemEval src/evaluation/print_qa_metrics.py type2acc (question_type) "
                    "(https://github.com/xiaowu0162/LongMemEval/blob/main/src/evaluation/print_qa_metrics.py)",
    judge="longmemeval",
    shapes={"s": _S,
            "m": PublishedShape("longmemeval-m", memories=500, questions=500, tokens_per_episode=215.0,
                                sample_memories=2),
            "oracle": replace(_S, note="the oracle split has no shape here: S's, an upper bound")},
)
