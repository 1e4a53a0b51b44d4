"""EpisodeStore with the real MiniLM encoder, real BM25 and real FAISS: columns, one encoder pass,
persistence (reopen, torn tails, append-only bytes), deletion, isolation across memories."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from memfit_gpu.config import MemFitConfig
from memfit_gpu.data.schema import Image, Memory, Session, Turn
from memfit_gpu.index.bm25 import tokenize
from memfit_gpu.store import EpisodeStore, episode_text

pytestmark = pytest.mark.slow  # real model weights (the session's bi_encoder)

MAY, JUNE, JAN = "1:56 pm on 8 May, 2023", "10:37 am on 27 June, 2023", "3 January 2024"


def _turn(turn_id, speaker, text, date, ts, images=()):
    return Turn(turn_id=turn_id, speaker=speaker, text=text, timestamp=ts, date_text=date, images=list(images))


def _memories() -> list[Memory]:
    a1 = [
        _turn("D1:1", "Caroline", "I went to the LGBTQ support group yesterday.", MAY, "2023-05-08T13:56:00"),
        _turn("D1:2", "Melanie", "That's great, Caroline! How did it feel?", MAY, "2023-05-08T13:56:00"),
        _turn("D1:3", "Caroline", "It was powerful.", MAY, "2023-05-08T13:56:00", [Image(caption="a photo of a rainbow flag")]),
    ]
    a2 = [
        _turn("D2:1", "Melanie", "I painted a sunrise by the lake last week.", JUNE, "2023-06-27T10:37:00"),
        _turn("D2:2", "Caroline", "Melanie, that sounds lovely! Send me a picture.", JUNE, "2023-06-27T10:37:00"),
    ]
    b1 = [
        _turn("D1:1", "user", "My cat Luna knocked over the lamp.", JAN, "2024-01-03T00:00:00",
              [Image(caption="a grey cat", image_id="img_7")]),
        _turn("D1:2", "assistant", "Poor lamp! Is Luna okay?", JAN, "2024-01-03T00:00:00"),
    ]
    return [
        Memory("conv-a", [Session("s1", MAY, "2023-05-08T13:56:00", a1), Session("s2", JUNE, "2023-06-27T10:37:00", a2)],
               speakers=["Caroline", "Melanie"]),
        Memory("conv-b", [Session("s1", JAN, "2024-01-03T00:00:00", b1)], speakers=["user", "assistant"]),
    ]


class EncodeSpy:
    """The real encoder, with a record of every encode call (how many passes, how many texts)."""

    def __init__(self, encoder):
        self.encoder = encoder
        self.dim = encoder.dim
        self.calls: list[int] = []

    def encode(self, texts, batch_size=128, progress=False):
        self.calls.append(len(texts))
        return self.encoder.encode(texts, batch_size=batch_size, progress=progress)


def _summarise(prompts: list[str]) -> list[str]:
    """A deterministic summariser: the bullet lines, joined (>= 20 characters for any real segment)."""
    return ["Summary: " + " / ".join(line[2:] for line in p.splitlines() if line.startswith("- ")) for p in prompts]


def test_episode_text_format():
    plain = _turn("D1:1", "Caroline", "Hi!", MAY, "2023-05-08T13:56:00")
    assert episode_text(plain) == "DATE: 1:56 pm on 8 May, 2023 | Speaker Caroline says: Hi!"
    two = _turn("r3", "user", "Look.", JAN, "", [Image(caption="a cat", image_id="img_1"), Image(caption="a dog")])
    assert episode_text(two) == "DATE: 3 January 2024 | Speaker user says: [Image img_1: a cat] [Image: a dog] Look."


def test_columns_and_one_encoder_pass(bi_encoder):
    spy = EncodeSpy(bi_encoder)
    store = EpisodeStore(None, MemFitConfig(), spy)
    bm25_adds, dense_adds = [], []
    for index, calls in ((store.episode_bm25, bm25_adds), (store.episode_dense, dense_adds)):
        real_add = index.add
        index.add = lambda items, memory_idx, real_add=real_add, calls=calls: calls.append(len(items)) or real_add(items, memory_idx)
    rows = store.add_memories(_memories(), progress=False)
    assert rows.tolist() == list(range(7))
    assert spy.calls == [7]  # ONE encoder pass over every new text
    assert bm25_adds == [7] and dense_adds == [7]  # one BM25 add and one dense add for both memories
    assert store.memory_ids == ["conv-a", "conv-b"]
    assert store.speakers == [["Caroline", "Melanie"], ["user", "assistant"]]
    assert store.memory_idx.tolist() == [0, 0, 0, 0, 0, 1, 1]
    assert store.session_idx.tolist() == [0, 0, 0, 1, 1, 2, 2]
    assert store.session_ids == ["s1", "s2", "s1"] and store.session_memory == [0, 0, 1]
    assert store.position.tolist() == [0, 1, 2, 3, 4, 0, 1]
    assert store.turn_id.tolist() == ["D1:1", "D1:2", "D1:3", "D2:1", "D2:2", "D1:1", "D1:2"]
    assert store.speaker_id.tolist() == [0, 1, 0, 1, 0, 0, 1]
    assert store.speaker.tolist() == ["Caroline", "Melanie", "Caroline", "Melanie", "Caroline", "user", "assistant"]
    assert store.timestamp[3] == np.datetime64("2023-06-27T10:37:00")
    assert store.year.tolist() == [2023] * 5 + [2024] * 2
    assert store.month.tolist() == [5, 5, 5, 6, 6, 1, 1]
    assert store.image_ids.tolist() == [(), (), (), (), (), ("img_7",), ()]
    assert store.text[2] == "DATE: 1:56 pm on 8 May, 2023 | Speaker Caroline says: [Image: a photo of a rainbow flag] It was powerful."
    assert store.body(2) == "[Image: a photo of a rainbow flag] It was powerful."
    assert not store.deleted.any()
    assert store.episode_dense.size == store.episode_bm25.num_rows == 7
    # stored vectors are exactly what the encoder gives for the episode texts
    np.testing.assert_allclose(store.episode_dense.vectors([5]), bi_encoder.encode([store.text[5]]).numpy(), atol=1e-5)


def test_indexes_answer_within_their_memory(bi_encoder):
    store = EpisodeStore(None, MemFitConfig(), bi_encoder)
    store.add_memories(_memories(), progress=False)
    _, rows = store.episode_bm25.search([["lamp"], ["lamp"]], [0, 1], k=5)
    assert rows.tolist() == [[-1] * 5, [6, 5, -1, -1, -1]]  # 'lamp' twice in row 6's shorter text... see below
    # row 6 "Poor lamp! Is Luna okay?" is shorter than row 5, so tf=1 scores higher there
    query = bi_encoder.encode(["a painting of the sunrise over a lake"])
    _, rows = store.episode_dense.search(query.repeat(2, 1), [0, 1], k=1)
    assert rows[0, 0].item() == 3 and store.memory_idx[rows[1, 0].item()] == 1


def _search_all(store: EpisodeStore, bi_encoder, queries: list[str], memories: list[int]):
    vectors = bi_encoder.encode(queries)
    bm25 = store.episode_bm25.search([tokenize(q) for q in queries], memories, k=10)
    dense = store.episode_dense.search(vectors, memories, k=10)
    return bm25, dense


QUERIES = ["Caroline support group", "lake sunrise painting", "Luna the cat", "how did it feel"]


def test_reopen_gives_identical_indexes_and_replays_the_log_tail(tmp_path, bi_encoder):
    cfg = MemFitConfig()
    store = EpisodeStore(tmp_path, cfg, bi_encoder)
    store.add_memories(_memories(), progress=False)
    memories = [0, 0, 1, 0]
    before = _search_all(store, bi_encoder, QUERIES, memories)
    store.close()

    spy = EncodeSpy(bi_encoder)
    reopened = EpisodeStore(tmp_path, cfg, spy)
    assert spy.calls == []  # the snapshot covers everything: nothing re-encoded
    after = _search_all(reopened, bi_encoder, QUERIES, memories)
    for x, y in zip(before, after, strict=True):
        assert torch.equal(x[0], y[0]) and torch.equal(x[1], y[1])
    assert reopened.text.tolist() == store.text.tolist() and reopened.speaker_id.tolist() == store.speaker_id.tolist()

    # a live turn: logged, not snapshotted; the process "dies" (no close) and the next open replays it
    row = reopened.append_turn("conv-b", _turn("D2:1", "user", "Luna is fine, she sleeps on the lamp now.", JAN, "2024-01-03T00:00:00"))
    assert row == 7
    live = _search_all(reopened, bi_encoder, QUERIES + ["lamp"], memories + [1])
    spy.calls.clear()
    third = EpisodeStore(tmp_path, cfg, spy)
    assert spy.calls == [1]  # only the turn after the snapshot is re-encoded
    replayed = _search_all(third, bi_encoder, QUERIES + ["lamp"], memories + [1])
    for x, y in zip(live, replayed, strict=True):
        assert torch.equal(x[1], y[1])
        torch.testing.assert_close(x[0], y[0], rtol=1e-5, atol=1e-6)
    # session_id None names the session by the turn's date text: a new session (global number 3), not "s1"
    assert third.position[7] == 2 and third.session_idx[7] == 3
    assert third.session_ids[3] == JAN and third.session_memory[3] == 1


def test_appending_never_rewrites_existing_bytes(tmp_path, bi_encoder):
    store = EpisodeStore(tmp_path, MemFitConfig(), bi_encoder)
    log_path = Path(tmp_path) / "log.jsonl"
    memories = _memories()
    store.add_memories(memories[:1], progress=False)
    first = log_path.read_bytes()
    store.add_memories(memories[1:], progress=False)
    second = log_path.read_bytes()
    store.append_turn("conv-a", _turn("D3:1", "Melanie", "Back from camping!", JUNE, "2023-06-28T09:00:00"))
    third = log_path.read_bytes()
    store.delete_episode("conv-a", "D1:1")
    fourth = log_path.read_bytes()
    assert len(first) < len(second) < len(third) < len(fourth)
    assert second.startswith(first) and third.startswith(second) and fourth.startswith(third)


def _store_with_live_turn(path, bi_encoder) -> tuple[EpisodeStore, bytes]:
    store = EpisodeStore(path, MemFitConfig(), bi_encoder)
    store.add_memories(_memories(), progress=False)
    good = (Path(path) / "log.jsonl").read_bytes()
    store.append_turn("conv-a", _turn("D3:1", "Melanie", "Back from camping!", JUNE, "2023-06-28T09:00:00"))
    return store, good


def test_torn_tail_is_dropped_with_a_warning_and_later_appends_are_clean(tmp_path, bi_encoder, caplog):
    store, good = _store_with_live_turn(tmp_path, bi_encoder)
    log_path = Path(tmp_path) / "log.jsonl"
    full = log_path.read_bytes()
    torn_at = len(good) + (len(full) - len(good)) // 2  # the killed process wrote half the last record
    log_path.write_bytes(full[:torn_at])
    with caplog.at_level(logging.WARNING, logger="memfit_gpu.store.log"):
        reopened = EpisodeStore(tmp_path, MemFitConfig(), bi_encoder)
    dropped = torn_at - len(good)
    assert f"dropping the last {dropped} bytes (1 partial or corrupt record line)" in caplog.text
    assert log_path.read_bytes() == good  # truncated back to the last good record
    assert reopened.size == 7 and reopened.turn_id.tolist()[-1] == "D1:2"
    row = reopened.append_turn("conv-a", _turn("D3:1", "Melanie", "Back from camping!", JUNE, "2023-06-28T09:00:00"))
    assert row == 7
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="memfit_gpu.store.log"):
        again = EpisodeStore(tmp_path, MemFitConfig(), bi_encoder)
    assert "dropping" not in caplog.text
    assert again.size == 8 and again.body(7) == "Back from camping!"
    _, rows = again.episode_bm25.search([["camping"]], [0], k=3)
    assert rows[0, 0].item() == 7


def test_garbage_after_the_last_record_is_dropped(tmp_path, bi_encoder, caplog):
    store, _ = _store_with_live_turn(tmp_path, bi_encoder)
    log_path = Path(tmp_path) / "log.jsonl"
    full = log_path.read_bytes()
    log_path.write_bytes(full + b"garbage\nmore garbage")
    with caplog.at_level(logging.WARNING, logger="memfit_gpu.store.log"):
        reopened = EpisodeStore(tmp_path, MemFitConfig(), bi_encoder)
    assert "malformed header" in caplog.text
    assert "dropping the last 20 bytes (2 partial or corrupt record lines)" in caplog.text
    assert log_path.read_bytes() == full
    assert reopened.size == 8  # nothing before the garbage is lost


def test_truncation_inside_the_snapshot_falls_back_to_a_full_replay(tmp_path, bi_encoder, caplog):
    store = EpisodeStore(tmp_path, MemFitConfig(), bi_encoder)
    store.add_memories(_memories(), progress=False)
    store.close()
    log_path = Path(tmp_path) / "log.jsonl"
    full = log_path.read_bytes()
    log_path.write_bytes(full[:-5])  # the last episode record (covered by the snapshot) is torn
    with caplog.at_level(logging.WARNING):
        reopened = EpisodeStore(tmp_path, MemFitConfig(), bi_encoder)
    assert "do not match the log" in caplog.text
    assert reopened.size == 6 and reopened.episode_dense.size == 6 and reopened.episode_bm25.num_rows == 6


def test_delete_episode_leaves_both_indexes_and_rebuilds_its_summary(tmp_path, bi_encoder):
    cfg = MemFitConfig()
    store = EpisodeStore(tmp_path, cfg, bi_encoder)
    store.add_memories(_memories(), progress=False)
    assert store.build_summaries(_summarise, progress=False) == 1  # conv-a: 5 turns = 1 segment; conv-b: 2 < 3
    old = store.summaries[0]
    assert old.members.tolist() == [0, 1, 2, 3, 4] and old.memory_idx == 0
    n_before, avgdl_before = store.episode_bm25.memory_stats(0)
    lengths = [len(tokenize(t)) for t in store.text[:5]]
    assert (n_before, avgdl_before) == (5, pytest.approx(sum(lengths) / 5))

    prompts_seen: list[str] = []

    def generate(prompts):
        prompts_seen.extend(prompts)
        return _summarise(prompts)

    deleted_text = store.text[1]
    store.delete_episode("conv-a", "D1:2", generate=generate)
    assert store.deleted.tolist() == [False, True, False, False, False, False, False]
    n_after, avgdl_after = store.episode_bm25.memory_stats(0)
    assert (n_after, avgdl_after) == (4, pytest.approx((sum(lengths) - lengths[1]) / 4))
    assert store.episode_bm25.memory_stats(1) == (2, pytest.approx(np.mean([len(tokenize(t)) for t in store.text[5:]])))
    # never returned again, by either index, even for its own text
    _, bm25_rows = store.episode_bm25.search([tokenize(deleted_text)], [0], k=10)
    _, dense_rows = store.episode_dense.search(bi_encoder.encode([deleted_text]), [0], k=10, min_score=-1.0)
    assert 1 not in bm25_rows[0].tolist() and 1 not in dense_rows[0].tolist()
    assert sorted(dense_rows[0][dense_rows[0] >= 0].tolist()) == [0, 2, 3, 4]
    # the summary: old retired, new one over the remaining members, with provenance
    assert len(prompts_seen) == 1 and "How did it feel" not in prompts_seen[0]
    assert store.summaries.deleted.view.tolist() == [True, False]
    new = store.summaries[1]
    assert new.members.tolist() == [0, 2, 3, 4] and new.replaces == 0
    assert new.event_time == np.datetime64("2023-05-08T13:56:00") and new.recorded_time == np.datetime64("2023-06-27T10:37:00")
    _, summary_rows = store.summary_bm25.search([tokenize("Caroline support group")], [0], k=5)
    assert summary_rows[0].tolist() == [1, -1, -1, -1, -1]
    with pytest.raises(KeyError, match="no live turn 'D1:2'"):
        store.delete_episode("conv-a", "D1:2")
    # and the deletion survives a reopen
    store.close()
    reopened = EpisodeStore(tmp_path, cfg, bi_encoder)
    assert reopened.deleted.tolist() == store.deleted.tolist()
    assert reopened.episode_bm25.memory_stats(0) == (4, pytest.approx(avgdl_after))
    assert [s.deleted for s in reopened.summaries] == [True, False]


def test_delete_without_generate_retires_the_summary(bi_encoder, caplog):
    store = EpisodeStore(None, MemFitConfig(), bi_encoder)
    store.add_memories(_memories(), progress=False)
    store.build_summaries(_summarise, progress=False)
    with caplog.at_level(logging.WARNING):
        store.delete_episode("conv-a", "D2:1")
    assert "no generate callable" in caplog.text
    assert store.summaries.live_rows().tolist() == []
    _, rows = store.summary_dense.search(store.summary_dense.vectors([0]), [0], k=3)
    assert rows[0].tolist() == [-1, -1, -1]


def test_batched_search_equals_per_memory_search_on_random_memories(bi_encoder):
    """Isolation property: many memories in one store, queries batched across them."""
    rng = np.random.default_rng(7)
    words = ("lake sunrise painting cat lamp group support camping hiking guitar piano school job "
             "interview dog park birthday cake trip paris book novel garden roses").split()
    memories = []
    for m in range(6):
        turns = [
            _turn(f"D1:{i}", rng.choice(["Ann", "Bo"]), " ".join(rng.choice(words, size=rng.integers(1, 7))), MAY,
                  "2023-05-08T13:56:00")
            for i in range(int(rng.integers(1, 20)))
        ]
        memories.append(Memory(f"m{m}", [Session("s1", MAY, "2023-05-08T13:56:00", turns)], speakers=["Ann", "Bo"]))
    store = EpisodeStore(None, MemFitConfig(), bi_encoder)
    store.add_memories(memories, progress=False)
    doomed = rng.choice(store.size, size=5, replace=False)
    for row in doomed:
        store.delete_episode(store.memory_ids[store.memory_idx[row]], store.turn_id[row])
    queries = [" ".join(rng.choice(words, size=rng.integers(1, 4))) for _ in range(24)]
    query_memory = rng.integers(0, 6, size=24)
    vectors = bi_encoder.encode(queries)
    tokens = [tokenize(q) for q in queries]
    bm25_scores, bm25_rows = store.episode_bm25.search(tokens, query_memory, k=8)
    dense_scores, dense_rows = store.episode_dense.search(vectors, query_memory, k=8)
    for q in range(24):
        s, r = store.episode_bm25.search([tokens[q]], [query_memory[q]], k=8)
        assert torch.equal(r[0], bm25_rows[q]) and torch.allclose(s[0], bm25_scores[q])
        s, r = store.episode_dense.search(vectors[q : q + 1], [query_memory[q]], k=8)
        assert torch.equal(r[0], dense_rows[q]) and torch.allclose(s[0], dense_scores[q])
        for rows in (bm25_rows[q], dense_rows[q]):
            found = rows[rows >= 0].numpy()
            assert (store.memory_idx[found] == query_memory[q]).all()
            assert not store.deleted[found].any()
        # dense: exact cosine against the memory's live rows, top 8 with score > 0
        live = store.memory_rows(int(query_memory[q]))
        cosines = store.episode_dense.vectors(live) @ vectors[q].numpy()
        order = [int(live[i]) for i in np.lexsort((live, -cosines)) if cosines[i] > 0][:8]
        assert dense_rows[q][: len(order)].tolist() == order
    assert math.isclose(float(dense_scores[0, 0]), float(store.episode_dense.vectors([int(dense_rows[0, 0])])[0] @ vectors[0].numpy()), rel_tol=1e-5)


def test_appending_to_existing_memories_and_late_speakers(bi_encoder):
    store = EpisodeStore(None, MemFitConfig(), bi_encoder)
    store.add_memories(_memories(), progress=False)
    more = Memory("conv-a", [Session("s3", "9 July 2023", "2023-07-09T12:00:00", [
        _turn("D3:1", "Jon", "Caroline and Melanie, meet me at the studio.", "9 July 2023", "2023-07-09T12:00:00"),
    ])], speakers=["Caroline", "Melanie", "Jon"])
    assert store.add_memories([more], progress=False).tolist() == [7]
    assert store.speakers[0] == ["Caroline", "Melanie", "Jon"]
    assert (store.memory_idx[7], store.position[7], store.speaker_id[7]) == (0, 5, 2)
    # a speaker first seen in a live turn gets the next id of its memory
    store.append_turn("conv-b", _turn("D2:1", "Luna", "Meow.", JAN, "2024-01-04T00:00:00"))
    assert store.speakers[1] == ["user", "assistant", "Luna"]
    assert store.speaker_id[[5, 6, 8]].tolist() == [0, 1, 2]
