"""EpisodeStore: every memory's episodes (and summaries) in one store, with the indexes it owns (the chunked
write path is store/write_path.py, opening and log replay store/replay.py; EpisodeStore inherits both).

Rows are global sequence numbers in append order across memories (design.md "Identifiers"); a
deleted row keeps its number. The read path gets numpy columns indexed by row, the memories'
speakers, and the four indexes (episode and summary, BM25 and dense).

Persistence (a path is set): `log.jsonl` is an append-only record log (store/log.py) of memories,
speakers, episodes, deletions and summaries. Every write batch ends with a `commit` record (log
format 2): a batch cut short by a killed writer is dropped whole on open, so a memory is never half
stored. `snapshots/<records>/` holds index state written after each batch (BM25 state dicts, dense
vectors as .npy) with the log fingerprint it covers and the sha256 of every file (in meta.json,
written last). Opening loads the newest snapshot that matches the log and its checksums (a corrupted
one is reported at ERROR and never used), rebuilds the metadata columns from every record (cheap, no
model), and replays into the indexes only the records after the snapshot, encoding just those texts,
then snapshots again so the next open encodes nothing. A store written in batches (add_memories,
build_summaries, delete_episode snapshot after themselves) therefore reopens with bit-identical
indexes; turns appended one at a time with `append_turn` are logged only and re-encoded by the next
open (batch composition can move scores in the last float bits), unless `snapshot()` or `close()`
came first.

Nothing stored is rewritten, re-encoded or re-summarised, except what a user deletion demands, and
`compact()`, which rewrites the store without its deleted turns (see there).

Bounded memory (LongMemEval-M: 2.75M turns on a 24 GiB machine): `add_memories` takes any iterable of
memories and works in chunks of about `store.write_budget_mb` (records, texts, token ids, vectors):
each chunk is encoded (or its precomputed embeddings taken), logged, applied to the metadata and
indexed before the next is built, and the batch's one commit record and snapshot come after the last.
Chunking changes nothing stored: the log, the BM25 state (term ids included) and the vectors are the
same bytes as a one-chunk build. The columns are compact: texts and turn ids are `TextColumn`s (UTF-8
bytes and offsets), the rest numpy; the record log keeps offsets only and is streamed on open.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from memfit_gpu import faults
from memfit_gpu.buffers import GrowableArray, TextColumn
from memfit_gpu.config import MemFitConfig
from memfit_gpu.data.schema import Image, Memory, Session, Turn
from memfit_gpu.index.bm25 import BM25Index
from memfit_gpu.index.dense import DenseIndex
from memfit_gpu.index.encoders import TextEncoder, load_bi_encoder
from memfit_gpu.index.factory import dense_gpu_id, dense_index, lexical_index
from memfit_gpu.index.protocols import LexicalIndex
from memfit_gpu.index.tokenize import tokenize_many
from memfit_gpu.names import MAX_SPEAKERS
from memfit_gpu.store import compaction
from memfit_gpu.store.log import RecordLog
from memfit_gpu.store.replay import LogReplay, RecordRefused
from memfit_gpu.store.segment import segment_batch, summary_segments
from memfit_gpu.store.snapshot import write_snapshot
from memfit_gpu.store.summaries import SummaryJob, plan_segments, summary_records
from memfit_gpu.store.summary_table import SummaryTable
from memfit_gpu.store.text import episode_prefix, split_body
from memfit_gpu.store.write_path import GENERATIONS, WritePath

log = logging.getLogger(__name__)



def _timestamp(value: str | None) -> np.datetime64:
    if not value:
        return np.datetime64("NaT", "s")
    try:
        return np.datetime64(value, "s")
    except ValueError:
        return np.datetime64("NaT", "s")


_APPLY_ERRORS = (ValueError, KeyError, IndexError, TypeError)


class EpisodeStore(WritePath, LogReplay):
    """Episodes of many memories, their metadata columns, and the BM25 + dense indexes over them. The
    chunked write path is store/write_path.py's WritePath, opening and log replay store/replay.py's LogReplay."""

    def __init__(self, path: str | Path | None, cfg: MemFitConfig | None = None, encoder: TextEncoder | None = None):
        self.cfg = cfg or MemFitConfig()
        if encoder is None:
            encoder = load_bi_encoder(self.cfg.index)
        self.encoder = encoder
        self.dim = int(encoder.dim)
        path = path if path is not None else self.cfg.store.path
        self.path = Path(path) if path is not None else None
        self.last_timings: dict[str, float] = {}
        self.erased: list[str] = []  # after compact(): the memories it removed (nothing was left of them)
        self.generation = next(GENERATIONS)  # a new number after every write batch (write_path.GENERATIONS)

        # memories
        self.memory_ids: list[str] = []
        self._memory_index: dict[str, int] = {}
        self.memory_speakers: list[list[str]] = []
        self._speaker_index: list[dict[str, int]] = []
        self.session_ids: list[str] = []  # global session index -> the benchmark's session id
        self.session_memory: list[int] = []  # global session index -> memory_idx
        self._session_index: list[dict[str, int]] = []
        self._memory_rows: list[GrowableArray] = []  # per memory: its rows in append order
        self._turn_index: dict[int, dict[str, list[int]]] = {}  # per memory, built on first use: turn id -> rows

        # episode columns (row-indexed)
        self._memory_idx = GrowableArray(np.int32)
        self._session_idx = GrowableArray(np.int32)
        self._position = GrowableArray(np.int32)
        self._speaker_id = GrowableArray(np.int16)
        self._timestamp = GrowableArray("datetime64[s]", np.datetime64("NaT", "s"))
        self._deleted = GrowableArray(np.bool_, False)
        self._prefix_len = GrowableArray(np.int32)
        self._text = TextColumn()
        self._turn_id = TextColumn()
        self._image_ids: dict[int, tuple[str, ...]] = {}  # only rows with images
        self._object_cache: dict[str, np.ndarray] = {}

        self.summaries = SummaryTable()
        self.summarised: set[int] = set()  # memories build_summaries has processed (never re-summarised)
        # records logged and applied to the metadata but not indexed yet (append_turns(index=False)): the
        # episode indexes index them, in one encoder pass, before anything reads them (index_pending)
        self._unindexed: list[dict[str, Any]] = []
        self.deferred_indexed = {"calls": 0, "episodes": 0, "seconds": 0.0}  # index_pending's work so far
        self.episode_bm25, self.summary_bm25 = self._new_bm25(), self._new_bm25()
        self.episode_dense, self.summary_dense = self._new_dense(), self._new_dense()

        self._log: RecordLog | None = None
        self._commits = True  # end each logged batch with a commit record (False for format-1 logs)
        self._snapshot_records = 0
        if self.path is not None:
            self._open()

    # ------------------------------------------------------------------ indexes
    @property
    def episode_bm25(self) -> LexicalIndex:
        """The episodes' BM25 index, holding every logged episode (pending ones are indexed first)."""
        if self._unindexed:
            self.index_pending()
        return self._episode_bm25

    @episode_bm25.setter
    def episode_bm25(self, index: LexicalIndex) -> None:
        self._episode_bm25 = index

    @property
    def episode_dense(self) -> DenseIndex:
        """The episodes' dense index, holding every logged episode (pending ones are indexed first)."""
        if self._unindexed:
            self.index_pending()
        return self._episode_dense

    @episode_dense.setter
    def episode_dense(self, index: DenseIndex) -> None:
        self._episode_dense = index

    @property
    def pending(self) -> int:
        """Episodes logged but not indexed yet (append_turns(index=False))."""
        return sum(1 for r in self._unindexed if r.get("t") == "episode")

    def index_pending(self) -> int:
        """Index the episodes appended with `append_turns(index=False)`: one encoder pass over all of
        them, one BM25 and one dense add, as if they had been one write batch. Called before anything
        reads or changes the episode indexes (their properties, every write batch, snapshot), so no read
        ever sees a logged turn missing from an index. Returns how many episodes it indexed."""
        if not self._unindexed:
            return 0
        started = time.perf_counter()
        records = self._unindexed
        embeddings = self._encode_records(records)  # a failure here keeps them pending
        self._unindexed = []
        self._index_records(records, embeddings)
        self.generation = next(GENERATIONS)
        episodes = sum(1 for r in records if r.get("t") == "episode")
        done = self.deferred_indexed
        done["calls"] += 1
        done["episodes"] += episodes
        done["seconds"] += time.perf_counter() - started
        return episodes

    def _dense_gpu_id(self) -> int:
        """The GPU of GPU FAISS (index/factory.py: the BM25 index's GPU, else GPU 0)."""
        return dense_gpu_id(self.cfg.index)

    def _new_bm25(self) -> LexicalIndex:
        return lexical_index(self.cfg.index)

    def _new_dense(self) -> DenseIndex:
        return dense_index(self.cfg.index, self.dim)

    # ------------------------------------------------------------------ read-side columns
    @property
    def size(self) -> int:
        """Episode rows ever stored (deleted rows keep their number)."""
        return self._memory_idx.size

    @property
    def memory_idx(self) -> np.ndarray:
        return self._memory_idx.view

    @property
    def session_idx(self) -> np.ndarray:
        """Global session number (unique per memory and session, in order of first appearance);
        `session_ids[i]` is the benchmark's id, `session_memory[i]` its memory."""
        return self._session_idx.view

    @property
    def speakers(self) -> list[list[str]]:
        """Speaker names per memory_idx (alias of memory_speakers)."""
        return self.memory_speakers

    @property
    def speaker(self) -> np.ndarray:
        """Speaker name per row, object array (built from the memories' speaker lists and speaker_id)."""
        cached = self._object_cache.get("speaker")
        if cached is None or len(cached) != self.size:
            cached = np.empty(self.size, dtype=object)
            memory_idx, speaker_id = self.memory_idx, self.speaker_id
            for memory in np.unique(memory_idx):
                rows = np.flatnonzero(memory_idx == memory)
                names = np.empty(len(self.memory_speakers[memory]), dtype=object)
                names[:] = self.memory_speakers[memory]
                cached[rows] = names[speaker_id[rows]]
            self._object_cache["speaker"] = cached
        return cached

    @property
    def position(self) -> np.ndarray:
        """Turn order within the memory: 0, 1, 2, ... in append order (deleted turns keep theirs)."""
        return self._position.view

    @property
    def speaker_id(self) -> np.ndarray:
        """Index into `memory_speakers[memory_idx]`."""
        return self._speaker_id.view

    @property
    def timestamp(self) -> np.ndarray:
        return self._timestamp.view

    @property
    def deleted(self) -> np.ndarray:
        return self._deleted.view

    @property
    def text(self) -> TextColumn:
        """Episode texts (what was encoded and BM25-indexed): `text[row]` is a str, `text[rows]` an object
        array (UTF-8 bytes underneath, see buffers.TextColumn)."""
        return self._text

    @property
    def turn_id(self) -> TextColumn:
        return self._turn_id

    @property
    def image_ids(self) -> np.ndarray:
        """Tuple of image ids per row (empty when none or when the benchmark has no ids)."""
        cached = self._object_cache.get("image_ids")
        if cached is None or len(cached) != self.size:
            cached = np.empty(self.size, dtype=object)
            cached[:] = [()] * self.size
            for row, ids in self._image_ids.items():
                cached[row] = ids
            self._object_cache["image_ids"] = cached
        return cached

    def nbytes(self) -> dict[str, int]:
        """Bytes of the episode columns (texts and turn ids as UTF-8 and offsets, numpy columns)."""
        columns = (self._memory_idx, self._session_idx, self._position, self._speaker_id, self._timestamp,
                   self._deleted, self._prefix_len)
        return {"text": self._text.nbytes, "turn_id": self._turn_id.nbytes,
                "columns": int(sum(c.view.nbytes for c in columns)),
                "memory_rows": int(sum(r.view.nbytes for r in self._memory_rows))}

    def body(self, row: int) -> str:
        """The episode text without its `DATE: ... says: ` prefix."""
        return self._text[row][int(self._prefix_len.view[row]) :]

    def speaker_name(self, row: int) -> str:
        return self.memory_speakers[int(self.memory_idx[row])][int(self.speaker_id[row])]

    def memory_rows(self, memory_idx: int, live: bool = True) -> np.ndarray:
        """Rows of one memory in conversation order."""
        rows = self._memory_rows[memory_idx].view.copy()
        return rows[~self.deleted[rows]] if live else rows

    def memory_of(self, memory_id: str) -> int:
        try:
            return self._memory_index[memory_id]
        except KeyError:
            raise KeyError(f"EpisodeStore: no memory {memory_id!r} (have {len(self.memory_ids)})") from None

    def row_of(self, memory_id: str, turn_id: str) -> int:
        """The live row of a turn. Unknown or ambiguous turn ids are errors that name both ids."""
        memory = self.memory_of(memory_id)
        index = self._turn_index.get(memory)
        if index is None:
            index = self._turn_index[memory] = {}
            for row in self._memory_rows[memory].view.tolist():
                index.setdefault(self._turn_id[row], []).append(row)
        rows = [r for r in index.get(turn_id, []) if not self.deleted[r]]
        if not rows:
            raise KeyError(f"EpisodeStore: memory {memory_id!r} has no live turn {turn_id!r}")
        if len(rows) > 1:
            raise KeyError(f"EpisodeStore: memory {memory_id!r} has {len(rows)} live turns with id {turn_id!r} (rows {rows})")
        return rows[0]

    # ------------------------------------------------------------------ record application (metadata)
    def _apply_memory(self, record: dict[str, Any]) -> None:
        memory = int(record["memory"])
        if memory != len(self.memory_ids):
            raise ValueError(f"{self._where()}: memory record {memory} out of order (expected {len(self.memory_ids)})")
        self.memory_ids.append(record["id"])
        self._memory_index[record["id"]] = memory
        self.memory_speakers.append([])
        self._speaker_index.append({})
        self._session_index.append({})
        self._memory_rows.append(GrowableArray(np.int64))
        for name in record.get("speakers", []):
            self._apply_speaker({"memory": memory, "name": name})

    def _apply_speaker(self, record: dict[str, Any]) -> None:
        memory, name = int(record["memory"]), record["name"]
        if name in self._speaker_index[memory]:
            return
        speaker = len(self.memory_speakers[memory])
        if speaker >= MAX_SPEAKERS:
            raise ValueError(f"EpisodeStore: memory {self.memory_ids[memory]!r} has more than {MAX_SPEAKERS} speakers")
        self.memory_speakers[memory].append(name)
        self._speaker_index[memory][name] = speaker

    def _apply_episode(self, record: dict[str, Any]) -> None:
        self._apply_episodes([record])

    def _apply_episodes(self, records: Sequence[dict[str, Any]]) -> None:
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
                self._apply_speaker({"memory": memory, "name": record["speaker"]})
            except _APPLY_ERRORS as exc:
                raise RecordRefused(offset, "episode", f"{self._where()}: {exc}") from None
            sessions = self._session_index[memory]
            session = sessions.get(record["session"])
            if session is None:
                session = sessions[record["session"]] = len(self.session_ids)
                self.session_ids.append(record["session"])
                self.session_memory.append(memory)
            text = record["text"]
            prefix = episode_prefix(record["date"], record["speaker"])
            if not text.startswith(prefix):
                raise RecordRefused(offset, "episode", f"{self._where()}: episode row {row} text does not start "
                                                       f"with {prefix!r}")
            pending = new_rows.setdefault(memory, [])
            memories.append(memory)
            sessions_of.append(session)
            positions.append(self._memory_rows[memory].size + len(pending))
            speakers.append(self._speaker_index[memory][record["speaker"]])
            times.append(_timestamp(record.get("ts")))
            texts.append(text)
            prefixes.append(len(prefix))
            turns.append(record["turn"])
            images = record.get("images")
            if images:
                self._image_ids[row] = tuple(images)
            pending.append(row)
        self._memory_idx.extend(memories)
        self._session_idx.extend(sessions_of)
        self._position.extend(positions)
        self._speaker_id.extend(speakers)
        self._timestamp.extend(np.asarray(times, dtype="datetime64[s]"))
        self._deleted.extend(np.zeros(len(records), dtype=np.bool_))
        self._prefix_len.extend(prefixes)
        self._text.extend(texts)
        self._turn_id.extend(turns)
        for memory, rows in new_rows.items():
            self._memory_rows[memory].extend(rows)
            index = self._turn_index.get(memory)
            if index is not None:  # kept up to date: rebuilding it is a pass over the memory's rows per add
                for row in rows:
                    index.setdefault(self._turn_id[row], []).append(row)

    def _apply_delete(self, record: dict[str, Any]) -> None:
        self._deleted.view[int(record["row"])] = True

    def _apply_summary(self, record: dict[str, Any]) -> None:
        table = self.summaries
        row = int(record["row"])
        if row != len(table):
            raise ValueError(f"{self._where()}: summary record row {row} out of order (expected {len(table)})")
        table.text.append(record["text"])
        table.memory_idx.extend([int(record["memory"])])
        table.members.append(np.asarray(record["members"], dtype=np.int64))
        table.event_time.extend([_timestamp(record.get("event"))])
        table.recorded_time.extend([_timestamp(record.get("recorded"))])
        table.deleted.extend([False])
        replaces = record.get("replaces")
        table.replaces.extend([-1 if replaces is None else int(replaces)])

    def _apply_summary_delete(self, record: dict[str, Any]) -> None:
        self.summaries.deleted.view[int(record["row"])] = True

    def _apply_summarised(self, record: dict[str, Any]) -> None:
        self.summarised.update(int(m) for m in record["memories"])

    _APPLY = {
        "memory": _apply_memory,
        "speaker": _apply_speaker,
        "episode": _apply_episode,
        "delete": _apply_delete,
        "summary": _apply_summary,
        "summary_delete": _apply_summary_delete,
        "summarised": _apply_summarised,
    }

    def _apply_all(self, records: Iterable[dict[str, Any]]) -> int:
        """Apply records in order, runs of episode records column by column; returns how many there were.
        A record that cannot be applied is a RecordRefused naming its position among `records`."""
        run: list[dict[str, Any]] = []
        count = 0

        def flush() -> None:
            try:
                self._apply_episodes(run)
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
                self._apply(record)
            except RecordRefused as exc:
                raise exc.shifted(count) from None
            except _APPLY_ERRORS as exc:
                raise RecordRefused(count, record.get("t"), f"{self._where()}: {exc}") from None
            count += 1
        if run:
            flush()
        return count

    def _check_records(self, records: Sequence[dict[str, Any]]) -> None:
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

    def _apply(self, record: dict[str, Any]) -> None:
        kind = record.get("t")
        if kind in ("header", "commit"):
            return
        handler = self._APPLY.get(kind)
        if handler is None:
            raise ValueError(f"{self._where()}: unknown record type {kind!r}")
        handler(self, record)

    def _where(self) -> str:
        return str(self._log.path) if self._log is not None else "EpisodeStore"

    # ------------------------------------------------------------------ index application
    @staticmethod
    def _texts_to_encode(records: list[dict[str, Any]]) -> list[str]:
        return [r["text"] for r in records if r.get("t") in ("episode", "summary")]

    def _encode_records(self, records: list[dict[str, Any]], progress: bool = False) -> torch.Tensor:
        started = time.perf_counter()
        embeddings = self._encode(self._texts_to_encode(records), progress)
        self.last_timings["encode_s"] = time.perf_counter() - started
        return embeddings

    def _index_records(
        self, records: list[dict[str, Any]], embeddings: torch.Tensor | None = None, progress: bool = False
    ) -> None:
        """Bring the four indexes up to date with records (already applied to the metadata).

        Every new text (episodes and summaries) is encoded in ONE encoder pass; the episodes of a batch
        (all memories) become one BM25 add and one dense add (one FAISS add per memory inside).
        """
        if embeddings is None:
            embeddings = self._encode_records(records, progress)
        self.last_timings.setdefault("bm25_s", 0.0)
        self.last_timings.setdefault("dense_s", 0.0)
        cursor = 0
        run: list[dict[str, Any]] = []  # consecutive episode (or summary) records, metadata records skipped

        def flush() -> None:
            nonlocal cursor, run
            if not run:
                return
            kind = run[0]["t"]
            vectors = embeddings[cursor : cursor + len(run)]
            cursor += len(run)
            memories = [int(r["memory"]) for r in run]
            bm25, dense = (
                (self.episode_bm25, self.episode_dense) if kind == "episode" else (self.summary_bm25, self.summary_dense)
            )
            expected = [int(r["row"]) for r in run]
            t0 = time.perf_counter()
            bm25_rows = bm25.add_texts([r["text"] for r in run], memories) if isinstance(bm25, BM25Index) else \
                bm25.add(tokenize_many([r["text"] for r in run]), memories)
            t1 = time.perf_counter()
            dense_rows = dense.add(vectors, memories)  # one FAISS add per memory inside
            t2 = time.perf_counter()
            self.last_timings["bm25_s"] += t1 - t0
            self.last_timings["dense_s"] += t2 - t1
            if list(map(int, bm25_rows)) != expected or dense_rows.tolist() != expected:
                raise RuntimeError(
                    f"{self._where()}: {kind} rows disagree: log {expected[:3]}..., "
                    f"BM25 {list(map(int, bm25_rows[:3]))}..., dense {dense_rows[:3].tolist()}..."
                )
            run = []

        for record in records:
            kind = record.get("t")
            if kind in ("episode", "summary"):
                if run and run[0]["t"] != kind:
                    flush()
                run.append(record)
            elif kind in ("delete", "summary_delete"):
                flush()  # a deletion may name a row added earlier in this very batch
                bm25, dense = (
                    (self.episode_bm25, self.episode_dense) if kind == "delete" else (self.summary_bm25, self.summary_dense)
                )
                bm25.delete([int(record["row"])])
                dense.delete([int(record["row"])])
        flush()

    def _encode(self, texts: list[str], progress: bool = False) -> torch.Tensor:
        if not texts:
            return torch.empty((0, self.dim), dtype=torch.float32)
        faults.point("store.encode", len(texts))
        return self.encoder.encode(texts, batch_size=self.cfg.index.encode_batch_size, progress=progress)

    # ------------------------------------------------------------------ writes
    def append_turn(self, memory_id: str, turn: Turn, session_id: str | None = None, speakers: Sequence[str] = ()) -> int:
        """A live agent's one new turn: logged (fsync with store.fsync) and indexed; returns its row.

        session_id None: the turn's date text names its session. A new memory id creates the memory
        with `speakers` (more speakers are added as they first speak).
        """
        return self.append_turns([(memory_id, turn, session_id, speakers)])[0]

    def append_turns(self, turns: Sequence[tuple[str, Turn, str | None, Sequence[str]]], index: bool = True) -> list[int]:
        """New turns of any memories, (memory id, turn, session id, speakers) each, as ONE write batch: one
        log append ending in its commit record (fsync with store.fsync), one encoder pass, one BM25 and one
        dense add; returns their rows in order. Logged only, like append_turn: the next snapshot() (or
        close()) saves the index state, else the next open re-encodes them.

        index=False: logged (fsynced) and applied to the metadata only; the encoder pass and the index adds
        wait for `index_pending`, which every read of the episode indexes runs first (a live memory's
        `live.indexing: deferred`). A kill before then loses nothing: the log replays."""
        records: list[dict[str, Any]] = []
        pending: dict[str, int] = {}
        rows: list[int] = []
        row = self.size
        for memory_id, turn, session_id, speakers in turns:
            memory_idx, created = self._memory_records(memory_id, speakers, pending)
            records.extend(created)
            records.append(self._episode_record(row, memory_idx, session_id if session_id is not None else turn.date_text,
                                                turn))
            rows.append(row)
            row += 1
        if records:
            self._commit(records, snapshot=False, index=index)
        return rows

    def live_turns(self, memory_id: str) -> list[int]:
        """The live rows of one memory in conversation order ([] for a memory never stored)."""
        memory = self._memory_index.get(memory_id)
        return [] if memory is None else self.memory_rows(memory).tolist()

    def conversation(self, memory_id: str) -> Memory:
        """One memory's live turns as the data schema's Memory (what a loader yields): its speakers, and its
        sessions in the order their first turn came, each turn with its id, speaker, own words, timestamp,
        date text and images (caption and id; the store keeps no image paths)."""
        memory = Memory(memory_id, speakers=list(self.memory_speakers[self.memory_of(memory_id)])
                        if memory_id in self._memory_index else [])
        sessions: dict[str, Session] = {}
        for row in self.live_turns(memory_id):
            speaker = self.speaker_name(row)
            text = self._text[row]
            date = text[len("DATE: "):len(text) - len(self.body(row)) - len(f" | Speaker {speaker} says: ")]
            stamp = "" if np.isnat(self.timestamp[row]) else str(self.timestamp[row])
            images, said = split_body(self.body(row), self.image_ids[row])
            session_id = self.session_ids[int(self.session_idx[row])]
            session = sessions.get(session_id)
            if session is None:
                session = sessions[session_id] = Session(session_id, date, stamp)
            session.turns.append(Turn(str(self.turn_id[row]), speaker, said, stamp, date,
                                      [Image(caption, image_id) for image_id, caption in images]))
        memory.sessions = list(sessions.values())
        return memory

    def has_turn(self, memory_id: str, turn_id: str) -> int | None:
        """The live row of a turn id in a memory, None when there is none (row_of raises instead)."""
        try:
            return self.row_of(memory_id, turn_id)
        except KeyError:
            return None

    def delete_episode(
        self, memory_id: str, turn_id: str, generate: Callable[[list[str]], list[str]] | None = None
    ) -> None:
        """User-initiated deletion of one turn (SPEC write path 5); see `delete_episodes`."""
        self.delete_episodes(memory_id, [turn_id], generate)

    def delete_episodes(
        self, memory_id: str, turn_ids: Sequence[str], generate: Callable[[list[str]], list[str]] | None = None
    ) -> dict[str, int]:
        """User-initiated deletion (SPEC write path 5), in one logged batch: the episodes leave the store's
        live rows and both indexes; a summary whose members include one of them is retired and, with
        `generate`, rebuilt over the remaining members (new summary row, `replaces` = the old one; one
        generate call for all). Without `generate` the old summary is still retired (it may quote a deleted
        turn) and the segment stays unsummarised. Every turn id is checked before anything is written.

        Returns counts: episodes deleted, summaries retired and rebuilt. The text stays in the log (a
        tombstone hides it) until `compact()`."""
        if not turn_ids:
            raise ValueError(f"EpisodeStore.delete_episodes: no turn ids given for memory {memory_id!r}")
        rows = sorted({self.row_of(memory_id, turn_id) for turn_id in turn_ids})
        return self.delete_rows(memory_id, rows, generate, label=", ".join(turn_ids))

    def delete_rows(self, memory_id: str, rows: Sequence[int], generate: Callable[[list[str]], list[str]] | None = None,
                    label: str = "") -> dict[str, int]:
        """`delete_episodes` by live rows of the memory (a live memory's delete_user: every row, whatever
        its turn id)."""
        memory = self.memory_of(memory_id)
        rows = sorted(set(int(r) for r in rows))
        foreign = [r for r in rows if int(self.memory_idx[r]) != memory or self.deleted[r]]
        if foreign:
            raise KeyError(f"EpisodeStore: rows {foreign[:5]} are no live turns of memory {memory_id!r}")
        records: list[dict[str, Any]] = [{"t": "delete", "row": row} for row in rows]
        doomed = set(rows)
        affected = [s for s in self.summaries.live_rows(memory) if doomed & set(self.summaries.members[s].tolist())]
        rebuild: list[tuple[int, np.ndarray]] = []
        for summary in affected:
            records.append({"t": "summary_delete", "row": int(summary)})
            remaining = self.summaries.members[summary]
            remaining = remaining[~np.isin(remaining, rows) & ~self.deleted[remaining]]
            rebuild.append((int(summary), remaining))
        if rebuild and generate is None:
            log.warning(
                "EpisodeStore: deleting %s/%s retires %d summar%s; no generate callable was given, so the "
                "segment is left without one", memory_id, label or f"{len(rows)} turns", len(rebuild),
                "y" if len(rebuild) == 1 else "ies",
            )
        rebuilt: list[dict[str, Any]] = []
        if rebuild and generate is not None:
            jobs = [self.summary_job(memory, members, replaces=old) for old, members in rebuild]
            rebuilt = summary_records(jobs, generate, self.cfg.summary, first_row=len(self.summaries))
        self._commit(records + rebuilt)
        return {"episodes": len(rows), "summaries_retired": len(rebuild), "summaries_rebuilt": len(rebuilt)}

    def build_summaries(
        self, generate: Callable[[list[str]], list[str]], memory_ids: Sequence[str] | None = None, progress: bool = True
    ) -> int:
        """Summarise the segments of every memory not summarised before, in one generate batch and one
        committed write batch; returns how many summaries were added.

        Args:
            generate: prompts -> texts (a reader's summary role, or any function).
            memory_ids: the memories to consider (default: all).
        """
        if not self.cfg.summary.enabled:
            log.info("summaries: disabled (summary.enabled=false); nothing built")
            return 0
        wanted = range(len(self.memory_ids)) if memory_ids is None else [self.memory_of(m) for m in memory_ids]
        memories = [m for m in wanted if m not in self.summarised]
        if len(memories) < len(wanted):
            log.info("summaries: %d memories already have summaries; they are not re-summarised",
                     len(wanted) - len(memories))
        if not memories:
            return 0
        rows = [self.memory_rows(m) for m in memories]
        planned = plan_segments(rows, [self.episode_dense.vectors(r) for r in rows], self.cfg.segment, self.cfg.summary)
        jobs = [self.summary_job(memory, members) for memory, segments in zip(memories, planned, strict=True)
                for members in segments]
        records = summary_records(jobs, generate, self.cfg.summary, first_row=len(self.summaries))
        # Remember which memories were summarised, even where every output was dropped: asking again would
        # re-summarise the same segments (and at temperature 0 get the same short answers).
        records.append({"t": "summarised", "memories": [int(m) for m in memories]})
        self._commit(records, progress=progress)
        built = len(records) - 1
        log.info("summaries: %d built over %d memories (%d segments eligible)", built, len(memories), len(jobs))
        return built

    def closed_segment_jobs(self, memory_ids: Sequence[str] | None = None) -> list[SummaryJob]:
        """What a live memory summarises next (memfit_gpu.Memory.consolidate): per memory, the live turns
        after the last one any live summary covers are segmented with TextTiling (as build_summaries
        segments a whole memory); every segment but the last is closed and gets a summary by the same rules
        (summary.min_segment; summary.max_summaries counts the memory's live summaries); the last one may
        still grow, so it waits. Nothing stored is re-summarised. Pure planning: commit the records made
        from these jobs with `commit_summaries` (the LLM calls need no hold on the store in between)."""
        if not self.cfg.summary.enabled:
            return []
        wanted = range(len(self.memory_ids)) if memory_ids is None else [self.memory_of(m) for m in memory_ids]
        memories, tails = [], []
        for memory in wanted:
            live = self.memory_rows(memory)
            summaries = self.summaries.live_rows(memory)
            covered = max((int(self.summaries.members[s].max()) for s in summaries if len(self.summaries.members[s])),
                          default=-1)
            tail = live[live > covered]
            room = self.cfg.summary.max_summaries - len(summaries)
            if len(tail) >= 2 * self.cfg.summary.min_segment and room > 0:
                memories.append((memory, room))
                tails.append(tail)
        if not memories:
            return []
        segments = segment_batch([self.episode_dense.vectors(t) for t in tails], self.cfg.segment)
        jobs = []
        for (memory, room), tail, cuts in zip(memories, tails, segments, strict=True):
            kept = summary_segments(list(cuts)[:-1], replace(self.cfg.summary, max_summaries=room))
            jobs.extend(self.summary_job(memory, tail[start:end]) for start, end in kept)
        return jobs

    def commit_summaries(self, records: Sequence[dict[str, Any]]) -> int:
        """Summary records made (summaries.summary_records) from `closed_segment_jobs`, as one committed
        write batch, rows renumbered from the table's end; a record whose members were deleted or covered
        by another summary since its jobs were planned is dropped (the next consolidation plans again).
        Returns how many were stored."""
        kept = []
        for record in records:
            members = np.asarray(record["members"], dtype=np.int64)
            memory = int(record["memory"])
            covered = [int(self.summaries.members[s].max()) for s in self.summaries.live_rows(memory)
                       if len(self.summaries.members[s])]
            if self.deleted[members].any() or (covered and members.min() <= max(covered)):
                continue
            kept.append({**record, "row": len(self.summaries) + len(kept)})
        if kept:
            self._commit(kept)
        return len(kept)

    def summary_job(self, memory_idx: int, members: Sequence[int] | np.ndarray, replaces: int | None = None) -> SummaryJob:
        """What a summary of these member turns (episode rows in time order) is made from."""
        members = np.asarray(members, dtype=np.int64)
        times = self.timestamp[members]  # a rebuild may find every member deleted: no times
        unknown = np.datetime64("NaT", "s")
        return SummaryJob(
            memory_idx=int(memory_idx), members=members,
            speakers=[self.speaker_name(int(row)) for row in members], bodies=[self.body(int(row)) for row in members],
            event=times[0] if len(times) else unknown, recorded=times[-1] if len(times) else unknown, replaces=replaces,
            memory_id=self.memory_ids[int(memory_idx)],
        )

    # ------------------------------------------------------------------ persistence
    def _snapshot_dir(self) -> Path:
        assert self.path is not None
        return self.path / "snapshots"

    def snapshot(self) -> None:
        """Write index state covering every record logged so far (no-op in memory or when current);
        see store/snapshot.py."""
        if self._log is None or len(self._log) == self._snapshot_records:
            return
        self.index_pending()  # a snapshot never covers a logged turn its indexes lack
        count = len(self._log)
        write_snapshot(
            self._snapshot_dir(), count, self._log.fingerprint(count),
            {"episodes": self.size, "summaries": len(self.summaries), "dim": self.dim},
            bm25={"episode_bm25": self.episode_bm25, "summary_bm25": self.summary_bm25},
            dense={"episode_dense": self.episode_dense, "summary_dense": self.summary_dense},
        )
        self._snapshot_records = count

    # ------------------------------------------------------------------ compaction
    def _compacted(self) -> tuple[list[dict[str, Any]], torch.Tensor]:
        """The log's records without deleted episodes, retired summaries and tombstones, rows renumbered
        in the same order, and the stored vector of every text in them (nothing is re-encoded)."""
        assert self._log is not None
        records, sources = compaction.compacted_records(self._log.records, self.deleted, self.summaries.deleted.view)
        vectors = np.empty((len(sources), self.dim), dtype=np.float32)
        for kind, dense in (("episode", self.episode_dense), ("summary", self.summary_dense)):
            where = [i for i, (k, _) in enumerate(sources) if k == kind]
            if where:
                vectors[where] = dense.vectors([sources[i][1] for i in where])
        return records, torch.from_numpy(vectors)

    def compact(self) -> dict[str, int]:
        """Rewrite the store on disk without its deleted episodes and retired summaries, for users who
        must really forget: afterwards their text and vectors are nowhere under the store folder.

        Episode and summary rows are renumbered 0.. in their old order (relative order, hence every
        tie-break, is kept); the indexes are rebuilt from the stored vectors (never re-encoded) and the
        live texts, so the same queries give the same results, row numbers aside (a trained FAISS factory
        is retrained on the remaining vectors). The new store (one committed batch and its snapshot) is
        built beside the old one and made durable, then the two are swapped with two renames and the old
        one is removed; a kill at any point leaves the old or the new store, and the next open finishes
        or undoes the swap. The store is closed afterwards: open it again to use it. Returns counts."""
        if self._log is None or self.path is None:
            raise ValueError("EpisodeStore.compact: an in-memory store has nothing on disk to compact")
        for memory in range(len(self.memory_ids)):
            kind = self.episode_dense.memory_kind(memory)
            if kind not in (None, "Flat"):
                log.warning("EpisodeStore.compact: memory %r uses a trained %s index: it is retrained on the "
                            "remaining vectors, so its approximate results can shift", self.memory_ids[memory], kind)
        before = {"records": len(self._log), "episodes": self.size, "summaries": len(self.summaries),
                  "memories": len(self.memory_ids)}
        records, vectors = self._compacted()
        kept = {r["id"] for r in records if r.get("t") == "memory"}
        self.erased = [m for m in self.memory_ids if m not in kept]  # memories nothing is left of
        new, _ = compaction.compaction_dirs(self.path)
        if new.exists():
            shutil.rmtree(new)
        fresh = EpisodeStore(new, self.cfg, self.encoder)
        fresh._commit(records, embeddings=vectors)
        assert fresh._log is not None
        after = {"records": len(fresh._log), "episodes": fresh.size, "summaries": len(fresh.summaries),
                 "memories": len(fresh.memory_ids)}
        fresh.close()
        compaction.fsync_tree(new)
        faults.point("compact.built")
        self._log.close()  # no last snapshot: this store is about to go
        self._log = None
        compaction.swap(self.path)
        log.info("EpisodeStore.compact: %s rewritten: %s", self.path, after)
        return {**{f"{k}_before": v for k, v in before.items()}, **{f"{k}_after": v for k, v in after.items()}}

    def close(self) -> None:
        """Snapshot what the log holds beyond the last snapshot, then close the log."""
        if self._log is not None:
            try:
                self.snapshot()
            finally:  # a refused snapshot (full disk) still closes the log: the next open replays it
                self._log.close()
                self._log = None

    def __enter__(self) -> EpisodeStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
