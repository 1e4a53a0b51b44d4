"""Real sweeps of real `memfit run` points (configs/smoke.yaml): through a one-node SLURM cluster started
by slurm/local-cluster.sh (one array task cancelled mid-run and resumed), with the sbatch template, and
with the local launcher (finished points skipped, a failing point reported).

The sweeps find their data in $MEMFIT_DATA_DIR as a user's would, here a folder laid out like ../shared/data
whose locomo10.json is LoCoMo conv-26 cut to its first three sessions and six questions (real turns and
questions): the points build a 58-turn store instead of 419, and the SLURM and resume paths are the same."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from support.data import write_small_locomo
from support.env import memfit_env

from memfit_gpu.sweep.aggregate import pack_hit_rate

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
CLUSTER = REPO / "slurm" / "local-cluster.sh"
SMOKE_SWEEP = REPO / "configs" / "sweeps" / "smoke.yaml"
MEMFIT = [sys.executable, "-m", "memfit_gpu.cli"]
SWEEP_TIMEOUT_S = 900
# slurmd refuses to start a job in the second its previous run's credential was revoked (see _interrupt)
CREDENTIAL_REVOKE_S = 3.0


@pytest.fixture(scope="module")
def small_data_dir(tmp_path_factory: pytest.TempPathFactory, shared_data: Path) -> Path:
    """A $MEMFIT_DATA_DIR whose locomo/locomo10.json is conv-26's first three sessions and six questions."""
    root = tmp_path_factory.mktemp("small-data")
    (root / "locomo").mkdir()
    write_small_locomo(shared_data, root, questions=6).rename(root / "locomo" / "locomo10.json")
    return root


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory, small_data_dir: Path) -> Iterator[dict[str, str]]:
    """A running local cluster; stopped afterwards only if this fixture started it. The environment
    names the data explicitly (the sweep pins it into every point)."""
    state_dir = os.environ.get("MEMFIT_SLURM_DIR", "/tmp/memfit-slurm")
    env = {**os.environ, "MEMFIT_SLURM_DIR": state_dir, "MEMFIT_DATA_DIR": str(small_data_dir)}
    started = subprocess.run([str(CLUSTER), "start"], env=env, capture_output=True, text=True, timeout=600)
    assert started.returncode == 0, f"local-cluster.sh start failed:\n{started.stdout}\n{started.stderr}"
    ours = "already running" not in started.stderr
    env["SLURM_CONF"] = os.path.join(state_dir, "slurm.conf")
    try:  # a cluster this fixture started is stopped whatever fails, this check included
        queue = subprocess.run(["squeue", "-h"], env=env, capture_output=True, text=True, timeout=30).stdout
        assert subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True,
                              timeout=30).stdout.split() == ["idle"], f"the cluster's node is busy:\n{queue}"
        yield env
    finally:
        if ours:
            subprocess.run([str(CLUSTER), "stop"], env=env, capture_output=True, text=True, timeout=120)


def _sweep_json(out: Path) -> dict:
    path = out / "sweep.json"
    for _ in range(5):  # written atomically, but may not exist yet
        try:
            return json.loads(path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            time.sleep(0.2)
    return {}


def _predictions(point_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (point_dir / "predictions.jsonl").read_text().splitlines() if line.strip()]


def _check_finished_point(point_dir: Path, k: int) -> None:
    assert (point_dir / "DONE").exists(), f"{point_dir} has no DONE"
    rows = _predictions(point_dir)
    ids = [r["question_id"] for r in rows]
    assert len(ids) == len(set(ids)) == 6, f"{point_dir}: {len(ids)} predictions, {len(set(ids))} distinct"
    metrics = json.loads((point_dir / "metrics.json").read_text())
    assert metrics["questions"] == 6
    resolved = yaml.safe_load((point_dir / "config.yaml").read_text())
    assert resolved["pack"]["k"] == k
    assert resolved["tracking"]["wandb"]["group"] == "smoke"


def _squeue_state(task_id: str, env: dict[str, str]) -> tuple[str, str]:
    out = subprocess.run(["squeue", "-h", "-r", "--states=all", "-j", task_id.split("_")[0], "-o", "%i %T %r"],
                         env=env, capture_output=True, text=True, timeout=30).stdout
    for line in out.splitlines():
        parts = line.split()
        if parts and parts[0] == task_id:
            return parts[1], parts[2] if len(parts) > 2 else ""
    return "", ""


def _interrupt(point: str, task_id: str, env: dict[str, str]) -> None:
    """k=5: cancelled (the sweep must resubmit it). k=10: submitit's timeout/preemption signal (USR2),
    which requeues the same task in place (released by `_Release`)."""
    signal = [] if point == "k=5" else ["--signal=USR2"]
    subprocess.run(["scancel", *signal, task_id], env=env, check=True, timeout=30)


class _Release:
    """A task requeued by USR2: SLURM holds it ~2 min (BeginTime), so the test releases it early as an
    administrator would, without waiting on it (the other point is watched meanwhile: it may reach and pass
    its mid-run moment within the seconds this takes). Not within the second of the requeue: slurmd revokes
    the killed task's job credential with a one-second timestamp, and a restart allocated in that same
    second is refused ("Killing non-startable batch job: Job credential revoked"), a real failure the
    sweep then handles by resubmitting, which is not the in-place path this test is about."""

    def __init__(self, task_id: str, env: dict[str, str]) -> None:
        self.task_id, self.env = task_id, env
        self.deadline, self.held_since = time.monotonic() + 120, None

    def done(self) -> bool:
        """True once released; AssertionError when the task was not requeued in time."""
        now = time.monotonic()
        state, reason = _squeue_state(self.task_id, self.env)
        if state in ("PENDING", "REQUEUED") and reason == "BeginTime":
            self.held_since = self.held_since if self.held_since is not None else now
            if now - self.held_since >= CREDENTIAL_REVOKE_S:
                subprocess.run(["scontrol", "update", f"JobId={self.task_id}", "StartTime=now"], env=self.env,
                               check=True, timeout=30)
                return True
        elif now > self.deadline:
            raise AssertionError(f"task {self.task_id} was not requeued after USR2 (state {state}, {reason})")
        return False


def _mid_run(point_dir: Path, point: str) -> bool:
    """k=5: some answers appended (smoke.yaml flushes every 3 of 6), so the resumed run must not repeat
    them; k=10: the build stage has finished (timings.json records it)."""
    if point == "k=5":
        predictions = point_dir / "predictions.jsonl"
        return predictions.exists() and predictions.read_text().count("\n") >= 1
    timings = point_dir / "timings.json"
    return timings.exists() and "build" in timings.read_text()


@pytest.fixture(scope="module")
def cancelled_sweep(slurm_cluster: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The 2-point smoke sweep on SLURM; k=5's array task is scancel'ed after its first answers, k=10's
    gets the timeout/preemption signal after its build stage."""
    out = tmp_path_factory.mktemp("sweep-slurm") / "smoke"
    log_path = out.parent / "sweep.log"
    interrupted: dict[str, str] = {}
    releases: list[_Release] = []
    with log_path.open("w") as log_file:
        proc = subprocess.Popen(
            [*MEMFIT, "sweep", "--config", str(SMOKE_SWEEP), "--launcher", "slurm", "--out", str(out),
             "--poll-s", "1"],
            env=slurm_cluster, stdout=log_file, stderr=subprocess.STDOUT, cwd=REPO,
        )
        deadline = time.monotonic() + SWEEP_TIMEOUT_S
        try:
            while (len(interrupted) < 2 or releases) and time.monotonic() < deadline and proc.poll() is None:
                for point in ("k=5", "k=10"):
                    if point in interrupted or (out / "points" / point / "DONE").exists():
                        continue
                    if _mid_run(out / "points" / point, point):
                        record = next(p for p in _sweep_json(out)["points"] if p["id"] == point)
                        interrupted[point] = record["jobs"][-1]["job_id"]
                        _interrupt(point, interrupted[point], slurm_cluster)
                        if point == "k=10":
                            releases.append(_Release(interrupted[point], slurm_cluster))
                releases = [r for r in releases if not r.done()]
                time.sleep(0.25)
            rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            if proc.poll() is None:
                proc.kill()
    return {"out": out, "rc": rc, "interrupted": interrupted, "log": log_path.read_text(), "env": slurm_cluster}


def _slurmctld_lines(env: dict[str, str], task_id: str) -> str:
    """What slurmctld logged about one task (for a failure message: why SLURM ended or refused it)."""
    log = Path(env["MEMFIT_SLURM_DIR"]) / "log" / "slurmctld.log"
    array_id = task_id.split("_")[0]
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    return "\n".join(line for line in lines if f"JobId={task_id}" in line or f"JobId={array_id}:" in line
                     or f"JobId={array_id} " in line)


def test_slurm_sweep_resumes_cancelled_and_requeued_tasks(cancelled_sweep: dict) -> None:
    out, log = cancelled_sweep["out"], cancelled_sweep["log"]
    assert sorted(cancelled_sweep["interrupted"]) == ["k=10", "k=5"], f"not both seen mid-run:\n{log[-3000:]}"
    assert cancelled_sweep["rc"] == 0, log[-3000:]
    _check_finished_point(out / "points" / "k=5", 5)
    _check_finished_point(out / "points" / "k=10", 10)

    state = _sweep_json(out)
    assert state["state"] == "done" and state["launcher"] == "slurm"
    records = {p["id"]: p for p in state["points"]}
    k5, k10 = records["k=5"], records["k=10"]
    # k=5: the cancelled array task, then one resubmitted task that finished it
    assert [j["job_id"] for j in k5["jobs"]][0] == cancelled_sweep["interrupted"]["k=5"]
    assert [j["state"] for j in k5["jobs"]] == ["CANCELLED", "COMPLETED"]
    assert k5["attempts"] == 2 and k5["state"] == "done"
    # exit codes of the command as each task saw it: SIGTERM from scancel (submitit's task outlives it
    # until SIGKILL and reports), then 0
    assert json.loads(Path(k5["jobs"][0]["status"]).read_text())["rc"] == -signal.SIGTERM
    assert json.loads(Path(k5["jobs"][1]["status"]).read_text())["rc"] == 0
    # k=10: requeued in place by submitit (same task id), finished by the same array task
    assert [(j["job_id"], j["state"]) for j in k10["jobs"]] == [(cancelled_sweep["interrupted"]["k=10"], "COMPLETED")], (
        f"{log[-3000:]}\n{_slurmctld_lines(cancelled_sweep['env'], cancelled_sweep['interrupted']['k=10'])}")
    assert k10["attempts"] == 1
    k10_err = Path(k10["jobs"][0]["log"]).with_suffix(".err").read_text()
    assert "Caught signal SIGUSR2" in k10_err and "DUE TO JOB REQUEUE" in k10_err
    # one array of both points, then one resubmission of k=5 alone
    assert [s["points"] for s in state["submissions"]] == [["k=5", "k=10"], ["k=5"]]
    # the data location the sweep found is given to every task explicitly
    data = (Path(cancelled_sweep["env"]["MEMFIT_DATA_DIR"]) / "locomo" / "locomo10.json").resolve()
    assert k5["args"] == [f"data.path={data}", "pack.k=5", "tracking.wandb.group=smoke"]
    # the resubmitted task's own log shows the same point's command
    assert "--out " + str(out / "points" / "k=5") in Path(k5["jobs"][1]["log"]).read_text()


def _cells(line: str) -> list[str]:
    """The cells of a Markdown table row, without their padding."""
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def test_aggregate_reads_every_point(cancelled_sweep: dict) -> None:
    out = cancelled_sweep["out"]
    result = subprocess.run([*MEMFIT, "aggregate", str(out)], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert _cells(lines[0]) == ["point", "pack.k", "status", "metric", "f1 %", "bleu1 %", "pack_hit %", "questions"]
    for line, k in zip(lines[2:], (5, 10), strict=True):
        point_dir = out / "points" / f"k={k}"
        metrics = json.loads((point_dir / "metrics.json").read_text())
        variant = metrics["metric_variant"]
        pack_hit = metrics["retrieval"]["overall"]["pack_hit"]
        assert pack_hit == pack_hit_rate(point_dir / "predictions.jsonl")  # the same rate, two sources
        assert _cells(line) == [f"k={k}", str(k), "done", variant, f"{100 * metrics['average'][variant]['f1']:.2f}",
                                f"{100 * metrics['average'][variant]['bleu1']:.2f}", f"{100 * pack_hit:.2f}", "6"]
    # both points read the same data with the same models and code: no provenance line below the table
    assert all((out / "points" / f"k={k}" / "provenance.json").is_file() for k in (5, 10))
    assert not [line for line in lines if line.startswith(("warning: ", "note: "))]
    assert (out / "aggregate.md").read_text() == result.stdout
    csv_lines = (out / "aggregate.csv").read_text().splitlines()
    assert csv_lines[0] == "point,pack.k,status,metric,f1,bleu1,pack_hit,questions" and len(csv_lines) == 3


def test_sbatch_array_template_runs_each_point(cancelled_sweep: dict, slurm_cluster: dict[str, str],
                                               tmp_path: Path) -> None:
    """slurm/memfit-array.sbatch as its comments say: the sweep's own resources from `--sbatch-args`
    override the template's #SBATCH lines; the points are DONE, so each array task finds its point
    finished and returns 0."""
    out = cancelled_sweep["out"]
    count = subprocess.run([*MEMFIT, "sweep", "--config", str(SMOKE_SWEEP), "--count"], capture_output=True,
                           text=True, timeout=120, cwd=REPO)
    assert count.stdout.strip() == "2"
    resources = subprocess.run([*MEMFIT, "sweep", "--config", str(SMOKE_SWEEP), "--sbatch-args"],
                               capture_output=True, text=True, timeout=120, cwd=REPO).stdout.split()
    assert resources == ["--array=0-1%2", "--cpus-per-task=1", "--mem=4G", "--time=00:30:00", "--partition=debug"]
    env = {**slurm_cluster, "SWEEP": str(SMOKE_SWEEP), "OUT": str(out), "MEMFIT_VENV": str(Path(sys.executable).parent.parent)}
    submitted = subprocess.run(
        ["sbatch", *resources, "--wait", f"--output={tmp_path}/task-%a.out", str(REPO / "slurm" / "memfit-array.sbatch")],
        env=env, capture_output=True, text=True, timeout=300, cwd=REPO,
    )
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    for index, point in enumerate(("k=5", "k=10")):
        text = (tmp_path / f"task-{index}.out").read_text()
        assert f"point {index} of {SMOKE_SWEEP}" in text
        assert f"point {point} is DONE, nothing to do" in text


def test_local_launcher_skips_finished_points_stops_on_sigterm_and_resumes(cancelled_sweep: dict, tmp_path: Path,
                                                                           small_data_dir: Path) -> None:
    """Three points, two of them copied finished from the SLURM sweep: only k=3 runs. The sweep gets
    SIGTERM once k=3's store is built (its child stops with it), and a second sweep finishes k=3."""
    sweep_file = tmp_path / "local.yaml"
    sweep_file.write_text(f"name: smoke\nconfig: {REPO / 'configs' / 'smoke.yaml'}\ngrid: {{pack.k: [5, 10, 3]}}\n")
    out = tmp_path / "local"
    finished = {}
    for point in ("k=5", "k=10"):
        shutil.copytree(cancelled_sweep["out"] / "points" / point, out / "points" / point)
        finished[point] = {name: (out / "points" / point / name).read_bytes() for name in ("DONE", "predictions.jsonl")}
    command = [*MEMFIT, "sweep", "--config", str(sweep_file), "--launcher", "local", "--out", str(out)]
    env = memfit_env(small_data_dir)

    first = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env)
    timings = out / "points" / "k=3" / "timings.json"
    deadline = time.monotonic() + SWEEP_TIMEOUT_S
    while first.poll() is None and time.monotonic() < deadline:
        if timings.exists() and "build" in timings.read_text():
            first.send_signal(signal.SIGTERM)
            break
        time.sleep(0.25)
    _, stderr = first.communicate(timeout=120)
    assert first.returncode == 130, stderr[-3000:]
    assert "2 point(s) already DONE, skipped: k=5, k=10" in stderr
    assert not (out / "points" / "k=3" / "DONE").exists()
    record = next(p for p in _sweep_json(out)["points"] if p["id"] == "k=3")
    assert record["state"] == "interrupted" and record["jobs"][0]["state"] == "CANCELLED"
    child_pid = int(record["jobs"][0]["job_id"].removeprefix("local:"))
    with pytest.raises(ProcessLookupError):
        os.kill(child_pid, 0)  # stopped and reaped with the sweep

    second = subprocess.run(command, capture_output=True, text=True, timeout=SWEEP_TIMEOUT_S, cwd=REPO, env=env)
    assert second.returncode == 0, second.stderr[-3000:]
    assert sorted(p.name for p in (out / "logs").iterdir()) == ["k=3.attempt1.log", "k=3.attempt2.log"]
    for point, files in finished.items():
        for name, content in files.items():
            assert (out / "points" / point / name).read_bytes() == content
    _check_finished_point(out / "points" / "k=3", 3)
    records = {p["id"]: p for p in _sweep_json(out)["points"]}
    assert {pid: r["attempts"] for pid, r in records.items()} == {"k=5": 0, "k=10": 0, "k=3": 2}
    assert [j["state"] for j in records["k=3"]["jobs"]] == ["CANCELLED", "COMPLETED"]


def test_local_launcher_does_not_retry_a_configuration_error(tmp_path: Path) -> None:
    """A point whose run cannot start (its data file is missing: exit code 2) is reported, not retried,
    even with retries allowed; the sweep exits 1."""
    sweep_file = tmp_path / "bad.yaml"
    missing = tmp_path / "no-such-locomo.json"
    sweep_file.write_text(
        f"name: bad\nconfig: {REPO / 'configs' / 'smoke.yaml'}\nfixed: {{data.path: {missing}}}\n"
        "grid: {pack.k: [5]}\n"
    )
    out = tmp_path / "bad"
    result = subprocess.run([*MEMFIT, "sweep", "--config", str(sweep_file), "--launcher", "local", "--out", str(out),
                             "--max-requeue", "2"], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert result.returncode == 1
    assert "sweep bad: 0/1 points DONE" in result.stdout
    assert "point k=5: configuration or data error (exit code 2), not retried" in result.stderr
    record = _sweep_json(out)["points"][0]
    assert record["state"] == "error" and record["attempts"] == 1
    assert [j["state"] for j in record["jobs"]] == ["FAILED(rc=2)"]
    assert str(missing) in (out / "logs" / "k=5.attempt1.log").read_text()
    assert not (out / "points" / "k=5" / "DONE").exists()
