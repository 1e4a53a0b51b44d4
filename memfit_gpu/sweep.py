"""Sweeps: one resumable `memfit run` per point of a grid, locally or as one SLURM job array.

A sweep file (YAML) names a base config, a grid and/or an explicit list of points, and the SLURM
resources of one point:

```yaml
name: smoke
config: ../smoke.yaml            # base config, relative to this file
fixed: {eval.bootstrap_samples: 100}   # overrides every point gets (optional)
grid: {pack.k: [5, 10]}          # cartesian product of the lists
points: [{retrieve.alpha: 0.5}]  # explicit points, added after the grid (optional; `name:` names one)
slurm: {partition: debug, gpus_per_task: 1, cpus_per_task: 8, mem_gb: 32, timeout_min: 240,
        array_parallelism: 64, max_requeue: 2}
```

Each point is a run directory `OUT/points/<id>/` (the id reads like its overrides, `k=5,alpha=0.5`)
produced by `memfit run --config BASE --out POINT_DIR key=value ...`. `memfit run` resumes and writes
`DONE` last, so the sweep's whole fault story is: a point with `DONE` is skipped; any other point is
(re)started and continues where it stopped. Preempted/timed-out SLURM tasks requeue themselves
(submitit checkpointing); a point whose task failed or was cancelled is resubmitted as soon as that
task has ended, up to `max_requeue` times per sweep command. A run that exits with code 2 (memfit's
configuration/data error) is not retried: the same command would fail again. `OUT/sweep.json`
records the points, their overrides, every job id and state.
"""

from __future__ import annotations

import csv
import hashlib
import io
import itertools
import json
import logging
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from memfit_gpu.locks import held, lock_path

log = logging.getLogger(__name__)

SWEEP_KEYS = ("name", "config", "fixed", "grid", "points", "slurm", "command")
# the program each point runs; {python} is the interpreter running the sweep (same venv on the node)
DEFAULT_COMMAND = ["{python}", "-m", "memfit_gpu.cli", "run", "--config", "{config}", "--out", "{out}"]
# memfit's exit code for a configuration or data error: a retry would fail the same way
USAGE_ERROR_RC = 2
# squeue states in which a task may still produce work (anything else, or gone from squeue, has ended)
ACTIVE_STATES = frozenset(
    {
        "PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD",
        "RESIZING", "SUSPENDED", "SIGNALING", "STAGE_OUT",
    }
)
# A task that ends without DONE is only resubmitted once it has looked ended this long: a task
# requeued on its timeout/preemption signal shows FAILED for a moment before it is PENDING again, and
# resubmitting it then would run the point twice at once.
ENDED_SETTLE_S = 10.0


class SweepError(ValueError):
    """A sweep file or sweep directory that cannot be used as asked."""


@dataclass
class SlurmSettings:
    partition: str | None = None  # None = the cluster's default partition
    gpus_per_task: int = 1  # one array task = one point = one node share
    cpus_per_task: int = 8
    mem_gb: float = 32.0
    timeout_min: int = 240
    array_parallelism: int = 64  # array tasks running at once (sbatch --array=0-N%P)
    max_requeue: int = 2  # resubmissions of unfinished points, and requeues on timeout/preemption
    setup: list[str] = field(default_factory=list)  # shell lines run before each task (module load ...)
    additional: dict[str, Any] = field(default_factory=dict)  # extra sbatch options: account, qos, ...


@dataclass
class SweepPoint:
    point_id: str
    overrides: dict[str, Any]  # the keys this point sets (grid keys, explicit keys)


@dataclass
class SweepSpec:
    name: str
    source: Path  # the sweep file
    config: Path  # base config, absolute
    fixed: dict[str, Any]
    points: list[SweepPoint]
    slurm: SlurmSettings
    command: list[str]

    @property
    def sweep_keys(self) -> list[str]:
        keys: list[str] = []
        for point in self.points:
            keys += [k for k in point.overrides if k not in keys]
        return keys


# ---------------------------------------------------------------------------------------- sweep file


def override_arg(key: str, value: Any) -> str:
    """`key=value` as OmegaConf's dot-list reads it back to the same value."""
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif value is None:
        text = "null"
    elif isinstance(value, (list, dict)):
        text = json.dumps(value)  # JSON is YAML flow syntax
    else:
        text = str(value)
    return f"{key}={text}"


def _id_value(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "+".join(_id_value(v) for v in value) or "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    return re.sub(r"[^A-Za-z0-9._+-]+", "-", str(value)).strip("-") or "none"


def _short_keys(keys: Sequence[str]) -> dict[str, str]:
    """Last dotted component, unless two keys share it (then the whole key)."""
    last = {k: k.rsplit(".", 1)[-1] for k in keys}
    counts: dict[str, int] = {}
    for short in last.values():
        counts[short] = counts.get(short, 0) + 1
    return {k: (last[k] if counts[last[k]] == 1 else k) for k in keys}


def point_ids(overrides: Sequence[dict[str, Any]], names: Sequence[str | None]) -> list[str]:
    """Readable, unique directory names: `k=5,alpha=0.5`; a hash suffix only where needed."""
    all_keys: list[str] = []
    for ov in overrides:
        all_keys += [k for k in ov if k not in all_keys]
    short = _short_keys(all_keys)
    ids: list[str] = []
    for ov, name in zip(overrides, names, strict=True):
        text = _id_value(name) if name else ",".join(f"{short[k]}={_id_value(v)}" for k, v in ov.items())
        text = text or "base"
        digest = hashlib.sha1(json.dumps(ov, sort_keys=True, default=str).encode()).hexdigest()[:6]
        if len(text) > 96:
            text = f"{text[:88]}-{digest}"
        ids.append(text)
    seen: dict[str, int] = {}
    for i in ids:
        seen[i] = seen.get(i, 0) + 1
    out = []
    for i, ov in zip(ids, overrides, strict=True):
        if seen[i] > 1:
            i = f"{i}-{hashlib.sha1(json.dumps(ov, sort_keys=True, default=str).encode()).hexdigest()[:6]}"
        out.append(i)
    if len(set(out)) != len(out):
        dup = next(i for i in out if out.count(i) > 1)
        raise SweepError(f"two sweep points have the same overrides ({dup})")
    return out


def _flat_mapping(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise SweepError(f"{where}: expected a mapping of dotted keys to values, got {type(value).__name__}")
    return {str(k): v for k, v in value.items()}


def load_sweep(path: str | Path, extra_overrides: Sequence[str] = ()) -> SweepSpec:
    """Read and check a sweep file; every point's config is validated before anything runs.

    `extra_overrides` (`key=value` from the command line) join the file's `fixed:` block, e.g. the
    reader servers of slurm/vllm-servers.sbatch.
    """
    import yaml

    from memfit_gpu.config import ConfigError, load_config

    path = Path(path).resolve()
    if not path.exists():
        raise SweepError(f"sweep file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise SweepError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise SweepError(f"{path}: expected a mapping at the top level")
    unknown = sorted(set(data) - set(SWEEP_KEYS))
    if unknown:
        raise SweepError(f"{path}: unknown key(s) {unknown}; allowed: {', '.join(SWEEP_KEYS)}")
    if "config" not in data:
        raise SweepError(f"{path}: missing `config:` (the base config, relative to the sweep file)")
    config = (path.parent / str(data["config"])).resolve()
    if not config.exists():
        raise SweepError(f"{path}: config {data['config']} does not exist ({config})")
    name = str(data.get("name") or path.stem)
    fixed = _flat_mapping(data.get("fixed"), f"{path}: fixed")
    for item in extra_overrides:
        if "=" not in item:
            raise SweepError(f"override {item!r} is not key=value (e.g. reader.backend=openai)")
        key, value = item.split("=", 1)
        fixed[key] = value  # kept as text: override_arg passes it through as typed

    grid = _flat_mapping(data.get("grid"), f"{path}: grid")
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            raise SweepError(f"{path}: grid.{key} must be a non-empty list, got {values!r}")
    overrides: list[dict[str, Any]] = []
    names: list[str | None] = []
    if grid:
        for combo in itertools.product(*grid.values()):
            overrides.append(dict(zip(grid.keys(), combo, strict=True)))
            names.append(None)
    explicit = data.get("points") or []
    if not isinstance(explicit, list):
        raise SweepError(f"{path}: points must be a list of mappings")
    for i, item in enumerate(explicit):
        point = _flat_mapping(item, f"{path}: points[{i}]")
        names.append(str(point.pop("name")) if "name" in point else None)
        overrides.append(point)
    if not overrides:
        overrides, names = [{}], [None]  # no grid, no points: the base config itself

    slurm_data = _flat_mapping(data.get("slurm"), f"{path}: slurm")
    allowed = set(SlurmSettings.__dataclass_fields__)
    bad = sorted(set(slurm_data) - allowed)
    if bad:
        raise SweepError(f"{path}: unknown slurm key(s) {bad}; allowed: {', '.join(sorted(allowed))}")
    slurm = SlurmSettings(**slurm_data)

    command = data.get("command") or DEFAULT_COMMAND
    if not isinstance(command, list) or not all(isinstance(c, str) for c in command):
        raise SweepError(f"{path}: command must be a list of strings")
    for placeholder in ("{config}", "{out}"):
        if not any(placeholder in c for c in command):
            raise SweepError(f"{path}: command must contain {placeholder}")

    ids = point_ids(overrides, names)
    points = [SweepPoint(pid, ov) for pid, ov in zip(ids, overrides, strict=True)]
    for point in points:
        try:
            load_config(config, point_overrides(name, fixed, point))
        except ConfigError as exc:
            raise SweepError(f"{path}: point {point.point_id}: {exc}") from None
    return SweepSpec(name, path, config, fixed, points, slurm, list(command))


def pin_data_location(spec: SweepSpec) -> SweepSpec:
    """The spec with `data.path` fixed to where this process finds the data, when the config leaves it
    to the environment ($MEMFIT_DATA_DIR, the fetch cache): SLURM tasks and local points then read the
    same files, whatever their own environment holds. A sweep whose data cannot be found stops here,
    before anything is submitted."""
    from memfit_gpu.config import load_config
    from memfit_gpu.data import DataNotFoundError, data_location

    pinned: dict[str, Any] = {}
    for point in spec.points:
        cfg = load_config(spec.config, point_overrides(spec.name, spec.fixed, point))
        if cfg.data.path is not None:
            continue
        try:
            where = str(data_location(cfg.data.benchmark, None, cfg.data.split))
        except DataNotFoundError as exc:
            raise SweepError(f"{spec.source}: point {point.point_id}: {exc}") from None
        if pinned.get("data.path", where) != where:
            raise SweepError(f"{spec.source}: points read different benchmarks; give each its data.path")
        pinned["data.path"] = where
    if not pinned:
        return spec
    log.info("sweep %s: data.path=%s for every point (found here; tasks get it explicitly)", spec.name,
             pinned["data.path"])
    return SweepSpec(spec.name, spec.source, spec.config, {**spec.fixed, **pinned}, spec.points, spec.slurm,
                     spec.command)


def point_overrides(sweep_name: str, fixed: dict[str, Any], point: SweepPoint) -> list[str]:
    """Dot-list overrides of one point: fixed ones, the point's own, and the W&B group = sweep name."""
    merged = {**fixed, **point.overrides}
    args = [override_arg(k, v) for k, v in merged.items()]
    if "tracking.wandb.group" not in merged:
        args.append(override_arg("tracking.wandb.group", sweep_name))
    return args


def point_command(spec: SweepSpec, point: SweepPoint, point_dir: Path) -> list[str]:
    values = {"python": sys.executable, "config": str(spec.config), "out": str(point_dir)}
    return [part.format(**values) for part in spec.command] + point_overrides(spec.name, spec.fixed, point)


# ---------------------------------------------------------------------------------------- state file


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    os.replace(tmp, path)


class SweepState:
    """`OUT/sweep.json`: points, overrides, attempts, job ids and states; rewritten on every change."""

    def __init__(self, spec: SweepSpec, out_dir: Path, launcher: str):
        self.spec = spec
        self.out_dir = out_dir
        self.path = out_dir / "sweep.json"
        previous: dict[str, Any] = {}
        if self.path.exists():
            try:
                previous = json.loads(self.path.read_text())
            except json.JSONDecodeError as exc:
                raise SweepError(f"{self.path}: not valid JSON ({exc}); move it away to start over") from None
            if previous.get("name") not in (None, spec.name):
                raise SweepError(
                    f"{self.path}: belongs to sweep {previous.get('name')!r}, not {spec.name!r}; use another --out"
                )
        old_points = {p["id"]: p for p in previous.get("points", [])}
        self.submissions: list[dict[str, Any]] = list(previous.get("submissions", []))
        self.points: dict[str, dict[str, Any]] = {}
        for point in spec.points:
            old = old_points.get(point.point_id, {})
            self.points[point.point_id] = {
                "id": point.point_id,
                "overrides": point.overrides,
                "dir": str(self.point_dir(point)),
                "args": point_overrides(spec.name, spec.fixed, point),
                "attempts": old.get("attempts", 0),
                "jobs": old.get("jobs", []),  # [{"job_id", "state", "attempt", "log"}]
                "state": "done" if self.is_done(point) else old.get("state", "pending"),
            }
        self.launcher = launcher

    def point_dir(self, point: SweepPoint) -> Path:
        return self.out_dir / "points" / point.point_id

    def is_done(self, point: SweepPoint) -> bool:
        return (self.point_dir(point) / "DONE").exists()

    def refresh_done(self) -> int:
        done = 0
        for point in self.spec.points:
            if self.is_done(point):
                self.points[point.point_id]["state"] = "done"
                done += 1
        return done

    def save(self) -> None:
        states = [p["state"] for p in self.points.values()]
        overall = "done" if all(s == "done" for s in states) else ("running" if "running" in states else "incomplete")
        _write_json(
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
                "submissions": self.submissions,
                "points": list(self.points.values()),
            },
        )


def _progress(total: int, name: str):  # tqdm is imported lazily: `memfit --help` stays fast
    from tqdm import tqdm

    return tqdm(total=total, desc=f"sweep {name}", unit="point", file=sys.stderr, dynamic_ncols=True)


def _show(bar: Any, done: int, postfix: str) -> None:
    if bar.n != done or bar.postfix != postfix:
        bar.n = done
        bar.set_postfix_str(postfix, refresh=False)
        bar.refresh()


# ---------------------------------------------------------------------------------------- local


def run_local(state: SweepState, todo: list[SweepPoint], jobs: int, poll_s: float, retries: int) -> None:
    """Run points as subprocesses, `jobs` at a time; each writes its log to OUT/logs/<id>.attempt<N>.log.

    A point that stops without DONE goes back to the queue up to `retries` times (not after exit code 2).
    """
    log_dir = state.out_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    queue = list(todo)
    starts: dict[str, int] = {}
    running: dict[str, tuple[subprocess.Popen, Any]] = {}
    bar = _progress(len(state.spec.points), state.spec.name)
    bar.update(state.refresh_done())
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
                record["attempts"] += 1
                starts[point.point_id] = starts.get(point.point_id, 0) + 1
                log_path = log_dir / f"{point.point_id}.attempt{record['attempts']}.log"
                argv = point_command(state.spec, point, state.point_dir(point))
                handle = open(log_path, "w")
                handle.write(f"$ {shlex.join(argv)}\n")
                handle.flush()
                proc = subprocess.Popen(argv, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)
                running[point.point_id] = (proc, handle)
                record["state"] = "running"
                record["jobs"].append({"job_id": f"local:{proc.pid}", "state": "RUNNING",
                                       "attempt": record["attempts"], "log": str(log_path)})
                state.save()
            time.sleep(poll_s)
            for point_id, (proc, handle) in list(running.items()):
                rc = proc.poll()
                if rc is None:
                    continue
                handle.close()
                del running[point_id]
                record = state.points[point_id]
                point = next(p for p in state.spec.points if p.point_id == point_id)
                finished = rc == 0 and state.is_done(point)
                record["jobs"][-1]["state"] = "COMPLETED" if rc == 0 else f"FAILED(rc={rc})"
                record["state"] = "done" if finished else _after_failure(
                    point_id, f"exit code {rc}" if rc else "exit 0 without DONE", rc, starts[point_id], retries,
                    record["jobs"][-1]["log"], state.point_dir(point))
                if record["state"] == "retry":
                    queue.append(point)
                state.save()
            _show(bar, state.refresh_done(), f"running={len(running)} queued={len(queue)}")
    except BaseException:
        # Ctrl-C or an error here: stop our children; their run dirs resume on the next sweep
        for proc, handle in running.values():
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait()
            handle.close()
        for point_id in running:
            state.points[point_id]["state"] = "interrupted"
            state.points[point_id]["jobs"][-1]["state"] = "CANCELLED"
        state.save()
        raise
    finally:
        if previous_term is not None:
            signal.signal(signal.SIGTERM, previous_term)
        bar.close()


def _after_failure(point_id: str, reason: str, rc: int | None, starts: int, retries: int, log_path: str,
                   point_dir: str | Path | None = None) -> str:
    """The point's next state: "busy" (another process is running the point: its start was refused),
    "error" (exit code 2: fix the config or data), "retry", or "failed"."""
    if rc == USAGE_ERROR_RC and point_dir is not None and held(lock_path(point_dir)):
        log.warning("point %s is being run by another process (its directory is locked); not started here, "
                    "run the sweep again once that run has ended; log: %s", point_id, log_path)
        return "busy"
    if rc == USAGE_ERROR_RC:
        log.error("point %s: configuration or data error (exit code 2), not retried; log: %s", point_id, log_path)
        return "error"
    if starts <= retries:
        log.warning("point %s stopped (%s); starting it again (%d of %d retries); log: %s", point_id, reason,
                    starts, retries, log_path)
        return "retry"
    log.warning("point %s failed (%s) after %d start(s); log: %s", point_id, reason, starts, log_path)
    return "failed"


def _terminate_as_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


# ---------------------------------------------------------------------------------------- slurm


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
        proc = subprocess.run(argv, preexec_fn=ignore_usr2)
        if status_path is not None:
            # the sweep reads the exit code here: SLURM's FAILED does not say whether a retry can help
            _write_json(Path(status_path), {"rc": proc.returncode, "task": os.environ.get("SLURM_JOB_ID")})
        if proc.returncode != 0:
            raise RuntimeError(f"point {point_dir}: `{shlex.join(argv)}` exited with code {proc.returncode}")
        if not (Path(point_dir) / "DONE").exists():
            raise RuntimeError(f"point {point_dir}: the command exited 0 but wrote no DONE")
        return point_dir

    def checkpoint(self, argv: list[str], point_dir: str, status_path: str | None = None):  # noqa: ANN201
        import submitit

        return submitit.helpers.DelayedSubmission(self, argv, point_dir, status_path)


def gpus_needed(cfg: Any) -> int:
    """GPUs one `memfit run` of this config holds at once: its in-process vLLM engines (reader, and a
    vllm judge, which starts its own), 0 for transformers/openai readers (the encoders share them)."""
    need = cfg.reader.instances * cfg.reader.tensor_parallel_size if cfg.reader.backend == "vllm" else 0
    if cfg.eval.judge.enabled and cfg.eval.judge.backend == "vllm":
        need += cfg.reader.instances * cfg.reader.tensor_parallel_size
    return need


def check_slurm_gpus(spec: SweepSpec) -> None:
    """A point whose readers need more GPUs than `slurm.gpus_per_task` gives would fail hours in."""
    from memfit_gpu.config import load_config

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


def slurm_executor(state: SweepState, max_requeue: int):
    import submitit

    settings = state.spec.slurm
    folder = state.out_dir / "slurm" / "%j"
    # max_num_timeout: submitit requeues a task on timeout/preemption at most this many times
    executor = submitit.AutoExecutor(folder=folder, cluster="slurm", slurm_max_num_timeout=max_requeue)
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
    statuses = [str(status_dir / f"{p.point_id}.attempt{state.points[p.point_id]['attempts'] + 1}.json") for p in todo]
    for path in statuses:
        Path(path).unlink(missing_ok=True)
    jobs = executor.map_array(PointTask(), argvs, dirs, statuses)
    task_ids = [str(job.job_id) for job in jobs]
    array_id = task_ids[0].split("_")[0] if task_ids else ""
    state.submissions.append(
        {"array_job_id": array_id, "points": [p.point_id for p in todo], "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    )
    for point, task_id, job, status in zip(todo, task_ids, jobs, statuses, strict=True):
        record = state.points[point.point_id]
        record["attempts"] += 1
        record["state"] = "running"
        record["jobs"].append({"job_id": task_id, "state": "PENDING", "attempt": record["attempts"],
                               "log": str(job.paths.stdout), "status": status})
    state.save()
    log.info("submitted array %s: %d point(s)", array_id, len(todo))
    return task_ids


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


def _task_rc(job: dict[str, Any]) -> int | None:
    status = job.get("status")
    if not status or not Path(status).exists():
        return None  # killed before the command returned (cancel, node failure, time limit)
    try:
        return int(json.loads(Path(status).read_text())["rc"])
    except (ValueError, KeyError, json.JSONDecodeError):
        return None


def wait_slurm(state: SweepState, poll_s: float, retries: int, starts: dict[str, int]) -> None:
    """Poll squeue until no task of this sweep is pending or running; DONE files are the truth.

    A point whose task ended without DONE is resubmitted at once (one array per poll), while it has
    retries left in this sweep command (`starts` counts this command's submissions per point).
    """
    bar = _progress(len(state.spec.points), state.spec.name)
    ended_since: dict[str, float] = {}  # job id -> when it was first seen ended without DONE
    try:
        while True:
            # a point may write DONE while its task is still finishing: follow the task until it ends
            current = {pid: rec["jobs"][-1] for pid, rec in state.points.items()
                       if rec["jobs"] and (rec["state"] == "running" or rec["jobs"][-1]["state"] in ACTIVE_STATES)}
            states = squeue_states([j["job_id"] for j in current.values()]) if current else {}
            active = 0
            changed = False
            for point_id, job in current.items():
                new_state = states.get(job["job_id"], job["state"] if job["state"] not in ACTIVE_STATES else "ENDED")
                if new_state != job["state"]:
                    job["state"] = new_state
                    changed = True
                if new_state in ACTIVE_STATES:
                    ended_since.pop(job["job_id"], None)
                    active += 1
                    continue
                point = next(p for p in state.spec.points if p.point_id == point_id)
                record = state.points[point_id]
                if state.is_done(point):
                    record["state"] = "done"
                elif record["state"] == "running":
                    first_seen = ended_since.setdefault(job["job_id"], time.monotonic())
                    if time.monotonic() - first_seen < ENDED_SETTLE_S:
                        active += 1  # not settled yet: it may be on its way back to PENDING
                        continue
                    rc = _task_rc(job)
                    point = next(p for p in state.spec.points if p.point_id == point_id)
                    record["state"] = _after_failure(point_id, f"task {job['job_id']} {new_state}", rc,
                                                     starts.get(point_id, 1), retries, job["log"],
                                                     state.point_dir(point))
                changed = True
            retry = [p for p in state.spec.points if state.points[p.point_id]["state"] == "retry"]
            if retry:
                for point in retry:
                    starts[point.point_id] = starts.get(point.point_id, 1) + 1
                submit_slurm(state, retry, retries)
                active += len(retry)
            done = state.refresh_done()
            if changed:
                state.save()
            running = sum(1 for j in current.values() if j["state"] == "RUNNING")
            _show(bar, done, f"running={running} waiting={active - running}")
            if active == 0:
                return
            time.sleep(poll_s)
    finally:
        bar.close()


def attach_active(state: SweepState) -> None:
    """Points whose last task is still queued or running (a re-run sweep) are waited for, not resubmitted."""
    last = {pid: rec["jobs"][-1] for pid, rec in state.points.items()
            if rec["jobs"] and not rec["jobs"][-1]["job_id"].startswith("local:") and rec["state"] != "done"}
    if not last:
        return
    states = squeue_states([j["job_id"] for j in last.values()])
    for point_id, job in last.items():
        if job["job_id"] in states:
            job["state"] = states[job["job_id"]]
        elif job["state"] in ACTIVE_STATES:
            job["state"] = "ENDED"  # squeue forgot it: it ended while no sweep was watching
        if job["state"] in ACTIVE_STATES:
            state.points[point_id]["state"] = "running"


# ---------------------------------------------------------------------------------------- driver


def run_sweep(
    spec: SweepSpec,
    out_dir: str | Path,
    launcher: str = "local",
    jobs: int = 1,
    wait: bool = True,
    poll_s: float = 5.0,
    max_requeue: int | None = None,
) -> dict[str, Any]:
    """Run every unfinished point; returns the sweep.json content. Finished points are never rerun."""
    if launcher not in ("local", "slurm"):
        raise SweepError(f"launcher {launcher!r} is not one of local, slurm")
    spec = pin_data_location(spec)
    out = Path(out_dir).resolve()
    (out / "points").mkdir(parents=True, exist_ok=True)
    state = SweepState(spec, out, launcher)
    retries = spec.slurm.max_requeue if max_requeue is None else max_requeue
    if launcher == "local" and max_requeue is None:
        retries = 0  # a local failure is usually a bug, not a preemption: report it, do not loop
    # "running" in an old sweep.json is stale unless SLURM still has the task (a local sweep's children
    # die with it): such points run again, and resume
    for record in state.points.values():
        if record["state"] in ("running", "retry"):
            record["state"] = "interrupted"
    if launcher == "slurm":
        check_slurm_gpus(spec)
        attach_active(state)
    state.save()
    skipped = [p.point_id for p in spec.points if state.is_done(p)]
    if skipped:
        log.info("sweep %s: %d point(s) already DONE, skipped: %s", spec.name, len(skipped), ", ".join(skipped))

    running_ids = {pid for pid, rec in state.points.items() if rec["state"] == "running"}
    todo = [p for p in spec.points if not state.is_done(p) and p.point_id not in running_ids]
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
    data = json.loads(state.path.read_text())
    done = sum(1 for p in data["points"] if p["state"] == "done")
    log.info("sweep %s: %d/%d points DONE (%s)", spec.name, done, len(data["points"]), state.path)
    return data


def find_point(spec: SweepSpec, which: str) -> SweepPoint:
    """A point by index (SLURM_ARRAY_TASK_ID) or by id."""
    if which.isdigit():
        index = int(which)
        if index >= len(spec.points):
            raise SweepError(f"{spec.source}: point index {index} out of range (sweep has {len(spec.points)} points)")
        return spec.points[index]
    for point in spec.points:
        if point.point_id == which:
            return point
    raise SweepError(f"{spec.source}: no point {which!r}; points: {', '.join(p.point_id for p in spec.points)}")


def run_point(spec: SweepSpec, out_dir: str | Path, which: str) -> int:
    """Run one point in this process's job (slurm/memfit-array.sbatch: one array task per point).

    sweep.json is written only if missing (many tasks start at once; the driver-less mode keeps no job
    records); a point with DONE returns at once.
    """
    spec = pin_data_location(spec)
    out = Path(out_dir).resolve()
    (out / "points").mkdir(parents=True, exist_ok=True)
    point = find_point(spec, which)
    state = SweepState(spec, out, "sbatch")
    if not state.path.exists():
        state.save()
    point_dir = state.point_dir(point)
    if state.is_done(point):
        log.info("point %s is DONE, nothing to do (%s)", point.point_id, point_dir)
        return 0
    argv = point_command(spec, point, point_dir)
    log.info("point %s: %s", point.point_id, shlex.join(argv))
    return subprocess.run(argv).returncode


# ---------------------------------------------------------------------------------------- aggregate


def _get(data: Any, *keys: str) -> Any:
    for key in keys:
        if not isinstance(data, dict) or key not in data:
            return None
        data = data[key]
    return data


def _pack_hit_rate(predictions: Path) -> float | None:
    hits = []
    if not predictions.exists():
        return None
    with predictions.open() as handle:
        for line in handle:
            if not line.strip():
                continue
            row = json.loads(line)
            if row.get("evaluated", True) and _get(row, "retrieval", "pack_hit") is not None:
                hits.append(bool(row["retrieval"]["pack_hit"]))
    return sum(hits) / len(hits) if hits else None


METRIC_COLUMNS = ("f1", "bleu1", "judge", "pack_hit", "questions")


def aggregate(sweep_dir: str | Path) -> tuple[list[str], list[dict[str, Any]]]:
    """One row per point: its sweep keys, status, and the main metrics of its metrics.json."""
    sweep_dir = Path(sweep_dir)
    state_path = sweep_dir / "sweep.json"
    if not state_path.exists():
        raise SweepError(f"{sweep_dir}: no sweep.json (not a sweep directory)")
    data = json.loads(state_path.read_text())
    keys: list[str] = list(data.get("sweep_keys", []))
    rows: list[dict[str, Any]] = []
    for point in data["points"]:
        point_dir = Path(point["dir"])
        if not point_dir.is_absolute() or not point_dir.exists():
            point_dir = sweep_dir / "points" / point["id"]
        row: dict[str, Any] = {"point": point["id"]}
        row.update({k: point["overrides"].get(k) for k in keys})
        row["status"] = "done" if (point_dir / "DONE").exists() else point.get("state", "pending")
        metrics_path = point_dir / "metrics.json"
        metrics = json.loads(metrics_path.read_text()) if metrics_path.exists() else None
        if metrics is not None:
            variant = metrics.get("metric_variant", "paper")
            row["metric"] = variant
            row["f1"] = _get(metrics, "average", variant, "f1")
            row["bleu1"] = _get(metrics, "average", variant, "bleu1")
            judge = _get(metrics, "average", "judge")
            row["judge"] = judge if judge is not None else _get(metrics, "overall", "judge")
            pack_hit = _get(metrics, "retrieval", "overall", "pack_hit")
            row["pack_hit"] = pack_hit if pack_hit is not None else _pack_hit_rate(point_dir / "predictions.jsonl")
            row["questions"] = metrics.get("questions")
        rows.append(row)
    columns = ["point", *keys, "status", "metric", *METRIC_COLUMNS]
    # a judge column with no judge anywhere is noise
    if all(r.get("judge") is None for r in rows):
        columns.remove("judge")
    return columns, rows


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return str(value)


# rates shown as percentages in the markdown table, like results.md; the CSV keeps fractions
PERCENT_COLUMNS = ("f1", "bleu1", "judge", "pack_hit")


def to_markdown(columns: Sequence[str], rows: Sequence[dict[str, Any]]) -> str:
    header = [f"{c} %" if c in PERCENT_COLUMNS else c for c in columns]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    for row in rows:
        cells = []
        for column in columns:
            value = row.get(column)
            if column in PERCENT_COLUMNS and isinstance(value, (int, float)):
                cells.append(f"{100.0 * value:.2f}")
            else:
                cells.append(_cell(value).replace("|", "\\|"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def to_csv(columns: Sequence[str], rows: Sequence[dict[str, Any]]) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(columns)
    for row in rows:
        writer.writerow(["" if row.get(c) is None else (json.dumps(row[c]) if isinstance(row[c], (list, dict))
                                                        else row[c]) for c in columns])
    return buf.getvalue()
