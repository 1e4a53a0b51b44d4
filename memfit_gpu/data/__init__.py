"""Benchmark loaders: LoCoMo, LongMemEval (S, M, oracle), MemGallery, your own jsonl -> one schema (schema.py).

Each loader module carries its BenchmarkSpec (spec.py; registry.py collects them by name): where its files
are, how they are read, its categories, protocol, judge and published shape.

    load_benchmark("locomo")                                   # $MEMFIT_DATA_DIR, else the fetch cache
    load_benchmark("memgallery", "/data/memgallery/dialog")    # explicit file or folder
    select_questions(benchmark, exclude_categories=["5"], limit_memories=2)

Where data is looked for, first hit wins: the explicit path; $MEMFIT_DATA_DIR (a folder laid out like
../shared/data: locomo/locomo10.json, longmemeval/*.json, memgallery/dialog/); the fetch cache
($MEMFIT_CACHE/data, default ~/.cache/memfit/data, same layout, filled by `memfit data fetch`).
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from memfit_gpu.config import ConfigError, DataConfig
from memfit_gpu.data.registry import benchmark_spec, find_spec
from memfit_gpu.data.schema import Benchmark, DataError, Image, Memory, Question, Session, Turn

log = logging.getLogger(__name__)

__all__ = [
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
    "read_benchmark",
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


def resolve_data_path(name: str, path: str | Path | None = None, split: str | None = None) -> list[Path]:
    """The files load_benchmark would read, or DataNotFoundError saying where it looked and what to run."""
    spec = benchmark_spec(name)
    name = spec.name
    if split is not None and split not in spec.splits:  # another benchmark's split, or none to have
        have = f"its splits are {', '.join(spec.splits)}" if spec.splits else "it has no splits: leave data.split unset"
        raise ConfigError(f"data.split={split!r} is no split of {name}: {have}")
    how = f"run `memfit data fetch {name}` or pass --path" if spec.fetchable else "pass --path (data.path)"
    if path is not None:
        root = Path(path).expanduser()
        files = spec.files_in(root, split)
        if not files:
            what = "does not exist" if not root.exists() else f"holds no {name} files"
            raise DataNotFoundError(f"{name}: {root} {what}; {how}")
        return files
    looked: list[str] = []
    data_dir = os.environ.get("MEMFIT_DATA_DIR")
    if data_dir:
        looked.append(f"$MEMFIT_DATA_DIR={data_dir}")
        files = spec.files_in(Path(data_dir).expanduser(), split)
        if files:
            return files
    cache = cache_dir()
    looked.append(f"cache {cache}")
    files = spec.files_in(cache, split)
    if files:
        return files
    raise DataNotFoundError(f"no {name} data found (looked in {'; '.join(looked)}): {how}")


def data_location(name: str, path: str | Path | None = None, split: str | None = None) -> Path:
    """What to pass as `data.path` so another process (a SLURM task, a local sweep point) reads the
    same files without looking anywhere itself: the file when there is one, else their folder (absolute)."""
    files = resolve_data_path(name, path, split)
    location = files[0] if len(files) == 1 else Path(os.path.commonpath([f.parent for f in files]))
    return location.resolve()


def load_benchmark(name: str, path: str | Path | None = None, split: str | None = None) -> Benchmark:
    """Read a benchmark into the common schema.

    name: a registered benchmark (data/registry.py: locomo | longmemeval | memgallery | jsonl | ...). path: a
    file or folder (see module doc); None looks in $MEMFIT_DATA_DIR then the fetch cache. split: LongMemEval
    only (s | m | oracle) when a folder holds several official files. Quirks are handled and listed in
    Benchmark.problems; a broken file raises DataError naming the file, the item and the field.
    """
    return read_benchmark(name, resolve_data_path(name, path, split))


def read_benchmark(name: str, files: Sequence[Path]) -> Benchmark:
    """load_benchmark on files already found (resolve_data_path: a run's RunInputs.files)."""
    spec = benchmark_spec(name)
    log.info(
        "loading %s from %s",
        spec.name,
        files[0] if len(files) == 1 else f"{len(files)} files in {files[0].parent}",
    )
    benchmark = spec.load(list(files))
    if benchmark.problems:
        log.info("%s: %d data quirks handled (Benchmark.problems)", spec.name, len(benchmark.problems))
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
    Table 2 scores it), except questions a data quirk excludes (an empty question, gold answer or
    conversation: `extra["excluded"]`), which no list selects. The run's default (neither list) is the
    benchmark's evaluated set: LoCoMo's loader marks category 5 unevaluated; own data says it per question
    (`evaluated`), and no category label is special there.
    Memories left without questions are dropped (nothing would read them); then the first
    `limit_memories` memories are kept and the first `limit_questions` questions of each. Sessions and
    turns are shared with the input, not copied.
    A label in either list that is no category of the benchmark (no question has it, its spec does not know
    it) is a ConfigError naming the key and the benchmark's categories.
    """
    include = None if include_categories is None else {str(c) for c in include_categories}
    exclude = set() if exclude_categories is None else {str(c) for c in exclude_categories}
    _check_category_labels(benchmark, include, exclude)
    for label, value in (("limit_memories", limit_memories), ("limit_questions", limit_questions)):
        if value is not None and value < 0:
            raise ValueError(f"{label} must be >= 0, got {value}")
    memories: list[Memory] = []
    for memory in benchmark.memories:
        if limit_memories is not None and len(memories) >= limit_memories:
            break
        # a question a category list selects is scored (exclude_categories=[] scores LoCoMo's
        # category 5 against its adversarial answer); no list at all keeps the benchmark's evaluated set
        kept = [
            q if q.evaluated else dataclasses.replace(q, evaluated=True)
            for q in memory.questions
            if (q.category in include if include is not None
                else q.evaluated if exclude_categories is None else True) and q.category not in exclude
            and "excluded" not in q.extra
        ]
        if limit_questions is not None:
            kept = kept[:limit_questions]
        if kept:
            memories.append(dataclasses.replace(memory, questions=kept))
    return Benchmark(
        name=benchmark.name, source=benchmark.source, memories=memories, problems=list(benchmark.problems)
    )


# What an older memfit wrote into every run's config.yaml as data.exclude_categories, whatever the benchmark
# (LoCoMo's category 5): on a benchmark without that label it excludes nothing, and refusing it would leave those
# runs unreadable (resume, judge audit), so it is let through with a warning.
_OLD_DEFAULT_EXCLUDE = frozenset({"5"})


def _check_category_labels(benchmark: Benchmark, include: set[str] | None, exclude: set[str]) -> None:
    """ConfigError for a label in a category list that is no category of the benchmark: no question has it
    and its spec does not know it. Such a label selects nothing, so a mistyped or other benchmark's label
    (`adversarial` for LoCoMo's 5) would score a different question set without a word."""
    spec = find_spec(benchmark.name)
    named = dict(spec.categories) if spec is not None else {}
    known = list(dict.fromkeys([*named, *(spec.labels if spec is not None else ())]))
    labels = known + sorted({q.category for m in benchmark.memories for q in m.questions} - set(known))
    for key, chosen in (("data.include_categories", include), ("data.exclude_categories", exclude)):
        unknown = sorted(c for c in chosen or () if c not in labels)
        if not unknown:
            continue
        if key == "data.exclude_categories" and include is None and set(unknown) <= _OLD_DEFAULT_EXCLUDE:
            log.warning("%s=%s names no category of %s: nothing is excluded for it (an older memfit's default)",
                        key, sorted(chosen or ()), benchmark.name)
            continue
        shown = ", ".join(f"{c} ({named[c]})" if named.get(c, c) != c else c for c in labels)
        by_name = {name: c for c, name in named.items()}  # LoCoMo's are selected by id: 5, not adversarial
        hints = []
        for label in unknown:
            meant = by_name.get(label) or next(iter(difflib.get_close_matches(label, labels, n=1)), None)
            if meant is not None:
                hints.append(f"{meant!r} instead of {label!r}")
        hint = f"; did you mean {', '.join(hints)}?" if hints else ""
        what = "is no category" if len(unknown) == 1 else "are no categories"
        raise ConfigError(f"{key}: {', '.join(map(repr, unknown))} {what} of {benchmark.name}: its categories are "
                          f"{shown or '(none: it holds no question)'}{hint}")


def select_from_config(benchmark: Benchmark, cfg: DataConfig) -> Benchmark:
    """select_questions with the fields of a config.DataConfig."""
    return select_questions(
        benchmark,
        include_categories=cfg.include_categories,
        exclude_categories=cfg.exclude_categories,
        limit_memories=cfg.limit_memories,
        limit_questions=cfg.limit_questions,
    )
