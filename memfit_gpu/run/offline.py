"""`memfit retrieve` for any method whose read path calls no LLM: packs.jsonl and diagnostics.json.

The same seam as `memfit run` (run/pipeline.py): the method from the registry, `write` then `read` over the
questions of `packs.questions_of`, rows written by `packs.write_packs`; so for one configuration both
commands give the same rows. No reader is loaded: MemFit retrieves without summaries unless `store_path`
names a store that holds them; full_context bounds the history by reader.max_prompt_chars and
full_context.context_tokens only. A method that needs a reader to read (lightmem_slm) is refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from memfit_gpu import provenance
from memfit_gpu.config import ConfigError, to_dict
from memfit_gpu.methods.base import MethodRun, StageClock
from memfit_gpu.methods.packs import questions_of, write_packs
from memfit_gpu.methods.registry import MethodEntry, method_entry
from memfit_gpu.run.directory import refuse_for_retrieval, run_lock
from memfit_gpu.run.inputs import RunInputs, collect


def retrieve_with_method(inputs: RunInputs, out: Path, store_path: str | Path | None = None) -> dict[str, Any]:
    """Write OUT/provenance.json, OUT/packs.jsonl and OUT/diagnostics.json for the method of `inputs.cfg`
    (inputs resolved with readers=False, checked and placed by preflight); returns diagnostics.json's content.
    OUT is held (its .lock) while they are written; a run directory or a live memory's folder is refused.

    Args:
        store_path: an existing EpisodeStore directory to read (keeps its summaries; never written); None
            builds the store in memory (or at store.path) from the benchmark.
    Raises:
        ConfigError: cfg.method needs a reader to retrieve (lightmem_slm).
        FileNotFoundError: the store at `store_path` lacks memories of the benchmark.
        RunError: OUT is a run directory or a live memory's folder, or another process holds it.
    """
    cfg = inputs.cfg
    entry = method_entry(cfg.method)
    if not entry.reader_free:
        raise ConfigError(f"method={cfg.method} retrieves with LLM calls (small language models): "
                          "use `memfit run`, which makes and accounts for them")
    refuse_for_retrieval(out)
    out.mkdir(parents=True, exist_ok=True)
    with run_lock(out):
        refuse_for_retrieval(out)  # again under the lock: a run may have started there meanwhile
        return _retrieve(inputs, out, entry, store_path)


def _retrieve(inputs: RunInputs, out: Path, entry: MethodEntry, store_path: str | Path | None) -> dict[str, Any]:
    cfg = inputs.cfg
    clock = StageClock()
    with clock.stage("load"):
        benchmark = inputs.selected  # what data.* selects (preflight read the benchmark and selected it)
        assert benchmark is not None, "inputs not checked by preflight (it reads the benchmark)"
        # what made these packs (no reader, judge or prompts: retrieval alone), before the packs themselves
        provenance.write(out, collect(inputs, benchmark, command="memfit retrieve"))
    method = entry.make()
    run = MethodRun(inputs.placed, None, benchmark, benchmark.memories, questions_of(benchmark), progress=True,
                    stage=clock.stage, store_path=None if store_path is None else Path(store_path))
    try:
        with inputs.in_force():  # the encoders load the weights provenance.json recorded
            with clock.stage("build"):
                method.write(run)
            with clock.stage("retrieve"):
                rows, diagnostics = method.read(run)
    finally:
        method.close()
    diagnostics["timings"] = {f"{name}_s": seconds for name, seconds in clock.seconds.items()}
    diagnostics["config"] = to_dict(cfg)
    write_packs(out, rows, diagnostics)
    return diagnostics
