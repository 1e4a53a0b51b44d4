"""`memfit profile`: where the time goes, per stage, and how retrieval cost grows with memory size.

    memfit profile --config configs/demo.yaml --out runs/prof [key=value ...]

1. Runs the real pipeline (`memfit run`, resumable) into DIR/run and reads its stage clocks: encode
   (the store's bi-encoder pass), the store's BM25 and FAISS appends, summaries, the retrieval stages
   (query encoding, BM25, dense, fusion + boosts, summary search, pool + expansion, PRF, rerank, pack)
   and the reader (answer and judge calls). Each stage gets wall seconds, items/s and share of the total.
2. Samples GPU memory and utilisation through NVML while it runs (absent GPU: recorded, not an error).
3. Scaling sweep: one synthetic memory of N episodes (1k ... 1M; Zipf-distributed tokens, random unit
   vectors, fixed seed) searched by a batch of questions with the real BM25Index (on index.device),
   DenseIndex and fusion; retrieve.kernels picks the torch or the Triton path (recorded per row).
Writes DIR/profile.json and DIR/profile.png (stacked stage bars + scaling curves); logs both to W&B
when tracking.wandb.enabled.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from memfit_gpu import pipeline
from memfit_gpu.config import MemFitConfig
from memfit_gpu.devices import first_device, gpu_count
from memfit_gpu.index.bm25 import BM25Index
from memfit_gpu.index.dense import DenseIndex
from memfit_gpu.kernels import resolve_backend
from memfit_gpu.kernels.hybrid_topk import hybrid_topk_triton
from memfit_gpu.retrieve.hybrid import fuse
from memfit_gpu.retrieve.stages import StageKey
from memfit_gpu.tracking import Tracker

log = logging.getLogger(__name__)

DEFAULT_SIZES = (1_000, 10_000, 100_000, 1_000_000)
RETRIEVAL_STAGES = ("query_encode", "bm25", "dense", "fuse", "summary_search", "expand", "prf", "rerank", "pack")


class GpuSampler:
    """Peak memory and mean utilisation of every visible GPU, sampled by NVML in a thread."""

    def __init__(self, interval_s: float = 0.5):
        self.interval_s = interval_s
        self.available = False
        self.reason = ""
        self._samples: list[list[tuple[float, float]]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
            self.names = [str(pynvml.nvmlDeviceGetName(h)) for h in self._handles]
            self.available = bool(self._handles)
            self.reason = "" if self.available else "NVML reports no GPU"
        except ImportError:
            self.reason = "nvidia-ml-py is not installed"
        except Exception as exc:  # NVMLError_LibraryNotFound and friends: no GPU here
            self.reason = f"NVML unavailable ({type(exc).__name__})"

    def _loop(self) -> None:
        while not self._stop.is_set():
            row = []
            for handle in self._handles:
                mem = self._nvml.nvmlDeviceGetMemoryInfo(handle)
                util = self._nvml.nvmlDeviceGetUtilizationRates(handle)
                row.append((mem.used / 2**30, float(util.gpu)))
            self._samples.append(row)
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
        for i, name in enumerate(self.names):
            mem = [s[i][0] for s in self._samples] or [0.0]
            util = [s[i][1] for s in self._samples] or [0.0]
            per_gpu.append({"index": i, "name": name, "peak_memory_gib": max(mem), "mean_utilisation_pct": float(np.mean(util)),
                            "samples": len(self._samples)})
        return {"available": True, "gpus": per_gpu}


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
        "read": (timings.get("answer", 0.0), roles["answer"]["calls"] + roles["answer"]["cached"], "answers"),
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
    """Retrieval cost vs episodes per memory: real BM25Index + DenseIndex + fusion, batched questions."""
    device = first_device(cfg.index.device)
    kernels = resolve_backend(cfg.retrieve.kernels, device)
    out = []
    for n_docs in sizes:
        docs, queries, doc_vecs, query_vecs = _synthetic_memory(n_docs, n_queries, 384, seed=n_docs)
        memory = [0] * n_docs
        t0 = time.perf_counter()
        bm25 = BM25Index(k1=cfg.index.bm25_k1, b=cfg.index.bm25_b, device=device)
        bm25.add(docs, memory)
        t1 = time.perf_counter()
        dense = DenseIndex(dim=384, factory=cfg.index.dense_factory, device=cfg.index.dense_device, nprobe=cfg.index.dense_nprobe)
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
        row = {"episodes": n_docs, "questions": n_queries, "kernels": kernels, "bm25_append_s": t1 - t0,
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
        started = time.perf_counter()
        metrics = pipeline.run(cfg, run_dir, progress=progress)
        pipeline_s = time.perf_counter() - started
        scaling = scaling_sweep(cfg, sizes, n_queries, progress) if sizes else []
    build = json.loads((run_dir / "build_timings.json").read_text()) if (run_dir / "build_timings.json").exists() else {}
    result = {
        "benchmark": metrics.get("benchmark"), "questions": metrics.get("questions"), "episodes": build.get("episodes"),
        "device": _device_name(), "pipeline_wall_s": pipeline_s,
        "note": "a resumed or finished run directory reports the clocks of the run that did the work",
        "stages": stage_table(run_dir), "scaling": scaling, "gpu": sampler.summary(),
        "run_dir": str(run_dir),
    }
    (out / "profile.json").write_text(json.dumps(result, indent=2) + "\n")
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
