"""The local launcher: points as child processes of the sweep, `jobs` at a time.

The children die with the sweep, however it ends: Ctrl-C and SIGTERM stop them explicitly, and on Linux
each child asks the kernel for SIGTERM when the sweep's process is gone (PR_SET_PDEATHSIG), so a
SIGKILLed sweep leaves no `memfit run` working unsupervised; the next start marks their records stopped.
"""

from __future__ import annotations

import ctypes
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import IO, Any

from memfit_gpu.sweep.progress import Progress
from memfit_gpu.sweep.spec import SweepPoint, point_command
from memfit_gpu.sweep.state import JobRecord, PointState, SweepState, state_after_stop


def run_local(state: SweepState, todo: list[SweepPoint], jobs: int, poll_s: float, retries: int) -> None:
    """Run points as subprocesses, `jobs` at a time; each writes its log to OUT/logs/<id>.attempt<N>.log.

    A point that stops without DONE goes back to the queue up to `retries` times (not after exit code 2).
    """
    log_dir = state.out_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    queue = list(todo)
    starts: dict[str, int] = {}
    running: dict[str, tuple[subprocess.Popen[bytes], IO[str]]] = {}
    progress = Progress(len(state.spec.points), state.spec.name)
    progress.show(state.refresh_done(), "")
    # children run in their own session (their whole process group is stopped together), so a
    # terminal's Ctrl-C does not reach them: SIGTERM/SIGINT of the sweep stops them explicitly below
    previous_term = None
    if threading.current_thread() is threading.main_thread():
        previous_term = signal.signal(signal.SIGTERM, _terminate_as_interrupt)
    try:
        while queue or running:
            while queue and len(running) < max(1, jobs):
                point = queue.pop(0)
                record = state.points[point.point_id]
                record.attempts += 1
                starts[point.point_id] = starts.get(point.point_id, 0) + 1
                log_path = log_dir / f"{point.point_id}.attempt{record.attempts}.log"
                argv = point_command(state.spec, point, state.point_dir(point))
                handle = open(log_path, "w")  # noqa: SIM115  (closed when the child ends)
                handle.write(f"$ {shlex.join(argv)}\n")
                handle.flush()
                proc = subprocess.Popen(argv, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True,
                                        preexec_fn=_die_with(os.getpid()))
                running[point.point_id] = (proc, handle)
                record.state = PointState.RUNNING
                record.jobs.append(JobRecord(f"local:{proc.pid}", "RUNNING", record.attempts, str(log_path)))
                state.save()
            time.sleep(poll_s)
            for point_id, (proc, handle) in list(running.items()):
                rc = proc.poll()
                if rc is None:
                    continue
                handle.close()
                del running[point_id]
                record = state.points[point_id]
                point = state.spec.point(point_id)
                job = record.jobs[-1]
                job.state = "COMPLETED" if rc == 0 else f"FAILED(rc={rc})"
                if rc == 0 and state.is_done(point):
                    record.state = PointState.DONE
                else:
                    record.state = state_after_stop(point_id, f"exit code {rc}" if rc else "exit 0 without DONE", rc,
                                                    starts[point_id], retries, job.log, state.point_dir(point))
                if record.state is PointState.RETRY:
                    queue.append(point)
                state.save()
            progress.show(state.refresh_done(), f"running={len(running)} queued={len(queue)}")
    except BaseException:
        # Ctrl-C or an error here: stop our children; their run dirs resume on the next sweep
        for proc, handle in running.values():
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait()
            handle.close()
        for point_id in running:
            state.points[point_id].state = PointState.INTERRUPTED
            state.points[point_id].jobs[-1].state = "CANCELLED"
        state.save()
        raise
    finally:
        if previous_term is not None:
            signal.signal(signal.SIGTERM, previous_term)
        progress.close()


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with(parent_pid: int) -> Callable[[], None] | None:
    """What the child runs before exec so that it gets SIGTERM when the sweep dies (None off Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)

    def arm() -> None:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent_pid:  # the sweep died before the request was made
            os.kill(os.getpid(), signal.SIGTERM)

    return arm


def _terminate_as_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")
