"""LoCoMo (snap-research/LoCoMo `data/locomo10.json`) -> Benchmark.

One memory per conversation (memory_id = sample_id). Quirks of the real file, all handled and
reported in Benchmark.problems (see ../shared/data/README.md):
- sessions are driven off the `session_N` keys: conv-26 has `session_N_date_time` keys with no session;
- answers are strings or integers; category-5 items may carry only `adversarial_answer`;
- evidence strings may be malformed ("D8:6; D9:17", "D9:1 D4:4", "D", "D:11:26", "D30:05") or empty,
  and a few name turns that do not exist;
- a dia_id repeated within a conversation, empty and huge turns (none in the real file) are handled by
  `_read.check_turns`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from tqdm import tqdm

from memfit_gpu.data._read import answer_text, check_turns, get, parse_locomo_date, read_json
from memfit_gpu.data.schema import Benchmark, DataError, Image, Memory, Question, Session, Turn
from memfit_gpu.data.spec import BenchmarkSpec, PublishedShape

NAME = "locomo"
NOT_EVALUATED = frozenset({"5"})  # adversarial questions are not scored (SPEC Evaluation)
# SPEC.md Evaluation, as the official code names them; any other label is a broken file (a run would report
# it as a category of its own and average it into the four category means)
CATEGORIES = {"1": "multi-hop", "2": "temporal", "3": "open-domain", "4": "single-hop", "5": "adversarial"}

_SESSION_KEY = re.compile(r"^session_(\d+)$")
_DATE_KEY = re.compile(r"^session_(\d+)_date_time$")
_CANONICAL_ID = re.compile(r"^D(\d+):(\d+)$")
# What a single evidence token may look like once separators are split off: "D8:6", "D:11:26", "D30:05".
_LOOSE_ID = re.compile(r"^D:?(\d+):(\d+)$")
_SEPARATORS = re.compile(r"[;,\s]+")


def parse_evidence(raw: str) -> tuple[list[str], list[str]]:
    """One evidence string -> (turn ids, tokens that could not be read).

    The canonical form "D3:7" passes through unchanged. Several ids in one string are split on ';', ','
    or whitespace; a stray colon after the "D" and leading zeros are dropped ("D:11:26" -> "D11:26",
    "D30:05" -> "D30:5"). Anything else ("D") is returned as unreadable.
    """
    if _CANONICAL_ID.match(raw) and not re.search(r"[D:]0\d", raw):
        return [raw], []
    ids: list[str] = []
    unreadable: list[str] = []
    for token in _SEPARATORS.split(raw.strip()):
        if not token:
            continue
        match = _LOOSE_ID.match(token)
        if match:
            ids.append(f"D{int(match.group(1))}:{int(match.group(2))}")
        else:
            unreadable.append(token)
    return ids, unreadable


def load_locomo(path: Path) -> Benchmark:
    path = Path(path)
    data = read_json(path)
    if not isinstance(data, list):
        raise DataError(str(path), None, None, f"expected a list of conversations, got {type(data).__name__}")
    benchmark = Benchmark(name=NAME, source=str(path))
    adversarial_only = 0
    for index, sample in enumerate(tqdm(data, desc="locomo", unit="conversation", leave=False, disable=None)):
        memory, n_adversarial_only = _load_sample(sample, index, path, benchmark.problems)
        adversarial_only += n_adversarial_only
        benchmark.memories.append(memory)
    if adversarial_only:
        benchmark.problems.append(
            f"locomo: {adversarial_only} category-5 questions have only 'adversarial_answer': "
            "answer set to it, kept in extra['adversarial_answer'] (category 5 is not evaluated)"
        )
    _check_unique_ids([m.memory_id for m in benchmark.memories], path, "sample_id")
    return benchmark


def _check_unique_ids(ids: list[str], path: Path, field_name: str) -> None:
    seen: set[str] = set()
    for index, memory_id in enumerate(ids):
        if memory_id in seen:
            raise DataError(str(path), index, field_name, f"duplicate id {memory_id!r}")
        seen.add(memory_id)


def _load_sample(sample: Any, index: int, path: Path, problems: list[str]) -> tuple[Memory, int]:
    if not isinstance(sample, dict):
        raise DataError(str(path), index, None, f"expected an object, got {type(sample).__name__}")
    memory_id = get(sample, "sample_id", str, path, index)
    conversation = get(sample, "conversation", dict, path, index)
    speakers = [
        get(conversation, "speaker_a", str, path, index, "conversation.speaker_a"),
        get(conversation, "speaker_b", str, path, index, "conversation.speaker_b"),
    ]
    session_numbers = sorted(int(m.group(1)) for k in conversation if (m := _SESSION_KEY.match(k)))
    date_numbers = sorted(int(m.group(1)) for k in conversation if (m := _DATE_KEY.match(k)))
    orphan_dates = [n for n in date_numbers if n not in set(session_numbers)]
    if orphan_dates:
        problems.append(
            f"locomo {memory_id}: {len(orphan_dates)} session_N_date_time keys with no session_N "
            f"(sessions {orphan_dates[0]}..{orphan_dates[-1]}): ignored"
        )

    sessions: list[Session] = []
    for number in session_numbers:
        key = f"session_{number}"
        date_key = f"{key}_date_time"
        date_text = get(conversation, date_key, str, path, index, f"conversation.{date_key}")
        timestamp = parse_locomo_date(date_text)
        if timestamp is None:
            raise DataError(
                str(path),
                index,
                f"conversation.{date_key}",
                f"date {date_text!r} is not like '1:56 pm on 8 May, 2023'",
            )
        raw_turns = get(conversation, key, list, path, index, f"conversation.{key}")
        session = Session(session_id=key, date_text=date_text, timestamp=timestamp)
        for position, raw_turn in enumerate(raw_turns):
            session.turns.append(
                _load_turn(raw_turn, path, index, f"conversation.{key}[{position}]", date_text, timestamp)
            )
        sessions.append(session)

    turn_session = {turn.turn_id: s.session_id for s in sessions for turn in s.turns}
    questions: list[Question] = []
    adversarial_only = 0
    for q_index, raw in enumerate(get(sample, "qa", list, path, index)):
        question, was_adversarial_only = _load_question(
            raw, q_index, memory_id, turn_session, path, index, problems
        )
        adversarial_only += was_adversarial_only
        questions.append(question)
    memory = Memory(memory_id=memory_id, sessions=sessions, questions=questions, speakers=speakers)
    check_turns(NAME, memory, problems)
    return memory, adversarial_only


def _load_turn(raw: Any, path: Path, index: int, where: str, date_text: str, timestamp: str) -> Turn:
    turn = Turn(
        turn_id=get(raw, "dia_id", str, path, index, f"{where}.dia_id"),
        speaker=get(raw, "speaker", str, path, index, f"{where}.speaker"),
        text=get(raw, "text", str, path, index, f"{where}.text"),
        timestamp=timestamp,
        date_text=date_text,
    )
    caption = get(raw, "blip_caption", str, path, index, f"{where}.blip_caption", default=None)
    if caption is not None:
        urls = get(raw, "img_url", (list, str), path, index, f"{where}.img_url", default=[])
        urls = [urls] if isinstance(urls, str) else urls
        turn.images.append(Image(caption=caption, image_id=None, path=urls[0] if urls else None))
        query = raw.get("query")
        if isinstance(query, str):
            turn.extra["image_query"] = query  # the search query LoCoMo used to find the image
    return turn


def _load_question(
    raw: Any,
    q_index: int,
    memory_id: str,
    turn_session: dict[str, str],
    path: Path,
    index: int,
    problems: list[str],
) -> tuple[Question, bool]:
    where = f"qa[{q_index}]"
    question_id = f"{memory_id}:q{q_index}"
    text = get(raw, "question", str, path, index, f"{where}.question")
    category_value = get(raw, "category", (int, str), path, index, f"{where}.category")
    category = str(category_value)
    if category not in CATEGORIES:
        raise DataError(str(path), index, f"{where}.category", f"{category_value!r} is not a LoCoMo category ("
                        f"{', '.join(f'{c} {name}' for c, name in CATEGORIES.items())})")
    extra: dict[str, Any] = {}

    adversarial = raw.get("adversarial_answer")
    if adversarial is not None:
        extra["adversarial_answer"] = answer_text(adversarial, path, index, f"{where}.adversarial_answer")
    adversarial_only = False
    if raw.get("answer") is not None:
        answer = answer_text(raw["answer"], path, index, f"{where}.answer")
    elif category in NOT_EVALUATED:
        # Category 5 is not scored by default; keeping the adversarial answer lets a reader prompt show what
        # the trap answer was. With neither answer the gold is empty: check_questions excludes the question
        # from scoring, so a selection of category 5 never scores it against "".
        answer = extra.get("adversarial_answer", "")
        extra["answer_from"] = "adversarial_answer" if "adversarial_answer" in extra else "missing"
        adversarial_only = "adversarial_answer" in extra
    else:
        raise DataError(str(path), index, f"{where}.answer", "required field is missing")

    raw_evidence = get(raw, "evidence", list, path, index, f"{where}.evidence", default=[])
    evidence: list[str] = []
    rewritten = False
    for e_index, item in enumerate(raw_evidence):
        if not isinstance(item, str):
            raise DataError(
                str(path), index, f"{where}.evidence[{e_index}]", f"expected str, got {type(item).__name__}"
            )
        ids, unreadable = parse_evidence(item)
        if ids != [item] or unreadable:
            rewritten = True
            what = f"read as {ids}" if ids else "nothing readable"
            dropped = f", dropped unreadable {unreadable}" if unreadable else ""
            problems.append(f"locomo {question_id}: evidence {item!r} {what}{dropped}")
        for turn_id in ids:
            if turn_id not in evidence:
                evidence.append(turn_id)
    if rewritten:
        extra["evidence_raw"] = list(raw_evidence)
    if not raw_evidence:
        problems.append(f"locomo {question_id}: no evidence given (category {category})")
    for turn_id in evidence:
        if turn_id not in turn_session:
            problems.append(f"locomo {question_id}: evidence {turn_id} names no turn of {memory_id}: kept")
    evidence_sessions: list[str] = []
    for turn_id in evidence:
        session_id = turn_session.get(turn_id)
        if session_id is not None and session_id not in evidence_sessions:
            evidence_sessions.append(session_id)

    question = Question(
        question_id=question_id,
        memory_id=memory_id,
        question=text,
        answer=answer,
        category=category,
        evidence=evidence,
        evidence_sessions=evidence_sessions,
        evaluated=category not in NOT_EVALUATED,
        extra=extra,
    )
    return question, adversarial_only


def files_in(root: Path, split: str | None = None) -> list[Path]:
    """locomo10.json: `root` itself, in `root`, or in a data folder's locomo/."""
    if root.is_file():
        return [root]
    for candidate in (root / "locomo10.json", root / "locomo" / "locomo10.json"):
        if candidate.is_file():
            return [candidate]
    return []


def load(files: list[Path]) -> Benchmark:
    if len(files) != 1:
        raise DataError(str(files[0].parent), None, None, "LoCoMo is one file: pass the locomo10.json path")
    return load_locomo(files[0])


SPEC = BenchmarkSpec(
    name=NAME, title="LoCoMo", load=load, files_in=files_in, layout="locomo/locomo10.json", fetchable=True,
    categories=CATEGORIES,
    category_source="snap-research/LoCoMo task_eval/evaluation_stats.py CATEGORY_MAPPING "
                    "(https://github.com/snap-research/LoCoMo/blob/main/task_eval/evaluation_stats.py)",
    averaging="category_mean",  # SPEC: "Average" = mean of the four category means
    not_evaluated=NOT_EVALUATED,
    locomo_categories=True,
    # the released file: 10 conversations, 5,882 turns, 1,986 questions of which 446 adversarial
    shapes={None: PublishedShape("locomo", memories=10, questions=1_986, tokens_per_episode=37.5, episodes=5_882,
                                 excluded={"5": 446}, sample_memories=4)},
)
