"""MemGallery (Mem-Gallery `data/dialog/*.json`, one scenario per file) -> Benchmark.

memory_id = file stem. Each round {round, user, assistant, [image_id, input_image, image_caption]}
is ONE turn spoken by "User" whose text carries the assistant reply after " | Assistant: ", because
MemGallery's questions ask about both sides of a round and its clue ids name rounds, not messages.
The images themselves are not in the dialog files: paths are kept relative, exactly as written.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tqdm import tqdm

from memfit_gpu.data._read import answer_text, check_turns, get, parse_iso_day, read_json, str_list
from memfit_gpu.data.schema import Benchmark, DataError, Image, Memory, Question, Session, Turn
from memfit_gpu.data.spec import BenchmarkSpec

NAME = "memgallery"
SPEAKER = "User"
ASSISTANT_SEPARATOR = " | Assistant: "
_IMAGE_ID = re.compile(r"D\d+:IMG_\d+")
# The question categories (`point`) the official scorer reports (YuanchenBei/Mem-Gallery
# benchmark/memengine/evaluate/evaluation.py); another would be scored as a category of its own.
POINTS = ("FR", "MR", "TR", "VR", "TTL", "VS", "CD", "KR", "AR")


def load_memgallery(paths: Path | Iterable[Path]) -> Benchmark:
    """Load scenario files (sorted by name so memory order never depends on the file system)."""
    files = [Path(paths)] if isinstance(paths, (str, Path)) else sorted(Path(p) for p in paths)
    if not files:
        raise DataError("(no file)", None, None, "no MemGallery dialog file to load")
    source = str(files[0]) if len(files) == 1 else str(files[0].parent)
    benchmark = Benchmark(name=NAME, source=source)
    for path in tqdm(files, desc="memgallery", unit="scenario", leave=False, disable=None):
        benchmark.memories.append(_load_scenario(path, benchmark.problems))
    return benchmark


def _load_scenario(path: Path, problems: list[str]) -> Memory:
    data = read_json(path)
    if not isinstance(data, dict):
        raise DataError(str(path), None, None, f"expected a scenario object, got {type(data).__name__}")
    memory_id = path.stem
    memory = Memory(memory_id=memory_id, speakers=[SPEAKER])
    profile = get(data, "character_profile", dict, path, None, default=None)
    if profile is not None:
        memory.extra["character_profile"] = profile
        name = profile.get("name")
        if isinstance(name, str) and name:
            memory.speakers.append(name)

    image_ids: set[str] = set()
    for s_index, raw_session in enumerate(get(data, "multi_session_dialogues", list, path, None)):
        item = f"multi_session_dialogues[{s_index}]"
        session_id = get(raw_session, "session_id", str, path, item)
        date_text = get(raw_session, "date", str, path, item)
        timestamp = parse_iso_day(date_text)
        if timestamp is None:
            raise DataError(str(path), item, "date", f"date {date_text!r} is not like '2024-06-17'")
        session = Session(session_id=session_id, date_text=date_text, timestamp=timestamp)
        for r_index, raw_round in enumerate(get(raw_session, "dialogues", list, path, item)):
            turn = _load_round(raw_round, path, item, f"dialogues[{r_index}]", date_text, timestamp)
            image_ids.update(image.image_id for image in turn.images if image.image_id)
            session.turns.append(turn)
        memory.sessions.append(session)
    memory.sessions.sort(key=lambda s: s.timestamp)  # stable: same-day sessions keep file order

    rounds = {turn.turn_id for turn in memory.turns()}
    session_ids = {s.session_id for s in memory.sessions}
    for q_index, raw in enumerate(get(data, "human-annotated QAs", list, path, None)):
        question = _load_question(raw, q_index, memory_id, path)
        memory.questions.append(question)
        unknown_rounds = [c for c in question.evidence if c not in rounds]
        unknown_sessions = [s for s in question.evidence_sessions if s not in session_ids]
        if unknown_rounds or unknown_sessions:
            problems.append(
                f"memgallery {question.question_id}: clue rounds {unknown_rounds} / sessions {unknown_sessions} "
                "not in the scenario: kept"
            )
        if question.category == "VS":
            named = question.extra["answer_image_ids"]
            if not named or any(i not in image_ids for i in named):
                problems.append(
                    f"memgallery {question.question_id}: VS answer {question.answer!r} does not name only images "
                    "of the scenario: kept as written"
                )
    check_turns(NAME, memory, problems)
    return memory


def _load_round(raw: Any, path: Path, item: str, where: str, date_text: str, timestamp: str) -> Turn:
    user = get(raw, "user", str, path, item, f"{where}.user")
    assistant = get(raw, "assistant", str, path, item, f"{where}.assistant", default="")
    text = user + (f"{ASSISTANT_SEPARATOR}{assistant}" if assistant else "")
    turn = Turn(
        turn_id=get(raw, "round", str, path, item, f"{where}.round"),
        speaker=SPEAKER,
        text=text,
        timestamp=timestamp,
        date_text=date_text,
        extra={"user": user, "assistant": assistant},
    )
    if "image_id" in raw or "input_image" in raw or "image_caption" in raw:
        ids = str_list(
            get(raw, "image_id", list, path, item, f"{where}.image_id"), path, item, f"{where}.image_id"
        )
        files = str_list(
            get(raw, "input_image", list, path, item, f"{where}.input_image"),
            path,
            item,
            f"{where}.input_image",
        )
        captions = str_list(
            get(raw, "image_caption", list, path, item, f"{where}.image_caption"),
            path,
            item,
            f"{where}.image_caption",
        )
        if not len(ids) == len(files) == len(captions):
            raise DataError(
                str(path),
                item,
                f"{where}.image_id",
                f"{len(ids)} image_id, {len(files)} input_image, {len(captions)} image_caption: "
                "one of each per image",
            )
        turn.images = [
            Image(caption=c, image_id=i, path=f) for i, f, c in zip(ids, files, captions, strict=True)
        ]
    return turn


def _load_question(raw: Any, q_index: int, memory_id: str, path: Path) -> Question:
    item = f"human-annotated QAs[{q_index}]"
    category = get(raw, "point", str, path, item)
    if category not in POINTS:
        raise DataError(str(path), item, "point", f"{category!r} is not a MemGallery point ({', '.join(POINTS)})")
    answer = answer_text(get(raw, "answer", (str, int, float), path, item), path, item, "answer")
    question = Question(
        question_id=f"{memory_id}:q{q_index}",
        memory_id=memory_id,
        question=get(raw, "question", str, path, item),
        answer=answer,
        category=category,
        evidence=str_list(get(raw, "clue", (list, str), path, item, default=[]), path, item, "clue"),
        evidence_sessions=str_list(
            get(raw, "session_id", (list, str), path, item, default=[]), path, item, "session_id"
        ),
    )
    image_path = get(raw, "question_image", str, path, item, default=None)
    if image_path is not None:
        caption = get(raw, "image_caption", str, path, item)
        question.image = Image(caption=caption, image_id=None, path=image_path)
    if category == "VS":
        # VS answers name images ("D2:IMG_003, D2:IMG_010"): the parsed ids let a scorer compare sets.
        question.extra["answer_image_ids"] = _IMAGE_ID.findall(answer)
    return question


def files_in(root: Path, split: str | None = None) -> list[Path]:
    """`root` itself, or the scenario files of dialog/ (in `root`, a data folder's memgallery/, or `root`)."""
    if root.is_file():
        return [root]
    # The dialog folder before `root` itself: memgallery/ also holds image_lfs_manifest.json.
    for folder in (root / "dialog", root / "memgallery" / "dialog", root):
        files = sorted(p for p in folder.glob("*.json") if p.is_file()) if folder.is_dir() else []
        if files:
            return files
    return []


def benchmark_folder(source: str | Path) -> Path:
    """The MemGallery folder that holds prompt/ (its official prompts), from a loaded benchmark's source (its
    dialog/ folder or a file in it)."""
    source = Path(source)
    for candidate in (source, source.parent, source.parent.parent):
        if (candidate / "prompt").is_dir():
            return candidate
    return source.parent if source.is_dir() else source.parent.parent


SPEC = BenchmarkSpec(
    name=NAME, title="MemGallery", load=load_memgallery, files_in=files_in, layout="memgallery/dialog/*.json",
    fetchable=True,
    # Names the MemFit paper itself uses (Table 11); the other points print as their codes.
    categories={"TTL": "test-time learning", "VS": "visual-centric search", "VR": "visual-centric reasoning",
                "KR": "knowledge resolution"},
    labels=POINTS,
    category_source="the MemFit paper's Table 11 names; the official scorer (YuanchenBei/Mem-Gallery "
                    f"benchmark/memengine/evaluate/evaluation.py) reports the `point` codes {', '.join(POINTS)} "
                    "without names",
    protocol="memgallery", judge="memgallery",
)
