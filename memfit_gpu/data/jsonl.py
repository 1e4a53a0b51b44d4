"""Your own data: the `jsonl` benchmark, one memory (one user's history) per line of a JSON Lines file.

    memfit data validate my_data.jsonl                                   # every problem, with line and field
    memfit run --config configs/memfit.yaml --out runs/mine data.benchmark=jsonl data.path=my_data.jsonl
    memfit data convert locomo --out locomo.jsonl                         # any loaded benchmark, this format

A line (the schema; docs/how-to/own-data.md; configs/data/example.jsonl is a complete small file):

    {"user_id": "alice",                                   # required, unique: the memory's id
     "speakers": ["Alice", "Bot"],                          # optional: the speakers, in this order
     "sessions": [                                          # required, in time order
       {"session_id": "s1",                                 # optional (default S1, S2, ...)
        "timestamp": "2024-03-02T10:00:00",                 # ISO 8601, no UTC offset (omitted: undated turns)
        "date_text": "10:00 am on 2 March, 2024",           # optional: how the episode text writes the date
        "turns": [
          {"turn_id": "s1:1",                               # optional (default <session_id>:<n>), unique
           "speaker": "Alice", "text": "I adopted a dog.",  # required
           "images": [{"path": "img/rex.jpg",               # optional; path relative to the file's folder
                       "caption": "a brown dog"}]}]}],      # (caption required, image_id optional)
     "questions": [                                         # optional
       {"question_id": "alice:q0",                          # optional (default <user_id>:q<n>), unique
        "question": "What pet did Alice adopt?", "answer": "a dog",   # required (answer: text or a number)
        "category": "single-hop",                           # required: any label; results are per label
        "evidence": ["s1:1"],                               # optional: gold turn ids (retrieval diagnostics)
        "question_date": "2024-05-01",                      # optional: ISO 8601
        "evaluated": true, "abstention": false}],           # optional: scored? the right answer is to decline?
     "summaries": [                                         # optional (`memfit store export --summaries`)
       {"text": "Alice adopted a dog.", "turn_ids": ["s1:1"],  # required: the summary and the turns it covers
        "event": "2024-03-02T10:00:00", "recorded": "2024-03-02T10:00:00"}]}   # optional: ISO 8601

Turns may also carry their own "timestamp" / "date_text" (default: their session's). A session without a
timestamp holds undated turns (what a live memory stores for turns added without one). `summaries` are a
live memory's segment summaries with their provenance, which `memfit store import` (Memory.import_memories)
restores; a run ignores them and makes its own. Any other key is an error, so a misspelt field never goes
unnoticed. Blank lines are skipped.

Reading checks every line and collects every problem (`validate`); loading raises a DataError naming the
file, the line and the field of the first error (and how many there are). Warnings (evidence naming no
turn, an image file that is not there, empty turns) load and are listed in Benchmark.problems.
`to_jsonl` writes any benchmark's memories in this format, so that a LoCoMo or LongMemEval file converted
with it gives identical packs (tests/test_seams.py).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any

from memfit_gpu.data._read import DuplicateKeyError, check_turns, json_error_text, loads, type_name
from memfit_gpu.data.schema import (
    Benchmark,
    DataError,
    Image,
    Memory,
    Question,
    Session,
    Turn,
    encoding_problem,
)
from memfit_gpu.data.spec import BenchmarkSpec
from memfit_gpu.index.tokenize import query_length_problem
from memfit_gpu.months import MONTH_NAMES
from memfit_gpu.names import MAX_SPEAKERS

NAME = "jsonl"
MEMORY_KEYS = ("user_id", "speakers", "sessions", "questions", "summaries")
SUMMARY_KEYS = ("text", "turn_ids", "event", "recorded")
SESSION_KEYS = ("session_id", "timestamp", "date_text", "turns")
TURN_KEYS = ("turn_id", "speaker", "text", "images", "timestamp", "date_text")
IMAGE_KEYS = ("caption", "path", "image_id")
QUESTION_KEYS = ("question_id", "question", "answer", "category", "evidence", "evidence_sessions", "question_date",
                 "evaluated", "abstention", "image")
_REQUIRED = object()


@dataclass
class Report:
    """What reading a file found: errors stop it from loading, warnings are listed in Benchmark.problems.
    Each problem is (item, field, reason): `errors` and `warnings` print them as DataError does."""

    path: Path
    problems: list[tuple[str | None, str | None, str]] = field(default_factory=list)
    notes: list[tuple[str | None, str | None, str]] = field(default_factory=list)

    def error(self, item: str | None, field_path: str | None, reason: str) -> None:
        self.problems.append((item, field_path, reason))

    def warn(self, item: str | None, field_path: str | None, reason: str) -> None:
        self.notes.append((item, field_path, reason))

    def _lines(self, found: list[tuple[str | None, str | None, str]]) -> list[str]:
        return [str(DataError(str(self.path), item, name, reason)) for item, name, reason in found]

    @property
    def errors(self) -> list[str]:
        return self._lines(self.problems)

    @property
    def warnings(self) -> list[str]:
        return self._lines(self.notes)


def _value_problem(value: Any) -> str | None:
    """What a well-typed JSON value cannot be: text that is no Unicode (a `\\ud800` escape: UTF-8 cannot
    store it) or a number that is none (NaN, Infinity, or 1e400 read as infinity)."""
    if isinstance(value, str):
        return encoding_problem(value)
    if isinstance(value, float) and not math.isfinite(value):
        return f"{value} is not a finite number"
    return None


class _Line:
    """Typed access to one line's fields; a problem is reported (not raised) and a stand-in returned."""

    def __init__(self, report: Report, item: str):
        self.report, self.item = report, item

    def keys(self, obj: dict[str, Any], allowed: Sequence[str], where: str) -> None:
        for key in obj:
            if key not in allowed:
                self.report.error(self.item, f"{where}{key}", f"unknown field (allowed: {', '.join(allowed)})")

    def value(self, obj: dict[str, Any], key: str, types: type | tuple[type, ...], where: str,
              default: Any = _REQUIRED) -> Any:
        name = f"{where}{key}"
        if obj.get(key) is None:
            if default is _REQUIRED:
                self.report.error(self.item, name, "required field is missing")
            return None if default is _REQUIRED else default
        value = obj[key]
        wanted = types if isinstance(types, tuple) else (types,)
        if (isinstance(value, bool) and bool not in wanted) or not isinstance(value, wanted):
            self.report.error(self.item, name, f"expected {type_name(types)}, got {type(value).__name__}")
            return None if default is _REQUIRED else default
        problem = _value_problem(value)
        if problem is not None:
            self.report.error(self.item, name, problem)
            return None if default is _REQUIRED else default
        return value

    def text(self, obj: dict[str, Any], key: str, where: str, required: bool = True, nonempty: bool = False) -> str | None:
        value = self.value(obj, key, str, where, _REQUIRED if required else None)
        if value is not None and nonempty and not value.strip():
            self.report.error(self.item, f"{where}{key}", "must not be empty")
        return value

    def texts(self, obj: dict[str, Any], key: str, where: str) -> list[str]:
        value = self.value(obj, key, list, where, [])
        if not all(isinstance(v, str) for v in value):
            self.report.error(self.item, f"{where}{key}", "expected a list of strings")
            return [v for v in value if isinstance(v, str)]
        problems = [encoding_problem(text) for text in value]
        first = next((n for n, problem in enumerate(problems) if problem is not None), None)
        if first is not None:
            self.report.error(self.item, f"{where}{key}[{first}]", str(problems[first]))
        return [text for text, problem in zip(value, problems, strict=True) if problem is None]

    def objects(self, obj: dict[str, Any], key: str, where: str, required: bool) -> list[dict[str, Any]]:
        value = self.value(obj, key, list, where, _REQUIRED if required else [])
        out = []
        for i, element in enumerate(value or []):
            if isinstance(element, dict):
                out.append(element)
            else:
                self.report.error(self.item, f"{where}{key}[{i}]", f"expected an object, got {type(element).__name__}")
        return out

    def timestamp(self, obj: dict[str, Any], key: str, where: str, required: bool) -> str | None:
        value = self.text(obj, key, where, required=required)
        if value is None:
            return None
        try:
            return local_time(value)
        except ValueError as exc:
            self.report.error(self.item, f"{where}{key}", str(exc))
            return None


def local_time(value: object) -> str:
    """An ISO 8601 local date or time as the store keeps it (`datetime.isoformat`); ValueError saying why for
    anything else, a UTC offset included. The one rule for a file's times and a live memory's (live/memory.py)."""
    try:
        when = datetime.fromisoformat(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"{value!r:.60} is not an ISO 8601 date or time "
                         "(e.g. 2024-03-02 or 2024-03-02T10:00:00)") from None
    if when.tzinfo is not None:
        raise ValueError(f"{value!r:.60} has a UTC offset: give local time without one")
    return when.isoformat()


def date_text(timestamp: str) -> str:
    """How an episode writes a date when the file gives none: '10:00 am on 2 March, 2024' (LoCoMo's style),
    '2 March, 2024' at midnight."""
    when = datetime.fromisoformat(timestamp)
    day = f"{when.day} {MONTH_NAMES[when.month - 1].capitalize()}, {when.year}"
    if when.hour == 0 and when.minute == 0:
        return day
    return f"{(when.hour % 12) or 12}:{when.minute:02d} {'am' if when.hour < 12 else 'pm'} on {day}"


_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")  # http://..., data:image/...;base64 (LoCoMo's img_url)


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError:  # a name too long for the file system is no file here
        return False


def _image(line: _Line, raw: dict[str, Any], where: str, folder: Path) -> Image:
    line.keys(raw, IMAGE_KEYS, where)
    path = line.text(raw, "path", where, required=False)
    if path and not _URL.match(path) and not _is_file(folder / path):
        line.report.warn(line.item, f"{where}path", f"image {path} is not at {folder / path} (needed only with "
                                                    "reader.images)")
    return Image(caption=line.text(raw, "caption", where) or "", image_id=line.text(raw, "image_id", where, False),
                 path=path)


def _memory(record: dict[str, Any], line: _Line, folder: Path) -> Memory | None:
    line.keys(record, MEMORY_KEYS, "")
    user = line.text(record, "user_id", "", nonempty=True)
    if user is None:
        return None
    line.item = f"{line.item} (user {user!r})"
    memory = Memory(user, speakers=line.texts(record, "speakers", ""))
    turn_ids: dict[str, str] = {}
    latest: tuple[int, datetime] | None = None  # the latest session timestamp so far: (session index, when)
    for s, raw in enumerate(line.objects(record, "sessions", "", required=True)):
        where = f"sessions[{s}]."
        line.keys(raw, SESSION_KEYS, where)
        written_id = line.text(raw, "session_id", where, required=False)
        session_id = written_id or f"S{s + 1}"
        if memory.sessions and memory.sessions[-1].session_id == session_id:
            # One id may have several entries (a live memory's export writes a new entry wherever the session id
            # changes, so interleaved sessions keep the conversation's order): all are one session. Two entries
            # in a row are never written so: most likely a copied session whose id was not changed.
            own = f"{session_id!r}" if written_id else f"its default id {session_id!r}"
            line.report.warn(line.item, f"{where}session_id", f"{own} is also the id of sessions[{s - 1}], the entry "
                                                              "before it: both are read as one session (give this one "
                                                              "its own session_id if it is another)")
        stamp = line.timestamp(raw, "timestamp", where, required=False) or ""
        written = line.text(raw, "date_text", where, required=False)
        session = Session(session_id, written if written is not None else (date_text(stamp) if stamp else ""), stamp)
        if stamp:  # sessions are the conversation in file order (the store, neighbours and segments follow it)
            when = datetime.fromisoformat(stamp)
            if latest is not None and when < latest[1]:
                line.report.warn(line.item, f"{where}timestamp", f"{stamp} is before sessions[{latest[0]}]'s "
                                 f"{latest[1].isoformat()}: sessions are read in file order as the conversation's "
                                 "order; list them in time order (or fix the timestamp)")
            if latest is None or when >= latest[1]:
                latest = (s, when)
        turns = line.objects(raw, "turns", where, required=True)
        if not turns:
            line.report.warn(line.item, f"{where}turns", "a session without turns")
        for t, turn_raw in enumerate(turns):
            at = f"{where}turns[{t}]."
            line.keys(turn_raw, TURN_KEYS, at)
            turn_id = line.text(turn_raw, "turn_id", at, required=False) or f"{session_id}:{t + 1}"
            if turn_id in turn_ids:
                line.report.error(line.item, f"{at}turn_id", f"{turn_id!r} is also the id of {turn_ids[turn_id]}: "
                                                             "turn ids must be unique within a memory")
            turn_ids.setdefault(turn_id, at.rstrip("."))
            own_stamp = line.timestamp(turn_raw, "timestamp", at, required=False)
            own_text = line.text(turn_raw, "date_text", at, required=False)
            undated = "timestamp" in turn_raw and turn_raw["timestamp"] is None  # null: no date, not the session's
            turn_stamp = "" if undated else own_stamp or session.timestamp
            inherited = "" if undated else date_text(own_stamp) if own_stamp else session.date_text
            session.turns.append(Turn(
                turn_id=turn_id, speaker=line.text(turn_raw, "speaker", at, nonempty=True) or "",
                text=line.text(turn_raw, "text", at) or "", timestamp=turn_stamp,
                date_text=own_text if own_text is not None else inherited,
                images=[_image(line, image, f"{at}images[{i}].", folder)
                        for i, image in enumerate(line.objects(turn_raw, "images", at, required=False))]))
        memory.sessions.append(session)
    speakers = list(dict.fromkeys([*memory.speakers, *(t.speaker for t in memory.turns())]))
    if len(speakers) > MAX_SPEAKERS:
        line.report.error(line.item, "speakers", f"{len(speakers)} speakers (the list and the turns'); a memory holds "
                                                 f"at most {MAX_SPEAKERS}")
    sessions = {s.session_id for s in memory.sessions}
    for q, raw in enumerate(line.objects(record, "questions", "", required=False)):
        where = f"questions[{q}]."
        line.keys(raw, QUESTION_KEYS, where)
        answer = line.value(raw, "answer", (str, int, float), where)
        category = line.value(raw, "category", (str, int), where)
        image = line.value(raw, "image", dict, where, None)
        question = Question(
            question_id=line.text(raw, "question_id", where, required=False) or f"{user}:q{q}", memory_id=user,
            question=line.text(raw, "question", where, nonempty=True) or "",
            answer="" if answer is None else str(answer), category="" if category is None else str(category),
            evidence=line.texts(raw, "evidence", where), evidence_sessions=line.texts(raw, "evidence_sessions", where),
            question_date=line.timestamp(raw, "question_date", where, required=False),
            image=_image(line, image, f"{where}image.", folder) if image is not None else None,
            evaluated=line.value(raw, "evaluated", bool, where, True),
            abstention=line.value(raw, "abstention", bool, where, False))
        if category is not None and str(category).strip().lower() in ("", "overall"):
            line.report.error(line.item, f"{where}category", f"{category!r} is no category label: results have a row "
                                                             "per label and one `overall`")
        too_long = query_length_problem(question.question)
        if too_long is not None:
            line.report.error(line.item, f"{where}question", too_long)
        unknown = [e for e in question.evidence if e not in turn_ids]
        if unknown:
            line.report.warn(line.item, f"{where}evidence", f"names no turn of this memory: {', '.join(unknown[:10])} "
                                                            "(kept; diagnostics count it as unmatched)")
        stray = [e for e in question.evidence_sessions if e not in sessions]
        if stray:
            line.report.warn(line.item, f"{where}evidence_sessions", f"names no session: {', '.join(stray[:10])}")
        memory.questions.append(question)
    summaries = []
    for n, raw in enumerate(line.objects(record, "summaries", "", required=False)):
        where = f"summaries[{n}]."
        line.keys(raw, SUMMARY_KEYS, where)
        covered = line.texts(raw, "turn_ids", where)
        if not covered:
            line.report.error(line.item, f"{where}turn_ids", "a summary covers at least one turn")
        unknown = [t for t in covered if t not in turn_ids]
        if unknown:
            line.report.error(line.item, f"{where}turn_ids", f"names no turn of this memory: {', '.join(unknown[:10])}")
        summaries.append({"text": line.text(raw, "text", where, nonempty=True) or "", "turn_ids": covered,
                          "event": line.timestamp(raw, "event", where, required=False),
                          "recorded": line.timestamp(raw, "recorded", where, required=False)})
    if summaries:
        memory.extra["summaries"] = summaries
    return memory


def read(path: str | Path) -> tuple[Benchmark, Report]:
    """Read every line, collecting every problem (nothing raised for the file's content)."""
    path = Path(path)
    report = Report(path)
    benchmark = Benchmark(name=NAME, source=str(path))
    try:
        # lines end at \n alone: splitlines() also cuts at U+2028, U+0085 and the like, which JSON strings
        # may hold raw (and `to_jsonl` writes so)
        lines = path.read_text(encoding="utf-8").split("\n")
    except UnicodeDecodeError as exc:
        report.error(None, None, f"not UTF-8 text ({exc})")
        return benchmark, report
    except FileNotFoundError:
        # no content to report on: one line naming the file, not the OS's "[Errno 2] ..."
        raise DataError(str(path), None, None, "no such file") from None
    users: dict[str, int] = {}
    questions: dict[str, str] = {}
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        item = f"line {number}"
        try:
            record = loads(text)
        except json.JSONDecodeError as exc:
            report.error(item, None, f"not valid JSON ({json_error_text(exc, line=False)})")
            continue
        except DuplicateKeyError as exc:
            report.error(item, exc.key, f"written twice in the object at column {exc.colno} (JSON would keep the "
                                        "last value and lose the first silently)")
            continue
        if not isinstance(record, dict):
            report.error(item, None, f"expected an object (one memory), got {type(record).__name__}")
            continue
        line = _Line(report, item)
        memory = _memory(record, line, path.parent)
        if memory is None:
            continue
        if memory.memory_id in users:
            report.error(line.item, "user_id", f"also the user_id of line {users[memory.memory_id]}: ids must be unique")
            continue
        users[memory.memory_id] = number
        for q, question in enumerate(memory.questions):
            if question.question_id in questions:
                report.error(line.item, f"questions[{q}].question_id", f"{question.question_id!r} is also a question "
                                                                       f"of {questions[question.question_id]}")
            questions.setdefault(question.question_id, line.item)
        check_turns(NAME, memory, benchmark.problems)  # empty and huge turns (duplicates are errors above)
        benchmark.memories.append(memory)
    if not benchmark.memories and not report.errors:
        report.error(None, None, "holds no memory (one JSON object per line)")
    benchmark.problems[:0] = report.warnings
    return benchmark, report


def load(files: list[Path]) -> Benchmark:
    """The benchmark of one jsonl file; DataError naming the first problem when there are errors."""
    if len(files) != 1:
        raise DataError(str(files[0].parent), None, None, "a jsonl benchmark is one file: pass its path")
    benchmark, report = read(files[0])
    if report.problems:
        item, name, reason = report.problems[0]
        more = len(report.problems) - 1
        if more:
            reason += (f" (and {more} more problem{'s' if more > 1 else ''}: `memfit data validate {files[0]}` "
                       "lists them)")
        raise DataError(str(files[0]), item, name, reason)
    return benchmark


def files_in(root: Path, split: str | None = None) -> list[Path]:
    """Only the file itself: own data has no folder layout."""
    return [root] if root.is_file() else []


# ------------------------------------------------------------------------------------------------ writing
def _image_json(image: Image) -> dict[str, Any]:
    out: dict[str, Any] = {"caption": image.caption}
    if image.path:
        out["path"] = image.path
    if image.image_id:
        out["image_id"] = image.image_id
    return out


def rebase_images(memories: Iterable[Memory], source: str | Path, out: str | Path) -> list[Memory]:
    """`memories` with every relative image path (turns' and questions') rewritten to name the same file
    from the folder of the jsonl file `out`, which this format reads them from. Loaders keep a path as the
    benchmark writes it, relative to its `source`'s folder (`source` itself when it is a folder, else the
    folder it is in: what reader.images resolves it against, methods/answers.py images_for): MemGallery's
    `../image/...` is relative to dialog/ and, copied as written, names no file from elsewhere. A path that
    already names the same file from `out`'s folder is kept as written; others become relative to that
    folder where the two share a folder below the root (they move together), else absolute. URLs and
    absolute paths are kept.
    The memories given are not changed."""
    base = Path(source)
    base = base if base.is_dir() else base.parent
    folder = Path(out).absolute().parent
    moved: dict[str, str] = {}

    def image(found: Image) -> Image:
        path = found.path
        if not path or _URL.match(path) or Path(path).is_absolute():
            return found
        if path not in moved:
            # resolved as the file system resolves each side's `..` (through symlinks), not as text
            target = (base / path).resolve()
            here = folder.resolve()
            if (folder / path).resolve() == target:
                moved[path] = path
            elif here.drive == target.drive and os.path.commonpath([here, target]) != target.anchor:
                moved[path] = Path(os.path.relpath(target, here)).as_posix()
            else:  # nothing but the root in common: an absolute path says the same, readably
                moved[path] = str(target)
        return found if moved[path] == path else replace(found, path=moved[path])

    return [replace(memory,
                    sessions=[replace(session, turns=[replace(turn, images=[image(i) for i in turn.images])
                                                      if turn.images else turn for turn in session.turns])
                              for session in memory.sessions],
                    questions=[replace(q, image=image(q.image)) if q.image is not None else q
                               for q in memory.questions])
            for memory in memories]


def memory_json(memory: Memory) -> dict[str, Any]:
    """One line of the format: everything of `memory` that retrieval, answering and scoring read."""
    sessions = []
    for session in memory.sessions:
        turns = []
        for turn in session.turns:
            row: dict[str, Any] = {"turn_id": turn.turn_id, "speaker": turn.speaker, "text": turn.text}
            if turn.images:
                row["images"] = [_image_json(i) for i in turn.images]
            inferred = session.date_text  # the date text the reader gives a turn that states none
            if turn.timestamp and turn.timestamp != session.timestamp:
                row["timestamp"], inferred = turn.timestamp, date_text(turn.timestamp)
            elif not turn.timestamp and session.timestamp:
                row["timestamp"], inferred = None, ""  # undated in a dated session (omitted, it takes the session's)
            if turn.date_text != inferred:
                row["date_text"] = turn.date_text
            turns.append(row)
        sessions.append({"session_id": session.session_id,
                         **({"timestamp": session.timestamp} if session.timestamp else {}),
                         "date_text": session.date_text, "turns": turns})
    questions = []
    for q in memory.questions:
        row = {"question_id": q.question_id, "question": q.question, "answer": q.answer, "category": q.category}
        for key, value, default in (("evidence", q.evidence, []), ("evidence_sessions", q.evidence_sessions, []),
                                    ("question_date", q.question_date, None), ("evaluated", q.evaluated, True),
                                    ("abstention", q.abstention, False)):
            if value != default:
                row[key] = value
        if q.image is not None:
            row["image"] = _image_json(q.image)
        questions.append(row)
    out: dict[str, Any] = {"user_id": memory.memory_id}
    if memory.speakers:
        out["speakers"] = list(memory.speakers)
    out.update(sessions=sessions, questions=questions)
    if memory.extra.get("summaries"):
        out["summaries"] = [{k: v for k, v in s.items() if v is not None} for s in memory.extra["summaries"]]
    return out


def to_jsonl(memories: Iterable[Memory]) -> str:
    """Memories as the text of a file in this format (`memfit data convert` writes it atomically)."""
    return "".join(json.dumps(memory_json(m), ensure_ascii=False) + "\n" for m in memories)


SPEC = BenchmarkSpec(
    name=NAME, title="Own data (jsonl)", load=load, files_in=files_in, layout="FILE.jsonl (data.path)",
    category_source="the file's own `category` labels",
)
