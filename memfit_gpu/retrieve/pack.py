"""Pack assembly and excerpt text (SPEC read path 8-9).

Pack: the top k of the final ranking (summaries compete for slots). Selected episodes, each with
its +/- context_window live neighbouring turns of the same session, deduplicated, in time order
(memory, timestamp, turn position). Summaries, in rank order, come first in a "remembered facts"
block.

Excerpt text (what the reader sees):
    REMEMBERED FACTS:
    - {summary text} (as of {date})
    <blank line>
    EXCERPT 1 (recorded 8 May 2023): Speaker Caroline says: I went yesterday (7 May 2023).
One excerpt per episode of the pack, chronological. The episode text's leading
"DATE: {session date} | " is dropped because the header carries the date; relative dates are
resolved against the episode's own session date (dates.resolve_relative_dates).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch

from memfit_gpu.retrieve.dates import resolve_relative_dates

_DATE_PREFIX = re.compile(r"^DATE: [^|]*\| ")
FACTS_HEADER = "REMEMBERED FACTS:"


@dataclass
class Pack:
    episodes: list[int] = field(default_factory=list)  # episode rows in time order (with neighbours)
    selected: list[int] = field(default_factory=list)  # episode rows among the top k (before neighbours)
    summaries: list[int] = field(default_factory=list)  # summary rows among the top k, in rank order


def build_pack(top: list[tuple[int, int]], view: Any, context_window: int) -> Pack:
    """top: (kind, row) of the k best candidates in rank order (kind 0 episode, 1 summary)."""
    selected = [row for kind, row in top if kind == 0]
    summaries = [row for kind, row in top if kind == 1]
    rows: set[int] = set()
    for row in selected:
        if context_window > 0:
            rows.update(view.neighbours(row, context_window))
        else:
            rows.add(row)
    rank = view.time_rank_list
    return Pack(episodes=sorted(rows, key=rank.__getitem__), selected=selected, summaries=summaries)


_TRIGGERS = ("yesterday", "ago", "last", "this", "next")


def build_packs(top_kind: torch.Tensor, top_row: torch.Tensor, view: Any, context_window: int) -> list[Pack]:
    """`build_pack` for a whole batch: top_kind/top_row [Q, k] (kind -1 = pad), one tensor pass for the
    neighbours, the dedup and the time order."""
    n_q = top_kind.shape[0]
    episode = top_kind == 0
    sel = torch.where(episode, top_row, -1)
    if context_window > 0:
        table = view.neighbour_table(context_window)  # [n_rows, 2w+1], -1 where none
        around = table[sel.clamp(min=0)]  # [Q, k, 2w+1]
        around = torch.where(episode[:, :, None], around, -1).reshape(n_q, -1)
    else:
        around = sel
    rank = view.time_rank_tensor
    big = torch.iinfo(torch.long).max
    key = torch.where(around >= 0, rank[around.clamp(min=0)], big)
    key, order = key.sort(dim=1)
    rows = around.gather(1, order)
    keep = key != big
    keep[:, 1:] &= key[:, 1:] != key[:, :-1]  # time ranks are unique per row: equal key = same row
    rows_list, keep_list = rows.tolist(), keep.tolist()
    kinds, tops = top_kind.tolist(), top_row.tolist()
    packs = []
    for i in range(n_q):
        packs.append(Pack(
            episodes=[r for r, k in zip(rows_list[i], keep_list[i], strict=True) if k],
            selected=[r for kind, r in zip(kinds[i], tops[i], strict=True) if kind == 0],
            summaries=[r for kind, r in zip(kinds[i], tops[i], strict=True) if kind == 1],
        ))
    return packs


def excerpt_body(text: str, anchor: Any, resolve_dates: bool) -> str:
    body = _DATE_PREFIX.sub("", text, count=1)
    if not resolve_dates:
        return body
    low = body.lower()
    # every relative-date phrase contains one of these words: skip the regex pass when none occurs
    if not any(word in low for word in _TRIGGERS):
        return body
    return resolve_relative_dates(body, anchor)


def format_excerpts(pack: Pack, view: Any, summary_suffix: str, resolve_dates: bool,
                    body_cache: dict[int, str] | None = None) -> str:
    """The reader's evidence block for one pack. body_cache: per-row line tails (batched path)."""
    parts: list[str] = []
    if pack.summaries:
        facts = [FACTS_HEADER]
        for srow in pack.summaries:
            facts.append("- " + view.sm_text[srow] + summary_suffix.format(date=view.summary_date(srow)))
        parts.append("\n".join(facts))
    lines = []
    for i, row in enumerate(pack.episodes, start=1):
        # tail = "(recorded {date}): {body}", the part of the line that depends on the row alone
        tail = body_cache.get(row) if body_cache is not None else None
        if tail is None:
            body = excerpt_body(view.ep_text[row], view.ep_time[row].astype(object), resolve_dates)
            tail = f"(recorded {view.recorded(row)}): {body}"
            if body_cache is not None:
                body_cache[row] = tail
        lines.append(f"EXCERPT {i} {tail}")
    if lines:
        parts.append("\n".join(lines))
    return "\n\n".join(parts)
