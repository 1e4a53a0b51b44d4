"""The bounded write path: a store written in many small chunks is the same store as one written in
one batch: the same log bytes, BM25 state (term ids included), vectors, columns, rankings and packs,
through deletions, snapshots and reopening; and the dense read path's batched product ranks as FAISS did."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from memfit_gpu.config import MemFitConfig
from memfit_gpu.data import load_benchmark, select_questions
from memfit_gpu.data.schema import Memory
from memfit_gpu.data.synth import HashEncoder, iter_memories
from memfit_gpu.retrieve.batched import retrieve_batch
from memfit_gpu.retrieve.view import ReadView
from memfit_gpu.store import EpisodeStore, episode_text

DIM = 384
ENCODER = HashEncoder(DIM)  # deterministic per text and batch-independent: rebuilds compare exactly


def _cfg(budget_mb: int, batched_max_rows: int = 65_536) -> MemFitConfig:
    cfg = MemFitConfig()
    cfg.summary.enabled = False
    cfg.retrieve.summaries = False
    cfg.rerank.backend = "none"
    cfg.index.device = "cpu"
    cfg.store.write_budget_mb = budget_mb
    cfg.index.dense_batched_max_rows = batched_max_rows
    return cfg


def _with_vectors(memories: list[Memory]) -> list[Memory]:
    for memory in memories:
        memory.extra["embeddings"] = ENCODER.encode([episode_text(t) for t in memory.turns()]).numpy()
    return memories


def _bm25_state(store: EpisodeStore) -> dict[str, Any]:
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in store.episode_bm25.state_dict().items()}


def _assert_same_store(a: EpisodeStore, b: EpisodeStore) -> None:
    assert a.size == b.size and a.memory_ids == b.memory_ids and a.memory_speakers == b.memory_speakers
    for column in ("memory_idx", "session_idx", "position", "speaker_id", "timestamp", "deleted"):
        assert np.array_equal(getattr(a, column), getattr(b, column)), column
    assert a.text.tolist() == b.text.tolist() and a.turn_id.tolist() == b.turn_id.tolist()
    assert a.image_ids.tolist() == b.image_ids.tolist() and a.speaker.tolist() == b.speaker.tolist()
    sa, sb = _bm25_state(a), _bm25_state(b)
    assert sa.keys() == sb.keys()
    for key in sa:
        same = torch.equal(sa[key], sb[key]) if isinstance(sa[key], torch.Tensor) else sa[key] == sb[key]
        assert same, key
    rows = np.arange(a.size)
    assert np.array_equal(a.episode_dense.vectors(rows), b.episode_dense.vectors(rows))
    assert np.array_equal(a.episode_dense.deleted, b.episode_dense.deleted)


def _retrieve(store: EpisodeStore, cfg: MemFitConfig, questions: list[Any], q_emb: torch.Tensor | None = None
              ) -> list[tuple[Any, ...]]:
    """Per question its pack, and every 10th question's ranked (kind, row, score) list: what must not move."""
    texts = [q.question for q in questions]
    results = retrieve_batch(ReadView.from_store(store), cfg, texts, [q.memory_id for q in questions],
                             embed=ENCODER.encode, question_embeddings=q_emb if q_emb is not None else
                             ENCODER.encode(texts))
    return [(r.pack_key(), [(c["kind"], c["row"], c["score"]) for c in r.ranked] if i % 10 == 0 else None)
            for i, r in enumerate(results)]


def _build(path: Path, cfg: MemFitConfig, memories: Any) -> EpisodeStore:
    store = EpisodeStore(path, cfg, ENCODER)
    store.add_memories(memories, progress=False, precomputed=True)
    return store


def _delete_some(store: EpisodeStore, memories: list[Memory]) -> None:
    for memory in memories[:3]:
        turns = [t.turn_id for t in memory.turns()]
        store.delete_episodes(memory.memory_id, turns[1::7])


@pytest.mark.slow
def test_chunked_equals_one_batch_on_locomo(tmp_path: Path, locomo_path: Path) -> None:
    """All of LoCoMo (5,882 turns) in one batch vs in chunks of ~1 MB (dozens): identical log bytes,
    columns, BM25 state and vectors; identical rankings (scores included) and packs for the 1,540
    evaluated questions, after deletions, and after reopening from the snapshots and from the log alone."""
    benchmark = select_questions(load_benchmark("locomo", locomo_path), exclude_categories=["5"])
    memories = _with_vectors(benchmark.memories)
    questions = [q for q in benchmark.questions() if q.evaluated]
    one_cfg, chunked_cfg = _cfg(1 << 20), _cfg(1)
    one = _build(tmp_path / "one", one_cfg, memories)
    chunked = _build(tmp_path / "chunked", chunked_cfg, iter(memories))
    assert one.last_timings["chunks"] == 1 and chunked.last_timings["chunks"] > 20
    assert (tmp_path / "one" / "log.jsonl").read_bytes() == (tmp_path / "chunked" / "log.jsonl").read_bytes()
    _assert_same_store(one, chunked)
    before = _retrieve(one, one_cfg, questions)
    assert _retrieve(chunked, chunked_cfg, questions) == before

    for store in (one, chunked):
        _delete_some(store, memories)
    _assert_same_store(one, chunked)
    after = _retrieve(one, one_cfg, questions)
    assert after != before and _retrieve(chunked, chunked_cfg, questions) == after
    one.close()
    chunked.close()

    reopened = EpisodeStore(tmp_path / "chunked", chunked_cfg, ENCODER)  # from its snapshot
    _assert_same_store(one, reopened)
    assert _retrieve(reopened, chunked_cfg, questions) == after
    reopened.close()
    for snapshot in (tmp_path / "chunked" / "snapshots").iterdir():  # from the log alone, replayed in chunks
        for file in snapshot.rglob("*"):
            if file.is_file():
                file.unlink()
    replayed = EpisodeStore(tmp_path / "chunked", chunked_cfg, ENCODER)
    _assert_same_store(one, replayed)
    assert _retrieve(replayed, chunked_cfg, questions) == after
    replayed.close()


def test_chunked_equals_one_batch_on_synthetic_longmemeval(tmp_path: Path) -> None:
    """Twelve LongMemEval-S-shaped memories (~6,600 turns, precomputed vectors) streamed from the
    generator in ~0.5 MB chunks (a memory's turns span chunks) vs one batch; then deletions, reopen."""
    def memories() -> Any:
        return iter_memories("longmemeval-s", 12, seed=3, embedding_dim=DIM)

    listed = list(memories())
    questions = [q for m in listed for q in m.questions]
    q_emb = torch.from_numpy(np.stack([q.extra["embedding"] for q in questions]))
    one_cfg, chunked_cfg = _cfg(1 << 20), _cfg(1)
    chunked_cfg.store.write_budget_mb = 1
    one = _build(tmp_path / "one", one_cfg, listed)
    chunked = _build(tmp_path / "chunked", chunked_cfg, memories())
    assert chunked.last_timings["chunks"] > 12  # more chunks than memories: memories are split
    assert (tmp_path / "one" / "log.jsonl").read_bytes() == (tmp_path / "chunked" / "log.jsonl").read_bytes()
    _assert_same_store(one, chunked)
    before = _retrieve(one, one_cfg, questions, q_emb)
    assert _retrieve(chunked, chunked_cfg, questions, q_emb) == before
    # the gold turn of each question lands in its pack (the generator's facts are findable)
    view = ReadView.from_store(one)
    assert all(set(q.evidence) & {view.ep_turn_id[r] for r in pack[0][1]} for q, pack in zip(questions, before, strict=True))

    for store in (one, chunked):
        _delete_some(store, listed)
        store.close()
    reopened = [EpisodeStore(tmp_path / name, cfg, ENCODER) for name, cfg in (("one", one_cfg), ("chunked", chunked_cfg))]
    _assert_same_store(*reopened)
    assert _retrieve(reopened[0], one_cfg, questions, q_emb) == _retrieve(reopened[1], chunked_cfg, questions, q_emb)
    for store in reopened:
        store.close()


def test_a_batch_that_fails_after_some_chunks_leaves_nothing(tmp_path: Path) -> None:
    """A persistent store whose multi-chunk batch fails part-way drops the batch's logged records and
    reloads itself: the store is as before the batch, and the same batch can be written again."""
    cfg = _cfg(1)
    store = _build(tmp_path / "store", cfg, iter_memories("longmemeval-s", 1, seed=0, embedding_dim=DIM))
    size, records = store.size, len(store._log)

    def failing() -> Any:
        yield from iter_memories("longmemeval-s", 3, seed=1, embedding_dim=DIM)
        raise RuntimeError("the source broke")

    with pytest.raises(RuntimeError, match="the source broke"):
        store.add_memories(failing(), progress=False, precomputed=True)
    assert store.size == size and len(store._log) == records and len(store.memory_ids) == 1
    store.add_memories(iter_memories("longmemeval-s", 3, seed=1, embedding_dim=DIM), progress=False, precomputed=True)
    assert len(store.memory_ids) == 4
    store.close()
    assert EpisodeStore(tmp_path / "store", cfg, ENCODER).size == store.size


def test_precomputed_embeddings_must_match_the_turns(tmp_path: Path) -> None:
    memory = next(iter_memories("longmemeval-s", 1, seed=0, embedding_dim=8))
    store = EpisodeStore(None, _cfg(64), ENCODER)
    with pytest.raises(ValueError, match=r"embeddings of shape \(\d+, 8\), expected \(\d+, 384\)"):
        store.add_memories([memory], progress=False, precomputed=True)
    del memory.extra["embeddings"]
    with pytest.raises(ValueError, match="has no extra\\['embeddings'\\]"):
        store.add_memories([memory], progress=False, precomputed=True)
    assert store.size == 0


class _SlowHashEncoder(HashEncoder):
    """HashEncoder taking 0.05 s a call (one call per chunk): a chunked batch's encode time must sum them."""

    def encode(self, texts: Any, batch_size: int = 0, progress: bool = False) -> torch.Tensor:  # noqa: ARG002
        time.sleep(0.05)
        return super().encode(texts)


def test_a_chunked_batch_times_every_chunk_s_encoding(locomo_path: Path) -> None:
    """`last_timings["encode_s"]` (build_timings.json, `memfit profile`'s encode rate) held the last chunk's
    encoding only, while bm25_s, dense_s and log_s summed every chunk's."""
    memories = load_benchmark("locomo", locomo_path).memories[:3]
    store = EpisodeStore(None, _cfg(1), _SlowHashEncoder(DIM))
    store.add_memories(memories, progress=False)
    chunks = store.last_timings["chunks"]
    assert chunks > 2 and store.last_timings["encode_s"] >= 0.05 * chunks, store.last_timings
    store.close()
