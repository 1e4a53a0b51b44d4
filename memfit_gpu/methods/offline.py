"""`memfit retrieve` for any LLM-free method: packs.jsonl and diagnostics.json without a run directory.

memfit and plain (MemFit's read path, plain with its switches) go through retrieve.offline; naive_rag and
full_context make their packs in memory here (full_context bounds the history by reader.max_prompt_chars
and full_context.context_tokens only, as no reader is loaded); lightmem_slm is refused, since its
retrieval calls small language models that only `memfit run` makes and accounts for.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from memfit_gpu.config import ConfigError, MemFitConfig, to_dict
from memfit_gpu.data import load_benchmark, select_from_config
from memfit_gpu.methods.base import MethodRun
from memfit_gpu.methods.registry import NEEDS_READER_TO_RETRIEVE, make_method, memfit_path_config
from memfit_gpu.retrieve.offline import retrieve_benchmark


def retrieve_with_method(cfg: MemFitConfig, out: Path, store_path: str | Path | None = None) -> dict[str, Any]:
    """Write OUT/packs.jsonl and OUT/diagnostics.json for cfg.method; returns diagnostics.json's content
    (with `method` naming the method).

    Raises:
        ConfigError: cfg.method needs a reader to retrieve (lightmem_slm).
    """
    if cfg.method in NEEDS_READER_TO_RETRIEVE:
        raise ConfigError(f"method={cfg.method} retrieves with LLM calls (small language models): "
                          "use `memfit run`, which makes and accounts for them")
    memfit_cfg = memfit_path_config(cfg)
    if memfit_cfg is not None:
        return retrieve_benchmark(memfit_cfg, out, store_path)
    started = time.perf_counter()
    benchmark = select_from_config(load_benchmark(cfg.data.benchmark, cfg.data.path, split=cfg.data.split), cfg.data)
    questions = [q for q in benchmark.questions() if q.evaluated]
    method = make_method(cfg.method)
    try:
        run = MethodRun(cfg, None, benchmark, benchmark.memories, questions, progress=True)
        method.write(run)
        rows, diagnostics = method.read(run)
    finally:
        method.close()
    diagnostics["timings"] = {"total_s": time.perf_counter() - started}
    diagnostics["config"] = to_dict(cfg)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "packs.jsonl", "w") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
    (out / "diagnostics.json").write_text(json.dumps(diagnostics, indent=2) + "\n")
    return diagnostics
