"""BEAM ("Beyond a Million Tokens"; mohammadtavakoli78/BEAM, hub Mohammadta/BEAM and Mohammadta/BEAM-10M) -> Benchmark.

Two layouts, the same Benchmark from both:

- the repository's folders (`chats/<split>/<id>/` there, `beam/<split>/<id>/` in a data folder):
  `chat.json` is a list of batches `{batch_number, time_anchor, turns}`, `turns` a list of turns and each
  turn a list of messages `{role, id, content}`; the first user message of a turn also carries `index`
  ("1,1") and `question_type` (`main_question`, follow-ups), the first message of a batch its `time_anchor`
  ("March-15-2024"). `probing_questions/probing_questions.json` maps each ability to its questions. The
  10M split's `chat.json` is a list of plans `{"plan-1": [batch, ...]}`.
- the hub's parquet (one row per conversation: `conversation_id`, `chat`, `probing_questions` as a string
  holding a Python literal, and columns memfit does not read): `chat` is a list of batches, each a flat
  list of messages that BEAM's own src/beam/download_dataset.py cuts into turns at every `main_question`
  (done here the same way); BEAM-10M's `chat` is a list of plans, each `{"plan-k": batches}` with the
  other plans' keys null.

The mapping: a conversation is a memory (memory id = its folder name or `conversation_id`), a batch a
session whose timestamp is the batch's time anchor (its `time_anchor`, else the first one a message of
it carries), a message a turn: turn id = the message `id`, speaker = its `role` (`user`, `assistant`).
The BEAM turn a message belongs to (its place in the batch, `index`, `question_type`) stays in
`Turn.extra`. In BEAM-10M each plan's batches follow the plan before; message ids that start again in a
plan are renumbered on from the plan before, as BEAM's src/beam/utils.py `combine_10m_chats` does for
the repository's chat.json (reported as a data quirk).

The stored text is a message's `content` verbatim, the generation marker of user messages
(`... ->-> 1,1`) included: BEAM's answer generation (src/answer_probing_questions/
long_term_memory_methods.py) gives its readers `message["content"]` unchanged, in the long-context
prompt and in every retrieval chunk (`USER: {content}`), so memfit's methods store what BEAM's
baselines read. The marker is kept in `Turn.extra["marker"]` as well.

Questions: every ability's list in file order, question id `<memory>:<ability>:<n>`, category = the ability.
The gold text is the ability's own field (`answer`, `ideal_response`, `ideal_answer`, `ideal_summary`,
`expected_compliance`); `expected_compliance` (instruction and preference following) describes a
compliant answer and is no reference answer, so those abilities get no F1 / BLEU / ROUGE in BEAM's table.
The rubric (what BEAM's judge scores) is `extra["rubric"]`. Evidence = `source_chat_ids` (a list, a
dict of lists such as `{first_statement, second_statement}`, nested lists), flattened in order; where
it is absent or empty, the `chat_id N` mentions of `conversation_references`. Abstention questions (whose
right answer is to decline) are `Question.abstention`.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Iterator, Sequence
from datetime import datetime
from pathlib import Path
from types import MappingProxyType
from typing import Any

from tqdm import tqdm

from memfit_gpu.data._read import DuplicateKeyError, answer_text, check_turns, loads, read_json
from memfit_gpu.data.schema import Benchmark, DataError, Memory, Question, Session, Turn
from memfit_gpu.data.spec import BenchmarkSpec, PublishedShape

NAME = "beam"
SPLITS: tuple[str, ...] = ("100K", "500K", "1M", "10M")  # the hub's split names (the repository's chats/ folders)
DEFAULT_SPLIT = "100K"  # the 128K-token split, the one ../shared/data ships
CHAT_FILE = "chat.json"
QUESTIONS_FILE = Path("probing_questions") / "probing_questions.json"
# The ten memory abilities, in the order of the BEAM paper's tables and of src/evaluation/report_results.py.
ABILITIES: dict[str, str] = {
    "abstention": "Abstention",
    "contradiction_resolution": "Contradiction Resolution",
    "event_ordering": "Event Ordering",
    "information_extraction": "Information Extraction",
    "instruction_following": "Instruction Following",
    "knowledge_update": "Knowledge Update",
    "multi_session_reasoning": "Multi-Session Reasoning",
    "preference_following": "Preference Following",
    "summarization": "Summarization",
    "temporal_reasoning": "Temporal Reasoning",
}
# Where an ability's gold text is: the first of these fields a question has.
GOLD_FIELDS: tuple[str, ...] = ("answer", "ideal_response", "ideal_answer", "ideal_summary", "expected_compliance")
# A gold field that describes compliance instead of answering (no F1 / BLEU / ROUGE against it).
NOT_A_REFERENCE: frozenset[str] = frozenset({"expected_compliance"})
# The time anchors BEAM writes ("March-15-2024"), then the forms its src/beam/utils.py parse_and_format_date reads.
_DATE_FORMATS = ("%B-%d-%Y", "%b-%d-%Y", "%B %d, %Y", "%b %d, %Y", "%Y-%m-%d", "%m/%d/%Y", "%m-%d-%Y")
_MARKER = re.compile(r"->->\s*(?P<marker>[^\n]*?)\s*$")
_CHAT_ID = re.compile(r"\bchat_id\s*:?\s*(\d+)", re.IGNORECASE)
_PARQUET_COLUMNS = ("conversation_id", "chat", "probing_questions")


def _natural(name: str) -> tuple[int, int | str]:
    return (0, int(name)) if name.isdigit() else (1, name)


def _conversation_folders(folder: Path) -> list[Path]:
    """The conversation folders of a split folder (numbered subfolders holding chat.json), in number order."""
    if not folder.is_dir():
        return []
    return sorted((p for p in folder.iterdir() if (p / CHAT_FILE).is_file()), key=lambda p: _natural(p.name))


def _conversation_files(folders: Sequence[Path]) -> list[Path]:
    """chat.json and, where it is there, probing_questions.json of each folder (both are the benchmark's data:
    the run's provenance hashes both; a missing questions file is the loader's error, naming it)."""
    files: list[Path] = []
    for folder in folders:
        files.append(folder / CHAT_FILE)
        if (folder / QUESTIONS_FILE).is_file():
            files.append(folder / QUESTIONS_FILE)
    return files


def _split_name(split: str | None) -> str:
    return DEFAULT_SPLIT if split is None else next((s for s in SPLITS if s.lower() == split.lower()), split)


def _parquet_files(folder: Path, split: str | None) -> list[Path]:
    """The hub's parquet files of `split` in `folder` or its data/ (named `<split>-00000-of-00001.parquet` and
    the like); with no split asked and none of the default split, every parquet file there."""
    for place in (folder, folder / "data"):
        if not place.is_dir():
            continue
        found = sorted(p for p in place.glob("*.parquet") if p.is_file())
        wanted = re.compile(rf"^{re.escape(_split_name(split).lower())}(?:[-_.]|$)")
        matching = [p for p in found if wanted.match(p.name.lower())]
        if matching or (split is None and found):
            return matching or found
    return []


def files_in(root: Path, split: str | None = None) -> list[Path]:
    """BEAM's files under `root`: a parquet file or a chat.json itself; a conversation folder; a split
    folder (numbered conversation folders); a folder holding split folders (the repository's chats/, a data
    folder's beam/) or the hub's parquet files, where `split` (default 100K) picks; a data folder's beam/."""
    if root.is_file():
        if root.suffix == ".parquet":
            return [root]
        if root.name == CHAT_FILE:
            return _conversation_files([root.parent])
        return []
    if (root / CHAT_FILE).is_file():
        return _conversation_files([root])
    folders = _conversation_folders(root)
    if folders:
        return _conversation_files(folders)
    for base in (root, root / NAME):
        if not base.is_dir():
            continue
        for candidate in sorted(base.iterdir()):
            if candidate.is_dir() and candidate.name.lower() == _split_name(split).lower():
                folders = _conversation_folders(candidate)
                if folders:
                    return _conversation_files(folders)
        parquet = _parquet_files(base, split)
        if parquet:
            return parquet
    return []


def prompt_roots(source: str | Path) -> list[Path]:
    """Folders that may hold BEAM's src/ (its judge and answer prompts, which `memfit data fetch beam` brings
    to `beam/src/`), nearest first: the loaded source's own folder and the two above it (a conversation
    folder, its split folder, the beam/ folder over them)."""
    source = Path(source)
    start = source if source.is_dir() else source.parent
    return [start, *list(start.parents)[:2]]


def load(files: list[Path]) -> Benchmark:
    """BEAM from the files `files_in` lists: chat.json files (each with its probing_questions.json) or the
    hub's parquet files, not both."""
    if not files:
        raise DataError("(no file)", None, None, "no BEAM file to load")
    parquet = [f for f in files if f.suffix == ".parquet"]
    if parquet and len(parquet) != len(files):
        raise DataError(str(files[0].parent), None, None, "mixes the hub's parquet files with conversation folders: "
                                                          "pass one layout")
    folders: list[Path] = []
    for f in [] if parquet else files:
        folder = f.parent if f.name == CHAT_FILE else f.parent.parent
        if folder not in folders:
            folders.append(folder)
    # the source names what was read: one parquet file or conversation folder, else the folder above them
    if parquet:
        source = parquet[0] if len(parquet) == 1 else parquet[0].parent
    else:
        source = folders[0] if len(folders) == 1 else folders[0].parent
    benchmark = Benchmark(name=NAME, source=str(source))
    seen: set[str] = set()
    conversations = (_parquet_rows(parquet) if parquet else
                     ((folder.name, folder / CHAT_FILE, None, None) for folder in folders))
    for memory_id, where, chat, questions in tqdm(conversations, desc="beam", unit="conversation", leave=False,
                                                  disable=None):
        if memory_id in seen:
            raise DataError(str(where), None, "conversation_id", f"conversation {memory_id!r} appears twice")
        seen.add(memory_id)
        if chat is None:  # a conversation folder: its two JSON files
            chat = read_json(where)
            questions_path = where.parent / QUESTIONS_FILE
            if not questions_path.is_file():
                raise DataError(str(questions_path), None, None, f"conversation {memory_id}: its probing questions "
                                                                 "file is missing")
            questions = read_json(questions_path)
            benchmark.memories.append(_memory(memory_id, chat, questions, str(where), str(questions_path), None,
                                              benchmark.problems))
        else:
            item = f"conversation {memory_id}"
            benchmark.memories.append(_memory(memory_id, chat, questions, str(where), str(where), item,
                                              benchmark.problems))
    return benchmark


def _parquet_rows(files: list[Path]) -> Iterator[tuple[str, Path, Any, Any]]:
    """(conversation id, file, chat, probing questions) per row of the hub's parquet files, one row at a time
    (BEAM-10M's rows are large), reading only the three columns memfit uses."""
    # Imported here: the parquet layout alone needs it, and pyarrow.parquet takes ~0.16 s to import, which
    # every command that loads the benchmark registry would pay.
    import pyarrow.parquet as pq

    for path in files:
        try:
            handle = pq.ParquetFile(path)
        except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
            raise DataError(str(path), None, None, f"not a parquet file ({exc})") from exc
        columns = handle.schema_arrow.names
        missing = [c for c in _PARQUET_COLUMNS if c not in columns]
        if missing:
            raise DataError(str(path), None, missing[0], f"column missing (the file has {', '.join(columns)})")
        row_number = 0
        for batch in handle.iter_batches(batch_size=1, columns=list(_PARQUET_COLUMNS)):
            for row in batch.to_pylist():
                conversation = row["conversation_id"]
                if isinstance(conversation, bool) or not isinstance(conversation, (str, int)):
                    raise DataError(str(path), f"row {row_number}", "conversation_id",
                                    f"expected str or int, got {type(conversation).__name__}")
                yield str(conversation), path, row["chat"], row["probing_questions"]
                row_number += 1


def _batches(chat: Any, file: str, item: str | None, problems: list[str], memory_id: str
             ) -> list[tuple[str, str, list[list[dict[str, Any]]], Any]]:
    """(session id, where, turns, batch time anchor) per batch, plans unrolled (BEAM-10M)."""
    if not isinstance(chat, list):
        raise DataError(file, item, "chat", f"expected a list of batches, got {type(chat).__name__}")
    plans = [entry for entry in chat if isinstance(entry, dict) and entry and all(str(k).startswith("plan-")
                                                                                  for k in entry)]
    if plans and len(plans) != len(chat):
        raise DataError(file, item, "chat", "mixes plans ({'plan-1': ...}) with batches")
    out: list[tuple[str, str, list[list[dict[str, Any]]], Any]] = []
    if plans:
        last_id: int | None = None
        renumbered: list[str] = []
        for p_index, entry in enumerate(plans):
            named = [(k, v) for k, v in entry.items() if v is not None]
            if len(named) != 1 or not isinstance(named[0][1], list):
                raise DataError(file, item, f"chat[{p_index}]", "a plan entry must hold exactly one plan (a list of "
                                                                "batches) under its plan-N key")
            plan, batches = named[0]
            plan_batches = [(f"{plan}:{_batch_name(raw, b_index)}", f"chat[{p_index}].{plan}[{b_index}]",
                             *_batch(raw, file, item, f"chat[{p_index}].{plan}[{b_index}]"))
                            for b_index, raw in enumerate(batches)]
            ids = [m["id"] for _, _, turns, _ in plan_batches for t in turns for m in t
                   if isinstance(m, dict) and isinstance(m.get("id"), int) and not isinstance(m.get("id"), bool)]
            if last_id is not None and ids and min(ids) <= last_id:
                offset = last_id + 1  # src/beam/utils.py combine_10m_chats: the plan's ids follow the last one
                for _, _, turns, _ in plan_batches:
                    for turn in turns:
                        for message in turn:
                            message["id"] = message["id"] + offset
                renumbered.append(f"{plan} +{offset}")
                ids = [i + offset for i in ids]
            if ids:
                last_id = ids[-1]
            out.extend(plan_batches)
        if renumbered:
            problems.append(f"beam {memory_id}: message ids start again in a plan: renumbered on from the plan before "
                            f"({', '.join(renumbered)}), as BEAM's combine_10m_chats numbers the repository's chat.json")
        return out
    for b_index, raw in enumerate(chat):
        out.append((_batch_name(raw, b_index), f"chat[{b_index}]", *_batch(raw, file, item, f"chat[{b_index}]")))
    return out


def _unique_sessions(batches: list[tuple[str, str, list[list[dict[str, Any]]], Any]], memory_id: str,
                     problems: list[str]) -> list[tuple[str, str, list[list[dict[str, Any]]], Any]]:
    """The batches with a repeated session id (a `batch_number` written twice) renamed `<id>#<position>` (its
    place in the conversation, from 0), as LongMemEval's loader renames a repeated session id: one store
    session per batch, never two batches merged into one."""
    used: set[str] = set()
    out = []
    renamed: list[str] = []
    for position, (session_id, where, turns, anchor) in enumerate(batches):
        if session_id in used:
            renamed.append(f"{session_id!r} -> {session_id + '#' + str(position)!r}")
            session_id = f"{session_id}#{position}"
        used.add(session_id)
        out.append((session_id, where, turns, anchor))
    if renamed:
        problems.append(f"beam {memory_id}: batch number repeated: later batches renamed ({', '.join(renamed)})")
    return out


def _batch_name(raw: Any, position: int) -> str:
    """A batch's session id: `batch-<batch_number>`, its place (from 1) where it has no number (the hub's)."""
    number = raw.get("batch_number") if isinstance(raw, dict) else None
    return f"batch-{number if isinstance(number, int) and not isinstance(number, bool) else position + 1}"


def _batch(raw: Any, file: str, item: str | None, where: str) -> tuple[list[list[dict[str, Any]]], Any]:
    """(turns, time anchor) of one batch: the repository's `{batch_number, time_anchor, turns}` or the hub's
    flat message list, cut into turns at each main question (BEAM's convert_chats_pickle_to_json)."""
    if isinstance(raw, dict):
        turns = raw.get("turns")
        if not isinstance(turns, list) or not all(isinstance(t, list) for t in turns):
            raise DataError(file, item, f"{where}.turns", "expected a list of turns, each a list of messages")
        return copy_turns(turns), raw.get("time_anchor")
    if not isinstance(raw, list):
        raise DataError(file, item, where, f"expected a batch (an object with turns, or a list of messages), got "
                                           f"{type(raw).__name__}")
    turns: list[list[dict[str, Any]]] = []
    current: list[dict[str, Any]] = []
    for message in raw:
        if isinstance(message, dict) and message.get("question_type") == "main_question" and current:
            turns.append(current)
            current = []
        current.append(dict(message) if isinstance(message, dict) else message)
    if current:
        turns.append(current)
    return turns, None


def copy_turns(turns: list[list[Any]]) -> list[list[Any]]:
    """The turns with each message copied, so renumbering never writes into the caller's data."""
    return [[dict(m) if isinstance(m, dict) else m for m in turn] for turn in turns]


def parse_time_anchor(text: str) -> datetime | None:
    """'March-15-2024' (and the other forms BEAM writes) -> datetime; None when it does not parse."""
    for form in _DATE_FORMATS:
        try:
            return datetime.strptime(text.strip(), form)
        except ValueError:
            continue
    return None


def _anchor_of(turns: list[list[dict[str, Any]]], batch_anchor: Any) -> str | None:
    if isinstance(batch_anchor, str) and batch_anchor.strip():
        return batch_anchor
    for turn in turns:
        for message in turn:
            anchor = message.get("time_anchor") if isinstance(message, dict) else None
            if isinstance(anchor, str) and anchor.strip():
                return anchor
    return None


def _message(raw: Any, file: str, item: str | None, where: str) -> tuple[str, str, str]:
    """(turn id, role, content) of one message."""
    if not isinstance(raw, dict):
        raise DataError(file, item, where, f"expected a message object, got {type(raw).__name__}")
    values = []
    for key, types in (("id", (int, str)), ("role", (str,)), ("content", (str,))):
        value = raw.get(key)
        if value is None:
            raise DataError(file, item, f"{where}.{key}", "required field is missing")
        if isinstance(value, bool) or not isinstance(value, types):
            raise DataError(file, item, f"{where}.{key}", f"expected {' or '.join(t.__name__ for t in types)}, "
                                                          f"got {type(value).__name__}")
        values.append(str(value))
    return values[0], values[1], values[2]


def _memory(memory_id: str, chat: Any, questions: Any, chat_file: str, questions_file: str, item: str | None,
            problems: list[str]) -> Memory:
    memory = Memory(memory_id=memory_id)
    batches = _unique_sessions(_batches(chat, chat_file, item, problems, memory_id), memory_id, problems)
    dated: list[tuple[str, str, list[list[dict[str, Any]]], str | None, datetime | None]] = []
    undated: list[str] = []
    for session_id, where, turns, batch_anchor in batches:
        anchor = _anchor_of(turns, batch_anchor)
        when = parse_time_anchor(anchor) if anchor is not None else None
        if when is None:
            undated.append(f"{session_id} ({anchor!r})" if anchor is not None else session_id)
        dated.append((session_id, where, turns, anchor, when))
    known = [when for *_, when in dated if when is not None]
    if not known:
        raise DataError(chat_file, item, "time_anchor", f"conversation {memory_id}: no batch has a time anchor BEAM "
                                                        "writes (like 'March-15-2024')")
    if undated:
        problems.append(f"beam {memory_id}: batches without a readable time anchor take the date of the batch before "
                        f"(the first such the next dated one): {', '.join(undated[:10])}")
    previous: datetime | None = None
    for index, (session_id, where, turns, anchor, when) in enumerate(dated):
        if when is None:
            when = previous or next(w for *_, w in dated[index:] if w is not None)
            anchor = when.strftime("%B-%d-%Y")
        previous = when
        timestamp = when.isoformat()
        session = Session(session_id=session_id, date_text=anchor, timestamp=timestamp)
        for t_index, turn in enumerate(turns):
            for m_index, raw in enumerate(turn):
                turn_id, role, content = _message(raw, chat_file, item, f"{where}.turns[{t_index}][{m_index}]")
                extra: dict[str, Any] = {"beam_turn": t_index}
                for key in ("index", "question_type", "time_anchor"):
                    if raw.get(key) is not None:
                        extra[key] = raw[key]
                marker = _MARKER.search(content) if role == "user" else None
                if marker is not None:
                    extra["marker"] = marker.group("marker")
                session.turns.append(Turn(turn_id=turn_id, speaker=role, text=content, timestamp=timestamp,
                                          date_text=anchor, extra=extra))
                if role not in memory.speakers:
                    memory.speakers.append(role)
        memory.sessions.append(session)
    turn_session = {t.turn_id: s.session_id for s in memory.sessions for t in s.turns}
    memory.questions = _questions(memory_id, questions, questions_file, item, turn_session, problems)
    check_turns(NAME, memory, problems)
    return memory


def _probing_questions(raw: Any, file: str, item: str | None) -> dict[str, Any]:
    """The questions object; the hub stores it as a string holding a Python literal (BEAM's download script
    reads it with ast.literal_eval), which is read the same way (a literal, never code), or as JSON."""
    if isinstance(raw, str):
        try:
            raw = _literal(raw)
        except _DuplicateLiteralKey as exc:
            raise DataError(file, item, "probing_questions", f"{exc} (the literal would keep the last value and "
                                                              "lose the first silently)") from None
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            try:
                raw = loads(raw)
            except json.JSONDecodeError as exc:
                raise DataError(file, item, "probing_questions", "neither a Python literal nor JSON "
                                                                  f"({exc.msg} at character {exc.pos})") from None
            except DuplicateKeyError as exc:
                raise DataError(file, item, "probing_questions", f"{exc} (JSON would keep the last value and lose "
                                                                  "the first silently)") from None
    if not isinstance(raw, dict):
        raise DataError(file, item, "probing_questions", f"expected an object of abilities, got {type(raw).__name__}")
    return raw


def _literal(text: str) -> Any:
    """ast.literal_eval, refusing a dict that writes one key twice (a literal keeps the last value and drops
    the first without a word): _DuplicateLiteralKey naming the key and its line."""
    tree = ast.parse(text.lstrip(" \t"), mode="eval")
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            seen: set[Any] = set()
            for key in node.keys:
                if isinstance(key, ast.Constant):
                    if key.value in seen:
                        raise _DuplicateLiteralKey(key.value, key.lineno)
                    seen.add(key.value)
    return ast.literal_eval(tree)


class _DuplicateLiteralKey(Exception):
    """A dict of the hub's probing_questions literal that writes one key twice."""

    def __init__(self, key: Any, lineno: int):
        super().__init__(f"key {key!r} appears twice in the dict at line {lineno}")


def _ids(value: Any) -> Iterator[str]:
    """Message ids in a source_chat_ids value (a list, a dict of lists, nested), in order."""
    if isinstance(value, dict):
        for inner in value.values():
            yield from _ids(inner)
    elif isinstance(value, list):
        for inner in value:
            yield from _ids(inner)
    elif isinstance(value, (int, str)) and not isinstance(value, bool) and str(value).strip():
        yield str(value).strip()


def _references(question: dict[str, Any]) -> list[str]:
    references = question.get("conversation_references", question.get("conversation_reference"))
    texts = references if isinstance(references, list) else [references] if references is not None else []
    return [match for text in texts if isinstance(text, str) for match in _CHAT_ID.findall(text)]


def _questions(memory_id: str, raw: Any, file: str, item: str | None, turn_session: dict[str, str],
               problems: list[str]) -> list[Question]:
    abilities = _probing_questions(raw, file, item)
    unknown = [a for a in abilities if a not in ABILITIES]
    if unknown:
        problems.append(f"beam {memory_id}: abilities {unknown} are not BEAM's ten: kept as categories of their own")
    ordered = [a for a in ABILITIES if a in abilities] + unknown
    out: list[Question] = []
    unknown_evidence: list[str] = []
    for ability in ordered:
        listed = abilities[ability]
        if not isinstance(listed, list):
            raise DataError(file, item, ability, f"expected a list of questions, got {type(listed).__name__}")
        for index, entry in enumerate(listed):
            where = f"{ability}[{index}]"
            if not isinstance(entry, dict):
                raise DataError(file, item, where, f"expected a question object, got {type(entry).__name__}")
            text = entry.get("question")
            if not isinstance(text, str):
                raise DataError(file, item, f"{where}.question", "required text is missing" if text is None else
                                f"expected str, got {type(text).__name__}")
            rubric = entry.get("rubric", [])
            if not isinstance(rubric, list) or not all(isinstance(r, str) for r in rubric):
                raise DataError(file, item, f"{where}.rubric", f"expected a list of str, got {rubric!r:.80}")
            # the first gold field the question writes; one of the wrong type is a broken file (it read as no
            # gold at all and the question left the scores without a word)
            gold_field = next((f for f in GOLD_FIELDS if entry.get(f) is not None), None)
            gold = "" if gold_field is None else answer_text(entry[gold_field], file, item, f"{where}.{gold_field}")
            evidence = list(dict.fromkeys(_ids(entry.get("source_chat_ids"))))
            evidence_from = "source_chat_ids" if evidence else None
            if not evidence:
                evidence = list(dict.fromkeys(_references(entry)))
                evidence_from = "conversation_references" if evidence else None
            missing = [e for e in evidence if e not in turn_session]
            if missing:
                unknown_evidence.append(f"{memory_id}:{ability}:{index} {missing}")
            extra: dict[str, Any] = {"rubric": list(rubric), "gold_field": gold_field,
                                     "reference_answer": gold_field is not None and gold_field not in NOT_A_REFERENCE}
            if evidence_from is not None:
                extra["evidence_from"] = evidence_from
            if "source_chat_ids" in entry:
                extra["source_chat_ids"] = entry["source_chat_ids"]
            if isinstance(entry.get("difficulty"), str):
                extra["difficulty"] = entry["difficulty"]
            question = Question(
                question_id=f"{memory_id}:{ability}:{index}", memory_id=memory_id, question=text,
                answer=gold, category=ability, evidence=evidence,
                evidence_sessions=list(dict.fromkeys(turn_session[e] for e in evidence if e in turn_session)),
                abstention=ability == "abstention", extra=extra,
            )
            if not rubric:
                question.evaluated = False
                question.extra["excluded"] = "the rubric is empty (BEAM's judge scores its rubric items)"
                problems.append(f"beam {question.question_id}: the rubric is empty: excluded from scoring")
            out.append(question)
    if unknown_evidence:
        problems.append(f"beam {memory_id}: evidence naming no message of the conversation: kept "
                        f"({'; '.join(unknown_evidence[:5])}{' ...' if len(unknown_evidence) > 5 else ''})")
    return out


SPEC = BenchmarkSpec(
    name=NAME, title="BEAM", load=load, files_in=files_in, layout="beam/{100K,500K,1M,10M}/<id>/chat.json",
    fetchable=True, splits=SPLITS, default_split=DEFAULT_SPLIT, categories=dict(ABILITIES),
    category_source="the ability keys of probing_questions.json, named as mohammadtavakoli78/BEAM README.md "
                    "'Probing Questions Types' names them; src/evaluation/report_results.py column_names orders them",
    averaging="category_mean", protocol="beam", judge="beam", shapes=MappingProxyType({
        # the 100K split as counted in ../shared; the others from the BEAM paper's 100 conversations (20, 35,
        # 35 and 10 a split, 20 questions each), messages a conversation scaled from the 100K split's 287 per
        # 128K tokens (data/synth.py beam-*), BM25 tokens a message as measured on the 100K split
        "100K": PublishedShape("beam-100k", memories=20, questions=400, tokens_per_episode=310.4, episodes=5732),
        "500K": PublishedShape("beam-500k", memories=35, questions=700, tokens_per_episode=310.4,
                               note="messages per conversation scaled from the 100K split"),
        "1M": PublishedShape("beam-1m", memories=35, questions=700, tokens_per_episode=310.4, sample_memories=2,
                             note="messages per conversation scaled from the 100K split"),
        "10M": PublishedShape("beam-10m", memories=10, questions=200, tokens_per_episode=310.4, sample_memories=1,
                              note="messages per conversation scaled from the 100K split"),
    }),
    units={"memories": "conversations", "sessions": "batches", "turns": "messages", "category": "ability"},
)
