"""memfit_gpu.devices: every device and dtype string the config accepts, on a CPU machine posing as two GPUs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from memfit_gpu import devices
from memfit_gpu.config import MemFitConfig
from memfit_gpu.devices import first_device, resolve_dtype, visible_devices
from memfit_gpu.store.episodes import EpisodeStore


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
    # issue 13.3: "gpu" and "cuda:0,cuda:1" are valid index.device values (the encoders replicate over
    # them) but reached torch.device as they were and crashed the store
    cfg = MemFitConfig()
    cfg.index.device = setting
    assert EpisodeStore._bm25_device(SimpleNamespace(cfg=cfg)) == torch.device("cuda", expected)


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


def test_encoder_dtype_auto_is_float32_everywhere_and_bf16_needs_native_support(monkeypatch) -> None:
    gpu = torch.device("cuda", 0)
    assert resolve_dtype("auto", [torch.device("cpu")]) == torch.float32
    assert resolve_dtype("auto", [gpu, torch.device("cuda", 1)]) == torch.float32
    assert resolve_dtype("fp16", [gpu]) == torch.float16
    # a V100 / T4 only emulates bf16: asking for it there is an error, not a silent slow path
    monkeypatch.setattr(devices, "_native_bf16", lambda device: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    with pytest.raises(ValueError, match="Tesla T4 .* no native bf16"):
        resolve_dtype("bf16", [gpu])
    assert resolve_dtype("bf16", [torch.device("cpu")]) == torch.bfloat16
    monkeypatch.setattr(devices, "_native_bf16", lambda device: True)
    assert resolve_dtype("bf16", [gpu]) == torch.bfloat16
