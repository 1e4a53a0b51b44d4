"""`memfit sweep`: run every unfinished point of a sweep, locally or on SLURM; or one point (`--point`).

Each point is a run directory `OUT/points/<id>/` produced by `memfit run --config BASE --out POINT_DIR
key=value ...`. `memfit run` resumes and writes `DONE` last, so the sweep's whole fault story is: a
point with `DONE` is skipped; any other point is (re)started and continues where it stopped.
`OUT/sweep.json` (state.py) records the points, their overrides, every job id and state.
"""

from __future__ import annotations

import logging
import shlex
import subprocess
from collections.abc import Callable
from pathlib import Path

from memfit_gpu.config import MemFitConfig, load_config
from memfit_gpu.sweep.local import run_local
from memfit_gpu.sweep.slurm import attach_active, check_slurm_gpus, submit_slurm, wait_slurm
from memfit_gpu.sweep.spec import (
    SweepError,
    SweepPoint,
    SweepSpec,
    find_point,
    pin_data_location,
    point_command,
    point_overrides,
)
from memfit_gpu.sweep.state import PointState, SweepState

log = logging.getLogger(__name__)

# (config a point would run now, its run directory) -> None, or SweepError saying how they differ
SameConfig = Callable[[MemFitConfig, Path], None]

LAUNCHERS = ("local", "slurm")


def refuse_changed_finished(state: SweepState, same_config: SameConfig,
                            points: list[SweepPoint] | None = None) -> None:
    """A finished point (DONE) whose run directory's config.yaml is not what the point would run now (an
    override or the sweep file changed) is refused, as `memfit run` refuses such a resume: the sweep would
    report it DONE and record arguments its results never ran with. `same_config(cfg, point_dir)` raises
    SweepError when they differ (the caller's: `memfit sweep` passes run.directory's comparison). A point
    directory without config.yaml (a sweep `command:` other than `memfit run`) has nothing to compare."""
    for point in state.spec.points if points is None else points:
        point_dir = state.point_dir(point)
        if not state.is_done(point) or not (point_dir / "config.yaml").is_file():
            continue
        cfg = load_config(state.spec.config, point_overrides(state.spec.name, state.spec.fixed, point))
        try:
            same_config(cfg, point_dir)
        except SweepError as exc:
            raise SweepError(f"point {point.point_id} is DONE with another configuration than this sweep gives "
                             f"it now: {exc}") from None


def run_sweep(
    spec: SweepSpec,
    out_dir: str | Path,
    launcher: str = "local",
    jobs: int = 1,
    wait: bool = True,
    poll_s: float = 5.0,
    max_requeue: int | None = None,
    same_config: SameConfig | None = None,
) -> SweepState:
    """Run every unfinished point; finished points are never rerun.

    Args:
        launcher: "local" (child processes, `jobs` at a time) or "slurm" (one submitit job array).
        wait: slurm: follow the tasks until none can still work (False: submit and return).
        poll_s: seconds between polls of the children or the queue.
        max_requeue: restarts of an unfinished point in this command (default: slurm.max_requeue;
            local: 0, as a local failure is usually a bug, not a preemption).
        same_config: checks each finished point's run directory against the config it would run now
            (refuse_changed_finished); None checks nothing.

    Returns:
        The sweep's state, as saved in OUT/sweep.json.
    """
    if launcher not in LAUNCHERS:
        raise SweepError(f"launcher {launcher!r} is not one of {', '.join(LAUNCHERS)}")
    spec = pin_data_location(spec)
    out = Path(out_dir).resolve()
    (out / "points").mkdir(parents=True, exist_ok=True)
    state = SweepState(spec, out, launcher)
    if same_config is not None:  # before sweep.json records the new arguments
        refuse_changed_finished(state, same_config)
    retries = spec.slurm.max_requeue if max_requeue is None else max_requeue
    if launcher == "local" and max_requeue is None:
        retries = 0
    # "running" in an old sweep.json is stale unless SLURM still has the task (a local sweep's children
    # die with it, even when it was SIGKILLed: sweep/local.py): such points run again, and resume
    for record in state.points.values():
        if record.state in (PointState.RUNNING, PointState.RETRY):
            record.state = PointState.INTERRUPTED
        for job in record.jobs:
            if job.local and job.state == "RUNNING":
                job.state = "CANCELLED"
    if launcher == "slurm":
        check_slurm_gpus(spec)
        attach_active(state)
    state.save()
    skipped = [p.point_id for p in spec.points if state.is_done(p)]
    if skipped:
        log.info("sweep %s: %d point(s) already DONE, skipped: %s", spec.name, len(skipped), ", ".join(skipped))

    todo = [p for p in spec.points if not state.is_done(p) and state.points[p.point_id].state is not PointState.RUNNING]
    if launcher == "local":
        if todo:
            run_local(state, todo, jobs, min(poll_s, 1.0), retries)
    else:
        if todo:
            submit_slurm(state, todo, retries)
        if wait:
            # attached tasks (from an earlier command) count as this command's first start
            wait_slurm(state, poll_s, retries, {p.point_id: 1 for p in spec.points if not state.is_done(p)})
    state.refresh_done()
    state.save()
    done = len(state.in_state(PointState.DONE))
    log.info("sweep %s: %d/%d points DONE (%s)", spec.name, done, len(spec.points), state.path)
    return state


def run_point(spec: SweepSpec, out_dir: str | Path, which: str, same_config: SameConfig | None = None) -> int:
    """Run one point in this process's job (slurm/memfit-array.sbatch: one array task per point).

    sweep.json is written when missing or when it does not list this point (a sweep file extended with
    points and submitted again: `memfit aggregate` lists what sweep.json holds); many tasks start at once,
    and each writes every point of the sweep file, so whichever write lands last lists them all. The
    driver-less mode keeps no job records. A point with DONE returns at once. Returns the point command's
    exit code.
    """
    spec = pin_data_location(spec)
    out = Path(out_dir).resolve()
    (out / "points").mkdir(parents=True, exist_ok=True)
    point = find_point(spec, which)
    state = SweepState(spec, out, "sbatch")
    if same_config is not None:
        refuse_changed_finished(state, same_config, [point])
    if point.point_id not in state.recorded:  # also when there is no sweep.json yet
        state.save()
    point_dir = state.point_dir(point)
    if state.is_done(point):
        log.info("point %s is DONE, nothing to do (%s)", point.point_id, point_dir)
        return 0
    argv = point_command(spec, point, point_dir)
    log.info("point %s: %s", point.point_id, shlex.join(argv))
    return subprocess.run(argv).returncode
