"""Benchmark loaders: LoCoMo, LongMemEval (S, M, oracle), MemGallery -> one schema (schema.py).

    load_benchmark("locomo")                                   # $MEMFIT_DATA_DIR, else the fetch cache
    load_benchmark("memgallery", "/data/memgallery/dialog")    # explicit file or folder
    select_questions(benchmark, exclude_categories=["5"], limit_memories=2)

Where data is looked for, first hit wins: the explicit path; $MEMFIT_DATA_DIR (a folder laid out like
../shared/data: locomo/locomo10.json, longmemeval/*.json, memgallery/dialog/); the fetch cache
($MEMFIT_CACHE/data, default ~/.cache/memfit/data, same layout, filled by `memfit data fetch`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Iterable
from pathlib import Path

from memfit_gpu.config import DataConfig
from memfit_gpu.data.locomo import load_locomo
from memfit_gpu.data.longmemeval import SPLIT_FILES, load_longmemeval
from memfit_gpu.data.memgallery import load_memgallery
from memfit_gpu.data.schema import Benchmark, DataError, Image, Memory, Question, Session, Turn

log = logging.getLogger(__name__)

BENCHMARKS = ("locomo", "longmemeval", "memgallery")
LONGMEMEVAL_SPLITS = ("s", "m", "oracle")

__all__ = [
    "BENCHMARKS",
    "Benchmark",
    "DataError",
    "DataNotFoundError",
    "Image",
    "Memory",
    "Question",
    "Session",
    "Turn",
    "cache_dir",
    "data_location",
    "load_benchmark",
    "resolve_data_path",
    "select_from_config",
    "select_questions",
]


class DataNotFoundError(FileNotFoundError):
    """No data where it was looked for; the message says how to get it."""


def cache_dir() -> Path:
    """Where `memfit data fetch` puts files: $MEMFIT_CACHE/data, default ~/.cache/memfit/data."""
    root = os.environ.get("MEMFIT_CACHE")
    return (Path(root).expanduser() if root else Path.home() / ".cache" / "memfit") / "data"


def _check_name(name: str) -> str:
    key = name.lower()
    if key not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r}: choose one of {', '.join(BENCHMARKS)}")
    return key


def _longmemeval_files(folder: Path, split: str | None) -> list[Path]:
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


def _files_in(name: str, root: Path, split: str | None) -> list[Path]:
    """The benchmark's files under `root`, which may be a file, the benchmark's own folder, or a data
    folder laid out like ../shared/data. Empty when nothing is there."""
    if root.is_file():
        return [root]
    if not root.is_dir():
        return []
    if name == "locomo":
        for candidate in (root / "locomo10.json", root / "locomo" / "locomo10.json"):
            if candidate.is_file():
                return [candidate]
        return []
    if name == "longmemeval":
        for folder in (root, root / "longmemeval"):
            files = _longmemeval_files(folder, split) if folder.is_dir() else []
            if files:
                return files
        return []
    # The dialog folder before `root` itself: memgallery/ also holds image_lfs_manifest.json.
    for folder in (root / "dialog", root / "memgallery" / "dialog", root):
        files = sorted(p for p in folder.glob("*.json") if p.is_file()) if folder.is_dir() else []
        if files:
            return files
    return []


def resolve_data_path(name: str, path: str | Path | None = None, split: str | None = None) -> list[Path]:
    """The files load_benchmark would read, or DataNotFoundError saying where it looked and what to run."""
    name = _check_name(name)
    if path is not None:
        root = Path(path).expanduser()
        files = _files_in(name, root, split)
        if not files:
            what = "does not exist" if not root.exists() else f"holds no {name} files"
            raise DataNotFoundError(f"{name}: {root} {what}; run `memfit data fetch {name}` or pass --path")
        return files
    looked: list[str] = []
    data_dir = os.environ.get("MEMFIT_DATA_DIR")
    if data_dir:
        looked.append(f"$MEMFIT_DATA_DIR={data_dir}")
        files = _files_in(name, Path(data_dir).expanduser(), split)
        if files:
            return files
    cache = cache_dir()
    looked.append(f"cache {cache}")
    files = _files_in(name, cache, split)
    if files:
        return files
    raise DataNotFoundError(
        f"no {name} data found (looked in {'; '.join(looked)}): run `memfit data fetch {name}` or pass --path"
    )


def data_location(name: str, path: str | Path | None = None, split: str | None = None) -> Path:
    """What to pass as `data.path` so another process (a SLURM task, a local sweep point) reads the
    same files without looking anywhere itself: the file when there is one, else their folder (absolute)."""
    files = resolve_data_path(name, path, split)
    location = files[0] if len(files) == 1 else Path(os.path.commonpath([f.parent for f in files]))
    return location.resolve()


def load_benchmark(name: str, path: str | Path | None = None, split: str | None = None) -> Benchmark:
    """Read a benchmark into the common schema.

    name: locomo | longmemeval | memgallery. path: a file or folder (see module doc); None looks in
    $MEMFIT_DATA_DIR then the fetch cache. split: LongMemEval only (s | m | oracle) when a folder holds
    several official files. Quirks are handled and listed in Benchmark.problems; a broken file raises
    DataError naming the file, the item and the field.
    """
    name = _check_name(name)
    files = resolve_data_path(name, path, split)
    log.info(
        "loading %s from %s",
        name,
        files[0] if len(files) == 1 else f"{len(files)} files in {files[0].parent}",
    )
    if name == "locomo":
        if len(files) != 1:
            raise DataError(
                str(files[0].parent), None, None, "LoCoMo is one file: pass the locomo10.json path"
            )
        benchmark = load_locomo(files[0])
    elif name == "longmemeval":
        benchmark = load_longmemeval(files)
    else:
        benchmark = load_memgallery(files)
    if benchmark.problems:
        log.info("%s: %d data quirks handled (Benchmark.problems)", name, len(benchmark.problems))
    return benchmark


def select_questions(
    benchmark: Benchmark,
    include_categories: Iterable[str] | None = None,
    exclude_categories: Iterable[str] | None = None,
    limit_memories: int | None = None,
    limit_questions: int | None = None,
) -> Benchmark:
    """A new Benchmark holding only the questions a run should answer.

    With neither list, the benchmark's evaluated questions are kept (LoCoMo: not category 5). A list
    decides: include_categories keeps exactly those categories, exclude_categories (alone: every other
    category is kept, `[]` = all of them) then drops categories, and every question kept is scored
    (`evaluated` True: LoCoMo's category 5 against its adversarial answer, as the LightMem-SLM paper's
    Table 2 scores it). The run's default (exclude ["5"]) is LoCoMo's evaluated set.
    Memories left without questions are dropped (nothing would read them); then the first
    `limit_memories` memories are kept and the first `limit_questions` questions of each. Sessions and
    turns are shared with the input, not copied.
    """
    include = None if include_categories is None else {str(c) for c in include_categories}
    exclude = set() if exclude_categories is None else {str(c) for c in exclude_categories}
    for label, value in (("limit_memories", limit_memories), ("limit_questions", limit_questions)):
        if value is not None and value < 0:
            raise ValueError(f"{label} must be >= 0, got {value}")
    memories: list[Memory] = []
    for memory in benchmark.memories:
        if limit_memories is not None and len(memories) >= limit_memories:
            break
        # a question a category list selects is scored (issue 24: exclude_categories=[] scores LoCoMo's
        # category 5 against its adversarial answer); no list at all keeps the benchmark's evaluated set
        kept = [
            q if q.evaluated else dataclasses.replace(q, evaluated=True)
            for q in memory.questions
            if (q.category in include if include is not None
                else q.evaluated if exclude_categories is None else True) and q.category not in exclude
        ]
        if limit_questions is not None:
            kept = kept[:limit_questions]
        if kept:
            memories.append(dataclasses.replace(memory, questions=kept))
    return Benchmark(
        name=benchmark.name, source=benchmark.source, memories=memories, problems=list(benchmark.problems)
    )


def select_from_config(benchmark: Benchmark, cfg: DataConfig) -> Benchmark:
    """select_questions with the fields of a config.DataConfig."""
    return select_questions(
        benchmark,
        include_categories=cfg.include_categories,
        exclude_categories=cfg.exclude_categories,
        limit_memories=cfg.limit_memories,
        limit_questions=cfg.limit_questions,
    )
