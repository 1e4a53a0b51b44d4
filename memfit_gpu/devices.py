"""Device strings of the config (`index.device`) -> torch devices: the one parser every user shares.

    visible_devices("auto")          every visible GPU, else [cpu]
    visible_devices("cuda:0,cuda:1") [cuda:0, cuda:1];  "cuda" / "gpu": every GPU (an error without one)
    first_device(spec)               where a single-device structure (the BM25 index) lives: the first one
    device_guard(device)             the context a kernel launch runs under (the tensors' GPU)
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["device_guard", "first_device", "visible_devices"]


def _gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def visible_devices(device: str | torch.device | Sequence[str] = "auto") -> list[torch.device]:
    """Devices to place replicas on: "auto" = every visible GPU, else the CPU.

    Also accepts "cpu", "cuda" or "gpu" (every GPU), "cuda:1", a comma list "cuda:0,cuda:2" or a list.
    """
    if isinstance(device, torch.device):
        return [device]
    if not isinstance(device, str):
        return [d for item in device for d in visible_devices(item)]
    spec = device.strip().lower()
    if "," in spec:
        return [d for item in spec.split(",") if item.strip() for d in visible_devices(item)]
    if spec in ("auto", "cuda", "gpu"):
        count = _gpu_count()
        if count:
            return [torch.device("cuda", i) for i in range(count)]
        if spec != "auto":
            raise RuntimeError(f"device={device!r} asked for GPUs but torch sees none")
        return [torch.device("cpu")]
    parsed = torch.device(spec)
    if parsed.type == "cuda":
        count = _gpu_count()
        index = 0 if parsed.index is None else parsed.index
        if index >= count:
            raise RuntimeError(f"device={device!r}: torch sees {count} GPU(s)")
        return [torch.device("cuda", index)]
    return [parsed]


def first_device(device: str | torch.device | Sequence[str] = "auto") -> torch.device:
    """The device of a structure that lives on one device only (the BM25 index): the first listed.

    "gpu" and "cuda:0,cuda:1" are valid `index.device` values (the encoders replicate over them),
    so they must not reach `torch.device` as they are."""
    devices = visible_devices(device)
    if not devices:
        raise RuntimeError(f"device={device!r} names no device")
    return devices[0]


def device_guard(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """Make ``device`` current while a kernel launches: Triton launches on the current CUDA device
    and its current stream, so without this a tensor on cuda:1 would be touched by a launch on
    cuda:0 (an illegal access), or race the torch work queued on cuda:1's stream."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()
