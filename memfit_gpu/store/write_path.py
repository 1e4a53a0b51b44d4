"""EpisodeStore's write path: a write batch from records or whole memories, in chunks of store.write_budget_mb.

`WritePath` is a part of EpisodeStore (store/episodes.py inherits it; it holds no state of its own): a
batch is encoded first, then logged, applied to the metadata and indexed chunk by chunk, and closed by one
commit record and a snapshot (`_commit` for a batch of records, `add_memories` for whole memories, which a
generator may stream). Chunking changes nothing stored: the log, the BM25 state and the vectors are the
same bytes as a one-chunk build. A failed later chunk drops the batch's records from a persistent store's
log and reopens it.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from memfit_gpu.data.schema import Memory, Turn
from memfit_gpu.store.text import episode_text

log = logging.getLogger("memfit_gpu.store.episodes")

# What one pending episode costs a write chunk, for store.write_budget_mb: its record (a dict), its text
# (several copies: record, log line, column), its token ids and their sort (per character, tokens being
# shorter than 4 characters on average) and its vector (float32, and the torch copy).
_RECORD_BYTES = 1500
_BYTES_PER_CHAR = 20
_BYTES_PER_DIM = 8
# Each change of a store's content takes the next number as its `generation`: a reader's cached view of
# the store (a live memory's ReadView) is current while the generation it was built at is.
GENERATIONS = itertools.count(1)


class WritePath:
    """Write batches of EpisodeStore (its attributes: cfg, dim, size, _log, _commits, memory_ids, ...)."""

    def _commit(
        self, records: list[dict[str, Any]], progress: bool = False, snapshot: bool = True,
        embeddings: torch.Tensor | None = None, index: bool = True,
    ) -> None:
        """One write batch in one chunk: encode (unless `embeddings` are given), then log, then apply to the
        metadata and the indexes, then (persistent stores) snapshot.

        The batch is checked first (`_check_records`) and encoding comes next: if either fails (a memory
        past its speakers, out of memory, a bad text) nothing was logged or applied. A failure after the
        log append (applying or indexing) drops the batch from a persistent store's log and reopens the
        store, so the log never keeps a batch its store did not take, and row numbers stay unique.
        index=False (turns only, append_turns): logged and applied to the metadata; encoding and indexing
        wait for index_pending."""
        batch_start = len(self._log) if self._log is not None else 0
        try:
            if not index:
                self._check_records(records)
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
        self._check_records(records)
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
        chunk), then the snapshot."""
        if self._log is not None and self._commits and count is not None:
            self._log.append([{"t": "commit", "records": count}])
        if snapshot:
            t0 = time.perf_counter()
            self.snapshot()
            self.last_timings["snapshot_s"] = self.last_timings.get("snapshot_s", 0.0) + time.perf_counter() - t0

    def _memory_records(self, memory_id: str, speakers: Sequence[str], pending: dict[str, int]) -> tuple[int, list[dict[str, Any]]]:
        if memory_id in pending:  # created earlier in this batch (maybe applied already, by an earlier chunk)
            return pending[memory_id], []
        if memory_id in self._memory_index:
            memory = self._memory_index[memory_id]
            known = self._speaker_index[memory]
            return memory, [{"t": "speaker", "memory": memory, "name": name} for name in dict.fromkeys(speakers) if name not in known]
        memory = max(len(self.memory_ids), max(pending.values(), default=-1) + 1)
        pending[memory_id] = memory
        return memory, [{"t": "memory", "memory": memory, "id": memory_id, "speakers": list(dict.fromkeys(speakers))}]

    @staticmethod
    def _episode_record(row: int, memory: int, session_id: str, turn: Turn) -> dict[str, Any]:
        return {
            "t": "episode",
            "row": row,
            "memory": memory,
            "session": session_id,
            "turn": turn.turn_id,
            "speaker": turn.speaker,
            "ts": turn.timestamp,
            "date": turn.date_text,
            "images": [image.image_id for image in turn.images if image.image_id],
            "text": episode_text(turn),
        }

    def _chunk_cost(self, record: dict[str, Any]) -> int:
        return _RECORD_BYTES + _BYTES_PER_CHAR * len(record["text"]) + _BYTES_PER_DIM * self.dim

    def _chunks(self, memories: Iterable[Memory], precomputed: bool
                ) -> Iterator[tuple[list[dict[str, Any]], torch.Tensor | None, bool]]:
        """The batch's records (and precomputed vectors) in chunks of about store.write_budget_mb, built
        lazily: a memory's turns may span chunks; nothing of a later chunk exists before it is asked for.
        The flag marks the chunk known to be the last (the memories ran out while it was being filled)."""
        budget = self.cfg.store.write_budget_mb * (1 << 20)
        pending: dict[str, int] = {}
        row = self.size
        records: list[dict[str, Any]] = []
        vectors: list[np.ndarray] = []
        used = 0

        def cut(last: bool) -> tuple[list[dict[str, Any]], torch.Tensor | None, bool]:
            nonlocal records, vectors, used
            given: torch.Tensor | None = None
            if precomputed:
                given = torch.from_numpy(np.concatenate(vectors)) if vectors else torch.empty((0, self.dim))
            out = records, given, last
            records, vectors, used = [], [], 0
            return out

        for memory in memories:
            memory_idx, created = self._memory_records(memory.memory_id, memory.speakers, pending)
            records.extend(created)
            given = self._precomputed(memory) if precomputed else None
            taken = 0  # turns of this memory whose vectors are in `vectors`
            position = 0
            for session in memory.sessions:
                for turn in session.turns:
                    record = self._episode_record(row, memory_idx, session.session_id, turn)
                    records.append(record)
                    row += 1
                    position += 1
                    used += self._chunk_cost(record)
                    if used >= budget:
                        if given is not None:
                            vectors.append(given[taken:position])
                            taken = position
                        yield cut(False)
            if given is not None and taken < position:
                vectors.append(given[taken:position])
        if records:
            yield cut(True)

    def _precomputed(self, memory: Memory) -> np.ndarray:
        vectors = memory.extra.get("embeddings")
        turns = sum(len(s.turns) for s in memory.sessions)
        if vectors is None:
            raise ValueError(f"EpisodeStore.add_memories(precomputed=True): memory {memory.memory_id!r} has no "
                             f"extra['embeddings'] (memfit_gpu.data.synth writes them with embedding_dim)")
        vectors = np.asarray(vectors, dtype=np.float32)
        if vectors.shape != (turns, self.dim):
            raise ValueError(f"EpisodeStore.add_memories(precomputed=True): memory {memory.memory_id!r} has "
                             f"embeddings of shape {vectors.shape}, expected ({turns}, {self.dim})")
        return vectors

    def add_memories(self, memories: Iterable[Memory], progress: bool = True, precomputed: bool = False) -> np.ndarray:
        """Store whole memories (a benchmark) as one write batch, in chunks of about store.write_budget_mb:
        one encoder pass per chunk (one in all when everything fits). `memories` may be any iterable (a
        generator streams LongMemEval-M: only the current chunk's memories are held).

        A memory id already in the store gets the turns appended. precomputed: take each memory's vectors
        from `memory.extra["embeddings"]` [turns, dim] instead of encoding. Returns the new episode rows.

        A failure while writing a later chunk leaves nothing of the batch: a persistent store drops the
        batch's records from its log and reopens itself (then raises); an in-memory store keeps the chunks
        written before the failure (logged at ERROR)."""
        started = time.perf_counter()
        self.last_timings = {}
        first = self.size
        batch_start = len(self._log) if self._log is not None else 0
        count = chunks = 0
        committed = False
        try:
            for records, embeddings, last in self._chunks(memories, precomputed):
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
