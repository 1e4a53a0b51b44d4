"""Metadata boosts after fusion (SPEC read path 2), vectorised over [Q, C] candidates.

Per question the constraints come from `dates.parse_constraints` (speaker names, years, months).
An episode gets +speaker when it matches any named speaker (`boosts.speaker_match`: `speaker` = it is
that speaker's turn, the default; `mention` = also when its text names them as a whole word), +month
when its timestamp's month is named, +year when its year is named; the three add up. A summary
matches the speakers of its member turns (under `mention`: the names its text mentions) and
year/month by its event time. The boost sum is
formed as ((0 + speaker) + month) + year in float64, the order the reference path uses.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from memfit_gpu.config import BoostConfig, MemFitConfig
from memfit_gpu.retrieve.dates import QueryConstraints
from memfit_gpu.retrieve.hybrid import Hits


def constraint_tensors(constraints: Sequence[QueryConstraints], speakers_lower: Sequence[list[str]],
                       memory_idx: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(speaker bit mask [Q], years [Q, Y] -1 padded, months [Q, M] -1 padded)."""
    width_y = max((len(c.years) for c in constraints), default=0) or 1
    width_m = max((len(c.months) for c in constraints), default=0) or 1
    bits, years, months = [], [], []
    for c, m in zip(constraints, memory_idx, strict=False):
        names = speakers_lower[m]
        b = 0
        for name in c.speakers:
            if name in names:
                b |= 1 << names.index(name)
        bits.append(b)
        years.append(sorted(c.years) + [-1] * (width_y - len(c.years)))
        months.append(sorted(c.months) + [-1] * (width_m - len(c.months)))
    n_q = len(bits)
    return (torch.tensor(bits, dtype=torch.long),
            torch.tensor(years, dtype=torch.long).reshape(n_q, width_y),
            torch.tensor(months, dtype=torch.long).reshape(n_q, width_m))


def add_boosts(hits: Hits, cfg: BoostConfig, speaker_bits: torch.Tensor, years: torch.Tensor,
               months: torch.Tensor, row_speaker_mask: np.ndarray, row_year: np.ndarray,
               row_month: np.ndarray) -> Hits:
    """Boosted copy of `hits`, in the same (row) order."""
    valid = hits.valid
    safe = hits.rows.clamp(min=0).numpy()
    spk = torch.from_numpy(row_speaker_mask[safe]) if row_speaker_mask.size else torch.zeros_like(hits.rows)
    yr = torch.from_numpy(row_year[safe]) if row_year.size else torch.full_like(hits.rows, -2)
    mo = torch.from_numpy(row_month[safe]) if row_month.size else torch.full_like(hits.rows, -2)
    speaker_hit = (spk & speaker_bits[:, None]) != 0
    year_hit = (yr[:, :, None] == years[:, None, :]).any(-1)
    month_hit = (mo[:, :, None] == months[:, None, :]).any(-1)
    # hit (0.0 or 1.0) x value is exact, so each term is the config's float64 value or 0.0
    boost = torch.zeros_like(hits.fused) + speaker_hit.double() * cfg.speaker
    boost = boost + month_hit.double() * cfg.month
    boost = boost + year_hit.double() * cfg.year
    boost = torch.where(valid, boost, 0.0)
    score = torch.where(valid, hits.fused + boost, -torch.inf)
    return Hits(hits.rows, hits.bm25, hits.dense, hits.fused, boost, score)


def boosted(cfg: MemFitConfig, kind: str) -> bool:
    """Whether hits of `kind` (ep | sm) get the boosts, in both read paths: episodes with
    retrieve.boosts_enabled, summaries also only with retrieve.boosts.summaries (SPEC read path 3 searches them
    with step 1's hybrid alone)."""
    rcfg = cfg.retrieve
    return rcfg.boosts_enabled and (kind == "ep" or rcfg.boosts.summaries)
