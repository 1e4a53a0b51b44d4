"""`memfit store delete` and `memfit store compact` on a run directory and on a store folder: the run's
config and reader, the run directory's lock, one-line errors with exit code 2, nothing left on disk."""

from __future__ import annotations

import fcntl
import json
import sqlite3
from pathlib import Path

import pytest

from memfit_gpu.cli import main
from memfit_gpu.cli.store import resolve_target
from memfit_gpu.config import load_config, to_yaml
from memfit_gpu.data.schema import Memory, Session, Turn
from memfit_gpu.live import Memory as LiveMemory
from memfit_gpu.store import EpisodeStore

pytestmark = pytest.mark.slow  # the real encoder (and, to rebuild a summary, the real SmolLM2 reader)

REPO = Path(__file__).resolve().parents[2]
MAY, JUNE = "1:56 pm on 8 May, 2023", "10:37 am on 27 June, 2023"


def _memories() -> list[Memory]:
    def turn(turn_id, speaker, text, date, ts):
        return Turn(turn_id=turn_id, speaker=speaker, text=text, timestamp=ts, date_text=date)

    turns = [
        turn("D1:1", "Caroline", "I went to the LGBTQ support group yesterday.", MAY, "2023-05-08T13:56:00"),
        turn("D1:2", "Melanie", "That's great, Caroline! How did it feel?", MAY, "2023-05-08T13:56:00"),
        turn("D1:3", "Caroline", "It was powerful, I felt accepted.", MAY, "2023-05-08T13:56:00"),
        turn("D2:1", "Melanie", "I painted a sunrise by the lake last week.", JUNE, "2023-06-27T10:37:00"),
        turn("D2:2", "Caroline", "Melanie, that sounds lovely! Send me a picture.", JUNE, "2023-06-27T10:37:00"),
    ]
    return [Memory("conv-a", [Session("s1", MAY, "2023-05-08T13:56:00", turns[:3]),
                              Session("s2", JUNE, "2023-06-27T10:37:00", turns[3:])], speakers=["Caroline", "Melanie"])]


def _bullets(prompts: list[str]) -> list[str]:
    """Deterministic first summaries (the store's content, not a reported number): the excerpt bullets."""
    return [" / ".join(line[2:] for line in p.splitlines() if line.startswith("- ")) for p in prompts]


@pytest.fixture
def run_dir(tmp_path: Path, bi_encoder) -> Path:
    """A run directory as `memfit run` leaves it up to its store: config.yaml (smoke, with summaries, the
    SmolLM2 reader), timings.json (written from the first stage on, before any store) and store/ with one
    memory and its summary."""
    cfg = load_config(REPO / "configs" / "smoke.yaml", ["summary.enabled=true", "summary.max_new_tokens=40"])
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(to_yaml(cfg))
    (run / "timings.json").write_text('{"load": 0.5}')
    store = EpisodeStore(run / "store", cfg, bi_encoder)
    store.add_memories(_memories(), progress=False)
    assert store.build_summaries(_bullets, progress=False) == 1
    store.close()
    return run


def _reopen(run: Path, bi_encoder) -> EpisodeStore:
    return EpisodeStore(run / "store", load_config(run / "config.yaml"), bi_encoder)


def _files_containing(root: Path, needle: bytes) -> list[str]:
    return [str(p) for p in sorted(root.rglob("*")) if p.is_file() and needle in p.read_bytes()]


def _error(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("memfit store: error: ")
    return err[-1]


def test_delete_rebuilds_the_summary_with_the_run_reader(run_dir: Path, bi_encoder, capsys):
    assert main(["store", "delete", str(run_dir), "--memory", "conv-a", "--turn", "D1:2"]) == 0
    out = capsys.readouterr().out
    assert (f"memfit store delete: {run_dir / 'store'}: deleted 1 turn(s) of conv-a (D1:2); 1 summary(ies) "
            f"retired, 1 rebuilt (1 reader prompt(s))") in out
    assert "is a finished experiment" in out and f"memfit store compact {run_dir}" in out
    store = _reopen(run_dir, bi_encoder)
    assert store.deleted.tolist() == [False, True, False, False, False]
    assert [s.deleted for s in store.summaries] == [True, False]
    rebuilt = store.summaries[1]
    assert rebuilt.members.tolist() == [0, 2, 3, 4] and rebuilt.replaces == 0
    assert rebuilt.text == rebuilt.text.strip() and len(rebuilt.text) >= 20
    assert "How did it feel" not in rebuilt.text
    with sqlite3.connect(run_dir / "cache.sqlite") as db:  # through the run's response cache
        assert db.execute("select count(*) from responses").fetchone()[0] == 1


def test_delete_without_resummarising_needs_no_reader(run_dir: Path, bi_encoder, capsys):
    assert main(["store", "delete", str(run_dir / "store"), "--memory", "conv-a", "--turn", "D1:2", "--turn", "D2:1",
                 "--no-resummarize"]) == 0
    assert "deleted 2 turn(s) of conv-a (D1:2, D2:1); 1 summary(ies) retired, 0 rebuilt\n" in capsys.readouterr().out
    assert not (run_dir / "cache.sqlite").exists()
    store = _reopen(run_dir, bi_encoder)
    assert store.deleted.tolist() == [False, True, False, True, False] and store.summaries.live_rows().tolist() == []


def test_delete_refuses_a_run_directory_that_is_held(run_dir: Path, capsys):
    before = (run_dir / "store" / "log.jsonl").read_bytes()
    with open(run_dir / ".lock", "a") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        line = _error(capsys, ["store", "delete", str(run_dir), "--memory", "conv-a", "--turn", "D1:2"])
        assert f"{run_dir} is in use by another memfit process (pid unknown); a run in progress?" in line
        line = _error(capsys, ["store", "compact", str(run_dir)])
        assert "is in use by another memfit process" in line
    assert (run_dir / "store" / "log.jsonl").read_bytes() == before


def test_import_into_a_run_directory_is_refused_and_changes_nothing(run_dir: Path, capsys):
    """`store import` opened a run directory as a live memory and appended to its store (a finished
    experiment's); a run directory is no live memory's folder for any command now."""
    (run_dir / "timings.json").write_text('{"load": 0.5, "build": 3.0}')  # as `memfit run` leaves it after a stage
    before = (run_dir / "store" / "log.jsonl").read_bytes()
    line = _error(capsys, ["store", "import", str(run_dir), str(REPO / "configs" / "data" / "example.jsonl"),
                           "--config", str(run_dir / "config.yaml")])
    assert line.endswith(f"{run_dir}: a run directory (config.yaml inside), a finished experiment whose packs and "
                         "predictions were made from its store as it is: not opened as a live memory (open a new "
                         "folder; `memfit store import` adds an own-data file to it)")
    assert (run_dir / "store" / "log.jsonl").read_bytes() == before


def test_delete_of_an_unknown_turn_is_a_one_line_error_and_changes_nothing(run_dir: Path, capsys):
    before = (run_dir / "store" / "log.jsonl").read_bytes()
    line = _error(capsys, ["store", "delete", str(run_dir), "--memory", "conv-a", "--turn", "D1:1", "--turn", "D9:9"])
    assert line.endswith(f"{run_dir / 'store'}: EpisodeStore: memory 'conv-a' has no live turn 'D9:9'")
    line = _error(capsys, ["store", "delete", str(run_dir), "--memory", "conv-z", "--turn", "D1:1"])
    assert "no memory 'conv-z'" in line
    assert (run_dir / "store" / "log.jsonl").read_bytes() == before


def test_compact_leaves_no_trace_of_the_deleted_turn(run_dir: Path, bi_encoder, capsys):
    store = _reopen(run_dir, bi_encoder)
    text = store.text[1].encode()
    body = store.body(1).encode()
    vector = store.episode_dense.vectors([1]).tobytes()
    summary = store.summaries.text[0].encode()  # quotes the turn
    store.close()
    assert main(["store", "delete", str(run_dir), "--memory", "conv-a", "--turn", "D1:2", "--no-resummarize"]) == 0
    for needle in (text, body, vector, summary):
        assert _files_containing(run_dir / "store", needle)  # tombstoned, still on disk
    capsys.readouterr()
    assert main(["store", "compact", str(run_dir)]) == 0
    assert (f"memfit store compact: {run_dir / 'store'}: 5 -> 4 episode rows, 1 -> 0 summary rows, 14 -> 8 log "
            f"records") in capsys.readouterr().out
    for needle in (text, body, vector, summary):
        assert _files_containing(run_dir / "store", needle) == []
    assert sorted(p.name for p in run_dir.iterdir()) == [".lock", "config.yaml", "store", "timings.json"]
    store = _reopen(run_dir, bi_encoder)
    assert store.size == 4 and store.turn_id.tolist() == ["D1:1", "D1:3", "D2:1", "D2:2"]


def test_a_store_folder_outside_a_run_directory_needs_its_config(run_dir: Path, tmp_path: Path, capsys):
    bare = tmp_path / "elsewhere" / "store"
    bare.parent.mkdir()
    (run_dir / "store").rename(bare)
    line = _error(capsys, ["store", "compact", str(bare)])
    assert line.endswith(f"{bare}: a store folder outside a run directory needs --config (the encoder and index "
                         f"settings it was built with)")
    assert main(["store", "compact", str(bare), "--config", str(run_dir / "config.yaml")]) == 0
    assert (bare.parent / ".store.lock").exists()  # the lock of a bare store lies beside it
    line = _error(capsys, ["store", "compact", str(tmp_path / "nothing")])
    assert line.endswith("nothing: neither a run directory (config.yaml and timings.json, provenance.json, "
                         "packs.jsonl or DONE), a live memory's folder (store/ and .lock) nor a store folder "
                         "(log.jsonl)")
    line = _error(capsys, ["store", "compact", str(run_dir)])  # its store has moved away
    assert line.endswith(f"{run_dir / 'store' / 'log.jsonl'}: no store there (was the run's build stage reached?)")


def _store_state(run: Path, bi_encoder) -> dict:
    """What a store holds, as its readers see it: the log's bytes, and the rows and vectors it reopens with."""
    store = _reopen(run, bi_encoder)
    try:
        rows = list(range(store.size))
        return {"log": (run / "store" / "log.jsonl").read_bytes(), "turns": store.turn_id.tolist(),
                "texts": [store.text[r] for r in rows], "deleted": store.deleted.tolist(),
                "vectors": store.episode_dense.vectors(rows).tobytes(), "summaries": len(store.summaries),
                "snapshots": sorted(p.name for p in (run / "store" / "snapshots").iterdir())}
    finally:
        store.close()


def test_compact_killed_at_each_step_then_rerun_gives_the_undisturbed_store(run_dir: Path, bi_encoder, tmp_path: Path,
                                                                           capsys, monkeypatch):
    """Killed between the swap's two renames a compaction used to leave no store/ folder, and `memfit
    store compact` / `memfit store delete` answered "no store there". Killed (SIGKILL) at each step of
    the compaction, the store commands finish or undo it, and a rerun gives the undisturbed result.

    Each killed compaction is a process of its own, forked from one that loaded the encoder once first
    (with one OpenMP thread, so no thread pool is forked): one interpreter start, one set of imports."""
    import json
    import os
    import shutil
    import signal
    import subprocess
    import sys

    from memfit_gpu.faults import FAULT_ENV, TRACE_ENV, parse_trace

    assert main(["store", "delete", str(run_dir), "--memory", "conv-a", "--turn", "D1:2", "--no-resummarize"]) == 0
    reference = tmp_path / "reference"
    shutil.copytree(run_dir, reference)
    monkeypatch.setenv(TRACE_ENV, str(tmp_path / "compact.trace"))
    assert main(["store", "compact", str(reference)]) == 0
    monkeypatch.delenv(TRACE_ENV)
    want = _store_state(reference, bi_encoder)
    seen: dict[str, int] = {}
    points = []
    for name, _ in parse_trace(tmp_path / "compact.trace"):
        seen[name] = seen.get(name, 0) + 1
        if name not in ("store.encode", "reader.load"):  # marks, not durable writes
            points.append(f"{name}:{seen[name]}")
    assert {"store.log", "store.snapshot", "compact.built", "compact.retired", "compact.swapped",
            "compact.removed"} <= {p.split(":")[0] for p in points}
    env = {k: v for k, v in os.environ.items() if k not in (FAULT_ENV, TRACE_ENV)}
    runs = []
    for index, point in enumerate(points):
        runs.append((point, str(tmp_path / f"k{index}")))
        shutil.copytree(run_dir, runs[-1][1])
    forks = (
        "import json, os, sys\n"
        "import memfit_gpu.cli, memfit_gpu.cli.store, memfit_gpu.config, memfit_gpu.index.encoders\n"
        # what loading the encoder imports (transformers and its company) is paid once, here
        f"memfit_gpu.index.encoders.load_bi_encoder(memfit_gpu.config.load_config({str(run_dir / 'config.yaml')!r}).index)\n"
        "codes = []\n"
        "for point, run in json.loads(sys.argv[1]):\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        f"        os.environ[{FAULT_ENV!r}] = point\n"
        "        os._exit(memfit_gpu.cli.main(['store', 'compact', run]))\n"
        "    codes.append(os.waitpid(pid, 0)[1])\n"
        "print(json.dumps(codes))\n"
    )
    proc = subprocess.run([sys.executable, "-c", forks, json.dumps(runs)], env={**env, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    statuses = json.loads(proc.stdout.strip().splitlines()[-1])
    capsys.readouterr()
    for (point, folder), status in zip(runs, statuses, strict=True):
        run = Path(folder)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (point, status, proc.stderr[-2000:])
        if point.startswith("compact.retired"):  # between the renames: no store/ folder at all
            assert not (run / "store").exists()
            other = tmp_path / "delete-after-kill"
            shutil.copytree(run, other)
            assert main(["store", "delete", str(other), "--memory", "conv-a", "--turn", "D2:1", "--no-resummarize"]) == 0
            store = _reopen(other, bi_encoder)
            assert store.turn_id.tolist() == ["D1:1", "D1:3", "D2:1", "D2:2"]  # the compaction was finished
            assert store.deleted.tolist() == [False, False, True, False]
            store.close()
        assert main(["store", "compact", str(run)]) == 0, (point, capsys.readouterr().err)
        assert _store_state(run, bi_encoder) == want, point
        assert sorted(p.name for p in run.iterdir()) == [".lock", "config.yaml", "store", "timings.json"], point


def _repairable_store(folder: Path) -> Path:
    """A store folder whose log an older memfit_gpu left unopenable (a live add of 64 speakers logged before it
    was refused, and a later batch naming its memory), ending in a torn record a killed writer left."""
    from memfit_gpu.store.log import RecordLog

    def episode(row: int, memory: int, turn: str, speaker: str, text: str) -> dict:
        return {"t": "episode", "row": row, "memory": memory, "session": "live", "turn": turn, "speaker": speaker,
                "ts": "", "date": "", "images": [], "text": f"DATE:  | Speaker {speaker} says: {text}"}

    first = [{"t": "memory", "memory": 0, "id": "u1", "speakers": []}, episode(0, 0, "a1", "Ann", "I keep bees.")]
    refused = [{"t": "memory", "memory": 1, "id": "u2", "speakers": []},
               *(episode(1 + i, 1, f"t{i + 1}", f"s{i}", f"hello {i}") for i in range(64))]
    later = [episode(1, 1, "t1", "s0", "acknowledged"), episode(2, 0, "a2", "Ann", "more bees")]
    log = RecordLog(folder / "log.jsonl")
    log.append([{"t": "header", "format": 2, "encoder": "all-MiniLM-L6-v2", "dim": 384}, *first,
                {"t": "commit", "records": 2}, *refused, {"t": "commit", "records": 65}, *later,
                {"t": "commit", "records": 2}])
    log.close()
    with open(folder / "log.jsonl", "ab") as handle:
        handle.write(b'0000004a 1234abcd {"t":"episode","row":3')
    return folder


def test_repair_dry_run_changes_no_byte_and_says_what_the_repair_does(tmp_path: Path, capsys):
    """`memfit store repair --dry-run` ("report only; change nothing") read the log as a writer opens it,
    cutting its torn tail off. Now every byte of the store stays, and it reports what the repair then does."""
    store = _repairable_store(tmp_path / "store")
    before = {p.name: p.read_bytes() for p in store.iterdir()}
    assert main(["store", "repair", str(store), "--dry-run"]) == 0
    dry = capsys.readouterr().out.splitlines()
    assert {p.name: p.read_bytes() for p in store.iterdir()} == before
    assert main(["store", "repair", str(store)]) == 0
    done = capsys.readouterr().out.splitlines()
    dropped = ("  log record 69: EpisodeStore: EpisodeStore: memory 'u2' has more than 63 speakers (65 records, its 1 "
               "memory record(s) kept)")
    assert dry == ["  the log ends in a torn record of 40 bytes (a killed writer's): the repair cuts it off, as any "
                   "open does", dropped,
                   f"memfit store repair: {store}: would drop 1 of 3 write batches (64 records)"]
    assert done[:2] == ["  the log ended in a torn record of 40 bytes (a killed writer's): cut off, as any open does",
                        dropped]
    backup = next(store.glob("log.jsonl.before-repair-*"))
    assert done[2].startswith(f"memfit store repair: {store}: dropped 1 of 3 write batches (64 records); the old "
                              f"log is {backup}, ")
    assert backup.read_bytes() == before["log.jsonl"][:-40]  # the old log whole, less the torn record


def _own_data(path: Path, *records: dict | None) -> Path:
    """An own-data file, one record a line (None: a blank line)."""
    path.write_text("".join("\n" if r is None else json.dumps(r) + "\n" for r in records))
    return path


BOB = {"user_id": "bob", "sessions": [{"turns": [{"speaker": "Bob", "text": "I keep bees."}]}]}


@pytest.mark.parametrize(("record", "field", "reason"), [
    ({"user_id": "alice", "sessions": [
        {"session_id": "s1", "turns": [{"speaker": "Alice", "text": "hello"}]},
        {"session_id": "s2", "turns": [{"speaker": "Alice", "text": "hi"},
                                       {"speaker": "Alice", "text": "  ", "images": [{"caption": "a dog"}]}]}]},
     "sessions[1].turns[1].text", "must be a non-empty string, got '  '"),
    ({"user_id": "alice smith", "sessions": [{"turns": [{"speaker": "Alice", "text": "hi"}]}]}, "user_id",
     "user id 'alice smith' is not valid: 1 to 128 characters, ASCII letters, digits and _ - . @ : only, starting "
     "with a letter or digit"),
])
def test_an_import_a_live_memory_refuses_names_the_file_line_and_field_and_creates_nothing(
        tmp_path: Path, capsys, record: dict, field: str, reason: str):
    """A turn with an image and blank text, or a user id with a space, passes the file's reader and is
    refused by a live memory: the refusal said `add, item user 'alice' turn 2, field 'text'` (no file, a
    turn number counted across sessions) and left an empty memory folder behind."""
    file = _own_data(tmp_path / "own.jsonl", BOB, None, record)
    folder = tmp_path / "memory"
    line = _error(capsys, ["store", "import", str(folder), str(file), "--config", str(REPO / "configs" / "demo.yaml")])
    assert line == f"memfit store: error: {file}, item line 3 (user {record['user_id']!r}), field '{field}': {reason}"
    assert not folder.exists()
    _own_data(file, record, BOB, {**record, "user_id": "carol"} if field != "user_id" else {**BOB, "user_id": "c d"})
    line = _error(capsys, ["store", "import", str(folder), str(file), "--config", str(REPO / "configs" / "demo.yaml")])
    assert line == (f"memfit store: error: {file}: 2 problem(s) a live memory refuses; the first: {file}, item line 1 "
                    f"(user {record['user_id']!r}), field '{field}': {reason} (memfit data validate --live {file} "
                    "lists them all)")
    assert not folder.exists()


def test_a_store_command_writes_a_live_memory_s_log_as_the_memory_does(tmp_path: Path) -> None:
    """`memfit store delete DIR --config C` on a live memory's folder opened its store with the config's
    store.fsync (off by default): the records it appended were not fsynced, in a log whose open trusts that
    an acknowledged record is on disk. A live memory's folder is written with fsync, whatever the config."""
    with LiveMemory.open(tmp_path / "m", REPO / "configs" / "demo.yaml",
                     overrides=["rerank.backend=none", "summary.enabled=false", "live.consolidate=manual"]) as memory:
        memory.add("u1", [{"speaker": "Ann", "text": "I keep bees."}])
    assert load_config(REPO / "configs" / "demo.yaml").store.fsync is False
    assert resolve_target(tmp_path / "m", str(REPO / "configs" / "demo.yaml")).cfg.store.fsync is True
