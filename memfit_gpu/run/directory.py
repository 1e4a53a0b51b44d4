"""A run directory's bookkeeping: one writer at a time, the configuration it started with, the wall time of
each stage.

    with run_lock(out): ...          one process writes a directory at a time (an exclusive lock on DIR/.lock)
    record_config(cfg, out)          DIR/config.yaml written once; a resume with another configuration is refused
    run_config(out)                  that configuration read back (an emptied config.yaml is no default one)
    is_run_directory(path)           config.yaml and something `memfit run` writes (RUN_MARKERS)
    is_memory_folder(path)           a live memory's folder: DIR/store and DIR/.lock, and no run directory
    refuse_foreign(out)              a folder holding a store that is no run directory (a live memory's): refused
    refuse_for_retrieval(out)        `memfit retrieve` writes into no run directory and no live memory's folder
    whole_groups(path, head, key)    growth.jsonl / depths.jsonl without a group a kill cut short
    StageTimer.load(DIR/timings.json)   wall time per stage, accumulated across resumed invocations

What a run directory holds: docs/concepts/design.md "Run directory"; the stages that fill it: pipeline.py.
"""

from __future__ import annotations

import json
import logging
import sys
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

from memfit_gpu import faults
from memfit_gpu.config import MemFitConfig, load_config, to_dict, to_yaml
from memfit_gpu.data.registry import find_spec
from memfit_gpu.data.schema import DataError
from memfit_gpu.files import (
    atomic_write_text,
    read_json_object,
    read_jsonl,
    read_yaml_mapping,
    write_jsonl_atomic,
)
from memfit_gpu.locks import LOCK_FILE, DirectoryBusyError, exclusive, lock_path, lock_wait_s
from memfit_gpu.mappings import flatten
from memfit_gpu.methods.base import StageClock
from memfit_gpu.store.compaction import interrupted

log = logging.getLogger(__name__)


# What `memfit run` writes beside its config.yaml from its first stage on (provenance.json before any store or
# answer), and a live memory never does
RUN_MARKERS = ("timings.json", "provenance.json", "packs.jsonl", "DONE")


class RunError(RuntimeError):
    """A run directory that cannot be resumed as asked."""


def refuse_foreign(out: Path) -> None:
    """RunError when `out` holds a store (DIR/store) but is no run directory (is_run_directory): a live memory's
    folder (Memory.open, `memfit serve --store`), whose users' store and cached replies the run would write into,
    and which Memory.open would then refuse as a run directory. A run writes config.yaml and provenance.json
    before its store, so its own directory, killed anywhere, is never refused; a response cache copied into a
    new directory (to serve a run's calls again) is no store and is used."""
    if (out / "store").exists() and not is_run_directory(out):
        what = "a live memory's folder" if is_memory_folder(out) else "no run directory"
        raise RunError(f"{out} holds a store (store/) but is {what} (a run directory has config.yaml with "
                       "timings.json, provenance.json, packs.jsonl or DONE): a run would write into that store and "
                       "its cache; use a new --out directory")


def refuse_for_retrieval(out: Path) -> None:
    """RunError when `memfit retrieve --out` names a folder a run or a live memory writes: one with config.yaml
    (a run directory, finished or started: its packs.jsonl and provenance.json are the run's, which a resume
    reuses) or a store (a live memory's folder). `memfit retrieve`'s own folder holds neither and is
    overwritten by the next retrieval into it."""
    if (out / "config.yaml").exists() or (out / "store").exists():
        what = ("a live memory's folder (store/ and .lock)" if is_memory_folder(out) else
                "a run directory (config.yaml: a run finished or started there)" if (out / "config.yaml").exists()
                else "a folder holding a store (store/)")
        raise RunError(f"{out} is {what}: `memfit retrieve` would replace its packs.jsonl, diagnostics.json and "
                       "provenance.json; use a new --out directory")


def is_run_directory(path: str | Path) -> bool:
    """Whether `path` is a run directory: its config.yaml and one of RUN_MARKERS, a finished or resumable
    experiment. A config.yaml alone is not one: an operator may keep the config a live memory is served with
    in its folder. The one test of it, for `Memory.open`, `memfit store` and `memfit run`'s --out."""
    folder = Path(path)
    return (folder / "config.yaml").is_file() and any((folder / name).exists() for name in RUN_MARKERS)


def is_memory_folder(path: str | Path) -> bool:
    """Whether `path` is a live memory's folder (Memory.open, `memfit serve --store`): its store in DIR/store
    (or a compaction of it killed between the swap's two renames), its lock DIR/.lock, and no run directory
    (a config.yaml of the operator's own may be there). The one test of it, for `memfit store` and the
    refusals of `memfit run` and `memfit retrieve`."""
    folder = Path(path)
    store = folder / "store"
    return not is_run_directory(folder) and ((store / "log.jsonl").is_file() or interrupted(store)) \
        and (folder / LOCK_FILE).is_file()


@contextmanager
def run_lock(out: Path) -> Iterator[None]:
    """Hold the run directory's lock (memfit_gpu.locks) for the whole run: two processes writing one
    directory would duplicate predictions and interleave the store log."""
    try:
        wait_s = lock_wait_s()
    except ValueError as exc:
        raise RunError(str(exc)) from None
    try:
        with exclusive(lock_path(out), "wait for it to end or use another --out directory", wait_s):
            yield
    except DirectoryBusyError as exc:
        raise RunError(str(exc)) from None


class StageTimer(StageClock):
    """Wall time per stage (methods/base.StageClock: nested stages count once), accumulated across resumed
    invocations in timings.json, which is saved after every stage."""

    def __init__(self, path: Path, seconds: dict[str, float] | None = None) -> None:
        super().__init__(seconds, ended=lambda clock: self._save())
        self.path = path

    @classmethod
    def load(cls, path: Path) -> StageTimer:
        """The stage times of earlier invocations; RunError for a file memfit did not write (damaged)."""
        try:
            seconds = read_json_object(path, numbers=True) if path.exists() else {}
        except DataError as exc:  # not JSON, not UTF-8, not {stage: seconds}
            raise RunError(f"{exc}: not the stage times memfit writes; delete it to resume (only the earlier "
                           "invocations' stage times are lost, no result)") from None
        return cls(path, {k: float(v) for k, v in seconds.items()})

    def _save(self) -> None:
        if sys.exc_info()[0] is not None:
            # the stage failed: its own failure is what the user must see, not a second one (a full disk) here
            try:
                atomic_write_text(self.path, json.dumps(self.seconds, indent=2))
            except OSError as exc:
                log.warning("%s not updated: %s", self.path, exc)
            return
        atomic_write_text(self.path, json.dumps(self.seconds, indent=2))
        faults.point("timings")


def whole_groups(path: Path, head: str, key: str) -> list[dict[str, Any]]:
    """The rows of an append-only file of groups (growth.jsonl's points, depths.jsonl's depths), each appended in
    one write: a row {"t": head, key: ..., "questions": n}, then n rows {"t": "question", key: ...}. A group that
    a killed writer or a full disk cut short (its torn last line dropped by read_jsonl: fewer rows than its head
    says, or rows without their head) is taken out of the file, rewritten whole, so that it is made again rather
    than counted as done over fewer questions."""
    rows = read_jsonl(path)
    for number, row in enumerate(rows, 1):
        if not isinstance(row, dict) or (row.get("t") in (head, "question") and key not in row) or (
                row.get("t") == head and not isinstance(row.get("questions"), int)):
            raise DataError(str(path), f"row {number}", key, "not a row memfit writes (an object naming its "
                            f"{key}): the file is damaged; delete it to make every {head} again")
    heads = {row[key]: row["questions"] for row in rows if row.get("t") == head}
    found = Counter(row[key] for row in rows if row.get("t") == "question")
    cut = sorted({k for k, n in heads.items() if found.get(k, 0) != n} | {k for k in found if k not in heads})
    if cut:
        log.warning("%s: %s %s cut short by a killed run or a full disk (fewer rows than it counts): made again",
                    path, key, ", ".join(map(str, cut)))
        rows = [row for row in rows if row.get(key) not in cut]
        write_jsonl_atomic(path, rows)
        faults.point(f"{path.name}.whole")
    return rows


def run_config(out: Path, overrides: Sequence[str] = ()) -> MemFitConfig:
    """The configuration a run directory was started with (its config.yaml, which record_config writes whole,
    every section): DataError naming the file when it is not a YAML mapping (emptied or damaged), which
    load_config alone would read as the defaults."""
    read_yaml_mapping(out / "config.yaml")
    return load_config(out / "config.yaml", overrides)


def _selection_as_now(cfg: MemFitConfig) -> MemFitConfig:
    """`cfg` with a category selection that names exactly what the benchmark leaves unevaluated written
    as today's default: `data.exclude_categories: ['5']`, the default of an older memfit, selects on
    LoCoMo what null (the benchmark's evaluated set) selects, so a run it started resumes."""
    data, spec = cfg.data, find_spec(cfg.data.benchmark)
    if (data.include_categories is None and data.exclude_categories is not None and spec is not None
            and spec.not_evaluated and {str(c) for c in data.exclude_categories} == set(spec.not_evaluated)):
        return replace(cfg, data=replace(data, exclude_categories=None))
    return cfg


def _what_not_where(cfg: MemFitConfig) -> MemFitConfig:
    """`cfg` without the keys that say where its inputs lie (provenance.WHERE's, in the config): the data's
    path and the servers' URLs. A requeued SLURM task that finds the data or a judge at another path (a
    sweep pins data.path where each task finds it) resumes the same run; provenance.json compares what the
    inputs hold (the data files' sha256, the models), and refuses a resume where that differs."""
    return replace(cfg, data=replace(cfg.data, path=None), reader=replace(cfg.reader, base_urls=[]),
                   eval=replace(cfg.eval, judge=replace(cfg.eval.judge, base_urls=[])))


def record_config(cfg: MemFitConfig, out: Path) -> None:
    """A resumed run must have the configuration it started with: anything else mixes two runs (where its
    inputs lie aside: `_what_not_where`)."""
    resolved = out / "config.yaml"
    text = to_yaml(cfg)
    if not resolved.exists():
        atomic_write_text(resolved, text)
        faults.point("config")
        return
    before, now = _what_not_where(run_config(out)), _what_not_where(cfg)
    if _selection_as_now(before) != _selection_as_now(now):
        flat_a, flat_b = flatten(to_dict(before)), flatten(to_dict(now))
        diff = sorted(k for k in flat_a.keys() | flat_b.keys() if flat_a.get(k) != flat_b.get(k))
        raise RunError(
            f"{out} was started with a different configuration ({', '.join(diff[:8])}"
            f"{' ...' if len(diff) > 8 else ''}); use a new --out directory for a different configuration"
        )
