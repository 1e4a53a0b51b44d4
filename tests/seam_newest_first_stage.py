"""A test-only read-path stage, `newest_first`, added from tests/ with one module and one registry call,
with its own settings (`plugins.newest_first.weight`), none of which edits memfit_gpu.

After the rerank it adds `weight` x the episode's recency among the question's valid episode candidates
(0 for the oldest, 1 for the newest; summaries and pads get 0), so a large weight orders the episodes
newest first. Loaded into a `memfit` process with MEMFIT_PLUGINS=seam_newest_first_stage (tests/ on
PYTHONPATH), or imported by a test.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from memfit_gpu.retrieve.pool import EPISODE
from memfit_gpu.retrieve.registry import StageBatch, StageEntry, register_stage


@dataclass
class NewestFirstSettings:
    weight: float = 1.0  # how much the newest episode gains over the oldest


def rescore(batch: StageBatch) -> torch.Tensor:
    episode = batch.valid & (batch.kind == EPISODE)
    times = torch.from_numpy(batch.view.ep_time.astype("int64")).to(torch.float64)  # seconds
    when = torch.where(episode, times[batch.row.clamp(min=0, max=len(times) - 1)], 0.0)
    lo = torch.where(episode, when, torch.inf).min(dim=1, keepdim=True).values
    hi = torch.where(episode, when, -torch.inf).max(dim=1, keepdim=True).values
    span = (hi - lo).clamp(min=1.0)
    recency = torch.where(episode, (when - lo) / span, 0.0)
    return batch.scores + batch.settings.weight * recency


register_stage("newest_first", StageEntry(rescore, settings=NewestFirstSettings))
