"""Summary layer (SPEC write path 3-4): one note per segment, built for every memory in one batch.

A summary prompt shows up to `max_excerpts` evenly spaced member turns. Each excerpt is the turn
without its `DATE: ... | Speaker X says: ` prefix but kept as `X: text`, so people stay named (the
summary is read alone), cut to `excerpt_chars` characters, as a `- ` bullet. The instruction is
`memfit_gpu/prompts/<summary.prompt>` with `{excerpts}` in it.

`generate(prompts) -> texts` is any callable (a reader's summary role, or a plain function): the
store does not care which LLM runs. Outputs shorter than `min_chars` (after stripping) are dropped.
A summary's provenance is its member episode rows; event time = the first member's timestamp,
recorded time = the last member's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from memfit_gpu.readers.prompts import PromptError, load_prompt
from memfit_gpu.segment import segment_batch, summary_segments

if TYPE_CHECKING:
    from memfit_gpu.store.episodes import EpisodeStore

log = logging.getLogger(__name__)


def excerpt_positions(count: int, limit: int) -> np.ndarray:
    """Up to `limit` evenly spaced indices into `count` members, first and last included."""
    if count <= limit:
        return np.arange(count)
    return np.unique(np.round(np.linspace(0, count - 1, limit)).astype(np.int64))


def summary_prompt(store: EpisodeStore, members: Sequence[int]) -> str:
    cfg = store.cfg.summary
    members = np.asarray(members, dtype=np.int64)
    lines = []
    for row in members[excerpt_positions(len(members), cfg.max_excerpts)]:
        excerpt = f"{store.speaker_name(int(row))}: {store.body(int(row))}"
        lines.append("- " + " ".join(excerpt.split())[: cfg.excerpt_chars])
    template = load_prompt(cfg.prompt)
    if "{excerpts}" not in template:
        raise PromptError(f"summary.prompt={cfg.prompt!r}: a summary prompt must contain the {{excerpts}} placeholder")
    return template.replace("{excerpts}", "\n".join(lines))


def _iso(value: np.datetime64) -> str | None:
    return None if np.isnat(value) else str(value)


def summary_records(
    store: EpisodeStore,
    jobs: Sequence[tuple[int, np.ndarray]],
    generate: Callable[[list[str]], list[str]],
    first_row: int,
    replaces: Sequence[int | None] | None = None,
) -> list[dict[str, Any]]:
    """Summary records for (memory_idx, member rows) jobs: ONE generate call for all of them."""
    cfg = store.cfg.summary
    jobs = [(m, np.asarray(members, dtype=np.int64)) for m, members in jobs]
    keep = [i for i, (_, members) in enumerate(jobs) if len(members) >= cfg.min_segment]
    if not keep:
        return []
    prompts = [summary_prompt(store, jobs[i][1]) for i in keep]
    outputs = generate(prompts)
    if len(outputs) != len(prompts):
        raise ValueError(f"summary generate returned {len(outputs)} texts for {len(prompts)} prompts")
    records: list[dict[str, Any]] = []
    dropped = 0
    for i, output in zip(keep, outputs, strict=True):
        text = (output or "").strip()
        if len(text) < cfg.min_chars:
            dropped += 1
            continue
        memory, members = jobs[i]
        records.append({
            "t": "summary",
            "row": first_row + len(records),
            "memory": int(memory),
            "text": text,
            "members": members.tolist(),
            "event": _iso(store.timestamp[members[0]]),
            "recorded": _iso(store.timestamp[members[-1]]),
            "replaces": None if replaces is None else replaces[i],
        })
    if dropped:
        log.info("summaries: dropped %d of %d outputs shorter than %d characters", dropped, len(prompts), cfg.min_chars)
    return records


def segment_memories(store: EpisodeStore, memories: Sequence[int]) -> list[list[np.ndarray]]:
    """TextTiling segments (as member row arrays) of each memory's live episodes, batched."""
    rows = [store.memory_rows(m) for m in memories]
    embeddings = [store.episode_dense.vectors(r) for r in rows]
    segments = segment_batch(embeddings, store.cfg.segment)
    return [[r[start:end] for start, end in segs] for r, segs in zip(rows, segments, strict=True)]


def build_summaries(
    store: EpisodeStore,
    generate: Callable[[list[str]], list[str]],
    memory_ids: Sequence[str] | None = None,
    progress: bool = True,
) -> int:
    """Summarise the segments of every memory not summarised before; returns how many summaries were added."""
    if not store.cfg.summary.enabled:
        log.info("summaries: disabled (summary.enabled=false); nothing built")
        return 0
    wanted = range(len(store.memory_ids)) if memory_ids is None else [store.memory_of(m) for m in memory_ids]
    memories = [m for m in wanted if m not in store.summarised]
    if len(memories) < len(wanted):
        log.info("summaries: %d memories already have summaries; they are not re-summarised", len(wanted) - len(memories))
    if not memories:
        return 0
    jobs: list[tuple[int, np.ndarray]] = []
    for memory, segments in zip(memories, segment_memories(store, memories), strict=True):
        lengths = [len(s) for s in segments]
        starts = np.cumsum([0, *lengths])
        by_start = {int(starts[i]): segments[i] for i in range(len(segments))}
        spans = summary_segments([(int(starts[i]), int(starts[i + 1])) for i in range(len(segments))], store.cfg.summary)
        jobs.extend((memory, by_start[start]) for start, _ in spans)
    records = summary_records(store, jobs, generate, first_row=len(store.summaries))
    # Remember which memories were summarised, even where every output was dropped: asking again would
    # re-summarise the same segments (and at temperature 0 get the same short answers).
    records.append({"t": "summarised", "memories": [int(m) for m in memories]})
    store._commit(records, progress=progress)
    built = len(records) - 1
    log.info("summaries: %d built over %d memories (%d segments eligible)", built, len(memories), len(jobs))
    return built
