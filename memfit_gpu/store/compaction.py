"""Compaction on disk: the records of a store without its deleted turns, and the durable folder swap.

`EpisodeStore.compact` builds the compacted store beside the old one (`compaction_dirs`), makes it
durable (`fsync_tree`), then swaps the two folders with two renames and removes the old one (`swap`).
A kill at any point leaves the old or the new store; the next open calls `finish_compaction`, which
completes or undoes the swap (a kill between the two renames leaves no store folder at all: `interrupted`
tells the store commands there is one to finish). Each step is a kill point (memfit_gpu/faults.py:
compact.built, compact.retired, compact.swapped, compact.removed).
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from memfit_gpu import faults

log = logging.getLogger(__name__)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """Every file and folder under root on disk (before a rename makes it the store)."""
    for folder, _, files in os.walk(root):
        for name in files:
            with open(Path(folder) / name, "rb") as handle:
                os.fsync(handle.fileno())
        fsync_dir(Path(folder))


def rename_durably(source: Path, target: Path) -> None:
    os.rename(source, target)
    fsync_dir(target.parent)


def compaction_dirs(path: Path) -> tuple[Path, Path]:
    """(the compacted store being built, the old store being retired), beside the store folder."""
    return path.parent / f".{path.name}.compact-new", path.parent / f".{path.name}.compact-old"


def interrupted(path: Path) -> bool:
    """Whether a compaction of the store at `path` was killed before it finished (the next open of the
    store completes or undoes it; the store folder itself may be missing)."""
    return any(folder.exists() for folder in compaction_dirs(path))


def swap(path: Path) -> None:
    """Make the durable compacted store the store: two renames, then the old one goes."""
    new, old = compaction_dirs(path)
    rename_durably(path, old)
    faults.point("compact.retired")
    rename_durably(new, path)
    faults.point("compact.swapped")
    shutil.rmtree(old)
    faults.point("compact.removed")


def finish_compaction(path: Path) -> None:
    """Complete or undo a compaction that was killed: compact() builds the new store beside the old one,
    makes it durable, then swaps the two with two renames and removes the old one."""
    new, old = compaction_dirs(path)
    if old.exists() and not path.exists():
        if new.exists():  # killed between the two renames: the new store is complete
            log.warning("%s: completing a compaction that was interrupted between its two renames", path)
            rename_durably(new, path)
        else:
            log.warning("%s: restoring the store from %s (a compaction was interrupted)", path, old)
            rename_durably(old, path)
    if old.exists():  # the swap was done: the old store (with the deleted turns) goes
        log.warning("%s: removing %s left by an interrupted compaction", path, old)
        shutil.rmtree(old)
    if new.exists():  # killed before the swap: the store is the old one, untouched
        log.warning("%s: removing the unfinished compaction %s (the store is unchanged)", path, new)
        shutil.rmtree(new)


def _renumbered(deleted: np.ndarray) -> np.ndarray:
    """Per old row: its number among the rows kept, in order (-1 for a deleted one)."""
    kept = np.flatnonzero(~np.asarray(deleted, dtype=bool))
    new = np.full(len(deleted), -1, dtype=np.int64)
    new[kept] = np.arange(len(kept))
    return new


def compacted_records(
    records: Sequence[dict[str, Any]], episode_deleted: np.ndarray, summary_deleted: np.ndarray
) -> tuple[list[dict[str, Any]], list[tuple[str, int]]]:
    """A log's records without deleted episodes, retired summaries, tombstones, header and commits, and
    without the memories nothing is left of (their id and speakers are a user's data too: an erased user
    leaves no trace), rows and memories renumbered 0.. in the same order.

    Args:
        records: the log's records, in order.
        episode_deleted: per episode row, whether it is deleted.
        summary_deleted: per summary row, whether it is retired.
    Returns:
        (the records, the (kind, old row) of each episode and summary record among them, in order:
        where its stored vector comes from).
    """
    new_episode, new_summary = _renumbered(episode_deleted), _renumbered(summary_deleted)
    alive: set[int] = set()  # memories with a kept episode or summary
    for record in records:
        kind = record.get("t")
        if (kind == "episode" and new_episode[int(record["row"])] >= 0) or (
                kind == "summary" and new_summary[int(record["row"])] >= 0):
            alive.add(int(record["memory"]))
    new_memory = {old: new for new, old in enumerate(sorted(alive))}
    kept: list[dict[str, Any]] = []
    sources: list[tuple[str, int]] = []
    for record in records:
        kind = record.get("t")
        if kind in ("header", "commit", "delete", "summary_delete"):
            continue
        if kind == "summarised":
            memories = [new_memory[int(m)] for m in record["memories"] if int(m) in new_memory]
            if memories:
                kept.append({**record, "memories": memories})
            continue
        if "memory" in record and int(record["memory"]) not in new_memory:
            continue  # a memory nothing is left of: its memory and speaker records go with it
        moved = {"memory": new_memory[int(record["memory"])]} if "memory" in record else {}
        if kind == "episode":
            row = int(record["row"])
            if new_episode[row] < 0:
                continue
            kept.append({**record, **moved, "row": int(new_episode[row])})
            sources.append((kind, row))
        elif kind == "summary":
            row = int(record["row"])
            if new_summary[row] < 0:
                continue
            members = new_episode[np.asarray(record["members"], dtype=np.int64)]
            # a retired summary is gone, so nothing is left for `replaces` to name
            kept.append({**record, **moved, "row": int(new_summary[row]), "members": members[members >= 0].tolist(),
                         "replaces": None})
            sources.append((kind, row))
        else:
            kept.append({**record, **moved})
    return kept, sources
