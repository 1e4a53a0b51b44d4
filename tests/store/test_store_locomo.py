"""The whole of LoCoMo (10 memories, 5,882 turns) in one persistent store, before and after reopening.

Encoding 5,882 turns takes minutes on two cores: the store is built ONCE per test session."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from memfit_gpu.config import MemFitConfig
from memfit_gpu.data import load_benchmark
from memfit_gpu.index.tokenize import tokenize
from memfit_gpu.retrieve.view import ReadView
from memfit_gpu.store import EpisodeStore, episode_text

pytestmark = pytest.mark.slow


class EncodeSpy:
    def __init__(self, encoder):
        self.encoder, self.dim, self.calls = encoder, encoder.dim, []

    def encode(self, texts, batch_size=128, progress=False):
        self.calls.append(len(texts))
        return self.encoder.encode(texts, batch_size=batch_size, progress=progress)


@pytest.fixture(scope="session")
def locomo(locomo_path):
    return load_benchmark("locomo", locomo_path)


@pytest.fixture(scope="session")
def locomo_store(tmp_path_factory, locomo, bi_encoder):
    path = tmp_path_factory.mktemp("locomo_store")
    spy = EncodeSpy(bi_encoder)
    store = EpisodeStore(path, MemFitConfig(), spy)
    store.add_memories(locomo.memories, progress=False)
    assert spy.calls == [5882]  # one encoder pass over the whole benchmark
    store.close()
    return path, store


def _questions(locomo):
    questions = locomo.questions()
    memory_of = {m.memory_id: i for i, m in enumerate(locomo.memories)}
    return [q.question for q in questions], np.array([memory_of[q.memory_id] for q in questions])


def test_locomo_store_contents(locomo, locomo_store):
    _, store = locomo_store
    assert store.size == 5882 and len(store.memory_ids) == 10
    assert store.memory_ids == [m.memory_id for m in locomo.memories]
    for m, memory in enumerate(locomo.memories):
        turns = memory.turns()
        rows = store.memory_rows(m)
        assert len(rows) == len(turns)
        assert store.text[rows].tolist() == [episode_text(t) for t in turns]
        assert store.turn_id[rows].tolist() == [t.turn_id for t in turns]
        assert store.position[rows].tolist() == list(range(len(turns)))
        assert [store.session_ids[s] for s in store.session_idx[rows]] == [
            s.session_id for s in memory.sessions for _ in s.turns
        ]
        # BM25 statistics are the memory's own: N and avgdl from its texts alone
        lengths = [len(tokenize(episode_text(t))) for t in turns]
        n_docs, avgdl = store.episode_bm25.memory_stats(m)
        assert n_docs == len(turns) and avgdl == pytest.approx(sum(lengths) / len(turns))
        assert store.episode_dense.memory_size(m) == len(turns)
    years, _ = ReadView.from_store(store).ep_year_month
    assert int((years >= 2022).sum()) == 5882  # every LoCoMo session is dated 2022-2023
    assert store.image_ids[0] == ()


def test_locomo_batched_search_is_isolated_and_equals_per_memory_runs(locomo, locomo_store, bi_encoder):
    _, store = locomo_store
    texts, memories = _questions(locomo)
    rng = np.random.default_rng(0)
    pick = rng.choice(len(texts), size=60, replace=False)
    texts = [texts[i] for i in pick]
    memories = memories[pick]
    vectors = bi_encoder.encode(texts)
    tokens = [tokenize(t) for t in texts]
    bm25_scores, bm25_rows = store.episode_bm25.search(tokens, memories, k=60)
    dense_scores, dense_rows = store.episode_dense.search(vectors, memories, k=60)
    for q in range(len(texts)):
        for rows in (bm25_rows[q], dense_rows[q]):
            found = rows[rows >= 0].numpy()
            assert len(found) > 0 and (store.memory_idx[found] == memories[q]).all()
        s, r = store.episode_bm25.search([tokens[q]], [memories[q]], k=60)
        assert torch.equal(r[0], bm25_rows[q]) and torch.allclose(s[0], bm25_scores[q])
        s, r = store.episode_dense.search(vectors[q : q + 1], [memories[q]], k=60)
        assert torch.equal(r[0], dense_rows[q]) and torch.allclose(s[0], dense_scores[q])


def test_locomo_reopen_is_identical_without_re_encoding(locomo, locomo_store, bi_encoder):
    path, store = locomo_store
    spy = EncodeSpy(bi_encoder)
    reopened = EpisodeStore(path, MemFitConfig(), spy)
    assert spy.calls == []  # everything comes from the snapshot
    assert reopened.size == store.size and reopened.text.tolist() == store.text.tolist()
    for column in ("memory_idx", "session_idx", "position", "speaker_id", "timestamp", "deleted"):
        assert np.array_equal(getattr(reopened, column), getattr(store, column)), column
    texts, memories = _questions(locomo)
    texts, memories = texts[::5], memories[::5]
    vectors = bi_encoder.encode(texts)
    tokens = [tokenize(t) for t in texts]
    for index_name, queries in (("episode_bm25", tokens), ("episode_dense", vectors)):
        before = getattr(store, index_name).search(queries, memories, k=60)
        after = getattr(reopened, index_name).search(queries, memories, k=60)
        assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1]), index_name
    reopened.close()
