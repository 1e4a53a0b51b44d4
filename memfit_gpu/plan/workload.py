"""The workload: counted from the benchmark file, else the benchmark's published shape."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from memfit_gpu.config import MemFitConfig
from memfit_gpu.data import DataNotFoundError, read_benchmark, resolve_data_path, select_from_config
from memfit_gpu.data.registry import benchmark_spec
from memfit_gpu.data.schema import Benchmark, Memory
from memfit_gpu.data.synth import LIKES, iter_memories
from memfit_gpu.index.tokenize import tokenize_many
from memfit_gpu.plan.sizes import BM25_DENSE_FACTOR, HEAPS_EXPONENT, SAMPLE_EPISODES
from memfit_gpu.store.text import episode_text

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Workload:
    benchmark: str
    source: str  # where the numbers come from, in words
    from_file: bool
    memories: int
    episodes: int
    questions: int
    widest: int  # episodes of the largest memory (BM25's padded width)
    turns_loaded: int  # turns of the whole loaded benchmark (the run keeps it in memory)
    text_bytes: int  # UTF-8 bytes of every stored episode text
    tokens: int  # BM25 tokens over all episodes
    postings: int  # distinct (episode, term) pairs
    terms: int  # distinct (memory, term) pairs
    dense_terms: int  # terms BM25 keeps as dense rows (df >= widest / 8)
    summaries: int  # at most this many summaries
    sampled: str  # what was tokenised
    unknown: bool = False  # no file and no published shape: every count is 0

    def describe(self) -> str:
        if self.unknown:
            return f"{self.benchmark}: UNKNOWN workload ({self.source}): data sizes are not counted"
        per = self.episodes or 1
        return (f"{self.benchmark}: {self.memories:,} memories, {self.episodes:,} episodes, {self.questions:,} questions; "
                f"{self.tokens / per:.0f} tokens and {self.postings / per:.0f} distinct terms per episode, "
                f"{self.terms:,} terms ({self.source}; {self.sampled})")


@dataclass
class _Sample:
    episodes: int = 0
    tokens: int = 0
    postings: int = 0
    terms: int = 0
    dense_terms: int = 0
    memories: int = 0

    def add(self, texts: Sequence[str], width: int) -> None:
        token_lists = tokenize_many(texts)
        df: Counter[str] = Counter()
        for tokens in token_lists:
            distinct = set(tokens)
            self.tokens += len(tokens)
            self.postings += len(distinct)
            df.update(distinct)
        self.episodes += len(texts)
        self.terms += len(df)
        self.dense_terms += sum(1 for count in df.values() if count * BM25_DENSE_FACTOR >= max(width, 1))
        self.memories += 1


def _summaries(cfg: MemFitConfig, sizes: Sequence[int]) -> int:
    if not cfg.summary.enabled:
        return 0
    return int(sum(min(cfg.summary.max_summaries, n // max(1, cfg.summary.min_segment)) for n in sizes))


def workload_of(cfg: MemFitConfig, memories: Sequence[Memory], questions: int, turns_loaded: int, source: str,
                sample_episodes: int = SAMPLE_EPISODES, seed: int = 0) -> Workload:
    """Counts of `memories` (what the run stores) and BM25 statistics from whole memories tokenised in a
    seeded order until `sample_episodes` episodes are seen (all of them when fewer)."""
    sizes = [sum(len(s.turns) for s in m.sessions) for m in memories]
    episodes = int(sum(sizes))
    widest = max(sizes, default=0)
    text_bytes = sum(len(episode_text(t).encode()) for m in memories for s in m.sessions for t in s.turns)
    sample = _Sample()
    for i in np.random.default_rng(seed).permutation(len(memories)).tolist():
        if sample.episodes >= sample_episodes:
            break
        sample.add([episode_text(t) for s in memories[i].sessions for t in s.turns], widest)
    scale = episodes / sample.episodes if sample.episodes else 0.0
    whole = sample.memories == len(memories)
    sampled = (f"all {episodes:,} episodes tokenised" if whole else
               f"{sample.episodes:,} episodes of {sample.memories} memories tokenised (seed {seed}), scaled x{scale:.2f}")
    return Workload(
        benchmark=cfg.data.benchmark, source=source, from_file=True, memories=len(memories), episodes=episodes,
        questions=questions, widest=widest, turns_loaded=turns_loaded, text_bytes=int(text_bytes),
        tokens=round(sample.tokens * scale), postings=round(sample.postings * scale), terms=round(sample.terms * scale),
        dense_terms=round(sample.dense_terms * scale), summaries=_summaries(cfg, sizes), sampled=sampled,
    )


def _workload_from_shape(cfg: MemFitConfig, why: str, seed: int = 0) -> Workload:
    published = benchmark_spec(cfg.data.benchmark).published_shape(cfg.data.split)
    if published is None:
        note = f"no published shape for {cfg.data.benchmark}"
        log.warning("plan: %s and %s: the data part of the plan is UNKNOWN (counted as 0)", why, note)
        return Workload(cfg.data.benchmark, f"{why}; {note}", False, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                        "nothing sampled", unknown=True)
    like, note = published.like, published.note
    shape = LIKES[like]
    memories = published.memories
    if cfg.data.limit_memories is not None:
        memories = min(memories, cfg.data.limit_memories)
    if published.episodes is not None:
        per_memory = published.episodes / published.memories
    else:
        per_memory = (sum(shape.sessions) / 2) * (sum(shape.turns) / 2)
    questions = published.questions
    if cfg.data.include_categories is None:
        excluded = cfg.data.exclude_categories
        questions -= sum(n for category, n in published.excluded.items() if excluded is None or category in excluded)
    per_q = questions / published.memories
    if cfg.data.limit_questions is not None:
        per_q = min(per_q, cfg.data.limit_questions)
    episodes = round(memories * per_memory)
    # whole synthetic memories of the shape: BM25 statistics per episode, per memory and the widest memory
    sample = _Sample()
    synth = list(iter_memories(like, n_questions=published.sample_memories * shape.questions_per_memory, seed=seed))
    widest = max(sum(len(s.turns) for s in m.sessions) for m in synth)
    text_bytes = 0
    for m in synth:
        texts = [episode_text(t) for s in m.sessions for t in s.turns]
        text_bytes += sum(len(t.encode()) for t in texts)
        sample.add(texts, widest)
    per_episode = episodes / sample.episodes
    # synthetic turns are shorter than the published ones: scale tokens and text linearly, distinct terms
    # by HEAPS_EXPONENT (the dense-row count is left as sampled)
    length = published.tokens_per_episode / (sample.tokens / sample.episodes)
    distinct = length**HEAPS_EXPONENT
    return Workload(
        benchmark=cfg.data.benchmark, source=f"published shape {like} ({why}{'; ' + note if note else ''})",
        from_file=False, memories=memories, episodes=episodes, questions=round(memories * per_q), widest=widest,
        turns_loaded=episodes, text_bytes=round(text_bytes * per_episode * length),
        tokens=round(sample.tokens * per_episode * length), postings=round(sample.postings * per_episode * distinct),
        terms=round(sample.terms * per_episode * distinct), dense_terms=round(sample.dense_terms * per_episode),
        summaries=_summaries(cfg, [round(per_memory)] * memories),
        sampled=(f"{sample.memories} synthetic memories (data/synth.py, seed {seed}), turn length x{length:.2f} "
                 "to the published length"),
    )


def estimate_workload(cfg: MemFitConfig, sample_episodes: int = SAMPLE_EPISODES, seed: int = 0) -> Workload:
    """The run's workload: counted from the benchmark file when it is found (data.benchmark, data.path,
    data.split, $MEMFIT_DATA_DIR, the fetch cache), else the benchmark's published shape."""
    try:
        files = resolve_data_path(cfg.data.benchmark, cfg.data.path, cfg.data.split)
    except DataNotFoundError:
        return _workload_from_shape(cfg, "no benchmark file found", seed)
    bench = read_benchmark(cfg.data.benchmark, files)
    return benchmark_workload(cfg, bench, select_from_config(bench, cfg.data), files, sample_episodes, seed)


def benchmark_workload(cfg: MemFitConfig, bench: Benchmark, selected: Benchmark, files: Sequence[Path],
                       sample_episodes: int = SAMPLE_EPISODES, seed: int = 0) -> Workload:
    """The workload counted from `bench`, read from `files`, and `selected`, the memories and questions data.*
    selects from it (a run's inputs: read and selected once, for the plan and the run)."""
    where = str(files[0]) if len(files) == 1 else f"{len(files)} files in {files[0].parent}"
    return workload_of(cfg, selected.memories, sum(len(m.questions) for m in selected.memories),
                       sum(len(s.turns) for m in bench.memories for s in m.sessions), f"benchmark file {where}",
                       sample_episodes, seed)
