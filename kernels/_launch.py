"""What every kernel launch shares: finding Triton, loading a kernel module, the device checks.

Each Triton kernel lives in its own module (`_<name>_triton.py`) that imports triton at its top and
defines the kernel at module level, so the JIT finds `tl` among the module's globals (a kernel that
reads `tl` from a closure compiles only on Triton >= 3.4). Those modules are imported on the first
launch, not with the package: ``TRITON_INTERPRET=1`` is read when a kernel is decorated, so a caller
may still set it after importing memfit_gpu (the tests run kernels on CPU tensors that way), and a
CPU-only install needs no Triton at all.
"""

from __future__ import annotations

import functools
import importlib
import os
from types import ModuleType

import torch

from memfit_gpu.devices import device_guard

__all__ = ["device_guard", "interpreting", "launch_device", "load", "next_power_of_two", "triton_available"]


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
