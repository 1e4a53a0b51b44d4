"""Seeded synthetic benchmarks shaped like LongMemEval (S, M), LoCoMo or BEAM, in the package's own schema.

    for memory in iter_memories("longmemeval-m", n_questions=500, seed=0):   # one memory at a time
        ...
    benchmark = synth_benchmark("longmemeval-s", n_questions=50, seed=0, embedding_dim=384)
    write_longmemeval("lme_m.json", "longmemeval-m", n_questions=500, seed=0)   # streamed to disk

For scale work (kernels, benchmarks, the M regime) where the real M file is not at hand. Shapes:

    like            sessions / memory   turns / session   words per turn (lognormal median)   questions / memory
    longmemeval-s   50 +- 5             ~11 (8-14)        user 18, assistant 70                1
    longmemeval-m   500 +- 20           ~11 (8-14)        user 18, assistant 70                1
    locomo          19-32               16-28             18 both                              154 (1 in files)
    beam-100k       3                   58-70             user 39 (s 0.59), asst. 567 (s 0.38) 20
    beam-500k       17-19               58-70             (as beam-100k)                       20
    beam-1m         34-36               58-70             (as beam-100k)                       20
    beam-10m        325-345             58-70             user 39 (s 0.59), asst. 567 (s 0.38) 20

so S has ~550 turns a question and M ~5,500 (500 questions: ~2.75M turns). The BEAM shapes are the real
100K split's (../shared/data/beam/100K, measured: 2,866 user and 2,866 assistant messages, words per message
median 39 and 567, log standard deviation 0.59 and 0.38; 3 batches of ~63 messages per conversation, about
153k tokens at 4 characters a token); beam-10m has about 110 times its batches: ~21,000 messages and ~6.6M
words (~10M tokens of a reader's tokenizer), as a BEAM-10M conversation, written in plans of 30 batches as
the 10M split is. Words per message use the shape's log standard deviation (0.6 for the others). Words come from a Zipf
(s = 1.07) law over a 30,000-word pseudo-word vocabulary. Each question has one gold evidence turn,
a user turn holding a fact ("my <w1> <w2> is <w3>") built from rare words; the question asks for it
("What is my <w1> <w2>?", answer <w3>) and `Question.evidence` names that turn.

Every memory draws from its own random stream, seeded by (seed, memory index): memory i is the same
whether or not the ones before it were generated, so `iter_memories` streams M without holding it.
With `embedding_dim`, each memory carries random unit embeddings of its turns (float32, seeded) in
`Memory.extra["embeddings"]` [turns, dim] and each question a unit vector near its gold turn's in
`Question.extra["embedding"]`, so scale runs need no encoder.

`HashEncoder` stands in for the bi-encoder where scale runs need query vectors the generator did not
make (PRF queries): each token gets a seeded random unit vector (from its CRC32), a text the
normalised sum of its tokens'. Deterministic and independent of the batch, so it also makes store
rebuilds exactly comparable.

Files: `write_longmemeval` writes the LongMemEval JSON layout (one record per question, each its own
haystack) that `memfit_gpu.data.longmemeval` reads back into the same memories (embeddings aside);
`write_beam` writes the BEAM repository's layout (`<id>/chat.json`, `<id>/probing_questions/
probing_questions.json`; batches of turns of a user message and the assistant's reply, integer message
ids, time anchors, the `->-> b,t` marker on user messages; questions per ability with a one-item rubric
and `source_chat_ids`) that `memfit_gpu.data.beam` reads.
"""

from __future__ import annotations

import functools
import json
import os
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch

from memfit_gpu.data._read import parse_longmemeval_date
from memfit_gpu.data.schema import Benchmark, Memory, Question, Session, Turn
from memfit_gpu.index.tokenize import tokenize

__all__ = ["LIKES", "HashEncoder", "iter_memories", "synth_benchmark", "write_beam", "write_longmemeval"]

VOCABULARY = 30_000
ZIPF_EXPONENT = 1.07
_RARE_FROM = 5_000  # fact words are drawn from ranks >= this: rare enough to identify the gold turn
_SYLLABLES = ("ba", "ko", "ri", "tu", "me", "sa", "lo", "ni", "da", "ve", "pu", "zi", "ga", "fe", "mo", "ha",
              "ru", "le", "ti", "no", "ka", "su", "we", "yo", "bi", "de", "po", "xa", "ji", "cu")
_QUESTION_TYPES = ("single-session-user", "multi-session", "knowledge-update", "temporal-reasoning")
_LOCOMO_CATEGORIES = ("1", "2", "3", "4")
# The LongMemEval layout holds LongMemEval's question types (its loader refuses any other label): a LoCoMo-shaped
# file writes category n as the n-th type.
_FILE_QUESTION_TYPES = dict(zip(_LOCOMO_CATEGORIES, _QUESTION_TYPES, strict=True))
# BEAM's ten abilities (data/beam.py ABILITIES), named here to keep synth below the loaders
_BEAM_ABILITIES = ("abstention", "contradiction_resolution", "event_ordering", "information_extraction",
                   "instruction_following", "knowledge_update", "multi_session_reasoning", "preference_following",
                   "summarization", "temporal_reasoning")
BEAM_PLAN_BATCHES = 30  # batches per plan in a beam-10m chat.json (the 10M split holds 10 plans)
_START = datetime(2023, 1, 2, 9, 0)
_WEEKDAYS = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")


@dataclass(frozen=True)
class Shape:
    sessions: tuple[int, int]  # inclusive range per memory
    turns: tuple[int, int]  # inclusive range per session
    user_words: float  # lognormal median of a user turn's words
    assistant_words: float
    questions_per_memory: int
    prefix: str
    user_sigma: float = 0.6  # log standard deviation of a user turn's words
    assistant_sigma: float = 0.6


LIKES = {
    "longmemeval-s": Shape((45, 55), (8, 14), 18.0, 70.0, 1, "lme-s"),
    "longmemeval-m": Shape((480, 520), (8, 14), 18.0, 70.0, 1, "lme-m"),
    "locomo": Shape((19, 32), (16, 28), 18.0, 18.0, 154, "locomo"),
    "beam-100k": Shape((3, 3), (58, 70), 39.0, 567.0, 20, "beam-100k", 0.59, 0.38),
    "beam-500k": Shape((17, 19), (58, 70), 39.0, 567.0, 20, "beam-500k", 0.59, 0.38),
    "beam-1m": Shape((34, 36), (58, 70), 39.0, 567.0, 20, "beam-1m", 0.59, 0.38),
    "beam-10m": Shape((325, 345), (58, 70), 39.0, 567.0, 20, "beam-10m", 0.59, 0.38),
}


def _shape(like: str) -> Shape:
    if like not in LIKES:
        raise ValueError(f"synth: like={like!r} is not one of {', '.join(LIKES)}")
    return LIKES[like]


@functools.cache
def _vocabulary() -> tuple[np.ndarray, np.ndarray]:
    """(words, cumulative Zipf probabilities): word r is a pseudo-word of 2-4 syllables, unique per rank."""
    base = len(_SYLLABLES)
    words = []
    for rank in range(VOCABULARY):
        n, parts = rank + base, []  # + base: every word has at least two syllables
        while n:
            n, digit = divmod(n, base)
            parts.append(_SYLLABLES[digit])
        words.append("".join(reversed(parts)))
    weights = 1.0 / np.arange(1, VOCABULARY + 1, dtype=np.float64) ** ZIPF_EXPONENT
    return np.asarray(words, dtype=object), np.cumsum(weights / weights.sum())


def _words(rng: np.random.Generator, count: int) -> np.ndarray:
    words, cdf = _vocabulary()
    ranks = np.minimum(np.searchsorted(cdf, rng.random(count)), VOCABULARY - 1)
    return words[ranks]


def _date_text(when: datetime) -> str:
    """LongMemEval's date layout: '2023/05/27 (Sat) 21:08'."""
    return f"{when:%Y/%m/%d} ({_WEEKDAYS[when.weekday()]}) {when:%H:%M}"


def _unit(rng: np.random.Generator, rows: int, dim: int) -> np.ndarray:
    vectors = rng.standard_normal((rows, dim)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    return vectors


def _memory(like: str, shape: Shape, index: int, n_questions: int, seed: int, embedding_dim: int | None) -> Memory:
    rng = np.random.default_rng([seed, index])
    n_sessions = int(rng.integers(shape.sessions[0], shape.sessions[1] + 1))
    turns_per = rng.integers(shape.turns[0], shape.turns[1] + 1, size=n_sessions)
    # sessions spread over about a year, in time order
    minutes = np.sort(rng.choice(365 * 24 * 60, size=n_sessions, replace=False))
    n_turns = int(turns_per.sum())
    is_user = np.concatenate([np.arange(n) % 2 == 0 for n in turns_per])
    median = np.where(is_user, shape.user_words, shape.assistant_words)
    sigma = np.where(is_user, shape.user_sigma, shape.assistant_sigma)
    lengths = np.maximum(1, np.round(median * np.exp(sigma * rng.standard_normal(n_turns)))).astype(np.int64)
    words = _words(rng, int(lengths.sum()))
    cuts = np.cumsum(lengths)[:-1]
    texts = [" ".join(chunk) for chunk in np.split(words, cuts)]

    memory_id = f"{shape.prefix}-{seed}-{index:06d}"
    question_ids = [memory_id] if n_questions == 1 else [f"{memory_id}:q{j}" for j in range(n_questions)]
    # one gold user turn per question, distinct turns
    user_turns = np.flatnonzero(is_user)
    gold = rng.choice(user_turns, size=n_questions, replace=False)
    words_all, _ = _vocabulary()
    facts = words_all[rng.integers(_RARE_FROM, VOCABULARY, size=(n_questions, 3))]
    for turn, (w1, w2, w3) in zip(gold.tolist(), facts, strict=True):
        texts[turn] = f"{texts[turn]}. By the way, my {w1} {w2} is {w3}."

    sessions, turn_ids, session_ids = [], [], []
    gold_turns = set(gold.tolist())
    position = 0
    for s, (count, offset) in enumerate(zip(turns_per.tolist(), minutes.tolist(), strict=True)):
        session_id = f"{memory_id}_s{s}"
        date_text = _date_text(_START + timedelta(minutes=offset))
        timestamp = parse_longmemeval_date(date_text)
        assert timestamp is not None
        session = Session(session_id=session_id, date_text=date_text, timestamp=timestamp)
        for n in range(count):
            turn = Turn(turn_id=f"{session_id}:{n + 1}", speaker="user" if is_user[position] else "assistant",
                        text=texts[position], timestamp=timestamp, date_text=date_text)
            if position in gold_turns:
                turn.extra["has_answer"] = True  # as the LongMemEval loader marks evidence turns
            session.turns.append(turn)
            turn_ids.append(turn.turn_id)
            session_ids.append(session_id)
            position += 1
        sessions.append(session)

    asked = _START + timedelta(minutes=int(minutes[-1]) + 24 * 60)
    question_date_text = _date_text(asked)
    question_date = parse_longmemeval_date(question_date_text)
    kinds = _LOCOMO_CATEGORIES if like == "locomo" else _BEAM_ABILITIES if like.startswith("beam") else _QUESTION_TYPES
    questions = []
    for j, (turn, (w1, w2, w3)) in enumerate(zip(gold.tolist(), facts, strict=True)):
        questions.append(Question(
            question_id=question_ids[j], memory_id=memory_id, question=f"What is my {w1} {w2}?", answer=str(w3),
            category=kinds[(index + j) % len(kinds)], evidence=[turn_ids[turn]],
            evidence_sessions=[session_ids[turn]], question_date=question_date,
            extra={"question_date_text": question_date_text},
        ))
    memory = Memory(memory_id=memory_id, sessions=sessions, questions=questions, speakers=["user", "assistant"])
    if embedding_dim:
        vectors_rng = np.random.default_rng([seed, index, 1])
        vectors = _unit(vectors_rng, n_turns, embedding_dim)
        memory.extra["embeddings"] = vectors
        for question, turn in zip(questions, gold.tolist(), strict=True):
            near = vectors[turn] + 0.8 * _unit(vectors_rng, 1, embedding_dim)[0]
            question.extra["embedding"] = (near / np.linalg.norm(near)).astype(np.float32)
    return memory


def iter_memories(like: str, n_questions: int, seed: int = 0, questions_per_memory: int | None = None,
                  embedding_dim: int | None = None) -> Iterator[Memory]:
    """Memories one at a time, `n_questions` questions in all (`questions_per_memory` each, the last
    memory takes the rest; default: the shape's, 1 for LongMemEval)."""
    shape = _shape(like)
    per = shape.questions_per_memory if questions_per_memory is None else int(questions_per_memory)
    if per < 1 or n_questions < 0:
        raise ValueError(f"synth: questions_per_memory={per} and n_questions={n_questions} must be >= 1 and >= 0")
    for index, first in enumerate(range(0, n_questions, per)):
        yield _memory(like, shape, index, min(per, n_questions - first), seed, embedding_dim)


def synth_benchmark(like: str = "longmemeval-s", n_questions: int = 50, seed: int = 0,
                    questions_per_memory: int | None = None, embedding_dim: int | None = None) -> Benchmark:
    """The whole benchmark in memory (for M at full size, stream `iter_memories` instead)."""
    memories = list(iter_memories(like, n_questions, seed, questions_per_memory, embedding_dim))
    return Benchmark(name=f"synth-{like}", source=f"synth:{like}:seed={seed}", memories=memories)


def _record(memory: Memory) -> dict:
    question = memory.questions[0]
    return {
        "question_id": question.question_id,
        "question_type": _FILE_QUESTION_TYPES.get(question.category, question.category),
        "question": question.question,
        "answer": question.answer,
        "question_date": question.extra["question_date_text"],
        "haystack_session_ids": [s.session_id for s in memory.sessions],
        "haystack_dates": [s.date_text for s in memory.sessions],
        "haystack_sessions": [
            [{"role": t.speaker, "content": t.text, **({"has_answer": True} if t.extra.get("has_answer") else {})}
             for t in s.turns]
            for s in memory.sessions
        ],
        "answer_session_ids": list(question.evidence_sessions),
    }


def write_longmemeval(path: str | Path, like: str, n_questions: int, seed: int = 0) -> int:
    """Write a LongMemEval-format JSON file (one question per haystack), memory by memory; returns
    the number of questions. Written to PATH.part and renamed at the end: a killed write leaves no
    partial file under PATH."""
    path = Path(path)
    part = path.with_name(path.name + ".part")
    count = 0
    with open(part, "w", encoding="utf-8") as fh:
        fh.write("[")
        for memory in iter_memories(like, n_questions, seed, questions_per_memory=1):
            fh.write(("," if count else "") + "\n" + json.dumps(_record(memory), ensure_ascii=False))
            count += 1
        fh.write("\n]\n")
    os.replace(part, path)
    return count


def _beam_chat(memory: Memory, plans: bool) -> tuple[list[Any], dict[str, int]]:
    """`memory` as a BEAM chat.json (batches of [user message, assistant reply] turns; integer message ids
    in order; in plans of BEAM_PLAN_BATCHES batches for beam-10m) and each turn id's message id."""
    ids: dict[str, int] = {}
    batches = []
    for b, session in enumerate(memory.sessions):
        anchor = f"{datetime.fromisoformat(session.timestamp):%B-%d-%Y}"
        turns: list[list[dict[str, Any]]] = []
        for t, turn in enumerate(session.turns):
            ids[turn.turn_id] = len(ids)
            message: dict[str, Any] = {"role": turn.speaker, "id": ids[turn.turn_id], "content": turn.text}
            if turn.speaker == "user":
                index = f"{b + 1},{len(turns) + 1}"
                message.update(content=f"{turn.text} ->-> {index}", index=index, question_type="main_question")
                if not turns:
                    message["time_anchor"] = anchor
                turns.append([message])
            elif turns:
                turns[-1].append(message)
            else:  # a batch that starts with the assistant: a turn of its own
                turns.append([message])
            del t
        batches.append({"batch_number": b + 1, "time_anchor": anchor, "turns": turns})
    if not plans:
        return batches, ids
    chunks = [batches[i:i + BEAM_PLAN_BATCHES] for i in range(0, len(batches), BEAM_PLAN_BATCHES)]
    return [{f"plan-{p + 1}": chunk} for p, chunk in enumerate(chunks)], ids


def write_beam(folder: str | Path, like: str = "beam-10m", conversations: int = 1, seed: int = 0) -> dict[str, int]:
    """Write `conversations` seeded BEAM-shaped conversations in the BEAM repository's layout under `folder`
    (`<n>/chat.json`, `<n>/probing_questions/probing_questions.json`, n from 1); each file is written
    beside its place and renamed, so a killed write leaves no partial file. Returns the counts written."""
    if not like.startswith("beam"):
        raise ValueError(f"write_beam: like={like!r} is not a BEAM shape ({', '.join(k for k in LIKES if k.startswith('beam'))})")
    shape = _shape(like)
    folder = Path(folder)
    counts = {"conversations": 0, "messages": 0, "questions": 0, "characters": 0}
    for index in range(conversations):
        memory = _memory(like, shape, index, shape.questions_per_memory, seed, None)
        chat, ids = _beam_chat(memory, plans=like == "beam-10m")
        probing: dict[str, list[dict[str, Any]]] = {}
        for question in memory.questions:
            probing.setdefault(question.category, []).append({
                "question": question.question, "answer": question.answer,
                "rubric": [f"States that it is {question.answer}"],
                "source_chat_ids": [ids[t] for t in question.evidence], "difficulty": "easy"})
        target = folder / str(index + 1)
        (target / "probing_questions").mkdir(parents=True, exist_ok=True)
        for path, data in ((target / "chat.json", chat), (target / "probing_questions" / "probing_questions.json", probing)):
            part = path.with_name(path.name + ".part")
            part.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
            os.replace(part, path)
        turns = memory.turns()
        counts["conversations"] += 1
        counts["messages"] += len(turns)
        counts["questions"] += len(memory.questions)
        counts["characters"] += sum(len(t.text) for t in turns)
    return counts


class HashEncoder:
    """A model-free TextEncoder: the normalised sum of per-token seeded unit vectors (see module doc).

    A text without tokens gets the vector of the empty token. Same interface as the bi-encoder (dim,
    dtype, devices, encode, info)."""

    def __init__(self, dim: int = 384, seed: int = 0):
        self._dim = int(dim)
        self.seed = int(seed)
        self.dtype = torch.float32
        self.devices = [torch.device("cpu")]
        self._vectors: dict[str, np.ndarray] = {}

    @property
    def dim(self) -> int:
        return self._dim

    def _token(self, token: str) -> np.ndarray:
        vector = self._vectors.get(token)
        if vector is None:
            rng = np.random.default_rng([self.seed, zlib.crc32(token.encode("utf-8"))])
            vector = self._vectors[token] = _unit(rng, 1, self._dim)[0].astype(np.float64)
        return vector

    def encode(self, texts: Sequence[str], batch_size: int = 128, progress: bool = False) -> torch.Tensor:
        out = np.empty((len(texts), self._dim), dtype=np.float32)
        for i, text in enumerate(texts):
            total = np.zeros(self._dim, dtype=np.float64)
            for token in tokenize(text) or [""]:
                total += self._token(token)
            norm = np.linalg.norm(total)
            out[i] = total / norm if norm > 0 else self._token("")
        return torch.from_numpy(out)

    def info(self) -> dict[str, Any]:
        return {"encoder": "hash", "dim": self._dim, "seed": self.seed}
