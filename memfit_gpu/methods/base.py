"""What a method gets from the run (`MethodRun`) and what it implements (`Method`).

A method's `write` stores what `run.memories` hold (its store, its indexes, LLM-written memories) and
`read` returns one packs.jsonl row per question of `run.questions`, in that order (methods/packs.py:
`pack_row`), and diagnostics.json. MemFit itself is a method (methods/memfit.py), as are the baselines.

The caller owns everything around them: `memfit run` (pipeline.py) writes packs.jsonl once and a rerun
that finds it complete calls neither; `memfit retrieve` (methods/offline.py) writes the same rows without
a reader. The answer call, the ledger check and scoring are shared. A method's LLM calls go through
`MethodRun.reader()` (the run's reader: response cache, ledger) with its own roles (its registry entry's), and
after each batch of calls it calls `MethodRun.account(point)` before it stores what the calls produced, as
MemFit's summaries do. `close` releases what the method holds open (its store); the caller calls it
whatever happened.

Questions need not come from a benchmark: `read` answers any batch of (memory id, question) pairs among
the memories written (`query` makes one without a gold answer), and `write` may be called again with more
memories, which a method with a persistent store adds to what it holds (the registry entry's
`incremental`). Timing: the caller times `write` as stage "build" and `read` as "retrieve" (timings.json);
a method may time a part of its write as a stage of its own with `run.stage(name)` (MemFit's
"summaries"), which is then not counted in "build" (StageClock).

Live: a method whose registry entry says `live` is also a `LiveMethod`, which memfit_gpu.Memory
drives while turns arrive: the Memory owns one EpisodeStore (the turns, verbatim, whatever the method) and
hands it to `attach`; after each write batch (turns added or deleted) it calls `changed` with the memories
touched, so the method brings what it derives from the turns up to date; `read` then answers any batch
of (memory id, query) pairs exactly as for a benchmark, and `hits` turns one of its rows into ranked hits.
`consolidate` is the write-time work that stays off the query path (MemFit's segment summaries,
LightMem's MTM notes and LTM graph), through `run.reader`; `compact` follows the store's compaction.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from memfit_gpu import faults
from memfit_gpu.config import MemFitConfig
from memfit_gpu.data.schema import Benchmark, Memory, Question
from memfit_gpu.readers.prompts import BenchmarkPrompts
from memfit_gpu.readers.reader import Reader
from memfit_gpu.store.episodes import EpisodeStore


def _no_ledger(point: str) -> None:
    faults.point(point)


def _untimed(name: str) -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext()


class StageClock:
    """Wall seconds per named stage, summed over the stage's runs. A stage opened inside another counts
    only to the inner one (the outer stage's seconds exclude it), so nested stages never count twice.
    `ended` is called after every stage with the clock (run/directory.py StageTimer saves timings.json there)."""

    def __init__(self, seconds: dict[str, float] | None = None,
                 ended: Callable[[StageClock], None] | None = None) -> None:
        self.seconds: dict[str, float] = dict(seconds or {})
        self._ended = ended
        self._inner: list[float] = []  # per open stage: seconds spent in stages nested in it

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        self._inner.append(0.0)
        try:
            yield
        finally:
            elapsed = time.perf_counter() - started
            nested = self._inner.pop()
            self.seconds[name] = self.seconds.get(name, 0.0) + elapsed - nested
            if self._inner:
                self._inner[-1] += elapsed
            if self._ended is not None:
                self._ended(self)


@dataclass
class MethodRun:
    cfg: MemFitConfig  # the run's configuration (index.device where the device plan put retrieval)
    out: Path | None  # the run directory (None: nothing is kept there, e.g. `memfit retrieve`)
    bench: Benchmark
    memories: list[Memory]  # the selected memories
    questions: list[Question]  # the questions to make packs for, in order
    reader: Callable[[], Reader] | None = None  # the run's cached, accounted reader (on first call); None: no LLM here
    # Save the ledger, then pass the named fault point: called after each batch of LLM calls, before
    # what they produced is stored, so a kill in between costs cache hits, never unaccounted calls.
    account: Callable[[str], None] = _no_ledger
    progress: bool = False
    stage: Callable[[str], contextlib.AbstractContextManager[None]] = _untimed  # the caller's stage clock (timings.json)
    # an existing store to read, never written (`memfit retrieve --store`): its memories must be there
    store_path: Path | None = None
    # the answer protocol and the benchmark's prompt files (MemGallery's, BEAM's) as the run resolved them
    # (RunInputs.prompts); None: none were resolved (`memfit retrieve`: no answers, sizes as protocol paper)
    prompts: BenchmarkPrompts | None = None

    def store_location(self) -> Path | None:
        """Where a method keeps its store: `store_path` when given, else store.path, else DIR/store in a run
        directory, else nowhere (in memory)."""
        if self.store_path is not None:
            return Path(self.store_path)
        if self.cfg.store.path is not None:
            return Path(self.cfg.store.path)
        return self.out / "store" if self.out is not None else None


class Method(Protocol):
    name: str

    def write(self, run: MethodRun) -> None: ...

    def read(self, run: MethodRun) -> tuple[list[dict[str, Any]], dict[str, Any]]: ...

    def close(self) -> None: ...


@dataclass
class Hit:
    """One ranked item a live search returns: a turn (kind episode), or what a method made from turns (a
    MemFit summary, a naive_rag chunk, a LightMem note or graph node), with the turns behind it."""

    kind: str  # episode | summary | chunk | mtm | ltm | memory (a peer system's own, e.g. mem0's)
    text: str  # the turn's own words (episode), else the item's text
    score: float  # the method's final score (rank order)
    turn_ids: list[str]  # the turn itself, or the turns the item was made from
    scores: dict[str, float | None]  # the stage scores behind `score` (MemFit: bm25, dense, fused, boost, rerank)
    speaker: str | None = None  # episode only
    timestamp: str | None = None  # episode only: ISO 8601
    session_id: str | None = None  # episode only

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "turn_id": self.turn_ids[0] if self.kind == "episode" else None,
                "text": self.text, "score": self.score, "scores": self.scores, "turn_ids": self.turn_ids,
                "speaker": self.speaker, "timestamp": self.timestamp, "session_id": self.session_id}


def episode_hit(store: EpisodeStore, row: int, score: float, scores: dict[str, float | None]) -> Hit:
    """A Hit for one stored turn."""
    stamp = store.timestamp[row]
    return Hit("episode", store.body(row), score, [str(store.turn_id[row])], scores, store.speaker_name(row),
               None if np.isnat(stamp) else str(stamp), store.session_ids[int(store.session_idx[row])])


# What a LiveMethod defines beyond a Method: a registry entry with live=True is refused without them
LIVE_MEMBERS = ("attach", "changed", "hits", "consolidate", "unconsolidated", "compact")


class LiveMethod(Method, Protocol):
    def attach(self, run: MethodRun, store: EpisodeStore) -> None: ...

    def changed(self, run: MethodRun, memory_ids: list[str]) -> None: ...

    def hits(self, row: dict[str, Any], k: int) -> list[Hit]: ...

    def consolidate(self, run: MethodRun, memory_ids: list[str],
                    holding: Callable[[], contextlib.AbstractContextManager[Any]]) -> dict[str, int]: ...

    def unconsolidated(self, memory_ids: list[str]) -> dict[str, int]:
        """Per memory, its live turns that no consolidation has taken up yet (0 or absent: none); a live
        memory reads it on opening and after a compaction, so turns added before a close, and notes a
        compaction dropped, are consolidated like new turns."""
        ...

    def compact(self, run: MethodRun, store: EpisodeStore, purged: list[str]) -> None:
        """The store was compacted (its rows renumbered, deleted turns gone); `purged`: the memories that had
        deleted turns (what was made over those turns must go, even where a new turn took a deleted one's id)."""
        ...


def query(memory_id: str, question: str, question_id: str | None = None, question_date: str | None = None) -> Question:
    """A question to read for that is not a benchmark's: no gold answer, no evidence, no category."""
    return Question(question_id or f"{memory_id}:query", memory_id, question, "", "", evidence=[],
                    question_date=question_date)


class GrowthMethod(Method, Protocol):
    """A method that also reads its memory as it stood after each memory's first `turns[memory id]` turns,
    from its one write of the whole trajectory (the growth analysis, memfit_gpu/run/growth.py)."""

    def read_at(self, run: MethodRun, turns: dict[str, int]) -> tuple[list[dict[str, Any]], dict[str, Any]]: ...


class DepthMethod(Method, Protocol):
    """A method whose pack is the top k of a ranking that k does not change (its registry entry's `depths`): it
    also packs its rows' ranking at another depth, without retrieving again (eval.pack_cutoffs, memfit_gpu/run/depths.py)."""

    def read_depth(self, run: MethodRun, rows: list[dict[str, Any]], k: int) -> tuple[list[dict[str, Any]], dict[str, Any]]: ...
