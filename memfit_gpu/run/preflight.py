"""What a run needs before it starts, checked before its directory records a configuration or any work.

A refusal here is one line (exit code 2 from the CLI) naming the setting to change, and leaves the run
directory as it was, so the corrected command works in the same --out directory. Checked, cheapest first:
- the benchmark's files exist (data.benchmark, data.path, data.split);
- index.device names devices this machine has;
- weights are on disk for every model the configuration loads (inputs.model_uses: the encoder, the
  cross-encoder with rerank.backend=cross-encoder, every reader whose backend loads weights: reader.model;
  eval.judge.model when the judge is on);
- the answer prompt leaves room for excerpts under reader.max_prompt_chars;
- BEAM's prompt files (its src/prompts.py and src/evaluation/compute_metrics.py) are there and parse, when
  the answers (reader.protocol beam) or the judge (eval.judge.prompt beam) read them; files other than the
  pinned commit's (data/checksums.json) are said in a warning;
- the device plan fits (plan/): on every GPU memfit's parts, a CUDA context and the vLLM engines' claims
  fit its memory, and the host's parts fit its RAM (a machine without GPUs checks the host alone);
- every server a reader backend calls answers (its entry's urls: reader.base_urls for openai;
  eval.judge.base_urls when the judge is on).

The plan it returns says where the run puts retrieval (`Plan.placed`).
"""

from __future__ import annotations

import logging
from pathlib import Path

from memfit_gpu.config import ConfigError, MemFitConfig
from memfit_gpu.data import resolve_data_path
from memfit_gpu.data.fetch import files_for
from memfit_gpu.devices import visible_devices
from memfit_gpu.digests import file_sha256
from memfit_gpu.evaluate.judge import reader_config_for_judge
from memfit_gpu.models import resolve
from memfit_gpu.plan import Plan, make_plan
from memfit_gpu.readers.openai import PROBE_TIMEOUT_S, probe_base_urls
from memfit_gpu.readers.prompts import BEAM_FILES, BeamPrompts, judge_kind, load_prompt, resolve_protocol
from memfit_gpu.readers.registry import backend_entry
from memfit_gpu.run.inputs import model_uses

log = logging.getLogger(__name__)


def check_can_start(cfg: MemFitConfig, *, readers: bool = True) -> Plan:
    """Raise (ConfigError, DataNotFoundError, MissingWeightsError, PromptError) when `cfg` cannot run here;
    else return its device plan. readers=False skips the reader and judge checks (retrieval alone)."""
    files = resolve_data_path(cfg.data.benchmark, cfg.data.path, cfg.data.split)
    try:
        visible_devices(cfg.index.device)
    except RuntimeError as exc:
        raise ConfigError(f"index.device={cfg.index.device!r} cannot be used here: {exc} "
                          "(index.device=auto takes every visible GPU, else the CPU)") from None
    for use in model_uses(cfg, readers=False):
        resolve(use.kind, use.name)
    if not readers:
        return _fitting_plan(cfg, readers=False)
    template = load_prompt(cfg.reader.prompt)
    if len(template) >= cfg.reader.max_prompt_chars:
        raise ConfigError(f"reader.max_prompt_chars={cfg.reader.max_prompt_chars} leaves no room for excerpts: "
                          f"the answer prompt {cfg.reader.prompt} alone holds {len(template):,} characters")
    check_beam_prompts(cfg, files[0], judge=cfg.eval.judge.enabled)
    plan = _fitting_plan(cfg, readers=True)
    _check_readers(cfg, judge=cfg.eval.judge.enabled)
    return plan


def check_beam_prompts(cfg: MemFitConfig, data_file: Path, judge: bool, answers: bool = True) -> BeamPrompts | None:
    """BEAM's prompts when the answer protocol (`answers`: they are made) or the judge (`judge`: it runs) reads
    them (PromptError, one line
    naming where they were looked for and `memfit data fetch beam`, when they are not there); None otherwise.
    Files that differ from the pinned commit's are used, with a warning: the run's numbers are then not made
    with BEAM's own prompts (provenance.json records their sha256 either way)."""
    answers = answers and resolve_protocol(cfg.reader.protocol, cfg.data.benchmark) == "beam"
    judged = judge and judge_kind(cfg.data.benchmark, cfg.eval.judge.prompt) == "beam"
    if not (answers or judged):
        return None
    if judged and cfg.data.benchmark != "beam":
        raise ConfigError(f"eval.judge.prompt=beam scores BEAM's rubric items, which data.benchmark="
                          f"{cfg.data.benchmark} does not have: use data.benchmark=beam or another judge")
    prompts = BeamPrompts.find(data_file)
    pinned = {e["path"]: e.get("sha256") for e in files_for("beam")}
    for name in BEAM_FILES.values():
        path = Path(prompts.folder) / name
        if file_sha256(path) != pinned.get(f"beam/{name}"):
            log.warning("%s is not the file of BEAM's pinned commit (memfit_gpu/data/checksums.json): the run's "
                        "%s use it as it is", path, "answers and judge" if answers and judged else
                        "answers" if answers else "judge")
    return prompts


def check_judge_can_start(cfg: MemFitConfig) -> None:
    """The checks of check_can_start for eval.judge alone, on or off (`memfit judge-audit` runs it): its
    servers answer, its weights are on disk, BEAM's prompt files are there when it is BEAM's judge."""
    if judge_kind(cfg.data.benchmark, cfg.eval.judge.prompt) == "beam":
        files = resolve_data_path(cfg.data.benchmark, cfg.data.path, cfg.data.split)
        check_beam_prompts(cfg, files[0], judge=True, answers=False)
    _check_readers(cfg, judge=True, reader=False)


def _check_readers(cfg: MemFitConfig, judge: bool, reader: bool = True) -> None:
    roles = [("reader", cfg.reader)] if reader else []
    if judge:
        roles.append(("eval.judge", reader_config_for_judge(cfg.eval.judge, cfg.reader)))
    for key, settings in roles:
        urls = backend_entry(settings.backend).urls(settings)  # the backend's registry entry says what it calls
        if urls:
            # The judge without URLs of its own uses the reader's (reader_config_for_judge).
            own = key == "reader" or bool(cfg.eval.judge.base_urls)
            probe_base_urls(f"{key}.base_urls" if own else "reader.base_urls", urls, settings.api_key_env,
                            timeout_s=min(settings.timeout_s, PROBE_TIMEOUT_S))
    for use in model_uses(cfg, retrieval=False, judge=judge):  # the readers whose backend loads weights here
        if use.weights and (reader or use.role == "judge"):
            resolve(use.kind, use.name)


def _fitting_plan(cfg: MemFitConfig, readers: bool) -> Plan:
    """The run's device plan on this machine; ConfigError naming the key to change when it does not fit."""
    plan = make_plan(cfg, readers=readers)
    plan.check()
    return plan
