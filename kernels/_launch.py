"""What every kernel launch shares: finding Triton, loading a kernel module, the device checks.

Each Triton kernel lives in its own module (`_<name>_triton.py`) that imports triton at its top and
defines the kernel at module level, so the JIT finds `tl` among the module's globals (a kernel that
reads `tl` from a closure compiles only on Triton >= 3.4). Those modules are imported on the first
launch, not with the package: ``TRITON_INTERPRET=1`` is read when a kernel is decorated, so a caller
may still set it after importing memfit_gpu (the tests run kernels on CPU tensors that way), and a
CPU-only install needs no Triton at all.

Every launch goes through `launch`, which also serves the GPU check (experiments/gpu_check.py): inside
`recording_launches()` each launch is synchronised and timed, and each variant (kernel, device and its
constexpr values, i.e. one compiled binary) keeps the seconds of its first launch, which on a GPU is
Triton's compile plus one run. Outside a recording a launch costs one global lookup more.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import time
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import torch

from memfit_gpu.devices import device_guard

__all__ = ["LaunchRecord", "device_guard", "interpreting", "launch", "launch_device", "load", "next_power_of_two",
           "recording_launches", "triton_available"]


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreting() -> bool:
    """Triton's interpreter is on (kernels then run on CPU tensors, for tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0", "false", "False")


@functools.cache
def load(name: str) -> ModuleType:
    """The kernel module ``memfit_gpu.kernels.<name>``, imported on first use (see module doc)."""
    if not triton_available():
        raise RuntimeError("the Triton kernels need the triton package (pip install -e '.[dev]' or a CUDA torch)")
    return importlib.import_module(f"{__package__}.{name}")


def launch_device(**tensors: torch.Tensor) -> torch.device:
    """The one device all of a launch's tensors live on; Triton needs CUDA tensors unless interpreting.

    A kernel reads every pointer on the device it runs on, so a tensor left on another device is an
    illegal access on a GPU: refuse it here with its name."""
    devices = {name: t.device for name, t in tensors.items()}
    first_name, device = next(iter(devices.items()))
    for name, other in devices.items():
        if other != device:
            raise ValueError(f"kernel launch: {name} is on {other} but {first_name} is on {device}")
    if device.type != "cuda" and not interpreting():
        raise ValueError(f"kernel launch: tensors are on {device}; Triton runs on CUDA tensors "
                         "(or on CPU tensors under TRITON_INTERPRET=1)")
    return device


def next_power_of_two(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


class LaunchRecord:
    """Launches seen inside one `recording_launches()`, by variant (kernel, device, constexpr values)."""

    def __init__(self) -> None:
        self.variants: dict[tuple[Any, ...], dict[str, Any]] = {}

    def add(self, kernel: str, device: torch.device, constexprs: dict[str, Any], seconds: float) -> None:
        key = (kernel, str(device), tuple(sorted(constexprs.items())))
        row = self.variants.get(key)
        if row is None:
            # first_launch_s: on a GPU the compile (or a load from Triton's cache) plus one run. Triton also
            # specialises integer arguments equal to 1 and pointers or integers divisible by 16: such a
            # second binary of the same variant shows as max_launch_s.
            row = self.variants[key] = {"kernel": kernel, "device": str(device), **constexprs, "launches": 0,
                                        "first_launch_s": round(seconds, 6), "total_s": 0.0, "max_launch_s": 0.0}
        row["launches"] += 1
        row["total_s"] = round(row["total_s"] + seconds, 6)
        row["max_launch_s"] = round(max(row["max_launch_s"], seconds), 6)

    def rows(self) -> list[dict[str, Any]]:
        return [dict(row) for row in self.variants.values()]


_RECORD: LaunchRecord | None = None


@contextlib.contextmanager
def recording_launches() -> Iterator[LaunchRecord]:
    """Time every kernel launch made inside (synchronised before and after; for the GPU check)."""
    global _RECORD
    previous, _RECORD = _RECORD, LaunchRecord()
    try:
        yield _RECORD
    finally:
        _RECORD = previous


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def launch(kernel_name: str, kernel: Any, grid: tuple[int, ...], device: torch.device, *args: Any,
           constexprs: dict[str, Any], **options: Any) -> None:
    """`kernel[grid](*args, **constexprs, **options)` on the current device (the caller holds its
    device_guard); timed per variant while `recording_launches()` is active."""
    record = _RECORD
    if record is None:
        kernel[grid](*args, **constexprs, **options)
        return
    _sync(device)
    start = time.perf_counter()
    kernel[grid](*args, **constexprs, **options)
    _sync(device)
    record.add(kernel_name, device, constexprs, time.perf_counter() - start)
