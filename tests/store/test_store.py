"""EpisodeStore with the real MiniLM encoder, real BM25 and real FAISS: columns, one encoder pass,
persistence (reopen, torn tails, append-only bytes), deletion, isolation across memories."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from memfit_gpu.config import MemFitConfig
from memfit_gpu.data.schema import Image, Memory, Session, Turn
from memfit_gpu.files import read_jsonl
from memfit_gpu.index.tokenize import tokenize
from memfit_gpu.retrieve.view import ReadView
from memfit_gpu.store import EpisodeStore, compaction, episode_text
from memfit_gpu.store.episodes import StoreClosedError
from memfit_gpu.store.log import StoreCorruptError
from memfit_gpu.store.repair import repair_store
from memfit_gpu.store.snapshot import meta_digest

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
    # the store gives BM25Index its texts (add_texts tokenises them as it indexes) and DenseIndex its vectors
    for index, method, calls in ((store.episode_bm25, "add_texts", bm25_adds), (store.episode_dense, "add", dense_adds)):
        real_add = getattr(index, method)
        setattr(index, method, lambda items, memory_idx, real_add=real_add, calls=calls:
                calls.append(len(items)) or real_add(items, memory_idx))
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
    years, months = ReadView.from_store(store).ep_year_month  # what the boosts read
    assert years.tolist() == [2023] * 5 + [2024] * 2
    assert months.tolist() == [5, 5, 5, 6, 6, 1, 1]
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
    assert f"torn last record (record cut short) at byte {len(good)}" in caplog.text
    assert f"dropping its {dropped} bytes" in caplog.text
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


@pytest.mark.parametrize("cut", ["at a record", "inside a record"])
def test_a_log_that_lost_acknowledged_records_is_refused_not_opened_smaller(tmp_path, bi_encoder, cut):
    """A log cut back below what a snapshot covers (an older copy put back, a lost write-back) opened as a smaller
    store with a warning, and the next snapshots pruned the only trace of the loss. A snapshot is written after
    the records it covers were committed, and an fsynced log keeps those through any crash, so it is refused now,
    the log and the snapshots as they were. (A log without fsync may lose them to an OS crash: the torn-commit
    test below opens it.)"""
    cfg = MemFitConfig()
    cfg.store.fsync = True  # every live memory's log (an add is durable when it returns)
    store = EpisodeStore(tmp_path, cfg, bi_encoder)
    store.add_memories(_memories(), progress=False)
    good = (Path(tmp_path) / "log.jsonl").read_bytes()
    store.append_turn("conv-a", _turn("D3:1", "Melanie", "Back from camping!", JUNE, "2023-06-28T09:00:00"))
    store.close()  # the live turn committed and snapshotted
    log_path = Path(tmp_path) / "log.jsonl"
    full = log_path.read_bytes()
    log_path.write_bytes(good if cut == "at a record" else full[:len(good) + 10])
    snapshots = Path(tmp_path) / "snapshots"
    before = sorted(p.name for p in snapshots.iterdir())
    with pytest.raises(StoreCorruptError, match=r"log\.jsonl: holds (\d+) committed records, while .*snapshots/(\d+) "
                                                r"\(its checksums intact\) covers \d+: records the store had "
                                                r"acknowledged are missing from the log") as info:
        EpisodeStore(tmp_path, cfg, bi_encoder)
    held, widest = (int(n) for n in re.search(r"holds (\d+) .*snapshots/(\d+) ", str(info.value)).groups())
    assert held < widest == max(int(name) for name in before)
    # (a record cut in half is no record: its bytes go, as a torn tail's)
    assert log_path.read_bytes() == good and sorted(p.name for p in snapshots.iterdir()) == before
    # the way out the message names: the log put back opens whole; or the wider snapshots removed, the smaller store
    log_path.write_bytes(full)
    assert EpisodeStore(tmp_path, cfg, bi_encoder).size == 8
    log_path.write_bytes(good)
    for folder in snapshots.iterdir():
        if int(folder.name) > held:
            shutil.rmtree(folder)
    assert EpisodeStore(tmp_path, cfg, bi_encoder).size == 7


def test_garbage_after_the_last_record_is_an_error_and_nothing_is_rewritten(tmp_path, bi_encoder):
    store, _ = _store_with_live_turn(tmp_path, bi_encoder)
    store.close()
    log_path = Path(tmp_path) / "log.jsonl"
    damaged = log_path.read_bytes() + b"garbage\nmore garbage"
    log_path.write_bytes(damaged)
    snapshots = sorted(p.name for p in (Path(tmp_path) / "snapshots").iterdir())
    with pytest.raises(StoreCorruptError, match=r"log\.jsonl, item record \d+ \(line \d+, byte \d+\): malformed header"):
        EpisodeStore(tmp_path, MemFitConfig(), bi_encoder)
    assert log_path.read_bytes() == damaged
    assert sorted(p.name for p in (Path(tmp_path) / "snapshots").iterdir()) == snapshots


def test_a_torn_commit_drops_its_whole_batch_and_the_batch_can_be_written_again(tmp_path, bi_encoder, caplog):
    """The last five bytes of the log belong to the commit record of add_memories' batch: without it the
    batch never happened, so neither memory is half stored, and storing the memories again gives the store
    an uninterrupted build gives."""
    cfg = MemFitConfig()
    store = EpisodeStore(tmp_path, cfg, bi_encoder)
    header = (Path(tmp_path) / "log.jsonl").read_bytes()
    store.add_memories(_memories(), progress=False)
    memories = [0, 0, 1, 0]
    before = _search_all(store, bi_encoder, QUERIES, memories)
    store.close()
    log_path = Path(tmp_path) / "log.jsonl"
    full = log_path.read_bytes()
    assert full.endswith(b'{"t":"commit","records":9}\n')  # 2 memory records + 7 episodes
    log_path.write_bytes(full[:-5])
    with caplog.at_level(logging.WARNING):
        reopened = EpisodeStore(tmp_path, cfg, bi_encoder)
    assert "the last 9 records are a write batch that was never committed" in caplog.text
    assert "do not match the log" in caplog.text  # the batch's snapshot is stale
    assert reopened.size == 0 and reopened.memory_ids == [] and log_path.read_bytes() == header
    assert reopened.add_memories(_memories(), progress=False).tolist() == list(range(7))
    assert log_path.read_bytes() == full
    after = _search_all(reopened, bi_encoder, QUERIES, memories)
    for x, y in zip(before, after, strict=True):
        assert torch.equal(x[0], y[0]) and torch.equal(x[1], y[1])


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


# ---------------------------------------------------------------------------------------------- snapshots


def _flip_vector_bit(vectors_path: Path, rows: int, row: int) -> None:
    """Flip an exponent bit of one float of `row` in a [rows, 384] float32 .npy (a huge change, not a subtle one)."""
    data = bytearray(vectors_path.read_bytes())
    start = len(data) - rows * 384 * 4
    data[start + (row * 384 + 5) * 4 + 3] ^= 0x40
    vectors_path.write_bytes(bytes(data))


def _flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def _newest_snapshot(path) -> Path:
    return sorted((Path(path) / "snapshots").iterdir())[-1]


@pytest.mark.parametrize("damage", ["vectors", "bm25", "meta", "missing"])
def test_a_damaged_snapshot_is_never_loaded_and_the_rebuilt_store_is_identical(tmp_path, bi_encoder, caplog, damage):
    cfg = MemFitConfig()
    store = EpisodeStore(tmp_path, cfg, bi_encoder)
    store.add_memories(_memories(), progress=False)
    store.close()
    memories = [0, 0, 1, 0]
    clean = _search_all(EpisodeStore(tmp_path, cfg, bi_encoder), bi_encoder, QUERIES, memories)
    snapshot = _newest_snapshot(tmp_path)
    if damage == "vectors":
        _flip_vector_bit(snapshot / "episode_dense" / "vectors.npy", rows=7, row=3)
        message = "episode_dense/vectors.npy fails its sha256"
    elif damage == "bm25":
        _flip_byte(snapshot / "episode_bm25.pt", 200)
        message = "episode_bm25.pt fails its sha256"
    elif damage == "meta":
        (snapshot / "meta.json").write_text((snapshot / "meta.json").read_text().replace('"episodes": 7', '"episodes": 8'))
        message = "meta.json: fails its own sha256"
    else:
        (snapshot / "summary_dense" / "deleted.npy").unlink()
        message = "summary_dense/deleted.npy is missing"

    spy = EncodeSpy(bi_encoder)
    with caplog.at_level(logging.WARNING):
        reopened = EpisodeStore(tmp_path, cfg, spy)
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and message in errors[0].getMessage() and "never loaded" in errors[0].getMessage()
    assert "re-encoding 7 texts" in caplog.text
    assert spy.calls == [7]  # rebuilt from the log, in one pass like the first build
    for x, y in zip(clean, _search_all(reopened, bi_encoder, QUERIES, memories), strict=True):
        assert torch.equal(x[0], y[0]) and torch.equal(x[1], y[1])
    # the rebuild wrote a fresh snapshot: the next open encodes nothing and loads the same indexes
    spy.calls.clear()
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        third = EpisodeStore(tmp_path, cfg, spy)
    assert spy.calls == [] and caplog.text == ""
    for x, y in zip(clean, _search_all(third, bi_encoder, QUERIES, memories), strict=True):
        assert torch.equal(x[0], y[0]) and torch.equal(x[1], y[1])


UNPICKLED: list[str] = []


def _record_unpickling() -> str:
    UNPICKLED.append("a pickled callable ran")
    return "ran"


class _PickledCode:
    """What a tampered snapshot could hold: unpickling it calls a function."""

    def __reduce__(self):
        return (_record_unpickling, ())


def test_a_snapshot_holding_pickled_code_is_never_unpickled(tmp_path, bi_encoder, caplog):
    """BM25 state files are read with torch.load(weights_only=True): a file whose checksums hold (rewritten
    with its meta.json) but that holds a pickled object is refused, not run, and the store is rebuilt."""
    cfg = MemFitConfig()
    store = EpisodeStore(tmp_path, cfg, bi_encoder)
    store.add_memories(_memories(), progress=False)
    store.close()
    memories = [0, 0, 1, 0]
    clean = _search_all(EpisodeStore(tmp_path, cfg, bi_encoder), bi_encoder, QUERIES, memories)
    snapshot = _newest_snapshot(tmp_path)
    bm25_path = snapshot / "episode_bm25.pt"
    state = torch.load(bm25_path, weights_only=True)
    torch.save({**state, "note": _PickledCode()}, bm25_path)
    meta = json.loads((snapshot / "meta.json").read_text())
    meta["files"]["episode_bm25.pt"] = hashlib.sha256(bm25_path.read_bytes()).hexdigest()
    meta["meta_sha256"] = meta_digest(meta)
    (snapshot / "meta.json").write_text(json.dumps(meta, indent=1))

    UNPICKLED.clear()
    spy = EncodeSpy(bi_encoder)
    with caplog.at_level(logging.WARNING):
        reopened = EpisodeStore(tmp_path, cfg, spy)
    assert UNPICKLED == []
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "holds more than tensors and plain values" in errors[0] and "never loaded" in errors[0]
    assert spy.calls == [7]  # rebuilt from the log
    for x, y in zip(clean, _search_all(reopened, bi_encoder, QUERIES, memories), strict=True):
        assert torch.equal(x[0], y[0]) and torch.equal(x[1], y[1])


def test_a_damaged_newest_snapshot_falls_back_to_the_one_before(tmp_path, bi_encoder, caplog):
    cfg = MemFitConfig()
    store = EpisodeStore(tmp_path, cfg, bi_encoder)
    store.add_memories(_memories(), progress=False)  # snapshot 1
    store.add_memories([Memory("conv-c", [Session("s1", JAN, "2024-01-03T00:00:00", [
        _turn("D1:1", "Ann", "I adopted a tortoise called Speedy.", JAN, "2024-01-03T00:00:00"),
    ])], speakers=["Ann"])], progress=False)  # snapshot 2
    store.close()
    memories = [0, 0, 1, 2]
    clean = _search_all(EpisodeStore(tmp_path, cfg, bi_encoder), bi_encoder, QUERIES, memories)
    _flip_vector_bit(_newest_snapshot(tmp_path) / "episode_dense" / "vectors.npy", rows=8, row=7)
    spy = EncodeSpy(bi_encoder)
    with caplog.at_level(logging.WARNING):
        reopened = EpisodeStore(tmp_path, cfg, spy)
    assert "episode_dense/vectors.npy fails its sha256" in caplog.text
    assert spy.calls == [1]  # the older snapshot covers the first 7 turns: only the tortoise is encoded again
    after = _search_all(reopened, bi_encoder, QUERIES, memories)
    for x, y in zip(clean, after, strict=True):
        assert torch.equal(x[1], y[1])
        torch.testing.assert_close(x[0], y[0], rtol=1e-5, atol=1e-6)  # one turn encoded alone, not in its batch


def test_a_store_without_usable_snapshot_is_snapshotted_after_its_rebuild(tmp_path, bi_encoder):
    cfg = MemFitConfig()
    store, _ = _store_with_live_turn(tmp_path, bi_encoder)  # the live turn is logged, not snapshotted
    del store  # killed: no close
    spy = EncodeSpy(bi_encoder)
    EpisodeStore(tmp_path, cfg, spy)
    assert spy.calls == [1]
    spy.calls.clear()
    EpisodeStore(tmp_path, cfg, spy)
    assert spy.calls == []  # replayed once, then snapshotted
    shutil.rmtree(Path(tmp_path) / "snapshots")
    EpisodeStore(tmp_path, cfg, spy)
    assert spy.calls == [8]
    spy.calls.clear()
    reopened = EpisodeStore(tmp_path, cfg, spy)
    assert spy.calls == [] and reopened.size == 8


def test_a_snapshot_of_the_older_format_is_not_trusted(tmp_path, bi_encoder, caplog):
    """Format-1 snapshots have no checksums: a store written before them is rebuilt once, then snapshotted."""
    cfg = MemFitConfig()
    store = EpisodeStore(tmp_path, cfg, bi_encoder)
    store.add_memories(_memories(), progress=False)
    store.close()
    meta_path = _newest_snapshot(tmp_path) / "meta.json"
    meta_path.write_text(meta_path.read_text().replace('"format": 2', '"format": 1'))
    spy = EncodeSpy(bi_encoder)
    with caplog.at_level(logging.WARNING):
        EpisodeStore(tmp_path, cfg, spy)
    assert "snapshot format 1 has no checksums" in caplog.text and spy.calls == [7]
    spy.calls.clear()
    EpisodeStore(tmp_path, cfg, spy)
    assert spy.calls == []


# ---------------------------------------------------------------------------------------------- compaction


def _store_with_deletion(path, bi_encoder) -> tuple[EpisodeStore, str, bytes, list[bytes]]:
    """conv-a with its summary, one turn deleted and the summary rebuilt. Returns the store, the deleted
    text, the deleted vector's bytes, and the retired summary's text and vector bytes."""
    store = EpisodeStore(path, MemFitConfig(), bi_encoder)
    store.add_memories(_memories(), progress=False)
    store.build_summaries(_summarise, progress=False)
    text = store.text[1]
    vector = store.episode_dense.vectors([1]).tobytes()
    retired = [store.summaries.text[0].encode(), store.summary_dense.vectors([0]).tobytes()]
    store.delete_episode("conv-a", "D1:2", generate=_summarise)
    return store, text, vector, retired


def _keyed(store: EpisodeStore, bi_encoder, queries: list[str], memories: list[int]):
    """Search results with rows named by (memory id, turn id): comparable across row numberings."""
    out = []
    for scores, rows in _search_all(store, bi_encoder, queries, memories):
        names = [[None if r < 0 else (store.memory_ids[store.memory_idx[r]], store.turn_id[r]) for r in row]
                 for row in rows.tolist()]
        out.append((scores, names))
    vectors = bi_encoder.encode(queries)
    for index, query in ((store.summary_bm25, [tokenize(q) for q in queries]), (store.summary_dense, vectors)):
        scores, rows = index.search(query, memories, k=3)
        out.append((scores, [[None if r < 0 else store.summaries.text[r] for r in row] for row in rows.tolist()]))
    return out


def _files_containing(root: Path, needle: bytes) -> list[str]:
    return [str(p) for p in sorted(root.rglob("*")) if p.is_file() and needle in p.read_bytes()]


def test_compact_forgets_deleted_turns_everywhere_and_searches_the_same(tmp_path, bi_encoder):
    cfg = MemFitConfig()
    root = Path(tmp_path) / "store"
    store, text, vector, retired = _store_with_deletion(root, bi_encoder)
    assert _files_containing(root, text.encode()) and _files_containing(root, vector)  # before: in the log and snapshot
    memories = [0, 0, 1, 0]
    before = _keyed(store, bi_encoder, QUERIES, memories)
    live_turns = store.turn_id[~store.deleted].tolist()
    counts = store.compact()
    assert counts == {"records_before": 18, "episodes_before": 7, "summaries_before": 2, "memories_before": 2,
                      "records_after": 12, "episodes_after": 6, "summaries_after": 1, "memories_after": 2}
    assert store.erased == []  # both memories keep turns: none is gone
    assert sorted(p.name for p in Path(tmp_path).iterdir()) == ["store"]  # nothing left beside it
    for needle in (text.encode(), text.split(" says: ")[1].encode(), vector, *retired):
        assert _files_containing(root, needle) == []

    spy = EncodeSpy(bi_encoder)
    reopened = EpisodeStore(root, cfg, spy)
    assert spy.calls == []  # the compacted store comes with its snapshot
    assert reopened.size == 6 and not reopened.deleted.any() and reopened.turn_id.tolist() == live_turns
    assert reopened.position.tolist() == [0, 1, 2, 3, 0, 1]
    assert len(reopened.summaries) == 1 and reopened.summaries[0].members.tolist() == [0, 1, 2, 3]
    assert reopened.summaries[0].replaces == -1
    after = _keyed(reopened, bi_encoder, QUERIES, memories)
    for (x_scores, x_names), (y_scores, y_names) in zip(before, after, strict=True):
        assert x_names == y_names and torch.equal(x_scores, y_scores)
    # the compacted store takes new work like any other
    assert reopened.append_turn("conv-a", _turn("D3:1", "Melanie", "Back from camping!", JUNE, "2023-06-28T09:00:00")) == 6


def _fail_at(monkeypatch, point: str) -> None:
    """Provoke a kill at one step of compact(): raise there, leaving the disk as a killed process would."""
    class Killed(RuntimeError):
        pass

    if point == "building":
        monkeypatch.setattr(compaction, "fsync_tree", lambda root: (_ for _ in ()).throw(Killed(point)))
        return
    real = compaction.rename_durably
    calls = []

    def rename(source, target):
        calls.append(source)
        if point == "first rename" and len(calls) == 1:
            raise Killed(point)
        real(source, target)
        if point == "between renames" and len(calls) == 1 or point == "after renames" and len(calls) == 2:
            raise Killed(point)

    monkeypatch.setattr(compaction, "rename_durably", rename)


@pytest.mark.parametrize("point,compacted", [("building", False), ("first rename", False),
                                              ("between renames", True), ("after renames", True)])
def test_compact_killed_at_any_step_leaves_the_old_or_the_new_store(tmp_path, bi_encoder, monkeypatch, caplog,
                                                                     point, compacted):
    cfg = MemFitConfig()
    root = Path(tmp_path) / "store"
    store, text, _, _ = _store_with_deletion(root, bi_encoder)
    memories = [0, 0, 1, 0]
    before = _keyed(store, bi_encoder, QUERIES, memories)
    _fail_at(monkeypatch, point)
    with pytest.raises(RuntimeError, match=point):
        store.compact()
    monkeypatch.undo()
    spy = EncodeSpy(bi_encoder)
    with caplog.at_level(logging.WARNING):
        reopened = EpisodeStore(root, cfg, spy)
    assert spy.calls == []
    assert sorted(p.name for p in Path(tmp_path).iterdir()) == ["store"]
    assert reopened.size == (6 if compacted else 7) and bool(_files_containing(root, text.encode())) is not compacted
    for (x_scores, x_names), (y_scores, y_names) in zip(before, _keyed(reopened, bi_encoder, QUERIES, memories),
                                                        strict=True):
        assert x_names == y_names and torch.equal(x_scores, y_scores)
    if not compacted:  # compacting again finishes the job
        reopened.compact()
        assert _files_containing(root, text.encode()) == [] and EpisodeStore(root, cfg, bi_encoder).size == 6


def test_compact_of_an_in_memory_store_is_an_error(bi_encoder):
    with pytest.raises(ValueError, match="in-memory store has nothing on disk"):
        EpisodeStore(None, MemFitConfig(), bi_encoder).compact()


def _folder_bytes(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(Path(path).rglob("*")) if p.is_file()}


def test_a_store_opened_to_read_changes_no_byte_and_refuses_what_a_writer_would_mend(tmp_path, bi_encoder):
    """`memfit retrieve --store` reads another run's store: it opened it to write, so a log whose last commit
    was cut short had its last batch dropped (12 committed, snapshotted episodes gone from the log) and a new
    snapshot written, before the run failed anyway. Opened to read, the folder is never changed: a clean store
    reads as a writer would, and what a writer would mend is refused, saying what to run."""
    store, _ = _store_with_live_turn(tmp_path, bi_encoder)
    store.snapshot()
    store.close()
    before = _folder_bytes(tmp_path)
    reader = EpisodeStore(tmp_path, MemFitConfig(), bi_encoder, read_only=True)
    assert reader.size == 8 and reader.body(7) == "Back from camping!" and _folder_bytes(tmp_path) == before
    with pytest.raises(StoreClosedError, match="opened to read only: nothing was written"):
        reader.append_turn("conv-a", _turn("D3:2", "Melanie", "Again!", JUNE, "2023-06-28T10:00:00"))
    assert _folder_bytes(tmp_path) == before
    log_path = Path(tmp_path) / "log.jsonl"
    log_path.write_bytes(before["log.jsonl"][:-30])  # the last commit record cut short
    cut = _folder_bytes(tmp_path)
    with pytest.raises(StoreCorruptError, match=r"write batch that was never committed .* nothing was dropped: "
                                                r"open it to write once \(`memfit store repair"):
        EpisodeStore(tmp_path, MemFitConfig(), bi_encoder, read_only=True)
    assert _folder_bytes(tmp_path) == cut
    # `memfit store repair` says so (its dry run said "nothing to repair") and drops it, as an open to write does
    assert repair_store(tmp_path, dry_run=True).uncommitted == 1 and _folder_bytes(tmp_path) == cut
    repaired = repair_store(tmp_path)
    # nothing lost: the old log (less its torn bytes, which any open cuts) and the dropped batch are kept
    assert repaired.uncommitted == 1 and repaired.torn_bytes > 0
    assert Path(repaired.backup).read_bytes() == cut["log.jsonl"][:-repaired.torn_bytes]
    assert [r["t"] for r in read_jsonl(Path(repaired.dropped_file))] == ["episode"]
    mended = EpisodeStore(tmp_path, MemFitConfig(), bi_encoder, read_only=True)
    assert mended.size == 7 and mended.turn_id.tolist()[-1] == "D1:2"
    (Path(tmp_path) / "log.jsonl").unlink()
    with pytest.raises(StoreCorruptError, match="no store log there"):
        EpisodeStore(tmp_path, MemFitConfig(), bi_encoder, read_only=True)
