"""EpisodeStore's opening: the log's committed batches, the newest good snapshot, and the replay of the rest.

`LogReplay` is a part of EpisodeStore (store/episodes.py inherits it; it holds no state of its own). Opening
finishes or undoes a killed compaction, drops a torn tail and any batch without its commit record (format
2 logs), loads the newest snapshot that matches the log and its checksums, applies every record to the
metadata columns (cheap, no model), replays into the indexes only the records after the snapshot (in
chunks of store.write_budget_mb, encoding just those texts) and snapshots again, so the next open encodes
nothing. Any other damage to the log is a StoreCorruptError naming the file, record and byte.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from memfit_gpu.data.schema import DataError
from memfit_gpu.store import compaction
from memfit_gpu.store.log import RecordLog, StoreCorruptError
from memfit_gpu.store.snapshot import clear_staging, load_newest

log = logging.getLogger("memfit_gpu.store.episodes")

LOG_FORMAT = 2  # 2: every write batch ends with a commit record; 1 (older stores): no commit records


class RecordRefused(ValueError):
    """A record the store cannot apply (a memory past MAX_SPEAKERS speakers, a row out of order, a memory
    it does not have): `position` is its index among the records being applied, `kind` its type."""

    def __init__(self, position: int, kind: str | None, reason: str) -> None:
        super().__init__(f"record {position + 1} ({kind}): {reason}")
        self.position, self.kind, self.reason = position, kind, reason

    def shifted(self, start: int) -> RecordRefused:
        return RecordRefused(start + self.position, self.kind, self.reason)


class StoreRecordError(DataError):
    """A committed log record the store cannot apply (replay stops: CLI exit 2; `memfit store repair`)."""


class LogReplay:
    """Opening an EpisodeStore from its folder (its attributes: cfg, dim, path, _log, indexes, columns)."""

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

    def _committed_records(self) -> int:
        """How many records of a format-2 log belong to committed batches (the header is its own batch)."""
        assert self._log is not None
        committed = start = 1
        for number, record in enumerate(self._log.iter_records(1), 1):
            if record.get("t") != "commit":
                continue
            if record.get("records") != number - start:
                raise StoreCorruptError(
                    str(self._log.path), f"record {number + 1}", "records",
                    f"a commit of {record.get('records')} records follows {number - start} records since the "
                    f"previous commit: the log's batches do not add up; the file was left unmodified",
                )
            committed = start = number + 1
        return committed

    def _open(self) -> None:
        assert self.path is not None
        compaction.finish_compaction(self.path)
        self.path.mkdir(parents=True, exist_ok=True)
        clear_staging(self._snapshot_dir())  # a snapshot interrupted while being written
        self._log = RecordLog(self.path / "log.jsonl", fsync=self.cfg.store.fsync)
        if not len(self._log):
            self._log.append([{"t": "header", "format": LOG_FORMAT, "encoder": self.cfg.index.encoder, "dim": self.dim}])
            return
        header = next(self._log.iter_records(0, 1))
        if header.get("t") != "header":
            raise ValueError(f"{self._log.path}: first record is not a store header")
        if header.get("format") not in (1, LOG_FORMAT):
            raise DataError(str(self._log.path), "record 1", "format",
                            f"store format {header.get('format')!r}; this memfit_gpu reads formats 1 and {LOG_FORMAT}")
        if header.get("dim") != self.dim:
            raise ValueError(f"{self._log.path}: store was built with {header.get('dim')}-d embeddings "
                             f"({header.get('encoder')}), the encoder gives {self.dim}-d")
        if header.get("encoder") != self.cfg.index.encoder:
            log.warning("%s: built with encoder %s, opened with %s", self._log.path, header.get("encoder"), self.cfg.index.encoder)
        self._commits = header.get("format") == LOG_FORMAT
        if self._commits:
            committed = self._committed_records()
            if committed < len(self._log):
                log.warning("%s: the last %d records are a write batch that was never committed (its writer was "
                            "killed): dropping them whole", self._log.path, len(self._log) - committed)
                self._log.drop_records(committed)
        covered = self._load_snapshot()
        self._snapshot_records = covered
        # the metadata of every record, streamed; the episodes the snapshot covers are counted on the way
        expected = 0

        def counted(records: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
            nonlocal expected
            for number, record in enumerate(records):
                if number < covered and record.get("t") == "episode":
                    expected += 1
                yield record

        try:
            self._apply_all(counted(self._log.iter_records()))
        except RecordRefused as exc:
            raise StoreRecordError(
                str(self._log.path), f"record {exc.position + 1} ({exc.kind})", None,
                f"{exc.reason}; the log holds a record this store cannot take (written by an older memfit_gpu, "
                f"which logged a write batch before checking it): `memfit store repair {self.path}` drops the "
                "batches that hold such records (keeping a copy of the old log and of what it drops)") from None
        if int(self.episode_bm25.num_rows) != expected or self.episode_dense.size != expected:
            raise ValueError(f"{self._log.path}: snapshot holds {self.episode_dense.size} dense / "
                             f"{self.episode_bm25.num_rows} BM25 rows, the log has {expected} episodes before it")
        tail = len(self._log) - covered
        texts = sum(1 for r in self._log.iter_records(covered) if r.get("t") in ("episode", "summary"))
        if texts:
            log.log(logging.WARNING if covered == 0 else logging.INFO,
                    "EpisodeStore: %s: replaying %d log records after %s (re-encoding %d texts)", self.path,
                    tail, f"the snapshot of record {covered}" if covered else "no usable snapshot", texts)
        for chunk in self._replay_chunks(covered):
            self._index_records(chunk)
        if tail:  # so that the next open loads everything from a snapshot and encodes nothing
            self.snapshot()
        log.info("EpisodeStore: opened %s: %d memories, %d episodes (%d live), %d summaries",
                 self.path, len(self.memory_ids), self.size, int((~self.deleted).sum()), len(self.summaries))

    def _replay_chunks(self, start: int) -> Iterator[list[dict[str, Any]]]:
        """The log's records from `start` on, in chunks of about store.write_budget_mb (one chunk, so one
        encoder pass, when they fit)."""
        assert self._log is not None
        budget = self.cfg.store.write_budget_mb * (1 << 20)
        chunk: list[dict[str, Any]] = []
        used = 0
        for record in self._log.iter_records(start):
            chunk.append(record)
            if "text" in record:
                used += self._chunk_cost(record)
                if used >= budget:
                    yield chunk
                    chunk, used = [], 0
        if chunk:
            yield chunk
