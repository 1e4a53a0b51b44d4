"""memfit_gpu.devices: every index.device string the config accepts, on a CPU machine posing as two GPUs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from memfit_gpu.config import MemFitConfig
from memfit_gpu.devices import first_device, visible_devices
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
