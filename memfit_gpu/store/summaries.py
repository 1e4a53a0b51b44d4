"""Summary layer (SPEC write path 3-4): one note per segment, built for every memory in one batch.

A summary prompt shows up to `max_excerpts` evenly spaced member turns. Each excerpt is the turn
without its `DATE: ... | Speaker X says: ` prefix (SPEC write path 4), its whitespace runs made one space
so that it stays one bullet, cut to `excerpt_chars` characters, as a `- ` bullet. `excerpt_speaker`
keeps the speaker as `X: text` (what this package did before it followed SPEC here). The instruction is
`memfit_gpu/prompts/<summary.prompt>` with `{excerpts}` in it.

`generate(prompts) -> texts` is any callable (a reader's summary role, or a plain function): the
store does not care which LLM runs. Outputs shorter than `min_chars` (after stripping) are dropped.
A summary's provenance is its member episode rows; event time = the first member's timestamp,
recorded time = the last member's.

Everything here is planning: which segments get a summary (`plan_segments`), the prompt of one
(`summary_prompt`) and the records of a batch (`summary_records`). It reads nothing of the store: the
store hands over each segment as a `SummaryJob` (`EpisodeStore.summary_job`) and commits the records
it gets back (`EpisodeStore.build_summaries`, `delete_episodes`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from memfit_gpu.config import SegmentConfig, SummaryConfig
from memfit_gpu.readers.prompts import PromptError, load_prompt
from memfit_gpu.readers.types import OwnedText
from memfit_gpu.store.segment import segment_batch, summary_segments

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SummaryJob:
    """One segment to summarise, as the store hands it over (member turns in time order)."""

    memory_idx: int
    members: np.ndarray  # episode rows (the summary's provenance)
    speakers: list[str]  # per member: the speaker's name
    bodies: list[str]  # per member: the episode text without its `DATE: ... says: ` prefix
    event: np.datetime64  # the first member's timestamp
    recorded: np.datetime64  # the last member's timestamp
    replaces: int | None = None  # the retired summary row this one rebuilds
    memory_id: str | None = None  # whose turns they are: each prompt names it (readers.types.OwnedText)


def excerpt_positions(count: int, limit: int) -> np.ndarray:
    """Up to `limit` evenly spaced indices into `count` members, first and last included."""
    if count <= limit:
        return np.arange(count)
    return np.unique(np.round(np.linspace(0, count - 1, limit)).astype(np.int64))


def summary_prompt(job: SummaryJob, cfg: SummaryConfig) -> str:
    """The prompt of one segment: `max_excerpts` evenly spaced `- body` bullets (`- speaker: body` with
    `cfg.excerpt_speaker`) in `cfg.prompt`."""
    lines = []
    for i in excerpt_positions(len(job.members), cfg.max_excerpts):
        excerpt = f"{job.speakers[i]}: {job.bodies[i]}" if cfg.excerpt_speaker else job.bodies[i]
        lines.append("- " + " ".join(excerpt.split())[: cfg.excerpt_chars])
    template = load_prompt(cfg.prompt)
    if "{excerpts}" not in template:
        raise PromptError(f"summary.prompt={cfg.prompt!r}: a summary prompt must contain the {{excerpts}} placeholder")
    return template.replace("{excerpts}", "\n".join(lines))


def _iso(value: np.datetime64) -> str | None:
    return None if np.isnat(value) else str(value)


def summary_records(
    jobs: Sequence[SummaryJob], generate: Callable[[list[str]], list[str]], cfg: SummaryConfig, first_row: int
) -> list[dict[str, Any]]:
    """Summary records (rows from `first_row` on) for the jobs of at least `cfg.min_segment` members:
    ONE generate call for all of them; outputs shorter than `cfg.min_chars` are dropped."""
    keep = [job for job in jobs if len(job.members) >= cfg.min_segment]
    if not keep:
        return []
    prompts = [OwnedText(summary_prompt(job, cfg), job.memory_id) for job in keep]
    outputs = generate(prompts)
    if len(outputs) != len(prompts):
        raise ValueError(f"summary generate returned {len(outputs)} texts for {len(prompts)} prompts")
    records: list[dict[str, Any]] = []
    dropped = 0
    for job, output in zip(keep, outputs, strict=True):
        text = (output or "").strip()
        if len(text) < cfg.min_chars:
            dropped += 1
            continue
        records.append({
            "t": "summary",
            "row": first_row + len(records),
            "memory": int(job.memory_idx),
            "text": text,
            "members": np.asarray(job.members, dtype=np.int64).tolist(),
            "event": _iso(job.event),
            "recorded": _iso(job.recorded),
            "replaces": job.replaces,
        })
    if dropped:
        log.info("summaries: dropped %d of %d outputs shorter than %d characters", dropped, len(prompts), cfg.min_chars)
    return records


def plan_segments(rows: Sequence[np.ndarray], embeddings: Sequence[np.ndarray], segment_cfg: SegmentConfig,
                  summary_cfg: SummaryConfig) -> list[list[np.ndarray]]:
    """Per memory, the member rows of each segment that gets a summary, in conversation order.

    Args:
        rows: each memory's live episode rows in conversation order.
        embeddings: their stored vectors [n, d], memory by memory.
    Returns:
        TextTiling segments (batched over memories) kept by `segment.summary_segments`.
    """
    planned = []
    for memory_rows, segments in zip(rows, segment_batch(list(embeddings), segment_cfg), strict=True):
        planned.append([memory_rows[start:end] for start, end in summary_segments(list(segments), summary_cfg)])
    return planned
