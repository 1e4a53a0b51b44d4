"""The parts of a plan, where each lives and what it takes, and the fit check (`make_plan`)."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from memfit_gpu.config import ConfigError, MemFitConfig, ReaderConfig
from memfit_gpu.devices import parse_dtype, reader_dtype, resolve_dtype, visible_devices
from memfit_gpu.evaluate.judge import judge_settings
from memfit_gpu.index.encoders.batching import Workers, default_batch_tokens
from memfit_gpu.plan.model_size import ModelSize, model_size
from memfit_gpu.plan.node import Gpu, Node, describe_node
from memfit_gpu.plan.sizes import (
    BENCHMARK_BYTES_PER_TURN,
    CUDA_CONTEXT_BYTES,
    DENSE_HOST_BYTES_PER_ROW,
    ENCODER_INPUT_BYTES_PER_WORDPIECE,
    ENCODER_LIVE_HIDDEN,
    ENCODER_LIVE_INTERMEDIATE,
    FAISS_PINNED_HOST_BYTES,
    GIB,
    MIB,
    PROCESS_HOST_BYTES,
    PY_TOKEN_BYTES,
    STORE_BYTES_PER_EPISODE,
    SUMMARY_TERMS,
    SUMMARY_TEXT_BYTES,
    VECTOR_BYTES_PER_DIM,
    VLLM_CPU_KV_DEFAULT_GIB,
    VLLM_HOST_BYTES_PER_GPU,
    VLLM_RUNTIME_BYTES,
    WORDPIECES_PER_TOKEN,
    WRITE_RECORD_BYTES_PER_EPISODE,
    _dtype_bytes,
    _faiss_temp_bytes,
    bm25_bytes,
    vector_bytes,
)
from memfit_gpu.plan.workload import Workload, estimate_workload
from memfit_gpu.readers.registry import backend_entry, engine_groups

log = logging.getLogger(__name__)


@dataclass
class Part:
    """One thing that takes memory: resident bytes on the host and per GPU, transient peaks above them
    (a write batch, an encoder batch, BM25's first-search preparation), and vLLM claims."""

    name: str
    where: str
    key: str  # the setting that moves or shrinks it
    host: int = 0
    host_peak: int = 0
    gpu: dict[int, int] = field(default_factory=dict)
    gpu_peak: dict[int, int] = field(default_factory=dict)
    claim: dict[int, int] = field(default_factory=dict)
    note: str = ""
    unknown: bool = False


@dataclass(frozen=True)
class Problem:
    message: str  # one line, naming the key(s) to change
    key: str
    rank: int = 1  # reported in rank order: 0 engines without GPUs, 1 a GPU, 2 an engine's own claim, 3 the host


@dataclass(frozen=True)
class GpuTotal:
    gpu: Gpu
    resident: int  # memfit's parts + memfit's CUDA context
    peak: int  # the largest transient of one part
    claims: int  # vLLM engines
    parts: tuple[str, ...]

    @property
    def total(self) -> int:
        return self.resident + self.peak + self.claims

    @property
    def fits(self) -> bool:
        return self.total <= self.gpu.total_bytes


@dataclass
class Plan:
    config: str
    node: Node
    workload: Workload
    parts: list[Part]
    retrieval_spec: str  # the index.device value the run builds with
    engine_gpus: dict[str, list[list[int]]]  # "reader" / "judge" -> GPU groups
    notes: list[str]
    problems: list[Problem] = field(default_factory=list)

    @property
    def gpu_checked(self) -> bool:
        return bool(self.node.gpus)

    def gpu_totals(self) -> list[GpuTotal]:
        out = []
        for gpu in self.node.gpus:
            resident = sum(p.gpu.get(gpu.index, 0) for p in self.parts)
            peak = max((p.gpu_peak.get(gpu.index, 0) for p in self.parts), default=0)
            claims = sum(p.claim.get(gpu.index, 0) for p in self.parts)
            names = tuple(p.name for p in self.parts if gpu.index in p.gpu or gpu.index in p.claim
                          or gpu.index in p.gpu_peak)
            out.append(GpuTotal(gpu, resident, peak, claims, names))
        return out

    def host_total(self) -> tuple[int, int]:
        """(resident, largest transient) host bytes."""
        return sum(p.host for p in self.parts), max((p.host_peak for p in self.parts), default=0)

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def unknown(self) -> list[str]:
        return [p.name for p in self.parts if p.unknown] + (["workload"] if self.workload.unknown else [])

    def check(self) -> None:
        """ConfigError (one line, the key to change) when the run cannot fit."""
        if self.problems:
            raise ConfigError(self.problems[0].message)

    def placed(self, cfg: MemFitConfig) -> MemFitConfig:
        """`cfg` with index.device where the plan put retrieval (the saved config.yaml keeps the user's)."""
        if cfg.index.device == self.retrieval_spec:
            return cfg
        return replace(cfg, index=replace(cfg.index, device=self.retrieval_spec))

    def to_dict(self) -> dict[str, Any]:
        resident, peak = self.host_total()
        return {
            "config": self.config, "node": self.node.describe(), "workload": self.workload.describe(),
            "workload_from_file": self.workload.from_file, "retrieval_device": self.retrieval_spec,
            "engine_gpus": self.engine_gpus,
            "parts": [{"name": p.name, "where": p.where, "host_gib": (p.host + p.host_peak) / GIB,
                       "gpu_gib": {f"cuda:{g}": (p.gpu.get(g, 0) + p.gpu_peak.get(g, 0) + p.claim.get(g, 0)) / GIB
                                   for g in sorted(p.gpu.keys() | p.gpu_peak.keys() | p.claim.keys())},
                       "key": p.key, "note": p.note, "unknown": p.unknown} for p in self.parts],
            "gpus": [{"gpu": f"cuda:{t.gpu.index}", "resident_gib": t.resident / GIB, "peak_gib": t.peak / GIB,
                      "claims_gib": t.claims / GIB, "total_gib": t.total / GIB, "capacity_gib": t.gpu.total_bytes / GIB,
                      "fits": t.fits} for t in self.gpu_totals()],
            "gpu_checked": self.gpu_checked,
            "host": {"resident_gib": resident / GIB, "peak_gib": peak / GIB, "capacity_gib": self.node.host_bytes / GIB},
            "fits": self.fits, "problems": [p.message for p in self.problems], "unknown": self.unknown,
            "notes": self.notes,
        }


def _encoder_dtype(setting: str, on_cpu: bool, key: str = "index.dtype") -> torch.dtype:
    """The encoders' compute dtype (devices.resolve_dtype: auto = float32, this one asked;
    float32 on GPUs), without asking a GPU."""
    return resolve_dtype(setting, [torch.device("cpu")] if on_cpu else (), key)


def _reader_runtime_dtype(setting: str, on_gpu: bool, vllm: bool) -> torch.dtype | None:
    """An in-process reader's weights dtype (devices.reader_dtype: a planned GPU taken to run bf16, a CPU
    asked); vLLM keeps the checkpoint's dtype on a GPU (None) and runs float32 on the CPU (readers/vllm.py)."""
    if vllm and parse_dtype(setting, "reader.dtype") is None:
        return None if on_gpu else torch.float32
    return reader_dtype(setting, "cuda" if on_gpu else "cpu", "reader.dtype", bf16=True if on_gpu else None)


def _parse_devices(spec: str, node: Node) -> list[str]:
    """index.device against the node (devices.visible_devices with the node's GPU count, not this
    machine's torch): "cpu", "cuda:N", ... ."""
    try:
        return [str(device) for device in visible_devices(spec, gpus=len(node.gpus))]
    except RuntimeError as exc:
        raise ConfigError(f"index.device={spec!r}: {exc} (index.device=auto or cpu)") from None


def _gpu_of(device: str) -> int | None:
    return int(device.split(":", 1)[1]) if device.startswith("cuda:") else None


def _span(gpus: Sequence[int]) -> str:
    return "cpu" if not gpus else ",".join(f"cuda:{g}" for g in gpus)


class _Builder:
    """Collects the parts of one plan."""

    def __init__(self, cfg: MemFitConfig, node: Node, workload: Workload, readers: bool, judge: ReaderConfig | None):
        self.cfg, self.node, self.w, self.readers, self.judge = cfg, node, workload, readers, judge
        self.parts: list[Part] = []
        self.notes: list[str] = []
        self.problems: list[Problem] = []
        self.engine_gpus: dict[str, list[list[int]]] = {}
        self.contexts: set[int] = set()  # GPUs where memfit's own process holds a CUDA context
        self.models: dict[str, ModelSize] = {}

    def add(self, part: Part) -> Part:
        self.parts.append(part)
        for device in list(part.gpu) + list(part.gpu_peak):
            self.contexts.add(device)
        return part

    # ---------------------------------------------------------------- readers
    def _engine_groups(self, role: str, reader: ReaderConfig) -> list[list[int]]:
        need = backend_entry(reader.backend).gpus(reader)
        tp = reader.tensor_parallel_size
        instances = reader.instances
        if need > len(self.node.gpus):
            fitting = max(1, len(self.node.gpus) // tp)
            self.problems.append(Problem(
                f"reader.instances={reader.instances} x reader.tensor_parallel_size={tp} "
                f"({role}) needs {need} GPUs but the node has {len(self.node.gpus)}: set reader.instances="
                f"{fitting}", "reader.instances", rank=0))
            instances = len(self.node.gpus) // tp
        return engine_groups([g.index for g in self.node.gpus], instances, tp)

    def reader_parts(self) -> None:
        if not self.readers:
            return
        roles: list[tuple[str, str, ReaderConfig]] = [("reader", "reader", self.cfg.reader)]
        if self.judge is not None:
            roles.append(("judge", "eval.judge", self.judge))
        for role, key, reader in roles:
            how = backend_entry(reader.backend).plan  # the backend's registry entry says how it is planned
            if how == "server":
                self.notes.append(f"{role}: {reader.backend} server {', '.join(reader.base_urls)}, not counted (on "
                                  "this node: keep it on GPUs memfit does not see)")
            elif how == "engines":
                self._vllm(role, key, reader)
            elif how == "in_process":
                self._transformers(role, key, reader)
            else:
                self.notes.append(f"{role}: reader.backend={reader.backend} holds no model memory: not counted")

    def _model(self, name: str, runtime: torch.dtype | None) -> ModelSize:
        size = model_size(name, runtime)
        self.models[name] = size
        return size

    def _vllm(self, role: str, key: str, reader: ReaderConfig) -> None:
        gpus = self.node.gpus
        model = self._model(reader.model, _reader_runtime_dtype(reader.dtype, bool(gpus), vllm=True))
        label = f"vLLM {role} engines ({reader.model})"
        if not gpus:
            kv = float(os.environ.get("VLLM_CPU_KVCACHE_SPACE", VLLM_CPU_KV_DEFAULT_GIB)) * GIB
            self.add(Part(f"vLLM {role} engine, CPU ({reader.model})", "cpu", "reader.backend",
                          host=int((model.weight_bytes or 0) + kv + VLLM_HOST_BYTES_PER_GPU),
                          note=f"weights {_size(model)}; VLLM_CPU_KVCACHE_SPACE={kv / GIB:g} GiB",
                          unknown=not model.known))
            return
        groups = self._engine_groups(role, reader)
        self.engine_gpus[role] = groups
        claim = {g: int(reader.gpu_memory_utilization * gpus[g].total_bytes) for group in groups for g in group}
        self.add(Part(label, f"{len(groups)} x {reader.tensor_parallel_size} GPU: {_span(sorted(claim))}",
                      "reader.gpu_memory_utilization", host=VLLM_HOST_BYTES_PER_GPU * len(claim), claim=claim,
                      note=f"claims {reader.gpu_memory_utilization:g} of each GPU; weights {_size(model)}"))
        if not model.known:
            self.notes.append(f"{key}.model={reader.model}: size UNKNOWN, so whether its weights and KV cache fit the "
                              "engine's claim is not checked (the claim itself is counted)")
        if role == "judge" and self.cfg.reader.backend == "vllm":
            self.notes.append("eval.judge.backend=vllm starts a second set of engines on the reader's GPUs: two "
                              "claims of reader.gpu_memory_utilization each")
        if model.known and groups:
            tp = reader.tensor_parallel_size
            need = (model.weight_bytes or 0) / tp + model.kv_bytes_per_token() * reader.max_model_len / tp \
                + VLLM_RUNTIME_BYTES
            smallest = min(claim.values())
            if need > smallest:
                self.problems.append(Problem(
                    f"vLLM {role} engine ({reader.model}): weights {model.weight_bytes / tp / GIB:.1f} GiB per GPU + "
                    f"KV cache for one {reader.max_model_len}-token sequence "
                    f"{model.kv_bytes_per_token() * reader.max_model_len / tp / GIB:.1f} GiB + runtime "
                    f"{VLLM_RUNTIME_BYTES / GIB:.0f} GiB = {need / GIB:.1f} GiB > its claim of {smallest / GIB:.1f} GiB "
                    f"(reader.gpu_memory_utilization={reader.gpu_memory_utilization:g}): raise "
                    "reader.gpu_memory_utilization or reader.tensor_parallel_size, or lower reader.max_model_len",
                    "reader.gpu_memory_utilization", rank=2))

    def _transformers(self, role: str, key: str, reader: ReaderConfig) -> None:
        gpus = self.node.gpus
        model = self._model(reader.model, _reader_runtime_dtype(reader.dtype, bool(gpus), vllm=False))
        dtype_bytes = _dtype_bytes(_reader_runtime_dtype(reader.dtype, bool(gpus), vllm=False) or torch.bfloat16)
        context = model.get("max_position_embeddings", reader.max_model_len)
        kv = model.kv_bytes_per_token(dtype_bytes) * reader.batch_size * (context + reader.max_new_tokens)
        weights = model.weight_bytes or 0
        name = f"transformers {role} ({reader.model})"
        note = f"weights {_size(model)}; KV for {reader.batch_size} x {context} tokens"
        if not gpus:
            self.add(Part(name, "cpu", "reader.batch_size", host=weights, host_peak=kv, note=note,
                          unknown=not model.known))
        elif reader.device_map is not None:
            share = {g.index: weights // len(gpus) for g in gpus}
            peak = {g.index: kv // len(gpus) for g in gpus}
            self.add(Part(name, f"device_map=auto: {_span([g.index for g in gpus])}", "reader.batch_size",
                          gpu=share, gpu_peak=peak, note=note, unknown=not model.known))
        else:
            self.add(Part(name, "cuda:0", "reader.device_map", gpu={0: weights}, gpu_peak={0: kv}, note=note,
                          unknown=not model.known))

    # ---------------------------------------------------------------- retrieval
    def retrieval_devices(self) -> tuple[list[str], str]:
        """(devices of encoders and BM25, the index.device value the run uses)."""
        spec = self.cfg.index.device
        if spec.strip().lower() != "auto" or not self.node.gpus:
            return _parse_devices(spec, self.node), spec
        engines = {g for groups in self.engine_gpus.values() for group in groups for g in group}
        if not engines:
            return _parse_devices(spec, self.node), spec
        free = [g.index for g in self.node.gpus if g.index not in engines]
        chosen = free or [0]
        devices = [f"cuda:{g}" for g in chosen]
        why = ("a GPU the engines do not use" if free else
               "every GPU has an engine: GPU 0 alone, so the other engine GPUs hold no memfit context")
        self.notes.append(f"index.device=auto: retrieval on {','.join(devices)} ({why})")
        return devices, ",".join(devices)

    def retrieval_parts(self, devices: list[str]) -> None:
        cfg, w = self.cfg, self.w
        gpus = [g for g in (_gpu_of(d) for d in devices) if g is not None]
        on_cpu = not gpus
        # the loaded benchmark and the store's columns live on the host wherever the indexes are
        self.add(Part("benchmark + store columns", "cpu", "data.limit_memories",
                      host=w.turns_loaded * BENCHMARK_BYTES_PER_TURN + w.text_bytes
                      + w.episodes * STORE_BYTES_PER_EPISODE + w.summaries * (SUMMARY_TEXT_BYTES + STORE_BYTES_PER_EPISODE)
                      + PROCESS_HOST_BYTES,
                      note=f"incl. memfit's process {PROCESS_HOST_BYTES / GIB:.0f} GiB", unknown=w.unknown))
        # encoder and its write path
        enc_dtype = _encoder_dtype(cfg.index.dtype, on_cpu)
        encoder = self._model(cfg.index.encoder, enc_dtype)
        dim = encoder.get("hidden_size", 384)
        max_len = encoder.get("max_seq_length", encoder.get("max_position_embeddings", 512))
        torch_devices = [torch.device(d) for d in devices]
        tokens = min(cfg.index.encode_batch_size * max_len,
                     cfg.index.encode_batch_tokens or default_batch_tokens(torch_devices))
        act = self._activations(encoder, tokens, enc_dtype)
        weights = encoder.weight_bytes or 0
        self.add(Part(f"bi-encoder x{len(devices)}", ",".join(devices), "index.encode_batch_tokens",
                      host=weights if on_cpu else 0, host_peak=act if on_cpu else 0,
                      gpu={g: weights for g in gpus}, gpu_peak={g: act for g in gpus},
                      note=f"{cfg.index.encoder}, weights {_size(encoder)}; activations of a batch of "
                      f"{tokens:,} tokens",
                      unknown=not encoder.known))
        self._worker_processes("encoder", cfg, devices, torch_devices, gpus, weights, encoder.known)
        wordpieces = min(w.tokens * WORDPIECES_PER_TOKEN, w.episodes * max_len)
        write = (w.episodes * (WRITE_RECORD_BYTES_PER_EPISODE + dim * VECTOR_BYTES_PER_DIM) + w.tokens * PY_TOKEN_BYTES
                 + wordpieces * ENCODER_INPUT_BYTES_PER_WORDPIECE)
        budget_mb = getattr(cfg.store, "write_budget_mb", None)
        write_note = "every episode in one batch (store.add_memories today)"
        if budget_mb:
            write = min(write, int(budget_mb) * MIB)
            write_note = f"chunks of store.write_budget_mb={budget_mb}"
        self.add(Part("write path (records, tokens, encoder inputs)", "cpu",
                      "store.write_budget_mb" if budget_mb else "data.limit_memories", host_peak=int(write),
                      note=write_note, unknown=w.unknown))
        # BM25, episodes and summaries
        bm25 = devices[0]
        for label, rows, postings, terms, dense_terms, width in (
            ("episodes", w.episodes, w.postings, w.terms, w.dense_terms, w.widest),
            ("summaries", w.summaries, w.summaries * SUMMARY_TERMS, w.summaries * SUMMARY_TERMS, 0,
             cfg.summary.max_summaries),
        ):
            if label == "summaries" and not rows:
                continue
            sizes = bm25_bytes(postings, rows, terms, dense_terms, width)
            live, cache, peak, vocab = sizes["live"], sizes["cache"], sizes["peak"], sizes["host"]
            g = _gpu_of(bm25)
            part = Part(f"BM25 {label}", bm25, "index.device=cpu" if g is not None else "index.device",
                        host=vocab + (int(live + cache) if g is None else 0), host_peak=int(peak) if g is None else 0,
                        note=f"{postings:,} postings, {terms:,} terms; search cache {cache / GIB:.2f} GiB",
                        unknown=w.unknown)
            if g is not None:
                part.gpu, part.gpu_peak = {g: int(live + cache)}, {g: int(peak)}
            self.add(part)
        # dense indexes
        dense_gpu = self.dense_gpu(devices)
        for label, rows in (("episodes", w.episodes), ("summaries", w.summaries)):
            if label == "summaries" and not rows:
                continue
            vectors = vector_bytes(rows, dim)
            part = Part(f"dense {label} (FAISS {cfg.index.dense_factory})", _span([] if dense_gpu is None else [dense_gpu]),
                        "index.dense_device=cpu" if dense_gpu is not None else "index.dense_device",
                        host=vectors + rows * DENSE_HOST_BYTES_PER_ROW, note=f"{rows:,} x {dim} float32",
                        unknown=w.unknown)
            if dense_gpu is None:
                part.host += vectors  # the CPU FAISS index's own copy
            else:
                temp = _faiss_temp_bytes(self.node.gpus[dense_gpu].total_bytes)
                part.gpu = {dense_gpu: vectors + temp}
                part.host += FAISS_PINNED_HOST_BYTES
                part.note += f" + FAISS temporary pool {temp / GIB:.1f} GiB"
            self.add(part)
        # cross-encoder
        if cfg.rerank.backend == "cross-encoder":
            ce_dtype = _encoder_dtype(cfg.rerank.dtype, on_cpu, "rerank.dtype")
            ce = self._model(cfg.rerank.model, ce_dtype)
            tokens = min(cfg.rerank.batch_size * cfg.rerank.max_length, default_batch_tokens(torch_devices))
            act = self._activations(ce, tokens, ce_dtype)
            weights = ce.weight_bytes or 0
            self.add(Part(f"cross-encoder x{len(devices)}", ",".join(devices), "rerank.batch_size",
                          host=weights if on_cpu else 0, host_peak=act if on_cpu else 0,
                          gpu={g: weights for g in gpus}, gpu_peak={g: act for g in gpus},
                          note=f"{cfg.rerank.model}, weights {_size(ce)}; activations of a batch of {tokens:,} tokens",
                          unknown=not ce.known))
            # the cross-encoder is fed by index.encoder_workers too: a pool of its own (load_cross_encoder)
            self._worker_processes("cross-encoder", cfg, devices, torch_devices, gpus, weights, ce.known)

    def _worker_processes(self, what: str, cfg: MemFitConfig, devices: list[str], torch_devices: list[torch.device],
                          gpus: list[int], weights: int, known: bool) -> None:
        """An encoder's worker processes, one per device, when index.encoder_workers starts them
        (index/encoders/workers.py): each its own CUDA context and interpreter, and the model's shared host
        copy; this process keeps its own replica on the first device. Each encoder (the bi-encoder, the
        cross-encoder) starts a pool of its own."""
        if len(devices) > 1 and Workers.resolve(cfg.index.encoder_workers, torch_devices) is Workers.PROCESSES:
            self.add(Part(f"{what} worker processes x{len(devices)}", ",".join(devices), "index.encoder_workers=threads",
                          host=len(devices) * PROCESS_HOST_BYTES + weights,
                          gpu={g: CUDA_CONTEXT_BYTES + (weights if g == gpus[0] else 0) for g in gpus},
                          note=f"a CUDA context ({CUDA_CONTEXT_BYTES / MIB:.0f} MiB) and a process per device",
                          unknown=not known))

    def _activations(self, model: ModelSize, tokens: int, dtype: torch.dtype) -> int:
        """Activations of one batch of `tokens` padded tokens (batches are cut by rows and by tokens)."""
        hidden = model.get("hidden_size", 384)
        intermediate = model.get("intermediate_size", 4 * hidden)
        per_token = ENCODER_LIVE_HIDDEN * hidden + ENCODER_LIVE_INTERMEDIATE * intermediate
        return int(tokens * per_token * _dtype_bytes(dtype))

    def dense_gpu(self, devices: list[str]) -> int | None:
        """GPU FAISS sits on the GPU of the BM25 index (the first retrieval device; the store passes it as
        DenseIndex's gpu_id), GPU 0 when retrieval is on the CPU; None for CPU FAISS."""
        if self.cfg.index.dense_device == "cpu" or not self.node.gpus or not self.node.faiss_gpu:
            if self.cfg.index.dense_device == "gpu" and (not self.node.gpus or not self.node.faiss_gpu):
                self.problems.append(Problem("index.dense_device=gpu needs GPU FAISS and a GPU on the node: set "
                                             "index.dense_device=auto or cpu", "index.dense_device", rank=0))
            return None
        first = _gpu_of(devices[0]) if devices else None
        return 0 if first is None else first

    def contexts_part(self) -> None:
        if self.contexts:
            gpus = sorted(self.contexts)
            self.add(Part("CUDA context (memfit process)", _span(gpus), "index.device",
                          gpu={g: CUDA_CONTEXT_BYTES for g in gpus}, note=f"{CUDA_CONTEXT_BYTES / MIB:.0f} MiB per GPU"))

    # ---------------------------------------------------------------- fit
    def fit(self, plan: Plan) -> None:
        if plan.gpu_checked:
            for total in plan.gpu_totals():
                if not total.fits:
                    self.problems.append(self._gpu_problem(plan, total))
        resident, peak = plan.host_total()
        if resident + peak > self.node.host_bytes:
            big = max(plan.parts, key=lambda p: p.host + p.host_peak)
            self.problems.append(Problem(
                f"host memory: {resident / GIB:.1f} GiB resident + {peak / GIB:.1f} GiB peak = "
                f"{(resident + peak) / GIB:.1f} GiB > {self.node.host_bytes / GIB:.1f} GiB; the largest part is "
                f"{big.name} ({(big.host + big.host_peak) / GIB:.1f} GiB): change {big.key}", big.key, rank=3))
        plan.problems = sorted(self.problems, key=lambda p: p.rank)

    def _gpu_problem(self, plan: Plan, total: GpuTotal) -> Problem:
        g = total.gpu.index
        cap = total.gpu.total_bytes
        memfit = total.resident + total.peak
        claimers = [p for p in plan.parts if g in p.claim]
        holds = [p for p in plan.parts if g in p.gpu or g in p.gpu_peak]
        fixes: list[tuple[str, str]] = []  # (key, what to set), most direct first
        if claimers:
            # the largest utilisation that leaves room for memfit's parts, shared by every claim on this GPU
            room = math.floor((cap - memfit) / cap / len(claimers) * 100) / 100
            if room > 0:
                fixes.append(("reader.gpu_memory_utilization", f"reader.gpu_memory_utilization<={room:.2f}"))
            if len(claimers) > 1:
                fixes.append(("eval.judge.backend", "eval.judge.backend=openai (one set of engines)"))
        if any(p.name.startswith(("BM25", "bi-encoder", "cross-encoder")) for p in holds):
            fixes.append(("index.device", "index.device=cpu"))
        if any(p.name.startswith("dense") for p in holds):
            fixes.append(("index.dense_device", "index.dense_device=cpu"))
        if claimers and self.cfg.reader.backend == "vllm" and self.cfg.reader.instances > 1:
            fixes.append(("reader.instances", f"reader.instances={self.cfg.reader.instances - 1} (frees a GPU "
                                              "for retrieval)"))
        if any(p.name.startswith("transformers") for p in holds):
            fixes.append(("reader.device_map", "reader.device_map=auto") if len(self.node.gpus) > 1
                         else ("reader.model", "a smaller reader.model"))
        fixes = fixes or [("index.device", "index.device=cpu")]
        parts = ", ".join(f"{p.name.split(' (')[0]} {(p.gpu.get(g, 0) + p.gpu_peak.get(g, 0)) / GIB:.1f}" for p in holds)
        claims = "".join(f" + {p.name.split(' (')[0]} claim {p.claim[g] / GIB:.1f} GiB" for p in claimers)
        return Problem(
            f"GPU cuda:{g} ({cap / GIB:.1f} GiB) does not fit: memfit {memfit / GIB:.1f} GiB{f' ({parts})' if parts else ''}"
            f"{claims} = "
            f"{total.total / GIB:.1f} GiB; change {' or '.join(text for _, text in fixes)}", fixes[0][0])


def make_plan(cfg: MemFitConfig, node: Node | None = None, workload: Workload | None = None, readers: bool = True,
              config_name: str = "", judge: ReaderConfig | None | str = "from config") -> Plan:
    """Where every part of `cfg`'s run lives on `node` (default: this machine) and what it takes; readers=False
    plans retrieval alone (`memfit retrieve`). `judge`: the judge's reader settings (a run passes its inputs',
    derived once: RunInputs.judge; None: no judge); by default derived from `cfg` (evaluate/judge.judge_settings)."""
    node = node if node is not None else describe_node()
    workload = workload if workload is not None else estimate_workload(cfg)
    judged = judge_settings(cfg) if isinstance(judge, str) else judge
    builder = _Builder(cfg, node, workload, readers, judged)
    builder.reader_parts()
    devices, spec = builder.retrieval_devices()
    builder.retrieval_parts(devices)
    builder.contexts_part()
    if not node.gpus:
        builder.notes.append("no GPU on the node: only host memory is checked")
    plan = Plan(config_name, node, workload, builder.parts, spec, builder.engine_gpus, builder.notes)
    builder.fit(plan)
    for name in plan.unknown:
        log.warning("plan: %s has an UNKNOWN size and is not counted: the verdict may be wrong", name)
    return plan


def _size(model: ModelSize) -> str:
    if not model.known:
        return "UNKNOWN (not counted)"
    return f"{model.weight_bytes / GIB:.2f} GiB ({model.origin})"


def _gib(value: int, unknown: bool) -> str:
    return "?" if unknown and not value else f"{value / GIB:.2f}"
