"""One schema for every benchmark: Benchmark -> Memory -> Session -> Turn, plus Questions.

Loaders produce these; nothing downstream knows which benchmark a memory came from.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from memfit_gpu.config import HUGE_TURN_CHARS  # noqa: F401  (the loaders' data-quirk threshold, defined with its config default)

# The later turns that repeat a turn id within one memory get "<id>#dup<n>" (n = 2, 3, ...).
_DUPLICATE_SUFFIX = re.compile(r"#dup\d+$")


def unique_turn_id(turn_id: str, number: int) -> str:
    """The id given to the `number`-th turn (2, 3, ...) that repeats `turn_id` within one memory."""
    return f"{turn_id}#dup{number}"


def written_turn_id(turn_id: str) -> str:
    """The id as the benchmark wrote it (a loader's "#dup<n>" suffix removed); evidence names turns by it."""
    return _DUPLICATE_SUFFIX.sub("", turn_id)


@dataclass
class Image:
    caption: str  # the text that stands for the image in the episode (LoCoMo blip_caption, MemGallery caption)
    image_id: str | None = None  # MemGallery ids; LoCoMo has none
    path: str | None = None  # local file or URL where one is known


@dataclass
class Turn:
    turn_id: str  # benchmark's own id: LoCoMo dia_id "D1:3", MemGallery round "D1:3", LongMemEval "<session>:<index>"
    speaker: str
    text: str
    timestamp: str  # ISO 8601 of the session start, "2023-05-08T13:56:00"
    date_text: str  # the session date as written in the benchmark (goes into the episode text)
    images: list[Image] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)  # e.g. MemGallery's assistant reply


@dataclass
class Session:
    session_id: str
    date_text: str
    timestamp: str
    turns: list[Turn] = field(default_factory=list)


@dataclass
class Question:
    question_id: str
    memory_id: str
    question: str
    answer: str  # gold answer as text (integers become their decimal string)
    category: str  # LoCoMo "1".."5", LongMemEval question_type, MemGallery point
    evidence: list[str] = field(default_factory=list)  # gold turn ids (parsed; see Benchmark.problems)
    evidence_sessions: list[str] = field(default_factory=list)
    question_date: str | None = None  # ISO 8601 when the benchmark gives one
    image: Image | None = None  # the question's own image (MemGallery)
    abstention: bool = False  # LongMemEval `_abs`: the right answer is to decline
    evaluated: bool = True  # False for categories excluded from scoring (LoCoMo category 5)
    extra: dict[str, Any] = field(default_factory=dict)  # adversarial_answer, raw evidence strings, ...


@dataclass
class Memory:
    memory_id: str
    sessions: list[Session] = field(default_factory=list)
    questions: list[Question] = field(default_factory=list)
    speakers: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)  # e.g. MemGallery's character_profile

    def turns(self) -> list[Turn]:
        """Every turn in conversation order (sessions in time order, then turn order)."""
        return [t for s in self.sessions for t in s.turns]


@dataclass
class Benchmark:
    name: str
    source: str  # file or folder it was read from
    memories: list[Memory] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # quirks found and how each was handled

    def questions(self) -> list[Question]:
        return [q for m in self.memories for q in m.questions]


class DataError(ValueError):
    """A benchmark file that cannot be read: the message names the file, the item and the field."""

    def __init__(self, file: str, item: str | int | None, field_name: str | None, reason: str):
        where = [str(file)]
        if item is not None:
            where.append(f"item {item}")
        if field_name is not None:
            where.append(f"field {field_name!r}")
        super().__init__(f"{', '.join(where)}: {reason}")
        self.file, self.item, self.field = file, item, field_name


def encoding_problem(text: str) -> str | None:
    """Why `text` cannot be stored (UTF-8 has no lone surrogates, which a JSON `\\ud800` escape can carry),
    or None when it can."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return (f"holds a lone surrogate (U+{ord(text[exc.start]):04X}) at character {exc.start}: not valid "
                "Unicode text")
    return None
