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

Stored text cannot forge the block's structure: every line of a turn (or summary) after its first that
holds more than whitespace starts with QUOTE_INDENT, so `EXCERPT n`, `Question:`, `Answer:` or
instruction lines at the start of a line only ever come from the template. A single-line turn (every
LoCoMo turn but six) is shown exactly as before. An excerpt longer than max_excerpt_chars is cut, with
a note saying how much, and the characters cut are counted for the pack row.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import date
from typing import Any

import numpy as np
import torch

from memfit_gpu.quoting import QUOTE_INDENT, quote_lines  # noqa: F401  (the methods import both from here)
from memfit_gpu.retrieve.dates import resolve_relative_dates
from memfit_gpu.retrieve.view import ReadView

FACTS_HEADER = "REMEMBERED FACTS:"


@dataclass
class Pack:
    episodes: list[int] = field(default_factory=list)  # episode rows in time order (with neighbours)
    selected: list[int] = field(default_factory=list)  # episode rows among the top k (before neighbours)
    summaries: list[int] = field(default_factory=list)  # summary rows among the top k, in rank order


def build_pack(top: list[tuple[int, int]], view: ReadView, context_window: int) -> Pack:
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


def build_packs(top_kind: torch.Tensor, top_row: torch.Tensor, view: ReadView, context_window: int) -> list[Pack]:
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
    # boolean indexing walks row-major, so each question's kept rows stay together and in order
    episodes = split_by_counts(rows[keep].tolist(), keep.sum(1).tolist())
    is_summary = top_kind == 1
    selected = split_by_counts(top_row[episode].tolist(), episode.sum(1).tolist())
    summaries = split_by_counts(top_row[is_summary].tolist(), is_summary.sum(1).tolist())
    return [Pack(episodes=e, selected=s, summaries=m) for e, s, m in zip(episodes, selected, summaries, strict=True)]


def split_by_counts(flat: list[Any], counts: list[int]) -> list[list[Any]]:
    """flat cut into consecutive pieces of the given lengths."""
    out, start = [], 0
    for n in counts:
        out.append(flat[start:start + n])
        start += n
    return out


def strip_date_prefix(text: str) -> str:
    """The text without a leading "DATE: {anything but |}| " (the header carries the date)."""
    if text.startswith("DATE: "):
        bar = text.find("|", 6)
        if bar >= 0 and text.startswith(" ", bar + 1):
            return text[bar + 2:]
    return text


def may_hold_relative_date(low: str) -> bool:
    """False only when lowercased text cannot hold a relative-date phrase (dates._RELATIVE_RE): each
    phrase has "yesterday", "ago", or last/this/next before week, a weekday (all end in "day"), month
    or year. Lets most episodes skip the regex. Non-ASCII text always goes to the regex: its
    case-insensitive matching folds a few letters (the long s) that lower() keeps."""
    if "yesterday" in low or "ago" in low or not low.isascii():
        return True
    return ("last" in low or "this" in low or "next" in low) and (
        "week" in low or "day" in low or "month" in low or "year" in low)


def excerpt_body(text: str, anchor: date | np.datetime64 | None, resolve_dates: bool) -> str:
    """anchor: the session date (date, datetime or numpy datetime64; None or NaT leaves dates as written)."""
    body = strip_date_prefix(text)
    if not resolve_dates or not may_hold_relative_date(body.lower()):
        return body
    if hasattr(anchor, "astype"):
        anchor = anchor.astype(object)  # numpy datetime64 -> datetime (None when NaT)
    if anchor is None:
        return body
    return resolve_relative_dates(body, anchor)


def cut_excerpt(body: str, max_chars: int) -> tuple[str, int]:
    """(body, 0), or its first max_chars characters with a note of how many were cut, and that count."""
    if len(body) <= max_chars:
        return body, 0
    cut = len(body) - max_chars
    return f"{body[:max_chars]} [... {cut:,} more characters cut: pack.max_excerpt_chars={max_chars:,}]", cut


def excerpt_tail(view: ReadView, row: int, resolve_dates: bool, max_excerpt_chars: int) -> tuple[str, int]:
    """The part of an excerpt line that depends on the row alone, "(recorded {date}): {body}", and the
    characters cut from the body."""
    body = quote_lines(excerpt_body(view.ep_text[row], view.ep_time[row], resolve_dates))
    body, cut = cut_excerpt(body, max_excerpt_chars)
    return f"(recorded {view.recorded(row)}): {body}", cut


def _facts_block(pack: Pack, view: ReadView, summary_suffix: str) -> str:
    return "\n".join([FACTS_HEADER] + ["- " + quote_lines(view.sm_text[srow])
                                       + summary_suffix.format(date=view.summary_date(srow))
                                       for srow in pack.summaries])


def format_excerpts(pack: Pack, view: ReadView, summary_suffix: str, resolve_dates: bool,
                    max_excerpt_chars: int) -> tuple[str, int]:
    """The reader's evidence block for one pack, and the characters cut from its excerpts."""
    parts: list[str] = []
    if pack.summaries:
        parts.append(_facts_block(pack, view, summary_suffix))
    tails = [excerpt_tail(view, row, resolve_dates, max_excerpt_chars) for row in pack.episodes]
    lines = [f"EXCERPT {i} {tail}" for i, (tail, _) in enumerate(tails, start=1)]
    if lines:
        parts.append("\n".join(lines))
    return "\n\n".join(parts), sum(cut for _, cut in tails)


def format_excerpts_batch(packs: list[Pack], view: ReadView, summary_suffix: str, resolve_dates: bool,
                          tails: dict[int, tuple[str, int]], max_excerpt_chars: int) -> list[tuple[str, int]]:
    """`format_excerpts` for every pack; each distinct row's tail is built once (`tails` keeps them, so
    it must only ever see one resolve_dates and max_excerpt_chars)."""
    for row in {row for pack in packs for row in pack.episodes}.difference(tails):
        tails[row] = excerpt_tail(view, row, resolve_dates, max_excerpt_chars)
    longest = max((len(pack.episodes) for pack in packs), default=0)
    heads = [f"EXCERPT {i} " for i in range(1, longest + 1)]
    out = []
    for pack in packs:
        built = [tails[row] for row in pack.episodes]
        lines = "\n".join(map(str.__add__, heads, (tail for tail, _ in built)))
        cut = sum(c for _, c in built)
        if pack.summaries:
            facts = _facts_block(pack, view, summary_suffix)
            out.append((facts + "\n\n" + lines if lines else facts, cut))
        else:
            out.append((lines, cut))
    return out
