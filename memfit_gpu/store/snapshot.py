"""Index snapshots of a store: write them, and find the newest one that can be trusted.

`snapshots/<records>/` holds the index state after a write batch: each BM25 index's `state_dict` (plain
tensors, lists, dicts and numbers, written with `torch.save` and read back with
`torch.load(weights_only=True)`, so loading never runs pickled code) and each dense index's vectors
(`DenseIndex.save`). `meta.json`, written last, holds the log fingerprint the snapshot covers
(`RecordLog.fingerprint`: records, bytes, CRC32 of those bytes), the sha256 of every file and of
itself. A snapshot is built in a `.staging-*` folder and renamed into place; at most
`KEEP_SNAPSHOTS` are kept.

A snapshot is loaded only when all of it holds: its format, its own digest, a fingerprint that
matches the log, every file's sha256 and BM25 files of plain values. Anything else is reported (at
ERROR where the bytes changed after writing) and the next older snapshot is tried; the store then
replays the log records after whatever it loaded.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from memfit_gpu import faults
from memfit_gpu.data.fetch import sha256_of
from memfit_gpu.files import storage_errors
from memfit_gpu.index.dense import BATCHED_MAX_ROWS, DenseIndex
from memfit_gpu.index.protocols import LexicalIndex
from memfit_gpu.store.log import RecordLog

log = logging.getLogger(__name__)

SNAPSHOT_FORMAT = 2  # 2: meta.json holds the sha256 of every file and of itself
KEEP_SNAPSHOTS = 2


@dataclass(frozen=True)
class Snapshot:
    """A snapshot that passed every check, loaded."""

    folder: Path
    records: int  # log records it covers
    bm25: dict[str, dict[str, Any]]  # name -> BM25 state dict
    dense: dict[str, DenseIndex]  # name -> dense index


def meta_digest(meta: dict[str, Any]) -> str:
    """sha256 of a snapshot's meta.json content without its own `meta_sha256` entry."""
    body = {k: v for k, v in meta.items() if k != "meta_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode("utf-8")).hexdigest()


def _folders(root: Path) -> list[Path]:
    """Finished snapshots, oldest first (staging folders start with a dot)."""
    return sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))


def clear_staging(root: Path) -> None:
    """Remove snapshots whose writer was killed before renaming them into place."""
    if root.exists():
        for staging in root.glob(".staging-*"):
            shutil.rmtree(staging, ignore_errors=True)


def write_snapshot(root: Path, count: int, fingerprint: dict[str, int], info: dict[str, Any],
                   bm25: dict[str, LexicalIndex], dense: dict[str, DenseIndex]) -> None:
    """Write `root/<count>/` covering the first `count` log records, then drop all but the newest
    KEEP_SNAPSHOTS.

    Args:
        fingerprint: `RecordLog.fingerprint(count)`.
        info: more entries for meta.json (sizes, dim).
        bm25, dense: the indexes by file name.
    """
    with storage_errors(root):  # a full disk leaves the staging folder, which the next open clears
        root.mkdir(parents=True, exist_ok=True)
        final = root / f"{count:012d}"
        staging = root / f".staging-{count:012d}-{os.getpid()}"
        if staging.exists():
            shutil.rmtree(staging)
        staging.mkdir()
        for name, index in bm25.items():
            torch.save(index.state_dict(), staging / f"{name}.pt")
        for name, vectors in dense.items():
            vectors.save(staging / name)
        files = {path.relative_to(staging).as_posix(): sha256_of(path) for path in sorted(staging.rglob("*")) if path.is_file()}
        meta = {"format": SNAPSHOT_FORMAT, **fingerprint, **info, "files": files}
        meta["meta_sha256"] = meta_digest(meta)
        faults.io_fault(staging / "meta.json")
        (staging / "meta.json").write_text(json.dumps(meta, indent=1))
        faults.point("store.snapshot.staged")
        if final.exists():
            shutil.rmtree(final)
        os.replace(staging, final)
    faults.point("store.snapshot")
    for old in _folders(root)[:-KEEP_SNAPSHOTS]:
        shutil.rmtree(old, ignore_errors=True)


def _damage(folder: Path, meta: dict[str, Any]) -> str | None:
    """Why a snapshot's files cannot be trusted (None: every checksum holds)."""
    files = meta.get("files")
    if not isinstance(files, dict) or not files:
        return "meta.json lists no file checksums"
    for name, digest in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if sha256_of(path) != digest:
            return f"{name} fails its sha256 (the bytes on disk changed after it was written)"
    return None


def _own_meta(folder: Path, quiet: bool = False) -> dict[str, Any] | None:
    """meta.json of a snapshot as it was written (this format, its own sha256 holding); None (logged why, unless
    `quiet`) otherwise."""
    meta_path = folder / "meta.json"
    if not meta_path.exists():
        return None
    level, why = logging.ERROR, ""
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        meta, why = None, f"{meta_path}: unreadable (corrupted on disk?): snapshot ignored"
    if meta is None and not why:  # meta.json holding `null`
        why = f"{meta_path}: not a JSON object (corrupted on disk?): snapshot ignored"
    elif meta is not None and not isinstance(meta, dict):
        meta, why = None, f"{meta_path}: not a JSON object (corrupted on disk?): snapshot ignored"
    elif meta is not None and meta.get("format") != SNAPSHOT_FORMAT:
        level, why = logging.WARNING, (f"{folder}: snapshot format {meta.get('format')!r} has no checksums (written "
                                       "by an older memfit_gpu): skipped, the indexes are rebuilt from the log")
        meta = None
    elif meta is not None and meta.get("meta_sha256") != meta_digest(meta):
        meta, why = None, f"{meta_path}: fails its own sha256 (corrupted on disk): snapshot ignored, never loaded"
    if meta is None and not quiet:
        log.log(level, "%s", why)
    return meta


def widest_snapshot(root: Path) -> tuple[int, Path] | None:
    """(records, folder) of the snapshot under `root` that covers the most log records, among those whose
    meta.json is as written (its own sha256 holds); None when there is none. A snapshot is written only after
    the records it covers were committed to the log, so a log holding fewer lost records it had acknowledged
    (replay.open_log refuses it)."""
    widest = None
    for folder in _folders(root) if root.is_dir() else []:
        meta = _own_meta(folder, quiet=True)
        count = meta.get("records") if meta is not None else None
        if isinstance(count, int) and not isinstance(count, bool) and (widest is None or count > widest[0]):
            widest = (count, folder)
    return widest


def _checked_meta(folder: Path, record_log: RecordLog) -> dict[str, Any] | None:
    """meta.json of a snapshot that matches the log and its checksums; None (logged why) otherwise."""
    meta = _own_meta(folder)
    if meta is None:
        return None
    count = meta.get("records", -1)
    if not isinstance(count, int) or count < 0 or count > len(record_log) or (
        record_log.fingerprint(count) != {k: meta.get(k) for k in ("records", "bytes", "prefix_crc")}
    ):
        log.warning("%s: covers %s records that do not match the log (%d valid records); skipped",
                    folder, count, len(record_log))
        return None
    damage = _damage(folder, meta)
    if damage is not None:
        log.error("%s: %s: snapshot ignored, never loaded; the indexes come from an older snapshot or are "
                  "rebuilt from the log", folder, damage)
        return None
    return meta


def load_newest(root: Path, record_log: RecordLog, dim: int, bm25_names: tuple[str, ...],
                dense_names: tuple[str, ...], dense_device: str, batched_max_rows: int = BATCHED_MAX_ROWS,
                dense_gpu_id: int = 0
                ) -> Snapshot | None:
    """The newest snapshot under `root` that matches `record_log` and its checksums, loaded; None when
    there is none (the store then rebuilds its indexes from the log).

    Raises ValueError when a trusted snapshot holds vectors of another dimension than `dim`."""
    if not root.exists():
        return None
    for folder in reversed(_folders(root)):
        meta = _checked_meta(folder, record_log)
        if meta is None:
            continue
        if meta.get("dim") != dim:
            raise ValueError(f"{folder / 'meta.json'}: embeddings are {meta.get('dim')}-d, the encoder gives {dim}-d")
        try:
            states = {name: torch.load(folder / f"{name}.pt", weights_only=True) for name in bm25_names}
        except pickle.UnpicklingError:
            # memfit_gpu writes plain values only: a pickled object there was not written by it
            log.error("%s: a BM25 file holds more than tensors and plain values: snapshot ignored, never loaded; "
                      "the indexes come from an older snapshot or are rebuilt from the log", folder)
            continue
        dense = {name: DenseIndex.load(folder / name, device=dense_device, gpu_id=dense_gpu_id,
                                       batched_max_rows=batched_max_rows)
                 for name in dense_names}
        return Snapshot(folder=folder, records=meta["records"], bm25=states, dense=dense)
    return None
