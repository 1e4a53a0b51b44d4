"""Which SLURM array tasks of a sweep may still produce work: squeue, and submitit's result files.

What submitit's job objects report, and how far the sweep trusts it:
- `job.done()` is True once the task's result file exists: submitit writes it when the submitted
  function returned or raised (also when it gives up requeueing), so the task has ended for good and
  no requeue follows. That half is reliable and immediate; the sweep reads it through `job.paths`.
- `job.state` and the other half of `job.done()` come from `sacct`: throttled (submitit asks at most
  every 10 minutes once a job is old), and `UNKNOWN` on a cluster without accounting storage
  (slurm/local-cluster.sh has none). Liveness therefore comes from squeue, which every cluster has.
- `job.exception()` waits for the result file; once it exists it returns at once (the reason a task
  failed, for the log).

A task that ends without a result file (scancel'ed while pending, killed, node failure) is only known
from squeue. A task requeued on its timeout/preemption signal shows FAILED for a moment before it is
PENDING again, so such an end counts only once it has lasted `ENDED_SETTLE_S`.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from memfit_gpu.sweep.spec import SweepError

# squeue states in which a task may still produce work (anything else, or gone from squeue, has ended):
# STOPPED (SIGSTOP, its node kept), SPECIAL_EXIT and RESV_DEL_HOLD (held, released by `scontrol release`) go on
ACTIVE_STATES = frozenset(
    {
        "PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD",
        "RESIZING", "SUSPENDED", "SIGNALING", "STAGE_OUT", "STOPPED", "SPECIAL_EXIT", "RESV_DEL_HOLD",
    }
)
# States after which SLURM itself may requeue the task under the same id (a job submitted with --requeue): a
# result file there may be an earlier attempt's, so such an end settles like one without a result file.
REQUEUED_BY_SLURM = frozenset({"PREEMPTED", "NODE_FAIL", "BOOT_FAIL"})
# A task that ends without a result file is only taken as ended once it has looked ended this long:
# resubmitting a task on its way back to PENDING would run the point twice at once.
ENDED_SETTLE_S = 10.0
# the state a task gets when squeue no longer lists it (purged after MinJobAge: it ended)
FORGOTTEN = "ENDED"


def squeue_states(task_ids: Sequence[str]) -> dict[str, str]:
    """State of each array task (`123_4`) that squeue still knows; finished tasks squeue forgot are absent."""
    arrays = sorted({t.split("_")[0] for t in task_ids})
    states: dict[str, str] = {}
    for array_id in arrays:
        proc = subprocess.run(
            ["squeue", "-h", "-r", "--states=all", "-j", array_id, "-o", "%i %T"],
            capture_output=True, text=True, timeout=60,
        )
        if proc.returncode != 0:
            if "Invalid job id" in proc.stderr:
                continue  # purged after MinJobAge: it ended
            raise SweepError(f"squeue failed for job {array_id}: {proc.stderr.strip()}")
        for line in proc.stdout.splitlines():
            parts = line.split()
            # a requeued array task can be listed twice (its ended record and its pending one): the
            # task is alive while any of its records is
            if len(parts) == 2 and states.get(parts[0]) not in ACTIVE_STATES:
                states[parts[0]] = parts[1]
    return {t: states[t] for t in task_ids if t in states}


def result_written(folder: Path, task_id: str) -> bool:
    """Whether submitit's result file of the task exists: the submitted function returned or raised."""
    import submitit

    return submitit.SlurmJob(folder=folder, job_id=task_id).paths.result_pickle.exists()


def failure_reason(folder: Path, task_id: str) -> str | None:
    """The last line of the exception a finished task raised (None: it succeeded or wrote no result)."""
    import submitit

    job = submitit.SlurmJob(folder=folder, job_id=task_id)
    if not job.paths.result_pickle.exists():
        return None
    error = job.exception()
    if error is None:
        return None
    # submitit's message holds the task's traceback between two lines of dashes: its last line is
    # the exception itself
    lines = str(error).splitlines()
    rules = [i for i, line in enumerate(lines) if line.strip() and set(line.strip()) == {"-"}]
    trace = lines[rules[0] + 1 : rules[1]] if len(rules) >= 2 else lines
    trace = [line.strip() for line in trace if line.strip()]
    return trace[-1] if trace else None


@dataclass
class TaskView:
    """One task as the watcher sees it in one poll."""

    state: str  # squeue's state; the last recorded one (or FORGOTTEN) when squeue no longer lists it
    active: bool  # queued or running: it may still produce work
    ended: bool  # over for good: not active, and either its result file exists or it has settled


class TaskWatcher:
    """Polls the tasks of one sweep; remembers since when each ended-looking task has looked ended.

    Args:
        folder: submitit's folder pattern of the sweep (`OUT/slurm/%j`), where result files are.
        settle_s: how long an end without a result file must last before it counts.
        clock: seconds, monotonic (tests pass their own).
    """

    def __init__(self, folder: Path, settle_s: float = ENDED_SETTLE_S,
                 clock: Callable[[], float] = time.monotonic):
        self.folder = folder
        self.settle_s = settle_s
        self.clock = clock
        self._ended_since: dict[str, float] = {}

    def poll(self, last_states: Mapping[str, str]) -> dict[str, TaskView]:
        """`last_states`: task id -> the state recorded for it so far. Returns a view of every task."""
        listed = squeue_states(list(last_states)) if last_states else {}
        views: dict[str, TaskView] = {}
        for task_id, last in last_states.items():
            state = listed.get(task_id, last if last not in ACTIVE_STATES else FORGOTTEN)
            if state in ACTIVE_STATES:
                self._ended_since.pop(task_id, None)
                views[task_id] = TaskView(state, active=True, ended=False)
                continue
            if result_written(self.folder, task_id) and state not in REQUEUED_BY_SLURM:
                views[task_id] = TaskView(state, active=False, ended=True)
                continue
            first_seen = self._ended_since.setdefault(task_id, self.clock())
            views[task_id] = TaskView(state, active=False, ended=self.clock() - first_seen >= self.settle_s)
        return views
