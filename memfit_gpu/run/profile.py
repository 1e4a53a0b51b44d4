"""`memfit profile`: where the time goes, per stage, and how retrieval cost grows with memory size.

    memfit profile --config configs/demo.yaml --out runs/prof [key=value ...]

1. Runs the real pipeline (`memfit run`, resumable) into DIR/run and reads its stage clocks: encode
   (the store's bi-encoder pass), the store's BM25 and FAISS appends, summaries, the retrieval stages
   (query encoding, BM25, dense, fusion + boosts, summary search, pool + expansion, PRF, rerank, pack),
   the reader (`read`: the answer calls' wall time, ledger.json roles.answer.wall_s) and the judge (`judge`:
   roles.judge.wall_s, evaluation: it runs beside the answers, so its time overlaps theirs). Each stage gets
   wall seconds, items/s and share of the stages' summed seconds.
2. Samples GPU memory and utilisation through NVML while it runs, on the GPUs this process sees
   (CUDA_VISIBLE_DEVICES, mapped by index or UUID as the variable spells them): whole-device numbers
   (vLLM engines included) next to memfit's own (NVML's per-process figure, and torch's peak reserved per
   visible GPU for the pipeline and for the sweep). Absent GPU or NVML: recorded, not an error.
3. Scaling sweep: one synthetic memory of N episodes (1k ... 1M; Zipf-distributed tokens, random unit
   vectors, fixed seed) searched by a batch of questions with the real BM25Index (on index.device's
   first device, recorded per row),
   DenseIndex and fusion; retrieve.kernels picks the torch or the Triton path (recorded per row).
Writes DIR/profile.json and DIR/profile.png (stacked stage bars + scaling curves); logs both to W&B
when tracking.wandb.enabled.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from memfit_gpu.config import MemFitConfig
from memfit_gpu.devices import first_device, gpu_count
from memfit_gpu.files import atomic_write_text
from memfit_gpu.index.factory import dense_index, lexical_index
from memfit_gpu.kernels import resolve_backend
from memfit_gpu.kernels.hybrid_topk import hybrid_topk_triton
from memfit_gpu.retrieve.hybrid import fuse
from memfit_gpu.retrieve.stages import StageKey
from memfit_gpu.run import pipeline
from memfit_gpu.run.tracking import Tracker

log = logging.getLogger(__name__)

DEFAULT_SIZES = (1_000, 10_000, 100_000, 1_000_000)
RETRIEVAL_STAGES = ("query_encode", "bm25", "dense", "fuse", "summary_search", "expand", "prf", "rerank", "pack")


@dataclass(frozen=True)
class VisibleGpu:
    """One GPU this process sees, as NVML knows it."""

    index: int  # torch's cuda:<index>: the position in CUDA_VISIBLE_DEVICES (or NVML's order when unset)
    spelled: str  # how CUDA_VISIBLE_DEVICES names it ("" when unset)
    nvml_index: int
    uuid: str
    name: str
    handle: Any


def _nvml_text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def visible_gpus(nvml: Any, environ: Mapping[str, str] | None = None) -> tuple[list[VisibleGpu], str]:
    """The NVML devices this process may use, in torch's order, and a note on how they were mapped.

    CUDA_VISIBLE_DEVICES as the variable spells each entry: an integer is NVML's index (CUDA numbers GPUs
    fastest first unless CUDA_DEVICE_ORDER=PCI_BUS_ID, NVML by PCI bus: on a mixed node set the order, or
    use UUIDs), `GPU-...` / `MIG-...` a UUID or a unique prefix of one. Like CUDA, the list ends at the
    first entry that names no device; "-1" or an empty value hides every GPU. Unset: every NVML device."""
    env = os.environ if environ is None else environ
    count = int(nvml.nvmlDeviceGetCount())
    handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
    uuids = [_nvml_text(nvml.nvmlDeviceGetUUID(h)) for h in handles]
    spec = env.get("CUDA_VISIBLE_DEVICES")
    if spec is None:
        chosen = [(str(i), i) for i in range(count)]
        note = "CUDA_VISIBLE_DEVICES unset: every NVML device"
    else:
        chosen = []
        for entry in (e.strip() for e in spec.split(",")):
            if not entry:
                break
            if entry.lstrip("-").isdigit():
                found = int(entry) if 0 <= int(entry) < count else None
            else:
                matches = [i for i, u in enumerate(uuids) if u.startswith(entry) or u.startswith(f"GPU-{entry}")]
                found = matches[0] if len(matches) == 1 else None
            if found is None or found in {c[1] for c in chosen}:
                break  # CUDA ignores this entry and every one after it
            chosen.append((entry, found))
        note = f"CUDA_VISIBLE_DEVICES={spec}: {len(chosen)} of {count} NVML devices"
        if any(e.isdigit() for e, _ in chosen) and env.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID":
            note += " (indices read as NVML's PCI order; CUDA_DEVICE_ORDER=PCI_BUS_ID makes CUDA agree)"
    gpus = [VisibleGpu(position, entry if spec is not None else "", i, uuids[i],
                       _nvml_text(nvml.nvmlDeviceGetName(handles[i])), handles[i])
            for position, (entry, i) in enumerate(chosen)]
    return gpus, note


def memfit_gpu_memory() -> list[dict[str, Any]]:
    """This process's own GPU memory per visible device, from torch's caching allocator: the peak reserved
    since the last reset (what memfit's tensors held, CUDA context and FAISS's own allocations not
    included). Empty when this process never initialised CUDA."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return []
    return [{"index": i, "max_reserved_gib": torch.cuda.max_memory_reserved(i) / 2**30,
             "max_allocated_gib": torch.cuda.max_memory_allocated(i) / 2**30} for i in range(torch.cuda.device_count())]


def reset_memfit_gpu_memory() -> None:
    """Start a new peak for `memfit_gpu_memory` (only where CUDA is already initialised: no new contexts)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i in range(torch.cuda.device_count()):
            torch.cuda.reset_peak_memory_stats(i)


class GpuSampler:
    """Peak memory and mean utilisation of the GPUs this process sees (CUDA_VISIBLE_DEVICES), sampled by
    NVML in a thread. NVML's numbers are whole-device (every process: vLLM engines included); this
    process's own use is NVML's per-process figure (when NVML reports our pid) and torch's peak reserved
    (`memfit_gpu_memory`). A device NVML refuses (a SLURM cgroup) is skipped and counted, not fatal."""

    def __init__(self, interval_s: float = 0.5, nvml: Any = None):
        self.interval_s = interval_s
        self.available = False
        self.reason = ""
        self.mapping = ""
        self.gpus: list[VisibleGpu] = []
        self._samples: list[list[tuple[float, float, float | None] | None]] = []
        self._errors: list[int] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            if nvml is None:
                import pynvml as nvml
            nvml.nvmlInit()
            self._nvml = nvml
            self.gpus, self.mapping = visible_gpus(nvml)
            self._errors = [0] * len(self.gpus)
            self.available = bool(self.gpus)
            self.reason = "" if self.available else f"NVML shows no visible GPU ({self.mapping})"
        except ImportError:
            self.reason = "nvidia-ml-py is not installed"
        except Exception as exc:  # NVMLError_LibraryNotFound and friends: no GPU here
            self.reason = f"NVML unavailable ({type(exc).__name__})"

    def _own_gib(self, handle: Any) -> float | None:
        try:
            processes = self._nvml.nvmlDeviceGetComputeRunningProcesses(handle)
        except Exception:  # noqa: BLE001 - per-process accounting is optional (MIG, containers)
            return None
        used = [p.usedGpuMemory for p in processes if p.pid == os.getpid() and p.usedGpuMemory is not None]
        return sum(used) / 2**30 if used else None

    def sample(self) -> None:
        """One sample of every visible GPU."""
        row: list[tuple[float, float, float | None] | None] = []
        for position, gpu in enumerate(self.gpus):
            try:
                mem = self._nvml.nvmlDeviceGetMemoryInfo(gpu.handle)
                util = self._nvml.nvmlDeviceGetUtilizationRates(gpu.handle)
                row.append((mem.used / 2**30, float(util.gpu), self._own_gib(gpu.handle)))
            except Exception:  # noqa: BLE001 - e.g. NVML_ERROR_NO_PERMISSION under a cgroup: skip this one
                self._errors[position] += 1
                row.append(None)
        self._samples.append(row)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)

    def __enter__(self) -> GpuSampler:
        if self.available:
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def summary(self) -> dict[str, Any]:
        if not self.available:
            return {"available": False, "reason": self.reason}
        per_gpu = []
        for i, gpu in enumerate(self.gpus):
            rows = [s[i] for s in self._samples if s[i] is not None]
            own = [r[2] for r in rows if r[2] is not None]
            per_gpu.append({
                "index": gpu.index, "visible_as": gpu.spelled, "nvml_index": gpu.nvml_index, "uuid": gpu.uuid,
                "name": gpu.name,
                "device_used_peak_gib": max((r[0] for r in rows), default=0.0),  # whole device, every process
                "memfit_process_used_peak_gib": max(own) if own else None,  # NVML, this pid (context included)
                "mean_utilisation_pct": float(np.mean([r[1] for r in rows])) if rows else 0.0,
                "samples": len(rows), "errors": self._errors[i],
            })
        return {"available": True, "mapping": self.mapping, "gpus": per_gpu}


def stage_table(run_dir: Path) -> dict[str, dict[str, float]]:
    """Per-stage seconds and item counts from a finished run directory."""
    timings = json.loads((run_dir / "timings.json").read_text())
    build = json.loads((run_dir / "build_timings.json").read_text()) if (run_dir / "build_timings.json").exists() else {}
    diag = json.loads((run_dir / "diagnostics.json").read_text())
    ledger = json.loads((run_dir / "ledger.json").read_text())
    retrieve = diag.get("retrieve_stage_seconds", {})
    n_q = diag.get("questions_total", 0)
    episodes = build.get("episodes", 0)
    roles = ledger["roles"]
    judge = roles["judge"]  # ledger.json lists every built-in role, used or not
    stages: dict[str, tuple[float, float, str]] = {
        "encode": (build.get("encode_s", 0.0), episodes, "episodes"),
        "index_append": (build.get("bm25_s", 0.0) + build.get("dense_s", 0.0), episodes, "episodes"),
        "summaries": (timings.get("summaries", 0.0), roles["summary"]["calls"] + roles["summary"]["cached"], "calls"),
        "query_encode": (retrieve.get(StageKey.QUERIES, 0.0), n_q, "questions"),
        "bm25": (retrieve.get(StageKey.BM25, 0.0), n_q, "questions"),
        "dense": (retrieve.get(StageKey.DENSE, 0.0), n_q, "questions"),
        "fuse": (retrieve.get(StageKey.FUSE, 0.0) + retrieve.get(StageKey.BOOST, 0.0), n_q, "questions"),
        "summary_search": (retrieve.get(StageKey.SUMMARIES, 0.0), n_q, "questions"),
        "expand": (retrieve.get(StageKey.POOL, 0.0), n_q, "questions"),
        "prf": (retrieve.get(StageKey.PRF, 0.0), n_q, "questions"),
        "rerank": (retrieve.get(StageKey.RERANK, 0.0), n_q, "questions"),
        "pack": (retrieve.get(StageKey.PACK, 0.0), n_q, "questions"),
        # the answer calls' own wall time: timings.answer is the whole answer stage, which holds the judge's calls
        # too (on its own thread behind the answers) and the models' loading, against a count of answers alone
        "read": (roles["answer"]["wall_s"], roles["answer"]["calls"] + roles["answer"]["cached"], "answers"),
        # evaluation, not the pipeline: beside the answers, so its time overlaps read's
        "judge": (judge["wall_s"], judge["calls"] + judge["cached"], "calls"),
    }
    total = sum(s for s, _, _ in stages.values()) or 1.0
    return {name: {"seconds": s, "items": n, "unit": unit, "items_per_s": (n / s) if s > 0 else None,
                   "share": s / total} for name, (s, n, unit) in stages.items()}


def _synthetic_memory(n_docs: int, n_queries: int, dim: int, seed: int) -> tuple[list[list[str]], list[list[str]], np.ndarray, np.ndarray]:
    """Zipf-distributed token lists (12-30 tokens) and random unit vectors: deterministic for a seed."""
    rng = np.random.default_rng(seed)
    vocab = np.array([f"w{i}" for i in range(50_000)])
    lengths = rng.integers(12, 31, size=n_docs + n_queries)
    ids = np.minimum(rng.zipf(1.3, size=int(lengths.sum())) - 1, len(vocab) - 1)
    words = vocab[ids]
    cuts = np.cumsum(lengths)[:-1]
    lists = [list(chunk) for chunk in np.split(words, cuts)]
    vectors = rng.standard_normal((n_docs + n_queries, dim)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    return lists[:n_docs], [q[:8] for q in lists[n_docs:]], vectors[:n_docs], vectors[n_docs:]


def scaling_sweep(cfg: MemFitConfig, sizes: tuple[int, ...], n_queries: int, progress: bool = True) -> list[dict[str, Any]]:
    """Retrieval cost vs episodes per memory: the configured lexical and dense indexes (index/factory.py) +
    fusion, batched questions."""
    device = first_device(cfg.index.device)
    kernels = resolve_backend(cfg.retrieve.kernels, device)
    out = []
    for n_docs in sizes:
        docs, queries, doc_vecs, query_vecs = _synthetic_memory(n_docs, n_queries, 384, seed=n_docs)
        memory = [0] * n_docs
        t0 = time.perf_counter()
        bm25 = lexical_index(cfg.index, device)
        bm25.add(docs, memory)
        t1 = time.perf_counter()
        dense = dense_index(cfg.index, 384)
        dense.add(doc_vecs, memory)
        t2 = time.perf_counter()
        q_memory = [0] * n_queries
        # the first search after add builds the weight cache (and compiles the kernels)
        bm25.search(queries[:1], q_memory[:1], cfg.retrieve.scan_top_k, kernels=kernels)
        t3 = time.perf_counter()
        b_scores, b_rows = bm25.search(queries, q_memory, cfg.retrieve.scan_top_k, kernels=kernels)
        _sync(device)
        t4 = time.perf_counter()
        d_scores, d_rows = dense.search(torch.from_numpy(query_vecs), q_memory, cfg.retrieve.scan_top_k,
                                        min_score=cfg.retrieve.dense_min_cosine)
        t5 = time.perf_counter()
        if kernels == "triton":
            hybrid_topk_triton(b_scores, b_rows, d_scores.to(device), d_rows.to(device), cfg.retrieve.alpha)
            _sync(device)
        else:
            fuse(b_scores.cpu(), b_rows.cpu(), d_scores.cpu(), d_rows.cpu(), cfg.retrieve.alpha)
        t6 = time.perf_counter()
        row = {"episodes": n_docs, "questions": n_queries, "kernels": kernels, "bm25_device": str(bm25.device),
               "dense_placement": dense.placement, "bm25_append_s": t1 - t0,
               "dense_append_s": t2 - t1,
               "bm25_weights_s": t3 - t2, "bm25_search_s": t4 - t3, "dense_search_s": t5 - t4, "fuse_s": t6 - t5}
        row["search_s"] = row["bm25_search_s"] + row["dense_search_s"] + row["fuse_s"]
        row["qps"] = n_queries / row["search_s"] if row["search_s"] > 0 else None
        out.append(row)
        if progress:
            log.info("profile scaling: %d episodes: search %.3f s for %d questions (%.0f q/s), append %.2f s",
                     n_docs, row["search_s"], n_queries, row["qps"] or 0, row["bm25_append_s"] + row["dense_append_s"])
        del bm25, dense, docs, doc_vecs
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def plot(profile: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stages = profile["stages"]
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(17, 5.5), gridspec_kw={"width_ratios": [1, 1, 1.4]})
    colours = plt.get_cmap("tab20").colors
    colour = {name: colours[i % len(colours)] for i, name in enumerate(stages)}
    # Left: the whole pipeline; middle: the retrieval stages alone (they vanish beside the reader).
    for axis, names, title in (
        (left, list(stages), "whole pipeline"),
        (middle, [n for n in stages if n in RETRIEVAL_STAGES], "retrieval stages (zoom)"),
    ):
        bottom = 0.0
        for name in names:
            row = stages[name]
            if row["seconds"] <= 0:
                continue
            axis.bar([title], [row["seconds"]], bottom=bottom, color=colour[name], width=0.5,
                     label=f"{name} {row['seconds']:.3g} s ({100 * row['share']:.1f} %)")
            bottom += row["seconds"]
        axis.set_ylabel("wall seconds")
        axis.legend(fontsize=7, loc="upper left", bbox_to_anchor=(0.55, 1.0))
    left.set_title(f"{profile['benchmark']}: {profile['questions']} questions, {profile['episodes']} episodes "
                   f"({profile['device']})", fontsize=9)
    scaling = profile["scaling"]
    if scaling:
        x = [r["episodes"] for r in scaling]
        for key, label in (("bm25_search_s", "BM25"), ("dense_search_s", "dense (FAISS)"), ("fuse_s", "fusion"),
                           ("search_s", "total")):
            right.plot(x, [max(r[key], 1e-6) for r in scaling], marker="o", label=label)
        right.set_xscale("log")
        right.set_yscale("log")
        right.set_xlabel("episodes in the memory")
        right.set_ylabel(f"seconds for {scaling[0]['questions']} batched questions")
        right.set_title("retrieval cost vs memory size")
        right.grid(True, which="both", alpha=0.3)
        right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def profile(cfg: MemFitConfig, out_dir: str | Path, sizes: tuple[int, ...] = DEFAULT_SIZES, n_queries: int = 64,
            progress: bool = True) -> dict[str, Any]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    run_dir = out / "run"
    with GpuSampler() as sampler:
        reset_memfit_gpu_memory()
        started = time.perf_counter()
        metrics = pipeline.run(cfg, run_dir, progress=progress)
        pipeline_s = time.perf_counter() - started
        memfit_memory = {"pipeline": memfit_gpu_memory()}
        reset_memfit_gpu_memory()
        scaling = scaling_sweep(cfg, sizes, n_queries, progress) if sizes else []
        memfit_memory["scaling"] = memfit_gpu_memory()
    build = json.loads((run_dir / "build_timings.json").read_text()) if (run_dir / "build_timings.json").exists() else {}
    result = {
        "benchmark": metrics.get("benchmark"), "questions": metrics.get("questions"), "episodes": build.get("episodes"),
        "device": _device_name(), "pipeline_wall_s": pipeline_s,
        "note": "a resumed or finished run directory reports the clocks of the run that did the work",
        "stages": stage_table(run_dir), "scaling": scaling, "gpu": sampler.summary(),
        # this process's torch peak reserved per visible GPU and phase (empty: CUDA never initialised here);
        # the vLLM engines are other processes: only NVML's whole-device numbers include them
        "memfit_gpu_memory": memfit_memory,
        "run_dir": str(run_dir),
    }
    atomic_write_text(out / "profile.json", json.dumps(result, indent=2) + "\n")
    plot(result, out / "profile.png")
    if cfg.tracking.wandb.enabled:
        tracker = Tracker.start(cfg, out)
        tracker.log_metrics({f"profile/{k}/seconds": v["seconds"] for k, v in result["stages"].items()})
        tracker.log_files("profile", [out / "profile.json"], images=[out / "profile.png"])
        tracker.finish()
    return result


def _device_name() -> str:
    count = gpu_count()
    return f"{count} x {torch.cuda.get_device_name(0)}" if count else "cpu"
