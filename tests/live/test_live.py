"""memfit_gpu.Memory, in process: the README example as written, batch writes (one log append,
one encoder pass), duplicates and conflicts, bad input, deletion and compaction, every live method of the
seam, consolidation off the query path, and many threads at once.

Real parts: LoCoMo's first conversation (its first sessions), the packaged MiniLM, the real store, BM25
and FAISS. The reader, where one is needed, is the test-only echo backend (tests/seam_echo_backend.py):
these tests check the machinery around a reader (one call per question, the ledger, what is logged),
never what a reader says.
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import seam_echo_backend  # noqa: F401  (registers reader.backend=echo)
from support.env import memfit_env
from support.gates import gate

from memfit_gpu.config import ConfigError
from memfit_gpu.data import load_benchmark
from memfit_gpu.data.schema import DataError
from memfit_gpu.faults import TRACE_ENV, parse_trace
from memfit_gpu.files import StorageError
from memfit_gpu.live import Memory, TurnConflictError, UnknownUserError, live_methods
from memfit_gpu.live.memory import UserFullError
from memfit_gpu.locks import DirectoryBusyError
from memfit_gpu.methods.common import mtm_windows
from memfit_gpu.methods.naive_rag import chunk_history
from memfit_gpu.readers.ledger import Ledger
from memfit_gpu.readers.reader import calls_are_background
from memfit_gpu.readers.types import ReaderError, Response
from memfit_gpu.retrieve.view import ReadView
from memfit_gpu.store import RecordLog
from memfit_gpu.store.log import StoreCorruptError

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "configs" / "demo.yaml"
CHEAP = ["rerank.backend=none", "reader.backend=echo", "live.consolidate=manual"]

pytestmark = pytest.mark.slow  # loads the real MiniLM weights


@pytest.fixture(scope="module")
def conv_turns(locomo_path: Path) -> list[dict[str, Any]]:
    """The first three sessions of LoCoMo conv-26 (58 turns) as `add` takes them."""
    memory = load_benchmark("locomo", locomo_path).memories[0]
    return [{"speaker": t.speaker, "text": t.text, "timestamp": t.timestamp, "turn_id": t.turn_id,
             "session_id": s.session_id, "date_text": t.date_text} for s in memory.sessions[:3] for t in s.turns]


def readme_example() -> str:
    text = (REPO / "README.md").read_text()
    match = re.search(r"```python\n(from memfit_gpu import Memory\n.*?)```", text, re.S)
    assert match, "README.md has no ```python block starting with `from memfit_gpu import Memory`"
    return match.group(1)


def test_the_readme_example_runs_as_written(tmp_path: Path) -> None:
    (tmp_path / "configs").symlink_to(REPO / "configs")
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        scope: dict[str, Any] = {}
        exec(compile(readme_example(), "README.md", "exec"), scope)  # noqa: S102
    finally:
        os.chdir(cwd)
    hits = scope["hits"]
    assert len(hits) == 1 and hits[0][0].text == "I adopted a grey cat named Pixel." and hits[0][0].turn_ids == ["t1"]
    assert set(hits[0][0].scores) == {"bm25", "dense", "fused", "boost", "rerank"}
    with Memory.open(tmp_path / "my_store", config=DEMO, overrides=CHEAP) as reopened:  # the lock was released
        assert reopened.users() == []  # delete_user left nothing to find


@pytest.mark.parametrize("indexing", ["on_add", "deferred"])
def test_one_add_of_many_users_is_one_log_append_and_one_encoder_pass(tmp_path: Path, conv_turns, monkeypatch,
                                                                      indexing: str) -> None:
    trace = tmp_path / "trace"
    with Memory.open(tmp_path / "m", config=DEMO, overrides=[*CHEAP, f"live.indexing={indexing}"]) as memory:
        monkeypatch.setenv(TRACE_ENV, str(trace))
        added = memory.add(["a", "b", "c"], [conv_turns[:5], conv_turns[5:12], conv_turns[12:20]])
        if indexing == "on_add":
            assert trace.read_text().splitlines() == ["store.encode\t20", "store.log"]
        else:  # logged (fsynced) now; the next read encodes the 20 pending turns in one pass
            assert trace.read_text().splitlines() == ["store.log"] and memory.store.pending == 20
            memory.search("b", ["Caroline"], k=1)
            assert trace.read_text().splitlines() == ["store.log", "store.encode\t20"] and memory.store.pending == 0
        monkeypatch.delenv(TRACE_ENV)
        assert [a.row for a in added] == list(range(20)) and not any(a.duplicate for a in added)
        assert [t["turn_id"] for t in memory.turns("b")] == [t["turn_id"] for t in conv_turns[5:12]]
        records = RecordLog(tmp_path / "m" / "store" / "log.jsonl").records
        assert [r["t"] for r in records].count("commit") == 1  # one committed batch for the three users
        assert records[-1] == {"t": "commit", "records": 23}  # 3 memories + 20 episodes


def test_an_add_is_stored_once_however_often_it_is_retried(tmp_path: Path, conv_turns) -> None:
    with Memory.open(tmp_path / "m", config=DEMO, overrides=CHEAP) as memory:
        first = memory.add("u", conv_turns[:3])
        again = memory.add("u", conv_turns[:4])
        assert [a.duplicate for a in again] == [True, True, True, False]
        assert [a.row for a in again[:3]] == [a.row for a in first]
        assert len(memory.turns("u")) == 4
        auto = memory.add("u", [{"speaker": "Ann", "text": "no id given"}, {"speaker": "Ann", "text": "nor here"}])
        assert [a.turn_id for a in auto] == ["t5", "t6"]  # the user's 5th and 6th turns
        with pytest.raises(TurnConflictError, match="turn 'D1:1': that turn id is already stored with other words"):
            memory.add("u", [{**conv_turns[0], "text": "something else"}, conv_turns[10]])
        assert len(memory.turns("u")) == 6  # nothing of the refused add was stored
        # an automatic id never takes one the same add names for a later turn: "second" names t7, so "first"
        # gets t8 (it took t7, and "second" was refused as a conflict with a turn "already stored")
        named = memory.add("u", [{"speaker": "Ann", "text": "first"}, {"speaker": "Ann", "text": "second", "turn_id": "t7"},
                                 {"speaker": "Ann", "text": "third"}])
        assert [(a.turn_id, a.duplicate) for a in named] == [("t8", False), ("t7", False), ("t9", False)]
        same = memory.add("v", [{"speaker": "Ann", "text": "ok"}, {"speaker": "Ann", "text": "ok", "turn_id": "t1"}])
        assert [(a.turn_id, a.duplicate) for a in same] == [("t2", False), ("t1", False)]  # two turns, not one
        assert [t["text"] for t in memory.turns("v")] == ["ok", "ok"]


BAD_TURNS = [
    ({"text": "hi"}, "speaker", "is required"),
    ({"speaker": "Ann", "text": ""}, "text", "must be a non-empty string"),
    ({"speaker": "Ann", "text": 5}, "text", "must be a non-empty string"),
    ({"speaker": "Ann", "text": "hi", "timestamp": "yesterday"}, "timestamp", "is not an ISO 8601"),
    ({"speaker": "Ann", "text": "hi", "timestamp": "2023-05-08T13:56:00+02:00"}, "timestamp", "UTC offset"),
    ({"speaker": "Ann", "text": "hi", "mood": "good"}, "mood", "unknown field"),
    ({"speaker": "Ann", "text": "hi", "images": 5}, "images", "a list of images, got int"),
]


def test_bad_turns_are_refused_naming_the_user_turn_and_field(tmp_path: Path) -> None:
    with Memory.open(tmp_path / "m", config=DEMO, overrides=CHEAP) as memory:
        memory.add("u", [{"speaker": "Ann", "text": "a fine first turn"}])
        for turn, field, reason in BAD_TURNS:
            with pytest.raises(DataError) as refused:
                memory.add("u", [{"speaker": "Ann", "text": "fine"}, turn])
            assert f"item user 'u' turn 1, field '{field}'" in str(refused.value) and reason in str(refused.value)
        assert len(memory.turns("u")) == 1


def test_a_date_text_that_names_the_session_is_bounded_as_a_session_id(tmp_path: Path) -> None:
    """A turn without session_id or timestamp takes its date text as its session id: a 100,000-character
    date_text made a 100,000-character session id, past the 256 a session_id is held to (names.LABEL_MAX).
    Such a date_text is bounded as the session id it becomes; beside a session id it is only a date text."""
    with Memory.open(tmp_path / "m", config=DEMO, overrides=CHEAP) as memory:
        with pytest.raises(DataError) as refused:
            memory.add("u", [{"speaker": "Ann", "text": "fine"}, {"speaker": "Ann", "text": "hi", "date_text": "d" * 100_000}])
        assert str(refused.value) == ("add, item user 'u' turn 1, field 'date_text': 100,000 characters; a date_text is "
                                      "at most 256 when it names the session (a turn without session_id or timestamp)")
        memory.add("u", [{"speaker": "Ann", "text": "at the limit", "date_text": "d" * 256, "turn_id": "a"},
                         {"speaker": "Ann", "text": "with a session", "date_text": "e" * 300, "session_id": "s1",
                          "turn_id": "b"}])
        assert [(t["turn_id"], t["session_id"]) for t in memory.turns("u")] == [("a", "d" * 256), ("b", "s1")]


def test_one_writer_per_memory_and_no_offline_method(tmp_path: Path) -> None:
    with Memory.open(tmp_path / "m", config=DEMO, overrides=CHEAP):
        with pytest.raises(DirectoryBusyError, match=f"pid {os.getpid()}"):
            Memory.open(tmp_path / "m", config=DEMO, overrides=CHEAP)
    with pytest.raises(ConfigError, match="method=full_context has no live write path"):
        Memory.open(tmp_path / "m2", config=DEMO, overrides=CHEAP, method="full_context")
    assert live_methods() == ["memfit", "plain", "naive_rag", "lightmem_slm", "mem0"]
    # LightMem's error injection draws its replacements from the other memories: other users, in a live one
    for key in ("write", "hq", "mtm"):
        with pytest.raises(ConfigError, match=rf"lightmem.noise.{key}=0.5: error injection is for benchmark runs"):
            Memory.open(tmp_path / "m3", config=DEMO, overrides=[*CHEAP, f"lightmem.noise.{key}=0.5"],
                        method="lightmem_slm")
    Memory.open(tmp_path / "m3", config=DEMO, overrides=[*CHEAP, "lightmem.noise.seed=3"]).close()
    # an operator's own config.yaml in a live memory's folder is no run directory (no timings.json, no DONE, ...)
    (tmp_path / "m3" / "config.yaml").write_text(DEMO.read_text())
    Memory.open(tmp_path / "m3", config=DEMO, overrides=CHEAP).close()
    (tmp_path / "m3" / "timings.json").write_text("{}")
    with pytest.raises(ConfigError, match="m3: a run directory"):
        Memory.open(tmp_path / "m3", config=DEMO, overrides=CHEAP)


def test_an_open_that_fails_leaves_no_folder_it_made(tmp_path: Path, monkeypatch) -> None:
    """A Memory.open that failed once it had made the folder left it behind, holding the lock file (and what
    the store had begun). A folder it made is removed now; one that was there stays, with what it held."""
    def broken(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise RuntimeError("the store could not open")

    monkeypatch.setattr("memfit_gpu.live.memory.EpisodeStore", broken)
    with pytest.raises(RuntimeError, match="could not open"):
        Memory.open(tmp_path / "new" / "m", config=DEMO, overrides=CHEAP)
    assert not (tmp_path / "new" / "m").exists()
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "notes.txt").write_text("mine")
    with pytest.raises(RuntimeError, match="could not open"):
        Memory.open(tmp_path / "kept", config=DEMO, overrides=CHEAP)
    assert (tmp_path / "kept" / "notes.txt").read_text() == "mine"
    monkeypatch.undo()
    Memory.open(tmp_path / "new" / "m", config=DEMO, overrides=CHEAP).close()


def test_deleting_removes_turns_from_every_read_and_compaction_from_disk(tmp_path: Path, conv_turns) -> None:
    with Memory.open(tmp_path / "m", config=DEMO, overrides=CHEAP) as memory:
        memory.add("keep", conv_turns[:20])
        secret = {"speaker": "Eve", "text": "my locker code is zebra-4471", "turn_id": "s1"}
        memory.add("gone", [*conv_turns[:20], secret])
        before = memory.search("keep", ["what did Caroline say about the support group?"], k=5)
        assert memory.search("gone", ["locker code"], k=1)[0][0].text == secret["text"]
        memory.delete("gone", ["s1"])
        assert all("zebra" not in h.text for h in memory.search("gone", ["locker code zebra"], k=20)[0])
        memory.delete_user("gone")
        with pytest.raises(UnknownUserError):
            memory.search("gone", ["locker code"])
        with pytest.raises(UnknownUserError):
            memory.delete_user("gone")
        assert b"zebra-4471" in b"".join(p.read_bytes() for p in (tmp_path / "m").rglob("*") if p.is_file())
        memory.compact()
        assert not any(b"zebra-4471" in p.read_bytes() for p in (tmp_path / "m").rglob("*") if p.is_file())
        assert "gone" not in memory.store.memory_ids  # nothing of the user is left: not even its memory record
        assert not [r for r in RecordLog(tmp_path / "m" / "store" / "log.jsonl").records if "gone" in json.dumps(r)]
        after = memory.search("keep", ["what did Caroline say about the support group?"], k=5)
        assert [(h.turn_ids, round(h.score, 5)) for h in after[0]] == [(h.turn_ids, round(h.score, 5)) for h in before[0]]


def test_a_delete_goes_ahead_when_the_reader_cannot_rebuild_the_summary(tmp_path: Path, conv_turns, monkeypatch) -> None:
    """A deleted turn covered by a summary: the summary is rebuilt over the rest with the reader. With the reader
    unreachable the delete raised, and the turn stayed searchable; now the turn is deleted, the summary that
    quotes it retired, and the segment left without one."""
    with Memory.open(tmp_path / "m", config=DEMO, overrides=[*CHEAP, "summary.enabled=true", "summary.min_chars=1"]) as memory:
        secret = {"speaker": "Eve", "text": "my locker code is zebra-4471", "turn_id": "s1"}
        memory.add("u", [*conv_turns[:30], secret, *conv_turns[30:60]])
        assert memory.consolidate(["u"])["summaries"] > 0
        store = memory.store
        row = store.row_of("u", "s1")
        covering = [s for s in store.summaries.live_rows(store.memory_of("u")) if row in store.summaries.members[s]]
        assert covering, "the secret's segment has a summary"

        def unreachable(requests):  # noqa: ANN001, ANN202
            raise ConnectionError("the reader's server is down")

        monkeypatch.setattr(memory.reader().backend, "generate", unreachable)
        counts = memory.delete("u", ["s1"])
        assert counts == {"episodes": 1, "summaries_retired": len(covering), "summaries_rebuilt": 0}
        assert all("zebra" not in h.text for h in memory.search("u", ["locker code zebra"], k=20)[0])
        assert not set(covering) & set(store.summaries.live_rows(store.memory_of("u")).tolist())


def test_a_delete_whose_summaries_changed_meanwhile_rebuilds_again_off_the_memory(tmp_path: Path, conv_turns,
                                                                                     monkeypatch) -> None:
    """A delete rebuilds the covering summary without holding the memory, then plans again. When another delete
    had changed that user's summaries meanwhile, the rebuild was made again holding the memory (every user's
    searches and adds waited for the LLM). It is made again off the memory now, and both deletions land."""
    with Memory.open(tmp_path / "m", config=DEMO, overrides=[*CHEAP, "summary.enabled=true", "summary.min_chars=1"]) as memory:
        memory.add("u", conv_turns[:60])
        assert memory.consolidate(["u"])["summaries"] > 0
        store = memory.store
        summary = int(store.summaries.live_rows(store.memory_of("u"))[0])
        first, second = (str(store.turn_id[r]) for r in store.summaries.members[summary][:2])
        generate, inside, release = memory._summary_generate, threading.Event(), threading.Event()
        calls: list[bool] = []  # per rebuild: was the memory free meanwhile?

        def memory_free() -> bool:
            free: list[bool] = []

            def probe() -> None:
                if memory._lock.acquire(timeout=2):
                    memory._lock.release()
                    free.append(True)

            prober = threading.Thread(target=probe)
            prober.start()
            prober.join()
            return bool(free)

        def gated(prompts):  # noqa: ANN001, ANN202 - the first rebuild is held (before the reader) until the other
            calls.append(memory_free())  # delete landed
            if len(calls) == 1:
                inside.set()
                assert release.wait(60)
            return generate(prompts)

        monkeypatch.setattr(memory, "_summary_generate", gated)
        results: list[dict[str, int]] = []
        deleting = threading.Thread(target=lambda: results.append(memory.delete("u", [first])))
        deleting.start()
        assert inside.wait(60)
        assert memory.delete("u", [second])["summaries_rebuilt"] == 1  # the other delete changes the summary
        release.set()
        deleting.join(60)
        assert results and results[0]["episodes"] == 1 and results[0]["summaries_rebuilt"] == 1
        assert len(calls) == 3 and all(calls), calls  # the third: made again, off the memory
        live = store.summaries.live_rows(store.memory_of("u"))
        assert not any(str(store.turn_id[m]) in (first, second) for s in live for m in store.summaries.members[s])


@pytest.mark.parametrize("method", ["plain", "naive_rag"])
def test_a_method_grown_turn_by_turn_reads_as_one_built_at_once(tmp_path: Path, conv_turns, method: str) -> None:
    """Incremental writes (many small adds, a deletion) give the reads of the same turns written at once."""
    questions = ["When did Caroline go to the LGBTQ support group?", "What did Melanie paint recently?"]
    turns = conv_turns[:30]
    with Memory.open(tmp_path / "live", config=DEMO, overrides=CHEAP, method=method) as grown:
        for start in range(0, len(turns), 6):
            grown.add("u", turns[start:start + 6])
        grown.delete("u", [conv_turns[3]["turn_id"]])
        live = grown.search("u", questions, k=5)
        if method == "naive_rag":
            store = grown.store
            rows = store.memory_rows(0).tolist()
            cfg = grown.cfg.naive_rag
            expected = chunk_history([store.text[r] for r in rows], rows, 0, cfg.chunk_tokens, cfg.overlap_tokens)
            held = [grown.method.chunks[r] for r in grown.method._rows_of[0]]
            assert held == expected
    kept = [t for t in turns if t["turn_id"] != conv_turns[3]["turn_id"]]
    with Memory.open(tmp_path / "once", config=DEMO, overrides=CHEAP, method=method) as once:
        once.add("u", kept)
        built = once.search("u", questions, k=5)
    assert [[h.turn_ids for h in hits] for hits in live] == [[h.turn_ids for h in hits] for hits in built]
    for a, b in zip(live, built, strict=True):
        assert [h.score for h in a] == pytest.approx([h.score for h in b], abs=1e-5)


def test_a_read_after_writes_reuses_the_speaker_masks_of_unchanged_rows(tmp_path: Path, conv_turns,
                                                                         monkeypatch) -> None:
    """The view after a write takes the earlier view's speaker masks for the rows it had, where their memory
    kept its speakers, and computes only the others; every mask equals a view built from scratch, after adds
    to both users, a new speaker in one, a deletion and a compaction."""
    seen: list[int] = []
    mask_of = ReadView._mask_of

    def counting(texts, *args):  # noqa: ANN001, ANN002
        seen.append(len(texts))
        return mask_of(texts, *args)

    monkeypatch.setattr(ReadView, "_mask_of", staticmethod(counting))
    modes = [(3, "speaker"), (3, "mention"), (1, "mention")]

    def check(memory: Memory) -> None:
        view, fresh = memory.method.view(), ReadView.from_store(memory.store)
        for min_chars, match in modes:
            assert view.episode_speaker_mask(min_chars, match).tolist() == fresh.episode_speaker_mask(min_chars, match).tolist()

    with Memory.open(tmp_path / "m", config=DEMO, overrides=CHEAP) as memory:
        memory.add("u1", conv_turns[:20])
        memory.add("u2", conv_turns[20:30])
        memory.search(["u1", "u2"], ["What did Caroline research?", "Where did Melanie go?"], k=5)
        for min_chars, match in modes:
            memory.method.view().episode_speaker_mask(min_chars, match)
        seen.clear()
        # u1 gains rows (its speakers unchanged); u2 gains a speaker, so all of u2's rows are redone
        memory.add("u1", conv_turns[30:34])
        memory.add("u2", [{"speaker": "Zed", "text": "Melanie showed Zed and Caroline her new painting.",
                           "timestamp": "2023-06-01T10:00:00"}])
        memory.search("u1", ["What did Caroline research?"], k=5)
        assert seen and all(n == 4 + 11 for n in seen[:3])  # u1's 4 new rows, u2's 10 + 1
        check(memory)
        memory.delete("u1", [conv_turns[0]["turn_id"]])
        memory.search("u1", ["What did Caroline research?"], k=5)
        check(memory)
        memory.compact()  # a new store: nothing is carried across, every mask is computed again
        seen.clear()
        memory.search("u1", ["What did Caroline research?"], k=5)
        assert seen[0] == 34
        check(memory)


def test_deferred_indexing_reads_every_acknowledged_turn_exactly_as_indexing_on_add(tmp_path: Path, conv_turns) -> None:
    """live.indexing=deferred: an add returns before its turns are encoded, yet every search sees all of
    them in both indexes, with the very results (bit for bit) of adds that index before they return; a
    snapshot covers no turn its indexes lack, and a memory dropped without close (a kill) replays them."""
    questions = ["When did Caroline go to the LGBTQ support group?", "What did Melanie paint recently?"]
    found: dict[str, list[list[list[tuple[list[str], float, dict[str, float | None]]]]]] = {}
    for indexing in ("on_add", "deferred"):
        memory = Memory.open(tmp_path / indexing, config=DEMO, overrides=[*CHEAP, f"live.indexing={indexing}"])
        found[indexing] = []
        for start in (0, 6):
            memory.add("u", conv_turns[start:start + 6])
            assert memory.store.pending == (6 if indexing == "deferred" else 0)
            hits = memory.search("u", [*questions, conv_turns[start + 5]["text"]], k=5)
            assert hits[2][0].turn_ids == [conv_turns[start + 5]["turn_id"]]  # the newest turn is found
            found[indexing].append([[(h.turn_ids, h.score, h.scores) for h in q] for q in hits])
        store = memory.store
        assert store.episode_bm25.num_rows == store.episode_dense.size == store.size == 12
        if indexing == "on_add":
            memory.close()
    assert found["deferred"] == found["on_add"]  # the same encoder batches: identical results, not close ones

    memory.add("u", conv_turns[12:16])
    memory.store.snapshot()  # indexes the pending turns first
    assert memory.store.pending == 0 and memory.store.episode_dense.size == 16
    memory.add("u", conv_turns[16:20])  # logged, never indexed: then the process "dies"
    memory._exit.close()  # only the lock is released, as a killed process's is
    with Memory.open(tmp_path / "deferred", config=DEMO, overrides=CHEAP) as reopened:
        assert [t["turn_id"] for t in reopened.turns("u")] == [t["turn_id"] for t in conv_turns[:20]]
        assert reopened.search("u", [conv_turns[19]["text"]], k=1)[0][0].turn_ids == [conv_turns[19]["turn_id"]]


def test_answer_makes_one_reader_call_per_question_in_one_batch(tmp_path: Path, conv_turns) -> None:
    with Memory.open(tmp_path / "m", config=DEMO, overrides=CHEAP) as memory:
        memory.add(["a", "b"], [conv_turns[:10], conv_turns[10:20]])
        answers = memory.answer(["a", "b", "a"], ["Who is Caroline?", "What did Melanie say?", "Where?"], k=2)
        assert [a.user_id for a in answers] == ["a", "b", "a"] and all(len(a.hits) <= 2 for a in answers)
        assert all(a.answer and a.error is None for a in answers)
    assert Ledger.load(tmp_path / "m" / "ledger.json").roles["answer"].calls == 3


def test_memfit_summarises_closed_segments_off_the_query_path(tmp_path: Path, conv_turns) -> None:
    overrides = [*CHEAP, "live.consolidate=background", "live.consolidate_after_turns=30"]
    with Memory.open(tmp_path / "m", config=DEMO, overrides=overrides) as memory:
        memory.add("u", conv_turns[:29])
        assert memory.consolidate([]) == {}
        assert len(memory.store.summaries) == 0  # below the threshold: the worker was not woken
        memory.add("u", conv_turns[29:])
        for _ in range(600):  # the worker builds them on its own thread
            if len(memory.store.summaries):
                break
            threading.Event().wait(0.1)
        assert memory.consolidation_error is None
        summaries = memory.store.summaries
        assert len(summaries) > 0
        last = max(int(m.max()) for m in summaries.members)
        assert last < memory.store.size - 1  # the last segment is still open: it may grow
        again = memory.consolidate(["u"])
        assert again == {"summaries": 0}  # nothing stored is re-summarised
        hits = memory.search("u", ["Caroline support group"], k=40)[0]
        assert any(h.kind == "summary" for h in hits)
    ledger = Ledger.load(tmp_path / "m" / "ledger.json")
    assert ledger.roles["summary"].calls == len(summaries)


def test_summaries_of_turns_without_a_timestamp_are_read_as_of_an_unknown_date(tmp_path: Path, conv_turns) -> None:
    """A turn may come without a timestamp (its excerpt says "unknown date"); a summary of such turns has
    none either, and every search or answer whose pack held one failed (AttributeError on NaT's date)."""
    undated = [{k: v for k, v in turn.items() if k not in ("timestamp", "date_text")} for turn in conv_turns]
    with Memory.open(tmp_path / "m", config=DEMO, overrides=CHEAP) as memory:
        memory.add(["u", "w"], [undated, conv_turns[:5]])
        assert memory.consolidate(["u"])["summaries"] > 0
        view = ReadView.from_store(memory.store)
        assert {view.summary_date(s) for s in range(len(memory.store.summaries))} == {"unknown date"}
        hits = memory.search("u", ["Caroline support group"], k=40)[0]
        assert any(h.kind == "summary" for h in hits)
        answer = memory.answer("u", ["When did Caroline go to the support group?"], k=40)[0]
        assert answer.error is None and any(h.kind == "summary" for h in answer.hits)


def test_lightmem_notes_follow_the_turns_deletions_and_compaction(tmp_path: Path, conv_turns) -> None:
    overrides = [*CHEAP, "lightmem.mtm_window_turns=6", "lightmem.consolidate_every=2"]
    with Memory.open(tmp_path / "m", config=DEMO, overrides=overrides, method="lightmem_slm") as memory:
        memory.add(["a", "b"], [conv_turns[:20], conv_turns[20:40]])
        sessions = [[t["session_id"] for t in part] for part in (conv_turns[:20], conv_turns[20:40])]
        windows = [len(mtm_windows(s, 6, final=False)) for s in sessions]  # a session's last short window waits
        assert memory.consolidate() == {"mtm_entries": sum(windows), "ltm_batches": sum(w // 2 for w in windows)}
        hits = memory.search("a", ["What did Caroline talk about?"], k=10)[0]
        assert {h.kind for h in hits} >= {"mtm"} and all(set(h.turn_ids) <= {t["turn_id"] for t in conv_turns[:20]}
                                                         for h in hits)
        memory.delete("a", [conv_turns[0]["turn_id"]])  # in a's first window
        hits = memory.search("a", ["What did Caroline talk about?"], k=10)[0]
        assert all(conv_turns[0]["turn_id"] not in h.turn_ids for h in hits)
        memory.compact()
        users = {r.get("user") for r in RecordLog(tmp_path / "m" / "lightmem" / "log.jsonl").records}
        assert users == {None, "b"}  # a lost a turn: its notes go, to be written again (header, commits: None)
        assert memory.consolidate(["a"])["mtm_entries"] == len(mtm_windows(sessions[0][1:], 6, final=False))
        assert memory.search("b", ["What did Melanie say?"], k=3)[0]


def _until(done: Any, memory: Memory) -> None:
    """Wait (up to 120 s) for the background consolidation to make `done()` true."""
    for _ in range(1200):
        assert memory.consolidation_error is None
        if done():
            return
        threading.Event().wait(0.1)
    raise AssertionError("the background consolidation did not finish in 120 s")


def test_notes_a_compaction_drops_are_made_again_in_the_background(tmp_path: Path, conv_turns) -> None:
    """LightMem's compaction drops the notes of a user who lost a turn (its windows moved). Nothing woke the
    background consolidation for them: searches read the last turns only until 64 more turns came."""
    overrides = ["rerank.backend=none", "reader.backend=echo", "live.consolidate=background",
                 "live.consolidate_after_turns=20", "lightmem.mtm_window_turns=6", "lightmem.consolidate_every=2"]
    sessions = [t["session_id"] for t in conv_turns[:20]]
    with Memory.open(tmp_path / "m", config=DEMO, overrides=overrides, method="lightmem_slm") as memory:
        notes = lambda: memory.method.memlog.user("a").mtm  # noqa: E731
        memory.add("a", conv_turns[:20])
        _until(lambda: len(notes()) == len(mtm_windows(sessions, 6, final=False)), memory)
        memory.delete("a", [conv_turns[0]["turn_id"]])
        memory.compact()  # 19 turns left: under live.consolidate_after_turns, yet made again
        _until(lambda: len(notes()) == len(mtm_windows(sessions[1:], 6, final=False)), memory)
        assert {h.kind for h in memory.search("a", ["What did Caroline talk about?"], k=10)[0]} >= {"mtm"}


def test_turns_added_before_a_close_are_consolidated_after_the_next_open(tmp_path: Path, conv_turns) -> None:
    """A reopened memory forgot which turns were waiting: consolidate() did nothing, and the background
    consolidation waited for live.consolidate_after_turns more."""
    with Memory.open(tmp_path / "m", config=DEMO, overrides=CHEAP) as memory:
        memory.add("u", conv_turns)
    with Memory.open(tmp_path / "m", config=DEMO, overrides=CHEAP) as memory:
        assert memory.consolidate()["summaries"] > 0
        summaries = len(memory.store.summaries)
        store = memory.store  # the live rows after the last summarised one: the open segment waits
        last = max(int(members.max()) for members in store.summaries.members)
        assert store.unsummarised_counts(["u"]) == {"u": sum(1 for r in store.live_turns("u") if r > last)}
        assert 0 < store.unsummarised_counts(["u"])["u"] < len(conv_turns)
    with Memory.open(tmp_path / "b", config=DEMO, overrides=CHEAP) as memory:
        memory.add("u", conv_turns)
    background = ["rerank.backend=none", "reader.backend=echo", "live.consolidate_after_turns=30"]
    with Memory.open(tmp_path / "b", config=DEMO, overrides=background) as memory:
        _until(lambda: len(memory.store.summaries) == summaries, memory)


def test_consolidation_is_background_work_that_answers_go_before(tmp_path: Path, conv_turns,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """One user's consolidation held the reader for all its summary calls, so every other user's answer waited
    until it ended. Its calls are background work (readers.reader.background_calls: a chunk at a time, an
    answer waiting going first, tests/readers); the answers' calls are not."""
    seen: list[tuple[str, bool]] = []
    with Memory.open(tmp_path / "m", config=DEMO, overrides=CHEAP) as memory:
        memory.add("a", conv_turns)
        memory.add("b", conv_turns[:4])
        backend = memory.reader().backend
        generate = backend.generate

        def noting(requests):  # noqa: ANN001, ANN202
            seen.extend((r.role, calls_are_background()) for r in requests)
            return generate(requests)

        monkeypatch.setattr(backend, "generate", noting)
        assert memory.consolidate(["a"])["summaries"] > 0
        memory.answer("b", ["What did Caroline research?"])
    assert {role for role, _ in seen} == {"summary", "answer"}
    assert all(background == (role == "summary") for role, background in seen)


def test_a_delete_rebuilding_a_summary_holds_no_other_user_s_search(tmp_path: Path, conv_turns,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A delete rebuilt the retired summary with the reader while holding the memory: every other user's search
    (and add) waited for that LLM call. The rebuild is made without holding the memory now, as background work,
    and lands with the deletion in one write batch."""
    with Memory.open(tmp_path / "m", config=DEMO, overrides=CHEAP) as memory:
        memory.add("u1", conv_turns)
        memory.add("u2", conv_turns[:4])
        assert memory.consolidate(["u1"])["summaries"] > 0
        store = memory.store
        covered = next(s for s in store.summaries.live_rows(store.memory_of("u1")) if len(store.summaries.members[s]) > 3)
        victim = store.turn_id[int(store.summaries.members[covered][1])]
        inside, release = gate(monkeypatch, memory, lambda requests: any(r.role == "summary" for r in requests))
        deleted: list[dict[str, int]] = []
        deleting = threading.Thread(target=lambda: deleted.append(memory.delete("u1", [victim])))
        deleting.start()
        assert inside.wait(30)  # the rebuild's LLM call is under way
        searched: list[Any] = []
        searching = threading.Thread(target=lambda: searched.append(memory.search("u2", ["Caroline"], k=2)))
        searching.start()
        searching.join(10)
        assert searched and not deleted  # served meanwhile
        assert victim in [t["turn_id"] for t in memory.turns("u1")]  # the deletion lands with its rebuilt summary
        release.set()
        deleting.join(30)
        assert deleted == [{"episodes": 1, "summaries_retired": 1, "summaries_rebuilt": 1}]
        assert victim not in [t["turn_id"] for t in memory.turns("u1")]
        members = [int(r) for r in store.summaries.members[covered] if store.turn_id[int(r)] != victim]
        rebuilt = store.summaries.live_rows(store.memory_of("u1"))[-1]
        assert store.summaries.replaces.view[rebuilt] == covered
        assert store.summaries.members[rebuilt].tolist() == members


def test_naive_rag_chunks_again_only_what_a_write_changed_and_holds_a_fresh_chunking(tmp_path: Path,
                                                                                     conv_turns) -> None:
    """naive_rag chunked a user's whole history again at every add (an add to a user of 60,000 turns took 10
    times a small user's, while every user's searches waited). It now starts at the first chunk a write can
    have changed; after any sequence of adds and deletes its chunks are a fresh chunking's, in order."""
    rng = random.Random(5)
    cheap = [*CHEAP, "naive_rag.chunk_tokens=16", "naive_rag.overlap_tokens=5"]
    with Memory.open(tmp_path / "m", config=DEMO, overrides=cheap, method="naive_rag") as memory:
        method, store, added = memory.method, memory.store, 0
        for step in range(30):
            if step % 4 == 3 and memory.turns("u"):
                live = [t["turn_id"] for t in memory.turns("u")]
                memory.delete("u", rng.sample(live, min(len(live), rng.randint(1, 3))))
            else:
                count = rng.randint(1, 4)
                memory.add("u", conv_turns[added:added + count])
                added += count
            m = store.memory_of("u")
            rows = store.memory_rows(m).tolist()
            fresh = chunk_history([method.table.ep_text[r] for r in rows], rows, m, 16, 5)
            assert [method.chunks[r] for r in method._rows_of[m]] == fresh, step
            assert not fresh or method._tokens_of[m][-1] == fresh[-1].tokens[1]  # the history's tokens, counted


def test_one_user_s_failing_consolidation_fails_that_user_only(tmp_path: Path, conv_turns,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """One user's turns made the shared background consolidation fail (a prompt the reader's server refuses):
    every user of that batch went without summaries, and their waiting counts had been zeroed first, so nobody's
    turns were consolidated until 64 more came. Now the counts are restored on failure, the users of a failed
    batch are consolidated each alone, and the failing user is tried again once more of its turns wait."""
    background = ["rerank.backend=none", "reader.backend=echo", "live.consolidate_after_turns=8"]
    poisoned = [{**turn, "text": f"POISON {turn['text']}"} for turn in conv_turns]
    asked: list[str] = []
    with Memory.open(tmp_path / "m", config=DEMO, overrides=background) as memory:
        backend = memory.reader().backend
        generate = backend.generate

        def refusing(requests):  # noqa: ANN001, ANN202  (a server refusing the prompt: no answer, no number)
            asked.extend("POISON" in r.messages[-1]["content"] for r in requests if r.role == "summary")
            answered = generate([r for r in requests if "POISON" not in r.messages[-1]["content"]])
            return [Response("", 0, 0, 0.0, error="prompt too long", answered=False)
                    if "POISON" in r.messages[-1]["content"] else answered.pop(0) for r in requests]

        monkeypatch.setattr(backend, "generate", refusing)
        with memory.holding():  # both wait, then the worker takes them in one batch
            memory.add("evil", poisoned)
            memory.add("good", conv_turns)
        for _ in range(1200):
            if memory.consolidation_error is not None and len(memory.store.summaries):
                break
            threading.Event().wait(0.1)
        assert isinstance(memory.consolidation_error, ReaderError)
        store = memory.store
        assert len(store.summaries.live_rows(store.memory_of("good"))) > 0
        assert len(store.summaries.live_rows(store.memory_of("evil"))) == 0
        assert memory._new_turns["evil"] == len(poisoned) and memory._new_turns["good"] == 0
        tries = asked.count(True)
        memory.add("good", [{"speaker": "Ann", "text": "one more", "turn_id": "x1"}])  # wakes the worker
        threading.Event().wait(1.0)
        assert asked.count(True) == tries  # not at another user's add
        with pytest.raises(ReaderError):
            memory.consolidate(["evil"])  # an explicit call tries at once, and its turns still wait after it
        assert memory._new_turns["evil"] == len(poisoned)


def test_an_add_past_a_user_s_text_share_is_refused_whole(tmp_path: Path) -> None:
    """add_batch(max_text_bytes_per_user=...): the episode text a user holds (UTF-8 as stored, the date and
    speaker prefix included; deleted turns until compaction) is bounded, counted across the adds of one batch,
    and an add past it stores nothing of itself; another user's add in the batch is stored."""
    def say(n: int, text: str) -> dict[str, Any]:
        return {"speaker": "Ann", "text": text, "turn_id": f"t{n}", "timestamp": "2024-03-01T10:00:00"}

    with Memory.open(tmp_path / "m", config=DEMO, overrides=CHEAP) as memory:
        memory.add("u", [say(1, "é" * 100)])
        held = len(memory.store.text[0].encode())
        assert held == memory.store.text_bytes("u") == len(memory.store.text[0]) + 100  # é is two bytes
        limit = 2 * held + 10
        results = memory.add_batch([("u", [say(2, "é" * 100)]), ("u", [say(3, "é" * 100)]), ("v", [say(1, "x")])],
                                   max_text_bytes_per_user=limit)
        assert [len(r) if isinstance(r, list) else type(r).__name__ for r in results] == [1, "UserFullError", 1]
        assert results[1].limit == "text" and str(results[1]) == (
            f"user 'u' would hold {3 * held:,} bytes of turn text (deleted turns count until compaction); at most "
            f"{limit:,}")
        memory.delete("u", ["t2"])  # held until compaction
        assert isinstance(memory.add_batch([("u", [say(3, "é" * 100)])], max_text_bytes_per_user=limit)[0],
                          UserFullError)
        memory.compact()
        assert memory.store.text_bytes("u") == held
        assert len(memory.add_batch([("u", [say(3, "é" * 100)])], max_text_bytes_per_user=limit)[0]) == 1
        assert [t["turn_id"] for t in memory.turns("u")] == ["t1", "t3"]


def test_threads_add_and_search_at_once(tmp_path: Path, conv_turns) -> None:
    errors: list[BaseException] = []
    with Memory.open(tmp_path / "m", config=DEMO, overrides=CHEAP) as memory:
        memory.add("seed", conv_turns[:5])

        def writer(user: str) -> None:
            try:
                for turn in conv_turns[:12]:
                    memory.add(user, [turn])
                    memory.search([user, "seed"], [turn["text"][:40], "Caroline"], k=3)
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=writer, args=(f"w{i}",)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors
        assert all([t["turn_id"] for t in memory.turns(f"w{i}")] == [t["turn_id"] for t in conv_turns[:12]]
                   for i in range(4))
    shutil.rmtree(tmp_path / "m")


# ------------------------------------------------------------- "Reliability, round 4": the Python API
def test_an_add_of_several_users_is_all_or_nothing_and_a_retry_stores_each_turn_once(tmp_path: Path) -> None:
    """add(["u1", "u2"], ...) where u1's turn conflicts (or is bad input) raised but stored u2's turn, and
    a retry then stored it again under a new id; the README promises nothing of the call is stored."""
    with Memory.open(tmp_path / "m", DEMO, overrides=CHEAP) as memory:
        memory.add("u1", [{"speaker": "Ann", "text": "I keep bees.", "turn_id": "t1"}])
        for refused, error in [({"speaker": "Ann", "text": "Other words.", "turn_id": "t1"}, TurnConflictError),
                               ({"speaker": "Ann"}, DataError),
                               ({"speaker": "Ann", "text": "bad \ud800 text"}, DataError)]:
            with pytest.raises(error):
                memory.add(["u1", "u2"], [[refused], [{"speaker": "Bob", "text": "I keep goats."}]])
            assert memory.users() == ["u1"] and len(memory.turns("u1")) == 1
        with pytest.raises(DataError, match="user_id.*is not valid"):
            memory.add(["u1", "u%31"], [[{"speaker": "Ann", "text": "x"}], [{"speaker": "Bob", "text": "y"}]])
        first = memory.add(["u1", "u2"], [[{"speaker": "Ann", "text": "I keep bees.", "turn_id": "t1"}],
                                          [{"speaker": "Bob", "text": "I keep goats.", "turn_id": "g1"}]])
        again = memory.add(["u1", "u2"], [[{"speaker": "Ann", "text": "I keep bees.", "turn_id": "t1"}],
                                          [{"speaker": "Bob", "text": "I keep goats.", "turn_id": "g1"}]])
        assert [a.duplicate for a in first] == [True, False] and [a.duplicate for a in again] == [True, True]
        assert [t["turn_id"] for t in memory.turns("u2")] == ["g1"]


def test_a_batch_whose_write_fails_is_written_add_by_add(tmp_path: Path, monkeypatch) -> None:
    """The write of a server's batch of adds fails (the log append meets a full disk, once): nothing of it
    is logged, each add is written again alone and stored; a refused add stays refused alone."""
    monkeypatch.setenv("MEMFIT_IO_FAULT", "log.jsonl:ENOSPC:2")  # 1: the new store's header
    with Memory.open(tmp_path / "m", DEMO, overrides=CHEAP) as memory:
        out = memory.add_batch([("u1", [{"speaker": "Ann", "text": "bees"}]), ("u2", [{"speaker": "Bob", "text": "goats"}]),
                                ("u3", [{"speaker": "Cy", "text": "bad \udfff"}])])
        assert [a[0].turn_id for a in out[:2]] == ["t1", "t1"] and isinstance(out[2], DataError)
        assert memory.users() == ["u1", "u2"]
    records = RecordLog(tmp_path / "m" / "store" / "log.jsonl").records
    assert [(r["row"], r["text"][-5:]) for r in records if r.get("t") == "episode"] == [(0, " bees"), (1, "goats")]


def test_one_add_that_fails_alone_leaves_the_others_of_its_batch_answered(tmp_path: Path, monkeypatch) -> None:
    """When the batched write failed and the adds were written one by one, an add that failed again alone
    raised out of the loop: the whole batch was answered as failed though the adds before it were stored,
    and the server's retry stored them twice (new automatic turn ids). Now that add alone gets its error."""
    with Memory.open(tmp_path / "m", DEMO, overrides=CHEAP) as memory:
        encode = memory.store.encoder.encode

        def fragile(texts, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202 - one text breaks the encoder
            if any("POISON" in t for t in texts):
                raise RuntimeError("the encoder broke on one text")
            return encode(texts, *args, **kwargs)

        monkeypatch.setattr(memory.store.encoder, "encode", fragile)
        out = memory.add_batch([("u1", [{"speaker": "Ann", "text": "bees"}]), ("u3", [{"speaker": "Cy", "text": "POISON"}]),
                                ("u2", [{"speaker": "Bob", "text": "goats"}])])
        assert [a[0].turn_id for a in (out[0], out[2])] == ["t1", "t1"]
        assert isinstance(out[1], RuntimeError) and "broke on one text" in str(out[1])
        assert memory.users() == ["u1", "u2"]
        assert [t["text"] for t in memory.turns("u1")] == ["bees"]


def test_a_snapshot_that_fails_after_an_add_is_stored_answers_the_add_as_stored(tmp_path: Path, monkeypatch) -> None:
    """The snapshot after an add (live.snapshot_after_turns) met a full disk: the add was answered as failed
    (507 from the server) though its turns were logged and fsynced, and the client's retry stored them again.
    Now the snapshot's failure is logged; the add is answered, and the next open replays the log."""
    folder = tmp_path / "m"
    with Memory.open(folder, DEMO, overrides=[*CHEAP, "live.snapshot_after_turns=2"]) as memory:
        memory.add("u", [{"speaker": "Ann", "text": "turn 0"}])
        monkeypatch.setenv("MEMFIT_IO_FAULT", "meta.json:ENOSPC")  # the next snapshot's last file
        added = memory.add("u", [{"speaker": "Ann", "text": "I moved to Lisbon in May."}])
        assert [a.turn_id for a in added] == ["t2"]
        monkeypatch.delenv("MEMFIT_IO_FAULT")
        assert [t["text"] for t in memory.turns("u")] == ["turn 0", "I moved to Lisbon in May."]
    with Memory.open(folder, DEMO, overrides=CHEAP) as memory:
        assert [t["turn_id"] for t in memory.turns("u")] == ["t1", "t2"]
        # a delete's batch ends with the store's own snapshot (EpisodeStore._end_batch): stored, so answered
        def full_disk() -> None:
            raise StorageError(str(folder / "store" / "snapshots"), "No space left on device", errno.ENOSPC)

        monkeypatch.setattr(memory.store, "snapshot", full_disk)
        assert memory.delete("u", ["t1"])["episodes"] == 1
        monkeypatch.undo()
    with Memory.open(folder, DEMO, overrides=CHEAP) as memory:
        assert [t["turn_id"] for t in memory.turns("u")] == ["t2"]


def test_a_search_that_breaks_the_batched_read_fails_alone(tmp_path: Path, monkeypatch) -> None:
    """A search that passes the checks but makes the batched read raise fails alone: the others of its
    batch are read again alone and answered. (The method's read is made to raise for one query.)"""
    with Memory.open(tmp_path / "m", DEMO, overrides=CHEAP) as memory:
        memory.add(["u1", "u2"], [[{"speaker": "Ann", "text": "I keep bees."}], [{"speaker": "Bob", "text": "goats"}]])
        read = memory.method.read

        def fragile(run, *args, **kwargs):  # noqa: ANN001, ANN202 - the method seam's read
            if any(q.question == "poison" for q in run.questions):
                raise RuntimeError("the read broke")
            return read(run, *args, **kwargs)

        monkeypatch.setattr(memory.method, "read", fragile)
        out = memory.search_batch([("u1", ["bees"], 1), ("u2", ["poison"], 1), ("u2", ["goats"], 1)])
        assert out[0][0][0].text == "I keep bees." and out[2][0][0].text == "goats"
        assert isinstance(out[1], RuntimeError)
        answers = memory.answer_batch([("u1", ["bees?"], 1), ("u2", ["poison"], 1)])
        assert answers[0][0].hits[0].text == "I keep bees." and isinstance(answers[1], RuntimeError)


def test_queries_are_checked_before_they_reach_a_batch(tmp_path: Path) -> None:
    with Memory.open(tmp_path / "m", DEMO, overrides=CHEAP) as memory:
        memory.add("u1", [{"speaker": "Ann", "text": "I keep bees."}])
        for queries, k, message in [(["bees \ud800"], 3, r"queries\[0\]: holds a lone surrogate"),
                                    (["bees " * 9000], 3, r"queries\[0\]: 9,000 words; a query has at most 8,192"),
                                    (["bees"], True, "an integer >= 1"), (["bees"], 2.0, "an integer >= 1")]:
            with pytest.raises(ValueError, match=message):
                memory.search("u1", queries, k=k)
        # an answer's question_date is quoted by its prompt: text, and text the cache can encode
        for date, message in [("\ud800", "question_date: holds a lone surrogate"), (20240302, "got int")]:
            assert isinstance(memory.answer_batch([("u1", ["bees?"], 3, date)])[0], ValueError)
            with pytest.raises(ValueError, match=message):
                memory.answer("u1", ["bees?"], question_date=date)
        # one id given where a list is asked for was read letter by letter ("t1" as "t", "1")
        with pytest.raises(TypeError, match=r"delete: turn_ids must be a list of strings, got str 't1'"):
            memory.delete("u1", "t1")
        with pytest.raises(TypeError, match=r"consolidate: user_ids must be a list of strings, got str 'u1'"):
            memory.consolidate("u1")
        assert len(memory.turns("u1")) == 1


def _unopenable_as_older_code_left_it(folder: Path) -> None:
    """A live memory whose log holds what older code logged before refusing it: a live add of 64 speakers (a
    memory record and 64 episodes), then two turns of later adds, one of them naming that memory."""
    with Memory.open(folder, DEMO, overrides=CHEAP) as memory:
        memory.add("u1", [{"speaker": "Ann", "text": "I keep bees.", "turn_id": "a1"}])
    log = RecordLog(folder / "store" / "log.jsonl", fsync=True)
    header = log.records[0]
    date = "DATE:  | Speaker"
    refused = [{"t": "memory", "memory": 1, "id": "u2", "speakers": []}] + [
        {"t": "episode", "row": 1 + i, "memory": 1, "session": "live", "turn": f"t{i + 1}", "speaker": f"s{i}",
         "ts": "", "date": "", "images": [], "text": f"{date} s{i} says: hello {i}"} for i in range(64)]
    later = [{"t": "episode", "row": 1, "memory": 1, "session": "live", "turn": "t1", "speaker": "s0", "ts": "",
              "date": "", "images": [], "text": f"{date} s0 says: acknowledged"},
             {"t": "episode", "row": 2, "memory": 0, "session": "live", "turn": "a2", "speaker": "Ann", "ts": "",
              "date": "", "images": [], "text": f"{date} Ann says: more bees"}]
    log.append([*refused, {"t": "commit", "records": len(refused)}, *later, {"t": "commit", "records": 2}])
    log.close()
    assert header["t"] == "header"


def _repaired_as_expected(folder: Path) -> None:
    with Memory.open(folder, DEMO, overrides=CHEAP) as memory:
        assert [t["text"] for t in memory.turns("u1")] == ["I keep bees.", "more bees"]
        assert [t["text"] for t in memory.turns("u2")] == ["acknowledged"]
        assert memory.search("u2", ["acknowledged"], k=1)[0][0].text == "acknowledged"


def test_a_log_that_older_code_left_unopenable_is_named_and_repaired(tmp_path: Path) -> None:
    """Older code logged a live add of 64 speakers before refusing it: replay stopped with a traceback
    and every user lost the memory. Now the open names the record and `memfit store repair` drops that
    batch (keeping its memory record, which later batches name), leaving every other turn as it was."""
    folder = tmp_path / "m"
    _unopenable_as_older_code_left_it(folder)
    with pytest.raises(DataError, match=r"record \d+ \(episode\).*would have 64 speakers|more than 63 speakers") as info:
        Memory.open(folder, DEMO, overrides=CHEAP)
    assert f"memfit store repair {folder / 'store'}" in str(info.value)
    cli = [sys.executable, "-m", "memfit_gpu.cli", "store", "repair", str(folder)]
    dry = subprocess.run([*cli, "--dry-run"], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert dry.returncode == 0 and "would drop 1 of 3 write batches (64 records)" in dry.stdout, dry.stdout + dry.stderr
    done = subprocess.run(cli, capture_output=True, text=True, cwd=REPO, timeout=300)
    assert done.returncode == 0 and "dropped 1 of 3 write batches" in done.stdout, done.stdout + done.stderr
    assert len(list((folder / "store").glob("log.jsonl.before-repair-*"))) == 1
    dropped = [json.loads(line) for f in (folder / "store").glob("dropped-*.jsonl") for line in f.read_text().splitlines()]
    assert len([r for r in dropped if r["t"] == "episode"]) == 64
    _repaired_as_expected(folder)
    again = subprocess.run(cli, capture_output=True, text=True, cwd=REPO, timeout=300)
    assert "nothing to repair" in again.stdout


def test_a_store_whose_log_is_gone_is_refused_not_opened_empty(tmp_path: Path) -> None:
    """A store folder with snapshots but no log (moved away, or lost between two renames of an older repair)
    opened as an empty memory, and the next add started a new log. It is refused now, the folder unchanged."""
    folder = tmp_path / "m"
    with Memory.open(folder, DEMO, overrides=CHEAP) as memory:
        memory.add("u1", [{"speaker": "Ann", "text": "I keep bees."}])
    store = folder / "store"
    assert any(p.name.isdigit() for p in (store / "snapshots").iterdir())
    (store / "log.jsonl").rename(store / "log.jsonl.before-repair-x")
    before = sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))
    for _ in range(2):
        with pytest.raises(StoreCorruptError, match=r"log\.jsonl: missing or empty, while snapshots/"):
            Memory.open(folder, DEMO, overrides=CHEAP)
        assert sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) == before
        (store / "log.jsonl").touch()  # an empty log is no log either
        before = sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))
    (store / "log.jsonl.before-repair-x").replace(store / "log.jsonl")
    with Memory.open(folder, DEMO, overrides=CHEAP) as memory:
        assert memory.users() == ["u1"]


def test_a_repair_killed_at_each_durable_write_is_finished_by_the_same_command(tmp_path: Path) -> None:
    """`memfit store repair` SIGKILLed at each durable write it crosses, then run again: the memory opens
    repaired. (It had renamed the old log away before renaming the new one in: a kill between left no log,
    which opens as an empty memory.)"""
    folder = tmp_path / "m"
    _unopenable_as_older_code_left_it(folder)
    cli = [sys.executable, "-m", "memfit_gpu.cli", "store", "repair"]
    reference, trace = tmp_path / "reference", tmp_path / "repair.trace"
    shutil.copytree(folder, reference)
    done = subprocess.run([*cli, str(reference)], capture_output=True, text=True, cwd=REPO, timeout=300,
                          env=memfit_env(MEMFIT_FAULT_TRACE=str(trace)))
    assert done.returncode == 0, done.stderr
    seen: dict[str, int] = {}
    points = []
    for name, _ in parse_trace(trace):
        seen[name] = seen.get(name, 0) + 1
        points.append(f"{name}:{seen[name]}")
    assert [p.split(":")[0] for p in points if p.startswith("repair.")][-3:] == [
        "repair.staged", "repair.backup", "repair.log"], points
    for point in points:
        killed_dir = tmp_path / point.replace(":", "-")
        shutil.copytree(folder, killed_dir)
        killed = subprocess.run([*cli, str(killed_dir)], capture_output=True, text=True, cwd=REPO, timeout=300,
                                env=memfit_env(MEMFIT_FAULT=point))
        assert killed.returncode == -signal.SIGKILL, (point, killed.stderr[-2000:])
        assert (killed_dir / "store" / "log.jsonl").is_file(), point
        again = subprocess.run([*cli, str(killed_dir)], capture_output=True, text=True, cwd=REPO, timeout=300,
                               env=memfit_env())
        assert again.returncode == 0, (point, again.stderr[-2000:])
        _repaired_as_expected(killed_dir)
        shutil.rmtree(killed_dir)
