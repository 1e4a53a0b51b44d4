"""What a method gets from the run (`MethodRun`) and what it implements (`Method`).

A method's `write` does its write-time work (indexes, LLM-written memories) and `read` returns one
packs.jsonl row per question, in question order, and diagnostics.json. The run owns everything around
them: packs.jsonl is written once and a rerun that finds it complete calls neither; the answer call, the
ledger check and scoring are MemFit's. A method's LLM calls go through `MethodRun.reader()` (the run's
reader: response cache, ledger) with its own roles (readers.ROLES), and after each batch of calls it
calls `MethodRun.account(point)` before it stores what the calls produced, as the summaries do.
`close` releases what the method holds open (its store); the run calls it whatever happened.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from memfit_gpu import faults
from memfit_gpu.config import MemFitConfig
from memfit_gpu.data.schema import Benchmark, Memory, Question


def _no_ledger(point: str) -> None:
    faults.point(point)


@dataclass
class MethodRun:
    cfg: MemFitConfig
    out: Path | None  # the run directory (None: nothing is kept, e.g. `memfit retrieve` in memory)
    bench: Benchmark
    memories: list[Memory]  # the selected memories
    questions: list[Question]  # the questions to make packs for, in order
    reader: Callable[[], Any] | None = None  # the run's cached, accounted reader; None: no LLM here
    # Save the ledger, then pass the named fault point: called after each batch of LLM calls, before
    # what they produced is stored, so a kill in between costs cache hits, never unaccounted calls.
    account: Callable[[str], None] = _no_ledger
    memgallery_dir: Path | None = None  # the MemGallery prompt folder when the answer protocol is memgallery
    progress: bool = False


class Method(Protocol):
    name: str

    def write(self, run: MethodRun) -> None: ...

    def read(self, run: MethodRun) -> tuple[list[dict[str, Any]], dict[str, Any]]: ...

    def close(self) -> None: ...


class GrowthMethod(Method, Protocol):
    """A method that also reads its memory as it stood after each memory's first `turns[memory id]` turns,
    from its one write of the whole trajectory (the growth analysis, memfit_gpu/growth.py)."""

    def read_at(self, run: MethodRun, turns: dict[str, int]) -> tuple[list[dict[str, Any]], dict[str, Any]]: ...
