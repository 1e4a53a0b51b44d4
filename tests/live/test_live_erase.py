"""Erase means gone: after a user is deleted and the memory compacted, no byte of the user's text and not
its id is in any file under the memory's folder (the store, its snapshots, cache.sqlite with its WAL,
ledger.json, LightMem's log, temporary files), nor in the server's log at the default level, while the
other user's turns, summaries, notes and cached answers are all still there.

The reader is the echo backend (tests/seam_echo_backend.py) answering with the first `EXCERPT 1` line of
its prompt: a summary, a LightMem note or an answer made over a user's turns then quotes them, as a real
model's do (the probe found a real summary quoting `The Zorblaxian vault code is quibbleflux...`).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
import seam_echo_backend  # noqa: F401  (registers reader.backend=echo)
from support.env import memfit_env
from support.files import files_holding
from support.gates import gate
from support.live_server import DEMO, LiveServer

from memfit_gpu.data.schema import DataError
from memfit_gpu.faults import parse_trace
from memfit_gpu.live import Memory
from memfit_gpu.serve.keys import new_key
from memfit_gpu.store import compaction
from memfit_gpu.store.episodes import StoreClosedError

REPO = Path(__file__).resolve().parents[2]
OVERRIDES = ["rerank.backend=none", "reader.backend=echo", "live.consolidate=manual", "summary.enabled=true",
             "summary.min_chars=1"]
ERASED, KEPT = "victim-7", "keeper-3"
SECRETS = ["Zorblaxian", "quibbleflux", ERASED]
KEPT_WORDS = ["mauveish", "Glimmerwick", KEPT]

pytestmark = pytest.mark.slow  # real MiniLM, real store


def turns(user: str) -> list[dict[str, str]]:
    if user == ERASED:
        words = "The Zorblaxian vault code is quibbleflux"
    else:
        words = "The Glimmerwick harbor lantern glows mauveish"
    return [{"speaker": "Ann" if user == ERASED else "Bob", "text": f"{words} {i}.", "turn_id": f"t{i}",
             "timestamp": f"2024-03-{1 + i // 8:02d}T10:{i % 60:02d}:00"} for i in range(40)]

@pytest.fixture(autouse=True)
def _echo_quotes_the_first_excerpt(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEMFIT_TEST_ECHO_PREFIX", "EXCERPT 1")


@pytest.mark.parametrize("method", ["memfit", "lightmem_slm"])
def test_delete_user_then_compact_leaves_no_byte_of_the_user(tmp_path: Path, method: str) -> None:
    folder = tmp_path / "memory"
    memory = Memory.open(folder, DEMO, overrides=OVERRIDES, method=method)
    try:
        memory.add([ERASED, KEPT], [turns(ERASED), turns(KEPT)])
        written = memory.consolidate()
        assert sum(written.values()) > 0, written  # summaries (memfit) / notes (lightmem) over both users
        assert "quibbleflux" in memory.answer(ERASED, ["What is the vault code?"])[0].raw_output
        kept_answer = memory.answer(KEPT, ["What glows?"])[0]
        assert "mauveish" in kept_answer.raw_output
        kept_hits = memory.search(KEPT, ["harbor lantern"], k=5)[0]
        before = files_holding(folder, SECRETS)
        assert any(f.startswith("cache.sqlite") for f in before) and "store/log.jsonl" in before, before
        counts = memory.delete_user(ERASED)
        assert counts["episodes"] == 40
        compacted = memory.compact()
        assert compacted["users_erased"] == 1 and compacted["cache_responses_dropped"] > 0, compacted
        assert files_holding(folder, SECRETS) == {}  # while it is open (the WAL emptied too)
        # the other user: every turn, its hits, its cached answer (served again, not asked again)
        assert [t["text"] for t in memory.turns(KEPT)] == [t["text"] for t in turns(KEPT)]
        again = memory.search(KEPT, ["harbor lantern"], k=5)[0]
        assert [(h.text, h.turn_ids) for h in again] == [(h.text, h.turn_ids) for h in kept_hits]
        calls = memory.ledger.roles["answer"].calls
        assert memory.answer(KEPT, ["What glows?"])[0].raw_output == kept_answer.raw_output
        assert memory.ledger.roles["answer"].calls == calls  # a cache hit
        assert memory.users() == [KEPT]
    finally:
        memory.close()
    assert files_holding(folder, SECRETS) == {}
    assert set(files_holding(folder, KEPT_WORDS)) >= {"cache.sqlite", "store/log.jsonl"}
    ledger = json.loads((folder / "ledger.json").read_text())
    assert "answer_keys" not in ledger and ledger["answer_calls"] == 3


@pytest.mark.parametrize("method", ["memfit", "lightmem_slm"])
def test_deleting_some_turns_then_compact_leaves_no_byte_of_them(tmp_path: Path, method: str) -> None:
    """A turn deleted from a user who keeps others: after compact() no file holds its text, although the user's
    cached answers and summaries quoted it (they are dropped, and asked again when needed); the user's other
    turns stay, and so does everything of the other user."""
    folder = tmp_path / "memory"
    secret = {"speaker": "Ann", "text": "My bank PIN is zanzibar4417.", "turn_id": "pin",
              "timestamp": "2024-02-01T10:00:00"}  # the earliest: EXCERPT 1
    memory = Memory.open(folder, DEMO, overrides=OVERRIDES, method=method)
    try:
        memory.add([ERASED, KEPT], [[secret, *turns(ERASED)], turns(KEPT)])
        assert sum(memory.consolidate().values()) > 0
        pin = memory.answer(ERASED, ["What is my bank PIN?"])[0].raw_output
        if method == "memfit":  # its answer quotes the turn (LightMem's pack is its notes, which echo no turn)
            assert "zanzibar4417" in pin
            assert any(f.startswith("cache.sqlite") for f in files_holding(folder, ["zanzibar4417"]))
        kept_answer = memory.answer(KEPT, ["What glows?"])[0]
        assert memory.delete(ERASED, ["pin"])["episodes"] == 1
        compacted = memory.compact()
        assert compacted["users_erased"] == 0 and compacted["users_with_deleted_turns"] == 1, compacted
        assert compacted["cache_responses_dropped"] > 0 and compacted["cache_calls_dropped"] == 0, compacted
        assert files_holding(folder, ["zanzibar4417"]) == {}
        assert len(memory.turns(ERASED)) == 40
        assert "quibbleflux" in memory.answer(ERASED, ["What is the vault code?"])[0].raw_output
        calls = memory.ledger.roles["answer"].calls
        assert memory.answer(KEPT, ["What glows?"])[0].raw_output == kept_answer.raw_output
        assert memory.ledger.roles["answer"].calls == calls  # the other user's answer: still a cache hit
    finally:
        memory.close()
    assert files_holding(folder, ["zanzibar4417"]) == {}


PIN = {"speaker": "Ann", "text": "My bank PIN is zanzibar4417.", "turn_id": "pin", "timestamp": "2024-02-01T10:00:00"}


def test_an_answer_read_before_a_compaction_leaves_no_byte_of_a_deleted_turn(tmp_path: Path) -> None:
    """A server reads an answer's pack, then generates beside the memory: a delete and a compaction can come in
    between, and the reply (quoting the deleted turn) was committed to cache.sqlite after the compaction had
    dropped the user's replies, for good. Now the reply of a request read before a compaction is dropped again."""
    folder = tmp_path / "memory"
    with Memory.open(folder, DEMO, overrides=OVERRIDES) as memory:
        memory.add(ERASED, [PIN, *turns(ERASED)])
        prepared = memory.prepare_answers([(ERASED, ["What is my bank PIN?"], 5)])
        memory.delete(ERASED, ["pin"])
        assert memory.compact()["users_with_deleted_turns"] == 1
        (answer,) = memory.finish_answers(prepared)[0]
        assert "zanzibar4417" in answer.raw_output  # read before the delete: it quotes the turn, once
        assert files_holding(folder, ["zanzibar4417"]) == {}
    assert files_holding(folder, ["zanzibar4417"]) == {}


def test_a_compaction_stopped_before_the_cache_is_cleaned_finishes_on_the_next_open(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The users whose replies a compaction drops are recorded before the store is rewritten: stopped after the
    store's swap (a kill, a full disk), the next open drops them, then the record."""
    folder = tmp_path / "memory"
    memory = Memory.open(folder, DEMO, overrides=OVERRIDES)
    memory.add([ERASED, KEPT], [[PIN, *turns(ERASED)], turns(KEPT)])
    assert "zanzibar4417" in memory.answer(ERASED, ["What is my bank PIN?"])[0].raw_output
    memory.delete(ERASED, ["pin"])

    def stopped(*_: object) -> None:
        raise OSError("stopped here")

    monkeypatch.setattr(Memory, "_forget", stopped)
    with pytest.raises(OSError, match="stopped here"):
        memory.compact()
    monkeypatch.undo()
    memory.close()
    assert "zanzibar4417" in str(files_holding(folder, ["zanzibar4417"]))  # in cache.sqlite still
    assert json.loads((folder / "forget.pending.json").read_text()) == {"responses_of": [ERASED]}
    Memory.open(folder, DEMO, overrides=OVERRIDES).close()
    assert files_holding(folder, ["zanzibar4417"]) == {} and not (folder / "forget.pending.json").exists()


def _pin_answered_then_deleted(folder: Path) -> None:
    """A memory of two users whose cached answer quotes the PIN turn, which is then deleted (not compacted)."""
    with Memory.open(folder, DEMO, overrides=OVERRIDES) as memory:
        memory.add([ERASED, KEPT], [[PIN, *turns(ERASED)], turns(KEPT)])
        assert "zanzibar4417" in memory.answer(ERASED, ["What is my bank PIN?"])[0].raw_output
        memory.delete(ERASED, ["pin"])


def test_a_damaged_record_of_whom_to_forget_is_refused_not_skipped(tmp_path: Path) -> None:
    """forget.pending.json names the users whose cached replies a stopped compaction must still drop. Damaged to a
    string, its characters were taken for user ids, nothing was dropped and the record was removed: the erasure
    was skipped. Now the memory is refused, naming the file, which stays for the erasure once it is mended."""
    folder = tmp_path / "memory"
    _pin_answered_then_deleted(folder)
    pending = folder / "forget.pending.json"
    cases = [(json.dumps({"responses_of": ERASED}), "responses_of"), ('{"responses_of": [7]}', "responses_of"),
             ("{}", "responses_of"), ('{"responses_of": [', None)]
    for damaged, field in cases:
        pending.write_text(damaged)
        with pytest.raises(DataError, match=rf"forget\.pending\.json{', field ' + repr(field) if field else ''}"):
            Memory.open(folder, DEMO, overrides=OVERRIDES)
        assert pending.read_text() == damaged
    pending.write_text(json.dumps({"responses_of": [ERASED]}))  # mended: the erasure finishes on open
    Memory.open(folder, DEMO, overrides=OVERRIDES).close()
    assert not pending.exists()


def test_a_live_compaction_killed_at_each_durable_write_still_leaves_no_byte_of_the_turn(tmp_path: Path) -> None:
    """`memfit store compact` of a live memory's folder, SIGKILLed at each durable write it crosses (the record
    of whom to forget, the new store's writes, the swap's steps), then the same command again: the deleted
    turn's text is in no file, and the other user's turns are all there."""
    folder = tmp_path / "memory"
    _pin_answered_then_deleted(folder)
    config = tmp_path / "config.yaml"
    config.write_text(f"defaults: {DEMO}\nrerank:\n  backend: none\nreader:\n  backend: echo\n")
    cli = [sys.executable, "-m", "memfit_gpu.cli", "store", "compact"]
    reference = tmp_path / "reference"
    shutil.copytree(folder, reference)
    trace = tmp_path / "compact.trace"
    done = subprocess.run([*cli, str(reference), "--config", str(config)], capture_output=True, text=True, cwd=REPO,
                          env=memfit_env(plugins="seam_echo_backend", MEMFIT_FAULT_TRACE=str(trace)), timeout=300)
    assert done.returncode == 0, done.stderr
    seen: dict[str, int] = {}
    points = []
    for name, _ in parse_trace(trace):
        seen[name] = seen.get(name, 0) + 1
        if name not in ("store.encode", "reader.load"):  # marks, not durable writes
            points.append(f"{name}:{seen[name]}")
    assert points[0] == "compact.pending:1" and "compact.removed:1" in points, points
    for point in points:
        killed_dir = tmp_path / point.replace(":", "-")
        shutil.copytree(folder, killed_dir)
        killed = subprocess.run([*cli, str(killed_dir), "--config", str(config)], capture_output=True, text=True,
                                cwd=REPO, env=memfit_env(plugins="seam_echo_backend", MEMFIT_FAULT=point), timeout=300)
        assert killed.returncode == -signal.SIGKILL, (point, killed.stderr[-2000:])
        again = subprocess.run([*cli, str(killed_dir), "--config", str(config)], capture_output=True, text=True,
                               cwd=REPO, env=memfit_env(plugins="seam_echo_backend"), timeout=300)
        assert again.returncode == 0, (point, again.stderr[-2000:])
        assert files_holding(killed_dir, ["zanzibar4417"]) == {}, point
        assert not (killed_dir / "forget.pending.json").exists(), point
        with Memory.open(killed_dir, DEMO, overrides=OVERRIDES) as memory:
            assert len(memory.turns(ERASED)) == 40 and len(memory.turns(KEPT)) == 40, point
        shutil.rmtree(killed_dir)


def test_a_lightmem_compaction_killed_after_the_store_swap_is_followed_on_the_next_open(tmp_path: Path) -> None:
    """LightMem's notes name store rows. A compaction SIGKILLed after the store's rows were renumbered
    (`compact.removed`), before the notes followed them, left notes naming other turns (another user's, past
    the end): the next open now lets the method follow, to the notes an uninterrupted compaction writes."""
    folder = tmp_path / "memory"
    with Memory.open(folder, DEMO, overrides=OVERRIDES, method="lightmem_slm") as memory:
        memory.add([ERASED, KEPT], [[PIN, *turns(ERASED)], turns(KEPT)])  # the PIN is row 0: every row moves
        assert memory.consolidate()["mtm_entries"] > 0
        memory.delete(ERASED, ["pin"])
    config = tmp_path / "config.yaml"
    config.write_text(f"defaults: {DEMO}\nmethod: lightmem_slm\nrerank:\n  backend: none\nreader:\n  backend: echo\n")
    cli = [sys.executable, "-m", "memfit_gpu.cli", "store", "compact"]
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    shutil.copytree(folder, reference)
    shutil.copytree(folder, killed)
    done = subprocess.run([*cli, str(reference), "--config", str(config)], capture_output=True, text=True, cwd=REPO,
                          env=memfit_env(plugins="seam_echo_backend"), timeout=300)
    assert done.returncode == 0, done.stderr
    cut = subprocess.run([*cli, str(killed), "--config", str(config)], capture_output=True, text=True, cwd=REPO,
                         env=memfit_env(plugins="seam_echo_backend", MEMFIT_FAULT="compact.removed"), timeout=300)
    assert cut.returncode == -signal.SIGKILL, cut.stderr[-2000:]
    notes = "lightmem/log.jsonl"
    assert (killed / notes).read_bytes() == (folder / notes).read_bytes()  # the old rows, on a renumbered store
    with Memory.open(killed, DEMO, overrides=OVERRIDES, method="lightmem_slm") as memory:
        assert len(memory.turns(ERASED)) == 40 and len(memory.turns(KEPT)) == 40
    assert (killed / notes).read_bytes() == (reference / notes).read_bytes()
    assert files_holding(killed, ["zanzibar4417"]) == {} and not (killed / "forget.pending.json").exists()


@pytest.mark.parametrize("method", ["memfit", "lightmem_slm"])
def test_a_compaction_waits_for_a_consolidation_in_flight(
        tmp_path: Path, method: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A consolidation plans its summaries (LightMem: its notes) over the rows, then calls the LLM without
    holding the memory. A compaction in that gap renumbered the rows and the users: the summaries of one user
    were then stored under another (found by that user's searches and export), and LightMem's notes named
    another user's turns. The compaction now waits for the consolidation in flight."""
    with Memory.open(tmp_path / "memory", DEMO, overrides=OVERRIDES, method=method) as memory:
        memory.add(["gone", KEPT, "other"], [turns(ERASED)[:6], turns(KEPT),
                                             [{"speaker": "Cy", "text": f"Trains are fine {i}.", "turn_id": f"c{i}"}
                                              for i in range(2)]])
        memory.delete_user("gone")  # the first user: a compaction renumbers every later row and user
        # the consolidation's LLM call, held until released
        inside, release = gate(monkeypatch, memory, lambda requests: any(r.role != "answer" for r in requests))
        consolidated: list[dict[str, int]] = []
        compacted: list[dict[str, int]] = []
        consolidating = threading.Thread(target=lambda: consolidated.append(memory.consolidate([KEPT])))
        consolidating.start()
        assert inside.wait(60)
        compacting = threading.Thread(target=lambda: compacted.append(memory.compact()))
        compacting.start()
        compacting.join(2.0)
        assert compacting.is_alive() and not compacted  # waits for the consolidation (it compacted at once)
        release.set()
        consolidating.join(60)
        compacting.join(60)
        assert sum(consolidated[0].values()) > 0 and compacted[0]["users_erased"] == 1
        kept_ids = {t["turn_id"] for t in turns(KEPT)}
        for hit in memory.search("other", ["Glimmerwick harbor lantern"], k=10)[0]:
            assert "Glimmerwick" not in hit.text and not set(hit.turn_ids) & (kept_ids - {"c0", "c1"}), hit
        for hit in memory.search(KEPT, ["Glimmerwick harbor lantern"], k=10)[0]:
            assert set(hit.turn_ids) <= kept_ids, hit
        assert memory.consolidate([KEPT]) is not None  # LightMem's notes name the right rows: no StoreCorruptError
        if method == "memfit":
            store = memory.store
            for row in store.summaries.live_rows(store.memory_of(KEPT)):
                assert {int(store.memory_idx[m]) for m in store.summaries.members[row]} == {store.memory_of(KEPT)}
            assert store.summaries.live_rows(store.memory_of("other")).size == 0


def test_a_lightmem_note_over_a_deleted_turn_is_dropped_though_a_new_turn_took_its_id(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """LightMem's compaction kept a note whose turn ids the compacted store still had: a deleted turn whose id a
    new turn had taken since passed for it, and the note quoting the deleted turn was served again. The notes of
    a user who lost turns now go by name (the next consolidation writes them again)."""
    monkeypatch.setenv("MEMFIT_TEST_ECHO_PREFIX", "- ")  # a note quotes the first turn of its window
    folder = tmp_path / "memory"
    pin = {**PIN, "timestamp": "2024-03-01T09:00:00"}  # the first turn of the first session's first window
    with Memory.open(folder, DEMO, overrides=[*OVERRIDES, "lightmem.mtm_window_turns=6"],
                     method="lightmem_slm") as memory:
        memory.add(ERASED, [pin, *turns(ERASED)])
        assert memory.consolidate()["mtm_entries"] > 0
        assert any(f.startswith("lightmem") for f in files_holding(folder, ["zanzibar4417"]))
        memory.delete(ERASED, ["pin"])
        memory.add(ERASED, [{**pin, "text": "My bank is on Elm Street."}])  # the deleted turn's id, new words
        memory.compact()
        assert files_holding(folder, ["zanzibar4417"]) == {}
        for hit in memory.search(ERASED, ["What is my bank PIN?"], k=10)[0]:
            assert "zanzibar4417" not in hit.text, hit
        assert memory.consolidate()["mtm_entries"] > 0  # written again, over the turns there are


def test_an_add_after_a_compaction_failed_half_way_is_refused_not_lost(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A compaction closes the store's log before it swaps the folders. When the swap failed, a later add was
    acknowledged but held in memory only: gone on the next open. It is refused now, and the next open finishes
    the compaction; the turns stored before it are all there."""
    folder = tmp_path / "memory"
    with Memory.open(folder, DEMO, overrides=OVERRIDES) as memory:
        memory.add(KEPT, turns(KEPT)[:5])
        memory.delete(KEPT, ["t0"])

        def busy(path: Path) -> None:
            raise OSError(errno.EBUSY, "Device or resource busy", str(path))

        monkeypatch.setattr(compaction, "swap", busy)
        with pytest.raises(OSError, match="busy"):
            memory.compact()
        with pytest.raises(StoreClosedError, match="nothing was written. Open it again"):
            memory.add(KEPT, [{"speaker": "Bob", "text": "Acknowledged, then lost.", "turn_id": "late"}])
    monkeypatch.undo()
    with Memory.open(folder, DEMO, overrides=OVERRIDES) as memory:
        assert [t["turn_id"] for t in memory.turns(KEPT)] == ["t1", "t2", "t3", "t4"]
        memory.add(KEPT, [{"speaker": "Bob", "text": "Stored for good.", "turn_id": "late"}])
    with Memory.open(folder, DEMO, overrides=OVERRIDES) as memory:
        assert [t["turn_id"] for t in memory.turns(KEPT)] == ["t1", "t2", "t3", "t4", "late"]


def test_two_users_never_share_a_cached_reply(tmp_path: Path) -> None:
    """The same turns and the same question for two users: two reader calls, one cached reply each (a user
    cannot time whether another asked the same, and erasing one user's replies leaves none of them behind)."""
    with Memory.open(tmp_path / "memory", DEMO, overrides=OVERRIDES) as memory:
        memory.add([ERASED, KEPT], [turns(ERASED), turns(ERASED)])
        first = memory.answer(ERASED, ["What is the vault code?"])[0]
        second = memory.answer(KEPT, ["What is the vault code?"])[0]
        assert first.raw_output == second.raw_output
        assert (memory.ledger.roles["answer"].calls, memory.ledger.roles["answer"].cached) == (2, 0)
        memory.answer(KEPT, ["What is the vault code?"])
        assert (memory.ledger.roles["answer"].calls, memory.ledger.roles["answer"].cached) == (2, 1)


@pytest.mark.parametrize("config_inside", [False, True], ids=["config-elsewhere", "config-in-the-folder"])
def test_the_store_commands_erase_a_live_users_every_byte_too(tmp_path: Path, config_inside: bool) -> None:
    """`memfit store delete` of every turn, then `memfit store compact`, on a live memory's folder; also where the
    operator keeps the config the memory is served with in its folder (config.yaml, which Memory.open allows):
    it is still a live memory's folder, compacted as Memory.compact does it, not a run directory's store."""
    folder = tmp_path / "memory"
    with Memory.open(folder, DEMO, overrides=OVERRIDES) as memory:
        memory.add([ERASED, KEPT], [turns(ERASED), turns(KEPT)])
        memory.consolidate()
        memory.answer(ERASED, ["What is the vault code?"])
    config = (folder if config_inside else tmp_path) / "config.yaml"
    config.write_text(f"defaults: {DEMO}\nrerank:\n  backend: none\nreader:\n  backend: echo\n")
    env = memfit_env(plugins="seam_echo_backend")
    cli = [sys.executable, "-m", "memfit_gpu.cli", "store"]
    delete = subprocess.run([*cli, "delete", str(folder), "--config", str(config), "--memory", ERASED,
                             "--no-resummarize", *sum((["--turn", f"t{i}"] for i in range(40)), [])],
                            capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    assert delete.returncode == 0, delete.stderr
    compact = subprocess.run([*cli, "compact", str(folder), "--config", str(config)], capture_output=True, text=True,
                             cwd=REPO, env=env, timeout=300)
    assert compact.returncode == 0, compact.stderr
    assert "1 memory(ies) with nothing left are gone" in compact.stdout, compact.stdout
    assert files_holding(folder, SECRETS) == {}
    with Memory.open(folder, DEMO, overrides=OVERRIDES) as memory:
        assert memory.users() == [KEPT] and len(memory.turns(KEPT)) == 40


def test_a_served_memory_erases_a_user_and_its_log_names_nothing_of_it(tmp_path: Path) -> None:
    """Through a real `memfit serve`: the user's turns, an answer over them, DELETE, then an admin's
    compact; then every file under the folder and the server's log hold nothing of the user."""
    keys_file = tmp_path / "keys.jsonl"
    key = new_key(keys_file, [ERASED, KEPT])
    admin = new_key(keys_file, ["admin-1"], admin=True)
    server = LiveServer(tmp_path / "memory", keys_file, ["rerank.backend=none", "reader.backend=echo",
                                                          "live.consolidate=manual", "summary.enabled=false"])
    os.environ["MEMFIT_TEST_ECHO_PREFIX"] = "EXCERPT 1"
    try:
        server.start()
    finally:
        del os.environ["MEMFIT_TEST_ECHO_PREFIX"]
    try:
        with httpx.Client(base_url=server.url, timeout=120, headers={"Authorization": f"Bearer {key}"}) as client:
            for user in (ERASED, KEPT):
                assert client.post(f"/v1/users/{user}/turns", json={"turns": turns(user)}).status_code == 200
            reply = client.post(f"/v1/users/{ERASED}/answer", json={"questions": ["What is the vault code?"]}).json()
            assert "quibbleflux" in reply["answers"][0]["raw_output"]
            assert client.delete(f"/v1/users/{ERASED}").status_code == 200
            compacted = client.post("/v1/compact", headers={"Authorization": f"Bearer {admin}"})
            assert compacted.status_code == 200 and compacted.json()["compacted"]["users_erased"] == 1
            assert files_holding(tmp_path / "memory", SECRETS) == {}
            assert client.get(f"/v1/users/{ERASED}/turns").status_code == 404
            assert len(client.get(f"/v1/users/{KEPT}/turns").json()["turns"]) == 40
        assert server.stop() == 0
    finally:
        server.kill()
    assert files_holding(tmp_path / "memory", SECRETS) == {}
    log = server.log.read_bytes()
    assert not [w for w in SECRETS if w.encode() in log]
