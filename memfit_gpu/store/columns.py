"""An EpisodeStore's metadata columns and how each kind of log record is applied to them.

`StoreColumns` holds everything the store knows per memory, session, episode row and summary row, apart
from the indexes: the memories' ids and speakers, the sessions, the row-indexed episode columns (compact:
texts and turn ids are `TextColumn`s, the rest numpy), the summary table and the memories summarised. It
is built from records only (`apply_all`: the write path's batches, the replay of a log on open, repair's
probe), needs no model, and holds no log or index: the store (store/episodes.py) passes it explicitly to
the write path (store/write_path.py) and the replay (store/replay.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from memfit_gpu.buffers import GrowableArray, TextColumn
from memfit_gpu.names import MAX_SPEAKERS
from memfit_gpu.store.summary_table import SummaryTable
from memfit_gpu.store.text import episode_prefix

_APPLY_ERRORS = (ValueError, KeyError, IndexError, TypeError)


class RecordRefused(ValueError):
    """A record the store cannot apply (a memory past MAX_SPEAKERS speakers, a row out of order, a memory
    it does not have): `position` is its index among the records being applied, `kind` its type."""

    def __init__(self, position: int, kind: str | None, reason: str) -> None:
        super().__init__(f"record {position + 1} ({kind}): {reason}")
        self.position, self.kind, self.reason = position, kind, reason

    def shifted(self, start: int) -> RecordRefused:
        return RecordRefused(start + self.position, self.kind, self.reason)


def timestamp(value: str | None) -> np.datetime64:
    """A record's ISO timestamp at second resolution; NaT when missing or unreadable."""
    if not value:
        return np.datetime64("NaT", "s")
    try:
        return np.datetime64(value, "s")
    except ValueError:
        return np.datetime64("NaT", "s")


class StoreColumns:
    """The metadata of every record applied so far (design.md "Identifiers": rows are global sequence
    numbers in append order across memories; a deleted row keeps its number).

    Errors name `where` the records came from (the store passes its log's path, or "EpisodeStore")."""

    def __init__(self) -> None:
        # memories
        self.memory_ids: list[str] = []
        self.memory_index: dict[str, int] = {}
        self.memory_speakers: list[list[str]] = []
        self.speaker_index: list[dict[str, int]] = []
        self.session_ids: list[str] = []  # global session index -> the benchmark's session id
        self.session_memory: list[int] = []  # global session index -> memory_idx
        self.session_index: list[dict[str, int]] = []
        self.rows_of_memory: list[GrowableArray] = []  # per memory: its rows in append order
        self.turn_index: dict[int, dict[str, list[int]]] = {}  # per memory, built on first use: turn id -> rows

        # episode columns (row-indexed)
        self.memory_idx = GrowableArray(np.int32)
        self.session_idx = GrowableArray(np.int32)
        self.position = GrowableArray(np.int32)
        self.speaker_id = GrowableArray(np.int16)
        self.timestamp = GrowableArray("datetime64[s]", np.datetime64("NaT", "s"))
        self.deleted = GrowableArray(np.bool_, False)
        self.prefix_len = GrowableArray(np.int32)
        self.text = TextColumn()
        self.turn_id = TextColumn()
        self.image_ids: dict[int, tuple[str, ...]] = {}  # only rows with images
        # only rows with images, logged with their parts: (image id or None, caption characters) in body order
        self.image_parts: dict[int, tuple[tuple[str | None, int], ...]] = {}

        self.summaries = SummaryTable()
        self.summarised: set[int] = set()  # memories build_summaries has processed (never re-summarised)

    @property
    def size(self) -> int:
        """Episode rows ever applied (deleted rows keep their number)."""
        return self.memory_idx.size

    def turn_rows(self, memory: int) -> dict[str, list[int]]:
        """Turn id -> rows (deleted ones included) of one memory, built on first use and kept up to date."""
        index = self.turn_index.get(memory)
        if index is None:
            index = self.turn_index[memory] = {}
            for row in self.rows_of_memory[memory].view.tolist():
                index.setdefault(self.turn_id[row], []).append(row)
        return index

    # ------------------------------------------------------------------ record handlers
    def _apply_memory(self, record: dict[str, Any], where: str) -> None:
        memory = int(record["memory"])
        if memory != len(self.memory_ids):
            raise ValueError(f"{where}: memory record {memory} out of order (expected {len(self.memory_ids)})")
        self.memory_ids.append(record["id"])
        self.memory_index[record["id"]] = memory
        self.memory_speakers.append([])
        self.speaker_index.append({})
        self.session_index.append({})
        self.rows_of_memory.append(GrowableArray(np.int64))
        for name in record.get("speakers", []):
            self._apply_speaker({"memory": memory, "name": name}, where)

    def _apply_speaker(self, record: dict[str, Any], where: str) -> None:
        memory, name = int(record["memory"]), record["name"]
        if name in self.speaker_index[memory]:
            return
        speaker = len(self.memory_speakers[memory])
        if speaker >= MAX_SPEAKERS:
            raise ValueError(f"EpisodeStore: memory {self.memory_ids[memory]!r} has more than {MAX_SPEAKERS} speakers")
        self.memory_speakers[memory].append(name)
        self.speaker_index[memory][name] = speaker

    def _apply_episode(self, record: dict[str, Any], where: str) -> None:
        self._apply_episodes([record], where)

    def _apply_episodes(self, records: Sequence[dict[str, Any]], where: str) -> None:
        """Episode records (rows in order) to the columns: checked one by one, appended column by column."""
        first = self.size
        memories, sessions_of, positions, speakers, times, texts, prefixes, turns = [], [], [], [], [], [], [], []
        new_rows: dict[int, list[int]] = {}
        for offset, record in enumerate(records):
            try:
                row, memory = int(record["row"]), int(record["memory"])
                if row != first + offset:
                    raise ValueError(f"episode record row {row} out of order (expected {first + offset})")
                if not 0 <= memory < len(self.memory_ids):
                    raise ValueError(f"episode row {row} names memory {memory}; the store has {len(self.memory_ids)}")
                self._apply_speaker({"memory": memory, "name": record["speaker"]}, where)
            except _APPLY_ERRORS as exc:
                raise RecordRefused(offset, "episode", f"{where}: {exc}") from None
            sessions = self.session_index[memory]
            session = sessions.get(record["session"])
            if session is None:
                session = sessions[record["session"]] = len(self.session_ids)
                self.session_ids.append(record["session"])
                self.session_memory.append(memory)
            text = record["text"]
            prefix = episode_prefix(record["date"], record["speaker"])
            if not text.startswith(prefix):
                raise RecordRefused(offset, "episode", f"{where}: episode row {row} text does not start "
                                                       f"with {prefix!r}")
            pending = new_rows.setdefault(memory, [])
            memories.append(memory)
            sessions_of.append(session)
            positions.append(self.rows_of_memory[memory].size + len(pending))
            speakers.append(self.speaker_index[memory][record["speaker"]])
            times.append(timestamp(record.get("ts")))
            texts.append(text)
            prefixes.append(len(prefix))
            turns.append(record["turn"])
            images = record.get("images")
            if images:
                self.image_ids[row] = tuple(images)
            parts = record.get("image_parts")
            if parts:
                self.image_parts[row] = tuple((part[0], int(part[1])) for part in parts)
            pending.append(row)
        self.memory_idx.extend(memories)
        self.session_idx.extend(sessions_of)
        self.position.extend(positions)
        self.speaker_id.extend(speakers)
        self.timestamp.extend(np.asarray(times, dtype="datetime64[s]"))
        self.deleted.extend(np.zeros(len(records), dtype=np.bool_))
        self.prefix_len.extend(prefixes)
        self.text.extend(texts)
        self.turn_id.extend(turns)
        for memory, rows in new_rows.items():
            self.rows_of_memory[memory].extend(rows)
            index = self.turn_index.get(memory)
            if index is not None:  # kept up to date: rebuilding it is a pass over the memory's rows per add
                for row in rows:
                    index.setdefault(self.turn_id[row], []).append(row)

    def _apply_delete(self, record: dict[str, Any], where: str) -> None:
        self.deleted.view[int(record["row"])] = True

    def _apply_summary(self, record: dict[str, Any], where: str) -> None:
        table = self.summaries
        row = int(record["row"])
        if row != len(table):
            raise ValueError(f"{where}: summary record row {row} out of order (expected {len(table)})")
        table.text.append(record["text"])
        table.memory_idx.extend([int(record["memory"])])
        table.members.append(np.asarray(record["members"], dtype=np.int64))
        table.event_time.extend([timestamp(record.get("event"))])
        table.recorded_time.extend([timestamp(record.get("recorded"))])
        table.deleted.extend([False])
        replaces = record.get("replaces")
        table.replaces.extend([-1 if replaces is None else int(replaces)])

    def _apply_summary_delete(self, record: dict[str, Any], where: str) -> None:
        self.summaries.deleted.view[int(record["row"])] = True

    def _apply_summarised(self, record: dict[str, Any], where: str) -> None:
        self.summarised.update(int(m) for m in record["memories"])

    _HANDLERS: dict[str, Callable[[StoreColumns, dict[str, Any], str], None]] = {
        "memory": _apply_memory,
        "speaker": _apply_speaker,
        "episode": _apply_episode,
        "delete": _apply_delete,
        "summary": _apply_summary,
        "summary_delete": _apply_summary_delete,
        "summarised": _apply_summarised,
    }

    def _apply(self, record: dict[str, Any], where: str) -> None:
        kind = record.get("t")
        if kind in ("header", "commit"):
            return
        handler = self._HANDLERS.get(kind)
        if handler is None:
            raise ValueError(f"{where}: unknown record type {kind!r}")
        handler(self, record, where)

    def apply_all(self, records: Iterable[dict[str, Any]], where: str) -> int:
        """Apply records in order, runs of episode records column by column; returns how many there were.
        A record that cannot be applied is a RecordRefused naming its position among `records`."""
        run: list[dict[str, Any]] = []
        count = 0

        def flush() -> None:
            try:
                self._apply_episodes(run, where)
            except RecordRefused as exc:
                raise exc.shifted(count - len(run)) from None

        for record in records:
            if record.get("t") == "episode":
                run.append(record)
                count += 1
                if len(run) >= 1 << 14:
                    flush()
                    run = []
                continue
            if run:
                flush()
                run = []
            try:
                self._apply(record, where)
            except RecordRefused as exc:
                raise exc.shifted(count) from None
            except _APPLY_ERRORS as exc:
                raise RecordRefused(count, record.get("t"), f"{where}: {exc}") from None
            count += 1
        if run:
            flush()
        return count

    def check(self, records: Sequence[dict[str, Any]]) -> None:
        """Refuse, before anything is logged or applied, a batch that applying would refuse part way
        (RecordRefused): a memory record out of order, a record naming a memory the store lacks, a memory
        past MAX_SPEAKERS speakers, an episode or summary row out of order. So the log never holds a
        record its own replay would refuse."""
        memories, ids = len(self.memory_ids), {}
        names: dict[int, set[str]] = {}
        row, summary_row = self.size, len(self.summaries)
        for position, record in enumerate(records):
            kind = record.get("t")
            if kind == "summary":
                if int(record["row"]) != summary_row:
                    raise RecordRefused(position, kind, f"summary row {record['row']} out of order (expected {summary_row})")
                summary_row += 1
                continue
            if kind not in ("memory", "speaker", "episode"):
                continue
            memory = int(record["memory"])
            if kind == "memory":
                if memory != memories:
                    raise RecordRefused(position, kind, f"memory record {memory} out of order (expected {memories})")
                memories += 1
                ids[memory], names[memory] = record["id"], set()
                spoken = list(record.get("speakers", []))
            elif not 0 <= memory < memories:
                raise RecordRefused(position, kind, f"names memory {memory}; the store has {memories}")
            else:
                spoken = [record["name"] if kind == "speaker" else record["speaker"]]
            known = names.get(memory)
            if known is None:
                known = names[memory] = set(self.memory_speakers[memory])
            known.update(spoken)
            if len(known) > MAX_SPEAKERS:
                name = ids.get(memory, self.memory_ids[memory] if memory < len(self.memory_ids) else memory)
                raise RecordRefused(position, kind, f"memory {name!r} would have {len(known)} speakers; a memory "
                                                    f"holds at most {MAX_SPEAKERS}")
            if kind == "episode":
                if int(record["row"]) != row:
                    raise RecordRefused(position, kind, f"episode row {record['row']} out of order (expected {row})")
                row += 1
