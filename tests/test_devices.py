"""memfit_gpu.devices: every device and dtype string the config accepts, on a CPU machine posing as two GPUs;
and every structure that picks a device picks it there."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from memfit_gpu import devices
from memfit_gpu.config import MemFitConfig, load_config
from memfit_gpu.data import load_benchmark, select_questions
from memfit_gpu.devices import first_device, reader_dtype, resolve_dtype, visible_devices, visible_gpu_ids
from memfit_gpu.index.factory import dense_gpu_id, lexical_device
from memfit_gpu.retrieve.view import ReadView


@pytest.fixture
def two_gpus(monkeypatch):
    # only the device count is asked for: parsing needs no GPU, so the answers are exact on any machine
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


def test_device_strings_with_two_gpus(two_gpus):
    both = [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert visible_devices("auto") == visible_devices("gpu") == visible_devices("cuda") == both
    assert visible_devices("cuda:0,cuda:1") == visible_devices(" cuda:0 , cuda:1 ") == both
    assert visible_devices("cuda:1") == [torch.device("cuda", 1)]
    assert first_device("gpu") == first_device("cuda:0,cuda:1") == first_device("auto") == torch.device("cuda", 0)
    assert first_device("cuda:1,cuda:0") == torch.device("cuda", 1)
    assert first_device("cpu") == torch.device("cpu")
    with pytest.raises(RuntimeError, match="torch sees 2 GPU"):
        first_device("cuda:2")


def test_device_strings_without_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert first_device("auto") == torch.device("cpu")
    with pytest.raises(RuntimeError, match="asked for GPUs but torch sees none"):
        first_device("gpu")


@pytest.mark.parametrize("setting, expected", [("gpu", 0), ("cuda:0,cuda:1", 0), ("cuda:1", 1), ("auto", 0)])
def test_store_puts_bm25_on_the_first_listed_gpu(two_gpus, setting, expected):
    # "gpu" and "cuda:0,cuda:1" are valid index.device values (the encoders replicate over
    # them) but reached torch.device as they were and crashed the store
    cfg = MemFitConfig()
    cfg.index.device = setting
    assert lexical_device(cfg.index) == torch.device("cuda", expected)  # the store's (index/factory.py)
    assert dense_gpu_id(cfg.index) == expected  # GPU FAISS beside it


def test_visible_devices_on_this_machine() -> None:
    assert visible_devices("cpu") == [torch.device("cpu")]
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    expected = [torch.device("cuda", i) for i in range(gpus)] or [torch.device("cpu")]
    assert visible_devices("auto") == expected
    assert visible_devices(["cpu", "cpu"]) == [torch.device("cpu")] * 2
    if gpus == 0:
        with pytest.raises(RuntimeError, match="sees none"):
            visible_devices("cuda")
        with pytest.raises(RuntimeError, match="sees 0 GPU"):
            visible_devices("cuda:1")


def test_gpu_ids_follow_cuda_visible_devices(two_gpus, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert visible_gpu_ids() == ["0", "1"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    assert visible_gpu_ids() == ["4", "6"]  # a child given "4" sees the GPU this process calls cuda:0
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    assert visible_gpu_ids() == []


def test_encoder_dtype_auto_is_float32_everywhere_and_an_amx_cpu_is_told_about_bf16(monkeypatch, caplog) -> None:
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    monkeypatch.setattr(devices, "_hinted", set())
    for amx in (True, False):  # a Xeon with AMX; an EPYC (AVX512-BF16)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda v=amx: v)
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
        caplog.clear()
        with caplog.at_level("INFO", logger="memfit_gpu.devices"):
            assert devices.cpu_amx() is amx and resolve_dtype("auto", [cpu], "index.dtype") == torch.float32
        told = [r.getMessage() for r in caplog.records if "AMX" in r.getMessage()]
        assert (told[0].startswith("index.dtype=auto: float32. This CPU has AMX tiles") if amx else told == []), told
        assert resolve_dtype("bf16", [cpu]) == torch.bfloat16  # a choice, on any CPU
        assert resolve_dtype("float32", [cpu]) == torch.float32 and resolve_dtype("fp16", [cpu]) == torch.float16
        # GPUs (even beside a CPU) and no device at all keep fp32: the paper's packs
        assert resolve_dtype("auto", [gpu, torch.device("cuda", 1)]) == resolve_dtype("auto", [cpu, gpu]) == torch.float32
        assert resolve_dtype("auto", []) == torch.float32
    caplog.clear()
    with caplog.at_level("INFO", logger="memfit_gpu.devices"):
        resolve_dtype("auto", [cpu], "index.dtype", amx=True)  # said once per setting and process
    assert not [r for r in caplog.records if "AMX" in r.getMessage()]
    assert resolve_dtype("fp16", [gpu]) == torch.float16
    assert resolve_dtype("fp16", [gpu]) == torch.float16
    # a V100 / T4 only emulates bf16: asking for it there is an error, not a silent slow path
    monkeypatch.setattr(devices, "_native_bf16", lambda device: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    with pytest.raises(ValueError, match="Tesla T4 .* no native bf16"):
        resolve_dtype("bf16", [gpu])
    assert resolve_dtype("bf16", [torch.device("cpu")]) == torch.bfloat16
    monkeypatch.setattr(devices, "_native_bf16", lambda device: True)
    assert resolve_dtype("bf16", [gpu]) == torch.bfloat16


def test_reader_dtype_auto_is_bf16_where_the_device_computes_it_natively(monkeypatch) -> None:
    # a CPU: bf16 with AVX512-BF16 or AMX tiles, float32 without (emulated bf16 is slower than fp32)
    for avx512_bf16, amx, want in ((False, False, torch.float32), (True, False, torch.bfloat16),
                                   (False, True, torch.bfloat16)):
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda v=avx512_bf16: v)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda v=amx: v)
        assert devices.cpu_native_bf16() == (want == torch.bfloat16)
        assert reader_dtype("auto", "cpu") == reader_dtype("auto", torch.device("cpu")) == want
    # the device plan's described node overrides the probe
    assert reader_dtype("auto", "cpu", bf16=True) == torch.bfloat16
    monkeypatch.setattr(devices, "cpu_native_bf16", lambda: True)
    assert reader_dtype("auto", "cpu") == torch.bfloat16 and reader_dtype("auto", "cpu", bf16=False) == torch.float32
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert reader_dtype("auto", "cuda") == reader_dtype("auto", "cuda:0") == torch.bfloat16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    assert reader_dtype("auto", torch.device("cuda", 1)) == torch.float16
    # an explicit dtype is taken as asked, on any device: the table the encoders read
    assert reader_dtype("bfloat16", "cpu") == torch.bfloat16 and reader_dtype("float32", "cuda") == torch.float32
    assert reader_dtype("half", "cpu") == torch.float16 and reader_dtype("float64", "cpu") == torch.float64


@pytest.mark.parametrize("setting, call", [
    ("reader.dtype", lambda: reader_dtype("int8", "cpu")),
    ("index.dtype", lambda: resolve_dtype("fp8", [torch.device("cpu")], "index.dtype")),
])
def test_bad_dtype_names_the_setting(setting, call) -> None:
    with pytest.raises(ValueError, match=rf"^{setting}='(int8|fp8)' is not a dtype: use auto or one of float32, "):
        call()


def test_read_view_puts_bm25_on_the_configured_device(locomo_path: Path) -> None:
    # ReadView.from_memories used to build its BM25 on the CPU whatever index.device said. "cpu:0" is
    # a device this machine has that differs from the default torch.device("cpu"), so the test can fail.
    cfg = load_config("configs/memfit.yaml", ["index.device=cpu:0", "index.dense_device=cpu"])
    memory = select_questions(load_benchmark("locomo", locomo_path), limit_memories=1).memories[0]
    vectors = np.random.default_rng(0).standard_normal((len(memory.turns()), 384)).astype(np.float32)
    view = ReadView.from_memories([memory], None, cfg, embeddings=torch.from_numpy(vectors))
    assert view.ep_bm25.device == first_device(cfg.index.device) == torch.device("cpu", 0)
    scores, rows = view.ep_bm25.search([["caroline"]], [0], 3)
    assert rows.device.type == "cpu" and int(rows[0, 0]) >= 0


def test_in_fresh_thread_runs_on_a_thread_that_then_ends() -> None:
    seen: list[threading.Thread] = []

    def work(a: int, b: int = 0) -> int:
        seen.append(threading.current_thread())
        return a + b

    assert devices.in_fresh_thread(work, 2, b=3) == 5
    assert seen[0] is not threading.current_thread()
    assert not seen[0].is_alive()

    def fail() -> None:
        raise KeyError("from the thread")

    with pytest.raises(KeyError, match="from the thread"):
        devices.in_fresh_thread(fail)
