"""The device plan (plan.py, `memfit plan`, preflight): placement, refusals naming the key to change, and its
BM25 / vector byte constants calibrated against real structures built from LoCoMo on the CPU."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from support.env import memfit_env

from memfit_gpu.config import ConfigError, MemFitConfig, load_config
from memfit_gpu.data import load_benchmark
from memfit_gpu.evaluate.judge import judge_settings
from memfit_gpu.plan import (
    GIB,
    Gpu,
    Node,
    bm25_bytes,
    described_node,
    estimate_workload,
    make_plan,
    model_size,
    render,
    vector_bytes,
)
from memfit_gpu.plan import build as plan_build
from memfit_gpu.plan import node as plan_node
from memfit_gpu.store import EpisodeStore

REPO = Path(__file__).resolve().parents[2]
SMOKE = REPO / "configs" / "smoke.yaml"
LME_S = REPO / "configs" / "experiments" / "longmemeval_s_qwen3_8b.yaml"


def node(gpus: int, gib: float, host_gib: float = 512, faiss_gpu: bool = True) -> Node:
    return Node(tuple(Gpu(i, "test GPU", int(gib * GIB)) for i in range(gpus)), int(host_gib * GIB), "test node",
                faiss_gpu)


class RandomEncoder:
    """Unit vectors of the encoder's width: the dense index's bytes do not depend on their values."""

    dim = 384

    def encode(self, texts: list[str], batch_size: int = 128, progress: bool = False) -> torch.Tensor:
        vectors = torch.randn(len(texts), self.dim, generator=torch.Generator().manual_seed(len(texts)))
        return vectors / vectors.norm(dim=1, keepdim=True)

    def info(self) -> dict[str, str]:
        return {}


@pytest.fixture(scope="module")
def locomo_cfg(locomo_path: Path) -> MemFitConfig:
    return load_config(None, [f"data.path={locomo_path}", "index.device=cpu", "index.dense_device=cpu",
                              "summary.enabled=false"])


@pytest.fixture(scope="module")
def locomo_store(locomo_cfg: MemFitConfig, locomo_path: Path) -> EpisodeStore:
    """The whole of LoCoMo in a real in-memory store (real BM25Index and DenseIndex, random vectors)."""
    store = EpisodeStore(None, locomo_cfg, RandomEncoder())
    store.add_memories(load_benchmark("locomo", locomo_path).memories, progress=False)
    return store


def _state_tensor_bytes(state: dict) -> int:
    return sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))


# BM25: the plan predicts state format 2 (int32 post_term and post_tf: 8 B a posting; a term -> token
# table). The counts come from the same tokeniser, so the whole file predicts the state to within ~2 %;
# the sampled workload moves it by up to ~4 % more (LoCoMo, 1,500-episode samples, seeds 0-2).
BM25_RATIO = (0.98, 1.02)


def test_bm25_bytes_predicted_from_the_file_match_the_real_index(locomo_cfg: MemFitConfig, locomo_store: EpisodeStore):
    workload = estimate_workload(locomo_cfg)
    assert workload.from_file and workload.episodes == locomo_store.size == 5882
    assert workload.sampled == "all 5,882 episodes tokenised"
    measured = _state_tensor_bytes(locomo_store.episode_bm25.state_dict())
    predicted = bm25_bytes(workload.postings, workload.episodes, workload.terms)["state"]
    assert BM25_RATIO[0] <= measured / predicted <= BM25_RATIO[1], (measured, predicted)


@pytest.mark.parametrize("seed", [0, 1])
def test_bm25_bytes_from_a_sample_of_memories(locomo_cfg: MemFitConfig, locomo_store: EpisodeStore, seed: int):
    workload = estimate_workload(locomo_cfg, sample_episodes=1500, seed=seed)
    assert "scaled" in workload.sampled
    measured = _state_tensor_bytes(locomo_store.episode_bm25.state_dict())
    predicted = bm25_bytes(workload.postings, workload.episodes, workload.terms)["state"]
    assert BM25_RATIO[0] * 0.96 <= measured / predicted <= BM25_RATIO[1] * 1.04, (measured, predicted)


def test_vector_bytes_match_the_real_dense_index(locomo_cfg: MemFitConfig, locomo_store: EpisodeStore):
    """Rows x the encoder's width (read from its weights on disk) x float32: exact (1 % allowed)."""
    workload = estimate_workload(locomo_cfg)
    encoder = model_size(locomo_cfg.index.encoder, torch.float32)
    assert encoder.source.startswith("on disk") and encoder.get("hidden_size") == 384
    dense = locomo_store.episode_dense
    measured = dense.vectors(np.arange(dense.size)).nbytes
    assert measured == pytest.approx(vector_bytes(workload.episodes, encoder.get("hidden_size")), rel=0.01)


def test_published_shape_when_the_file_is_absent(tmp_path: Path):
    cfg = load_config(LME_S, [f"data.path={tmp_path / 'missing'}"])
    workload = estimate_workload(cfg)
    assert not workload.from_file and "published shape longmemeval-s" in workload.source
    assert workload.memories == 500 and workload.questions == 500 and workload.episodes == 275_000
    assert 100 <= workload.tokens / workload.episodes <= 250  # ~115k tokens a history, scaled to BM25 tokens
    unknown = estimate_workload(load_config(None, ["data.benchmark=memgallery", f"data.path={tmp_path / 'x'}"]))
    assert unknown.unknown and "UNKNOWN" in unknown.describe()


def test_model_sizes_from_disk_table_or_unknown(caplog: pytest.LogCaptureFixture):
    assert model_size("sentence-transformers/all-MiniLM-L6-v2").source.startswith("on disk")
    qwen = model_size("Qwen/Qwen3-8B")
    assert qwen.known and 15 * GIB < qwen.weight_bytes < 16 * GIB  # bf16, the published checkpoint
    assert qwen.kv_bytes_per_token() == 2 * 36 * 8 * 128 * 2
    mystery = model_size("nobody/no-such-model")
    assert not mystery.known and "UNKNOWN" in mystery.source
    assert "UNKNOWN" in caplog.text


def test_retrieval_goes_on_a_gpu_the_engines_do_not_use(locomo_path: Path):
    cfg = load_config(LME_S, [f"data.path={locomo_path}", "data.benchmark=locomo", "data.split=null"])
    four = make_plan(cfg, node(4, 96))
    assert four.fits and four.engine_gpus == {"reader": [[0], [1], [2]]}
    assert four.placed(cfg).index.device == "cuda:3" and cfg.index.device == "auto"
    bm25 = next(p for p in four.parts if p.name == "BM25 episodes")
    assert bm25.where == "cuda:3" and set(bm25.gpu) == {3}
    # three GPUs, three engines: retrieval beside the engine on GPU 0 only, counted with its claim
    three = make_plan(cfg, node(3, 96))
    assert three.placed(cfg).index.device == "cuda:0"
    total = three.gpu_totals()[0]
    assert total.claims == int(0.9 * 96 * GIB) and total.resident > 0 and total.fits
    assert three.gpu_totals()[1].resident == 0  # no memfit context on the other engine GPUs
    # an explicit index.device is kept; a transformers reader claims nothing and moves nothing
    assert make_plan(load_config(LME_S, [f"data.path={locomo_path}", "data.benchmark=locomo", "data.split=null", "index.device=cpu"]),
                     node(4, 96)).retrieval_spec == "cpu"
    smoke = load_config(SMOKE, [f"data.path={locomo_path}"])
    assert make_plan(smoke, node(2, 96)).placed(smoke) is smoke


def test_vllm_reader_and_retrieval_on_a_small_gpu_are_refused_naming_the_key(locomo_path: Path):
    cfg = load_config(SMOKE, [f"data.path={locomo_path}", "reader.backend=vllm"])
    small = make_plan(cfg, node(1, 8))
    assert not small.fits
    with pytest.raises(ConfigError) as info:
        small.check()
    message = str(info.value)
    assert "\n" not in message and message.startswith("GPU cuda:0 (8.0 GiB) does not fit")
    assert "reader.gpu_memory_utilization<=" in message and "index.device=cpu" in message
    assert small.problems[0].key == "reader.gpu_memory_utilization"
    assert "DOES NOT FIT" in render(small)
    # the key it names works: at the utilisation it suggests the same run fits
    room = message.split("reader.gpu_memory_utilization<=")[1].split()[0]
    assert make_plan(load_config(SMOKE, [f"data.path={locomo_path}", "reader.backend=vllm",
                                         f"reader.gpu_memory_utilization={room}"]), node(1, 8)).fits


def test_a_vllm_judge_is_a_second_claim(locomo_path: Path):
    cfg = load_config(LME_S, [f"data.path={locomo_path}", "data.benchmark=locomo", "data.split=null",
                              "eval.judge.backend=vllm", "eval.judge.model=Qwen/Qwen3-8B"])
    refused = make_plan(cfg, node(4, 96))  # the judge's settings derived from cfg
    assert refused.engine_gpus["judge"] == refused.engine_gpus["reader"]
    assert make_plan(cfg, node(4, 96), judge=judge_settings(cfg)).engine_gpus == refused.engine_gpus  # a run's
    assert "judge" not in make_plan(cfg, node(4, 96), judge=None).engine_gpus  # the plan plans the judge given
    assert not refused.fits and "vLLM judge engines claim 86.4 GiB" in refused.problems[0].message
    assert "eval.judge.backend=openai" in refused.problems[0].message


def test_too_few_gpus_for_the_engines_and_an_engine_its_claim_cannot_hold(locomo_path: Path):
    cfg = load_config(LME_S, [f"data.path={locomo_path}", "data.benchmark=locomo", "data.split=null"])
    few = make_plan(cfg, node(2, 96))
    assert few.problems[0].key == "reader.instances" and "needs 3 GPUs" in few.problems[0].message
    tight = make_plan(load_config(LME_S, [f"data.path={locomo_path}", "data.benchmark=locomo", "data.split=null",
                                          "reader.gpu_memory_utilization=0.15"]), node(4, 96))
    assert any("KV cache for one 32768-token sequence" in p.message for p in tight.problems)


def test_without_gpus_only_the_host_is_checked(locomo_path: Path):
    cfg = load_config(SMOKE, [f"data.path={locomo_path}", "reader.backend=vllm"])
    cpu = make_plan(cfg, node(0, 0, host_gib=64))
    assert cpu.fits and not cpu.gpu_checked and "GPU check skipped" in render(cpu)
    tiny = make_plan(cfg, node(0, 0, host_gib=1))
    assert not tiny.fits and tiny.problems[0].message.startswith("host memory:")


def test_memfit_plan_exits_2_with_the_key(locomo_path: Path, shared_data: Path):
    env = memfit_env(shared_data)
    proc = subprocess.run([sys.executable, "-m", "memfit_gpu.cli", "plan", "--config", str(SMOKE), "--gpus", "1",
                           "--gpu-mem-gib", "8", "--host-mem-gib", "64", "reader.backend=vllm"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "verdict: DOES NOT FIT" in proc.stdout and "cuda:0" in proc.stdout
    error = [line for line in proc.stderr.splitlines() if line.startswith("memfit plan: error:")]
    assert len(error) == 1 and "reader.gpu_memory_utilization<=" in error[0]
    fits = subprocess.run([sys.executable, "-m", "memfit_gpu.cli", "plan", "--config", str(SMOKE), "--gpus", "2",
                           "--gpu-mem-gib", "96", "--host-mem-gib", "64", "reader.backend=vllm"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert fits.returncode == 0 and "verdict: fits" in fits.stdout and "index.device -> cuda:1" in fits.stdout


def test_memfit_plan_plans_the_judge_when_it_is_on(capsys: pytest.CaptureFixture[str]):
    """`memfit plan` derives the judge's settings from the configuration (a run passes its inputs' own)."""
    from memfit_gpu.cli import main

    asked = ["plan", "--config", str(SMOKE), "--gpus", "2", "--gpu-mem-gib", "96", "--host-mem-gib", "64", "--json",
             "reader.backend=vllm", "reader.gpu_memory_utilization=0.4", "eval.judge.backend=vllm"]
    for judged, engines in (("false", ["reader"]), ("true", ["reader", "judge"])):
        assert main([*asked, f"eval.judge.enabled={judged}"]) == 0
        assert list(json.loads(capsys.readouterr().out)["engine_gpus"]) == engines


def test_each_encoder_s_worker_processes_are_planned(locomo_path: Path):
    """The bi-encoder and the cross-encoder each start a pool of worker processes, one per device (both are fed
    by index.encoder_workers); the plan counted the bi-encoder's only: a CUDA context and a process per GPU
    short, and a fits-or-not verdict that could be wrong."""
    overrides = [f"data.path={locomo_path}", "index.device=cuda:0,cuda:1", "index.encoder_workers=processes"]
    with_ce = make_plan(load_config(SMOKE, [*overrides, "rerank.backend=cross-encoder"]), node(2, 96))
    names = [p.name for p in with_ce.parts]
    assert "encoder worker processes x2" in names and "cross-encoder worker processes x2" in names, names
    ce = next(p for p in with_ce.parts if p.name == "cross-encoder worker processes x2")
    assert set(ce.gpu) == {0, 1} and ce.gpu[1] == plan_build.CUDA_CONTEXT_BYTES
    without = make_plan(load_config(SMOKE, [*overrides, "rerank.backend=none"]), node(2, 96))
    assert "cross-encoder worker processes x2" not in [p.name for p in without.parts]


def test_the_plans_in_the_gpu_server_guide_are_what_memfit_plan_prints(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch,
                                                                          capsys: pytest.CaptureFixture[str]):
    """docs/how-to/gpu-server.md shows `memfit plan` with its output: each is what the command prints now (no
    benchmark file, as on the machine that printed them: the published shape)."""
    from memfit_gpu.cli import main

    monkeypatch.delenv("MEMFIT_DATA_DIR", raising=False)
    monkeypatch.setenv("MEMFIT_CACHE", str(tmp_path / "cache"))  # an empty fetch cache
    guide = (REPO / "docs" / "how-to" / "gpu-server.md").read_text()
    shown = re.findall(r"```\n\$ memfit (plan [^\n]+)\n(.*?)```", guide, flags=re.S)
    assert len(shown) == 2
    monkeypatch.chdir(REPO)
    for command, printed in shown:
        assert main(shlex.split(command)) == 0
        assert capsys.readouterr().out == printed, command


def test_memfit_run_is_refused_in_preflight_and_leaves_no_config(tmp_path: Path, shared_data: Path,
                                                                  monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]):
    from memfit_gpu.cli import main

    monkeypatch.setenv("MEMFIT_DATA_DIR", str(shared_data))
    monkeypatch.setattr(plan_build, "describe_node", lambda: node(1, 8))  # where make_plan looks it up
    out = tmp_path / "run"
    code = main(["run", "--config", str(SMOKE), "--out", str(out), "--quiet", "reader.backend=vllm"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("memfit run: error: GPU cuda:0 (8.0 GiB) does not fit")
    assert "reader.gpu_memory_utilization<=" in err[-1]
    assert not (out / "config.yaml").exists()


def test_gpu_memory_without_gpus_is_refused_on_a_machine_without_gpus(monkeypatch: pytest.MonkeyPatch):
    """`memfit plan --gpu-mem-gib 80` on a machine without GPUs changed nothing, and the node line still said
    it was applied."""
    monkeypatch.setattr(plan_node, "describe_node", lambda: Node((), 64 * GIB, "this machine", False))
    with pytest.raises(ConfigError, match="--gpu-mem-gib on a machine without GPUs describes no GPU: give --gpus"):
        described_node(gpu_mem_gib=80)
    assert [g.total_bytes for g in described_node(gpus=2, gpu_mem_gib=80).gpus] == [80 * GIB] * 2


def test_described_node_defaults_to_this_machine():
    here = described_node()
    assert here.source == "this machine" and here.host_bytes > 0
    four = described_node(4, 96, 512)
    assert len(four.gpus) == 4 and four.gpus[3].total_bytes == 96 * GIB and four.faiss_gpu
    assert described_node(4, 96, 512, faiss_gpu=False).faiss_gpu is False
