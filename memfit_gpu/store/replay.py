"""Opening an EpisodeStore's folder: the log's committed batches, and the replay of its records.

Opening (EpisodeStore._open, store/episodes.py) finishes or undoes a killed compaction, drops a torn
tail and any batch without its commit record (format 2 logs: `open_log`), loads the newest snapshot that
matches the log and its checksums, applies every record to the store's columns (`replay_columns`:
cheap, no model), replays into the indexes only the records after the snapshot (`replay_chunks`: in
chunks of store.write_budget_mb, encoding just those texts) and snapshots again, so the next open
encodes nothing. Any other damage to the log is a StoreCorruptError naming the file, record and byte.
Every function here takes what it reads (the log, the columns) as arguments.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memfit_gpu.config import MemFitConfig
from memfit_gpu.data.schema import DataError
from memfit_gpu.store import compaction
from memfit_gpu.store.columns import RecordRefused, StoreColumns
from memfit_gpu.store.log import RecordLog, StoreCorruptError
from memfit_gpu.store.snapshot import clear_staging, widest_snapshot
from memfit_gpu.store.write_path import chunk_cost

log = logging.getLogger("memfit_gpu.store.episodes")

LOG_FORMAT = 2  # 2: every write batch ends with a commit record; 1 (older stores): no commit records


class StoreRecordError(DataError):
    """A committed log record the store cannot apply (replay stops: CLI exit 2; `memfit store repair`)."""


@dataclass
class OpenedLog:
    log: RecordLog
    commits: bool  # end each logged batch with a commit record (False for format-1 logs)
    created: bool  # a new log: its header is all it holds


def committed_records(record_log: RecordLog) -> int:
    """How many records of a format-2 log belong to committed batches (the header is its own batch)."""
    committed = start = 1
    for number, record in enumerate(record_log.iter_records(1), 1):
        if record.get("t") != "commit":
            continue
        if record.get("records") != number - start:
            raise StoreCorruptError(
                str(record_log.path), f"record {number + 1}", "records",
                f"a commit of {record.get('records')} records follows {number - start} records since the "
                f"previous commit: the log's batches do not add up; the file was left unmodified",
            )
        committed = start = number + 1
    return committed


def open_log(path: Path, snapshots: Path, cfg: MemFitConfig, dim: int, read_only: bool = False) -> OpenedLog:
    """The store folder's log, made ready to replay: a killed compaction finished or undone, a killed
    snapshot's staging folder removed, a new log given its header, an old one's header checked against
    the encoder and its uncommitted last batch dropped whole.

    read_only: change no byte of the folder (`memfit retrieve --store`, whose store is another's); what an
    open to write would mend (a compaction or a batch a killed writer left, a log a snapshot outruns) is then
    a StoreCorruptError saying what to run, never dropped."""
    if read_only:
        return _open_to_read(path, snapshots, cfg, dim)
    compaction.finish_compaction(path)
    path.mkdir(parents=True, exist_ok=True)
    clear_staging(snapshots)  # a snapshot interrupted while being written
    log_path = path / "log.jsonl"
    if (not log_path.exists() or not log_path.stat().st_size) and snapshots.is_dir() \
            and any(p.name.isdigit() for p in snapshots.iterdir()):
        # a store with snapshots of its records has a log: without it the store would open empty
        raise StoreCorruptError(str(log_path), None, None,
                                "missing or empty, while snapshots/ holds snapshots of its records: the store's log "
                                "was moved or deleted (one named log.jsonl.before-repair-* is the log as it was before "
                                "a repair: rename it back); nothing was opened or written")
    record_log = RecordLog(log_path, fsync=cfg.store.fsync)
    if not len(record_log):
        record_log.append([{"t": "header", "format": LOG_FORMAT, "encoder": cfg.index.encoder, "dim": dim}])
        return OpenedLog(record_log, commits=True, created=True)
    commits = _checked_header(record_log, cfg, dim)
    committed = committed_records(record_log) if commits else len(record_log)
    widest = widest_snapshot(snapshots) if cfg.store.fsync else None
    if widest is not None and widest[0] > committed:
        # a snapshot is written after the records it covers were committed, and an fsynced log (store.fsync: every
        # live memory's) keeps what it committed through any crash: the log lost acknowledged records to an outside
        # hand (cut short, an older copy put back). Opening would serve a smaller memory, and the next snapshots
        # would prune the only trace of the loss. (Without fsync, an OS crash may lose the log's last writes and
        # keep a later snapshot: that snapshot is skipped and a benchmark build writes them again.)
        raise StoreCorruptError(str(log_path), None, None, _outrun(committed, widest))
    if commits:
        if committed < len(record_log):
            log.warning("%s: the last %d records are a write batch that was never committed (its writer was "
                        "killed): dropping them whole", record_log.path, len(record_log) - committed)
            record_log.drop_records(committed)
    return OpenedLog(record_log, commits=commits, created=False)


def _outrun(committed: int, widest: tuple[int, Path]) -> str:
    return (f"holds {committed} committed records, while {widest[1]} (its checksums intact) covers {widest[0]}: "
            "records the store had acknowledged are missing from the log (it was cut short or replaced by an older "
            "copy); nothing was opened or dropped. Put the whole log back; to open the store as the log now stands, "
            "losing those records, remove the snapshots that cover more than it holds")


def _checked_header(record_log: RecordLog, cfg: MemFitConfig, dim: int) -> bool:
    """The log's header checked against this memfit and the encoder; whether its batches end in commits."""
    header = next(record_log.iter_records(0, 1))
    if header.get("t") != "header":
        raise ValueError(f"{record_log.path}: first record is not a store header")
    if header.get("format") not in (1, LOG_FORMAT):
        raise DataError(str(record_log.path), "record 1", "format",
                        f"store format {header.get('format')!r}; this memfit_gpu reads formats 1 and {LOG_FORMAT}")
    if header.get("dim") != dim:
        raise ValueError(f"{record_log.path}: store was built with {header.get('dim')}-d embeddings "
                         f"({header.get('encoder')}), the encoder gives {dim}-d")
    if header.get("encoder") != cfg.index.encoder:
        log.warning("%s: built with encoder %s, opened with %s", record_log.path, header.get("encoder"), cfg.index.encoder)
    return header.get("format") == LOG_FORMAT


def _open_to_read(path: Path, snapshots: Path, cfg: MemFitConfig, dim: int) -> OpenedLog:
    """open_log(read_only=True): the log as it stands, refused where an open to write would change it."""
    log_path = path / "log.jsonl"
    mend = f"open it to write once (`memfit store repair {path}` shows and mends what is left), then read it"
    if not log_path.is_file() or not log_path.stat().st_size:
        raise StoreCorruptError(str(log_path), None, None,
                                "a compaction of this store was interrupted mid-swap: " + mend
                                if compaction.interrupted(path)
                                else "no store log there: not a store (or not built yet); nothing was read")
    record_log = RecordLog(log_path, read_only=True)
    commits = _checked_header(record_log, cfg, dim)
    committed = committed_records(record_log) if commits else len(record_log)
    widest = widest_snapshot(snapshots) if cfg.store.fsync else None
    if widest is not None and widest[0] > committed:  # first, as an open to write refuses it (open_log says why)
        raise StoreCorruptError(str(log_path), None, None, _outrun(committed, widest))
    if committed < len(record_log):
        raise StoreCorruptError(str(log_path), None, None,
                                f"the last {len(record_log) - committed} records are a write batch that was never "
                                "committed (its writer was killed or is writing it now, or the log was cut short); "
                                f"opened to read only, nothing was dropped: {mend}")
    return OpenedLog(record_log, commits=commits, created=False)


def replay_columns(record_log: RecordLog, columns: StoreColumns, covered: int, store: Path) -> int:
    """Apply every record of the log to `columns` (streamed); returns how many episodes the first
    `covered` records (a snapshot's) hold. A record the columns refuse is a StoreRecordError."""
    expected = 0

    def counted(records: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        nonlocal expected
        for number, record in enumerate(records):
            if number < covered and record.get("t") == "episode":
                expected += 1
            yield record

    try:
        columns.apply_all(counted(record_log.iter_records()), str(record_log.path))
    except RecordRefused as exc:
        raise StoreRecordError(
            str(record_log.path), f"record {exc.position + 1} ({exc.kind})", None,
            f"{exc.reason}; the log holds a record this store cannot take (written by an older memfit_gpu, "
            f"which logged a write batch before checking it): `memfit store repair {store}` drops the "
            "batches that hold such records (keeping a copy of the old log and of what it drops)") from None
    return expected


def replay_chunks(record_log: RecordLog, start: int, dim: int, budget_mb: float) -> Iterator[list[dict[str, Any]]]:
    """The log's records from `start` on, in chunks of about `budget_mb` (one chunk, so one encoder pass,
    when they fit)."""
    budget = budget_mb * (1 << 20)
    chunk: list[dict[str, Any]] = []
    used = 0
    for record in record_log.iter_records(start):
        chunk.append(record)
        if "text" in record:
            used += chunk_cost(record, dim)
            if used >= budget:
                yield chunk
                chunk, used = [], 0
    if chunk:
        yield chunk
