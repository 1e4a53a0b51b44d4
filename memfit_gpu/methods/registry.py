"""Method name -> implementation (the `method` key; names in config.METHODS).

`memfit` and `plain` run MemFit's own path in memfit_gpu.pipeline (store, summaries, batched
retrieval), `plain` with its fixed switches (`memfit_path_config`). The others are `Method`s
(methods/base.py) with a write and a read step of their own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from memfit_gpu.config import METHODS, ConfigError, MemFitConfig
from memfit_gpu.methods.base import Method
from memfit_gpu.methods.full_context import FullContext
from memfit_gpu.methods.lightmem import LightMem
from memfit_gpu.methods.naive_rag import NaiveRAG
from memfit_gpu.methods.plain import SWITCHES, plain_config

OWN_PATH: dict[str, Callable[[], Method]] = {"naive_rag": NaiveRAG, "full_context": FullContext,
                                               "lightmem_slm": LightMem}
# methods whose read path calls an LLM: `memfit retrieve` (LLM-free) refuses them
NEEDS_READER_TO_RETRIEVE = ("lightmem_slm",)
# methods that read their memory as it stood at a point of the trajectory (`read_at`): eval.growth_points
GROWTH_METHODS = ("lightmem_slm", "naive_rag")


def memfit_path_config(cfg: MemFitConfig) -> MemFitConfig | None:
    """The configuration MemFit's own path runs with for this method; None for a method with its own."""
    if cfg.method == "memfit":
        return cfg
    if cfg.method == "plain":
        return plain_config(cfg)
    return None


def method_info(cfg: MemFitConfig) -> dict[str, Any]:
    """What diagnostics.json records of a MemFit-path method: its name, and plain's fixed switches."""
    if cfg.method == "plain":
        return {"name": "plain", "switches": {**SWITCHES, "summary.enabled": False}}
    return {"name": cfg.method}


def make_method(name: str) -> Method:
    """A fresh instance of a method with its own path (it holds its write-time state until read)."""
    if name not in OWN_PATH:
        raise ConfigError(f"method={name!r} has no write/read path of its own (methods: {', '.join(METHODS)})")
    return OWN_PATH[name]()
