"""memfit_gpu: MemFit long-term conversational memory, batched on GPUs (arXiv 2610.00872)."""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# `from memfit_gpu import Memory` (the live memory API, memfit_gpu/live/) resolves on first use: importing the
# package itself must stay light, since every `memfit` command and every submodule import goes through here.
_LAZY = {"Memory": "memfit_gpu.live"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'memfit_gpu' has no attribute {name!r}")
