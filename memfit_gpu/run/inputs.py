"""A run's inputs: the benchmark files, the models its configuration loads, its prompt files and its judge.

    inputs = resolve_inputs(cfg)        what a run of cfg reads, resolved once (RunInputs)
    with inputs.in_force(): ...         the stages load the weights it found (no second search)
    inputs = check_can_start(inputs)    preflight.py: each of them is usable here; the device plan added
    collect(inputs, benchmark)          the run's provenance record (provenance.py: what each field means)
    judge_record(inputs)                the judge part of it (also what `memfit judge-audit` records)

The facts a run derives from its configuration are derived here once: its data files, its models and their
weights, the judge's reader settings, the answer protocol and the judge's kind with the benchmark's prompt
files they read, and (with_plan) the device plan with the configuration it places. Preflight, provenance and
the stages read the record instead of deriving them again. `memfit run` writes the provenance record before
its first answer and compares it on every resume (run/pipeline.py); `memfit retrieve` writes it beside its
packs (run/offline.py).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from memfit_gpu import provenance
from memfit_gpu.config import MemFitConfig, ReaderConfig
from memfit_gpu.data import Benchmark, resolve_data_path
from memfit_gpu.data.registry import benchmark_spec
from memfit_gpu.data.stats import quirk_counts
from memfit_gpu.devices import first_device, reader_dtype, resolve_dtype, visible_devices
from memfit_gpu.digests import file_sha256, text_sha256
from memfit_gpu.evaluate.judge import judge_settings
from memfit_gpu.methods.registry import method_entry
from memfit_gpu.models import ResolvedModel, origin, pinned, resolve
from memfit_gpu.plan import Plan
from memfit_gpu.readers.prompts import (
    BEAM_FILES,
    LONGMEMEVAL_JUDGE_FILES,
    MEMGALLERY_FILES,
    BenchmarkPrompts,
    load_prompt,
)
from memfit_gpu.readers.registry import backend_entry


@dataclass(frozen=True)
class ModelUse:
    role: str  # encoder | cross_encoder | reader | judge: its key under the record's `models`
    kind: str  # models.KINDS: how models.resolve looks for it
    name: str  # the id the configuration names
    config_key: str  # the key that names it
    backend: str | None = None  # a reader's or judge's backend
    weights: bool = True  # loaded from disk here (False: a server's model, named only)
    base_urls: tuple[str, ...] = ()
    # an encoder's dtype setting (its key, its value) and index.device: model_record resolves what it computes in
    dtype: tuple[str, str] | None = None
    device: str = "auto"
    # an in-process reader's reader.dtype (the transformers backend): model_record resolves the dtype its weights
    # compute in where the reader loads (devices.reader_dtype: "auto" depends on the GPU's or the CPU's bf16)
    reader_dtype: str | None = None
    resolved: ResolvedModel | None = None  # its weights as models.resolve found them (resolve_inputs); None: not yet


def with_weights(uses: Iterable[ModelUse]) -> tuple[ModelUse, ...]:
    """`uses` with their weights found (models.resolve; MissingWeightsError says where it looked), each kind and
    name searched once (a judge that is the reader's model shares its weights); a server's model (weights=False)
    as it is."""
    found: dict[tuple[str, str], ResolvedModel] = {}
    out = []
    for use in uses:
        if use.weights:
            key = (use.kind, use.name)
            if key not in found:
                found[key] = resolve(use.kind, use.name)
            use = replace(use, resolved=found[key])
        out.append(use)
    return tuple(out)


def model_uses(cfg: MemFitConfig, *, retrieval: bool = True, readers: bool = True,
               judge: ReaderConfig | None = None) -> list[ModelUse]:
    """The models `cfg` loads: the encoder, the cross-encoder (rerank.backend=cross-encoder) and, with
    readers, the reader and the judge (`judge`: its reader settings, evaluate/judge.judge_settings;
    None: no judge); a reader whose backend loads no weights (its registry entry: a server) is listed with
    weights=False. The encoders carry the dtype they compute in on index.device."""
    uses = []
    if retrieval:
        uses.append(ModelUse("encoder", "encoder", cfg.index.encoder, "index.encoder",
                             dtype=("index.dtype", cfg.index.dtype), device=cfg.index.device))
        if cfg.rerank.backend == "cross-encoder":
            uses.append(ModelUse("cross_encoder", "cross-encoder", cfg.rerank.model, "rerank.model",
                                 dtype=("rerank.dtype", cfg.rerank.dtype), device=cfg.index.device))
    if readers:
        roles = [("reader", cfg.reader, "reader.model")]
        if judge is not None:
            roles.append(("judge", judge, "eval.judge.model"))
        for role, reader, key in roles:
            weights = backend_entry(reader.backend).weights
            uses.append(ModelUse(role, "reader", reader.model, key, reader.backend, weights,
                                 () if weights else tuple(reader.base_urls),
                                 reader_dtype=reader.dtype if reader.backend == "transformers" else None))
    return uses


@dataclass(frozen=True)
class RunInputs:
    """What a run of `cfg` reads, resolved once from its configuration (resolve_inputs), and where it runs
    (with_plan: the device plan preflight made)."""

    cfg: MemFitConfig  # as given (config.yaml keeps it, so a resume on another node plans again)
    files: tuple[Path, ...]  # the benchmark's files (data.benchmark, data.path, data.split)
    models: tuple[ModelUse, ...]  # every model it loads (model_uses), with its weights found (with_weights)
    readers: bool  # a reader answers (memfit run); False: retrieval alone (memfit retrieve), no prompts
    # what the answers and the judge speak (reader.protocol and eval.judge.prompt resolved for the benchmark) and
    # the benchmark's prompt files they read (MemGallery's prompt/, BEAM's src/); None without readers
    prompts: BenchmarkPrompts | None
    judge: ReaderConfig | None  # the judge's reader settings (eval.judge over reader); None: no judge
    plan: Plan | None = None  # the device plan (preflight.check_can_start); None: not planned yet
    # the benchmark as read from `files` (all of it: data.* selects from it), for the plan and then the run
    benchmark: Benchmark | None = None
    selected: Benchmark | None = None  # what data.* selects from it: the questions the run makes packs for

    @property
    def protocol(self) -> str | None:
        """The answer protocol: paper | memgallery | beam; None without readers."""
        return self.prompts.protocol if self.prompts is not None else None

    @property
    def placed(self) -> MemFitConfig:
        """What the stages run: cfg with index.device where the device plan put retrieval (cfg before a plan)."""
        return self.plan.placed(self.cfg) if self.plan is not None else self.cfg

    @property
    def judge_kind(self) -> str | None:
        """The judge's prompt kind: paper | longmemeval | memgallery | beam; None: no judge."""
        return self.prompts.judge_kind if self.prompts is not None else None

    @contextmanager
    def in_force(self) -> Iterator[None]:
        """While a run works from this record, the stages that load a model by name get the weights it found
        (models.pinned): what loads is what provenance.json records, whatever the caches hold meanwhile. (Prompt
        files are read once per process already: readers/prompts.load_prompt.)"""
        with pinned((use.kind, use.resolved) for use in self.models if use.resolved is not None):
            yield

    def with_plan(self, plan: Plan, benchmark: Benchmark, selected: Benchmark) -> RunInputs:
        """The inputs with the device plan, made for `benchmark` as read from `files` (`selected`: what data.*
        selects from it): `placed` has index.device where it put retrieval, and the encoders are recorded on
        that device (where their dtype resolves)."""
        device = plan.placed(self.cfg).index.device
        models = tuple(replace(u, device=device) if u.dtype is not None else u for u in self.models)
        return replace(self, plan=plan, models=models, benchmark=benchmark, selected=selected)


def resolve_inputs(cfg: MemFitConfig, *, readers: bool = True, judge_alone: bool = False) -> RunInputs:
    """The record of what a run of `cfg` reads. `readers` False: retrieval alone (`memfit retrieve`); `judge_alone`:
    the judge whatever eval.judge.enabled says, and of the models the judge's alone (`memfit judge-audit`).

    Raises:
        DataNotFoundError: the benchmark's files are not found.
        MissingWeightsError: a model's weights are not found (models.resolve says where it looked).
        ConfigError, PromptError: the prompts cannot be found (BenchmarkPrompts.find), e.g. BEAM's judge for
            another benchmark.
    """
    judge_reader = judge_settings(cfg, force=judge_alone) if readers else None
    files = tuple(resolve_data_path(cfg.data.benchmark, cfg.data.path, cfg.data.split))
    prompts = (BenchmarkPrompts.find(cfg.reader.protocol, cfg.data.benchmark, files[0],
                                     cfg.eval.judge.prompt if judge_reader is not None else None) if readers else None)
    uses = model_uses(cfg, retrieval=not judge_alone, readers=readers, judge=judge_reader)
    models = with_weights(u for u in uses if not judge_alone or u.role == "judge")
    return RunInputs(cfg=cfg, files=files, models=models, readers=readers, prompts=prompts, judge=judge_reader)


def model_record(use: ModelUse) -> dict[str, Any]:
    """What the record says of one model: its id, where its weights came from and their sha256, and an
    encoder's compute dtype (devices.resolve_dtype on index.device, as the encoder resolves it when it loads)."""
    record: dict[str, Any] = {"name": use.name, "config_key": use.config_key}
    if use.backend is not None:
        record["backend"] = use.backend
    if use.dtype is not None:
        key, value = use.dtype
        record["dtype"] = str(resolve_dtype(value, visible_devices(use.device), key)).removeprefix("torch.")
    if use.reader_dtype is not None:  # where TransformersBackend loads it: the first GPU, else the CPU
        record["reader_dtype"] = str(reader_dtype(use.reader_dtype, first_device("auto"),
                                                  f"{use.config_key.rsplit('.', 1)[0]}.dtype")).removeprefix("torch.")
    if not use.weights:
        return {**record, "source": "server", "base_urls": list(use.base_urls)}
    resolved = use.resolved
    assert resolved is not None, f"{use.role}: a model's record before its weights were found (with_weights)"
    came_from = origin(resolved)
    record.update(path=resolved.path, **came_from, weights=provenance.weights_entry(resolved.path))
    if came_from["gguf"] and Path(came_from["gguf"]).is_file():
        record["gguf_sha256"] = file_sha256(came_from["gguf"])
    return record


def data_record(inputs: RunInputs, benchmark: Benchmark) -> dict[str, Any]:
    """The benchmark's files as read (bytes, sha256; named relative to their folder) and the quirks its
    loader handled, by kind."""
    cfg, files = inputs.cfg, inputs.files
    root = files[0].parent if len(files) == 1 else Path(os.path.commonpath([f.parent for f in files]))
    return {"benchmark": benchmark_spec(cfg.data.benchmark).name, "split": cfg.data.split, "root": str(root.resolve()),
            "files": {str(f.relative_to(root)): provenance.file_entry(f) for f in files},
            "quirks": {"count": len(benchmark.problems), "by_kind": quirk_counts(benchmark.problems)}}


def category_record(cfg: MemFitConfig, benchmark: Benchmark) -> dict[str, Any]:
    """The benchmark's category id -> name map and where it is written (data/spec.py BenchmarkSpec), and the
    categories of the questions the run selected."""
    spec = benchmark_spec(cfg.data.benchmark)
    used = sorted({q.category for q in benchmark.questions()})
    return {"map": dict(spec.categories),
            "source": spec.category_source or "none: the benchmark's own labels are its category names",
            "in_run": {c: spec.category_name(c) for c in used}}


def _prompt_hashes(names: list[str], prompt_dir: str | None = None) -> dict[str, str]:
    return {name: text_sha256(load_prompt(name, prompt_dir)) for name in dict.fromkeys(names)}


def _memgallery_prompts(prompts: BenchmarkPrompts, names: list[str]) -> dict[str, str]:
    assert prompts.memgallery_dir is not None, "MemGallery's prompts for a run that does not read them"
    folder = prompts.memgallery_dir / "prompt"
    return {f"prompt/{name}": file_sha256(folder / name) for name in names if (folder / name).is_file()}


def _beam_prompts(prompts: BenchmarkPrompts, names: list[str]) -> dict[str, str]:
    """The sha256 of BEAM's prompt files the run reads (its src/ files, as resolve_inputs found them)."""
    assert prompts.beam is not None, "BEAM's prompts for a run that does not read them"
    return {name: file_sha256(Path(prompts.beam.folder) / name) for name in names}


def judge_record(inputs: RunInputs) -> dict[str, Any]:
    """The judge (its reader settings, resolve_inputs): backend, model, kind and the sha256 of each prompt
    file its kind reads; {"enabled": false} when the run has no judge."""
    reader, kind, found = inputs.judge, inputs.judge_kind, inputs.prompts
    if reader is None or kind is None or found is None:
        return {"enabled": False}
    if kind == "paper":
        prompts = _prompt_hashes(["judge.txt"])
    elif kind == "longmemeval":
        prompts = _prompt_hashes(sorted(set(LONGMEMEVAL_JUDGE_FILES.values())))
    elif kind == "beam":  # the rubric judge (src/prompts.py), event ordering's matcher (compute_metrics.py)
        prompts = _beam_prompts(found, list(BEAM_FILES.values()))
    else:
        prompts = _memgallery_prompts(found, [MEMGALLERY_FILES["judge"]])
    local = backend_entry(reader.backend).weights
    return {"enabled": True, "backend": reader.backend, "model": reader.model, "kind": kind,
            "max_new_tokens": reader.max_new_tokens, "base_urls": [] if local else list(reader.base_urls),
            "prompts": prompts}


# provenance.json's key for a method's own prompts: its name, except lightmem_slm's (recorded as "lightmem"
# since before the registry held prompt folders; run directories compare it on resume)
_PROMPT_RECORD_NAMES = {"lightmem_slm": "lightmem"}


def prompt_record(inputs: RunInputs) -> dict[str, dict[str, str]]:
    """The sha256 of each prompt file the reader's calls are made from: the answer prompt (MemGallery's
    official files under its protocol; the multimodal variant when images are sent), the summary prompt
    when summaries are on, and the files of the method's own prompt folder (its registry entry's `prompts`:
    LightMem's four for method=lightmem_slm)."""
    cfg, found = inputs.cfg, inputs.prompts
    assert found is not None, "a prompt record for inputs resolved without readers"
    out: dict[str, dict[str, str]] = {}
    if found.protocol == "beam":
        out["answer"] = _beam_prompts(found, [BEAM_FILES["prompts"]])
    elif found.protocol == "memgallery":
        official = [MEMGALLERY_FILES[k] for k in ("system", "AR", "CD", "VS")]
        out["answer"] = {**_prompt_hashes(["answer_memgallery.txt"]), **_memgallery_prompts(found, official)}
    else:
        multimodal = cfg.reader.images != "none" and cfg.reader.prompt == "answer.txt"
        out["answer"] = _prompt_hashes([cfg.reader.prompt, *(["answer_multimodal.txt"] if multimodal else [])])
    if cfg.summary.enabled:
        out["summary"] = _prompt_hashes([cfg.summary.prompt])
    entry = method_entry(cfg.method)
    if entry.prompts is not None:  # the method's own prompt folder (its registry entry)
        folder = entry.prompts(cfg)
        out[_PROMPT_RECORD_NAMES.get(cfg.method, cfg.method)] = _prompt_hashes(
            sorted(p.name for p in folder.glob("*.txt")), str(folder))
    return out


def collect(inputs: RunInputs, benchmark: Benchmark, *, command: str = "memfit run") -> dict[str, Any]:
    """The provenance record of a run over `benchmark` (the questions data.* selected; the selection keeps the
    loader's quirks); inputs resolved with readers=False (retrieval alone, `memfit retrieve`) record no
    reader, judge or prompts. Hashes what it records (each file once per process: digests.py)."""
    return {
        "schema": provenance.SCHEMA, "written": provenance.now(), "command": command, "argv": list(sys.argv),
        **provenance.environment(),
        "data": data_record(inputs, benchmark),
        "categories": category_record(inputs.cfg, benchmark),
        "models": {use.role: model_record(use) for use in inputs.models},
        "judge": judge_record(inputs),
        "prompts": prompt_record(inputs) if inputs.readers else {},
    }
