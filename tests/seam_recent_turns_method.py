"""A test-only method, `recent_turns`, added from tests/ with one module and one registry call.

Its pack is the last `pack.k` turns of the question's memory, oldest first, printed as MemFit prints a
turn; nothing is written, no LLM is called. Loaded into a `memfit` process with
MEMFIT_PLUGINS=seam_recent_turns_method (tests/ on PYTHONPATH).
"""

from __future__ import annotations

from typing import Any

from memfit_gpu.methods.base import MethodRun
from memfit_gpu.methods.common import TurnTable, diagnostics_for, pack_json
from memfit_gpu.methods.packs import pack_row
from memfit_gpu.methods.registry import MethodEntry, register_method
from memfit_gpu.retrieve.pack import excerpt_tail


class RecentTurns:
    name = "recent_turns"

    def __init__(self) -> None:
        self.table: TurnTable | None = None

    def write(self, run: MethodRun) -> None:
        self.table = TurnTable.from_memories(run.memories)

    def read(self, run: MethodRun) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        assert self.table is not None, "read before write"
        table, cfg = self.table, run.cfg
        chosen = [table.memory_rows(table.memory_index(q.memory_id))[-cfg.pack.k:] for q in run.questions]
        diagnostics, records = diagnostics_for(table, run.questions, chosen, chosen, chosen,
                                               {"name": self.name, "turns": cfg.pack.k})
        rows = []
        for q, picked, record in zip(run.questions, chosen, records, strict=True):
            excerpts = "\n".join(f"EXCERPT {i} {excerpt_tail(table, r, cfg.pack.resolve_dates, cfg.pack.max_excerpt_chars)[0]}"
                                 for i, r in enumerate(picked, start=1))
            rows.append(pack_row(q, self.name, {"pack": pack_json(picked, picked, table.ep_turn_id),
                                                "excerpts": excerpts, "retrieval": record}))
        return rows, diagnostics

    def close(self) -> None:
        pass


register_method("recent_turns", MethodEntry(RecentTurns))
