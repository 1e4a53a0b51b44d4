"""memfit_gpu: MemFit long-term conversational memory, batched on GPUs (arXiv 2610.00872)."""

from __future__ import annotations

import importlib
import os
from typing import Any

__version__ = "0.1.0"

# torch's CPU kernels (oneDNN, and ideep over it) keep a compiled primitive for every input shape they meet, up
# to 1,024 in each of two caches, at about half a MiB each. A served memory meets a new shape with nearly every
# request (each batch's token count), so after 20,000 requests it held about 1 GiB more than a fresh server over
# the same data (experiments/bench_soak.py). 32 entries keep the shapes that repeat (a decode step, a warm
# batch) at no measured cost in speed. Read by torch when it first runs such a kernel, so it is set here, on the
# way into any memfit module; a value already in the environment wins.
ONEDNN_CACHE_CAPACITY = "32"
for _variable in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
    os.environ.setdefault(_variable, ONEDNN_CACHE_CAPACITY)

# `from memfit_gpu import Memory` (the live memory API, memfit_gpu/live/) resolves on first use: importing the
# package itself must stay light, since every `memfit` command and every submodule import goes through here.
_LAZY = {"Memory": "memfit_gpu.live"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'memfit_gpu' has no attribute {name!r}")
