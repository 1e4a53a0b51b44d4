"""`memfit store repair`: a log whose replay meets a record the store refuses, made openable again.

Since the write path checks every batch before logging it (StoreColumns.check), a log never
holds a record its own replay refuses. A log written by an older memfit_gpu may: a live add whose 64th
speaker was refused after its batch had been logged stayed in the log, so every later open stopped at it
(StoreRecordError). Repair replays the log's committed batches, metadata only (nothing is encoded), and
drops each batch that does not apply, except its `memory` records: the writer had applied those before
the refusal, and later batches name that memory by its number. Every other batch is kept byte for byte.
A refused batch was refused to its caller as a whole, so no acknowledged turn is in it.

Nothing is lost: the old log is kept beside the new one (`log.jsonl.before-repair-<time>`), the dropped
records are written to `dropped-<time>.jsonl`, and snapshots that cover records after the first change
are removed (the next open replays from the last snapshot still valid, re-encoding what follows it).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from memfit_gpu import faults
from memfit_gpu.config import MemFitConfig
from memfit_gpu.files import write_jsonl_atomic
from memfit_gpu.store import compaction
from memfit_gpu.store.columns import RecordRefused
from memfit_gpu.store.compaction import fsync_dir
from memfit_gpu.store.episodes import EpisodeStore
from memfit_gpu.store.log import RecordLog, encode_record
from memfit_gpu.store.replay import LOG_FORMAT

log = logging.getLogger(__name__)


class _NoEncoder:
    """Repair applies metadata only: an encoder that is never asked to encode, of the log's dimension."""

    def __init__(self, dim: int) -> None:
        self.dim = dim

    def encode(self, texts: list[str], **_: Any) -> torch.Tensor:
        raise RuntimeError("store repair encodes nothing")


@dataclass
class RepairReport:
    batches: int = 0
    dropped: list[dict[str, Any]] = field(default_factory=list)  # per dropped batch: first record, reason
    records_dropped: int = 0
    backup: str | None = None
    dropped_file: str | None = None
    snapshots_removed: int = 0
    torn_bytes: int = 0  # a torn last record a killed writer left: cut off (a dry run: left in place)
    uncommitted: int = 0  # records of a last batch without its commit record (a killed writer's): dropped whole

    def to_json(self) -> dict[str, Any]:
        return {"batches": self.batches, "batches_dropped": len(self.dropped), "records_dropped": self.records_dropped,
                "dropped": self.dropped, "backup": self.backup, "dropped_file": self.dropped_file,
                "snapshots_removed": self.snapshots_removed, "torn_bytes": self.torn_bytes,
                "uncommitted": self.uncommitted}


def _batches(records: list[dict[str, Any]], commits: bool) -> list[list[dict[str, Any]]]:
    """The header, then the committed batches (each with its commit record); an uncommitted tail is left
    out (opening drops it too). A format-1 log: one batch per record."""
    out: list[list[dict[str, Any]]] = [records[:1]]
    batch: list[dict[str, Any]] = []
    for record in records[1:]:
        batch.append(record)
        if not commits or record.get("t") == "commit":
            out.append(batch)
            batch = []
    return out


def repair_store(store: str | Path, dry_run: bool = False) -> RepairReport:
    """Repair the log of the store folder `store` (module doc); dry_run: report what would be dropped,
    change nothing. The caller holds the store's lock."""
    store = Path(store)
    path = store / "log.jsonl"
    if not dry_run:  # as any open to write: a killed compaction finished or undone first
        compaction.finish_compaction(store)
    elif not path.is_file() and compaction.interrupted(store):
        raise FileNotFoundError(f"{path}: a compaction of this store was interrupted mid-swap; `memfit store repair` "
                                "without --dry-run finishes it (as any open to write does)")
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no store log there")
    report = RepairReport()
    # a dry run reads the log without touching it (a torn tail stays; opening to write would cut it off)
    source = RecordLog(path, read_only=dry_run)
    records = source.records
    source.close()
    report.torn_bytes = source.dropped_bytes
    if not records or records[0].get("t") != "header":
        raise ValueError(f"{path}: first record is not a store header")
    header = records[0]
    commits = header.get("format") == LOG_FORMAT
    probe_cfg = MemFitConfig()

    def fresh() -> EpisodeStore:
        return EpisodeStore(None, probe_cfg, _NoEncoder(int(header["dim"])))  # type: ignore[arg-type]

    probe = fresh()
    kept: list[list[dict[str, Any]]] = []
    dropped_records: list[dict[str, Any]] = []
    first_change: int | None = None  # records before it are unchanged
    position = 1
    for batch in _batches(records, commits)[1:]:
        report.batches += 1
        body = [r for r in batch if r.get("t") != "commit"]
        try:
            probe._apply_all(body)
            kept.append(batch)
        except RecordRefused as exc:
            first_change = position if first_change is None else first_change
            probe = fresh()
            for earlier in kept:
                probe._apply_all([r for r in earlier if r.get("t") != "commit"])
            salvaged = [r for r in body if r.get("t") == "memory"]
            try:
                probe._apply_all(salvaged)
            except RecordRefused:
                probe = fresh()
                for earlier in kept:
                    probe._apply_all([r for r in earlier if r.get("t") != "commit"])
                salvaged = []
            if salvaged:
                kept.append([*salvaged, *([{"t": "commit", "records": len(salvaged)}] if commits else [])])
            kept_ids = {id(r) for r in salvaged}
            lost = [r for r in batch if id(r) not in kept_ids]
            dropped_records.extend(lost)
            report.records_dropped += sum(1 for r in lost if r.get("t") != "commit")
            report.dropped.append({"log_record": position + exc.position + 1, "reason": exc.reason,
                                   "records": len(body), "kept_memory_records": len(salvaged)})
            log.warning("%s: dropping the batch at record %d (%d records): %s", path, position + 1, len(body), exc.reason)
        position += len(batch)
    report.uncommitted = len(records) - position
    if report.uncommitted:
        # a batch without its commit (a killed writer's, or the log cut short: a snapshot may cover it): what an
        # open to write drops, dropped here through the same rewrite, so its records stay in the dropped file and
        # the old log's backup, and no snapshot past what the log keeps remains
        dropped_records.extend(records[position:])
        first_change = position if first_change is None else first_change
    if dry_run or first_change is None:
        return report
    # Every step leaves a store that opens as the old one or the repaired one, so a kill anywhere is undone by
    # the same command again: the dropped records and the new log beside the old; the snapshots past the first
    # change removed (an index the next open rebuilds from the log), the old log linked to its backup name, then
    # the new log renamed over it in one step (never a moment without a log, which opens as an empty store).
    stamp = time.strftime("%Y%m%dT%H%M%S")
    backup = _unused(store / f"log.jsonl.before-repair-{stamp}")
    dropped_file = _unused(store / f"dropped-{stamp}.jsonl")
    write_jsonl_atomic(dropped_file, dropped_records)
    faults.point("repair.dropped")
    staged = store / "log.jsonl.repair"
    with open(staged, "wb") as handle:
        for record in [header, *(r for batch in kept for r in batch)]:
            handle.write(encode_record(record))
        handle.flush()
        os.fsync(handle.fileno())
    faults.point("repair.staged")
    snapshots = store / "snapshots"
    if snapshots.is_dir():
        for folder in sorted(snapshots.iterdir()):
            if folder.is_dir() and folder.name.isdigit() and int(folder.name) > first_change:
                shutil.rmtree(folder)
                report.snapshots_removed += 1
                faults.point("repair.snapshot")
    try:
        os.link(path, backup)  # the old log whole under its backup name, and still in place
    except OSError:  # a file system without hard links
        shutil.copy2(path, backup)
    fsync_dir(store)
    faults.point("repair.backup")
    os.replace(staged, path)
    fsync_dir(store)
    faults.point("repair.log")
    report.backup, report.dropped_file = str(backup), str(dropped_file)
    return report


def _unused(path: Path) -> Path:
    """`path`, or `path` with -2, -3, ... where a repair killed within the same second left it."""
    candidate, n = path, 1
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.name}-{n}")
    return candidate

