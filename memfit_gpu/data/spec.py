"""BenchmarkSpec: everything memfit knows about one benchmark, in the benchmark's own loader module.

Each loader module (locomo.py, longmemeval.py, memgallery.py, jsonl.py) ends with its `SPEC`; data/registry.py
collects them by name, and every place that once asked "which benchmark is this?" asks the spec instead:

    load, files_in      data/__init__.py: where its files are under a path or data folder, how they are read
    fetchable, splits   data/fetch.py and `memfit data fetch`: the catalogue's files, LongMemEval's splits
    categories          evaluate/tables.py: category id -> name (with `category_source`, where the mapping is
                        written), `averaging` (category_mean | question_mean), `title` of the results table
    protocol, judge     readers/prompts.py: the answer protocol and the judge kind `auto` stands for
    shapes              plan/: the published shape when the benchmark file is not on the machine
    not_evaluated       the categories a loader marks unscored (LoCoMo's adversarial category 5)
    units               data/stats.py: what the benchmark calls its memories, sessions, turns and categories

A new benchmark is a loader module with a SPEC and one `register_benchmark(SPEC)` call (data/registry.py).
This module imports nothing but the schema: specs are plain data and functions.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from memfit_gpu.data.schema import Benchmark

AVERAGING_RULES: tuple[str, ...] = ("category_mean", "question_mean")
PROTOCOLS: tuple[str, ...] = ("paper", "memgallery", "beam")
JUDGE_KINDS: tuple[str, ...] = ("paper", "longmemeval", "memgallery", "beam")


@dataclass(frozen=True)
class PublishedShape:
    """A benchmark's published size, for the device plan when its file is not here (plan/)."""

    like: str  # the data/synth.py shape whose synthetic memories stand in for it (data.synth.LIKES)
    memories: int
    questions: int
    tokens_per_episode: float  # BM25 tokens per stored turn in the published data
    episodes: int | None = None  # turns of the released file; None = synth's sessions x turns per memory
    # questions per category the benchmark does not evaluate, which the default selection leaves out (LoCoMo: 5)
    excluded: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    sample_memories: int = 4  # synthetic memories generated to measure BM25 statistics
    note: str = ""  # said in the plan when this shape stands for something else (an upper bound)


def _no_files(root: Path, split: str | None) -> list[Path]:
    return [root] if root.is_file() else []


@dataclass(frozen=True)
class BenchmarkSpec:
    name: str  # data.benchmark
    title: str  # the results table's heading
    load: Callable[[list[Path]], Benchmark]  # its files -> Benchmark (DataError naming file, item, field)
    # a file or folder (the benchmark's own, or a data folder laid out like ../shared/data) -> its files
    files_in: Callable[[Path, str | None], list[Path]] = _no_files
    layout: str = "FILE"  # where $MEMFIT_DATA_DIR holds it, in words (`memfit data --help`)
    fetchable: bool = False  # data/checksums.json lists official files (`memfit data fetch`)
    splits: tuple[str, ...] = ()  # data.split values (LongMemEval: s, m, oracle)
    default_split: str | None = None  # the split fetch and the plan take when none is given
    categories: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))  # id -> name
    # every label its files may hold where `categories` names only some (MemGallery's nine points): a file holding
    # a subset still selects by any of them (data.include/exclude_categories)
    labels: tuple[str, ...] = ()
    category_source: str = ""  # where the id -> name mapping is written (the official scorer's file)
    averaging: str = "question_mean"  # "Average" of the results table
    protocol: str = "paper"  # reader.protocol=auto
    judge: str = "paper"  # eval.judge.prompt=auto
    not_evaluated: frozenset[str] = frozenset()  # categories the loader marks evaluated=False
    # its category ids are LoCoMo's: the `locomo` metric variant applies their rules (1: multi-hop answers cut at
    # commas, 3: at ";", 5: the adversarial indicator); another benchmark's labels are scored as plain F1
    locomo_categories: bool = False
    shapes: Mapping[str | None, PublishedShape] = field(default_factory=lambda: MappingProxyType({}))
    # `memfit data stats` names: memories, sessions, turns, category -> the benchmark's own words (BEAM:
    # conversations, batches, messages, ability); a name not given keeps memfit's
    units: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))

    def __post_init__(self) -> None:
        if self.averaging not in AVERAGING_RULES:
            raise ValueError(f"BenchmarkSpec {self.name}: averaging {self.averaging!r} is not one of {AVERAGING_RULES}")
        if self.protocol not in PROTOCOLS or self.judge not in JUDGE_KINDS:
            raise ValueError(f"BenchmarkSpec {self.name}: protocol must be one of {PROTOCOLS} and judge one of "
                             f"{JUDGE_KINDS}")

    def category_name(self, category: str) -> str:
        return self.categories.get(str(category), str(category))

    def published_shape(self, split: str | None) -> PublishedShape | None:
        """The published shape of `split` (None: the default split's), or None when there is none."""
        return self.shapes.get(split if split is not None else self.default_split)
