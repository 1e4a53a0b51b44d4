"""memfit_gpu.kernels: torch references by hand, exact order-independent BM25 sums, launch devices,
the retrieve.kernels switch, and every Triton kernel against its reference under TRITON_INTERPRET=1."""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import memfit_gpu.index.bm25 as bm25_module
import memfit_gpu.index.bm25_postings as postings_module
import memfit_gpu.kernels.hybrid_topk as hybrid_module
import memfit_gpu.kernels.segment_topk as topk_module
import memfit_gpu.kernels.segmented_scatter as scatter_module
from memfit_gpu.config import ConfigError, load_config
from memfit_gpu.devices import device_guard
from memfit_gpu.index.bm25 import BM25Index
from memfit_gpu.index.bm25_postings import _on_grid
from memfit_gpu.kernels import resolve_backend
from memfit_gpu.kernels._launch import launch_device, recording_launches
from memfit_gpu.kernels.segment_topk import padded_topk, segment_topk_torch
from memfit_gpu.kernels.segmented_scatter import segmented_scatter_add, segmented_scatter_add_torch

REPO = Path(__file__).resolve().parents[2]
# 3 terms in CSR: term 0 -> cols (1, 3) weights (0.5, 2.0); term 1 -> nothing; term 2 -> col 0 weight 4.0
TERM_PTR = torch.tensor([0, 2, 2, 3])
POST_COL = torch.tensor([1, 3, 0], dtype=torch.int32)
POST_WEIGHT = torch.tensor([0.5, 2.0, 4.0])


# ---------------------------------------------------------------- torch references by hand
def test_scatter_reference_by_hand():
    acc = torch.zeros(8, dtype=torch.float64)
    # (base, term): row 0 (base 0) gets term 0 twice and term 1; row 1 (base 4) gets term 2 and term 0
    segmented_scatter_add_torch(acc, torch.tensor([0, 0, 0, 4, 4]), torch.tensor([0, 1, 0, 2, 0]), TERM_PTR, POST_COL,
                                POST_WEIGHT)
    assert acc.tolist() == [0.0, 1.0, 0.0, 4.0, 4.0, 0.5, 0.0, 2.0]
    assert acc.dtype == torch.float64


def test_no_pairs_and_empty_terms_leave_acc_untouched():
    acc = torch.full((4,), 7.0, dtype=torch.float64)
    segmented_scatter_add_torch(acc, torch.tensor([0]), torch.tensor([1]), TERM_PTR, POST_COL, POST_WEIGHT)
    empty = torch.empty(0, dtype=torch.long)
    segmented_scatter_add_torch(acc, empty, empty, TERM_PTR, POST_COL, POST_WEIGHT)
    assert acc.tolist() == [7.0] * 4


def test_selector_uses_torch_on_cpu(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the Triton kernel must not run on CPU tensors under backend='auto'")

    monkeypatch.setattr(scatter_module, "segmented_scatter_add_triton", refuse)
    acc = segmented_scatter_add(torch.zeros(4, dtype=torch.float64), torch.tensor([0]), torch.tensor([2]), TERM_PTR,
                                POST_COL, POST_WEIGHT)
    assert acc.tolist() == [4.0, 0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="unknown segmented_scatter_add backend 'cuda'"):
        segmented_scatter_add(acc, torch.tensor([0]), torch.tensor([2]), TERM_PTR, POST_COL, POST_WEIGHT, backend="cuda")


def test_shape_errors_are_named():
    with pytest.raises(ValueError, match="one entry per pair"):
        segmented_scatter_add_torch(torch.zeros(4, dtype=torch.float64), torch.tensor([0, 0]), torch.tensor([0]),
                                    TERM_PTR, POST_COL, POST_WEIGHT)
    with pytest.raises(ValueError, match="float64"):
        segmented_scatter_add_torch(torch.zeros(4), torch.tensor([0]), torch.tensor([0]), TERM_PTR, POST_COL,
                                    POST_WEIGHT)
    with pytest.raises(ValueError, match="row_start has 1 entries for 2 questions"):
        segment_topk_torch(torch.zeros(3, dtype=torch.float64), torch.tensor([0, 1, 3]), torch.tensor([0]),
                           torch.arange(3), k=2)


def test_segment_topk_reference_by_hand():
    # question 0: 4 docs (scores 1, 3, 3, 0) at rows 10..13; question 1: no docs; question 2: 1 doc
    acc = torch.tensor([1.0, 3.0, 3.0, 0.0, 0.5], dtype=torch.float64)
    scores, rows = segment_topk_torch(acc, torch.tensor([0, 4, 4, 5]), torch.tensor([0, 0, 4]),
                                      torch.tensor([10, 11, 12, 13, 20]), k=5)
    assert rows.tolist() == [[11, 12, 10, -1, -1], [-1] * 5, [20, -1, -1, -1, -1]]
    assert scores.tolist() == [[3.0, 3.0, 1.0, 0.0, 0.0], [0.0] * 5, [0.5, 0.0, 0.0, 0.0, 0.0]]
    vals, cols = padded_topk(torch.tensor([[2.0, 5.0, 2.0]]), k=2)
    assert cols.tolist() == [[1, 0]] and vals.tolist() == [[5.0, 2.0]]


# ---------------------------------------------------------------- exact, order-independent sums
def _wide_corpus(seed: int) -> tuple[BM25Index, list[list[str]]]:
    """Frequent and rare terms (weights over several magnitudes) and long queries: float32 sums here
    depend on their order in many last bits."""
    rng = random.Random(seed)
    words = [f"w{i}" for i in range(300)]
    docs = [[rng.choice(words[: rng.choice([8, 40, 300])]) for _ in range(rng.randint(1, 40))] for _ in range(400)]
    index = BM25Index()
    index.add(docs, [0] * len(docs))
    queries = [[rng.choice(words) for _ in range(rng.randint(3, 25))] for _ in range(200)]
    return index, queries


def test_bm25_scores_do_not_depend_on_the_order_of_the_sums(monkeypatch):
    index, queries = _wide_corpus(5)
    rng = random.Random(6)
    base, _ = index.scores(queries, [0] * len(queries))
    permuted, _ = index.scores([rng.sample(q, len(q)) for q in queries], [0] * len(queries))
    assert torch.equal(base, permuted)  # the pairs reach the accumulator in another order
    # the dense-row product and the posting scatter add in different orders: the same bits too
    for factor in (0, 10**9):
        monkeypatch.setattr(postings_module, "_DENSE_FACTOR", factor)
        index._cache = None
        assert torch.equal(index.scores(queries, [0] * len(queries))[0], base)
    assert int((base > 0).sum()) > 10_000


def test_bm25_score_is_the_exact_sum_of_its_weights_rounded_once():
    index, queries = _wide_corpus(7)
    cache = index._prepare()
    scores, rows = index.scores(queries[:20], [0] * 20)
    term_ptr, cols, weights = cache["term_ptr"].tolist(), cache["post_col"].tolist(), cache["post_weight"].tolist()
    slot = cache["slot"].tolist()  # the CSR's rows are term slots (memory by memory)
    vocab = {token: term for query in queries[:20] for token in query if (term := index.term_id(0, token)) >= 0}
    for qi, query in enumerate(queries[:20]):
        by_col: dict[int, list[float]] = {}
        for token in query:
            term = vocab.get(token)
            if term is None:
                continue
            for j in range(term_ptr[slot[term]], term_ptr[slot[term] + 1]):
                by_col.setdefault(cols[j], []).append(weights[j])
        for col, parts in by_col.items():
            # math.fsum is the correctly rounded float64 sum; it is exact here, so one float32 rounding follows
            exact = math.fsum(parts)
            assert exact == sum(sorted(parts)) == sum(sorted(parts, reverse=True))
            assert float(scores[qi, col]) == float(torch.tensor(exact, dtype=torch.float64).float())


def test_weights_on_the_grid_are_float32_and_keep_every_weight_above_2_to_minus_9():
    weights = torch.tensor([1e-12, 3.3e-6, 0.0015, 2.0**-9, 0.7, 21.0, 0.0])
    grid = _on_grid(weights)
    assert grid.dtype == torch.float32
    assert torch.equal(grid[3:], weights[3:])
    multiples = grid.double() * 2.0**32
    assert torch.equal(multiples, multiples.round())  # every weight is a multiple of 2^-32
    assert float(grid[0]) == 0.0 and abs(float(grid[1]) - 3.3e-6) <= 2.0**-33


def test_a_query_beyond_the_exact_sum_bound_is_refused(monkeypatch):
    monkeypatch.setattr(bm25_module, "_MAX_QUERY_PAIRS", 4)
    index = BM25Index()
    index.add([["a", "b"]], [0])
    assert index.search([["a"] * 4], [0], k=1)[1].tolist() == [[0]]
    with pytest.raises(ValueError, match="query 1 has 5 known tokens; exact scoring supports up to 4"):
        index.search([["a"], ["a", "b", "a", "b", "a"]], [0, 0], k=1)


# ---------------------------------------------------------------- launch on the tensors' device
def test_device_guard_makes_the_tensors_gpu_current():
    guard = device_guard(torch.device("cuda", 1))
    assert isinstance(guard, torch.cuda.device) and guard.idx == 1  # entering it needs a GPU, building it does not
    assert isinstance(device_guard(torch.device("cpu")), contextlib.nullcontext)


class _RecordingGuard:
    """Stands in for device_guard: records the device made current while a launch happens."""

    current: list[torch.device | None] = [None]

    def __init__(self, device: torch.device):
        self.device = device

    def __enter__(self):
        self.current.append(self.device)

    def __exit__(self, *exc):
        self.current.pop()


class _RecordingKernels:
    """Stands in for a kernel module: each launch records the device current at that moment."""

    def __init__(self):
        self.launches: list[torch.device | None] = []

    def __getattr__(self, name):
        launches = self.launches

        class Kernel:
            def __getitem__(self, grid):
                return lambda *args, **kwargs: launches.append(_RecordingGuard.current[-1])

        return Kernel()


@pytest.mark.parametrize("module", [scatter_module, topk_module, hybrid_module], ids=lambda m: m.__name__)
def test_every_launch_runs_under_its_tensors_device(module, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # lets launch_device accept CPU tensors; nothing is compiled
    kernels = _RecordingKernels()
    monkeypatch.setattr(module, "device_guard", _RecordingGuard)
    monkeypatch.setattr(module, "load", lambda name: kernels)
    if module is scatter_module:
        module.segmented_scatter_add_triton(torch.zeros(8, dtype=torch.float64), torch.tensor([0]), torch.tensor([0]),
                                            TERM_PTR, POST_COL, POST_WEIGHT)
    elif module is topk_module:
        module.segment_topk_triton(torch.ones(3, dtype=torch.float64), torch.tensor([0, 3]), torch.tensor([0]),
                                   torch.arange(3), k=2)
    else:
        module.hybrid_topk_triton(torch.ones(1, 2), torch.tensor([[0, 1]]), torch.ones(1, 2), torch.tensor([[1, 2]]),
                                  0.7)
    assert kernels.launches == [torch.device("cpu")]


def test_segment_topk_routes_k_above_64_to_the_torch_reference(monkeypatch):
    """The Triton path never compiles K_PAD > 64 (K_PAD 512 took 7 minutes to compile for
    sm_90a); k > TRITON_MAX_K gives the reference's result without a launch, k = 64 launches K_PAD 64."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kernels = _RecordingKernels()
    monkeypatch.setattr(topk_module, "load", lambda name: kernels)
    acc = torch.tensor([0.5, 2.0, 0.0, 1.0, 3.0], dtype=torch.float64)
    seg, row_start, rows = torch.tensor([0, 3, 5]), torch.tensor([0, 3]), torch.arange(5) * 10
    assert topk_module.TRITON_MAX_K == 64
    got = topk_module.segment_topk_triton(acc, seg, row_start, rows, k=65)
    ref = segment_topk_torch(acc, seg, row_start, rows, k=65)
    assert kernels.launches == [] and torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    assert got[1][0, :3].tolist() == [10, 0, -1] and got[1][1, :2].tolist() == [40, 30]
    with recording_launches() as record:
        topk_module.segment_topk_triton(acc, seg, row_start, rows, k=64)
        topk_module.segment_topk_triton(acc, seg, row_start, rows, k=64)
        topk_module.segment_topk_kernel(acc, seg, row_start, rows, k=65)  # the kernel itself, any k
    assert len(kernels.launches) == 3
    variants = {(row["kernel"], row["K_PAD"]): row["launches"] for row in record.rows()}
    assert variants == {("segment_topk", 64): 2, ("segment_topk", 128): 1}
    assert all(row["first_launch_s"] >= 0 and row["device"] == "cpu" for row in record.rows())


def test_launch_refuses_mixed_devices_and_cpu_tensors_without_the_interpreter(monkeypatch):
    with pytest.raises(ValueError, match="rows is on meta but scores is on cpu"):
        launch_device(scores=torch.zeros(2), rows=torch.zeros(2, device="meta"))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="Triton runs on CUDA tensors"):
        launch_device(scores=torch.zeros(2))


# ---------------------------------------------------------------- the retrieve.kernels switch
def test_backend_switch_resolves_auto_by_device(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 1)
    assert resolve_backend("auto", cpu) == "torch"
    assert resolve_backend("auto", gpu) == "triton"
    assert resolve_backend("auto", gpu, supported=False) == "torch"  # the reference BM25 has no kernel path
    assert resolve_backend("torch", gpu) == "torch"
    with pytest.raises(ValueError, match="Triton runs on CUDA tensors"):
        resolve_backend("triton", cpu)
    with pytest.raises(ValueError, match="index.bm25_backend=torch"):
        resolve_backend("triton", gpu, supported=False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_backend("triton", cpu) == "triton"
    assert load_config(None, ["retrieve.kernels=triton"]).retrieve.kernels == "triton"
    assert load_config(None).retrieve.kernels == "auto"
    with pytest.raises(ConfigError, match="retrieve.kernels='cuda' is not one of torch, triton, auto"):
        load_config(None, ["retrieve.kernels=cuda"])


def test_bm25_search_rejects_an_unknown_kernel_path():
    index = BM25Index()
    index.add([["a"]], [0])
    with pytest.raises(ValueError, match="kernels='cuda' is not one of torch, triton"):
        index.search([["a"]], [0], k=1, kernels="cuda")


# ---------------------------------------------------------------- the kernels in Triton's interpreter
def _interpreter(*cases: str) -> dict:
    # TRITON_INTERPRET is read when a kernel module is imported: a fresh process, kernels on CPU tensors
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, str(REPO / "tests" / "support" / "kernel_cases.py"), *cases], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def interpreted() -> dict:
    return _interpreter("scatter", "topk", "bm25_search", "hybrid", "topk_wide")


@pytest.mark.parametrize("case, at_least", [("scatter", 1000), ("topk", 300), ("bm25_search", 1000), ("hybrid", 1000),
                                            ("topk_wide", 300)])
def test_triton_kernel_equals_its_reference_bit_for_bit(interpreted, case, at_least):
    result = interpreted[case]
    assert result["ok"], result["detail"]
    assert result["checked"] >= at_least, result["detail"]


@pytest.mark.slow
def test_retrieve_batch_with_triton_kernels_equals_torch():
    """retrieve.kernels=triton vs torch through the whole batched read path (episodes, summaries, pool,
    expansions, PRF, packs, excerpts) on a real LoCoMo conversation, three configurations."""
    result = _interpreter("retrieve_batch")["retrieve_batch"]
    assert result["ok"], result["detail"]
    assert result["checked"] >= 1000, result["detail"]


@pytest.mark.slow
def test_memfit_retrieve_honours_the_kernels_switch():
    """The Triton kernels' acceptance, on 12 questions: `memfit retrieve ... retrieve.kernels=triton` under
    TRITON_INTERPRET=1 writes the same packs.jsonl rows as retrieve.kernels=torch (real encoder)."""
    result = _interpreter("cli")["cli"]
    assert result["ok"], result["detail"]
    assert result["checked"] >= 100, result["detail"]


def test_profiler_scaling_sweep_honours_the_kernels_switch():
    result = _interpreter("profile")["profile"]
    assert result["ok"], result["detail"]


def test_kernel_backend_of_a_view_follows_its_bm25_index(monkeypatch):
    from memfit_gpu.index.bm25_reference import ReferenceBM25
    from memfit_gpu.retrieve.batched import kernel_backend

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert kernel_backend(SimpleNamespace(ep_bm25=BM25Index()), "auto") == "torch"  # CPU index
    assert kernel_backend(SimpleNamespace(ep_bm25=BM25Index()), "triton") == "triton"
    with pytest.raises(ValueError, match="index.bm25_backend=torch"):
        kernel_backend(SimpleNamespace(ep_bm25=ReferenceBM25()), "triton")


# ---------------------------------------------------------------- the Triton floor (>= 3.0)
def test_kernels_compile_on_old_triton_by_construction():
    """Triton < 3.4 resolves names from the kernel function's module globals and reads tl.constexpr only
    from a real annotation: every @triton.jit function is defined at module level, in a module without
    `from __future__ import annotations` (tests/support/kernel_cases.py ran green under the 3.0.0 interpreter)."""
    import ast

    jitted = 0
    for path in sorted((REPO / "kernels").glob("*.py")):
        tree = ast.parse(path.read_text())
        top_level = {id(node) for node in tree.body}
        future = any(isinstance(n, ast.ImportFrom) and n.module == "__future__" for n in tree.body)
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and any(ast.unparse(d).endswith("jit") for d in node.decorator_list):
                jitted += 1
                assert id(node) in top_level, f"{path.name}: kernel {node.name} is nested (closure over tl)"
                assert not future, f"{path.name}: kernel module uses from __future__ import annotations"
    assert jitted == 3


@pytest.mark.parametrize("block", [3, 0, 96, True])
def test_a_scatter_block_that_is_no_power_of_two_is_refused_by_name(block: object) -> None:
    """block=3 failed inside Triton's interpreter ("arange's range must be a power of 2")."""
    empty = torch.zeros(0, dtype=torch.long)
    with pytest.raises(ValueError, match=rf"block={block!r} must be a power of two"):
        scatter_module.segmented_scatter_add_triton(torch.zeros((1, 1), dtype=torch.float64), empty, empty,
                                                    torch.zeros(1, dtype=torch.long), empty,
                                                    torch.zeros(0), block=block)  # type: ignore[arg-type]
