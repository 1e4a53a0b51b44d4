"""DenseIndex: exact per-memory inner product on real FAISS, isolation, ties, tombstones, persistence."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

import memfit_gpu.index.dense as dense_module
from memfit_gpu.index.dense import DenseIndex


def _unit(rng: np.random.Generator, n: int, dim: int) -> np.ndarray:
    vectors = rng.standard_normal((n, dim)).astype(np.float32)
    return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


def _brute_force(vectors, row_memory, deleted, query, memory, k, min_score=0.0):
    """Plain numpy oracle: score desc, row asc, score > min_score, own memory, live rows only."""
    scores = vectors @ query
    candidates = [
        (-float(scores[row]), row)
        for row in range(len(vectors))
        if row_memory[row] == memory and not deleted[row] and scores[row] > min_score
    ]
    candidates.sort()
    return [row for _, row in candidates[:k]], [-s for s, _ in candidates[:k]]


def test_hand_computed_scores_order_and_padding():
    index = DenseIndex(dim=2, factory="Flat", device="cpu")
    vectors = np.array([[1, 0], [0, 1], [0.6, 0.8], [-1, 0], [1, 0]], dtype=np.float32)
    rows = index.add(vectors, [0, 0, 0, 0, 1])
    assert rows.tolist() == [0, 1, 2, 3, 4]
    scores, found = index.search(np.array([[0.8, 0.6]], dtype=np.float32), [0], k=5)
    # memory 0 only: row 2 (0.96), row 0 (0.8), row 1 (0.6); row 3 (-0.8) is not > 0; row 4 is memory 1.
    assert found.tolist() == [[2, 0, 1, -1, -1]]
    assert torch.allclose(scores, torch.tensor([[0.96, 0.8, 0.6, 0.0, 0.0]]))
    assert scores.dtype == torch.float32 and found.dtype == torch.int64
    # min_score is exclusive
    _, found = index.search(np.array([[0.8, 0.6]], dtype=np.float32), [0], k=5, min_score=0.6)
    assert found.tolist() == [[2, 0, -1, -1, -1]]


def test_ties_break_by_lower_row_even_beyond_the_first_fetch():
    index = DenseIndex(dim=2, factory="Flat", device="cpu")
    # 40 identical vectors then one better one: every tie must come back in row order.
    vectors = np.array([[1, 0]] * 40 + [[0.0, 1.0]], dtype=np.float32)
    index.add(vectors, [3] * 41)
    _, found = index.search(np.array([[1.0, 0.0]], dtype=np.float32), [3], k=5)
    assert found.tolist() == [[0, 1, 2, 3, 4]]
    index.delete([1, 3])
    _, found = index.search(np.array([[1.0, 0.0]], dtype=np.float32), [3], k=5)
    assert found.tolist() == [[0, 2, 4, 5, 6]]


def test_tombstones_are_never_returned_and_k_live_rows_still_come_back():
    rng = np.random.default_rng(0)
    index = DenseIndex(dim=8, factory="Flat", device="cpu")
    vectors = _unit(rng, 50, 8)
    index.add(vectors, [0] * 50)
    query = vectors[7]
    _, before = index.search(query[None], [0], k=10)
    doomed = before[0, :6].tolist()
    index.delete(doomed)
    index.delete(doomed[:2])  # repeats are no-ops
    assert index.memory_size(0) == 44
    _, after = index.search(query[None], [0], k=10, min_score=-2.0)
    assert not set(after[0].tolist()) & set(doomed)
    assert (after[0] >= 0).all()
    deleted = np.zeros(50, bool)
    deleted[doomed] = True
    expected, _ = _brute_force(vectors, np.zeros(50, int), deleted, query, 0, 10, min_score=-2.0)
    assert after[0].tolist() == expected
    with pytest.raises(IndexError, match="do not exist"):
        index.delete([50])


def test_batched_search_equals_per_memory_search_and_never_crosses_memories():
    rng = np.random.default_rng(1)
    index = DenseIndex(dim=16, factory="Flat", device="cpu")
    sizes = [30, 1, 0, 12, 45]
    row_memory = np.concatenate([[m] * s for m, s in enumerate(sizes)]).astype(int)
    rng.shuffle(row_memory)  # memories interleaved in the global row space
    vectors = _unit(rng, len(row_memory), 16)
    # added in three uneven batches
    for lo, hi in [(0, 10), (10, 11), (11, len(row_memory))]:
        index.add(vectors[lo:hi], row_memory[lo:hi])
    deleted = np.zeros(len(row_memory), bool)
    deleted[rng.choice(len(row_memory), 9, replace=False)] = True
    index.delete(np.flatnonzero(deleted))
    queries = _unit(rng, 40, 16)
    query_memory = rng.integers(0, len(sizes) + 1, size=40)  # memory 5 does not exist: all -1
    scores, found = index.search(queries, query_memory, k=7)
    for q in range(40):
        rows, expected_scores = _brute_force(vectors, row_memory, deleted, queries[q], query_memory[q], 7)
        assert found[q, : len(rows)].tolist() == rows
        assert (found[q, len(rows) :] == -1).all()
        np.testing.assert_allclose(scores[q, : len(rows)].numpy(), expected_scores, rtol=1e-5, atol=1e-6)
        single_scores, single = index.search(queries[q : q + 1], [query_memory[q]], k=7)
        assert torch.equal(single[0], found[q]) and torch.equal(single_scores[0], scores[q])
        returned = found[q][found[q] >= 0].numpy()
        assert (row_memory[returned] == query_memory[q]).all()


def test_ivf_falls_back_to_flat_when_too_few_vectors_and_trains_when_enough(caplog):
    rng = np.random.default_rng(2)
    index = DenseIndex(dim=8, factory="IVF4,Flat", device="cpu", nprobe=4)
    with caplog.at_level(logging.DEBUG, logger="memfit_gpu.index.dense"):
        index.add(_unit(rng, 3, 8), [0, 0, 0])
    assert index.memory_kind(0) == "Flat"
    assert "needs 4 to train: using exact Flat" in caplog.text
    index.add(_unit(rng, 200, 8), [1] * 200)
    assert index.memory_kind(1) == "IVF4,Flat"
    index.add(_unit(rng, 5, 8), [0] * 5)  # memory 0 now has 8 >= 4 vectors: retrained from stored vectors
    assert index.memory_kind(0) == "IVF4,Flat"
    # nprobe = nlist: the IVF search is exact, so it must match brute force
    vectors = index.vectors(np.arange(index.size))
    queries = _unit(rng, 5, 8)
    _, found = index.search(queries, [1] * 5, k=10)
    for q in range(5):
        expected, _ = _brute_force(vectors, index.row_memory, index.deleted, queries[q], 1, 10)
        assert found[q, : len(expected)].tolist() == expected


def test_hnsw_factory_searches_its_own_memory():
    rng = np.random.default_rng(3)
    index = DenseIndex(dim=8, factory="HNSW32", device="cpu")
    vectors = _unit(rng, 100, 8)
    index.add(vectors, [0] * 50 + [1] * 50)
    assert index.memory_kind(0) == "HNSW32"
    _, found = index.search(vectors[[0, 60]], [0, 1], k=1)
    assert found.tolist() == [[0], [60]]


@pytest.mark.parametrize("factory", ["Flat", "IVF4,Flat"])
def test_save_load_gives_identical_results(tmp_path, factory):
    rng = np.random.default_rng(4)
    index = DenseIndex(dim=8, factory=factory, device="cpu", nprobe=2)
    index.add(_unit(rng, 60, 8), rng.integers(0, 3, size=60))
    index.delete([5, 17])
    queries = _unit(rng, 9, 8)
    query_memory = [0, 1, 2] * 3
    expected = index.search(queries, query_memory, k=12)
    index.save(tmp_path)
    loaded = DenseIndex.load(tmp_path, device="cpu")
    got = loaded.search(queries, query_memory, k=12)
    assert torch.equal(expected[0], got[0]) and torch.equal(expected[1], got[1])
    assert loaded.size == 60 and loaded.deleted.sum() == 2
    assert [loaded.memory_kind(m) for m in range(3)] == [index.memory_kind(m) for m in range(3)]
    # appends after a load continue the numbering
    assert loaded.add(_unit(rng, 2, 8), [0, 0]).tolist() == [60, 61]


def test_shape_errors_name_the_argument():
    index = DenseIndex(dim=4, device="cpu")
    with pytest.raises(ValueError, match=r"vectors must be \[n, 4\]"):
        index.add(np.zeros((2, 3), np.float32), [0, 0])
    with pytest.raises(ValueError, match="memory_idx has 1 entries, expected 2"):
        index.add(np.zeros((2, 4), np.float32), [0])


def test_bad_factory_is_named():
    with pytest.raises(ValueError, match="cannot build factory 'NoSuchIndex'"):
        DenseIndex(dim=4, factory="NoSuchIndex", device="cpu")


def test_faiss_order_is_kept_only_when_it_is_already_final():
    in_order = DenseIndex._in_final_order
    live = np.array([[True, True, False]])
    assert in_order(np.array([[0.9, 0.5, 0.1]], dtype=np.float32), live)
    assert not in_order(np.array([[0.9, 0.9, 0.1]], dtype=np.float32), live)  # a tie: rows must be ordered
    assert not in_order(np.array([[0.9, 0.5, 0.1]], dtype=np.float32), np.array([[True, False, True]]))  # tombstone
    assert in_order(np.array([[0.9, 0.9]], dtype=np.float32), np.array([[True, False]]))  # tie with a dead entry


def test_placement_is_logged_and_a_required_gpu_is_an_error(caplog: pytest.LogCaptureFixture,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    import faiss

    from memfit_gpu.index import dense

    monkeypatch.setattr(dense, "_LOGGED_PLACEMENTS", set())
    with caplog.at_level("INFO", logger="memfit_gpu.index.dense"):
        index = DenseIndex(dim=4, device="auto")
    gpu_build = hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0
    assert index.use_gpu == gpu_build
    assert "DenseIndex: FAISS indexes on " + index.placement in caplog.text
    if not gpu_build:
        assert index.placement.startswith("CPU (")
        with pytest.raises(RuntimeError, match="index.dense_device=gpu: this FAISS build has no GPU support"):
            DenseIndex(dim=4, device="gpu")
    assert DenseIndex(dim=4, device="cpu").placement == "CPU (index.dense_device=cpu)"
    with pytest.raises(ValueError, match="not one of auto, cpu, gpu"):
        DenseIndex(dim=4, device="cuda")


# ---------------------------------------------------------------- batched product vs FAISS
def _oracle_scores(vectors: np.ndarray, query: np.ndarray) -> np.ndarray:
    """The batched path's scores: float64 inner products of the float32 values, rounded once."""
    return (vectors.astype(np.float64) @ query.astype(np.float64)).astype(np.float32)


def test_many_tombstones_under_the_gpu_k_cap_still_give_k_live_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """GPU FAISS fetches at most _GPU_MAX_K neighbours: with more tombstones than that above the live
    rows, the over-fetch used to stop short and return fewer than k (here none). The memory is now
    searched exactly over its stored vectors instead."""
    rng = np.random.default_rng(11)
    n, dim, k = 3000, 8, 10
    index = DenseIndex(dim=dim, factory="Flat", device="cpu", batched_max_rows=0)  # FAISS for every memory
    vectors = _unit(rng, n, dim)
    index.add(vectors, [0] * n)
    query = vectors[0]
    doomed = np.argsort(-(vectors @ query), kind="stable")[:2100]  # the 2,100 best rows
    index.delete(doomed)
    monkeypatch.setattr(DenseIndex, "_on_gpu", lambda self, part: True)  # as if the index were on a GPU
    scores, found = index.search(query[None], [0], k=k, min_score=-2.0)
    deleted = np.zeros(n, bool)
    deleted[doomed] = True
    expected, _ = _brute_force(vectors, np.zeros(n, int), deleted, query, 0, k, min_score=-2.0)
    assert len(expected) == k and found[0].tolist() == expected
    assert scores[0].tolist() == _oracle_scores(vectors[expected], query).tolist()


@pytest.mark.parametrize("threshold", [0, 10, 10_000])
def test_batched_and_faiss_memories_agree_with_brute_force(tmp_path, threshold: int) -> None:
    """Memories of 3, 12 and 40 rows: batched under the threshold, FAISS above it (12 crosses 10 in its
    second add); every search equals the oracle, before and after save/load, with tombstones."""
    rng = np.random.default_rng(12)
    index = DenseIndex(dim=16, factory="Flat", device="cpu", batched_max_rows=threshold)
    row_memory = np.array([0] * 3 + [1] * 8 + [2] * 40 + [1] * 4)
    vectors = _unit(rng, len(row_memory), 16)
    index.add(vectors[:30], row_memory[:30])
    index.add(vectors[30:], row_memory[30:])
    expect = {m: ("batched" if size <= threshold else "faiss") for m, size in ((0, 3), (1, 12), (2, 40))}
    assert {m: index.memory_search(m) for m in range(3)} == expect
    deleted = np.zeros(len(row_memory), bool)
    deleted[[1, 12, 13, 52]] = True
    index.delete(np.flatnonzero(deleted))
    queries = _unit(rng, 12, 16)
    query_memory = np.array([0, 1, 2, 3] * 3)
    for loaded in (False, True):
        if loaded:
            index.save(tmp_path)
            index = DenseIndex.load(tmp_path, device="cpu", batched_max_rows=threshold)
            assert {m: index.memory_search(m) for m in range(3)} == expect
        scores, found = index.search(queries, query_memory, k=9)
        for q in range(12):
            rows, _ = _brute_force(vectors, row_memory, deleted, queries[q], query_memory[q], 9)
            assert found[q, : len(rows)].tolist() == rows and (found[q, len(rows):] == -1).all()
            if expect.get(int(query_memory[q])) == "batched":
                assert scores[q, : len(rows)].tolist() == _oracle_scores(vectors[rows], queries[q]).tolist()


def test_batched_blocks_split_by_size_and_queries_give_the_same_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """However the memories and queries are cut into blocks, each query gets the same bits."""
    rng = np.random.default_rng(13)
    sizes = [5, 70, 1, 33, 200]
    row_memory = np.concatenate([[m] * s for m, s in enumerate(sizes)])
    vectors = _unit(rng, len(row_memory), 8)
    index = DenseIndex(dim=8, factory="Flat", device="cpu")
    index.add(vectors, row_memory)
    index.delete([0, 100, 101])
    queries = _unit(rng, 50, 8)
    query_memory = rng.integers(0, len(sizes), size=50)
    whole = index.search(queries, query_memory, k=12)
    monkeypatch.setattr(dense_module, "_BLOCK_ELEMENTS", 8 * 40)  # one memory (or a few queries) per block
    cut = index.search(queries, query_memory, k=12)
    assert torch.equal(whole[0], cut[0]) and torch.equal(whole[1], cut[1])


def test_batched_equals_faiss_rankings_on_real_embeddings(locomo2_summary_store) -> None:
    """The older path (a FAISS call per memory) and the batched product rank the same rows on two
    LoCoMo conversations (MiniLM vectors, the evaluated questions), with 5 % of the turns deleted;
    their scores differ at most in float32's last bits."""
    benchmark, store = locomo2_summary_store
    rows = np.arange(store.size)
    vectors = store.episode_dense.vectors(rows)
    memories = store.memory_idx[rows]
    questions = [q for q in benchmark.questions() if q.evaluated]
    queries = store.encoder.encode([q.question for q in questions])
    query_memory = [store.memory_of(q.memory_id) for q in questions]
    doomed = rows[::20]
    results = []
    for threshold in (0, 10_000):
        index = DenseIndex(dim=vectors.shape[1], factory="Flat", device="cpu", batched_max_rows=threshold)
        index.add(vectors, memories)
        index.delete(doomed)
        assert index.memory_search(0) == ("faiss" if threshold == 0 else "batched")
        results.append(index.search(queries, query_memory, k=60))
    (faiss_scores, faiss_rows), (batched_scores, batched_rows) = results
    assert torch.equal(faiss_rows, batched_rows)
    assert float((faiss_scores - batched_scores).abs().max()) <= 1e-6
    assert not set(batched_rows.flatten().tolist()) & set(doomed.tolist())
