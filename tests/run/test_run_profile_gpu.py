"""`memfit profile`'s GPU accounting on the CPU: NVML devices restricted to CUDA_VISIBLE_DEVICES (by index
or UUID, as the variable spells them), a device NVML refuses skipped, memfit's own torch memory, and the
scaling sweep's BM25 on the configured device. The NVML module is a fake made to provoke the mapping: its
numbers are inputs of these tests, never measurements. And the stage table of a judged run's files."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from memfit_gpu.config import load_config
from memfit_gpu.devices import first_device
from memfit_gpu.readers.ledger import Ledger, RoleStats
from memfit_gpu.run.profile import GpuSampler, memfit_gpu_memory, scaling_sweep, stage_table, visible_gpus


class FakeNvmlError(Exception):
    pass


class FakeNvml:
    """Four devices in NVML (PCI) order; device `refuse` answers memory queries with an error (a cgroup)."""

    UUIDS = ["GPU-aaaa1111-0000-0000-0000-000000000000", "GPU-bbbb2222-0000-0000-0000-000000000000",
             "GPU-cccc3333-0000-0000-0000-000000000000", "GPU-dddd4444-0000-0000-0000-000000000000"]

    def __init__(self, refuse: int | None = None, pid: int | None = None):
        self.refuse = refuse
        self.pid = pid

    def nvmlInit(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        return len(self.UUIDS)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetUUID(self, handle: int) -> bytes:
        return self.UUIDS[handle].encode()

    def nvmlDeviceGetName(self, handle: int) -> str:
        return f"fake-{handle}"

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> Any:
        if handle == self.refuse:
            raise FakeNvmlError("NVML_ERROR_NO_PERMISSION")
        return SimpleNamespace(used=(handle + 1) * 2**30)

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> Any:
        return SimpleNamespace(gpu=10 * handle)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list[Any]:
        return [SimpleNamespace(pid=self.pid, usedGpuMemory=2**29)] if self.pid is not None else []


@pytest.mark.parametrize(("spec", "nvml_indices"), [
    (None, [0, 1, 2, 3]),
    ("2,0", [2, 0]),
    ("GPU-cccc3333-0000-0000-0000-000000000000,GPU-aaaa1111-0000-0000-0000-000000000000", [2, 0]),
    ("GPU-dddd,GPU-bbbb", [3, 1]),  # unique UUID prefixes, as CUDA accepts them
    ("1,7,2", [1]),  # CUDA stops at the first entry that names no device
    ("1,1", [1]),
    ("-1", []),
    ("", []),
])
def test_visible_gpus_follow_cuda_visible_devices(spec: str | None, nvml_indices: list[int]):
    env = {} if spec is None else {"CUDA_VISIBLE_DEVICES": spec}
    gpus, note = visible_gpus(FakeNvml(), env)
    assert [g.nvml_index for g in gpus] == nvml_indices
    assert [g.index for g in gpus] == list(range(len(nvml_indices)))  # torch's cuda:<n> order
    assert all(g.uuid == FakeNvml.UUIDS[g.nvml_index] for g in gpus)
    if spec:
        assert note.startswith(f"CUDA_VISIBLE_DEVICES={spec}:")


def test_index_spelling_warns_about_the_device_order():
    _, note = visible_gpus(FakeNvml(), {"CUDA_VISIBLE_DEVICES": "2,0"})
    assert "CUDA_DEVICE_ORDER=PCI_BUS_ID" in note
    _, note = visible_gpus(FakeNvml(), {"CUDA_VISIBLE_DEVICES": "2,0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"})
    assert "CUDA_DEVICE_ORDER" not in note


def test_sampler_reports_visible_devices_only_and_skips_a_refused_one(monkeypatch: pytest.MonkeyPatch):
    import os

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    sampler = GpuSampler(nvml=FakeNvml(refuse=1, pid=os.getpid()))
    assert sampler.available
    sampler.sample()
    sampler.sample()
    summary = sampler.summary()
    rows = summary["gpus"]
    assert [(r["index"], r["visible_as"], r["nvml_index"]) for r in rows] == [(0, "3", 3), (1, "1", 1)]
    assert rows[0]["device_used_peak_gib"] == 4.0 and rows[0]["samples"] == 2 and rows[0]["errors"] == 0
    assert rows[0]["memfit_process_used_peak_gib"] == 0.5  # NVML's figure for this pid
    assert rows[1]["samples"] == 0 and rows[1]["errors"] == 2  # refused, not fatal
    assert "2 of 4 NVML devices" in summary["mapping"]


def test_no_visible_gpu_is_reported_not_raised(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    sampler = GpuSampler(nvml=FakeNvml())
    assert not sampler.available and "no visible GPU" in sampler.summary()["reason"]


def test_memfit_memory_is_empty_without_cuda():
    assert memfit_gpu_memory() == []


def test_scaling_sweep_builds_bm25_on_the_configured_device():
    cfg = load_config(None, ["index.device=cpu", "index.dense_device=cpu", "retrieve.kernels=torch"])
    rows = scaling_sweep(cfg, (300,), n_queries=4, progress=False)
    assert rows[0]["bm25_device"] == str(first_device(cfg.index.device)) == "cpu"
    assert rows[0]["dense_placement"].startswith("CPU")


def test_the_read_stage_is_the_answer_calls_and_the_judge_has_its_own(tmp_path: Path):
    """`read` was timings.answer, the whole answer stage, which holds the judge's calls (on its own thread behind
    the answers) and the models' loading, over a count of answers alone: a judged run's answers/s counted the judge's
    time. The read stage is the answer calls' wall time; the judge's is a stage of its own."""
    ledger = Ledger()
    ledger.roles["answer"] = RoleStats(calls=6, wall_s=4.0)
    ledger.roles["judge"] = RoleStats(calls=5, cached=1, wall_s=9.0)
    (tmp_path / "ledger.json").write_text(ledger.to_json())
    (tmp_path / "timings.json").write_text(json.dumps({"load": 1.0, "build": 2.0, "retrieve": 0.5, "answer": 12.0}))
    (tmp_path / "diagnostics.json").write_text(json.dumps({"questions_total": 6, "retrieve_stage_seconds": {}}))
    stages = stage_table(tmp_path)
    assert {k: stages["read"][k] for k in ("seconds", "items", "unit", "items_per_s")} == {
        "seconds": 4.0, "items": 6, "unit": "answers", "items_per_s": 1.5}
    assert {k: stages["judge"][k] for k in ("seconds", "items", "unit", "items_per_s")} == {
        "seconds": 9.0, "items": 6, "unit": "calls", "items_per_s": 6 / 9.0}
    assert stages["read"]["share"] == 4.0 / 13.0  # of the stages' summed seconds
