"""`OUT/sweep.json`: the points of a sweep, their overrides, every start (job) and each point's state.

The file is rewritten (atomically) on every change and read back by a later sweep command, by
`memfit aggregate` and by the paper's tables. A point's state is a `PointState`; the jobs keep the
scheduler's own word for each start (squeue's `PENDING`, `RUNNING`, ..., or `COMPLETED`,
`FAILED(rc=N)`, `CANCELLED` for a local process). DONE files in the point directories are the truth:
a point with `OUT/points/<id>/DONE` is done whatever the file says.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from memfit_gpu import faults
from memfit_gpu.files import write_json_atomic
from memfit_gpu.locks import held, lock_path
from memfit_gpu.sweep.spec import SweepError, SweepPoint, SweepSpec, point_overrides

log = logging.getLogger(__name__)

# memfit's exit code for a configuration or data error: a retry would fail the same way
USAGE_ERROR_RC = 2


class PointState(str, Enum):
    """Where a point stands (`state` of a point in sweep.json)."""

    PENDING = "pending"  # never started
    RUNNING = "running"  # a process or SLURM task works on it (or did when the file was last written)
    RETRY = "retry"  # stopped without DONE, to be started again by this sweep command
    INTERRUPTED = "interrupted"  # stopped with the sweep (Ctrl-C, SIGTERM) or left by an earlier command
    DONE = "done"  # OUT/points/<id>/DONE exists
    FAILED = "failed"  # stopped without DONE and no retry left
    ERROR = "error"  # exit code 2: the point's configuration or data is wrong; not retried
    BUSY = "busy"  # refused because another process is running the point (its directory is locked)


@dataclass
class JobRecord:
    """One start of a point: a local process (`local:<pid>`) or a SLURM array task (`<array>_<index>`)."""

    job_id: str
    state: str  # the scheduler's word, see the module docstring
    attempt: int
    log: str
    status: str | None = None  # SLURM: the file where the task writes its command's exit code

    @property
    def local(self) -> bool:
        return self.job_id.startswith("local:")

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        if self.status is None and self.local:
            del data["status"]  # local starts have no status file (their exit code is the process's)
        return data


@dataclass
class PointRecord:
    point_id: str
    overrides: dict[str, Any]
    dir: str
    args: list[str] = field(default_factory=list)  # the point's dot-list overrides
    attempts: int = 0  # starts over every sweep command
    jobs: list[JobRecord] = field(default_factory=list)
    state: PointState = PointState.PENDING

    @property
    def last_job(self) -> JobRecord | None:
        return self.jobs[-1] if self.jobs else None

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.point_id, "overrides": self.overrides, "dir": self.dir, "args": self.args,
                "attempts": self.attempts, "jobs": [j.to_dict() for j in self.jobs], "state": self.state.value}


@dataclass
class Submission:
    """One SLURM job array: its id and the points it runs, in array index order."""

    array_job_id: str
    points: list[str]
    time: str


@dataclass
class SweepRecord:
    """What a sweep.json holds that is read back (the rest is rewritten from the sweep file)."""

    path: Path
    name: str | None
    sweep_keys: list[str]
    points: list[PointRecord]
    submissions: list[Submission]


_REQUIRED = object()


def _field(data: dict[str, Any], key: str, kind: type | tuple[type, ...], default: Any, where: str) -> Any:
    if key not in data and default is _REQUIRED:
        raise SweepError(f"{where}: field {key!r} missing")
    value = data.get(key, default)
    if not isinstance(value, kind):
        raise SweepError(f"{where}: field {key!r} is {type(value).__name__}, expected {_type_names(kind)}")
    return value


def _type_names(kind: type | tuple[type, ...]) -> str:
    return " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))


def _job(data: Any, where: str) -> JobRecord:
    if not isinstance(data, dict):
        raise SweepError(f"{where}: expected an object, got {type(data).__name__}")
    return JobRecord(_field(data, "job_id", str, _REQUIRED, where), _field(data, "state", str, _REQUIRED, where),
                     _field(data, "attempt", int, 0, where), _field(data, "log", str, "", where),
                     _field(data, "status", (str, type(None)), None, where))


def _point(data: Any, where: str) -> PointRecord:
    if not isinstance(data, dict):
        raise SweepError(f"{where}: expected an object, got {type(data).__name__}")
    point_id = _field(data, "id", str, _REQUIRED, where)
    where = f"{where} (point {point_id})"
    state = _field(data, "state", str, PointState.PENDING.value, where)
    try:
        point_state = PointState(state)
    except ValueError:
        raise SweepError(f"{where}: state {state!r} is not one of {', '.join(s.value for s in PointState)}") from None
    jobs = _field(data, "jobs", list, [], where)
    return PointRecord(point_id, _field(data, "overrides", dict, {}, where), _field(data, "dir", str, "", where),
                       _field(data, "args", list, [], where), _field(data, "attempts", int, 0, where),
                       [_job(j, f"{where} jobs[{i}]") for i, j in enumerate(jobs)], point_state)


def read_sweep_record(path: str | Path) -> SweepRecord:
    """A sweep.json read back; a missing, unreadable or malformed one is a SweepError naming the file,
    the point and the field."""
    path = Path(path)
    if not path.is_file():
        raise SweepError(f"{path.parent}: no sweep.json (not a sweep directory)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SweepError(f"{path}: not valid JSON ({exc}); move it away to start over") from None
    if not isinstance(data, dict):
        raise SweepError(f"{path}: expected a JSON object")
    where = str(path)
    # every sweep has points and SweepState.save writes them all: none is damage (aggregate would print nothing)
    points = [_point(p, f"{path}: points[{i}]") for i, p in enumerate(_field(data, "points", list, _REQUIRED, where))]
    if not points:
        raise SweepError(f"{path}: field 'points' is empty; a sweep.json memfit wrote lists every point of its sweep")
    submissions = []
    for i, item in enumerate(_field(data, "submissions", list, [], where)):
        at = f"{path}: submissions[{i}]"
        if not isinstance(item, dict):
            raise SweepError(f"{at}: expected an object, got {type(item).__name__}")
        submissions.append(Submission(_field(item, "array_job_id", str, _REQUIRED, at), _field(item, "points", list, [], at),
                                      _field(item, "time", str, "", at)))
    return SweepRecord(path, _field(data, "name", (str, type(None)), None, where),
                       _field(data, "sweep_keys", list, [], where), points, submissions)


def point_dir(sweep_dir: str | Path, point_id: str) -> Path:
    """Where a point's run directory is: OUT/points/<id>, always. sweep.json's `dir` records it for the reader
    of the file, but a sweep folder moved or copied (or archived while a new sweep took its old name) must
    read its own points, so every reader of a sweep goes by this, never by the recorded path."""
    return Path(sweep_dir) / "points" / point_id


class SweepState:
    """`OUT/sweep.json` of one sweep command: the points of the sweep file, with the attempts, jobs and
    states an earlier command recorded; rewritten by `save` on every change."""

    def __init__(self, spec: SweepSpec, out_dir: Path, launcher: str):
        self.spec = spec
        self.out_dir = out_dir
        self.path = out_dir / "sweep.json"
        self.launcher = launcher
        self.submissions: list[Submission] = []
        old_points: dict[str, PointRecord] = {}
        self.recorded: frozenset[str] = frozenset()  # the point ids sweep.json listed when read (none: no file)
        if self.path.exists():
            previous = read_sweep_record(self.path)
            if previous.name not in (None, spec.name):
                raise SweepError(
                    f"{self.path}: belongs to sweep {previous.name!r}, not {spec.name!r}; use another --out"
                )
            old_points = {p.point_id: p for p in previous.points}
            self.recorded = frozenset(old_points)
            self.submissions = previous.submissions
        self.points: dict[str, PointRecord] = {}
        for point in spec.points:
            old = old_points.get(point.point_id)
            self.points[point.point_id] = PointRecord(
                point.point_id, point.overrides, str(self.point_dir(point)),
                point_overrides(spec.name, spec.fixed, point),
                attempts=old.attempts if old else 0,
                jobs=old.jobs if old else [],
                state=PointState.DONE if self.is_done(point) else (old.state if old else PointState.PENDING),
            )

    def point_dir(self, point: SweepPoint) -> Path:
        return point_dir(self.out_dir, point.point_id)

    def is_done(self, point: SweepPoint) -> bool:
        return (self.point_dir(point) / "DONE").exists()

    def in_state(self, *states: PointState) -> list[SweepPoint]:
        """The sweep's points whose record is in one of `states`, in sweep order."""
        return [p for p in self.spec.points if self.points[p.point_id].state in states]

    def refresh_done(self) -> int:
        """Marks every point with DONE as done; returns how many are."""
        done = 0
        for point in self.spec.points:
            if self.is_done(point):
                self.points[point.point_id].state = PointState.DONE
                done += 1
        return done

    def save(self) -> None:
        states = [p.state for p in self.points.values()]
        overall = ("done" if all(s is PointState.DONE for s in states)
                   else "running" if PointState.RUNNING in states else "incomplete")
        write_json_atomic(
            self.path,
            {
                "name": self.spec.name,
                "sweep_file": str(self.spec.source),
                "base_config": str(self.spec.config),
                "fixed": self.spec.fixed,
                "launcher": self.launcher,
                "sweep_keys": self.spec.sweep_keys,
                "slurm": asdict(self.spec.slurm),
                "state": overall,
                "updated": time.strftime("%Y-%m-%dT%H:%M:%S"),
                "submissions": [asdict(s) for s in self.submissions],
                "points": [p.to_dict() for p in self.points.values()],
            },
        )
        faults.point("sweep.state")


def state_after_stop(point_id: str, reason: str, rc: int | None, starts: int, retries: int, log_path: str,
                     point_dir: str | Path | None = None) -> PointState:
    """The next state of a point whose process or task stopped without DONE.

    Args:
        reason: what stopped it, for the log (`exit code 1`, `task 7_0 FAILED`).
        rc: the command's exit code, None when unknown (killed before it returned).
        starts: this sweep command's starts of the point so far; `retries`: how many restarts it allows.
        point_dir: the point's run directory, to tell a refused start from the point's own error.

    Returns:
        BUSY (another process runs the point: its start was refused), ERROR (exit code 2: fix the
        config or data), RETRY, or FAILED.
    """
    if rc == USAGE_ERROR_RC and point_dir is not None and held(lock_path(point_dir)):
        log.warning("point %s is being run by another process (its directory is locked); not started here, "
                    "run the sweep again once that run has ended; log: %s", point_id, log_path)
        return PointState.BUSY
    if rc == USAGE_ERROR_RC:
        log.error("point %s: configuration or data error (exit code 2), not retried; log: %s", point_id, log_path)
        return PointState.ERROR
    if starts <= retries:
        log.warning("point %s stopped (%s); starting it again (%d of %d retries); log: %s", point_id, reason,
                    starts, retries, log_path)
        return PointState.RETRY
    log.warning("point %s failed (%s) after %d start(s); log: %s", point_id, reason, starts, log_path)
    return PointState.FAILED
