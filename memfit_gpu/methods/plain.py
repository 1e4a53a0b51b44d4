"""Plain retrieval as a method: MemFit's store, encoders, hybrid search, reranker and reader with every
MemFit addition off (SPEC: "Plain retrieval = all off, same store, same encoders, same cross-encoder,
same reader").

`method=plain` is MemFit's method (methods/memfit.py: store -> retrieve) with exactly the switches of
configs/ablations/plain_retrieval.yaml applied over the run's configuration, and no summaries: plain
retrieval never reads them, so building them would only spend write-time calls it does not use.
config.yaml keeps the configuration as given (with method: plain); the switches are fixed by the method,
and diagnostics.json records them under `method`. To vary one of them, run method=memfit with the
ablation file's keys instead.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from memfit_gpu.config import MemFitConfig
from memfit_gpu.methods.memfit import MemFit

# configs/ablations/plain_retrieval.yaml, key by key (tests/methods/test_methods.py checks that they agree)
SWITCHES: dict[str, Any] = {
    "retrieve.scan_top_k": 30,
    "retrieve.summaries": False,
    "retrieve.summary_expansion": False,
    "retrieve.prf.enabled": False,
    "rerank.rerank_pool": 40,
    "pack.context_window": 0,
}


def _with(obj: Any, dotted: str, value: Any) -> Any:
    head, _, rest = dotted.partition(".")
    return replace(obj, **{head: _with(getattr(obj, head), rest, value) if rest else value})


def plain_config(cfg: MemFitConfig) -> MemFitConfig:
    """The configuration MemFit's path runs with for method=plain: SWITCHES applied, summaries off."""
    for dotted, value in {**SWITCHES, "summary.enabled": False}.items():
        cfg = _with(cfg, dotted, value)
    return cfg


class Plain(MemFit):
    name = "plain"

    def path_config(self, cfg: MemFitConfig) -> MemFitConfig:
        return plain_config(cfg)

    def info(self) -> dict[str, Any]:
        return {"name": self.name, "switches": {**SWITCHES, "summary.enabled": False}}
