"""The stages of experiments/gpu_check.py (imported by it after it has put the tree, the assets' packages
and the FAISS stand-in in place; not a script of its own).

A stage fills `ctx.metrics`, its entry in gpu_check.json, which the runner rewrites after every part:
`checks` maps each property verified to True/False (the stage passes when all hold), `skipped` names
parts that do not apply here and why, `placement` says where each device-side index or model ended
(each one is also a `<name>_on_device` check: an index that fell back to the CPU fails its stage),
`runtime` records the kernel backend, dense placement and dtypes it ran with, and `figures` the numbers
the verdict needs (the kernel speed ratio, the memory peaks). Work happens in parts (`ctx.part(name)`):
each is timed, names itself in the JSON while it runs and is bounded, by a fixed cap or by its share of
what the budget leaves (`ctx.allowance()`). A stage that cannot run at all raises `Skip`.

On `--device cpu` the "device" side is the CPU too: the run proves the code paths (Triton kernels under
TRITON_INTERPRET=1), not GPU numbers.

Two switches exist to prove the verdict, for tests: GPU_CHECK_FORCE_FALLBACK=<stage> moves that stage's
device BM25 index off the device before its placement is taken, as index/bm25.py's out-of-memory fallback
moves it (to the CPU; on a CPU run to "meta", the one other device there), and GPU_CHECK_STALL=<stage>.<part>
(or `setup`) makes that part hang, for the watchdog.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import logging
import math
import os
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

from memfit_gpu import faults
from memfit_gpu.buffers import GrowableTensor
from memfit_gpu.config import MemFitConfig, ReaderConfig, load_config
from memfit_gpu.data import load_benchmark, select_questions
from memfit_gpu.data.schema import Memory
from memfit_gpu.data.synth import iter_memories
from memfit_gpu.index.bm25 import BM25Index
from memfit_gpu.index.encoders import BiEncoder, CrossEncoderModule, random_cross_encoder
from memfit_gpu.index.tokenize import tokenize, tokenize_many
from memfit_gpu.kernels._launch import interpreting, triton_available
from memfit_gpu.plan import GIB, Gpu, Node, make_plan, workload_of
from memfit_gpu.plan.node import host_memory_bytes
from memfit_gpu.plan.sizes import CUDA_CONTEXT_BYTES
from memfit_gpu.readers.types import Request
from memfit_gpu.retrieve.batched import RetrievalResult, kernel_backend, retrieve_batch
from memfit_gpu.retrieve.view import ReadView
from memfit_gpu.store import episode_text

REPO = Path(__file__).resolve().parents[1]
log = logging.getLogger("gpu_check")

FALLBACK_ENV = "GPU_CHECK_FORCE_FALLBACK"
STALL_ENV = "GPU_CHECK_STALL"
SCAN_K = 60  # retrieve.scan_top_k: what the read path asks BM25 for
CE_CANDIDATES = 80  # rerank.rerank_pool: the cross-encoder's candidates per question
QUICK_MEMORIES = 2  # --quick: the first two LoCoMo conversations, ...
QUICK_SESSIONS = 8  # ... their first 8 sessions (about 300 turns in all) ...
QUICK_QUESTIONS = 20  # ... and the first 20 evaluated questions of each
FP32_TOLERANCE = 1e-4  # float32 embeddings (unit vectors, entries ~0.05), GPU vs CPU and vs sentence-transformers
FP32_MIN_COSINE = 1 - 1e-5
CE_TOLERANCE = FP32_TOLERANCE  # cross-encoder logits, GPU vs CPU: the same float32 bar as the bi-encoder's
# The same text encoded in batches of other shapes (padding width, rows per GEMM) is not bit-equal even on
# the CPU (measured: ~1.6e-7 apart, oneDNN and attention reductions depend on the shape); within a few
# float32 ulps is what float32 keeps, and the bits are reported beside it.
DUPLICATE_TOLERANCE = 1e-6
# Score differences (cross-encoder logits, z-scored final scores) up to this are float noise; a top-10
# or pack difference is a near tie only under it.
NEAR_TIE_NOISE = 1e-3
BF16_MIN_COSINE = 0.99
LME_M_MEMORIES = 500  # LongMemEval-M: 500 questions, each its own ~5,500-turn memory
# Fixed caps of the CPU references (the CPU side of a comparison is the slow one): questions and seconds
CE_CPU_QUESTIONS, CE_CPU_CAP_S = 24, 30.0  # encoders_more: cross-encoder top-10, 80 candidates each
RERANK_CPU_QUESTIONS, RERANK_CPU_CAP_S = 48, 40.0  # rerank: retrieve_batch with the cross-encoder
S_CAP_S = 60.0  # kernels: building synthetic LongMemEval-S for the speed figure, ~0.15 s of CPU a question
M_CAP_S = 90.0  # kernels_m and memory: synthetic LongMemEval-M, ~1.5 s of CPU a memory
WORKER_START_TIMEOUT_S = 60.0  # workers: at most this long for worker processes to start
READER_PROMPTS = 16  # reader: LoCoMo questions answered at batch size 1 and 8
# reader near ties: the step where two answers part had its top two logits within this share of the top
# logit (float32: GEMM reduction order; bf16: 8 bits of mantissa, rounded at every layer)
READER_TIE = {"float32": 1e-4, "bf16": 2**-5}


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
    """A script of the tree (tests/support/kernel_cases.py, experiments/bench_kernels.py) as a module."""
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


def tf32_state() -> dict[str, Any]:
    """Whether float32 matrix products may run in TF32 (torch's switches; off by default)."""
    return {"matmul_allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
            "cudnn_allow_tf32": bool(torch.backends.cudnn.allow_tf32),
            "float32_matmul_precision": torch.get_float32_matmul_precision()}


@dataclass
class Context:
    """What the stages share: the device, the budget, LoCoMo, the config and cached models/embeddings,
    and the running stage's metrics with the runner's callback that rewrites the JSON."""

    device: torch.device
    quick: bool
    assets: Path
    work: Path  # scratch space (the random cross-encoder and reader folders)
    deadline: float  # time.perf_counter() value when the budget is spent
    memories: list[Memory] = field(default_factory=list)
    reserve: float = 0.0  # seconds the stages after the current one need (set by the runner)
    cache: dict[str, Any] = field(default_factory=dict)
    stage: str = ""  # the running stage (set by the runner)
    metrics: dict[str, Any] = field(default_factory=dict)  # its entry's metrics (the runner writes them)
    on_part: Callable[[str | None], None] = lambda part: None  # the runner: a part starts (name) or ends (None)
    fallback_stage: str | None = None  # GPU_CHECK_FORCE_FALLBACK
    stall: str | None = None  # GPU_CHECK_STALL

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
        return cls(device=dev, quick=quick, assets=assets, work=work, deadline=deadline, memories=memories,
                   fallback_stage=os.environ.get(FALLBACK_ENV) or None, stall=os.environ.get(STALL_ENV) or None)

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

    # -- parts, placement, runtime
    @contextlib.contextmanager
    def part(self, name: str, guard: bool = True) -> Iterator[None]:
        """One part of the running stage: named in the JSON while it runs (the runner writes it, then
        the kill point `gpu_check.part` is passed), timed into metrics["part_seconds"]. Guarded, an
        exception fails the check `name` and is kept in metrics["errors"] instead of ending the stage:
        one broken path (Triton without a C compiler, an unexpected OOM) must not hide what the stage's
        other parts measure. Unguarded (later parts need its result), it ends the stage as a failure."""
        metrics = self.metrics
        self.on_part(name)
        faults.point("gpu_check.part")
        if self.stall == f"{self.stage}.{name}":
            stall_forever()
        start = time.perf_counter()
        try:
            yield
        except Skip:
            raise
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
            self.on_part(None)

    @property
    def fallback_device(self) -> torch.device:
        """Where GPU_CHECK_FORCE_FALLBACK moves an index: the CPU, or "meta" when the CPU is the device."""
        return torch.device("meta") if self.device.type == "cpu" else torch.device("cpu")

    def placed(self, name: str, where: torch.device | str, movable: Any = None) -> None:
        """Record where a device-side index or model ended; it must be on the checked device. `movable`
        (an index with .to/.device) is what GPU_CHECK_FORCE_FALLBACK moves off the device first."""
        if movable is not None and self.fallback_stage == self.stage:
            movable.to(self.fallback_device)
            where = movable.device
        where = torch.device(where)
        self.metrics.setdefault("placement", {})[name] = str(where)
        self.metrics["checks"][f"{name}_on_device"] = where == self.device

    def runtime(self, key: str, value: Any) -> None:
        self.metrics.setdefault("runtime", {})[key] = value

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

    def config(self, side: str, *overrides: str) -> MemFitConfig:
        """configs/memfit.yaml (the paper's settings) with retrieval on one side: "cpu" (BM25 and the
        dense product on the CPU: the reference) or "device" (BM25 on the checked device and
        index.dense_device=auto: the production dense path, the batched exact product on the GPU when
        torch sees one; FAISS, the exact stand-in, is never needed below 65,536 rows a memory)."""
        where = (["index.device=cpu", "index.dense_device=cpu"] if side == "cpu"
                 else [f"index.device={self.device}", "index.dense_device=auto"])
        return load_config(REPO / "configs" / "memfit.yaml", [*where, *overrides])

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


def stall_forever() -> None:
    """GPU_CHECK_STALL: a part that never ends (the watchdog's test)."""
    while True:
        time.sleep(1.0)


# ---------------------------------------------------------------------------------------------- kernels
def _kernel_cases(ctx: Context, names: Sequence[str], repeats: int) -> None:
    """tests/support/kernel_cases.py's cases `names`, each a part: the kernel on the device `repeats` times
    against the torch reference on the CPU, every run compared bit for bit."""
    if not triton_available():
        raise Skip("triton is not installed")
    if not ctx.on_gpu and not interpreting():
        raise Skip("CPU run without TRITON_INTERPRET=1: the kernels run on CUDA tensors only")
    cases = _load_module(REPO / "tests" / "support" / "kernel_cases.py", "kernel_cases")
    m = ctx.metrics
    m.update(repeats=repeats, compiled=ctx.on_gpu)
    m.setdefault("cases", {})
    for name in names:
        with ctx.part(f"case_{name}"):
            start = time.perf_counter()
            result = cases.CASES[name](device=str(ctx.device), repeats=repeats)
            m["cases"][name] = {**result, "seconds": round(time.perf_counter() - start, 3)}
            m["checks"][f"{name}_bit_identical_{repeats}_runs"] = bool(result["ok"]) and result["checked"] > 0


def _bench_kernels(ctx: Context, size: str) -> dict[str, Any]:
    """experiments/bench_kernels.py at one size: Triton against the torch path, timed, every bit compared."""
    bench = _load_module(REPO / "experiments" / "bench_kernels.py", "bench_kernels")
    if ctx.on_gpu:
        row = bench.run_gpu_stage([size], str(ctx.device), repeats=3)["sizes"][size]
    else:
        row = bench.run([size], torch.device("cpu"), repeats=1, with_triton=True, progress=False)["sizes"][size]
        row["note"] = "CPU dry run under TRITON_INTERPRET=1: timings are the interpreter's, not a GPU's"
    return row


def stage_kernels(ctx: Context) -> None:
    """Each Triton kernel (compiled on the GPU; the interpreter on a CPU run) against its torch reference,
    bit for bit over repeated runs, then their speed against the torch path at LoCoMo and S size. Every
    variant compiled is in the stage's `kernel_variants` with the seconds of its first launch."""
    m = ctx.metrics
    names = _load_module(REPO / "tests" / "support" / "kernel_cases.py", "kernel_cases").KERNEL_CASES
    if ctx.quick and not ctx.on_gpu:  # the interpreter takes ~75 s for these two; the CI runs them already
        for name in names[2:]:
            m["skipped"][f"case_{name}"] = "--quick: tests/kernels/test_kernels.py runs it under the interpreter"
        names = names[:2]
    _kernel_cases(ctx, names, 10 if ctx.on_gpu else (1 if ctx.quick else 2))
    m["speed"] = {}
    if ctx.on_gpu:
        # building S takes ~0.15 s of CPU a question: as many as S_CAP_S (or a third of what is left) allows
        s_questions = int(min(500, min(S_CAP_S, ctx.allowance() / 3) / 0.15))
        sizes = ["locomo"] + ([f"s:{s_questions}"] if s_questions >= 50 else [])
        if s_questions < 50:
            m["skipped"]["speed_s"] = f"budget: {ctx.allowance():.0f} s left for this stage"
    else:
        sizes = ["locomo:8", "s:3"] if ctx.quick else ["locomo:100", "s:10"]
    for size in sizes:
        with ctx.part(f"speed_{size.partition(':')[0]}"):
            row = m["speed"][size] = _bench_kernels(ctx, size)
            m["checks"][f"speed_identical_{size}"] = bool(row["identical"])
    ratios = {size: row["ratio"] for size, row in m["speed"].items() if row.get("ratio")}
    if any(size.startswith("locomo") for size in ratios):
        m["figures"] = {"kernel_speed_ratio": ratios}


def stage_kernels_m(ctx: Context) -> None:
    """bench_kernels at LongMemEval-M shape (`m:Q`, Q sized to the budget: ~1.5 s of CPU a memory)."""
    if not triton_available() or not (ctx.on_gpu or interpreting()):
        raise Skip("no triton, or a CPU run without TRITON_INTERPRET=1")
    if ctx.on_gpu:
        questions = int(min(LME_M_MEMORIES, max(0.0, min(M_CAP_S, ctx.allowance() * 0.8) - 10) / 1.5))
        if questions < 10:
            raise Skip(f"budget: {ctx.allowance():.0f} s left, M needs ~25 s for 10 memories")
        size = f"m:{questions}"
    else:
        size = "m:1"
    with ctx.part("speed_m"):
        row = ctx.metrics.setdefault("speed", {})[size] = _bench_kernels(ctx, size)
        ctx.metrics["checks"][f"speed_identical_{size}"] = bool(row["identical"])


def stage_kernels_wide(ctx: Context) -> None:
    """Optional, last: the segment_topk kernel itself above TRITON_MAX_K (K_PAD 128), which the read path
    never launches (k > 64 takes the torch reference); its compile seconds are in `kernel_variants`."""
    cases = _load_module(REPO / "tests" / "support" / "kernel_cases.py", "kernel_cases")
    _kernel_cases(ctx, cases.WIDE_CASES, 3 if ctx.on_gpu else 1)


# ---------------------------------------------------------------------------------------------- bm25
def stage_bm25(ctx: Context) -> None:
    """BM25Index on the device against the CPU on LoCoMo: scores and rows bit for bit for every evaluated
    question (torch path, Triton path), PRF terms and their encoded search, idf, a delete, state_dict
    across devices and .to(); the device index must end on the device."""
    m = ctx.metrics
    checks = m["checks"]
    tokens = tokenize_many(ctx.episodes)
    mems = ctx.episode_memory
    queries = [tokenize(q) for q in ctx.questions]
    q_mems = ctx.question_memory
    m.update(episodes=len(tokens), questions=len(queries), k=SCAN_K)
    with ctx.part("build", guard=False):
        cpu = BM25Index(device="cpu")
        cpu.add(tokens, mems)
        dev = BM25Index(device=ctx.device)
        m["device_build_s"], _ = ctx.timed(lambda: dev.add(tokens, mems))
    with ctx.part("search_torch", guard=False):  # the reference every later part compares with
        cpu_s, ref = ctx.timed(lambda: cpu.search(queries, q_mems, SCAN_K))
        dev.search(queries[:1], q_mems[:1], SCAN_K)  # the weight cache, outside the clock
        dev_s, got = ctx.timed(lambda: dev.search(queries, q_mems, SCAN_K))
        checks["search_torch_bits"] = results_equal(ref, got)
        m.update(cpu_search_s=cpu_s, device_search_s=dev_s, hits=int((ref[1] >= 0).sum()))
    kernels = {"torch": "torch"}
    # the Triton path: compiled on a GPU, the interpreter on a CPU run (a subset there: it is slow)
    if triton_available() and (ctx.on_gpu or interpreting()):
        with ctx.part("search_triton"):
            n_triton = len(queries) if ctx.on_gpu else min(len(queries), 40 if ctx.quick else 100)
            dev.search(queries[:1], q_mems[:1], SCAN_K, kernels="triton")  # compiles, outside the clock
            triton_s, tri = ctx.timed(lambda: dev.search(queries[:n_triton], q_mems[:n_triton], SCAN_K,
                                                         kernels="triton"))
            checks["search_triton_bits"] = results_equal((ref[0][:n_triton], ref[1][:n_triton]), tri)
            m.update(triton_questions=n_triton, device_triton_search_s=triton_s)
            kernels["triton"] = "triton"
    else:
        m["skipped"]["search_triton"] = "no triton, or a CPU run without TRITON_INTERPRET=1"
    ctx.runtime("kernels", kernels)

    with ctx.part("prf"):  # the terms of the top-2 rows straight from the postings, then their encoded search
        prf_cpu = cpu.feedback_terms(ref[1][:, :2], 4, 12, "idf")
        prf_dev = dev.feedback_terms(got[1][:, :2], 4, 12, "idf")
        checks["prf_terms_equal"] = results_equal(prf_cpu, prf_dev) and cpu.term_tokens(
            prf_cpu[1]) == dev.term_tokens(prf_dev[1].cpu())
        checks["prf_search_bits"] = results_equal(cpu.search_encoded(*prf_cpu, q_mems, SCAN_K),
                                                  dev.search_encoded(*prf_dev, q_mems, SCAN_K))
        m["prf_pairs"] = int(prf_cpu[0].numel())
    with ctx.part("idf_and_stats"):
        # idf in float64 (log1p on each device): a last-bit difference is possible and harmless here (the
        # PRF term order is integer df order; posting weights are rounded to float32 on a grid)
        idf_cpu = [v for row in cpu.idf(queries, q_mems) for v in row]
        idf_dev = [v for row in dev.idf(queries, q_mems) for v in row]
        m["idf_bits_equal"] = idf_cpu == idf_dev
        checks["idf_equal_to_1e-15"] = len(idf_cpu) == len(idf_dev) and all(
            abs(a - b) <= 1e-15 * max(abs(a), 1.0) for a, b in zip(idf_cpu, idf_dev, strict=True))
        checks["memory_stats_equal"] = all(cpu.memory_stats(i) == dev.memory_stats(i)
                                           for i in range(len(ctx.memories)))
    with ctx.part("delete", guard=False):  # every 7th row and each memory's first: N, df and avgdl change
        starts = np.cumsum([0] + [len(mem.turns()) for mem in ctx.memories])[:-1].tolist()
        deleted = sorted(set(range(0, len(tokens), 7)) | set(starts))
        cpu.delete(deleted)
        dev.delete(deleted)
        after = cpu.search(queries, q_mems, SCAN_K)
        checks["delete_search_bits"] = results_equal(after, dev.search(queries, q_mems, SCAN_K))
        checks["delete_removed_rows"] = not bool(np.isin(after[1].numpy(), deleted).any())
        m["deleted_rows"] = len(deleted)
    with ctx.part("state_dict"):
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
    with ctx.part("to"):  # .to() both ways, on copies (the stage's device index stays where it is)
        checks["to_cpu_to_device_bits"] = results_equal(after, from_dev.to(ctx.device).search(queries, q_mems, SCAN_K))
        checks["to_device_to_cpu_bits"] = results_equal(after, from_cpu.to("cpu").search(queries, q_mems, SCAN_K))
        checks["to_moved_every_tensor"] = (from_dev._post_term.device == ctx.device
                                           and from_cpu._post_term.device.type == "cpu")
    ctx.placed("bm25_index", dev.device, movable=dev)


# ---------------------------------------------------------------------------------------------- retrieval
def _retrieve(ctx: Context, view: ReadView, cfg: MemFitConfig, embed: Callable, q_emb: torch.Tensor,
              reranker: Any, picked: Sequence[int]) -> tuple[float, dict[str, float], list[RetrievalResult]]:
    timings: dict[str, float] = {}
    questions = [ctx.questions[i] for i in picked]
    mids = [ctx.question_memory_ids[i] for i in picked]
    seconds, results = ctx.timed(lambda: retrieve_batch(view, cfg, questions, mids, embed=embed,
                                                        question_embeddings=q_emb[list(picked)], reranker=reranker,
                                                        timings=timings))
    return seconds, {k: round(v, 4) for k, v in timings.items()}, results


def _near_tie(gap: float, difference: float) -> bool:
    """Two candidates `gap` apart may swap on the device when the question's scores moved by
    `difference` (float noise, at most NEAR_TIE_NOISE) and the gap is within twice that."""
    return difference <= NEAR_TIE_NOISE and gap <= 2 * difference


def _explained(a: RetrievalResult, b: RetrievalResult) -> bool:
    """A pack difference that a near tie explains: the same PRF terms, and where the final orders first
    part, two candidates both sides ranked, closer on the CPU than twice the question's largest
    final-score difference (float noise, `_near_tie`). A candidate only one side ranked, or PRF terms that
    differ, are no near tie: the difference began before the final order, and is counted as unexplained."""
    if a.prf_terms != b.prf_terms:
        return False
    final_a = {(c["kind"], c["row"]): c["final"] for c in a.ranked}
    final_b = {(c["kind"], c["row"]): c["final"] for c in b.ranked}
    common = final_a.keys() & final_b.keys()
    if not common:
        return False
    worst = max(abs(final_a[key] - final_b[key]) for key in common)
    order_a = [(c["kind"], c["row"]) for c in a.ranked]
    order_b = [(c["kind"], c["row"]) for c in b.ranked]
    first = next((i for i, (x, y) in enumerate(zip(order_a, order_b, strict=False)) if x != y), None)
    if first is None or order_a[first] not in common or order_b[first] not in common:
        return False
    return _near_tie(abs(final_a[order_a[first]] - final_a[order_b[first]]), worst)


def _pack_differences(ref: Sequence[RetrievalResult], got: Sequence[RetrievalResult],
                      picked: Sequence[int]) -> dict[str, Any]:
    """Identical packs, differences a near tie explains, the rest (with up to five examples)."""
    differ = [(i, a, b) for i, a, b in zip(picked, ref, got, strict=True) if a.pack_key() != b.pack_key()]
    unexplained = [(i, a, b) for i, a, b in differ if not _explained(a, b)]
    return {"questions": len(ref), "packs_identical": len(ref) - len(differ),
            "near_ties": len(differ) - len(unexplained), "unexplained": len(unexplained),
            "prf_terms_differ": sum(a.prf_terms != b.prf_terms for _, a, b in differ),
            "examples": [{"question": i, "cpu_pack": a.pack_key(), "device_pack": b.pack_key()}
                         for i, a, b in unexplained[:5]]}


def _device_kernels(ctx: Context) -> tuple[str, ...]:
    """retrieve.kernels settings to run on the device: auto (Triton on a GPU) and torch; on a CPU run the
    Triton path under the interpreter (auto would be torch there)."""
    if ctx.on_gpu:
        return ("auto", "torch")
    return ("triton",) if triton_available() and interpreting() else ("torch",)


def _record_view(ctx: Context, view: ReadView, name: str = "") -> None:
    """Where a device view's BM25 index and dense product ended, and how its memories are searched."""
    ctx.placed(f"{name}bm25_index", view.ep_bm25.device, movable=view.ep_bm25)
    dense = view.ep_dense
    ctx.placed(f"{name}dense_product", dense.product_device)
    searched = sorted({str(dense.memory_search(i)) for i in range(len(ctx.memories))})
    ctx.runtime(f"{name}dense", {"product_device": str(dense.product_device), "faiss": dense.placement,
                                 "searched_by": searched})
    ctx.metrics["checks"][f"{name}dense_batched_product"] = searched == ["batched"]


def stage_retrieval(ctx: Context) -> None:
    """retrieve_batch for every selected LoCoMo question, rerank none, with the production device path
    (BM25 on the device, the batched dense product on it, the Triton kernels) against the CPU: fed the
    same CPU embeddings every pack is identical; fed the device's own embeddings every difference must be
    a near tie."""
    m = ctx.metrics
    m.update(questions=len(ctx.questions), runs={})
    everyone = range(len(ctx.questions))

    def record(name: str, seconds: float, timings: dict[str, float], n: int) -> None:
        m["runs"][name] = {"questions": n, "seconds": seconds, "questions_per_s": n / seconds, "timings": timings}

    with ctx.part("embeddings_cpu", guard=False):
        cpu_ep, cpu_q = ctx.embeddings("cpu")
        m["encode_s_cpu"] = ctx.cache.get("encode_s:cpu")
    cpu_cfg = ctx.config("cpu", "rerank.backend=none")
    embed = ctx.embed_fn("cpu")
    with ctx.part("reference_cpu", guard=False):
        cpu_view = ReadView.from_memories(ctx.memories, None, cpu_cfg, embeddings=cpu_ep)
        _retrieve(ctx, cpu_view, cpu_cfg, embed, cpu_q, None, everyone)  # encodes the PRF queries, unclocked
        seconds, timings, ref = _retrieve(ctx, cpu_view, cpu_cfg, embed, cpu_q, None, everyone)
        record("cpu", seconds, timings, len(ref))
    dev_view = ReadView.from_memories(ctx.memories, None, ctx.config("device", "rerank.backend=none"),
                                      embeddings=cpu_ep)
    resolved: dict[str, str] = {}
    for kernels in _device_kernels(ctx):
        with ctx.part(f"packs_same_embeddings_{kernels}"):
            cfg = ctx.config("device", "rerank.backend=none", f"retrieve.kernels={kernels}")
            resolved[kernels] = kernel_backend(dev_view, kernels)
            if ctx.on_gpu:
                _retrieve(ctx, dev_view, cfg, embed, cpu_q, None, everyone[:8])  # compiles / warms up, unclocked
            seconds, timings, got = _retrieve(ctx, dev_view, cfg, embed, cpu_q, None, everyone)
            record(f"device_{kernels}", seconds, timings, len(got))
            same = [a.pack_key() == b.pack_key() and a.excerpts == b.excerpts and a.prf_terms == b.prf_terms
                    for a, b in zip(ref, got, strict=True)]
            m["runs"][f"device_{kernels}"]["packs_identical"] = sum(same)
            m["checks"][f"packs_identical_same_embeddings_{kernels}"] = all(same)
    ctx.runtime("kernels", resolved)
    _record_view(ctx, dev_view)

    # the device's own embeddings (question, episode and PRF vectors)
    if not ctx.on_gpu:
        m["skipped"]["packs_device_embeddings"] = "CPU run: the device's embeddings are the CPU's"
        return
    with ctx.part("embeddings_device", guard=False):
        dev_ep, dev_q = ctx.embeddings("device")
        m["encode_s_device"] = ctx.cache.get("encode_s:device")
    with ctx.part("packs_device_embeddings"):
        own_view = ReadView.from_memories(ctx.memories, None, ctx.config("device", "rerank.backend=none"),
                                          embeddings=dev_ep)
        cfg = ctx.config("device", "rerank.backend=none", "retrieve.kernels=auto")
        seconds, timings, own = _retrieve(ctx, own_view, cfg, ctx.embed_fn("device"), dev_q, None, everyone)
        record("device_own_embeddings", seconds, timings, len(own))
        m["device_embeddings"] = found = _pack_differences(ref, own, everyone)
        m["checks"]["packs_device_embeddings_near_ties"] = found["unexplained"] == 0
        _record_view(ctx, own_view, "own_embeddings_")


# ---------------------------------------------------------------------------------------------- encoders
def _compare_rows(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    cosine = torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=1)
    return {"max_abs_diff": float((a - b).abs().max()), "min_cosine": float(cosine.min()),
            "mean_cosine": float(cosine.mean()), "rows": int(a.shape[0])}


def stage_encoders(ctx: Context) -> None:
    """BiEncoder float32 on the device against the CPU, and against sentence-transformers on the same
    device: the same vectors, and the throughput of both on the same texts (the ratio is a figure)."""
    from sentence_transformers import SentenceTransformer  # 12-17 s to import: only the stages that use it

    m = ctx.metrics
    checks = m["checks"]
    with ctx.part("embeddings", guard=False):
        cpu_ep, cpu_q = ctx.embeddings("cpu")
        dev_ep, dev_q = ctx.embeddings("device")
    m["encode_s"] = {"cpu": ctx.cache.get("encode_s:cpu"), "device": ctx.cache.get("encode_s:device")}
    m["texts"] = len(ctx.episodes) + len(ctx.questions)
    if ctx.on_gpu:
        m["fp32_device_vs_cpu"] = compared = _compare_rows(torch.cat([cpu_ep, cpu_q]), torch.cat([dev_ep, dev_q]))
        checks["fp32_device_vs_cpu"] = (compared["max_abs_diff"] <= FP32_TOLERANCE
                                        and compared["min_cosine"] >= FP32_MIN_COSINE)
    else:
        m["skipped"]["fp32_device_vs_cpu"] = "CPU run: both sides are the same CPU encoder"
    encoder = ctx.encoder("device")
    with ctx.part("vs_sentence_transformers"):  # same device, same folder (its float32 config upcasts)
        texts = ctx.episodes if ctx.on_gpu else _spread(ctx.episodes, 64 if ctx.quick else 256)
        st = SentenceTransformer(ctx.encoder_path, device=str(ctx.device))

        def st_encode(batch: list[str]) -> torch.Tensor:
            return st.encode(batch, batch_size=128, normalize_embeddings=True, convert_to_tensor=True,
                             show_progress_bar=False).float().cpu()

        encoder.encode(texts[:64])  # warm-up of both: kernels, allocator
        st_encode(texts[:64])
        ours_s, ours = ctx.timed(lambda: encoder.encode(texts))
        st_s, st_rows = ctx.timed(lambda: st_encode(texts))
        m["vs_sentence_transformers"] = compared = _compare_rows(st_rows, ours)
        compared.update(texts=len(texts), ours_texts_per_s=len(texts) / ours_s, st_texts_per_s=len(texts) / st_s,
                        ratio=st_s / ours_s, sentence_transformers_dtype=str(next(st.parameters()).dtype),
                        st_batch_size=128, ours_batch_tokens=encoder.max_batch_tokens)
        checks["matches_sentence_transformers"] = (compared["max_abs_diff"] <= FP32_TOLERANCE
                                                   and compared["min_cosine"] >= FP32_MIN_COSINE)
        m["figures"] = {"encoder_vs_sentence_transformers": compared["ratio"]}
    ctx.placed("bi_encoder", encoder.devices[0])
    ctx.runtime("encoder_dtype", str(encoder.dtype))


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


def _top10(scores: torch.Tensor) -> list[int]:
    return scores.argsort(descending=True, stable=True)[:10].tolist()


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


@contextlib.contextmanager
def _warnings_of(logger_name: str, needle: str) -> Iterator[list[str]]:
    """The messages containing `needle` that `logger_name` logs inside the block."""
    seen: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if needle in record.getMessage():
                seen.append(record.getMessage())

    handler = Catch()
    logging.getLogger(logger_name).addHandler(handler)
    try:
        yield seen
    finally:
        logging.getLogger(logger_name).removeHandler(handler)


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
    torch.cuda.set_per_process_memory_fraction(cap / total, ctx.device)
    try:
        with _warnings_of("memfit_gpu.index.encoders", "batch size halved") as halvings:
            seconds, constrained = ctx.timed(lambda: encoder.encode(texts, batch_size=batch))
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, ctx.device)
        ctx.free_device_memory()
    return {"batch_size": batch, "unconstrained_peak_bytes": int(need), "cap_bytes": int(cap),
            "fraction": cap / total, "halvings": len(halvings), "last_message": halvings[-1] if halvings else None,
            "seconds": seconds, "bit_equal": bit_equal(reference, constrained),
            "max_abs_diff": float((reference - constrained).abs().max())}


def stage_encoders_more(ctx: Context) -> None:
    """Duplicate texts in different batches; bf16 against float32; the cross-encoder's top-10 on the device
    against the CPU (the CPU scores a fixed cap of questions); batch halving under a forced OOM."""
    m = ctx.metrics
    checks, skipped = m["checks"], m["skipped"]
    dev_ep, dev_q = ctx.embeddings("device")
    by_length = sorted(set(ctx.episodes), key=len)  # duplicates: probes of every length, alone and in batches
    probes = _spread(by_length, 6 if ctx.quick else 12)
    fillers = _spread(ctx.episodes, 24 if ctx.quick else 700)
    with ctx.part("duplicates"):
        m["duplicates"] = {"device": _duplicates(ctx.encoder("device"), probes, fillers)}
        checks["fp32_duplicates_within_rounding"] = m["duplicates"]["device"]["max_abs_diff"] <= DUPLICATE_TOLERANCE

    if not ctx.on_gpu:  # bf16, where the GPU has it natively
        skipped["bf16"] = "CPU run: bf16 is checked on a GPU"
    elif not torch.cuda.is_bf16_supported(including_emulation=False):
        skipped["bf16"] = f"{torch.cuda.get_device_name(ctx.device)} has no native bf16"
    else:
        with ctx.part("bf16"):
            bf16 = BiEncoder.from_pretrained(ctx.encoder_path, device=str(ctx.device), dtype="bf16")
            seconds, rows = ctx.timed(lambda: bf16.encode(ctx.episodes + ctx.questions, batch_size=128))
            m["bf16_vs_fp32"] = compared = _compare_rows(torch.cat([dev_ep, dev_q]), rows)
            compared["encode_s"] = seconds
            m["duplicates"]["bf16"] = _duplicates(bf16, probes, fillers)  # bf16 promises no bits
            checks["bf16_close_to_fp32"] = compared["min_cosine"] >= BF16_MIN_COSINE
            del bf16

    # the cross-encoder (seeded random head on the MiniLM body): top-10 of 80 candidates, device vs CPU;
    # the CPU scores at most CE_CPU_QUESTIONS questions in at most CE_CPU_CAP_S (10 at a time)
    with ctx.part("cross_encoder"):
        cpu_ce = ctx.cross_encoder("cpu")
        chunks = _chunks(_cross_encoder_pairs(ctx, 2 if ctx.quick else CE_CPU_QUESTIONS), 10)
        cpu_s, pairs, cpu_parts = _until(min(CE_CPU_CAP_S, 0.25 * ctx.allowance()), chunks, lambda chunk: cpu_ce.score(
            [(q, p) for q, passages in chunk for p in passages], batch_size=256))
        flat = [(q, p) for q, passages in pairs for p in passages]
        cpu_flat = torch.cat(cpu_parts)
        if ctx.on_gpu:
            dev_ce = ctx.cross_encoder("device")
            dev_s, dev_flat = ctx.timed(lambda: dev_ce.score(flat, batch_size=256))
            ctx.placed("cross_encoder", dev_ce.devices[0])
        else:  # the same module on the same CPU: scoring again would only repeat the work
            dev_s, dev_flat = cpu_s, cpu_flat
            skipped["cross_encoder_device"] = "CPU run: the device side is the CPU side"
        bounds = np.cumsum([0] + [len(p) for _, p in pairs]).tolist()
        split = [(cpu_flat[a:b], dev_flat[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
        agreement = _agreement([a for a, _ in split], [b for _, b in split])
        m["cross_encoder"] = {**agreement, "pairs": len(flat), "cpu_pairs_per_s": len(flat) / cpu_s,
                              "device_pairs_per_s": len(flat) / dev_s, "tolerance": CE_TOLERANCE}
        checks["cross_encoder_top10"] = agreement["unexplained"] == 0 and agreement["max_abs_diff"] <= CE_TOLERANCE

    if not ctx.on_gpu:  # OOM: a memory cap that the batch cannot fit in; the batch halves, the rows stay
        skipped["oom_halving"] = "CPU run: out-of-memory halving is a CUDA path"
    else:
        with ctx.part("oom_halving"):
            longest = sorted(ctx.episodes, key=len, reverse=True)[:1024]
            m["oom_halving"] = oom = _oom_halving(ctx, ctx.encoder("device"), longest)
            checks["oom_halved"] = oom["halvings"] >= 1
            checks["oom_rows_equal_unconstrained"] = oom["max_abs_diff"] <= DUPLICATE_TOLERANCE  # bits reported
    ctx.placed("bi_encoder", ctx.encoder("device").devices[0])


def stage_rerank(ctx: Context) -> None:
    """retrieve_batch with the random cross-encoder, BM25 and the dense product on the device against the
    CPU, the same CPU embeddings: the CPU reranks a fixed cap of questions (the slow side), the device
    every one; a pack difference must be a near tie."""
    m = ctx.metrics
    cpu_ep, cpu_q = ctx.embeddings("cpu")
    folder = ctx.cross_encoder_folder()
    cpu_cfg = ctx.config("cpu", "rerank.backend=cross-encoder", f"rerank.model={folder}")
    dev_cfg = ctx.config("device", "rerank.backend=cross-encoder", f"rerank.model={folder}")
    embed = ctx.embed_fn("cpu")
    cpu_view = ReadView.from_memories(ctx.memories, None, cpu_cfg, embeddings=cpu_ep)
    dev_view = ReadView.from_memories(ctx.memories, None, dev_cfg, embeddings=cpu_ep)
    order = np.random.default_rng(0).permutation(len(ctx.questions)).tolist()  # every memory in each chunk
    cap = 2 if ctx.quick else RERANK_CPU_QUESTIONS
    timings: dict[str, float] = {}
    with ctx.part("cpu_reference", guard=False):
        cpu_ce = ctx.cross_encoder("cpu")

        def rerank_on_cpu(chunk: list[int]) -> list[RetrievalResult]:
            _, chunk_timings, results = _retrieve(ctx, cpu_view, cpu_cfg, embed, cpu_q, cpu_ce, chunk)
            for key, value in chunk_timings.items():
                timings[key] = timings.get(key, 0.0) + value
            return results

        seconds, picked, parts = _until(min(RERANK_CPU_CAP_S, 0.5 * ctx.allowance()), _chunks(order[:cap], 8),
                                        rerank_on_cpu)
        cpu_res = [r for part in parts for r in part]
        m["cpu"] = {"questions": len(cpu_res), "seconds": seconds, "timings": timings}
    with ctx.part("device"):
        dev_ce = ctx.cross_encoder("device")
        if ctx.on_gpu:
            dev_pick = list(range(len(ctx.questions)))
            seconds, dev_timings, dev_res = _retrieve(ctx, dev_view, dev_cfg, embed, cpu_q, dev_ce, dev_pick)
            m["device"] = {"questions": len(dev_res), "seconds": seconds, "questions_per_s": len(dev_res) / seconds,
                           "timings": dev_timings}
        else:  # the same module on the same CPU: reranking again would only repeat the work
            dev_pick, dev_res = picked, cpu_res
            m["skipped"]["device"] = "CPU run: the device side is the CPU side"
        by_question = dict(zip(dev_pick, dev_res, strict=True))
        m["packs"] = found = _pack_differences(cpu_res, [by_question[i] for i in picked], picked)
        m["checks"]["packs_rerank_cross_encoder"] = found["unexplained"] == 0
        ctx.placed("cross_encoder", dev_ce.devices[0])
        ctx.runtime("kernels", kernel_backend(dev_view, dev_cfg.retrieve.kernels))
    _record_view(ctx, dev_view)


# ---------------------------------------------------------------------------------------------- memory
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


def stage_memory(ctx: Context) -> None:
    """Peak GPU memory (allocated / reserved, above what was held before) and host RSS for the LoCoMo
    build + retrieval on the device, and for a BM25 index of LongMemEval-M's shape (synthetic, streamed
    memory by memory) scaled to the budget and extrapolated per posting to the full 500 memories."""
    m = ctx.metrics
    m["host_before"] = host_memory()
    dev_ep, dev_q = ctx.embeddings("device")
    with ctx.part("locomo", guard=False):
        base = _reset_peaks(ctx)
        cfg = ctx.config("device", "rerank.backend=none")
        build_s, view = ctx.timed(lambda: ReadView.from_memories(ctx.memories, None, cfg, embeddings=dev_ep))
        after_build = _gpu_memory(ctx, base)
        seconds, _, results = _retrieve(ctx, view, cfg, ctx.embed_fn("device"), dev_q, None,
                                        range(len(ctx.questions)))
        gpu = _gpu_memory(ctx, base)
        m["locomo"] = {"episodes": len(ctx.episodes), "questions": len(results), "build_s": build_s,
                       "retrieve_s": seconds, "bm25_tensor_bytes": _bm25_tensor_bytes(view.ep_bm25),
                       "gpu_after_build": after_build, "gpu": gpu, "host": host_memory()}
        peaks = {"host_peak_rss_bytes": m["locomo"]["host"]["peak_rss_bytes"]}
        if gpu is not None:
            peaks.update(gpu_peak_allocated_bytes=gpu["peak_allocated_bytes"],
                         gpu_peak_reserved_bytes=gpu["peak_reserved_bytes"])
        m["figures"] = {"memory_peaks": {"locomo": peaks}}
        _record_view(ctx, view)
        del view, results

    # LongMemEval-M shape: as many memories as the budget allows (about 1.5 s of CPU each to generate
    # and tokenise), searched with their questions on the device
    with ctx.part("longmemeval_m_bm25"):
        n_memories = 1 if ctx.quick else int(min(LME_M_MEMORIES, max(1, min(M_CAP_S, ctx.allowance() * 0.6) / 1.5)))
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
            "hits": int((found[1] >= 0).sum()), "bm25_tensor_bytes": resident,
            "bytes_per_posting": resident / postings, "gpu_after_build": after_build, "gpu": _gpu_memory(ctx, base),
            "host": host_memory(),
            "extrapolated_to_full_m": {
                "note": f"linear in postings from {n_memories} of {LME_M_MEMORIES} memories (not measured at full M)",
                "postings": int(postings * scale), "bm25_tensor_bytes": int(resident * scale)},
        }
        if ctx.on_gpu:
            synthetic["extrapolated_to_full_m"]["peak_allocated_bytes"] = int(synthetic["gpu"]["peak_allocated_bytes"]
                                                                              * scale)
        m["longmemeval_m_bm25"] = synthetic
        m["checks"]["every_question_found_rows"] = bool((found[1][:, 0] >= 0).all())
        ctx.placed("longmemeval_m_bm25_index", index.device, movable=index)

    # BEAM-10M shape: one synthetic conversation of ~21,000 messages (data/synth.py beam-10m; the quick run:
    # the 100K shape), its BM25 index on the device and its 20 questions searched, with random unit
    # vectors of its messages in a dense index on the device, searched by vectors near the gold messages
    with ctx.part("beam_10m"):
        like = "beam-100k" if ctx.quick else "beam-10m"
        base = _reset_peaks(ctx)
        start = time.perf_counter()
        memory = next(iter_memories(like, 20, seed=0, embedding_dim=384))
        generated_s = time.perf_counter() - start
        memory_turns = memory.turns()
        index = BM25Index(device=ctx.device)
        build_s, _ = ctx.timed(lambda: index.add(tokenize_many([t.text for t in memory_turns]),
                                                 [0] * len(memory_turns)))
        queries = [tokenize(q.question) for q in memory.questions]
        search_s, found = ctx.timed(lambda: index.search(queries, [0] * len(queries), SCAN_K))
        vectors = torch.as_tensor(memory.extra["embeddings"], device=ctx.device)
        asked = torch.as_tensor(np.stack([q.extra["embedding"] for q in memory.questions]), device=ctx.device)
        dense_s, top = ctx.timed(lambda: torch.topk(asked @ vectors.T, SCAN_K, dim=1))
        positions = {t.turn_id: i for i, t in enumerate(memory_turns)}
        gold = [positions[q.evidence[0]] for q in memory.questions]
        m["beam_10m"] = {
            "like": like, "messages": len(memory_turns), "questions": len(memory.questions),
            "words": int(sum(len(t.text.split()) for t in memory_turns)), "generate_s": generated_s,
            "bm25_build_s": build_s, "bm25_search_s": search_s, "dense_search_s": dense_s,
            "postings": int(index._post_term.size), "bm25_tensor_bytes": _bm25_tensor_bytes(index),
            "bm25_gold_in_top": int(sum(g in found[1][i].tolist() for i, g in enumerate(gold))),
            "dense_gold_in_top": int(sum(g in top.indices[i].tolist() for i, g in enumerate(gold))),
            "gpu": _gpu_memory(ctx, base), "host": host_memory()}
        m["checks"]["beam_every_question_found_rows"] = bool((found[1][:, 0] >= 0).all())
    if not ctx.on_gpu:
        m["skipped"]["gpu_memory"] = "CPU run: host memory only"


# ---------------------------------------------------------------------------------------------- stand-ins
def random_reader(folder: Path, words: Sequence[str], seed: int = 0) -> Path:
    """A seeded random two-layer Llama with a word-level tokenizer of `words` (decoding joins words with
    spaces, so an answer's text gives back its token ids), saved as a transformers folder with a chat
    template: it stands in for a reader on a machine that has none. Weights drawn with a wide
    initializer_range, so the next-token logits spread (random near-uniform logits would tie at every
    step). Its answers mean nothing."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", "[BOS]", "[EOS]"]
    vocab = {token: i for i, token in enumerate(specials + [w for w in dict.fromkeys(words) if w not in specials])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", pad_token="[PAD]",
                                        bos_token="[BOS]", eos_token="[EOS]")
    tokenizer.chat_template = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
                               "{% if add_generation_prompt %}assistant {% endif %}")
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(folder))
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=0.2, tie_word_embeddings=False, pad_token_id=vocab["[PAD]"],
                         bos_token_id=vocab["[BOS]"], eos_token_id=vocab["[EOS]"])
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(str(folder))
    return folder


def _reader_requests(ctx: Context, n: int) -> list[Request]:
    picked = _spread(list(range(len(ctx.questions))), n)
    return [Request(messages=[{"role": "user", "content": ctx.questions[i]}], key=f"q{i}") for i in picked]


def _divergence(backend: Any, request: Request, other_text: str, tie: float) -> dict[str, Any]:
    """Where the answer to `request` at batch size 1 parts from `other_text` (its answer in a batch of 8):
    greedy decoding alone again with the logits kept, the first step whose token is not the other
    answer's (word-level tokens: the text gives its ids back; special tokens, which decoding drops, are
    passed over), and how far the batch-1 token's logit was above the other's there. A near tie when
    that margin is at most `tie` times the top logit (at least 1)."""
    tokenizer = backend.tokenizer
    ids = backend._prompt_ids(request)
    inputs = torch.tensor([ids], device=backend.device)
    with torch.inference_mode():
        out = backend.net.generate(input_ids=inputs, attention_mask=torch.ones_like(inputs),
                                   max_new_tokens=backend.cfg.max_new_tokens, do_sample=False, temperature=None,
                                   top_p=None, top_k=None, output_scores=True, return_dict_in_generate=True,
                                   pad_token_id=tokenizer.pad_token_id)
    generated = out.sequences[0, len(ids):].tolist()
    eos = backend._eos_ids()
    special = set(tokenizer.all_special_ids) - eos
    other = tokenizer(other_text, add_special_tokens=False)["input_ids"]
    j = 0
    for step, token in enumerate(generated):
        if token in special:
            continue
        wanted = other[j] if j < len(other) else next(iter(eos))  # the other answer's token, or its end
        if token in eos or token != wanted:
            if token in eos and j >= len(other):
                break  # both ended here: the texts agree
            logits = out.scores[step][0].float()
            margin = float(logits[token] - logits[wanted])
            top = float(logits[token])
            return {"step": step, "token": token, "other_token": wanted, "margin": margin, "top_logit": top,
                    "near_tie": margin <= tie * max(1.0, abs(top))}
        j += 1
    return {"step": None, "near_tie": False, "note": "the batch-1 path did not part from the other answer"}


def stage_reader(ctx: Context) -> None:
    """A stand-in for the reader that machine cannot run (no vLLM, no weights): the transformers reader
    backend on the device with a small random Llama, greedy answers to LoCoMo questions at batch size 1
    and 8 in float32 and bf16. Batch invariance: every answer that differs must part at a near tie."""
    from memfit_gpu.readers.transformers import TransformersBackend  # imports PIL: only this stage needs it

    m = ctx.metrics
    with ctx.part("model", guard=False):
        words = [w for text in ctx.episodes for w in tokenize(text)]
        folder = ctx._cached("reader_folder", lambda: random_reader(ctx.work / "reader", words))
    requests = _reader_requests(ctx, 6 if ctx.quick else READER_PROMPTS)
    m["requests"] = len(requests)
    for dtype in ("float32", "bf16"):
        if dtype == "bf16" and ctx.on_gpu and not torch.cuda.is_bf16_supported(including_emulation=False):
            m["skipped"]["bf16"] = f"{torch.cuda.get_device_name(ctx.device)} has no native bf16"
            continue
        with ctx.part(f"batch_invariance_{dtype}"):
            backend = TransformersBackend(ReaderConfig(model=str(folder), dtype=dtype, batch_size=1,
                                                       max_new_tokens=12), device=str(ctx.device))
            single_s, single = ctx.timed(lambda backend=backend: backend.generate(requests))
            backend.batch_size = 8
            batched_s, batched = ctx.timed(lambda backend=backend: backend.generate(requests))
            differ = [i for i, (a, b) in enumerate(zip(single, batched, strict=True)) if a.text != b.text]
            parted = {i: _divergence(backend, requests[i], batched[i].text, READER_TIE[dtype]) for i in differ}
            unexplained = [i for i, found in parted.items() if not found["near_tie"]]
            m[dtype] = {"identical": len(requests) - len(differ), "near_ties": len(differ) - len(unexplained),
                        "unexplained": len(unexplained), "divergences": {str(i): v for i, v in parted.items()},
                        "batch_1_s": single_s, "batch_8_s": batched_s,
                        "answered": sum(bool(r.text) for r in single), "model_dtype": str(backend.net.dtype)}
            m["checks"][f"batch_invariant_{dtype}"] = not unexplained and len(single) == len(batched) == len(requests)
            ctx.placed(f"reader_{dtype}", backend.device)
            del backend
    ctx.runtime("reader_dtypes", {d: m[d]["model_dtype"] for d in ("float32", "bf16") if d in m})


def stage_vllm_room(ctx: Context) -> None:
    """A stand-in for what vLLM engines leave to retrieval (that machine has no vLLM): `memfit plan` for a
    vLLM reader on this GPU, with reader.gpu_memory_utilization set as high as the plan says still leaves
    memfit its predicted share; then this process is capped to exactly what such an engine leaves
    (set_per_process_memory_fraction) and builds and retrieves LoCoMo with the cross-encoder under it. The
    plan's figure holds when that run neither runs out of memory nor halves a batch, and its measured peak
    stays within the plan's prediction."""
    m = ctx.metrics
    if ctx.on_gpu:
        props = torch.cuda.get_device_properties(ctx.device)
        gpu = Gpu(0, str(props.name), int(props.total_memory))  # the plan numbers its GPUs from 0
    else:
        gpu = Gpu(0, "H200 (described: CPU run)", int(139.8 * GIB))
    node = Node((gpu,), host_memory_bytes(), "the checked GPU" if ctx.on_gpu else "described", faiss_gpu=False)
    folder = ctx.cross_encoder_folder()
    base = ("reader.backend=vllm", "reader.model=Qwen/Qwen3-8B", "reader.instances=1", "reader.tensor_parallel_size=1",
            "rerank.backend=cross-encoder", f"rerank.model={folder}", f"index.encoder={ctx.encoder_path}",
            "index.device=cuda:0")
    with ctx.part("plan", guard=False):
        cfg = load_config(REPO / "configs" / "memfit.yaml", list(base))
        turns = sum(len(mem.turns()) for mem in ctx.memories)
        workload = workload_of(cfg, ctx.memories, len(ctx.questions), turns, "gpu_check's LoCoMo selection")
        first = make_plan(cfg, node, workload).gpu_totals()[0]
        need = first.resident + first.peak  # memfit's parts + its CUDA context + the largest transient
        utilization = math.floor((gpu.total_bytes - need) / gpu.total_bytes * 100) / 100
        plan = make_plan(load_config(REPO / "configs" / "memfit.yaml",
                                     [*base, f"reader.gpu_memory_utilization={utilization}"]), node, workload)
        total = plan.gpu_totals()[0]
        room = gpu.total_bytes - total.claims
        m["plan"] = {"node": node.describe(), "gpu_memory_utilization": utilization, "memfit_need_bytes": need,
                     "engine_claim_bytes": total.claims, "room_bytes": room, "fits": plan.fits,
                     "problems": [p.message for p in plan.problems], "unknown": plan.unknown,
                     "parts": [p for p in plan.to_dict()["parts"] if p["gpu_gib"]]}
        m["checks"]["plan_fits"] = plan.fits and room >= need
    if not ctx.on_gpu:
        m["skipped"]["retrieval_under_cap"] = "CPU run: the cap is the CUDA allocator's (set_per_process_memory_fraction)"
        return
    with ctx.part("retrieval_under_cap"):
        for key in ("encoder:device", "ce:device"):  # rebuilt under the cap: every byte counted
            ctx.cache.pop(key, None)
        ctx.cache.pop("memo:device", None)
        ctx.free_device_memory()
        held = torch.cuda.memory_reserved(ctx.device)
        cap = room - CUDA_CONTEXT_BYTES  # the context lives outside the allocator's cap
        torch.cuda.reset_peak_memory_stats(ctx.device)
        torch.cuda.set_per_process_memory_fraction(cap / gpu.total_bytes, ctx.device)
        try:
            with _warnings_of("memfit_gpu", "out of memory") as oom, \
                    _warnings_of("memfit_gpu.index.encoders", "batch size halved") as halved:
                dev_cfg = ctx.config("device", "rerank.backend=cross-encoder", f"rerank.model={folder}")
                encoder = ctx.encoder("device")
                both = encoder.encode(ctx.episodes + ctx.questions, batch_size=128)
                episodes, questions = both[: len(ctx.episodes)], both[len(ctx.episodes):]
                view = ReadView.from_memories(ctx.memories, None, dev_cfg, embeddings=episodes)
                seconds, _, results = _retrieve(ctx, view, dev_cfg, ctx.embed_fn("device"), questions,
                                                ctx.cross_encoder("device"), range(len(ctx.questions)))
                ctx.sync()
            peak = torch.cuda.max_memory_reserved(ctx.device)
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0, ctx.device)
        m["under_cap"] = {"cap_bytes": int(cap), "held_before_bytes": int(held), "peak_reserved_bytes": int(peak),
                          "plan_parts_bytes": int(need - CUDA_CONTEXT_BYTES), "questions": len(results),
                          "retrieve_s": seconds, "oom_warnings": oom[:5], "batch_halvings": len(halved),
                          "measured_over_plan": peak / max(1, need - CUDA_CONTEXT_BYTES)}
        m["checks"]["no_oom_under_cap"] = not oom and not halved
        m["checks"]["peak_within_plan"] = peak <= need - CUDA_CONTEXT_BYTES
        _record_view(ctx, view)
        ctx.placed("bi_encoder", encoder.devices[0])
        del view, results


def stage_workers(ctx: Context) -> None:
    """Encoder worker processes on the device: bench_encoder_workers.compare with two workers of the same
    device (one process, two worker processes, two threads, sentence-transformers' pool of two), the
    workers given at most WORKER_START_TIMEOUT_S to start. Last: spawned processes are the slowest
    thing to start. A --quick run starts two CPU worker processes only (no pool) on a few texts."""
    from memfit_gpu.index.encoders import workers

    m = ctx.metrics
    workers.START_TIMEOUT_S = min(workers.START_TIMEOUT_S, WORKER_START_TIMEOUT_S)
    m["start_timeout_s"] = workers.START_TIMEOUT_S
    spec = f"{ctx.device},{ctx.device}"
    if ctx.quick:
        with ctx.part("two_worker_processes"):
            texts = _spread(ctx.episodes, 32)
            pool = BiEncoder.from_pretrained(ctx.encoder_path, device=spec, dtype="float32", workers="processes")
            try:
                start = time.perf_counter()
                rows = pool.encode(texts)
                m["two_worker_processes"] = {"texts": len(texts), "seconds_with_start": time.perf_counter() - start}
            finally:
                pool.close()
            one = ctx.encoder("device").encode(texts)
            m["two_worker_processes"]["max_abs_diff"] = diff = float((rows - one).abs().max())
            m["checks"]["worker_rows_match_one_device"] = diff <= DUPLICATE_TOLERANCE
        m["skipped"]["compare"] = "--quick: sentence-transformers' pool and the timed arms take minutes on a CPU"
        return
    with ctx.part("compare"):
        bench = _load_module(REPO / "experiments" / "bench_encoder_workers.py", "bench_encoder_workers")
        texts = ctx.episodes if ctx.on_gpu else ctx.episodes[:256]
        m["workers"] = found = bench.compare(ctx.encoder_path, spec, texts, repeats=1)
        m["checks"]["worker_rows_match_one_device"] = found["max_abs_diff"] <= DUPLICATE_TOLERANCE


@dataclass(frozen=True)
class Stage:
    name: str
    title: str
    run: Callable[[Context], None]
    min_s: float  # least seconds a useful run takes on the GPU machine (full mode); --quick takes a tenth
    optional: bool = False  # the verdict does not wait for it (run last, when the budget leaves room)


# Most valuable first: kernels bit for bit and their speed, BM25, every pack with the production
# device path, encoder throughput against sentence-transformers, memory peaks; then the rest; the stand-ins
# for what the machine cannot run; worker processes last; the optional wide kernel variant after them.
STAGES = (
    Stage("kernels", "Triton kernels vs torch, bit-identical across runs; their speed at LoCoMo and S size",
          stage_kernels, 30),
    Stage("bm25", "BM25 device vs CPU on LoCoMo (search, Triton, PRF, delete, state_dict, .to)", stage_bm25, 10),
    Stage("retrieval", "every LoCoMo pack with the production device path (BM25, dense product, kernels)",
          stage_retrieval, 30),
    Stage("encoders", "bi-encoder fp32 device vs CPU; vs sentence-transformers: same vectors, throughput",
          stage_encoders, 15),
    Stage("memory", "peak GPU/host memory: LoCoMo build + retrieval, BM25 at LongMemEval-M shape", stage_memory, 15),
    Stage("encoders_more", "duplicates across batches, bf16, cross-encoder top-10, OOM batch halving",
          stage_encoders_more, 25),
    Stage("rerank", "retrieval with the cross-encoder, device vs a fixed share on the CPU", stage_rerank, 25),
    Stage("kernels_m", "bench_kernels at LongMemEval-M shape, sized to the budget", stage_kernels_m, 20),
    Stage("reader", "stand-in reader: transformers on the device, random Llama, batch invariance fp32 / bf16",
          stage_reader, 20),
    Stage("vllm_room", "stand-in for vLLM's claim: memfit plan's room, LoCoMo retrieval under that cap",
          stage_vllm_room, 25),
    Stage("workers", "encoder worker processes on the device (start timeout 60 s) vs sentence-transformers' pool",
          stage_workers, 40),
    Stage("kernels_wide", "optional: segment_topk kernel at K_PAD 128 (never launched by the read path)",
          stage_kernels_wide, 10, optional=True),
)
