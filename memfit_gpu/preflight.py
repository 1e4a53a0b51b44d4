"""What a run needs before it starts, checked before its directory records a configuration or any work.

A refusal here is one line (exit code 2 from the CLI) naming the setting to change, and leaves the run
directory as it was, so the corrected command works in the same --out directory. Checked, cheapest first:
- the benchmark's files exist (data.benchmark, data.path, data.split);
- index.device names devices this machine has;
- weights are on disk for the encoder, the cross-encoder (rerank.backend=cross-encoder) and every
  in-process reader (reader.model; eval.judge.model when the judge is on);
- the answer prompt leaves room for excerpts under reader.max_prompt_chars;
- every OpenAI-compatible server answers (reader.base_urls; eval.judge.base_urls when the judge is on).
"""

from __future__ import annotations

from memfit_gpu.config import ConfigError, MemFitConfig
from memfit_gpu.data import resolve_data_path
from memfit_gpu.devices import visible_devices
from memfit_gpu.evaluate.judge import reader_config_for_judge
from memfit_gpu.models import resolve
from memfit_gpu.readers.openai import PROBE_TIMEOUT_S, probe_base_urls
from memfit_gpu.readers.prompts import load_prompt


def check_can_start(cfg: MemFitConfig, *, readers: bool = True) -> None:
    """Raise (ConfigError, DataNotFoundError, MissingWeightsError, PromptError) when `cfg` cannot run here.
    readers=False skips the reader and judge checks (retrieval alone)."""
    resolve_data_path(cfg.data.benchmark, cfg.data.path, cfg.data.split)
    try:
        visible_devices(cfg.index.device)
    except RuntimeError as exc:
        raise ConfigError(f"index.device={cfg.index.device!r} cannot be used here: {exc} "
                          "(index.device=auto takes every visible GPU, else the CPU)") from None
    resolve("encoder", cfg.index.encoder)
    if cfg.rerank.backend == "cross-encoder":
        resolve("cross-encoder", cfg.rerank.model)
    if not readers:
        return
    template = load_prompt(cfg.reader.prompt)
    if len(template) >= cfg.reader.max_prompt_chars:
        raise ConfigError(f"reader.max_prompt_chars={cfg.reader.max_prompt_chars} leaves no room for excerpts: "
                          f"the answer prompt {cfg.reader.prompt} alone holds {len(template):,} characters")
    roles = [("reader", cfg.reader)]
    if cfg.eval.judge.enabled:
        roles.append(("eval.judge", reader_config_for_judge(cfg.eval.judge, cfg.reader)))
    for key, reader in roles:
        if reader.backend == "openai":
            # The judge without URLs of its own uses the reader's (reader_config_for_judge).
            own = key == "reader" or bool(cfg.eval.judge.base_urls)
            probe_base_urls(f"{key}.base_urls" if own else "reader.base_urls", reader.base_urls, reader.api_key_env,
                            timeout_s=min(reader.timeout_s, PROBE_TIMEOUT_S))
        else:
            resolve("reader", reader.model)
