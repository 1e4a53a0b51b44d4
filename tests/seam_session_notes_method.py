"""A test-only method, `session_notes`, added from tests/ with one module and one registry call: its own
settings (`plugins.session_notes.*`), its own LLM role (`session_note`, a write-phase call) and its own
prompt folder (tests/seam_prompts/, hashed into provenance.json), none of which edits memfit_gpu.

Write: one reader call per session, role session_note, with the prompt seam_prompts/session_note.txt;
read: the memory's notes, then its last `plugins.session_notes.turns` turns, as excerpts. Loaded into a
`memfit` process with MEMFIT_PLUGINS=seam_session_notes_method (tests/ on PYTHONPATH).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memfit_gpu.config import MemFitConfig
from memfit_gpu.methods.base import MethodRun
from memfit_gpu.methods.common import TurnTable, diagnostics_for, pack_json
from memfit_gpu.methods.packs import pack_row
from memfit_gpu.methods.registry import MethodEntry, method_settings, register_method
from memfit_gpu.readers.clean import reply_text
from memfit_gpu.readers.types import Request

PROMPTS = Path(__file__).resolve().parent / "seam_prompts"


@dataclass
class SessionNotesSettings:
    turns: int = 2  # the memory's last turns packed after its notes
    note_tokens: int = 24  # tokens a note may take

    def __post_init__(self) -> None:
        if self.turns < 1:
            raise ValueError(f"turns={self.turns} must be at least 1")


def prompt_folder(cfg: MemFitConfig) -> Path:
    return PROMPTS


class SessionNotes:
    name = "session_notes"

    def __init__(self) -> None:
        self.table: TurnTable | None = None
        self.notes: dict[str, list[str]] = {}

    def write(self, run: MethodRun) -> None:
        assert run.reader is not None, "session_notes calls the reader while writing"
        settings = method_settings(run.cfg, self.name)
        template = (prompt_folder(run.cfg) / "session_note.txt").read_text()
        self.table = TurnTable.from_memories(run.memories)
        requests, owners = [], []
        for memory in run.memories:
            for session in memory.sessions:
                prompt = template.format(session_id=session.session_id, user=memory.memory_id,
                                         first_turn=session.turns[0].text,
                                         turns="\n".join(f"{t.speaker}: {t.text}" for t in session.turns))
                requests.append(Request([{"role": "user", "content": prompt}], role="session_note",
                                        key=f"{memory.memory_id}:{session.session_id}", owner=memory.memory_id,
                                        max_new_tokens=settings.note_tokens))
                owners.append(memory.memory_id)
        responses = run.reader().generate(requests)
        run.account("session_notes.ledger")
        for owner, response in zip(owners, responses, strict=True):
            self.notes.setdefault(owner, []).append(reply_text(response.text))

    def read(self, run: MethodRun) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        assert self.table is not None, "read before write"
        table, turns = self.table, method_settings(run.cfg, self.name).turns
        chosen = [table.memory_rows(table.memory_index(q.memory_id))[-turns:] for q in run.questions]
        diagnostics, records = diagnostics_for(table, run.questions, chosen, chosen, chosen,
                                               {"name": self.name, "turns": turns})
        rows = []
        for q, picked, record in zip(run.questions, chosen, records, strict=True):
            lines = [f"NOTE {i} {note}" for i, note in enumerate(self.notes.get(q.memory_id, []), start=1)]
            lines += [f"EXCERPT {i} {table.ep_text[r]}" for i, r in enumerate(picked, start=1)]
            rows.append(pack_row(q, self.name, {"pack": pack_json(picked, picked, table.ep_turn_id),
                                                "excerpts": "\n".join(lines), "retrieval": record}))
        return rows, diagnostics

    def close(self) -> None:
        pass


register_method("session_notes", MethodEntry(SessionNotes, reader_free=False, settings=SessionNotesSettings,
                                             roles={"session_note": "write"}, prompts=prompt_folder))
