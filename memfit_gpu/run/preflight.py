"""What a run needs before it starts, checked before its directory records a configuration or any work.

A refusal here is one line (exit code 2 from the CLI) naming the setting to change, and leaves the run
directory as it was, so the corrected command works in the same --out directory. Resolving the inputs
(inputs.resolve_inputs) already found, or refused:
- the benchmark's files (data.benchmark, data.path, data.split);
- the weights of every model the configuration loads (RunInputs.models: the encoder, the cross-encoder with
  rerank.backend=cross-encoder, every reader whose backend loads weights: reader.model; eval.judge.model
  when the judge is on);
- the benchmark's prompt files the answers and the judge read (BEAM's src/prompts.py and
  src/evaluation/compute_metrics.py, parsed, when reader.protocol or eval.judge.prompt is beam).
Checked here, cheapest first:
- index.device names devices this machine has;
- the method can do the eval stages asked of it: eval.growth_points (growth.py check_growth), eval.pack_cutoffs
  (depths.py check_depths);
- the answer prompt leaves room for excerpts under reader.max_prompt_chars;
- BEAM's prompt files, when read, are the pinned commit's (data/checksums.json); others are said in a warning;
- the device plan fits (plan/, counted from the benchmark as read, which the record keeps so that the run
  reads it once): on every GPU memfit's parts, a CUDA context and the vLLM engines' claims fit its memory,
  and the host's parts fit its RAM (a machine without GPUs checks the host alone);
- every server a reader backend calls answers (its entry's urls: reader.base_urls for openai;
  eval.judge.base_urls when the judge is on).

It reads what inputs.resolve_inputs resolved and returns the same record with the device plan
(RunInputs.with_plan: `placed` says where the run puts retrieval).
"""

from __future__ import annotations

import logging
from pathlib import Path

from memfit_gpu.config import ConfigError
from memfit_gpu.data import read_benchmark, select_from_config
from memfit_gpu.data.fetch import files_for
from memfit_gpu.devices import visible_devices
from memfit_gpu.digests import file_sha256
from memfit_gpu.plan import benchmark_workload, make_plan
from memfit_gpu.readers.openai import PROBE_TIMEOUT_S, probe_base_urls
from memfit_gpu.readers.prompts import BEAM_FILES, load_prompt
from memfit_gpu.readers.registry import backend_entry
from memfit_gpu.run.depths import check_depths
from memfit_gpu.run.growth import check_growth
from memfit_gpu.run.inputs import RunInputs

log = logging.getLogger(__name__)


def check_can_start(inputs: RunInputs) -> RunInputs:
    """Raise (ConfigError, PromptError, a server's error) when the run cannot start here; else return the
    inputs with its device plan. Inputs resolved with readers=False (retrieval alone) skip the eval stages'
    (growth, depths), reader and judge checks."""
    cfg = inputs.cfg
    try:
        visible_devices(cfg.index.device)
    except RuntimeError as exc:
        raise ConfigError(f"index.device={cfg.index.device!r} cannot be used here: {exc} "
                          "(index.device=auto takes every visible GPU, else the CPU)") from None
    if inputs.readers:
        check_growth(cfg)
        check_depths(cfg)
        template = load_prompt(cfg.reader.prompt)
        if len(template) >= cfg.reader.max_prompt_chars:
            raise ConfigError(f"reader.max_prompt_chars={cfg.reader.max_prompt_chars} leaves no room for excerpts: "
                              f"the answer prompt {cfg.reader.prompt} alone holds {len(template):,} characters")
        check_beam_prompts(inputs)
    planned = _planned(inputs)
    if inputs.readers:  # the servers last: the slowest check
        _check_readers(inputs)
    return planned


def check_beam_prompts(inputs: RunInputs, answers: bool = True) -> None:
    """Warn when BEAM's prompt files that the answer protocol (`answers`: they are made) or the judge reads
    (resolve_inputs found them, or said where it looked and `memfit data fetch beam`) differ from the pinned
    commit's: they are used as they are, and the run's numbers are then not made with BEAM's own prompts
    (provenance.json records their sha256 either way)."""
    answers = answers and inputs.protocol == "beam"
    judged = inputs.judge_kind == "beam"
    if not (answers or judged):
        return
    assert inputs.prompts is not None and inputs.prompts.beam is not None, "BEAM's protocol without its prompts"
    pinned = {e["path"]: e.get("sha256") for e in files_for("beam")}
    for name in BEAM_FILES.values():
        path = Path(inputs.prompts.beam.folder) / name
        if file_sha256(path) != pinned.get(f"beam/{name}"):
            log.warning("%s is not the file of BEAM's pinned commit (memfit_gpu/data/checksums.json): the run's "
                        "%s use it as it is", path, "answers and judge" if answers and judged else
                        "answers" if answers else "judge")


def check_judge_can_start(inputs: RunInputs) -> None:
    """The checks of check_can_start for the judge alone (`memfit judge-audit` runs it, with inputs resolved
    with judge_alone=True, which found its weights and BEAM's prompt files when it is BEAM's judge): its
    servers answer, BEAM's prompt files are the pinned commit's."""
    check_beam_prompts(inputs, answers=False)
    _check_readers(inputs, reader=False)


def _check_readers(inputs: RunInputs, reader: bool = True) -> None:
    cfg = inputs.cfg
    roles = [("reader", cfg.reader)] if reader else []
    if inputs.judge is not None:
        roles.append(("eval.judge", inputs.judge))
    for key, settings in roles:
        urls = backend_entry(settings.backend).urls(settings)  # the backend's registry entry says what it calls
        if urls:
            # The judge without URLs of its own uses the reader's (reader_config_for_judge).
            own = key == "reader" or bool(cfg.eval.judge.base_urls)
            probe_base_urls(f"{key}.base_urls" if own else "reader.base_urls", urls, settings.api_key_env,
                            timeout_s=min(settings.timeout_s, PROBE_TIMEOUT_S))


def _planned(inputs: RunInputs) -> RunInputs:
    """The inputs with the run's device plan on this machine, counted from the benchmark as read (kept in the
    record: the run reads it once); ConfigError naming the key to change when it does not fit."""
    cfg = inputs.cfg
    benchmark = read_benchmark(cfg.data.benchmark, inputs.files)
    selected = select_from_config(benchmark, cfg.data)
    if not any(memory.questions for memory in selected.memories):  # before config.yaml: the directory stays free
        data = cfg.data
        categories = sorted({str(q.category) for memory in benchmark.memories for q in memory.questions})
        raise ConfigError(f"{benchmark.source}: data.include_categories={data.include_categories}, "
                          f"data.exclude_categories={data.exclude_categories}, data.limit_memories="
                          f"{data.limit_memories} and data.limit_questions={data.limit_questions} select no question "
                          f"(its questions' categories: {', '.join(categories) or 'none'})")
    plan = make_plan(cfg, workload=benchmark_workload(cfg, benchmark, selected, inputs.files), readers=inputs.readers,
                     judge=inputs.judge)
    plan.check()
    return inputs.with_plan(plan, benchmark, selected)
