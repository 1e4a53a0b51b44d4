"""The stages of experiments/gpu_check.py (imported by it after it has put the tree, the assets' packages
and the FAISS stand-in in place; not a script of its own).

Every stage takes the shared `Context` and returns its metrics; `metrics["checks"]` maps each property
the stage verifies to True/False (the stage passes when all hold), `metrics["skipped"]` names parts that
do not apply here (bf16 and OOM on a CPU run) and why. A stage that cannot run at all raises `Skip`.
Each stage sizes its work to `ctx.allowance()`: the budget left minus what the later stages need.

On `--device cpu` the "device" side is the CPU too: the run proves the code paths (Triton kernels under
TRITON_INTERPRET=1), not GPU numbers.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import logging
import resource
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch

from memfit_gpu.buffers import GrowableTensor
from memfit_gpu.config import MemFitConfig, load_config
from memfit_gpu.data import load_benchmark, select_questions
from memfit_gpu.data.schema import Memory
from memfit_gpu.data.synth import iter_memories
from memfit_gpu.index.bm25 import BM25Index
from memfit_gpu.index.encoders import BiEncoder, CrossEncoderModule, random_cross_encoder
from memfit_gpu.index.tokenize import tokenize, tokenize_many
from memfit_gpu.kernels._launch import interpreting, triton_available
from memfit_gpu.retrieve.batched import RetrievalResult, retrieve_batch
from memfit_gpu.retrieve.view import ReadView
from memfit_gpu.store import episode_text

REPO = Path(__file__).resolve().parents[1]
log = logging.getLogger("gpu_check")

SCAN_K = 60  # retrieve.scan_top_k: what the read path asks BM25 for
CE_CANDIDATES = 80  # rerank.rerank_pool: the cross-encoder's candidates per question
QUICK_MEMORIES = 2  # --quick: the first two LoCoMo conversations, ...
QUICK_SESSIONS = 8  # ... their first 8 sessions (about 300 turns in all) ...
QUICK_QUESTIONS = 20  # ... and the first 20 evaluated questions of each
FP32_TOLERANCE = 1e-4  # float32 embeddings (unit vectors, entries ~0.05), GPU vs CPU and vs sentence-transformers
FP32_MIN_COSINE = 1 - 1e-5
# The same text encoded in batches of other shapes (padding width, rows per GEMM) is not bit-equal even on
# the CPU (measured: ~1.6e-7 apart, oneDNN and attention reductions depend on the shape); within a few
# float32 ulps is what float32 keeps, and the bits are reported beside it.
DUPLICATE_TOLERANCE = 1e-6
# Score differences (cross-encoder logits, z-scored final scores) up to this are float noise; a top-10
# or pack difference is a near tie only under it.
NEAR_TIE_NOISE = 1e-3
BF16_MIN_COSINE = 0.99
LME_M_MEMORIES = 500  # LongMemEval-M: 500 questions, each its own ~5,500-turn memory


class Skip(Exception):
    """The stage does not apply here (the reason is recorded)."""


# ---------------------------------------------------------------------------------------------- helpers
def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bits (-0.0 differs from 0.0; equal NaNs are equal)."""
    a, b = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point():
        as_int = {8: torch.int64, 4: torch.int32, 2: torch.int16}[a.element_size()]
        return torch.equal(a.view(as_int), b.view(as_int))
    return torch.equal(a, b)


def results_equal(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(bit_equal(x, y) for x, y in zip(a, b, strict=True))


def _load_module(path: Path, name: str) -> ModuleType:
    """A script of the tree (tests/kernel_cases.py, experiments/bench_kernels.py) as a module."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _rss_bytes() -> int:
    """Resident set size now (Linux /proc; 0 elsewhere)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0
    return pages * resource.getpagesize()


def host_memory() -> dict[str, int]:
    """Peak RSS of the process so far (ru_maxrss is in KiB on Linux) and the RSS now."""
    return {"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "rss_bytes": _rss_bytes()}


def _spread(items: Sequence[Any], count: int) -> list[Any]:
    """`count` items evenly spaced over `items` (all of them when count >= len)."""
    if count >= len(items):
        return list(items)
    return [items[int(i)] for i in np.linspace(0, len(items) - 1, max(1, count)).round()]


@contextlib.contextmanager
def _part(metrics: dict[str, Any], name: str, guard: bool = True) -> Iterator[None]:
    """One part of a stage, timed into metrics["part_seconds"]. Guarded, an exception fails the check
    `name` and is kept in metrics["errors"] instead of ending the stage: one broken path (Triton without a
    C compiler, an unexpected OOM) must not hide what the stage's other parts measure."""
    start = time.perf_counter()
    try:
        yield
    except Exception as exc:
        if not guard:
            raise
        metrics.setdefault("errors", {})[name] = {
            "error": f"{type(exc).__name__}: {exc}"[:1000],
            "traceback": "".join(traceback.format_exception(exc))[-3000:]}
        metrics["checks"][name] = False
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    finally:
        metrics.setdefault("part_seconds", {})[name] = round(time.perf_counter() - start, 3)


@dataclass
class Context:
    """What the stages share: the device, the budget, LoCoMo, the config and cached models/embeddings."""

    device: torch.device
    quick: bool
    assets: Path
    work: Path  # scratch space (the random cross-encoder folder)
    deadline: float  # time.perf_counter() value when the budget is spent
    memories: list[Memory] = field(default_factory=list)
    reserve: float = 0.0  # seconds the stages after the current one need (set by the runner)
    cache: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def create(cls, device: str, quick: bool, assets: Path, work: Path, deadline: float) -> Context:
        bench = select_questions(load_benchmark("locomo", assets / "data" / "locomo10.json"),
                                 exclude_categories=["5"],
                                 limit_memories=QUICK_MEMORIES if quick else None,
                                 limit_questions=QUICK_QUESTIONS if quick else None)
        memories = bench.memories
        if quick:  # a dry run of the code paths: fewer turns to encode and rerank
            memories = [replace(m, sessions=m.sessions[:QUICK_SESSIONS]) for m in memories]
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        return cls(device=dev, quick=quick, assets=assets, work=work, deadline=deadline, memories=memories)

    # -- budget
    def remaining(self) -> float:
        return self.deadline - time.perf_counter()

    def allowance(self) -> float:
        """Seconds this stage may spend: what is left after the later stages' minimum."""
        return self.remaining() - self.reserve

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"

    def sync(self) -> None:
        if self.on_gpu:
            torch.cuda.synchronize(self.device)

    def timed(self, fn: Callable[[], Any]) -> tuple[float, Any]:
        """(wall seconds with the device synchronised on both ends, fn's result)."""
        self.sync()
        start = time.perf_counter()
        out = fn()
        self.sync()
        return time.perf_counter() - start, out

    # -- LoCoMo, in the order ReadView.from_memories lays the episodes out
    @property
    def encoder_path(self) -> str:
        return str(self.assets / "encoder")

    def _cached(self, key: str, build: Callable[[], Any]) -> Any:
        if key not in self.cache:
            self.cache[key] = build()
        return self.cache[key]

    @property
    def episodes(self) -> list[str]:
        return self._cached("episodes", lambda: [episode_text(t) for m in self.memories for t in m.turns()])

    @property
    def episode_memory(self) -> list[int]:
        return self._cached("episode_memory", lambda: [i for i, m in enumerate(self.memories) for _ in m.turns()])

    @property
    def questions(self) -> list[str]:
        return [q.question for m in self.memories for q in m.questions]

    @property
    def question_memory_ids(self) -> list[str]:
        return [m.memory_id for m in self.memories for _ in m.questions]

    @property
    def question_memory(self) -> list[int]:
        return [i for i, m in enumerate(self.memories) for _ in m.questions]

    def config(self, *overrides: str) -> MemFitConfig:
        """configs/memfit.yaml (the paper's settings) with the dense indexes on the CPU (the stand-in)."""
        return load_config(REPO / "configs" / "memfit.yaml",
                           ["index.device=cpu", "index.dense_device=cpu", *overrides])

    # -- models and embeddings (built once, by whichever stage needs them first)
    def encoder(self, side: str) -> BiEncoder:
        """The float32 bi-encoder on the CPU ("cpu") or the checked device ("device")."""
        if side == "device" and not self.on_gpu:
            return self.encoder("cpu")
        where = "cpu" if side == "cpu" else str(self.device)
        return self._cached(f"encoder:{side}", lambda: BiEncoder.from_pretrained(self.encoder_path, device=where,
                                                                                dtype="float32"))

    def embeddings(self, side: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(episode embeddings, question embeddings) of the LoCoMo selection by one side's encoder."""
        if side == "device" and not self.on_gpu:
            return self.embeddings("cpu")

        def encode() -> tuple[torch.Tensor, torch.Tensor]:
            encoder = self.encoder(side)
            seconds, both = self.timed(lambda: encoder.encode(self.episodes + self.questions, batch_size=128))
            self.cache[f"encode_s:{side}"] = seconds
            return both[: len(self.episodes)], both[len(self.episodes):]

        return self._cached(f"embeddings:{side}", encode)

    def embed_fn(self, side: str) -> Callable[[list[str]], torch.Tensor]:
        """Text -> embedding through one side's encoder, memoised per text: PRF queries that come out the
        same on both sides get the very same vectors, so only retrieval can differ."""
        memo: dict[str, torch.Tensor] = self.cache.setdefault(f"memo:{side}", {})
        encoder = self.encoder(side)

        def embed(texts: list[str]) -> torch.Tensor:
            new = [t for t in dict.fromkeys(texts) if t not in memo]
            if new:
                for text, row in zip(new, encoder.encode(new, batch_size=128), strict=True):
                    memo[text] = row
            return torch.stack([memo[t] for t in texts]) if texts else torch.zeros((0, encoder.dim))

        return embed

    def cross_encoder_folder(self) -> Path:
        """The seeded random cross-encoder head on the shipped MiniLM body (deterministic with its seed)."""
        return self._cached("ce_folder", lambda: random_cross_encoder(self.work / "cross-encoder",
                                                                      base=self.encoder_path, seed=0))

    def cross_encoder(self, side: str) -> CrossEncoderModule:
        if side == "device" and not self.on_gpu:
            return self.cross_encoder("cpu")
        where = "cpu" if side == "cpu" else str(self.device)
        return self._cached(f"ce:{side}", lambda: CrossEncoderModule.from_pretrained(
            str(self.cross_encoder_folder()), device=where, max_length=384, dtype="float32"))

    def cpu_bm25(self) -> BM25Index:
        def build() -> BM25Index:
            index = BM25Index()
            index.add(tokenize_many(self.episodes), self.episode_memory)
            return index

        return self._cached("bm25:cpu", build)

    def free_device_memory(self) -> None:
        gc.collect()
        if self.on_gpu:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------- stage 1
def stage_kernels(ctx: Context) -> dict[str, Any]:
    """Each Triton kernel (compiled on the GPU; the interpreter on a CPU run) against its torch reference
    on the CPU, on tests/kernel_cases.py's random ragged batches, every run compared bit for bit."""
    if not triton_available():
        raise Skip("triton is not installed")
    if not ctx.on_gpu and not interpreting():
        raise Skip("CPU run without TRITON_INTERPRET=1: the kernels run on CUDA tensors only")
    cases = _load_module(REPO / "tests" / "kernel_cases.py", "kernel_cases")
    repeats = 10 if ctx.on_gpu else (1 if ctx.quick else 2)
    metrics: dict[str, Any] = {"repeats": repeats, "compiled": ctx.on_gpu, "cases": {}, "checks": {}}
    for name in cases.KERNEL_CASES:
        start = time.perf_counter()
        result = cases.CASES[name](device=str(ctx.device), repeats=repeats)
        metrics["cases"][name] = {**result, "seconds": round(time.perf_counter() - start, 3)}
        metrics["checks"][f"{name}_bit_identical_{repeats}_runs"] = bool(result["ok"]) and result["checked"] > 0
    return metrics


# ---------------------------------------------------------------------------------------------- stage 2
def stage_bm25(ctx: Context) -> dict[str, Any]:
    """BM25Index on the device against the CPU on LoCoMo: scores and rows bit for bit for every evaluated
    question (torch path, Triton path), PRF terms and their encoded search, idf, a delete, state_dict
    across devices and .to()."""
    tokens = tokenize_many(ctx.episodes)
    mems = ctx.episode_memory
    cpu = BM25Index(device="cpu")
    cpu.add(tokens, mems)
    dev = BM25Index(device=ctx.device)
    build_s, _ = ctx.timed(lambda: dev.add(tokens, mems))
    queries = [tokenize(q) for q in ctx.questions]
    q_mems = ctx.question_memory
    checks: dict[str, bool] = {}
    metrics: dict[str, Any] = {"episodes": len(tokens), "questions": len(queries), "k": SCAN_K,
                               "device_build_s": build_s, "checks": checks}

    cpu_s, ref = ctx.timed(lambda: cpu.search(queries, q_mems, SCAN_K))
    dev.search(queries[:1], q_mems[:1], SCAN_K)  # the weight cache, outside the clock
    dev_s, got = ctx.timed(lambda: dev.search(queries, q_mems, SCAN_K))
    checks["search_torch_bits"] = results_equal(ref, got)
    metrics.update(cpu_search_s=cpu_s, device_search_s=dev_s, hits=int((ref[1] >= 0).sum()))

    # the Triton path: compiled on a GPU, the interpreter on a CPU run (a subset there: it is slow)
    if triton_available() and (ctx.on_gpu or interpreting()):
        with _part(metrics, "search_triton"):
            n_triton = len(queries) if ctx.on_gpu else min(len(queries), 40 if ctx.quick else 100)
            dev.search(queries[:1], q_mems[:1], SCAN_K, kernels="triton")  # compiles, outside the clock
            triton_s, tri = ctx.timed(lambda: dev.search(queries[:n_triton], q_mems[:n_triton], SCAN_K,
                                                         kernels="triton"))
            checks["search_triton_bits"] = results_equal((ref[0][:n_triton], ref[1][:n_triton]), tri)
            metrics.update(triton_questions=n_triton, device_triton_search_s=triton_s)
    else:
        metrics.setdefault("skipped", {})["search_triton"] = "no triton, or a CPU run without TRITON_INTERPRET=1"

    # PRF: the terms of the top-2 rows straight from the postings, then their encoded search
    prf_cpu = cpu.feedback_terms(ref[1][:, :2], 4, 12, "idf")
    prf_dev = dev.feedback_terms(got[1][:, :2], 4, 12, "idf")
    checks["prf_terms_equal"] = results_equal(prf_cpu, prf_dev) and cpu.term_tokens(prf_cpu[1]) == dev.term_tokens(
        prf_dev[1].cpu())
    checks["prf_search_bits"] = results_equal(cpu.search_encoded(*prf_cpu, q_mems, SCAN_K),
                                              dev.search_encoded(*prf_dev, q_mems, SCAN_K))
    metrics["prf_pairs"] = int(prf_cpu[0].numel())
    # idf in float64 (log1p on each device): a last-bit difference is possible and harmless here (the
    # PRF term order is integer df order; posting weights are rounded to float32 on a grid)
    idf_cpu = [v for row in cpu.idf(queries, q_mems) for v in row]
    idf_dev = [v for row in dev.idf(queries, q_mems) for v in row]
    metrics["idf_bits_equal"] = idf_cpu == idf_dev
    checks["idf_equal_to_1e-15"] = len(idf_cpu) == len(idf_dev) and all(
        abs(a - b) <= 1e-15 * max(abs(a), 1.0) for a, b in zip(idf_cpu, idf_dev, strict=True))
    checks["memory_stats_equal"] = all(cpu.memory_stats(m) == dev.memory_stats(m) for m in range(len(ctx.memories)))

    # a delete: every 7th row and each memory's first row; N, df and avgdl change on both sides
    starts = np.cumsum([0] + [len(m.turns()) for m in ctx.memories])[:-1].tolist()
    deleted = sorted(set(range(0, len(tokens), 7)) | set(starts))
    cpu.delete(deleted)
    dev.delete(deleted)
    after = cpu.search(queries, q_mems, SCAN_K)
    checks["delete_search_bits"] = results_equal(after, dev.search(queries, q_mems, SCAN_K))
    checks["delete_removed_rows"] = not bool(np.isin(after[1].numpy(), deleted).any())
    metrics["deleted_rows"] = len(deleted)

    # state_dict across devices, and .to() both ways
    from_dev = BM25Index(device="cpu")
    from_dev.load_state_dict(dev.state_dict())
    from_cpu = BM25Index(device=ctx.device)
    from_cpu.load_state_dict(cpu.state_dict())
    checks["state_dict_device_to_cpu_bits"] = results_equal(after, from_dev.search(queries, q_mems, SCAN_K))
    checks["state_dict_cpu_to_device_bits"] = results_equal(after, from_cpu.search(queries, q_mems, SCAN_K))
    states = cpu.state_dict(), dev.state_dict()
    checks["state_dicts_equal"] = all(
        bit_equal(a, states[1][key]) if isinstance(a, torch.Tensor) else a == states[1][key]
        for key, a in states[0].items())
    checks["to_cpu_to_device_bits"] = results_equal(after, from_dev.to(ctx.device).search(queries, q_mems, SCAN_K))
    checks["to_device_to_cpu_bits"] = results_equal(after, dev.to("cpu").search(queries, q_mems, SCAN_K))
    checks["to_moved_every_tensor"] = (from_dev._post_term.device == ctx.device
                                       and dev._post_term.device.type == "cpu")
    return metrics


# ---------------------------------------------------------------------------------------------- stage 3
def _duplicates(encoder: BiEncoder, probes: list[str], fillers: list[str]) -> dict[str, Any]:
    """The same texts encoded alone, in a batch of 32 and in one of 512 among other texts (different
    padding widths and batch shapes): are their rows the same bits?"""
    alone = encoder.encode(probes, batch_size=1)
    runs = {"alone": alone}
    for size in (32, 512):
        runs[f"batch_{size}"] = encoder.encode(fillers + probes, batch_size=size)[len(fillers):]
    equal = {name: bit_equal(alone, rows) for name, rows in runs.items() if name != "alone"}
    worst = max(float((alone - rows).abs().max()) for rows in runs.values())
    return {"bit_equal": equal, "max_abs_diff": worst, "probes": len(probes)}


def _compare_rows(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    cosine = torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=1)
    return {"max_abs_diff": float((a - b).abs().max()), "min_cosine": float(cosine.min()),
            "mean_cosine": float(cosine.mean()), "rows": int(a.shape[0])}


def _top10(scores: torch.Tensor) -> list[int]:
    return scores.argsort(descending=True, stable=True)[:10].tolist()


def _near_tie(gap: float, difference: float) -> bool:
    """Two candidates `gap` apart on the CPU may swap on the device when the question's scores moved by
    `difference` (float noise, at most NEAR_TIE_NOISE) and the gap is within twice that."""
    return difference <= NEAR_TIE_NOISE and gap <= 2 * difference


def _agreement(cpu_scores: list[torch.Tensor], dev_scores: list[torch.Tensor]) -> dict[str, Any]:
    """Top-10 agreement per question; a disagreement counts as a near tie when the first two candidates
    that differ are closer on the CPU than twice that question's largest CPU-device score difference."""
    worst = max(float((a - b).abs().max()) for a, b in zip(cpu_scores, dev_scores, strict=True))
    identical = near_ties = unexplained = 0
    for a, b in zip(cpu_scores, dev_scores, strict=True):
        top_a, top_b = _top10(a), _top10(b)
        if top_a == top_b:
            identical += 1
            continue
        first = next(i for i, (x, y) in enumerate(zip(top_a, top_b, strict=True)) if x != y)
        if _near_tie(abs(float(a[top_a[first]] - a[top_b[first]])), float((a - b).abs().max())):
            near_ties += 1
        else:
            unexplained += 1
    return {"questions": len(cpu_scores), "top10_identical": identical, "near_ties": near_ties,
            "unexplained": unexplained, "max_abs_diff": worst}


def _chunks(items: list[Any], size: int) -> list[list[Any]]:
    return [items[i:i + size] for i in range(0, len(items), size)]


def _until(seconds: float, chunks: list[list[Any]], work: Callable[[list[Any]], Any]) -> tuple[float, list, list]:
    """`work` chunk after chunk (at least one) until `seconds` are spent: (seconds spent, the items done,
    each chunk's result). The CPU side of a comparison stops in time even when the machine is slower than
    its first chunk promised; the device side then does the same items."""
    start = time.perf_counter()
    done: list[Any] = []
    results: list[Any] = []
    for chunk in chunks:
        if done and time.perf_counter() - start >= seconds:
            break
        results.append(work(chunk))
        done += chunk
    return time.perf_counter() - start, done, results


def _cross_encoder_pairs(ctx: Context, n_questions: int) -> list[tuple[str, list[str]]]:
    """(question, its top-80 BM25 episodes) for questions spread over the selection."""
    bm25 = ctx.cpu_bm25()
    picked = _spread(list(range(len(ctx.questions))), n_questions)
    queries = [tokenize(ctx.questions[i]) for i in picked]
    _, rows = bm25.search(queries, [ctx.question_memory[i] for i in picked], CE_CANDIDATES)
    out = []
    for i, row in zip(picked, rows.tolist(), strict=True):
        passages = [ctx.episodes[r] for r in row if r >= 0]
        if len(passages) > 10:
            out.append((ctx.questions[i], passages))
    return out


def _oom_halving(ctx: Context, encoder: BiEncoder, texts: list[str]) -> dict[str, Any]:
    """Cap the process's GPU memory (set_per_process_memory_fraction) so that the batch cannot fit, check
    that encode halves its batch until it does, and that the rows still equal the unconstrained ones."""
    batch = len(texts)
    ctx.free_device_memory()
    torch.cuda.reset_peak_memory_stats(ctx.device)
    base = torch.cuda.memory_allocated(ctx.device)
    reference = encoder.encode(texts, batch_size=batch)
    need = torch.cuda.max_memory_allocated(ctx.device) - base
    total = torch.cuda.get_device_properties(ctx.device).total_memory
    ctx.free_device_memory()
    cap = torch.cuda.memory_reserved(ctx.device) + need // 4  # a quarter of what the full batch took
    halvings: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "batch size halved" in record.getMessage():
                halvings.append(record.getMessage())

    handler = Catch()
    logging.getLogger("memfit_gpu.index.encoders").addHandler(handler)
    torch.cuda.set_per_process_memory_fraction(cap / total, ctx.device)
    try:
        seconds, constrained = ctx.timed(lambda: encoder.encode(texts, batch_size=batch))
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, ctx.device)
        logging.getLogger("memfit_gpu.index.encoders").removeHandler(handler)
        ctx.free_device_memory()
    return {"batch_size": batch, "unconstrained_peak_bytes": int(need), "cap_bytes": int(cap),
            "fraction": cap / total, "halvings": len(halvings), "last_message": halvings[-1] if halvings else None,
            "seconds": seconds, "bit_equal": bit_equal(reference, constrained),
            "max_abs_diff": float((reference - constrained).abs().max())}


def _workers_throughput(ctx: Context, texts: list[str]) -> dict[str, Any]:
    """experiments/bench_encoder_workers.py on two workers of the same device: one process, two worker
    processes (does one process leave the device idle?), two threads, sentence-transformers' pool of two."""
    bench = _load_module(REPO / "experiments" / "bench_encoder_workers.py", "bench_encoder_workers")
    return bench.compare(ctx.encoder_path, f"{ctx.device},{ctx.device}", texts, repeats=1)


def stage_encoders(ctx: Context) -> dict[str, Any]:
    """BiEncoder float32 on the device against the CPU and against sentence-transformers on the same
    device; duplicate texts in different batches; bf16; the cross-encoder's top-10 on the device against
    the CPU; throughput per batch size; batch halving under a forced OOM."""
    from sentence_transformers import SentenceTransformer

    checks: dict[str, bool] = {}
    skipped: dict[str, str] = {}
    metrics: dict[str, Any] = {"texts": len(ctx.episodes) + len(ctx.questions), "checks": checks, "skipped": skipped}
    with _part(metrics, "embeddings", guard=False):  # every later part needs them
        cpu_ep, cpu_q = ctx.embeddings("cpu")
        dev_ep, dev_q = ctx.embeddings("device")
    metrics["encode_s"] = {"cpu": ctx.cache.get("encode_s:cpu"), "device": ctx.cache.get("encode_s:device")}
    metrics["fp32_device_vs_cpu"] = compared = _compare_rows(torch.cat([cpu_ep, cpu_q]), torch.cat([dev_ep, dev_q]))
    checks["fp32_device_vs_cpu"] = (compared["max_abs_diff"] <= FP32_TOLERANCE
                                    and compared["min_cosine"] >= FP32_MIN_COSINE)
    if not ctx.on_gpu:
        skipped["fp32_device_vs_cpu"] = "CPU run: both sides are the same CPU encoder"

    with _part(metrics, "sentence_transformers"):  # same device, same folder (its float32 config upcasts)
        sample = _spread(ctx.episodes, 64 if ctx.quick else 2000)
        st = SentenceTransformer(ctx.encoder_path, device=str(ctx.device))
        st_rows = st.encode(sample, batch_size=128, normalize_embeddings=True, convert_to_tensor=True).float().cpu()
        ours = ctx.encoder("device").encode(sample, batch_size=128)
        metrics["vs_sentence_transformers"] = compared = _compare_rows(st_rows, ours)
        compared["sentence_transformers_dtype"] = str(next(st.parameters()).dtype)
        checks["matches_sentence_transformers"] = (compared["max_abs_diff"] <= FP32_TOLERANCE
                                                   and compared["min_cosine"] >= FP32_MIN_COSINE)
        del st

    # duplicates: probes of every length, alone and inside mixed batches
    by_length = sorted(set(ctx.episodes), key=len)
    probes = _spread(by_length, 6 if ctx.quick else 12)
    fillers = _spread(ctx.episodes, 24 if ctx.quick else 700)
    with _part(metrics, "duplicates"):
        metrics["duplicates"] = {"device": _duplicates(ctx.encoder("device"), probes, fillers)}
        checks["fp32_duplicates_within_rounding"] = (metrics["duplicates"]["device"]["max_abs_diff"]
                                                     <= DUPLICATE_TOLERANCE)

    # bf16, where the GPU has it natively
    if not ctx.on_gpu:
        skipped["bf16"] = "CPU run: bf16 is checked on a GPU"
    elif not torch.cuda.is_bf16_supported(including_emulation=False):
        skipped["bf16"] = f"{torch.cuda.get_device_name(ctx.device)} has no native bf16"
    else:
        with _part(metrics, "bf16"):
            bf16 = BiEncoder.from_pretrained(ctx.encoder_path, device=str(ctx.device), dtype="bf16")
            seconds, rows = ctx.timed(lambda: bf16.encode(ctx.episodes + ctx.questions, batch_size=128))
            metrics["bf16_vs_fp32"] = compared = _compare_rows(torch.cat([dev_ep, dev_q]), rows)
            compared["encode_s"] = seconds
            metrics.setdefault("duplicates", {})["bf16"] = _duplicates(bf16, probes, fillers)  # bf16 promises no bits
            checks["bf16_close_to_fp32"] = compared["min_cosine"] >= BF16_MIN_COSINE
            del bf16

    # cross-encoder (seeded random head on the MiniLM body): top-10 of 80 candidates, device vs CPU, on as
    # many questions (up to 100) as a tenth of the allowance scores on the CPU, 10 questions at a time
    with _part(metrics, "cross_encoder"):
        cpu_ce = ctx.cross_encoder("cpu")
        chunks = _chunks(_cross_encoder_pairs(ctx, 2 if ctx.quick else 100), 10)
        cpu_s, pairs, cpu_parts = _until(0.1 * ctx.allowance(), chunks, lambda chunk: cpu_ce.score(
            [(q, p) for q, passages in chunk for p in passages], batch_size=256))
        flat = [(q, p) for q, passages in pairs for p in passages]
        cpu_flat = torch.cat(cpu_parts)
        ctx.cache["ce_cpu_pairs_per_s"] = len(flat) / cpu_s
        if ctx.on_gpu:
            dev_s, dev_flat = ctx.timed(lambda: ctx.cross_encoder("device").score(flat, batch_size=256))
        else:  # the same module on the same CPU: scoring again would only repeat the work
            dev_s, dev_flat = cpu_s, cpu_flat
            skipped["cross_encoder_device"] = "CPU run: the device side is the CPU side"
        bounds = np.cumsum([0] + [len(p) for _, p in pairs]).tolist()
        split = [(cpu_flat[a:b], dev_flat[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
        agreement = _agreement([a for a, _ in split], [b for _, b in split])
        metrics["cross_encoder"] = {**agreement, "pairs": len(flat), "cpu_pairs_per_s": len(flat) / cpu_s,
                                    "device_pairs_per_s": len(flat) / dev_s}
        checks["cross_encoder_top10"] = (agreement["unexplained"] == 0
                                         and agreement["max_abs_diff"] <= NEAR_TIE_NOISE)

    # throughput: texts/s per batch size (synchronised clocks), not in --quick
    if ctx.quick:
        skipped["throughput"] = "--quick"
    else:
        with _part(metrics, "throughput"):
            texts = ctx.episodes if ctx.on_gpu else ctx.episodes[:256]
            encoder = ctx.encoder("device")
            encoder.encode(texts[:64], batch_size=64)  # warm-up: kernels, allocator
            metrics["throughput_texts_per_s"] = {
                str(size): len(texts) / ctx.timed(lambda size=size: encoder.encode(texts, batch_size=size))[0]
                for size in (32, 128, 512)}
            metrics["throughput_texts"] = len(texts)
        with _part(metrics, "workers"):
            metrics["workers"] = _workers_throughput(ctx, texts)

    # OOM: a memory cap that the batch cannot fit in; the batch halves and the rows stay the same
    if not ctx.on_gpu:
        skipped["oom_halving"] = "CPU run: out-of-memory halving is a CUDA path"
    else:
        with _part(metrics, "oom_halving"):
            longest = sorted(ctx.episodes, key=len, reverse=True)[:1024]
            metrics["oom_halving"] = oom = _oom_halving(ctx, ctx.encoder("device"), longest)
            checks["oom_halved"] = oom["halvings"] >= 1
            checks["oom_rows_equal_unconstrained"] = oom["max_abs_diff"] <= DUPLICATE_TOLERANCE  # bits reported
    return metrics


# ---------------------------------------------------------------------------------------------- stage 4
def _views(ctx: Context, embeddings: torch.Tensor, cfg: MemFitConfig) -> ReadView:
    """The LoCoMo read view with the given episode embeddings, its BM25 index moved to the device."""
    view = ReadView.from_memories(ctx.memories, None, cfg, embeddings=embeddings)
    view.ep_bm25.to(ctx.device)
    return view


def _retrieve(ctx: Context, view: ReadView, cfg: MemFitConfig, embed: Callable, q_emb: torch.Tensor,
              reranker: Any, picked: Sequence[int]) -> tuple[float, dict[str, float], list[RetrievalResult]]:
    timings: dict[str, float] = {}
    questions = [ctx.questions[i] for i in picked]
    mids = [ctx.question_memory_ids[i] for i in picked]
    seconds, results = ctx.timed(lambda: retrieve_batch(view, cfg, questions, mids, embed=embed,
                                                        question_embeddings=q_emb[list(picked)], reranker=reranker,
                                                        timings=timings))
    return seconds, {k: round(v, 4) for k, v in timings.items()}, results


def _explained(a: RetrievalResult, b: RetrievalResult) -> bool:
    """A pack difference after reranking that a near tie explains: the same candidates, and where the final
    orders first part, the two candidates are closer on the CPU than twice the question's largest final
    score difference, itself float noise (`_near_tie`)."""
    final_a = {(c["kind"], c["row"]): c["final"] for c in a.ranked}
    final_b = {(c["kind"], c["row"]): c["final"] for c in b.ranked}
    if final_a.keys() != final_b.keys():
        return False
    worst = max(abs(final_a[key] - final_b[key]) for key in final_a)
    order_a = [(c["kind"], c["row"]) for c in a.ranked]
    order_b = [(c["kind"], c["row"]) for c in b.ranked]
    first = next((i for i, (x, y) in enumerate(zip(order_a, order_b, strict=True)) if x != y), None)
    return first is not None and _near_tie(abs(final_a[order_a[first]] - final_a[order_b[first]]), worst)


def stage_retrieval(ctx: Context) -> dict[str, Any]:
    """retrieve_batch for every selected LoCoMo question with the BM25 index on the device against the
    CPU, both fed the same CPU embeddings (only retrieval differs): rerank none (Triton and torch kernels
    on the device) and the random cross-encoder; packs compared with pack_key(). Then the device's own
    embeddings: how many packs change."""
    checks: dict[str, bool] = {}
    skipped: dict[str, str] = {}
    metrics: dict[str, Any] = {"questions": len(ctx.questions), "checks": checks, "skipped": skipped, "runs": {}}
    cpu_ep, cpu_q = ctx.embeddings("cpu")
    none = ctx.config("rerank.backend=none")
    cpu_view = ReadView.from_memories(ctx.memories, None, none, embeddings=cpu_ep)
    dev_view = _views(ctx, cpu_ep, none)
    embed = ctx.embed_fn("cpu")
    everyone = range(len(ctx.questions))

    def record(name: str, seconds: float, timings: dict[str, float], n: int) -> None:
        metrics["runs"][name] = {"questions": n, "seconds": seconds, "questions_per_s": n / seconds,
                                 "timings": timings}

    _retrieve(ctx, cpu_view, none, embed, cpu_q, None, everyone)  # encodes the PRF queries, outside the clock
    seconds, timings, ref = _retrieve(ctx, cpu_view, none, embed, cpu_q, None, everyone)
    record("cpu_none", seconds, timings, len(ref))
    for kernels in ("auto", "torch"):
        if kernels == "torch" and not ctx.on_gpu:
            skipped["device_none_torch"] = "CPU run: auto is the torch path already"
            continue
        with _part(metrics, f"device_none_{kernels}"):
            cfg = ctx.config("rerank.backend=none", f"retrieve.kernels={kernels}")
            _retrieve(ctx, dev_view, cfg, embed, cpu_q, None, everyone[:8])  # compiles / warms up, unclocked
            seconds, timings, got = _retrieve(ctx, dev_view, cfg, embed, cpu_q, None, everyone)
            record(f"device_none_{kernels}", seconds, timings, len(got))
            same = [a.pack_key() == b.pack_key() and a.excerpts == b.excerpts and a.prf_terms == b.prf_terms
                    for a, b in zip(ref, got, strict=True)]
            metrics["runs"][f"device_none_{kernels}"]["packs_identical"] = sum(same)
            checks[f"packs_identical_rerank_none_{kernels}"] = all(same)

    # the random cross-encoder: the device reranks every question; the CPU a share the budget allows
    with _part(metrics, "cross_encoder"):
        ce_cfg = ctx.config("rerank.backend=cross-encoder", f"rerank.model={ctx.cross_encoder_folder()}")
        cpu_ce, dev_ce = ctx.cross_encoder("cpu"), ctx.cross_encoder("device")
        share = 0.5 if ctx.on_gpu else 0.25  # a CPU run reranks its share twice (its "device" is the CPU)
        order = np.random.default_rng(0).permutation(len(ctx.questions)).tolist()  # every memory in each chunk
        order = order[:2] if ctx.quick else order
        timings: dict[str, float] = {}

        def rerank_on_cpu(chunk: list[int]) -> list[RetrievalResult]:
            _, chunk_timings, results = _retrieve(ctx, cpu_view, ce_cfg, embed, cpu_q, cpu_ce, chunk)
            for key, value in chunk_timings.items():
                timings[key] = timings.get(key, 0.0) + value
            return results

        seconds, picked, parts = _until(share * ctx.allowance(), _chunks(order, 25), rerank_on_cpu)
        cpu_res = [r for part in parts for r in part]
        record("cpu_cross_encoder", seconds, timings, len(cpu_res))
        dev_pick = everyone if ctx.on_gpu else picked  # a CPU run repeats the CPU's share
        seconds, timings, dev_res = _retrieve(ctx, dev_view, ce_cfg, embed, cpu_q, dev_ce, dev_pick)
        record("device_cross_encoder", seconds, timings, len(dev_res))
        dev_by_question = dict(zip(dev_pick, dev_res, strict=True))
        differ = [(a, dev_by_question[i]) for i, a in zip(picked, cpu_res, strict=True)
                  if a.pack_key() != dev_by_question[i].pack_key()]
        unexplained = sum(not _explained(a, b) for a, b in differ)
        metrics["cross_encoder"] = {"questions_compared": len(picked), "packs_identical": len(picked) - len(differ),
                                    "near_ties": len(differ) - unexplained, "unexplained": unexplained}
        checks["packs_rerank_cross_encoder"] = unexplained == 0

    # the device's own embeddings (question, episode and PRF vectors): how many packs move (reported)
    if ctx.on_gpu:
        with _part(metrics, "device_embeddings"):
            dev_ep, dev_q = ctx.embeddings("device")
            own_view = _views(ctx, dev_ep, none)
            seconds, timings, own = _retrieve(ctx, own_view, none, ctx.embed_fn("device"), dev_q, None, everyone)
            record("device_embeddings_none", seconds, timings, len(own))
            metrics["device_embeddings"] = {"packs_identical": sum(a.pack_key() == b.pack_key()
                                                                   for a, b in zip(ref, own, strict=True)),
                                            "questions": len(own)}
    else:
        skipped["device_embeddings"] = "CPU run: the device's embeddings are the CPU's"
    return metrics


# ---------------------------------------------------------------------------------------------- stage 5
def _bm25_tensor_bytes(index: BM25Index) -> int:
    """Bytes of the index's tensors (postings, per-row and per-term columns, the search cache)."""
    total = sum(buf.capacity_bytes for buf in vars(index).values() if isinstance(buf, GrowableTensor))
    return total + sum(t.nbytes for t in (index._cache or {}).values() if isinstance(t, torch.Tensor))


def _gpu_memory(ctx: Context, base: int) -> dict[str, int] | None:
    if not ctx.on_gpu:
        return None
    return {"allocated_bytes": torch.cuda.memory_allocated(ctx.device) - base,
            "peak_allocated_bytes": torch.cuda.max_memory_allocated(ctx.device) - base,
            "peak_reserved_bytes": torch.cuda.max_memory_reserved(ctx.device)}


def _reset_peaks(ctx: Context) -> int:
    ctx.free_device_memory()
    if not ctx.on_gpu:
        return 0
    torch.cuda.reset_peak_memory_stats(ctx.device)
    return torch.cuda.memory_allocated(ctx.device)


def stage_memory(ctx: Context) -> dict[str, Any]:
    """Peak GPU memory (allocated / reserved, above what was held before) and host RSS for the LoCoMo
    build + retrieval, and for a BM25 index of LongMemEval-M's shape (synthetic, streamed memory by
    memory) scaled to the budget and extrapolated per posting to the full 500 memories."""
    metrics: dict[str, Any] = {"host_before": host_memory(), "checks": {}}
    base = _reset_peaks(ctx)
    cpu_ep, cpu_q = ctx.embeddings("cpu")
    none = ctx.config("rerank.backend=none")
    build_s, view = ctx.timed(lambda: _views(ctx, cpu_ep, none))
    after_build = _gpu_memory(ctx, base)
    seconds, _, results = _retrieve(ctx, view, none, ctx.embed_fn("cpu"), cpu_q, None, range(len(ctx.questions)))
    metrics["locomo"] = {"episodes": len(ctx.episodes), "questions": len(results), "build_s": build_s,
                         "retrieve_s": seconds, "bm25_tensor_bytes": _bm25_tensor_bytes(view.ep_bm25),
                         "gpu_after_build": after_build, "gpu": _gpu_memory(ctx, base), "host": host_memory()}
    del view, results

    # LongMemEval-M shape: as many memories as the budget allows (about 1.5 s of CPU each to generate
    # and tokenise), searched with their questions on the device
    n_memories = 1 if ctx.quick else int(min(LME_M_MEMORIES, max(1, ctx.allowance() * 0.6 / 1.5)))
    base = _reset_peaks(ctx)
    index = BM25Index(device=ctx.device)
    queries: list[list[str]] = []
    mems: list[int] = []
    start = time.perf_counter()
    turns = 0
    for m_idx, memory in enumerate(iter_memories("longmemeval-m", n_memories, seed=0)):
        memory_turns = memory.turns()
        index.add(tokenize_many([t.text for t in memory_turns]), [m_idx] * len(memory_turns))
        turns += len(memory_turns)
        queries += [tokenize(q.question) for q in memory.questions]
        mems += [m_idx] * len(memory.questions)
    ctx.sync()
    build_s = time.perf_counter() - start
    after_build = _gpu_memory(ctx, base)
    search_s, found = ctx.timed(lambda: index.search(queries, mems, SCAN_K))
    postings = int(index._post_term.size)
    resident = _bm25_tensor_bytes(index)
    scale = LME_M_MEMORIES / n_memories
    synthetic: dict[str, Any] = {
        "memories": n_memories, "turns": turns, "postings": postings, "build_s": build_s, "search_s": search_s,
        "hits": int((found[1] >= 0).sum()), "bm25_tensor_bytes": resident, "bytes_per_posting": resident / postings,
        "gpu_after_build": after_build, "gpu": _gpu_memory(ctx, base), "host": host_memory(),
        "extrapolated_to_full_m": {
            "note": f"linear in postings from {n_memories} of {LME_M_MEMORIES} memories (not measured at full M)",
            "postings": int(postings * scale), "bm25_tensor_bytes": int(resident * scale)},
    }
    if ctx.on_gpu:
        peak = synthetic["gpu"]["peak_allocated_bytes"]
        synthetic["extrapolated_to_full_m"]["peak_allocated_bytes"] = int(peak * scale)
    metrics["longmemeval_m_bm25"] = synthetic
    metrics["checks"]["every_question_found_rows"] = bool((found[1][:, 0] >= 0).all())
    if not ctx.on_gpu:
        metrics["skipped"] = {"gpu_memory": "CPU run: host memory only"}
    return metrics


# ---------------------------------------------------------------------------------------------- stage 6
def stage_bench_kernels(ctx: Context) -> dict[str, Any]:
    """experiments/bench_kernels.py's GPU stage: Triton against torch on synthetic LoCoMo, S and (if the
    budget allows) M shapes, every result identical. Sizes are scaled to the budget: building S takes
    about 0.15 s of CPU per question, M about 1.5 s."""
    bench = _load_module(REPO / "experiments" / "bench_kernels.py", "bench_kernels")
    if not ctx.on_gpu:
        if not (triton_available() and interpreting()):
            raise Skip("CPU run without the Triton interpreter")
        result = bench.run(["locomo:30"], torch.device("cpu"), repeats=1, with_triton=True, progress=False)
        result["note"] = "CPU dry run under TRITON_INTERPRET=1: timings are the interpreter's, not a GPU's"
    else:
        allowance = ctx.allowance()
        sizes = ["locomo"]
        s_questions = int(min(500, max(0.0, allowance - 30) * 0.5 / 0.15))
        if s_questions >= 50:
            sizes.append(f"s:{s_questions}")
        m_questions = int(min(500, max(0.0, allowance - 30 - s_questions * 0.15) * 0.8 / 1.5))
        if m_questions >= 20:
            sizes.append(f"m:{m_questions}")
        result = bench.run_gpu_stage(sizes, str(ctx.device), repeats=3)
    result["checks"] = {f"identical_{size}": bool(row["identical"]) for size, row in result["sizes"].items()}
    return result


@dataclass(frozen=True)
class Stage:
    name: str
    title: str
    run: Callable[[Context], dict[str, Any]]
    top: bool  # one of the four that decide the verdict: skipping one leaves it incomplete
    min_s: float  # least seconds a useful run takes on the GPU machine (full mode); --quick takes a tenth


STAGES = (
    Stage("kernels", "Triton kernels vs torch reference, bit-identical across runs", stage_kernels, True, 45),
    Stage("bm25", "BM25 device vs CPU on LoCoMo (search, Triton, PRF, delete, state_dict, .to)", stage_bm25, True,
          15),
    Stage("encoders", "encoders fp32/bf16 device vs CPU vs sentence-transformers, cross-encoder, throughput, OOM",
          stage_encoders, True, 40),
    Stage("retrieval", "batched retrieval of every LoCoMo question, device vs CPU packs", stage_retrieval, True, 40),
    Stage("memory", "peak GPU/host memory: LoCoMo, and BM25 at LongMemEval-M shape", stage_memory, False, 25),
    Stage("bench_kernels", "bench_kernels GPU stage: Triton vs torch at LoCoMo / S / M shapes", stage_bench_kernels,
          False, 30),
)

# Issue 14 (later work): the GPU figures (encoder scaling, M-scale retrieval on the GPU) join the check as
# stages here, after everything above in priority, so they only use budget the checks leave over.
FIGURE_STAGES: tuple[Stage, ...] = ()
