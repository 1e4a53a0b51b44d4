"""What several methods share: the turn table of the selected memories, pack rows, diagnostics.

A method that does not read MemFit's store still reports where its context came from in the turns'
terms, so `packs.jsonl` rows and `diagnostics.json` keep one shape across methods: `pack.episodes` /
`pack.selected` name turns (row = position in the TurnTable, or the store row for a method that has
one), and the hit/pack rates of retrieve/diagnostics.py are computed from them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from memfit_gpu.data.schema import Memory, Question, Turn
from memfit_gpu.retrieve.batched import RetrievalResult
from memfit_gpu.retrieve.dates import recorded_date
from memfit_gpu.retrieve.diagnostics import compute_diagnostics
from memfit_gpu.retrieve.pack import Pack
from memfit_gpu.store import episode_text


@dataclass
class TurnTable:
    """Every turn of some memories in conversation order, as flat columns indexed by row (its position
    here). Has the columns of ReadView that excerpt formatting (retrieve.pack.excerpt_tail) and retrieval
    diagnostics read, without encoding anything."""

    memory_ids: list[str]
    ep_memory: np.ndarray  # int64 memory index per row
    ep_session: list[str]  # the benchmark's session id per row
    ep_text: list[str]  # SPEC episode text: "DATE: ... | Speaker X says: ..."
    ep_time: np.ndarray  # datetime64[s], NaT when unknown
    ep_turn_id: list[str]
    ep_deleted: np.ndarray  # bool, all False: a benchmark's turns are all live
    turns: list[Turn] = field(default_factory=list)
    _rows: list[list[int]] = field(default_factory=list)

    @classmethod
    def from_memories(cls, memories: Sequence[Memory]) -> TurnTable:
        ids, mem, sess, texts, times, tids, turns = [], [], [], [], [], [], []
        rows: list[list[int]] = []
        for m_idx, memory in enumerate(memories):
            ids.append(memory.memory_id)
            rows.append([])
            for session in memory.sessions:
                for turn in session.turns:
                    rows[-1].append(len(texts))
                    mem.append(m_idx)
                    sess.append(session.session_id)
                    texts.append(episode_text(turn))
                    stamp = turn.timestamp or session.timestamp
                    times.append(np.datetime64(stamp, "s") if stamp else np.datetime64("NaT", "s"))
                    tids.append(turn.turn_id)
                    turns.append(turn)
        return cls(ids, np.asarray(mem, dtype=np.int64), sess, texts, np.asarray(times, dtype="datetime64[s]"),
                   tids, np.zeros(len(texts), dtype=bool), turns, rows)

    def memory_index(self, memory_id: str) -> int:
        try:
            return self.memory_ids.index(memory_id)
        except ValueError:
            raise KeyError(f"no memory {memory_id!r} among the {len(self.memory_ids)} selected") from None

    def memory_rows(self, memory_idx: int) -> list[int]:
        """Rows of one memory in conversation order."""
        return self._rows[memory_idx]

    def recorded(self, row: int) -> str:
        """The turn's date as excerpts print it (ReadView.recorded)."""
        return recorded_date(self.ep_time[row])


def pack_json(rows: Sequence[int], selected: Sequence[int], turn_ids: Sequence[str]) -> dict[str, Any]:
    """The `pack` field of a packs.jsonl row: the turns whose text the excerpts hold (the answer stage
    sends their images with reader.images=retrieved), the ones chosen on their own merit among them."""
    chosen = set(selected)
    return {"episodes": [{"row": r, "turn_id": turn_ids[r], "selected": r in chosen} for r in rows],
            "selected": [{"row": r, "turn_id": turn_ids[r]} for r in selected], "summaries": []}


def diagnostics_for(table: Any, questions: Sequence[Question], ranked: Sequence[Sequence[int]],
                    selected: Sequence[Sequence[int]], packed: Sequence[Sequence[int]],
                    method: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any] | None]]:
    """diagnostics.json and per-question records (retrieve/diagnostics.py) of a method's turn choices.

    ranked: the turns in the method's rank order (hit@k); selected: the turns it chose (pack_hit);
    packed: every turn the excerpts hold (pack_hit_window). `table` is a TurnTable or a ReadView."""
    results = [RetrievalResult(q.memory_id, q.question, [{"kind": "episode", "row": r} for r in rank],
                               Pack(episodes=list(pack), selected=list(chosen)), "")
               for q, rank, chosen, pack in zip(questions, ranked, selected, packed, strict=True)]
    diagnostics, records = compute_diagnostics(results, questions, table, reranker={"backend": "none"})
    diagnostics["method"] = method
    return diagnostics, records


# LightMem's MTM windows: the unit its write path batches turns in and the growth analysis counts points in
# (run/growth.py), so that every growth method cuts a user's history at the same turn.
def mtm_windows(sessions: Sequence[int], window: int, final: bool) -> list[list[int]]:
    """Positions (0..n-1) of each MTM window over a user's turns, given each turn's session: runs of
    `window` turns within a session. The last window of the last session is open (not returned) while it
    is short and the history may still grow (`final` False)."""
    out: list[list[int]] = []
    current: list[int] = []
    for position, session in enumerate(sessions):
        if current and (session != sessions[current[0]] or len(current) == window):
            out.append(current)
            current = []
        current.append(position)
    if current and (final or len(current) == window):
        out.append(current)
    return out
