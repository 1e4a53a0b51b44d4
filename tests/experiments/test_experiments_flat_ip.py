"""experiments/_flat_ip.py (the GPU check's exact stand-in for FAISS Flat) against real faiss-cpu."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import faiss
import numpy as np
import pytest
import torch

import memfit_gpu.index.dense as dense_module
from memfit_gpu.index.dense import DenseIndex

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("_flat_ip_under_test", REPO / "experiments" / "_flat_ip.py")
flat_ip = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = flat_ip
_spec.loader.exec_module(flat_ip)


def _unit(rng: np.random.Generator, n: int, d: int) -> np.ndarray:
    x = rng.standard_normal((n, d)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _pair(d: int) -> tuple[object, object]:
    return (faiss.index_factory(d, "Flat", faiss.METRIC_INNER_PRODUCT),
            flat_ip.index_factory(d, "Flat", flat_ip.METRIC_INNER_PRODUCT))


def test_constants_and_the_calls_dense_py_makes_match_faiss():
    assert flat_ip.METRIC_INNER_PRODUCT == faiss.METRIC_INNER_PRODUCT
    assert flat_ip.METRIC_L2 == faiss.METRIC_L2
    real, stand_in = _pair(8)
    assert (stand_in.d, stand_in.ntotal, stand_in.is_trained, stand_in.metric_type) == \
           (real.d, real.ntotal, real.is_trained, real.metric_type) == (8, 0, True, faiss.METRIC_INNER_PRODUCT)
    for module, index in ((faiss, real), (flat_ip, stand_in)):
        with pytest.raises(RuntimeError):
            module.extract_index_ivf(index)  # dense.py's nprobe setting relies on this for Flat
        with pytest.raises(RuntimeError):
            module.index_factory(8, "Bogus", module.METRIC_INNER_PRODUCT)
        with pytest.raises(AssertionError):
            index.search(np.ones((1, 8), np.float32), 0)
    with pytest.raises(RuntimeError, match="only index_factory"):
        flat_ip.index_factory(8, "IVF4,Flat", flat_ip.METRIC_INNER_PRODUCT)  # Flat only: say so, never approximate
    assert flat_ip.get_num_gpus() == 0 and not hasattr(flat_ip, "StandardGpuResources")


def test_random_search_matches_faiss_rows_and_scores():
    rng = np.random.default_rng(0)
    real, stand_in = _pair(384)
    for chunk in (_unit(rng, 300, 384), _unit(rng, 257, 384)):  # two adds, as dense.py appends
        real.add(chunk)
        stand_in.add(chunk)
    assert stand_in.ntotal == real.ntotal == 557
    queries = _unit(rng, 40, 384)
    for k in (1, 10, 68, 557):
        want_d, want_l = real.search(queries, k)
        got_d, got_l = stand_in.search(queries, k)
        assert got_d.dtype == np.float32 and got_l.dtype == np.int64 and got_l.shape == (40, k)
        np.testing.assert_array_equal(got_l, want_l)  # random unit vectors: no ties within float32 error
        np.testing.assert_allclose(got_d, want_d, rtol=0, atol=2e-6)
    # every score is a float64 sum of the exact products, rounded once: within one float32 rounding of the
    # exact sum (fsum) of those products
    stored = np.concatenate(stand_in._blocks).astype(np.float64)
    exact = np.array([[math.fsum(q * v) for v in stored[:50]] for q in queries.astype(np.float64)])
    got = stand_in.inner_products(queries)[:, :50].astype(np.float64)
    assert np.all(np.abs(got - exact) <= np.spacing(np.abs(exact).astype(np.float32)))


def test_ties_come_in_label_order_and_k_beyond_ntotal_pads_like_faiss():
    real, stand_in = _pair(4)
    vectors = np.eye(4, dtype=np.float32)[[0, 1, 0, 2, 0]]  # labels 0, 2, 4 tie for query e0
    real.add(vectors)
    stand_in.add(vectors)
    query = np.array([[1, 0, 0, 0], [0, 0, 0, 0]], dtype=np.float32)
    want_d, want_l = real.search(query, 7)
    got_d, got_l = stand_in.search(query, 7)
    assert got_l.tolist() == [[0, 2, 4, 1, 3, -1, -1], [0, 1, 2, 3, 4, -1, -1]]
    np.testing.assert_array_equal(got_d, want_d)  # same scores, same -FLT_MAX padding
    for got, want in zip(got_l, want_l, strict=True):  # FAISS returns the same rows, ties in its own order
        assert sorted(got.tolist()) == sorted(want.tolist())
    empty_d, empty_l = stand_in.search(np.zeros((0, 4), np.float32), 3)
    assert empty_d.shape == empty_l.shape == (0, 3)
    fresh = flat_ip.IndexFlatIP(4)
    assert fresh.search(query, 2)[1].tolist() == [[-1, -1], [-1, -1]]


def test_a_query_scores_the_same_bits_whatever_batch_it_is_in():
    rng = np.random.default_rng(1)
    index = flat_ip.IndexFlatIP(384)
    index.add(_unit(rng, 700, 384))
    queries = _unit(rng, 33, 384)
    together = index.inner_products(queries)
    alone = np.concatenate([index.inner_products(queries[i:i + 1]) for i in range(33)])
    assert np.array_equal(together, alone)
    assert np.array_equal(index.inner_products(queries[::-1]), together[::-1])


def test_dense_index_over_the_stand_in_returns_what_it_returns_over_faiss(monkeypatch):
    """The whole DenseIndex (per-memory parts, tombstones, over-fetch for ties at the cut) on both."""
    rng = np.random.default_rng(2)
    vectors = _unit(rng, 600, 64)
    vectors[100:110] = vectors[99]  # a run of identical rows: ties at the cut
    memories = rng.integers(0, 5, 600)
    memories[99:110] = 1
    queries = np.concatenate([_unit(rng, 30, 64), vectors[99:100]])
    query_memories = np.concatenate([rng.integers(0, 6, 30), [1]])  # memory 5 was never added

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        index = DenseIndex(64, device="cpu")
        index.add(vectors[:400], memories[:400])
        index.add(vectors[400:], memories[400:])
        index.delete([3, 101, 250])
        return index.search(queries, query_memories, k=8)

    want = run()
    monkeypatch.setattr(dense_module, "faiss", flat_ip)
    got = run()
    assert torch.equal(got[1], want[1])
    assert torch.allclose(got[0], want[0], rtol=0, atol=2e-6)
    assert got[1][-1].tolist() == [99, 100, 102, 103, 104, 105, 106, 107]  # the tied run, 101 deleted


def test_install_puts_it_in_place_of_faiss(monkeypatch):
    monkeypatch.delitem(sys.modules, "faiss")
    monkeypatch.delitem(sys.modules, "memfit_gpu.index.dense")
    assert flat_ip.install() is flat_ip
    import faiss as imported

    assert imported is flat_ip
