"""The SLURM launcher: one submitit job array per round of points, watched until no task can still work.

Preempted/timed-out tasks requeue themselves (submitit checkpointing: `PointTask.checkpoint`); a point
whose task failed or was cancelled is resubmitted as soon as that task has ended (watch.py says when),
up to `max_requeue` times per sweep command. A task whose command exits with code 2 (memfit's
configuration/data error) is not retried: the same command would fail again.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shlex
import signal
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memfit_gpu.config import MemFitConfig, load_config
from memfit_gpu.files import write_json_atomic
from memfit_gpu.locks import LOCK_WAIT_ENV
from memfit_gpu.readers.registry import backend_entry
from memfit_gpu.sweep.progress import Progress
from memfit_gpu.sweep.spec import SweepError, SweepPoint, SweepSpec, point_command, point_overrides
from memfit_gpu.sweep.state import (
    JobRecord,
    PointState,
    Submission,
    SweepState,
    state_after_stop,
)
from memfit_gpu.sweep.watch import ACTIVE_STATES, FORGOTTEN, TaskWatcher, failure_reason, squeue_states

if TYPE_CHECKING:  # submitit is optional (`pip install memfit-gpu[slurm]`) and imported where a sweep submits
    import submitit

log = logging.getLogger(__name__)

# longer than SLURM's KillWait (30 s by default) plus a run's own shutdown
TASK_LOCK_WAIT_S = 300


class PointTask:
    """One array task: run a point's resumable command; on timeout/preemption requeue the same command.

    A class (not a closure) so that submitit can pickle it; `checkpoint` is submitit's hook, called on
    its timeout/preemption signal: requeueing the same command is the whole checkpoint, because the
    point's run directory is where `memfit run` resumes from.
    """

    def __call__(self, argv: list[str], point_dir: str, status_path: str | None = None) -> str:
        def ignore_usr2() -> None:
            # submitit's warning signal goes to the whole step; the run keeps working until the real
            # kill, and the requeued task resumes from whatever it wrote by then
            signal.signal(signal.SIGUSR2, signal.SIG_IGN)

        print(f"memfit sweep task: {shlex.join(argv)}", flush=True)
        # a requeued task can start before SLURM has finished killing the one it replaces, which still
        # holds the point's run lock: wait for it rather than fail the point
        env = {**os.environ, LOCK_WAIT_ENV: os.environ.get(LOCK_WAIT_ENV, str(TASK_LOCK_WAIT_S))}
        # not subprocess.run: submitit's USR2 handler requeues the job and raises SystemExit here, on which run()
        # kills the command at once; Popen's exit waits for it instead, so the run keeps working until SLURM
        # signals the whole step and stops at its next kill point (the requeued task resumes from there)
        with subprocess.Popen(argv, preexec_fn=ignore_usr2, env=env) as proc:
            returncode = proc.wait()
        if status_path is not None:
            # the sweep reads the exit code here: SLURM's FAILED does not say whether a retry can help
            write_json_atomic(Path(status_path), {"rc": returncode, "task": os.environ.get("SLURM_JOB_ID")})
        if returncode != 0:
            raise RuntimeError(f"point {point_dir}: `{shlex.join(argv)}` exited with code {returncode}")
        if not (Path(point_dir) / "DONE").exists():
            raise RuntimeError(f"point {point_dir}: the command exited 0 but wrote no DONE")
        return point_dir

    def checkpoint(self, argv: list[str], point_dir: str,
                   status_path: str | None = None) -> submitit.helpers.DelayedSubmission:
        import submitit

        return submitit.helpers.DelayedSubmission(self, argv, point_dir, status_path)


# ---------------------------------------------------------------------------------------- resources


def gpus_needed(cfg: MemFitConfig) -> int:
    """GPUs one `memfit run` of this config holds at once: what the reader's backend entry says its engines
    hold (vLLM: instances x tensor_parallel_size), and a judge's, which starts its own; 0 for in-process and
    server readers (the encoders share the GPUs)."""
    need = backend_entry(cfg.reader.backend).gpus(cfg.reader)
    if cfg.eval.judge.enabled:
        # the judge's engines take the reader's instances and tensor_parallel_size
        # (evaluate/judge.reader_config_for_judge)
        need += backend_entry(cfg.eval.judge.backend).gpus(cfg.reader)
    return need


def check_slurm_gpus(spec: SweepSpec) -> None:
    """A point whose readers need more GPUs than `slurm.gpus_per_task` gives would fail hours in."""
    for point in spec.points:
        need = gpus_needed(load_config(spec.config, point_overrides(spec.name, spec.fixed, point)))
        if need > spec.slurm.gpus_per_task:
            raise SweepError(
                f"{spec.source}: point {point.point_id} runs vLLM engines on {need} GPU(s) "
                f"(reader.instances x reader.tensor_parallel_size) but slurm.gpus_per_task is "
                f"{spec.slurm.gpus_per_task}: raise slurm.gpus_per_task or lower reader.instances"
            )


def sbatch_args(spec: SweepSpec) -> list[str]:
    """sbatch options for slurm/memfit-array.sbatch from the sweep's `slurm:` block (command-line
    options override the template's #SBATCH lines), `--array` included."""
    s = spec.slurm
    hours, minutes = divmod(int(s.timeout_min), 60)
    args = [f"--array=0-{len(spec.points) - 1}%{s.array_parallelism}", f"--cpus-per-task={s.cpus_per_task}",
            f"--mem={int(math.ceil(s.mem_gb))}G", f"--time={hours:02d}:{minutes:02d}:00"]
    if s.gpus_per_task > 0:  # --gpus-per-task=0 is an error on clusters without GPU gres: say nothing then
        args.append(f"--gpus-per-task={s.gpus_per_task}")
    if s.partition:
        args.append(f"--partition={s.partition}")
    for key, value in s.additional.items():
        args.append(f"--{str(key).replace('_', '-')}={value}")
    return args


# ---------------------------------------------------------------------------------------- submit


def submitit_folder(state: SweepState) -> Path:
    """submitit's folder pattern of the sweep: one folder per task, `OUT/slurm/<array>_<index>/`."""
    return state.out_dir / "slurm" / "%j"


def slurm_executor(state: SweepState, max_requeue: int) -> submitit.AutoExecutor:
    """A submitit executor with the sweep's `slurm:` resources (one node share per array task)."""
    import submitit

    settings = state.spec.slurm
    # max_num_timeout: submitit requeues a task on timeout/preemption at most this many times
    executor = submitit.AutoExecutor(folder=submitit_folder(state), cluster="slurm", slurm_max_num_timeout=max_requeue)
    params: dict[str, Any] = {
        "name": f"memfit-{state.spec.name}",
        "timeout_min": settings.timeout_min,
        "cpus_per_task": settings.cpus_per_task,
        "mem_gb": settings.mem_gb,
        "nodes": 1,
        "tasks_per_node": 1,
        "slurm_array_parallelism": settings.array_parallelism,
    }
    if settings.gpus_per_task > 0:  # `--gpus-per-node=0` is an error on clusters without GPU gres
        params["gpus_per_node"] = settings.gpus_per_task
    if settings.partition:
        params["slurm_partition"] = settings.partition
    if settings.setup:
        params["slurm_setup"] = list(settings.setup)
    if settings.additional:
        params["slurm_additional_parameters"] = dict(settings.additional)
    executor.update_parameters(**params)
    return executor


def submit_slurm(state: SweepState, todo: list[SweepPoint], max_requeue: int) -> list[str]:
    """Submit one job array for `todo`; returns the array task ids (`<array>_<index>`)."""
    executor = slurm_executor(state, max_requeue)
    argvs = [point_command(state.spec, p, state.point_dir(p)) for p in todo]
    dirs = [str(state.point_dir(p)) for p in todo]
    status_dir = state.out_dir / "status"
    status_dir.mkdir(parents=True, exist_ok=True)
    statuses = [str(status_dir / f"{p.point_id}.attempt{state.points[p.point_id].attempts + 1}.json") for p in todo]
    for path in statuses:
        Path(path).unlink(missing_ok=True)
    try:
        jobs = executor.map_array(PointTask(), argvs, dirs, statuses)
    except RuntimeError as exc:  # submitit's FailedJobError: sbatch refused the array (its stderr is in it)
        raise SweepError(f"sbatch refused the job array of {len(todo)} point(s): {str(exc).strip()}") from None
    task_ids = [str(job.job_id) for job in jobs]
    array_id = task_ids[0].split("_")[0] if task_ids else ""
    state.submissions.append(Submission(array_id, [p.point_id for p in todo], time.strftime("%Y-%m-%dT%H:%M:%S")))
    for point, task_id, job, status in zip(todo, task_ids, jobs, statuses, strict=True):
        record = state.points[point.point_id]
        record.attempts += 1
        record.state = PointState.RUNNING
        record.jobs.append(JobRecord(task_id, "PENDING", record.attempts, str(job.paths.stdout), status))
    state.save()
    log.info("submitted array %s: %d point(s)", array_id, len(todo))
    return task_ids


# ---------------------------------------------------------------------------------------- wait


def task_rc(job: JobRecord) -> int | None:
    """The exit code the task's command returned (its status file), None if it never returned
    (killed: cancel, node failure, time limit)."""
    if not job.status or not Path(job.status).exists():
        return None
    try:
        return int(json.loads(Path(job.status).read_text())["rc"])
    except (ValueError, KeyError, TypeError, json.JSONDecodeError):
        return None


def wait_slurm(state: SweepState, poll_s: float, retries: int, starts: dict[str, int],
               watcher: TaskWatcher | None = None) -> None:
    """Poll until no task of this sweep can still work; DONE files are the truth.

    A point whose task ended without DONE is resubmitted at once (one array per poll), while it has
    retries left in this sweep command (`starts` counts this command's submissions per point).
    """
    watcher = watcher or TaskWatcher(submitit_folder(state))
    progress = Progress(len(state.spec.points), state.spec.name)
    try:
        while True:
            # a point may write DONE while its task is still finishing: follow the task until it ends
            current = {pid: rec.jobs[-1] for pid, rec in state.points.items()
                       if rec.jobs and (rec.state is PointState.RUNNING or rec.jobs[-1].state in ACTIVE_STATES)}
            views = watcher.poll({job.job_id: job.state for job in current.values()})
            active = 0
            changed = False
            for point_id, job in current.items():
                view = views[job.job_id]
                if view.state != job.state:
                    job.state = view.state
                    changed = True
                if view.active:
                    active += 1
                    continue
                point = state.spec.point(point_id)
                record = state.points[point_id]
                if state.is_done(point):
                    record.state = PointState.DONE
                elif record.state is PointState.RUNNING:
                    if not view.ended:
                        active += 1  # not settled yet: it may be on its way back to PENDING
                        continue
                    reason = f"task {job.job_id} {view.state}"
                    raised = failure_reason(watcher.folder, job.job_id)
                    record.state = state_after_stop(point_id, f"{reason}: {raised}" if raised else reason,
                                                    task_rc(job), starts.get(point_id, 1), retries, job.log,
                                                    state.point_dir(point))
                changed = True
            retry = state.in_state(PointState.RETRY)
            if retry:
                for point in retry:
                    starts[point.point_id] = starts.get(point.point_id, 1) + 1
                submit_slurm(state, retry, retries)
                active += len(retry)
            done = state.refresh_done()
            if changed:
                state.save()
            running = sum(1 for j in current.values() if j.state == "RUNNING")
            progress.show(done, f"running={running} waiting={active - running}")
            if active == 0:
                return
            time.sleep(poll_s)
    finally:
        progress.close()


def attach_active(state: SweepState) -> None:
    """Points whose last task is still queued or running (a re-run sweep) are waited for, not resubmitted."""
    last = {pid: rec.jobs[-1] for pid, rec in state.points.items()
            if rec.jobs and not rec.jobs[-1].local and rec.state is not PointState.DONE}
    if not last:
        return
    states = squeue_states([j.job_id for j in last.values()])
    for point_id, job in last.items():
        if job.job_id in states:
            job.state = states[job.job_id]
        elif job.state in ACTIVE_STATES:
            job.state = FORGOTTEN  # squeue forgot it: it ended while no sweep was watching
        if job.state in ACTIVE_STATES:
            state.points[point_id].state = PointState.RUNNING
