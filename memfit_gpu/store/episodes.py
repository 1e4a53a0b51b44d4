"""EpisodeStore: every memory's episodes (and summaries) in one store, with the indexes it owns. Its parts
are explicit objects and functions, not base classes: the metadata columns and how each log record kind
applies to them are `StoreColumns` (store/columns.py), a write batch's records and chunks are made from
those columns by store/write_path.py, and opening checks and replays the log with store/replay.py.

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

import itertools
import logging
import shutil
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from memfit_gpu import faults
from memfit_gpu.buffers import TextColumn
from memfit_gpu.config import MemFitConfig
from memfit_gpu.data.schema import Image, Memory, Session, Turn
from memfit_gpu.index.bm25 import BM25Index
from memfit_gpu.index.dense import DenseIndex
from memfit_gpu.index.encoders import TextEncoder, load_bi_encoder
from memfit_gpu.index.factory import dense_gpu_id, dense_index, lexical_index
from memfit_gpu.index.protocols import LexicalIndex
from memfit_gpu.index.tokenize import tokenize_many
from memfit_gpu.store import compaction
from memfit_gpu.store.columns import StoreColumns
from memfit_gpu.store.log import RecordLog
from memfit_gpu.store.replay import open_log, replay_chunks, replay_columns
from memfit_gpu.store.segment import segment_batch, summary_segments
from memfit_gpu.store.snapshot import load_newest, write_snapshot
from memfit_gpu.store.summaries import SummaryJob, plan_segments, summary_records
from memfit_gpu.store.summary_table import SummaryTable
from memfit_gpu.store.text import split_body, split_images
from memfit_gpu.store.write_path import batch_chunks, turn_records

log = logging.getLogger(__name__)

# Each change of a store's content takes the next number as its `generation`: a reader's cached view of
# the store (a live memory's ReadView) is current while the generation it was built at is.
GENERATIONS = itertools.count(1)


class StoreClosedError(RuntimeError):
    """A write to a persistent store whose log is closed (closed, or a compaction that failed half-way): it
    would be held in memory only, and lost, though the call returned."""


@dataclass(frozen=True)
class DeletePlan:
    """A deletion planned by `EpisodeStore.plan_delete`, not yet written."""

    memory_id: str
    rows: list[int]  # the live rows deleted
    records: list[dict[str, Any]]  # their tombstones and the covering summaries' retirements
    rebuilds: list[SummaryJob]  # a summary over each retired one's remaining members (`replaces` = it)

    def same_as(self, other: DeletePlan) -> bool:
        """The same writes and rebuilds (the stored turns a rebuild reads never change: the store appends)."""
        return (self.memory_id, self.rows, self.records) == (other.memory_id, other.rows, other.records) and [
            (job.replaces, job.members.tolist()) for job in self.rebuilds] == [
            (job.replaces, job.members.tolist()) for job in other.rebuilds]


class EpisodeStore:
    """Episodes of many memories, their metadata columns, and the BM25 + dense indexes over them. The
    columns and their record handlers are `self.columns` (store/columns.py); the write batch's records
    come from store/write_path.py, opening and log replay from store/replay.py."""

    def __init__(self, path: str | Path | None, cfg: MemFitConfig | None = None, encoder: TextEncoder | None = None,
                 read_only: bool = False):
        """read_only: read the store at `path` without changing a byte of its folder (no snapshot, no repair, no
        write: `memfit retrieve --store` reads another run's store); what an open to write would mend is refused
        (store/replay.py open_log)."""
        self.cfg = cfg or MemFitConfig()
        self.read_only = read_only
        if encoder is None:
            encoder = load_bi_encoder(self.cfg.index)
        self.encoder = encoder
        self.dim = int(encoder.dim)
        path = path if path is not None else self.cfg.store.path
        self.path = Path(path) if path is not None else None
        self.last_timings: dict[str, float] = {}
        self.erased: list[str] = []  # after compact(): the memories it removed (nothing was left of them)
        self.generation = next(GENERATIONS)  # a new number after every write batch

        self.columns = StoreColumns()  # the metadata of every record applied (store/columns.py)
        self._object_cache: dict[str, np.ndarray] = {}  # per-row object arrays built from the columns

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
        return self.columns.size

    @property
    def memory_ids(self) -> list[str]:
        """Memory ids by memory_idx."""
        return self.columns.memory_ids

    @property
    def memory_speakers(self) -> list[list[str]]:
        """Speaker names per memory_idx, in order of first appearance."""
        return self.columns.memory_speakers

    @property
    def session_ids(self) -> list[str]:
        """Global session index -> the benchmark's session id."""
        return self.columns.session_ids

    @property
    def session_memory(self) -> list[int]:
        """Global session index -> memory_idx."""
        return self.columns.session_memory

    @property
    def summaries(self) -> SummaryTable:
        return self.columns.summaries

    @property
    def summarised(self) -> set[int]:
        """Memories build_summaries has processed (never re-summarised)."""
        return self.columns.summarised

    @property
    def memory_idx(self) -> np.ndarray:
        return self.columns.memory_idx.view

    @property
    def session_idx(self) -> np.ndarray:
        """Global session number (unique per memory and session, in order of first appearance);
        `session_ids[i]` is the benchmark's id, `session_memory[i]` its memory."""
        return self.columns.session_idx.view

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
        return self.columns.position.view

    @property
    def speaker_id(self) -> np.ndarray:
        """Index into `memory_speakers[memory_idx]`."""
        return self.columns.speaker_id.view

    @property
    def timestamp(self) -> np.ndarray:
        return self.columns.timestamp.view

    @property
    def deleted(self) -> np.ndarray:
        return self.columns.deleted.view

    @property
    def text(self) -> TextColumn:
        """Episode texts (what was encoded and BM25-indexed): `text[row]` is a str, `text[rows]` an object
        array (UTF-8 bytes underneath, see buffers.TextColumn)."""
        return self.columns.text

    @property
    def turn_id(self) -> TextColumn:
        return self.columns.turn_id

    @property
    def image_ids(self) -> np.ndarray:
        """Tuple of image ids per row (empty when none or when the benchmark has no ids)."""
        cached = self._object_cache.get("image_ids")
        if cached is None or len(cached) != self.size:
            cached = np.empty(self.size, dtype=object)
            cached[:] = [()] * self.size
            for row, ids in self.columns.image_ids.items():
                cached[row] = ids
            self._object_cache["image_ids"] = cached
        return cached

    def nbytes(self) -> dict[str, int]:
        """Bytes of the episode columns (texts and turn ids as UTF-8 and offsets, numpy columns)."""
        c = self.columns
        columns = (c.memory_idx, c.session_idx, c.position, c.speaker_id, c.timestamp, c.deleted, c.prefix_len)
        return {"text": c.text.nbytes, "turn_id": c.turn_id.nbytes,
                "columns": int(sum(column.view.nbytes for column in columns)),
                "memory_rows": int(sum(r.view.nbytes for r in c.rows_of_memory))}

    def body(self, row: int) -> str:
        """The episode text without its `DATE: ... says: ` prefix."""
        return self.columns.text[row][int(self.columns.prefix_len.view[row]) :]

    def speaker_name(self, row: int) -> str:
        return self.memory_speakers[int(self.memory_idx[row])][int(self.speaker_id[row])]

    def memory_rows(self, memory_idx: int, live: bool = True) -> np.ndarray:
        """Rows of one memory in conversation order."""
        rows = self.columns.rows_of_memory[memory_idx].view.copy()
        return rows[~self.deleted[rows]] if live else rows

    def text_bytes(self, memory_id: str) -> int:
        """UTF-8 bytes of a memory's episode texts, deleted turns included (until compaction drops them)."""
        return int(self.columns.text.sizes(self.memory_rows(self.memory_of(memory_id), live=False)).sum())

    def memory_of(self, memory_id: str) -> int:
        try:
            return self.columns.memory_index[memory_id]
        except KeyError:
            raise KeyError(f"EpisodeStore: no memory {memory_id!r} (have {len(self.memory_ids)})") from None

    def row_of(self, memory_id: str, turn_id: str) -> int:
        """The live row of a turn. Unknown or ambiguous turn ids are errors that name both ids."""
        index = self.columns.turn_rows(self.memory_of(memory_id))
        rows = [r for r in index.get(turn_id, []) if not self.deleted[r]]
        if not rows:
            raise KeyError(f"EpisodeStore: memory {memory_id!r} has no live turn {turn_id!r}")
        if len(rows) > 1:
            raise KeyError(f"EpisodeStore: memory {memory_id!r} has {len(rows)} live turns with id {turn_id!r} (rows {rows})")
        return rows[0]

    # ------------------------------------------------------------------ record application (metadata)
    def _apply_all(self, records: Iterable[dict[str, Any]]) -> int:
        """Apply records to the columns (StoreColumns.apply_all); returns how many there were."""
        return self.columns.apply_all(records, self._where())

    def _where(self) -> str:
        return str(self._log.path) if self._log is not None else "EpisodeStore"

    # ------------------------------------------------------------------ index application
    @staticmethod
    def _texts_to_encode(records: list[dict[str, Any]]) -> list[str]:
        return [r["text"] for r in records if r.get("t") in ("episode", "summary")]

    def _encode_records(self, records: list[dict[str, Any]], progress: bool = False) -> torch.Tensor:
        started = time.perf_counter()
        embeddings = self._encode(self._texts_to_encode(records), progress)
        # summed over a batch's chunks, as the other stages' seconds are (memfit profile's encode rate)
        self.last_timings["encode_s"] = self.last_timings.get("encode_s", 0.0) + time.perf_counter() - started
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

    # ------------------------------------------------------------------ write batches
    def _commit(
        self, records: list[dict[str, Any]], progress: bool = False, snapshot: bool = True,
        embeddings: torch.Tensor | None = None, index: bool = True,
    ) -> None:
        """One write batch in one chunk: encode (unless `embeddings` are given), then log, then apply to the
        metadata and the indexes, then (persistent stores) snapshot.

        The batch is checked first (`StoreColumns.check`) and encoding comes next: if either fails (a memory
        past its speakers, out of memory, a bad text) nothing was logged or applied. A failure after the
        log append (applying or indexing) drops the batch from a persistent store's log and reopens the
        store, so the log never keeps a batch its store did not take, and row numbers stay unique.
        index=False (turns only, append_turns): logged and applied to the metadata; encoding and indexing
        wait for index_pending."""
        self._check_writable()
        batch_start = len(self._log) if self._log is not None else 0
        try:
            if not index:
                self.columns.check(records)
                if self._log is not None:
                    self._log.append([*records, *([{"t": "commit", "records": len(records)}] if self._commits else [])])
                self._apply_all(records)
                self._unindexed.extend(records)
                self.generation = next(GENERATIONS)
            else:
                self._write_chunk(records, embeddings, progress, commit=len(records))
        except BaseException:
            if self._log is not None and len(self._log) > batch_start:
                self._undo_batch(batch_start)
            raise
        if snapshot:
            self._end_batch(None, snapshot)

    def _write_chunk(self, records: list[dict[str, Any]], embeddings: torch.Tensor | None, progress: bool,
                     commit: int | None = None) -> None:
        """Encode (unless given), log, apply to the metadata, index: one chunk of a batch. commit: the
        batch's record count when this is its last chunk (its commit record goes in the same write)."""
        self.index_pending()  # turns logged before this batch are indexed first: index order is log order
        self.columns.check(records)
        if embeddings is None:
            embeddings = self._encode_records(records, progress)
        else:
            self.last_timings.setdefault("encode_s", 0.0)
        started = time.perf_counter()
        if self._log is not None:
            closing = [{"t": "commit", "records": commit}] if commit is not None and self._commits else []
            self._log.append([*records, *closing])
        logged = time.perf_counter()
        self._apply_all(records)
        applied = time.perf_counter()
        self._index_records(records, embeddings)
        self.generation = next(GENERATIONS)
        for key, seconds in (("log_s", logged - started), ("metadata_s", applied - logged)):
            self.last_timings[key] = self.last_timings.get(key, 0.0) + seconds

    def _end_batch(self, count: int | None, snapshot: bool = True) -> None:
        """The commit record of a batch of `count` records (format-2 logs; None: written with its last
        chunk), then the snapshot. The batch is stored once its commit is logged: a snapshot that fails then
        (a full disk) is logged, not raised, so that no caller takes a stored batch for a failed one (and
        writes it again); the next open replays the log past the last snapshot."""
        if self._log is not None and self._commits and count is not None:
            self._log.append([{"t": "commit", "records": count}])
        if snapshot:
            t0 = time.perf_counter()
            try:
                self.snapshot()
            except Exception:  # noqa: BLE001
                log.exception("EpisodeStore: %s: the batch is stored, but its snapshot failed (opening replays the "
                              "log past the last snapshot)", self.path)
            self.last_timings["snapshot_s"] = self.last_timings.get("snapshot_s", 0.0) + time.perf_counter() - t0

    def add_memories(self, memories: Iterable[Memory], progress: bool = True, precomputed: bool = False) -> np.ndarray:
        """Store whole memories (a benchmark) as one write batch, in chunks of about store.write_budget_mb:
        one encoder pass per chunk (one in all when everything fits). `memories` may be any iterable (a
        generator streams LongMemEval-M: only the current chunk's memories are held).

        A memory id already in the store gets the turns appended. precomputed: take each memory's vectors
        from `memory.extra["embeddings"]` [turns, dim] instead of encoding. Returns the new episode rows.

        A failure while writing a later chunk leaves nothing of the batch: a persistent store drops the
        batch's records from its log and reopens itself (then raises); an in-memory store keeps the chunks
        written before the failure (logged at ERROR)."""
        self._check_writable()
        started = time.perf_counter()
        self.last_timings = {}
        first = self.size
        batch_start = len(self._log) if self._log is not None else 0
        count = chunks = 0
        committed = False
        try:
            for records, embeddings, last in batch_chunks(self.columns, memories, precomputed, self.dim,
                                                          self.cfg.store.write_budget_mb):
                count += len(records)
                self._write_chunk(records, embeddings, progress, commit=count if last else None)
                committed = last
                chunks += 1
        except BaseException:
            if chunks:
                self._undo_batch(batch_start)
            raise
        if count:
            self._end_batch(None if committed else count)
        self.last_timings["chunks"] = chunks
        self.last_timings["total_s"] = time.perf_counter() - started
        log.info(
            "EpisodeStore: stored %d episodes in %d chunk(s) in %.1f s (%s)",
            self.size - first, chunks, self.last_timings["total_s"],
            ", ".join(f"{k} {v:.2f}" for k, v in self.last_timings.items() if k not in ("total_s", "chunks")),
        )
        return np.arange(first, self.size, dtype=np.int64)

    def _check_writable(self) -> None:
        if self.read_only:
            raise StoreClosedError(f"{self.path}: the store was opened to read only: nothing was written")
        if self.path is not None and self._log is None:
            raise StoreClosedError(f"{self.path}: the store is closed (or a compaction that failed half-way closed "
                                   "its log): nothing was written. Open it again (opening finishes or undoes that "
                                   "compaction)")

    def _undo_batch(self, batch_start: int) -> None:
        """After a batch failed once part of it was logged: drop its uncommitted records and reload the
        store from disk."""
        if self._log is None:
            log.error("EpisodeStore: a write batch failed after some of its chunks were applied; this in-memory "
                      "store keeps them (%d episodes in all now)", self.size)
            return
        log.error("EpisodeStore: %s: a write batch failed after some of its chunks were logged: dropping them "
                  "and reopening the store", self.path)
        self._log.drop_records(batch_start)
        self._log.close()
        self._log = None
        self.__init__(self.path, self.cfg, self.encoder)  # type: ignore[misc]

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
        records, rows = turn_records(self.columns, turns)
        if records:
            self._commit(records, snapshot=False, index=index)
        return rows

    def live_turns(self, memory_id: str) -> list[int]:
        """The live rows of one memory in conversation order ([] for a memory never stored)."""
        memory = self.columns.memory_index.get(memory_id)
        return [] if memory is None else self.memory_rows(memory).tolist()

    def conversation(self, memory_id: str) -> Memory:
        """One memory's live turns as the data schema's Memory (what a loader yields): its speakers (those of a
        live turn: a deleted turn's speaker is no more named than its words), and its turns in conversation order, each with its id, speaker, own words, timestamp, date text and images
        (caption and id; the store keeps no image paths), in sessions: a new session entry wherever the session
        id changes, so that sessions whose turns interleave come back in that order (one id may then have
        several entries, as the own-data format allows; grouping them reordered the conversation)."""
        rows = self.live_turns(memory_id)
        speaking = {self.speaker_name(row) for row in rows}
        memory = Memory(memory_id, speakers=[s for s in self.memory_speakers[self.memory_of(memory_id)] if s in speaking]
                        if memory_id in self.columns.memory_index else [])
        sessions: list[Session] = []
        for row in rows:
            speaker = self.speaker_name(row)
            text = self.text[row]
            date = text[len("DATE: "):len(text) - len(self.body(row)) - len(f" | Speaker {speaker} says: ")]
            stamp = "" if np.isnat(self.timestamp[row]) else str(self.timestamp[row])
            parts = self.columns.image_parts.get(row)
            exact = split_images(self.body(row), parts) if parts else None
            # a record logged before image_parts: told apart by the ids alone (a caption holding "] " splits early)
            images, said = exact if exact is not None else split_body(self.body(row), self.image_ids[row])
            session_id = self.session_ids[int(self.session_idx[row])]
            if not sessions or sessions[-1].session_id != session_id:
                sessions.append(Session(session_id, date, stamp))
            sessions[-1].turns.append(Turn(str(self.turn_id[row]), speaker, said, stamp, date,
                                           [Image(caption, image_id) for image_id, caption in images]))
        memory.sessions = sessions
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
        plan = self.plan_delete(memory_id, rows)
        if plan.rebuilds and generate is None:
            log.warning(
                "EpisodeStore: deleting %s/%s retires %d summar%s; no generate callable was given, so the "
                "segment is left without one", memory_id, label or f"{len(plan.rows)} turns", len(plan.rebuilds),
                "y" if len(plan.rebuilds) == 1 else "ies",
            )
        rebuilt = summary_records(plan.rebuilds, generate, self.cfg.summary, 0) if generate is not None else []
        return self.commit_delete(plan, rebuilt)

    def plan_delete(self, memory_id: str, rows: Sequence[int]) -> DeletePlan:
        """What deleting these live rows of the memory writes (their tombstones, the retirement of every summary
        covering one) and the summaries to rebuild over the remaining members; nothing is written. KeyError when a
        row is no live turn of the memory. A live memory makes the rebuilt summaries (LLM calls) without holding
        the store, then plans again and commits when the plan is the same (`commit_delete`)."""
        memory = self.memory_of(memory_id)
        rows = sorted(set(int(r) for r in rows))
        foreign = [r for r in rows if int(self.memory_idx[r]) != memory or self.deleted[r]]
        if foreign:
            raise KeyError(f"EpisodeStore: rows {foreign[:5]} are no live turns of memory {memory_id!r}")
        records: list[dict[str, Any]] = [{"t": "delete", "row": row} for row in rows]
        doomed = set(rows)
        affected = [s for s in self.summaries.live_rows(memory) if doomed & set(self.summaries.members[s].tolist())]
        rebuilds: list[SummaryJob] = []
        for summary in affected:
            records.append({"t": "summary_delete", "row": int(summary)})
            remaining = self.summaries.members[summary]
            remaining = remaining[~np.isin(remaining, rows) & ~self.deleted[remaining]]
            rebuilds.append(self.summary_job(memory, remaining, replaces=int(summary)))
        return DeletePlan(memory_id, rows, records, rebuilds)

    def commit_delete(self, plan: DeletePlan, rebuilt: Sequence[dict[str, Any]]) -> dict[str, int]:
        """The plan's records and the summaries rebuilt from its jobs (summaries.summary_records; rows renumbered
        from the table's end) as one committed write batch: the deletion and its rebuilt summaries land together."""
        first = len(self.summaries)
        rebuilt = [{**record, "row": first + i} for i, record in enumerate(rebuilt)]
        self._commit(plan.records + rebuilt)
        return {"episodes": len(plan.rows), "summaries_retired": len(plan.rebuilds), "summaries_rebuilt": len(rebuilt)}

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

    def summarised_through(self) -> np.ndarray:
        """Per memory, the last row any of its live summaries covers (-1: none), from one pass over them."""
        covered = np.full(len(self.memory_ids), -1, dtype=np.int64)
        for s in self.summaries.live_rows():
            members = self.summaries.members[s]
            if len(members):
                m = int(self.summaries.memory_idx.view[s])
                covered[m] = max(int(covered[m]), int(members.max()))
        return covered

    def unsummarised_counts(self, memory_ids: Sequence[str]) -> dict[str, int]:
        """Per memory, its live rows after the last one a live summary covers (what closed_segment_jobs
        segments next): a live memory's open asks it of every user."""
        covered = self.summarised_through()
        indexes = {m: self.memory_of(m) for m in memory_ids}
        return {m: int((self.memory_rows(i) > covered[i]).sum()) for m, i in indexes.items()}

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
        covered = self.summarised_through()
        for memory in wanted:
            live = self.memory_rows(memory)
            tail = live[live > covered[memory]]
            room = self.cfg.summary.max_summaries - len(self.summaries.live_rows(memory))
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
            if (self.memory_idx[members] != memory).any():  # planned over rows since renumbered: never another's
                raise ValueError(f"summary record of memory {memory} names rows of another memory: "
                                 f"{members.tolist()[:10]}")
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

    # ------------------------------------------------------------------ opening (store/replay.py)
    def _load_snapshot(self) -> int:
        """Load the newest snapshot that matches the log and its checksums; returns how many records it covers."""
        assert self._log is not None
        loaded = load_newest(self._snapshot_dir(), self._log, self.dim, ("episode_bm25", "summary_bm25"),
                             ("episode_dense", "summary_dense"), self.cfg.index.dense_device,
                             self.cfg.index.dense_batched_max_rows, self._dense_gpu_id())
        if loaded is None:
            return 0
        self.episode_bm25.load_state_dict(loaded.bm25["episode_bm25"])
        self.summary_bm25.load_state_dict(loaded.bm25["summary_bm25"])
        self.episode_dense, self.summary_dense = loaded.dense["episode_dense"], loaded.dense["summary_dense"]
        log.info("EpisodeStore: loaded snapshot %s (%d records)", loaded.folder, loaded.records)
        return loaded.records

    def _open(self) -> None:
        """Open the store's folder: the log made ready (replay.open_log), the newest good snapshot loaded,
        every record applied to the columns (cheap, no model), the records after the snapshot replayed
        into the indexes, and a new snapshot when there were any, so the next open encodes nothing."""
        assert self.path is not None
        opened = open_log(self.path, self._snapshot_dir(), self.cfg, self.dim, self.read_only)
        self._log, self._commits = opened.log, opened.commits
        if opened.created:
            return
        covered = self._load_snapshot()
        self._snapshot_records = covered
        # the metadata of every record, streamed; the episodes the snapshot covers are counted on the way
        expected = replay_columns(self._log, self.columns, covered, self.path)
        if int(self.episode_bm25.num_rows) != expected or self.episode_dense.size != expected:
            raise ValueError(f"{self._log.path}: snapshot holds {self.episode_dense.size} dense / "
                             f"{self.episode_bm25.num_rows} BM25 rows, the log has {expected} episodes before it")
        tail = len(self._log) - covered
        texts = sum(1 for r in self._log.iter_records(covered) if r.get("t") in ("episode", "summary"))
        if texts:
            log.log(logging.WARNING if covered == 0 else logging.INFO,
                    "EpisodeStore: %s: replaying %d log records after %s (re-encoding %d texts)", self.path,
                    tail, f"the snapshot of record {covered}" if covered else "no usable snapshot", texts)
        for chunk in replay_chunks(self._log, covered, self.dim, self.cfg.store.write_budget_mb):
            self._index_records(chunk)
        if tail and not self.read_only:  # so that the next open loads everything from a snapshot and encodes nothing
            self.snapshot()
        log.info("EpisodeStore: opened %s: %d memories, %d episodes (%d live), %d summaries",
                 self.path, len(self.memory_ids), self.size, int((~self.deleted).sum()), len(self.summaries))

    # ------------------------------------------------------------------ persistence
    def _snapshot_dir(self) -> Path:
        assert self.path is not None
        return self.path / "snapshots"

    def snapshot(self) -> None:
        """Write index state covering every record logged so far (no-op in memory or when current);
        see store/snapshot.py."""
        if self._log is None or len(self._log) == self._snapshot_records or self.read_only:
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

    def memories_with_deleted_turns(self) -> list[str]:
        """The memories some deleted turn of which is still in the log (`compact` removes them)."""
        return [self.memory_ids[m] for m in np.unique(self.memory_idx[self.deleted]).tolist()]

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
        self._check_writable()
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
