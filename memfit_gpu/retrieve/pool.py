"""Candidate pool and additive expansions (SPEC read path 4-6), vectorised over questions.

Pool: episode hits and summary hits interleaved round-robin, episode first (e0 s0 e1 s1 ...; when
one list runs out the other continues), cut at `pool_size`.
Summary expansion: members of the top summaries not already pooled enter with weight x that
summary's (fused + boost) score; a member of several summaries keeps its best (ties: the higher
ranked summary). PRF expansion: new episodes (in neither the pool nor the summary expansion) enter
with weight x their PRF fused score, uncapped. Expansions are ordered by score desc, then row asc.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from memfit_gpu.retrieve.hybrid import _BIG, Hits

EPISODE, SUMMARY = 0, 1
SOURCE_POOL, SOURCE_SUMMARY_EXPANSION, SOURCE_PRF = 0, 1, 2
SOURCE_NAMES = {SOURCE_POOL: "pool", SOURCE_SUMMARY_EXPANSION: "summary_expansion", SOURCE_PRF: "prf"}


_COLUMNS = ("kind", "row", "score", "source", "origin", "ref")
_PAD = {"kind": -1, "row": -1, "score": float("-inf"), "source": -1, "origin": -1, "ref": -1}
STAGE_NAMES = ("bm25", "dense", "fused", "boost")


@dataclass
class Candidates:
    """Padded per-question candidate list [Q, N]; pads have kind -1, row -1, score -inf.

    The raw stage scores of the search that found a candidate (bm25, dense, fused, boost) are only
    read for output, so they stay where that search left them (`stages`: each search's four [Q, C]
    tensors, never copied) and each candidate keeps a flat reference into them: reordering moves six
    columns, not ten. `stage_table` builds the [S, 4] table when output needs it."""

    kind: torch.Tensor  # long: 0 episode, 1 summary
    row: torch.Tensor  # long: episode row or summary row
    score: torch.Tensor  # float64 first-stage score (fused + boost, or expansion score)
    source: torch.Tensor  # long: SOURCE_*
    origin: torch.Tensor  # long: summary row an expansion came from, else -1
    ref: torch.Tensor  # long: row of stage_table() with this candidate's stage scores, -1 = all zero
    stages: tuple[tuple[torch.Tensor, ...], ...]  # per search: (bm25, dense, fused, boost) [Q, C] float64

    def stage_table(self) -> torch.Tensor:
        """[S, 4] float64 (STAGE_NAMES order): the rows `ref` points at."""
        if not self.stages:
            return torch.zeros((0, 4), dtype=torch.float64)
        return torch.cat([torch.stack(part, -1).reshape(-1, 4) for part in self.stages])

    @property
    def valid(self) -> torch.Tensor:
        return self.kind >= 0

    def take(self, cols: torch.Tensor) -> Candidates:
        if cols.numel() == 0 or int(cols.min()) >= 0:  # a permutation or cut: nothing to pad
            return Candidates(**{n: getattr(self, n).gather(1, cols) for n in _COLUMNS}, stages=self.stages)
        safe, pad = cols.clamp(min=0), cols < 0
        out = {}
        for name in _COLUMNS:
            t = getattr(self, name)
            out[name] = torch.where(pad, torch.as_tensor(_PAD[name], dtype=t.dtype), t.gather(1, safe))
        return Candidates(**out, stages=self.stages)

    @classmethod
    def empty(cls, n_q: int) -> Candidates:
        e = torch.zeros((n_q, 0), dtype=torch.long)
        return cls(e, e, torch.zeros((n_q, 0), dtype=torch.float64), e, e, e, ())

    @classmethod
    def from_hits(cls, hits: Hits, kind: int, source: int, score: torch.Tensor | None = None,
                  origin: torch.Tensor | None = None) -> Candidates:
        valid = hits.valid
        n_q, width = hits.rows.shape
        return cls(
            kind=torch.where(valid, kind, -1), row=hits.rows,
            score=torch.where(valid, hits.score if score is None else score, -torch.inf),
            source=torch.where(valid, source, -1),
            origin=torch.full_like(hits.rows, -1) if origin is None else origin,
            ref=torch.where(valid, torch.arange(n_q * width).view(n_q, width), -1),
            stages=((hits.bm25, hits.dense, hits.fused, hits.boost),),
        )

    def compact(self, limit: int | None = None) -> Candidates:
        """Pads moved to the end, order of real entries kept, width cut to the longest list (and limit)."""
        valid = self.valid
        width = int(valid.sum(1).max()) if self.kind.numel() else 0
        if limit is not None:
            width = min(width, limit)
        if self.kind.shape[1] > 1 and bool((valid[:, 1:] & ~valid[:, :-1]).any()):  # a pad before an entry
            return self.take((~valid).long().argsort(dim=1, stable=True)[:, :width])
        return self.head(width)

    def head(self, k: int) -> Candidates:
        return self.take(torch.arange(min(k, self.kind.shape[1])).expand(self.kind.shape[0], -1))


def in_set(values: torch.Tensor, members: torch.Tensor) -> torch.Tensor:
    """values [Q, A] (-1 = pad) found among members [Q, B] (-1 = pad), per question."""
    if members.shape[1] == 0 or values.shape[1] == 0:
        return torch.zeros(values.shape, dtype=torch.bool)
    keys = torch.where(members >= 0, members, _BIG).sort(dim=1).values
    pos = torch.searchsorted(keys, values.contiguous()).clamp(max=keys.shape[1] - 1)
    return (keys.gather(1, pos) == values) & (values >= 0)


def round_robin(episodes: Hits, summaries: Hits | None, pool_size: int) -> Candidates:
    """Interleave ranked episode and summary hits, episode first, up to pool_size items."""
    ep = Candidates.from_hits(episodes, EPISODE, SOURCE_POOL)
    if summaries is None or summaries.rows.shape[1] == 0:
        return ep.compact(pool_size)
    sm = Candidates.from_hits(summaries, SUMMARY, SOURCE_POOL)
    n_e, n_s = episodes.counts()[:, None], summaries.counts()[:, None]
    i = torch.arange(episodes.rows.shape[1])[None, :]
    j = torch.arange(summaries.rows.shape[1])[None, :]
    key_e = torch.where(i < n_s, 2 * i, n_s + i)
    key_s = torch.where(j < n_e, 2 * j + 1, n_e + j)
    key = torch.cat([torch.where(episodes.valid, key_e, _BIG), torch.where(summaries.valid, key_s, _BIG)], 1)
    both = concat([ep, sm])
    order = key.argsort(dim=1, stable=True)[:, :pool_size]  # pads carry key _BIG: they sort last
    return both.take(order).compact()


def concat(parts: list[Candidates]) -> Candidates:
    """Side by side, pads where the parts had them (`.compact()` moves them to the end)."""
    columns = {n: torch.cat([getattr(p, n) for p in parts], 1) for n in _COLUMNS if n != "ref"}
    refs, offset = [], 0
    for part in parts:
        refs.append(torch.where(part.ref >= 0, part.ref + offset, -1) if offset else part.ref)
        offset += sum(tensors[0].numel() for tensors in part.stages)
    return Candidates(**columns, ref=torch.cat(refs, 1), stages=tuple(t for p in parts for t in p.stages))


def summary_expansion(pool: Candidates, summaries: Hits, members_padded: torch.Tensor, top: int,
                      weight: float) -> Candidates:
    """Members of the top `top` summaries that are not pooled episodes, best score per member."""
    n_q = pool.kind.shape[0]
    best = summaries.head(top)
    if best.rows.shape[1] == 0 or members_padded.numel() == 0:
        return Candidates.empty(n_q)
    members = members_padded[best.rows.clamp(min=0)]  # [Q, T, M]
    ok = best.valid[:, :, None] & (members >= 0)
    width = members.shape[1] * members.shape[2]
    rows = torch.where(ok, members, -1).reshape(n_q, width)
    score = torch.where(ok, (weight * best.score)[:, :, None].expand_as(members), -torch.inf).reshape(n_q, width)
    origin = torch.where(ok, best.rows[:, :, None].expand_as(members), -1).reshape(n_q, width)
    pooled_episodes = torch.where(pool.kind == EPISODE, pool.row, -1)
    keep = (rows >= 0) & ~in_set(rows, pooled_episodes)
    rows = torch.where(keep, rows, -1)
    # best per member: order by score desc (stable: higher summary first), then group by row
    by_score = torch.where(keep, score, -torch.inf).argsort(dim=1, descending=True, stable=True)
    rows, score, origin = rows.gather(1, by_score), score.gather(1, by_score), origin.gather(1, by_score)
    by_row = torch.where(rows >= 0, rows, _BIG).argsort(dim=1, stable=True)
    rows, score, origin = rows.gather(1, by_row), score.gather(1, by_row), origin.gather(1, by_row)
    first = torch.ones_like(rows, dtype=torch.bool)
    first[:, 1:] = rows[:, 1:] != rows[:, :-1]
    keep = first & (rows >= 0)
    cand = Candidates(
        kind=torch.where(keep, EPISODE, -1), row=torch.where(keep, rows, -1),
        score=torch.where(keep, score, -torch.inf),
        source=torch.where(keep, SOURCE_SUMMARY_EXPANSION, -1), origin=torch.where(keep, origin, -1),
        ref=torch.full_like(rows, -1), stages=(),
    )  # members have no stage scores of their own
    return order_by_score(cand)  # members are in row order here


def order_by_score(cand: Candidates) -> Candidates:
    """Score desc, row asc, for candidates whose real entries are in row order (pads: score -inf,
    anywhere): one stable sort by score keeps row order among equal scores; pads end up last, cut."""
    order = cand.score.argsort(dim=1, descending=True, stable=True)
    width = int(cand.valid.sum(1).max()) if cand.kind.numel() else 0
    return cand.take(order[:, :width])


def prf_expansion(prf_hits: Hits, pool: Candidates, expansion: Candidates, weight: float) -> Candidates:
    """PRF hits that are neither pooled episodes nor summary-expansion members, at weight x fused."""
    taken = torch.cat([torch.where(pool.kind == EPISODE, pool.row, -1), expansion.row], 1)
    keep = prf_hits.valid & ~in_set(prf_hits.rows, taken)
    rows = torch.where(keep, prf_hits.rows, -1)
    hits = Hits(rows, prf_hits.bm25, prf_hits.dense, prf_hits.fused, prf_hits.boost,
                torch.where(keep, prf_hits.score, -torch.inf))
    cand = Candidates.from_hits(hits, EPISODE, SOURCE_PRF, score=torch.where(keep, weight * prf_hits.fused, -torch.inf))
    return order_by_score(cand)  # pads (score -inf) sort last and are cut
