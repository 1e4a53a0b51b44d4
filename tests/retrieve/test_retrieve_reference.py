"""The batched read path against the one-question-at-a-time reference, on real LoCoMo conversations.

Store: the first two LoCoMo conversations with the real MiniLM bi-encoder, real BM25 and FAISS
indexes, and an extractive summary layer (conftest.locomo2_summary_store). Question and PRF query
embeddings come from the real encoder. Reranker none (no cross-encoder weights exist offline).
"""

from __future__ import annotations

import time

import pytest
import torch
from support.encoding import cached_embed

from memfit_gpu.config import load_config
from memfit_gpu.retrieve import stages
from memfit_gpu.retrieve.batched import retrieve_batch
from memfit_gpu.retrieve.reference import retrieve_one
from memfit_gpu.retrieve.stages import StageKey, tick
from memfit_gpu.retrieve.view import ReadView

pytestmark = pytest.mark.slow

PER_MEMORY = 25  # questions per conversation: 50 in all keeps each config's reference run short


@pytest.fixture(scope="module")
def setup(locomo2_summary_store, bi_encoder):
    benchmark, store = locomo2_summary_store
    questions = [q for m in benchmark.memories for q in [q for q in m.questions if q.evaluated][:PER_MEMORY]]
    return store, questions, cached_embed(bi_encoder)


def _both(setup, overrides: list[str], reference: bool = True):
    store, questions, embed = setup
    cfg = load_config("configs/memfit.yaml", ["rerank.backend=none", *overrides])
    texts, mems = [q.question for q in questions], [q.memory_id for q in questions]
    q_emb = embed(texts)
    batched = retrieve_batch(ReadView.from_store(store), cfg, texts, mems, embed=embed, question_embeddings=q_emb)
    view = ReadView.from_store(store)
    loop = [retrieve_one(view, cfg, t, m, embed, q_emb[i]) for i, (t, m) in enumerate(zip(texts, mems, strict=True))
            if reference]
    return cfg, view, batched, loop


CONFIGS = [
    [],
    ["retrieve.prf.term_order=alphabetical", "pack.context_window=2"],
    ["retrieve.boosts.speaker_match=mention", "retrieve.boosts.summaries=true"],
    ["retrieve.summaries=false"],
    ["retrieve.scan_top_k=30", "rerank.rerank_pool=20", "pack.k=5", "retrieve.boosts_enabled=false"],
    ["retrieve.summary_expansion_top=10", "retrieve.prf.docs=4", "retrieve.alpha=0.5", "pack.context_window=0"],
]


@pytest.mark.parametrize("overrides", CONFIGS, ids=lambda o: ",".join(o) or "paper")
def test_batched_equals_reference(setup, overrides) -> None:
    _, view, batched, loop = _both(setup, overrides)
    assert view.has_summaries
    for a, b in zip(batched, loop, strict=True):
        assert a.pack_key() == b.pack_key(), a.question
        assert [(c["kind"], c["row"], c["source"]) for c in a.ranked] == [(c["kind"], c["row"], c["source"]) for c in b.ranked]
        assert [c["final"] for c in a.ranked] == [c["final"] for c in b.ranked]
        assert a.prf_terms == b.prf_terms and a.excerpts == b.excerpts


def test_switches_change_what_they_should(setup) -> None:
    cfg, view, paper, _ = _both(setup, [], reference=False)
    sources = {c["source"] for r in paper for c in r.ranked}
    assert {"pool", "summary_expansion", "prf"} <= sources
    assert any(c["kind"] == "summary" for r in paper for c in r.ranked)
    assert all(len(r.pack.selected) + len(r.pack.summaries) == cfg.pack.k for r in paper)
    # expansions enter at 0.5 x a score of at most 1 + 0.23 (fused <= 1, all three boosts)
    assert all(c["score"] <= 0.5 * (1 + 0.10 + 0.08 + 0.05) for r in paper for c in r.ranked if c["source"] != "pool")

    _, _, no_prf, _ = _both(setup, ["retrieve.prf.enabled=false"], reference=False)
    assert all(c["source"] != "prf" for r in no_prf for c in r.ranked) and all(not r.prf_terms for r in no_prf)
    _, _, no_exp, _ = _both(setup, ["retrieve.summary_expansion=false"], reference=False)
    assert all(c["source"] != "summary_expansion" for r in no_exp for c in r.ranked)
    _, _, no_sum, _ = _both(setup, ["retrieve.summaries=false"], reference=False)
    assert all(c["kind"] == "episode" and c["source"] != "summary_expansion" for r in no_sum for c in r.ranked)
    assert all(not r.pack.summaries and "REMEMBERED FACTS" not in r.excerpts for r in no_sum)
    _, _, window0, _ = _both(setup, ["pack.context_window=0"], reference=False)
    for r in window0:
        assert sorted(r.pack.episodes) == sorted(r.pack.selected)
    _, _, k5, _ = _both(setup, ["pack.k=5"], reference=False)
    assert all(len(r.pack.selected) + len(r.pack.summaries) == 5 for r in k5)
    _, _, plain, _ = _both(setup, ["retrieve.boosts_enabled=false"], reference=False)
    assert all(c["boost"] == 0.0 for r in plain for c in r.ranked)
    assert any(c["boost"] > 0 for r in paper for c in r.ranked)
    # SPEC read path 3: summaries get step 1's hybrid alone; retrieve.boosts.summaries boosts them as well
    assert all(c["boost"] == 0.0 for r in paper for c in r.ranked if c["kind"] == "summary")
    _, _, summaries_boosted, _ = _both(setup, ["retrieve.boosts.summaries=true"], reference=False)
    assert any(c["boost"] > 0 for r in summaries_boosted for c in r.ranked if c["kind"] == "summary")


def test_cross_encoder_rerank_batched_equals_reference(setup, tmp_path) -> None:
    """The rerank path with a real-bodied cross-encoder whose head is seeded random (no trained one
    ships offline; its scores mean nothing): same packs both ways, z-scores per kind, weights recorded."""
    from memfit_gpu.index.encoders import random_cross_encoder
    from memfit_gpu.retrieve.rerank import load_reranker

    store, questions, embed = setup
    folder = random_cross_encoder(tmp_path / "ce", seed=5)
    cfg = load_config("configs/memfit.yaml", [f"rerank.model={folder}", "rerank.rerank_pool=20"])
    reranker = load_reranker(cfg.rerank, device="cpu")
    picked = questions[:3] + questions[PER_MEMORY:PER_MEMORY + 3]
    texts, mems = [q.question for q in picked], [q.memory_id for q in picked]
    q_emb = embed(texts)
    batched = retrieve_batch(ReadView.from_store(store), cfg, texts, mems, embed=embed, question_embeddings=q_emb,
                             reranker=reranker)
    view = ReadView.from_store(store)
    loop = [retrieve_one(view, cfg, t, m, embed, q_emb[i], reranker=reranker) for i, (t, m) in enumerate(zip(texts, mems, strict=True))]
    for a, b in zip(batched, loop, strict=True):
        assert a.pack_key() == b.pack_key()
        assert [(c["kind"], c["row"]) for c in a.ranked] == [(c["kind"], c["row"]) for c in b.ranked]
        assert [c["rerank"] for c in a.ranked] == pytest.approx([c["rerank"] for c in b.ranked], abs=1e-5)
        assert a.reranker["backend"] == "cross-encoder" and a.reranker["weights"]["path"] == str(folder)
        for kind in ("episode", "summary"):
            finals = torch.tensor([c["final"] for c in a.ranked if c["kind"] == kind], dtype=torch.float64)
            if len(finals) >= 3:  # z-scored within the kind: mean 0, population std 1
                assert abs(finals.mean().item()) < 1e-9 and abs(finals.std(unbiased=False).item() - 1) < 1e-9
        assert [c["final"] for c in a.ranked] == sorted((c["final"] for c in a.ranked), reverse=True)


def test_batched_equals_reference_on_the_reference_bm25_backend(setup) -> None:
    """PRF terms then come from ReferenceBM25's plain feedback_terms instead of BM25Index's postings."""
    import dataclasses

    from memfit_gpu.index.bm25_reference import ReferenceBM25
    from memfit_gpu.index.tokenize import tokenize_many

    store, questions, embed = setup
    base = ReadView.from_store(store)
    plain = ReferenceBM25()
    plain.add(tokenize_many(base.ep_text), base.ep_memory.tolist())
    cfg = load_config("configs/memfit.yaml", ["rerank.backend=none"])
    texts, mems = [q.question for q in questions], [q.memory_id for q in questions]
    q_emb = embed(texts)
    batched = retrieve_batch(dataclasses.replace(base, ep_bm25=plain), cfg, texts, mems, embed=embed,
                             question_embeddings=q_emb)
    view = dataclasses.replace(ReadView.from_store(store), ep_bm25=plain)
    loop = [retrieve_one(view, cfg, t, m, embed, q_emb[i]) for i, (t, m) in enumerate(zip(texts, mems, strict=True))]
    assert sum(bool(a.prf_terms) for a in batched) > len(batched) // 2
    for a, b in zip(batched, loop, strict=True):
        assert a.prf_terms == b.prf_terms and a.pack_key() == b.pack_key() and a.excerpts == b.excerpts


def test_stage_clocks_wait_for_the_index_device(setup, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every stage clock of the batched path is read after the BM25 index's device has
    finished its queued work (on a GPU an unsynchronised clock billed BM25 to `fuse`); the keys
    written are exactly the StageKey names `memfit profile` reads."""
    store, questions, embed = setup
    cfg = load_config("configs/memfit.yaml", ["rerank.backend=none"])
    synced: list[torch.device | None] = []
    monkeypatch.setattr(stages, "synchronize", synced.append)
    texts, mems = [q.question for q in questions[:4]], [q.memory_id for q in questions[:4]]
    view = ReadView.from_store(store)
    timings: dict[str, float] = {}
    retrieve_batch(view, cfg, texts, mems, embed=embed, question_embeddings=embed(texts), timings=timings)
    # every key but the added stages' (ticked only when retrieve.stages names some: tests/test_seams.py)
    keys = {v for k, v in vars(StageKey).items() if k.isupper() and k not in ("PRF_PREFIX", "ADDED")}
    prf_parts = {StageKey.PRF_PREFIX + k for k in (StageKey.BM25, StageKey.DENSE, StageKey.FUSE)}
    expected = keys - {StageKey.BOOST} if cfg.retrieve.kernels == "triton" else keys
    assert set(timings) == expected | prf_parts
    # one synchronised reading per key written (PRF's parts and the BM25/dense/fuse split included);
    # the BM25 and dense devices are the CPU here
    assert len(synced) == 12 + 2 * 3 + 2 and set(synced) == {view.ep_bm25.device, None}


def test_tick_reads_the_clock_after_the_device_finished(monkeypatch: pytest.MonkeyPatch) -> None:
    """The wait is inside the measured interval (a CUDA stage's kernels are billed to it)."""
    waited: list[torch.device] = []

    def slow_sync(device: torch.device) -> None:
        waited.append(device)
        time.sleep(0.05)

    monkeypatch.setattr(torch.cuda, "synchronize", slow_sync)
    timings: dict[str, float] = {}
    start = time.perf_counter()
    tick(timings, StageKey.BM25, start, torch.device("cuda", 1))
    tick(timings, StageKey.DENSE, start, torch.device("cpu"))
    tick(timings, StageKey.FUSE, start, None)
    assert waited == [torch.device("cuda", 1)]
    assert timings[StageKey.BM25] >= 0.05 and set(timings) == {"bm25", "dense", "fuse"}


def test_undated_turns_get_no_month_or_year_boost_on_either_path(tmp_path, bi_encoder) -> None:
    """An undated turn's time is NaT, whose integer the batched path read as May (so "in May" boosted every
    undated turn) and on which the reference raised AttributeError."""
    import seam_echo_backend  # noqa: F401  (registers reader.backend=echo)

    from memfit_gpu.live import Memory

    turns = [{"speaker": "Ann", "text": f"I went hiking with my sister, trip {i}."} for i in range(6)]
    turns += [{"speaker": "Ann", "text": "In May we went hiking again.", "timestamp": "2024-05-04T10:00:00"}]
    with Memory.open(tmp_path / "m", "configs/demo.yaml", overrides=["reader.backend=echo", "rerank.backend=none",
                                                                        "live.consolidate=manual"]) as memory:
        cfg = load_config("configs/memfit.yaml", ["rerank.backend=none"])
        texts, mems, embed = ["Where did we go hiking in May 2024?"], ["u"], cached_embed(bi_encoder)
        memory.add("u", turns)
        view = ReadView.from_store(memory.store)
        batched = retrieve_batch(view, cfg, texts, mems, embed=embed, question_embeddings=embed(texts))
        loop = retrieve_one(view, cfg, texts[0], "u", embed, embed(texts)[0])
    boosts = {c["row"]: c["boost"] for c in batched[0].ranked}
    assert boosts[6] > 0 and all(boosts[r] == 0.0 for r in range(6) if r in boosts) and len(boosts) > 1
    assert [(c["row"], c["final"]) for c in batched[0].ranked] == [(c["row"], c["final"]) for c in loop.ranked]
