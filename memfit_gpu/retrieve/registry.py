"""Added read-path stages (the `retrieve.stages` key): one module and one registry call each.

An added stage runs after SPEC's rerank (read path 7) and before the pack (8-9), on both read paths with the
same code: it gets a batch's candidates as [Q, N] tensors (the reference path hands it a batch of one) and
returns their new scores; the candidates are then put in that order (ties keep candidate order), packed and
written to packs.jsonl's `ranked[].final`. With `retrieve.stages: []` (the default) nothing here runs.

    @dataclass
    class RecencySettings:
        weight: float = 0.1                                   # plugins.recency.weight

    def rescore(batch: StageBatch) -> torch.Tensor:          # [Q, N] float64
        ...
    register_stage("recency", StageEntry(rescore, settings=RecencySettings))

    MEMFIT_PLUGINS=my_lab.recency memfit run ... 'retrieve.stages=[recency]' plugins.recency.weight=0.2
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from memfit_gpu.config import ConfigError, MemFitConfig, register_section, section
from memfit_gpu.registries import Registry
from memfit_gpu.retrieve.view import ReadView


@dataclass(frozen=True)
class StageBatch:
    """What an added stage sees of a batch of questions. Pads may sit anywhere in a row (the batched path
    does not compact candidates without a reranker): a stage treats each question's valid candidates as a
    set, and what it returns for a pad is ignored."""

    view: ReadView  # the memories' episodes and summaries (ep_text, ep_time, sm_text, ...)
    cfg: MemFitConfig
    settings: Any  # the stage's own settings (plugins.<name>, an instance of its entry's dataclass); None without
    questions: list[str]
    memories: list[int]  # each question's memory, as an index into view.memory_ids
    kind: torch.Tensor  # [Q, N] int64: 0 an episode, 1 a summary (retrieve.pool EPISODE, SUMMARY)
    row: torch.Tensor  # [Q, N] int64: the candidate's row in the view's episode or summary table
    valid: torch.Tensor  # [Q, N] bool: a candidate, not a pad
    scores: torch.Tensor  # [Q, N] float64: the scores so far (the rerank's z-scores, else the first-stage score)


@dataclass(frozen=True)
class StageEntry:
    rescore: Callable[[StageBatch], torch.Tensor]  # a batch -> its candidates' new scores, [Q, N] float64
    settings: type | None = None  # a dataclass: `plugins.<stage name>.*` (config.register_section)


STAGES: Registry[StageEntry] = Registry(
    "retrieve.stages", {},
    lambda name, known: ConfigError(f"retrieve.stages: {name!r} is not a registered stage ({', '.join(known) or 'none'})"))


def register_stage(name: str, entry: StageEntry) -> None:
    """Add a read-path stage: `retrieve.stages=[name]` then runs it in both read paths."""
    if entry.settings is not None:
        register_section(name, entry.settings)
    STAGES.register(name, entry)


def run_stages(view: ReadView, cfg: MemFitConfig, questions: Sequence[str], memories: Sequence[int],
               kind: torch.Tensor, row: torch.Tensor, valid: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """The candidates' scores after every stage of `retrieve.stages`, in order; pads keep theirs."""
    for name in cfg.retrieve.stages:
        entry = STAGES.get(name)
        settings = section(cfg, name) if entry.settings is not None else None
        batch = StageBatch(view, cfg, settings, list(questions), list(memories), kind, row, valid, scores)
        new = entry.rescore(batch)
        if not isinstance(new, torch.Tensor) or new.shape != scores.shape:
            raise ValueError(f"retrieve.stages: stage {name!r} returned "
                             f"{tuple(new.shape) if isinstance(new, torch.Tensor) else type(new).__name__}, "
                             f"not a tensor of the candidates' shape {tuple(scores.shape)}")
        scores = torch.where(valid, new.to(torch.float64), scores)
    return scores
