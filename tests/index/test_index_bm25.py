"""BM25Index (batched torch) against hand-computed values, ReferenceBM25, and bm25s on real LoCoMo."""

from __future__ import annotations

import json
import logging
import math
import random
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import memfit_gpu.index.bm25 as bm25_module
import memfit_gpu.index.bm25_postings as postings_module
from memfit_gpu.index.bm25 import BM25Index
from memfit_gpu.index.bm25_reference import ReferenceBM25
from memfit_gpu.index.protocols import LexicalIndex
from memfit_gpu.index.tokenize import tokenize, tokenize_many
from memfit_gpu.store import episode_prefix

BACKENDS = [BM25Index, ReferenceBM25]
# three documents of memory 0 used by the hand-computed cases: N = 3, avgdl = (2 + 3 + 1) / 3 = 2
DOCS = [["a", "b"], ["a", "c", "c"], ["d"]]
IDF_A = math.log(1 + (3 - 2 + 0.5) / (2 + 0.5))  # df(a) = 2
IDF_C = math.log(1 + (3 - 1 + 0.5) / (1 + 0.5))  # df(c) = 1
# tf / (tf + k1 * (1 - b + b * dl / avgdl)) with k1 = 1.5, b = 0.75
TF_A_DOC0 = 1 / (1 + 1.5 * (0.25 + 0.75 * 2 / 2))  # = 0.4
TF_A_DOC1 = 1 / (1 + 1.5 * (0.25 + 0.75 * 3 / 2))  # = 1 / 3.0625
TF_C_DOC1 = 2 / (2 + 1.5 * (0.25 + 0.75 * 3 / 2))  # = 2 / 4.0625


# ---------------------------------------------------------------- helpers
@pytest.fixture(params=["dense-rows", "all-sparse"])
def scoring_path(request, monkeypatch):
    """BM25Index scores frequent terms as dense rows and the rest through the segmented scatter; tiny
    corpora make every term dense, so these runs force each path in turn."""
    monkeypatch.setattr(postings_module, "_DENSE_FACTOR", 10**9 if request.param == "dense-rows" else 0)
    return request.param


def locomo_memories(path, limit: int | None = None) -> tuple[list[list[str]], list[list[str]]]:
    """(episode texts, evaluated question texts) per conversation, sessions driven off session_N keys."""
    conversations = json.loads(path.read_text())[:limit]
    episodes, questions = [], []
    for conv in conversations:
        talk = conv["conversation"]
        numbers = sorted(int(m.group(1)) for key in talk if (m := re.fullmatch(r"session_(\d+)", key)))
        texts = [
            episode_prefix(talk[f"session_{n}_date_time"], turn["speaker"]) + turn["text"]
            for n in numbers
            for turn in talk[f"session_{n}"]
        ]
        episodes.append(texts)
        questions.append([qa["question"] for qa in conv["qa"] if str(qa["category"]) != "5"])
    return episodes, questions


def build(cls, docs: list[list[str]], mems: list[int]):
    index = cls()
    index.add(docs, mems)
    return index


def assert_same_results(fast, slow, queries, mems, k):
    """The same rows and bit-identical scores: the reference rounds as the index does (its module doc). It summed
    in float64 and sorted on that, so a tie of the float32 scores came out in rounding-noise order (and the
    scores differed by 1 ulp), which a tolerance here hid."""
    fs, fr = fast.search(queries, mems, k)
    ss, sr = slow.search(queries, mems, k)
    assert fs.shape == ss.shape == (len(queries), k)
    assert torch.equal(fs, ss) and torch.equal(fr, sr)


def test_a_tie_is_broken_by_the_lower_row_on_both_paths():
    """`a` and `b` have the same df: rows 0 and 1 score the same in exact arithmetic. The reference ranked row 1
    first (its float64 sums differed in the last bit), so at k=1 the two backends kept different rows."""
    docs = [["a", "c", "d"], ["c", "b", "d"]]
    fast, slow = build(BM25Index, docs, [0, 0]), build(ReferenceBM25, docs, [0, 0])
    for k in (1, 2):
        assert_same_results(fast, slow, [["a", "c", "d", "b"]], [0], k)
    assert slow.search([["a", "c", "d", "b"]], [0], 1)[1].tolist() == [[0]]


# ---------------------------------------------------------------- tokenizer
def test_tokenize_lowercases_unicode_word_runs():
    assert tokenize("Hello, World! It's 2023 — Café_au_lait ÜBER naïve") == [
        "hello", "world", "it", "s", "2023", "café_au_lait", "über", "naïve",
    ]
    assert tokenize("") == []
    assert tokenize_many(["A b", "", "c-D"]) == [["a", "b"], [], ["c", "d"]]


# ---------------------------------------------------------------- hand-computed values
@pytest.mark.parametrize("cls", BACKENDS)
def test_hand_computed_scores_and_order(cls, scoring_path):
    index = build(cls, DOCS, [0, 0, 0])
    scores, rows = index.search([["a"], ["c", "a"]], [0, 0], k=3)
    assert rows.tolist() == [[0, 1, -1], [1, 0, -1]]
    expected = [[IDF_A * TF_A_DOC0, IDF_A * TF_A_DOC1, 0.0], [IDF_C * TF_C_DOC1 + IDF_A * TF_A_DOC1, IDF_A * TF_A_DOC0, 0.0]]
    torch.testing.assert_close(scores, torch.tensor(expected), atol=1e-6, rtol=1e-6)
    assert scores.dtype == torch.float32 and rows.dtype == torch.long


@pytest.mark.parametrize("cls", BACKENDS)
def test_repeated_query_term_counts_per_occurrence(cls, scoring_path):
    index = build(cls, DOCS, [0, 0, 0])
    once, _ = index.search([["a"]], [0], k=2)
    twice, rows = index.search([["a", "a"]], [0], k=2)
    assert rows.tolist() == [[0, 1]]
    torch.testing.assert_close(twice, 2 * once)
    torch.testing.assert_close(twice[0, 0], torch.tensor(2 * IDF_A * 0.4))


@pytest.mark.parametrize("cls", BACKENDS)
def test_empty_and_unmatched_queries_return_nothing(cls):
    index = build(cls, DOCS, [0, 0, 0])
    scores, rows = index.search([[], ["zebra", "unicorn"], ["d"]], [0, 0, 0], k=2)
    assert rows.tolist() == [[-1, -1], [-1, -1], [2, -1]]
    assert scores[:2].abs().sum() == 0
    # a memory that was never added has no rows at all
    scores, rows = index.search([["a"]], [7], k=2)
    assert rows.tolist() == [[-1, -1]] and scores.abs().sum() == 0


@pytest.mark.parametrize("cls", BACKENDS)
def test_ties_break_by_lower_row(cls, scoring_path):
    # rows 0 and 2 are identical documents: equal scores, lower row first
    index = build(cls, [["x", "y"], ["z"], ["x", "y"], ["x", "x", "y"]], [0, 0, 0, 0])
    scores, rows = index.search([["y"]], [0], k=4)
    assert rows.tolist() == [[0, 2, 3, -1]]
    assert scores[0, 0] == scores[0, 1]


@pytest.mark.parametrize("cls", BACKENDS)
def test_idf_and_doc_tokens(cls):
    index = build(cls, DOCS + [["a", "q"]], [0, 0, 0, 1])
    idf = index.idf([["a", "c", "never"], ["a"]], [0, 1])
    # memory 1 has N = 1, df(a) = 1; a token absent from the memory has df = 0
    expected = [[IDF_A, IDF_C, math.log(1 + 3.5 / 0.5)], [math.log(1 + 0.5 / 1.5)]]
    for got, want in zip(idf, expected, strict=True):
        assert got == pytest.approx(want, rel=1e-12)
    assert index.doc_tokens([1, 3]) == [["a", "c"], ["a", "q"]]


@pytest.mark.parametrize("cls", BACKENDS)
def test_delete_updates_n_df_avgdl(cls, scoring_path):
    index = build(cls, DOCS, [0, 0, 0])
    index.delete([0])
    index.delete([0])  # repeat: no double counting
    # memory now: ["a","c","c"], ["d"]: N = 2, avgdl = 2, df(a) = 1
    scores, rows = index.search([["a"]], [0], k=3)
    idf = math.log(1 + (2 - 1 + 0.5) / 1.5)
    assert rows.tolist() == [[1, -1, -1]]
    assert float(scores[0, 0]) == pytest.approx(idf * 1 / (1 + 1.5 * (0.25 + 0.75 * 3 / 2)), rel=1e-6)
    assert index.memory_stats(0) == (2, 2.0)
    assert index.idf([["a"]], [0])[0][0] == pytest.approx(idf)
    # rows keep their numbers after a delete
    assert index.add([["a"]], [0]).tolist() == [3]


@pytest.mark.parametrize("cls", BACKENDS)
def test_scores_full_vectors_padded(cls, scoring_path):
    index = build(cls, [["a"], ["b"], ["a", "b"], ["a"]], [0, 1, 0, 0])
    index.delete([3])
    scores, rows = index.scores([["a"], ["a"], ["b"]], [0, 1, 1])
    # width = most live docs of a queried memory (memory 0: rows 0, 2)
    assert rows.tolist() == [[0, 2], [1, -1], [1, -1]]
    assert scores.shape == (3, 2)
    assert scores[1].tolist() == [0.0, 0.0]
    assert scores[2, 1] == 0 and scores[2, 0] > 0
    assert scores[0, 0] > scores[0, 1] > 0


@pytest.mark.parametrize("cls", BACKENDS)
def test_bad_arguments_name_the_problem(cls):
    index = build(cls, DOCS, [0, 0, 0])
    with pytest.raises(ValueError, match="2 token lists but 1 memory_idx"):
        index.add([["a"], ["b"]], [0])
    with pytest.raises(IndexError, match="row 9 does not exist"):
        index.delete([9])
    with pytest.raises(ValueError, match="k must be >= 1"):
        index.search([["a"]], [0], k=0)
    with pytest.raises(ValueError, match="memory_idx must be >= 0"):
        index.search([["a"]], [-1], k=1)


# ---------------------------------------------------------------- bm25s parity on real LoCoMo
def test_parity_with_bm25s_on_locomo(locomo_path):
    import bm25s  # dev dependency: the oracle

    logging.getLogger("bm25s").setLevel(logging.WARNING)
    episodes, questions = locomo_memories(locomo_path, limit=None)
    index = BM25Index()
    doc_tokens = [tokenize_many(texts) for texts in episodes]
    for mem, tokens in enumerate(doc_tokens):
        index.add(tokens, [mem] * len(tokens))
    query_tokens = [tokenize_many(qs) for qs in questions]
    flat_queries = [q for qs in query_tokens for q in qs]
    flat_mems = [mem for mem, qs in enumerate(query_tokens) for _ in qs]
    ours, rows = index.scores(flat_queries, flat_mems)
    assert len(flat_queries) == 1540  # every LoCoMo question outside category 5
    theirs = torch.zeros_like(ours)
    expected_rows = torch.full_like(rows, -1)
    qi = 0
    for mem, tokens in enumerate(doc_tokens):
        retriever = bm25s.BM25(method="lucene", k1=1.5, b=0.75)
        retriever.index(tokens, show_progress=False)
        first_row = sum(len(t) for t in doc_tokens[:mem])
        n = len(tokens)
        for query in query_tokens[mem]:
            theirs[qi, :n] = torch.from_numpy(retriever.get_scores(query))
            expected_rows[qi, :n] = torch.arange(first_row, first_row + n)
            qi += 1
    assert torch.equal(rows, expected_rows)
    # padding past a query's own conversation stays exactly 0 on both sides
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    assert float(theirs.max()) > 10  # real, non-trivial scores were compared


# ---------------------------------------------------------------- fast vs reference
def test_parity_with_reference_after_appends_and_deletes(locomo_path):
    episodes, questions = locomo_memories(locomo_path, limit=3)
    fast, slow = BM25Index(), ReferenceBM25()
    rng = random.Random(0)
    # interleave memories across add calls so each memory's rows are not contiguous
    pending = [(mem, tokenize(text)) for mem, texts in enumerate(episodes) for text in texts]
    rng.shuffle(pending)
    queries = [tokenize(q) for qs in questions for q in qs[:15]]
    mems = [mem for mem, qs in enumerate(questions) for _ in qs[:15]]
    for start in range(0, len(pending), 400):
        batch = pending[start : start + 400]
        new_fast = fast.add([t for _, t in batch], [m for m, _ in batch])
        new_slow = slow.add([t for _, t in batch], [m for m, _ in batch])
        assert torch.equal(new_fast, new_slow)
        victims = rng.sample(new_fast.tolist(), 25)
        fast.delete(victims)
        slow.delete(victims)
        assert_same_results(fast, slow, queries, mems, k=20)
    fs, fr = fast.scores(queries, mems)
    ss, sr = slow.scores(queries, mems)
    assert torch.equal(fr, sr)
    torch.testing.assert_close(fs, ss, atol=1e-5, rtol=1e-5)
    probe = [["caroline", "melanie", "the", "never_seen"]] * 3
    for got, want in zip(fast.idf(probe, [0, 1, 2]), slow.idf(probe, [0, 1, 2]), strict=True):
        assert got == pytest.approx(want, rel=1e-12)
    assert fast.doc_tokens([5, 17, 300]) == slow.doc_tokens([5, 17, 300])


def test_chunked_search_equals_one_block(monkeypatch, scoring_path):
    rng = random.Random(1)
    words = [f"w{i}" for i in range(30)]
    docs = [[rng.choice(words) for _ in range(rng.randint(0, 8))] for _ in range(120)]
    mems = [rng.randrange(4) for _ in docs]
    index = build(BM25Index, docs, mems)
    queries = [[rng.choice(words) for _ in range(rng.randint(0, 4))] for _ in range(50)]
    qmems = [rng.randrange(5) for _ in queries]  # memory 4 was never added
    whole = index.search(queries, qmems, k=7)
    monkeypatch.setattr(bm25_module, "_CHUNK_ELEMENTS", 100)  # about 2 queries per block
    chunked = index.search(queries, qmems, k=7)
    assert torch.equal(whole[0], chunked[0]) and torch.equal(whole[1], chunked[1])
    assert_same_results(index, build(ReferenceBM25, docs, mems), queries, qmems, k=7)


def _oom_docs() -> tuple[BM25Index, list[list[str]], list[int]]:
    rng = random.Random(2)
    words = [f"w{i}" for i in range(30)]
    docs = [[rng.choice(words) for _ in range(rng.randint(0, 8))] for _ in range(120)]
    index = build(BM25Index, docs, [rng.randrange(4) for _ in docs])
    queries = [[rng.choice(words) for _ in range(rng.randint(1, 4))] for _ in range(40)]
    return index, queries, [rng.randrange(4) for _ in queries]


def test_out_of_memory_halves_the_question_block(monkeypatch, caplog):
    """BM25 used to die on OOM. A block of questions that does not fit is halved until it does
    (provoked: any block of more than 5 questions raises torch.OutOfMemoryError); same bits as one block."""
    index, queries, qmems = _oom_docs()
    whole = index.search(queries, qmems, k=7)
    real = BM25Index._score_block
    sizes: list[int] = []

    def tight(self, cache, pair_query, pair_term, n_queries, width):
        sizes.append(n_queries)
        if n_queries > 5:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(self, cache, pair_query, pair_term, n_queries, width)

    monkeypatch.setattr(BM25Index, "_score_block", tight)
    with caplog.at_level(logging.WARNING, logger="memfit_gpu.index.bm25"):
        halved = index.search(queries, qmems, k=7)
    assert torch.equal(whole[0], halved[0]) and torch.equal(whole[1], halved[1])
    assert sizes[0] == 40 and max(sizes[sizes.index(5):]) == 5 and "5 at a time now" in caplog.text
    monkeypatch.setattr(BM25Index, "_score_block", lambda *a: (_ for _ in ()).throw(
        RuntimeError("CUDA error: out of memory")))
    with pytest.raises(RuntimeError, match="out of memory"):  # one question does not fit either: not hidden
        index.search(queries[:3], qmems[:3], k=7)


def test_out_of_memory_on_the_gpu_moves_the_index_to_the_cpu(monkeypatch, caplog):
    """When even one question does not fit on the GPU the index moves to the CPU for good, says so, and
    answers there with the torch path (the device is described as CUDA; the OOM is provoked)."""
    index, queries, qmems = _oom_docs()
    expected = index.search(queries, qmems, k=7, kernels="torch")
    real = BM25Index._search_pairs
    calls: list[str] = []

    def first_fails(self, pair_query, pair_term, mems, k, kernels="torch"):
        calls.append(f"{self.device.type}/{kernels}")
        if self.device.type == "cuda":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")
        return real(self, pair_query, pair_term, mems, k, kernels)

    real_encode = BM25Index._encode_queries

    def encode_here(self, queries, mems):  # the query pairs are made on the CPU, where the tensors are
        believed, self.device = self.device, torch.device("cpu")
        try:
            return real_encode(self, queries, mems)
        finally:
            self.device = believed

    monkeypatch.setattr(BM25Index, "_search_pairs", first_fails)
    monkeypatch.setattr(BM25Index, "_encode_queries", encode_here)
    index.device = torch.device("cuda", 1)  # what the index believes; its tensors are on the CPU here
    with caplog.at_level(logging.WARNING, logger="memfit_gpu.index.bm25"):
        got = index.search(queries, qmems, k=7, kernels="triton")
    assert calls == ["cuda/triton", "cpu/torch"] and index.device == torch.device("cpu")
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert "out of memory on cuda:1" in caplog.text and "moves to the CPU" in caplog.text
    index.device = torch.device("cpu")
    monkeypatch.setattr(BM25Index, "_search_pairs", lambda *a, **kw: (_ for _ in ()).throw(
        torch.OutOfMemoryError("DefaultCPUAllocator: can't allocate memory")))
    with pytest.raises(torch.OutOfMemoryError):  # on the CPU there is nowhere to go: the error stands
        index.search(queries, qmems, k=7)


# ---------------------------------------------------------------- isolation
@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    data=st.lists(
        st.tuples(st.integers(0, 3), st.lists(st.sampled_from("abcdef"), max_size=6)), min_size=1, max_size=30
    ),
    queries=st.lists(
        st.tuples(st.integers(0, 4), st.lists(st.sampled_from("abcdefg"), max_size=4)), min_size=1, max_size=12
    ),
)
def test_batched_search_equals_per_memory_search(data, queries):
    index = build(BM25Index, [d for _, d in data], [m for m, _ in data])
    row_memory = [m for m, _ in data]
    k = 5
    scores, rows = index.search([q for _, q in queries], [m for m, _ in queries], k)
    for qi, (mem, query) in enumerate(queries):
        own_rows = [r for r, m in enumerate(row_memory) if m == mem]
        got = [r for r in rows[qi].tolist() if r >= 0]
        assert all(row_memory[r] == mem for r in got)  # never a row of another memory
        # the same query against an index holding only this memory
        alone = BM25Index()
        if own_rows:
            alone.add([data[r][1] for r in own_rows], [0] * len(own_rows))
        alone_scores, alone_rows = alone.search([query], [0], k)
        mapped = [own_rows[r] if r >= 0 else -1 for r in alone_rows[0].tolist()]
        assert rows[qi].tolist() == mapped
        torch.testing.assert_close(scores[qi], alone_scores[0])


# ---------------------------------------------------------------- persistence and devices
def test_state_dict_round_trip(tmp_path):
    rng = random.Random(2)
    words = [f"t{i}" for i in range(40)]
    docs = [[rng.choice(words) for _ in range(rng.randint(1, 10))] for _ in range(200)]
    mems = [rng.randrange(3) for _ in docs]
    index = build(BM25Index, docs, mems)
    index.delete([3, 50, 51, 199])
    queries = [[rng.choice(words) for _ in range(3)] for _ in range(30)]
    qmems = [rng.randrange(3) for _ in queries]
    before = index.search(queries, qmems, k=10)
    torch.save(index.state_dict(), tmp_path / "bm25.pt")
    reopened = BM25Index(k1=0.1, b=0.1)  # the state's k1 and b win
    reopened.load_state_dict(torch.load(tmp_path / "bm25.pt", weights_only=True))
    after = reopened.search(queries, qmems, k=10)
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
    assert reopened.idf(queries, qmems) == index.idf(queries, qmems)
    assert reopened.doc_tokens([0, 199]) == index.doc_tokens([0, 199])
    # both keep growing identically
    assert torch.equal(reopened.add([["t1", "t2"]], [1]), index.add([["t1", "t2"]], [1]))
    assert torch.equal(reopened.scores(queries, qmems)[0], index.scores(queries, qmems)[0])
    with pytest.raises(ValueError, match="version"):
        BM25Index().load_state_dict({"version": 99})


def test_to_device_keeps_results():
    index = build(BM25Index, DOCS, [0, 0, 0])
    before = index.search([["a", "c"]], [0], k=3)
    index.to("cpu")
    after = index.search([["a", "c"]], [0], k=3)
    assert torch.equal(before[1], after[1]) and torch.equal(before[0], after[0])
    assert after[0].device == torch.device("cpu")


# ---------------------------------------------------------------- PRF terms from the postings
def _plain_feedback_terms(index, rows, mem, min_chars, terms, order):
    """The reference path's rule: distinct doc tokens, idf desc then token (or alphabetical)."""
    pool = {t for doc in index.doc_tokens(rows) for t in doc if len(t) >= min_chars}
    if order == "alphabetical":
        return sorted(pool)[:terms]
    ordered = sorted(pool)
    idf = dict(zip(ordered, index.idf([ordered], [mem])[0], strict=True)) if ordered else {}
    return sorted(pool, key=lambda t: (-idf[t], t))[:terms]


@pytest.mark.parametrize("cls", BACKENDS)
@pytest.mark.parametrize("order", ["idf", "alphabetical"])
def test_feedback_terms_equal_the_plain_rule(cls, order, scoring_path):
    rng = random.Random(3)
    words = ["alpha", "be", "cedar", "delta", "echo", "fig", "grape", "hazelnut", "ice", "juniper", "kiwi"]
    docs = [[rng.choice(words) for _ in range(rng.randint(0, 9))] for _ in range(160)]
    mems = [rng.randrange(5) for _ in docs]
    index = build(cls, docs, mems)
    deleted = set(rng.sample(range(len(docs)), 20))
    index.delete(sorted(deleted))  # df and N change; deleted rows are not asked for
    live = [r for r in range(len(docs)) if r not in deleted]
    by_memory = {m: [r for r in live if mems[r] == m] for m in range(5)}
    asks = []
    for _ in range(60):
        m = rng.randrange(5)
        asks.append((m, rng.sample(by_memory[m], min(len(by_memory[m]), rng.randint(0, 3)))))
    width = max(len(r) for _, r in asks)
    rows = torch.tensor([r + [-1] * (width - len(r)) for _, r in asks])
    for min_chars, terms in ((1, 12), (4, 3), (5, 1)):
        query, term = index.feedback_terms(rows, min_chars, terms, order)
        got = [[] for _ in asks]
        for q, token in zip(query.tolist(), index.term_tokens(term), strict=True):
            got[q].append(token)
        want = [_plain_feedback_terms(index, r, m, min_chars, terms, order) for m, r in asks]
        assert got == want
        assert terms == 1 or any(len(g) > 1 for g in got)  # real orderings were compared
        # the pairs are the encoded PRF queries: searching them equals searching the tokens
        qm = [m for m, _ in asks]
        by_pairs = index.search_encoded(query, term, qm, k=6)
        by_tokens = index.search(want, qm, k=6)
        assert torch.equal(by_pairs[0], by_tokens[0]) and torch.equal(by_pairs[1], by_tokens[1])


@pytest.mark.parametrize("order", ["idf", "alphabetical"])
def test_feedback_terms_follow_an_index_grown_one_document_at_a_time(order):
    """The token order feedback_terms reads is merged as tokens arrive (not sorted again per write): after
    every small add it equals a sort of the whole vocabulary, and the terms equal the plain rule."""
    rng = random.Random(11)
    letters = "abcdeéz"

    def word() -> str:
        return "".join(rng.choice(letters) for _ in range(rng.randint(1, 6)))

    index = BM25Index()
    mems: list[int] = []
    first = [[word() for _ in range(8)] for _ in range(40)]
    index.add(first, [i % 3 for i in range(40)])
    mems += [i % 3 for i in range(40)]
    merged = 0
    for step in range(60):
        doc = [word() for _ in range(rng.randint(1, 5))]
        mem = rng.randrange(3)
        index.add([doc], [mem])
        mems.append(mem)
        if step % 3:
            continue
        before = len(index._token_rank)
        rows = [r for r in range(len(mems)) if mems[r] == mem][-4:]
        query, term = index.feedback_terms(torch.tensor([rows]), 2, 6, order)
        merged += before > 0 and len(index._token_text) > before
        texts = index._token_text
        assert index._token_rank.tolist() == [sorted(texts).index(t) for t in texts]
        assert index.term_tokens(term) == _plain_feedback_terms(index, rows, mem, 2, 6, order)
        assert query.tolist() == [0] * len(term)
    assert merged >= 5  # the merge (not the whole sort) ran


@pytest.mark.parametrize("order", ["idf", "alphabetical"])
def test_feedback_terms_are_the_same_pairs_on_both_backends(order, scoring_path):
    """Term ids are numbered alike (per (memory, token), first appearance), so the pairs match exactly."""
    rng = random.Random(4)
    words = [f"w{i:02d}x" for i in range(25)]
    docs = [[rng.choice(words) for _ in range(rng.randint(0, 7))] for _ in range(120)]
    mems = [rng.randrange(3) for _ in docs]
    fast, slow = build(BM25Index, docs, mems), build(ReferenceBM25, docs, mems)
    for index in (fast, slow):
        index.delete([1, 7, 30])
    asks = [[r for r in rng.sample(range(len(docs)), 8) if mems[r] == m][:4] for m in (0, 1, 2, 0, 1)]
    rows = torch.tensor([a + [-1] * (4 - len(a)) for a in asks])
    qm = [0, 1, 2, 0, 1]
    pairs_fast = fast.feedback_terms(rows, 1, 5, order)
    pairs_slow = slow.feedback_terms(rows, 1, 5, order)
    assert pairs_fast[0].tolist() == pairs_slow[0].tolist() and pairs_fast[1].tolist() == pairs_slow[1].tolist()
    assert len(set(pairs_fast[0].tolist())) >= 4  # most queries got terms
    assert fast.term_tokens(pairs_fast[1]) == slow.term_tokens(pairs_slow[1])
    fs, fr = fast.search_encoded(*pairs_fast, qm, k=10)
    ss, sr = slow.search_encoded(*pairs_slow, qm, k=10)
    assert torch.equal(fr, sr)
    torch.testing.assert_close(fs, ss, atol=1e-5, rtol=1e-5)


def _term_id(index, row: int, token: str) -> int:
    """The term id of a token of one row, through the public API."""
    query, term = index.feedback_terms(torch.tensor([[row]]), 1, 100, "alphabetical")
    return dict(zip(index.term_tokens(term), term.tolist(), strict=True))[token]


@pytest.mark.parametrize("cls", BACKENDS)
def test_feedback_terms_and_search_encoded_errors(cls):
    index = build(cls, [["apple", "pear"], ["plum"]], [0, 1])
    with pytest.raises(ValueError, match="term_order"):
        index.feedback_terms(torch.tensor([[0]]), 1, 3, "random")
    with pytest.raises(IndexError, match="row 5"):
        index.feedback_terms(torch.tensor([[5]]), 1, 3, "idf")
    empty_q, empty_t = index.feedback_terms(torch.tensor([[-1]]), 1, 3, "idf")
    assert empty_q.numel() == empty_t.numel() == 0
    plum = _term_id(index, 1, "plum")
    assert plum == 2  # (0, apple), (0, pear), (1, plum)
    with pytest.raises(ValueError, match="another memory"):
        index.search_encoded(torch.tensor([0]), torch.tensor([plum]), [0], k=2)
    with pytest.raises(ValueError, match="ascending"):
        index.search_encoded(torch.tensor([1, 0]), torch.tensor([plum, plum]), [1, 1], k=2)
    with pytest.raises(ValueError, match="term id 3 does not exist"):
        index.search_encoded(torch.tensor([0]), torch.tensor([3]), [1], k=2)
    with pytest.raises(ValueError, match="term id -1 does not exist"):
        index.search_encoded(torch.tensor([0]), torch.tensor([-1]), [1], k=2)
    with pytest.raises(ValueError, match="2 query indexes but 1 term ids"):
        index.search_encoded(torch.tensor([0, 0]), torch.tensor([plum]), [1], k=2)
    scores, rows = index.search_encoded(torch.tensor([1]), torch.tensor([plum]), [0, 1], k=2)
    assert rows.tolist() == [[-1, -1], [1, -1]]  # a query without pairs scores nothing


def test_reference_has_no_kernels():
    index = build(ReferenceBM25, DOCS, [0, 0, 0])
    assert not ReferenceBM25.has_kernels and BM25Index.has_kernels
    with pytest.raises(ValueError, match="ReferenceBM25 has no Triton kernels"):
        index.search([["a"]], [0], k=2, kernels="triton")
    with pytest.raises(ValueError, match="ReferenceBM25 has no Triton kernels"):
        index.search_encoded(torch.tensor([0]), torch.tensor([0]), [0], k=2, kernels="triton")
    with pytest.raises(ValueError, match="kernels='cuda' is not one of torch, triton"):
        index.search([["a"]], [0], k=2, kernels="cuda")
    assert index.search([["a"]], [0], k=2, kernels="torch")[1].tolist() == [[0, 1]]


def test_both_backends_implement_the_lexical_protocol():
    members = {name for name in vars(LexicalIndex) if not name.startswith("_")} | set(LexicalIndex.__annotations__)
    assert {"search", "search_encoded", "feedback_terms", "term_tokens", "idf", "doc_tokens", "has_kernels",
            "device", "state_dict"} <= members
    for cls in BACKENDS:
        index = cls()
        assert not [name for name in members if not hasattr(index, name)], cls


def test_reference_state_round_trip_keeps_term_ids(tmp_path):
    index = build(ReferenceBM25, [["apple", "pear"], ["plum", "apple"], ["fig"]], [0, 1, 0])
    index.delete([2])
    torch.save(index.state_dict(), tmp_path / "ref.pt")
    reopened = ReferenceBM25(k1=0.1, b=0.1)
    reopened.load_state_dict(torch.load(tmp_path / "ref.pt", weights_only=True))  # plain values only
    rows = torch.tensor([[0, -1], [1, -1], [2, 0]])
    for a, b in zip(index.feedback_terms(rows, 1, 5, "idf"), reopened.feedback_terms(rows, 1, 5, "idf"), strict=True):
        assert a.tolist() == b.tolist()
    assert reopened.search([["apple"]], [1], k=2)[1].tolist() == index.search([["apple"]], [1], k=2)[1].tolist() == [[1, -1]]
    assert (reopened.k1, reopened.b) == (1.5, 0.75)


# ---------------------------------------------------------------- compact storage
def test_add_texts_equals_add_of_tokenized_texts_and_compact_columns(locomo_path):
    """The store's call (add_texts: tokenised text by text) builds the same state as add(tokenize_many)."""
    episodes, _ = locomo_memories(locomo_path, limit=2)
    texts = [t for conv in episodes for t in conv]
    mems = [m for m, conv in enumerate(episodes) for _ in conv]
    by_texts, by_tokens = BM25Index(), BM25Index()
    for lo in range(0, len(texts), 250):  # several adds: term ids keep their first-appearance numbering
        by_texts.add_texts(texts[lo : lo + 250], mems[lo : lo + 250])
    by_tokens.add(tokenize_many(texts), mems)
    a, b = by_texts.state_dict(), by_tokens.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)
    assert a["post_term"].dtype == torch.int32 and a["post_tf"].dtype == torch.int32
    assert len(a["tokens"]) == len(set(a["tokens"])) < by_texts.num_terms  # one string per token, not per term
    first = tokenize(texts[0])
    assert by_texts.doc_tokens([0]) == [list(dict.fromkeys(first))]
    assert by_texts.term_id(0, first[0]) == 0 and by_texts.term_id(5, first[0]) == -1


def test_sliced_prepare_gives_the_same_layout(monkeypatch, scoring_path):
    """_prepare in slices of 7 postings (a term's postings split across slices, tombstones) = one slice."""
    rng = random.Random(5)
    words = [f"w{i}" for i in range(30)]
    docs = [[rng.choice(words) for _ in range(rng.randint(0, 12))] for _ in range(150)]
    index = build(BM25Index, docs, [rng.randrange(4) for _ in docs])
    index.delete([0, 7, 8, 140])
    whole = {k: v.clone() for k, v in index._prepare().items() if isinstance(v, torch.Tensor)}
    monkeypatch.setattr(postings_module, "PREPARE_SLICE", 7)
    index._cache = None
    sliced = index._prepare()
    assert all(torch.equal(whole[k], sliced[k]) for k in whole)


@pytest.mark.parametrize("slice_postings", [1 << 22, 5])
def test_a_layout_brought_up_to_date_equals_one_laid_out_afresh(monkeypatch, slice_postings):
    """After adds and deletes in some memories (new memories, new terms, a memory emptied, the widest
    memory changing), _prepare lays out again only the changed memories' blocks and copies the others:
    every tensor of its cache equals a first build's, and so do the searches."""
    monkeypatch.setattr(postings_module, "PREPARE_SLICE", slice_postings)
    rng = random.Random(21)
    words = [f"w{i}" for i in range(40)]

    def docs(n: int) -> list[list[str]]:
        return [[rng.choice(words) for _ in range(rng.randint(0, 10))] for _ in range(n)]

    index = BM25Index()
    mems: list[int] = []
    first = docs(120)
    index.add(first, [rng.randrange(4) for _ in first])
    mems += index._row_memory.view.tolist()
    queries = [[rng.choice(words) for _ in range(4)] for _ in range(12)]
    laid_out_again = []
    for step in range(25):
        kind = step % 5
        if kind == 3:
            live = [r for r in range(index.num_rows) if not bool(index._deleted.view[r])]
            index.delete(rng.sample(live, 3))
        elif kind == 4:  # empty one memory's rows entirely, then refill it later
            index.delete([r for r in range(index.num_rows) if mems[r] == 2])
        else:
            batch = docs(rng.randint(1, 4))
            target = [rng.choice([0, 1, 2, 5 + step // 10]) for _ in batch]
            index.add(batch, target)
            mems += target
        laid_out_again.append(len(index._dirty))
        cache = {k: v.clone() for k, v in index._prepare().items()}
        fresh = BM25Index()
        fresh.load_state_dict(index.state_dict())
        again = fresh._prepare()
        assert cache.keys() == again.keys()
        for key in cache:
            assert torch.equal(cache[key], again[key]), key
        qm = [rng.randrange(index.num_memories) for _ in queries]
        got, want = index.search(queries, qm, k=8), fresh.search(queries, qm, k=8)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert 0 < max(laid_out_again) < index.num_memories  # some memories were copied, not laid out again


def test_a_format_1_state_still_loads():
    """Snapshots written before the compact storage hold one token string per term ("terms"): they load, same results."""
    rng = random.Random(6)
    words = [f"t{i}" for i in range(25)]
    docs = [[rng.choice(words) for _ in range(rng.randint(1, 8))] for _ in range(80)]
    mems = [rng.randrange(3) for _ in docs]
    index = build(BM25Index, docs, mems)
    index.delete([4])
    state = index.state_dict()
    old = {k: v for k, v in state.items() if k not in ("tokens", "term_token")}
    old.update(version=1, terms=[state["tokens"][t] for t in state["term_token"].tolist()])
    loaded = BM25Index()
    loaded.load_state_dict(old)
    queries = [[rng.choice(words) for _ in range(3)] for _ in range(20)]
    qmems = [rng.randrange(3) for _ in queries]
    assert all(torch.equal(x, y) for x, y in zip(loaded.search(queries, qmems, 10), index.search(queries, qmems, 10),
                                                strict=True))
    assert loaded.state_dict()["term_token"].tolist() == state["term_token"].tolist()
