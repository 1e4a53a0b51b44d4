"""I/O failures are one line naming the file and what to do (exit code 2), never a traceback: a damaged
response cache, a full disk, a file system that refuses a write. Faults are provoked at the exact write
(memfit_gpu.faults' MEMFIT_IO_FAULT) or made for real (a damaged SQLite file)."""

from __future__ import annotations

import errno
import os
import shutil
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from memfit_gpu import faults, files
from memfit_gpu.cli import main
from memfit_gpu.cli.errors import storage_line
from memfit_gpu.faults import IO_FAULT_ENV
from memfit_gpu.files import StorageError, append_jsonl, atomic_write_text, temporaries, write_output
from memfit_gpu.readers.cache import ResponseCache
from memfit_gpu.readers.ledger import Ledger
from memfit_gpu.readers.types import Response

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _faults_counted_from_zero() -> None:
    faults.reset()  # MEMFIT_IO_FAULT's n counts the writes of this test only


def _filled_cache(path: Path) -> bytes:
    """A real cache.sqlite of a few pages (responses and ledger entries), checkpointed; its bytes."""
    cache = ResponseCache(path)
    ledger = Ledger()
    rows = [(f"key{i:04d}", "answer", Response(f"answer {i} " * 20, 30, 5, 0.1, False, "m")) for i in range(200)]
    cache.commit("openai", rows, [ledger.entry("answer", f"q{i}", r, "openai") for i, (_, _, r) in enumerate(rows)])
    cache.close()
    data = path.read_bytes()
    assert len(data) > 20_000 and not Path(f"{path}-wal").exists()
    return data


def _use(path: Path) -> None:
    """What a resumed run does with its cache: open it, read the ledger entries and responses, commit."""
    cache = ResponseCache(path)
    try:
        cache.entries()
        cache.get_many([f"key{i:04d}" for i in range(200)])
        cache.commit("openai", [("new", "answer", Response("x", 1, 1, 0.0))])
    finally:
        cache.close()


@pytest.mark.parametrize("damage", ["garbage", "truncated to 4096", "truncated to 5000", "header + garbage pages"])
def test_a_damaged_cache_is_one_error_naming_it_as_safe_to_delete(tmp_path: Path, damage: str) -> None:
    """These used to give a traceback (`file is not a database`, `database disk image is malformed`)
    naming no file and not saying that deleting the cache is safe."""
    path = tmp_path / "cache.sqlite"
    good = _filled_cache(path)
    damaged = {
        "garbage": bytes(range(256)) * 64,
        "truncated to 4096": good[:4096],
        "truncated to 5000": good[:5000],
        "header + garbage pages": good[:100] + b"\xa5" * (len(good) - 100),
    }[damage]
    path.write_bytes(damaged)
    with pytest.raises(StorageError) as info:
        _use(path)
    message = str(info.value)
    assert message.startswith(f"{path}: damaged (")
    assert "deleting it is safe" in message and "rerun the same command" in message
    assert "\n" not in message
    assert path.read_bytes() == damaged  # left as it was


def test_a_run_on_a_damaged_cache_exits_2_with_one_line(tmp_path: Path, shared_data: Path, capsys,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEMFIT_DATA_DIR", str(shared_data))
    out = tmp_path / "run"
    out.mkdir()
    (out / "cache.sqlite").write_bytes(b"not a database at all" * 300)
    code = main(["run", "--config", str(REPO / "configs" / "smoke.yaml"), "--out", str(out), "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "Traceback" not in "\n".join(err)
    assert err[-1].startswith(f"memfit run: error: {out / 'cache.sqlite'}: damaged (")
    assert "deleting it is safe" in err[-1]


@pytest.mark.parametrize(("code", "advice"), [
    ("ENOSPC", "free space on its file system"),
    ("EACCES", "give this user write permission there"),
    ("EROFS", "the file system is read-only"),
    ("EIO", "the disk reported an I/O error"),
])
def test_a_refused_write_names_the_file_and_what_to_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: str,
                                                       advice: str) -> None:
    """A full disk used to give three chained ENOSPC tracebacks naming no file."""
    target = tmp_path / "ledger.json"
    atomic_write_text(target, "before")
    monkeypatch.setenv(IO_FAULT_ENV, f"ledger.json:{code}")
    with pytest.raises(StorageError) as info:
        atomic_write_text(target, "after")
    assert str(info.value).startswith(f"{target}: writing failed: ")
    assert f"({code}); {advice}" in str(info.value) and str(info.value).endswith("what was written before is kept")
    assert target.read_text() == "before" and not temporaries(target)
    monkeypatch.setenv(IO_FAULT_ENV, f"predictions.jsonl:{code}:2")  # the second append fails
    faults.reset()
    rows = tmp_path / "predictions.jsonl"
    append_jsonl(rows, [{"q": 1}])
    with pytest.raises(StorageError, match=rf"predictions\.jsonl: writing failed: .*\({code}\)"):
        append_jsonl(rows, [{"q": 2}])
    monkeypatch.setenv(IO_FAULT_ENV, f"cache.sqlite:{code}")
    faults.reset()
    cache = ResponseCache(tmp_path / "cache.sqlite")
    with pytest.raises(StorageError, match=rf"cache\.sqlite: writing failed: .*\({code}\); {advice}"):
        cache.commit("openai", [("k", "answer", Response("x", 1, 1, 0.0))])
    assert len(cache) == 0  # the transaction was rolled back whole
    cache.close()


def test_sqlites_own_refusals_name_the_cache(tmp_path: Path) -> None:
    cache = ResponseCache(tmp_path / "cache.sqlite")
    error = cache._error(sqlite3.OperationalError("database or disk is full"), "writing")
    assert str(error).startswith(f"{tmp_path / 'cache.sqlite'}: writing failed (database or disk is full); "
                                 "free space on its file system")
    error = cache._error(sqlite3.OperationalError("attempt to write a readonly database"), "writing")
    assert "the file system is read-only" in str(error)
    cache.close()


def test_an_io_error_without_a_handler_is_still_one_line() -> None:
    """An OSError of the machine's state raised anywhere (with the file it names) is an exit-2 line."""
    line = storage_line(OSError(errno.ENOSPC, "No space left on device", "/runs/x/timings.json"))
    assert line == ("/runs/x/timings.json: writing or reading failed: No space left on device (ENOSPC); free space "
                    "on its file system, then rerun the same command: what was written before is kept")
    assert storage_line(OSError(errno.ENOENT, "No such file", "x")) is None
    assert storage_line(StorageError("x", "x: told already", errno.ENOSPC)) is None  # printed as it is
    assert storage_line(ValueError("x")) is None


FULL_DISK_OPEN = """
import sys
from memfit_gpu.readers.cache import ResponseCache
from memfit_gpu.files import StorageError
folder = sys.argv[1]
ResponseCache(folder + "/cache.sqlite").close()
filler = open(folder + "/filler", "wb", buffering=0)  # the file system, full (left open)
try:
    while True:
        filler.write(b"x" * 1024)
except OSError:
    pass
try:
    ResponseCache(folder + "/cache.sqlite")
except StorageError as exc:
    print(exc)
"""


def test_a_really_full_disk_at_the_cache_says_the_disk_is_full(tmp_path: Path) -> None:
    """On a full file system SQLite reports opening its WAL as "disk I/O error", which read as a failing
    disk ("check it (dmesg)"). A real tmpfs of 256 KiB, mounted in a mount namespace of its own
    (`unshare -rm`: no privileges needed), filled up, then the cache opened again."""
    folder = tmp_path / "small"
    folder.mkdir()
    script = (f"mount -t tmpfs -o size=256k tmpfs {folder} && exec {sys.executable} -c '{FULL_DISK_OPEN}' {folder}")
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    line = proc.stdout.strip()
    assert line.startswith(f"{folder}/cache.sqlite: opening failed (disk I/O error: its file system is full); "
                           "free space on its file system, then rerun the same command"), line
    assert "dmesg" not in line


def test_an_output_the_user_names_is_written_whole_or_in_place_where_it_cannot_be_replaced(tmp_path: Path) -> None:
    """`--csv`, `--md`, `--json-out`: a regular file is replaced in one step; a symlink keeps pointing at the file
    it names, which gets the text; /dev/null (or /dev/stdout, a pipe) is written in place, not replaced."""
    target = tmp_path / "real.csv"
    target.write_text("old\n")
    link = tmp_path / "link.csv"
    link.symlink_to(target)
    write_output(link, "a,b\n")
    assert link.is_symlink() and target.read_text() == "a,b\n"
    write_output(tmp_path / "new.csv", "c\n")
    assert (tmp_path / "new.csv").read_text() == "c\n"
    write_output("/dev/null", "d\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.csv", "new.csv", "real.csv"]  # no temporary left


@pytest.mark.parametrize(("table", "change"), [
    ("responses", "UPDATE responses SET text = 'answer 7 changed' WHERE key = 'key0007'"),
    ("responses", "UPDATE responses SET output_tokens = 6 WHERE key = 'key0007'"),
    ("responses", "UPDATE responses SET owner = 'someone else' WHERE key = 'key0007'"),
    ("calls", "UPDATE calls SET input_tokens = 31 WHERE seq = 8"),
    ("calls", "UPDATE calls SET served = 'cached' WHERE seq = 8"),
    # its digest taken away with it: an edit the digest could not catch, were a row without one taken
    ("responses", "UPDATE responses SET text = 'answer 7 changed', digest = NULL WHERE key = 'key0007'"),
    ("calls", "UPDATE calls SET input_tokens = 31, digest = NULL WHERE seq = 8"),
    ("responses", "UPDATE responses SET text = X'41' WHERE key = 'key0007'"),  # bytes where text belongs
])
def test_a_row_changed_on_disk_is_the_damaged_error_not_another_answer(tmp_path: Path, table: str,
                                                                       change: str) -> None:
    """SQLite checks its pages, not what a row holds: a response changed in place (a flipped bit, an edit
    by hand) used to be served as the run's answer, a call record counted as it read."""
    path = tmp_path / "cache.sqlite"
    _filled_cache(path)
    with sqlite3.connect(path) as conn:
        assert conn.execute(change).rowcount == 1
    damaged = path.read_bytes()
    with pytest.raises(StorageError) as info:
        _use(path)
    message = str(info.value)
    what = "the cached response under key key0007" if table == "responses" else "a call record"
    assert message.startswith(f"{path}: damaged ({what} does not match its digest: changed on disk or by hand)")
    assert "deleting it is safe" in message and "\n" not in message
    assert path.read_bytes() == damaged  # left as it was


def test_a_changed_ledger_base_is_the_damaged_error(tmp_path: Path) -> None:
    path = tmp_path / "cache.sqlite"
    cache = ResponseCache(path)
    cache.set_ledger_base({"roles": {"answer": {"calls": 3}}})
    assert cache.ledger_base() == {"roles": {"answer": {"calls": 3}}}
    cache.close()
    with sqlite3.connect(path) as conn:
        conn.execute("""UPDATE ledger_base SET ledger = '{"roles": {"answer": {"calls": 30}}}'""")
    cache = ResponseCache(path)
    try:
        with pytest.raises(StorageError, match=r"damaged \(the ledger base does not match its digest"):
            cache.ledger_base()
    finally:
        cache.close()


def test_a_cache_written_before_digests_gets_them_and_reads_as_it_was(tmp_path: Path) -> None:
    """A file an older memfit wrote (no digest column) is read as it was, and from then on a changed row is
    the damaged error. Values SQLite stores in another type than given (an int in a REAL column, a bool)
    are digested as stored, so a sound row never reads as changed."""
    path = tmp_path / "cache.sqlite"
    _filled_cache(path)
    with sqlite3.connect(path) as conn:  # as an older memfit left it
        conn.execute("PRAGMA user_version = 0")
        for table in ("responses", "calls", "ledger_base"):
            conn.execute(f"ALTER TABLE {table} DROP COLUMN digest")
        before = conn.execute("SELECT * FROM responses ORDER BY key").fetchall()
    cache = ResponseCache(path)
    try:
        found = cache.get_many(["key0003"])
        assert found["key0003"].text == "answer 3 " * 20 and len(cache.entries()) == 200
        entry = Ledger().entry("answer", "q-int", Response("y", 1, 1, 0, False, "m", True), "openai")
        entry.update(latency_s=0, gpu_seconds=1, tokens_estimated=True)  # stored as 0.0, 1.0 and 1
        cache.commit("openai", [("int-key", "answer", Response("y", 1, 1, 0, False, "m", True))], [entry])
    finally:
        cache.close()
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT COUNT(*) FROM responses WHERE digest IS NULL").fetchone()[0] == 0
        assert conn.execute("SELECT COUNT(*) FROM calls WHERE digest IS NULL").fetchone()[0] == 0
        after = conn.execute(f"SELECT {', '.join(c[1] for c in conn.execute('PRAGMA table_info(responses)'))} "
                             "FROM responses WHERE key != 'int-key' ORDER BY key").fetchall()
    assert [row[:-1] for row in after] == before
    cache = ResponseCache(path)
    try:
        assert cache.get_many(["int-key"])["int-key"].text == "y" and len(cache.entries()) == 201
    finally:
        cache.close()
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE responses SET text = 'answer 3 changed' WHERE key = 'key0003'")
    cache = ResponseCache(path)
    try:
        with pytest.raises(StorageError, match="key key0003 does not match its digest"):
            cache.get_many(["key0003"])
    finally:
        cache.close()


def test_a_run_whose_cached_answer_was_changed_exits_2_naming_the_cache(
        smoke_run_dir: tuple[Path, str], tmp_path: Path, shared_data: Path, monkeypatch: pytest.MonkeyPatch,
        capsys) -> None:
    """Resumed after its answers were lost, the run reads them from its cache: a changed one used to
    become the run's prediction, scored as if the reader had said it."""
    monkeypatch.setenv("MEMFIT_DATA_DIR", str(shared_data))
    out = tmp_path / "smoke"
    shutil.copytree(smoke_run_dir[0], out)
    for name in ("DONE", "ledger.json", "metrics.json", "predictions.jsonl"):
        (out / name).unlink()
    with sqlite3.connect(out / "cache.sqlite") as conn:
        assert conn.execute("UPDATE responses SET text = text || ' (changed)' "
                            "WHERE rowid = (SELECT MAX(rowid) FROM responses WHERE role = 'answer')").rowcount == 1
    code = main(["run", "--config", str(REPO / "configs" / "smoke.yaml"), "--out", str(out), "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "Traceback" not in "\n".join(err)
    assert err[-1].startswith(f"memfit run: error: {out / 'cache.sqlite'}: damaged (the cached response under key ")
    assert "does not match its digest" in err[-1] and not (out / "predictions.jsonl").exists()


def test_a_temporary_of_another_node_is_kept_while_its_writer_may_live(tmp_path: Path) -> None:
    """Two SLURM tasks on two nodes write one sweep.json: a PID in the other node's temporary name is a dead or
    unrelated process here, and its live write was deleted (its rename then failed). Only this place's dead
    writers' temporaries go at once; anyone else's once no write could still be under way."""
    target = tmp_path / "sweep.json"
    atomic_write_text(target, "first")
    dead = 2 ** 22 + 12345  # above pid_max's default: no process has it
    here = tmp_path / f".sweep.json.{dead}-1-abcd1234-{files._writer_place()}.tmp"
    elsewhere = tmp_path / f".sweep.json.{dead}-1-abcd1234-0badf00d.tmp"
    older = tmp_path / f".sweep.json.{dead}-1-abcd1234.tmp"  # an older memfit's name, place unknown
    alive = tmp_path / f".sweep.json.{os.getppid()}-1-abcd1234-{files._writer_place()}.tmp"
    for stray in (here, elsewhere, older, alive):
        stray.write_text("half")
    atomic_write_text(target, "second")
    assert sorted(p.name for p in temporaries(target)) == sorted([elsewhere.name, older.name, alive.name])
    past = time.time() - files.FOREIGN_TEMPORARY_S - 5
    for stray in (elsewhere, older, alive):
        os.utime(stray, (past, past))
    atomic_write_text(target, "third")
    assert temporaries(target) == [alive] and target.read_text() == "third"


def test_a_file_in_a_folder_that_is_not_there_is_named_not_its_temporary(tmp_path: Path, capsys) -> None:
    """`memfit data convert --out /missing/x.jsonl` said "[Errno 2] No such file or directory:
    '/missing/.x.jsonl.24190-...tmp'": the name of a temporary file the user never gave."""
    target = tmp_path / "missing" / "x.jsonl"
    with pytest.raises(StorageError) as refused:
        atomic_write_text(target, "x")
    assert str(refused.value) == (f"{target}: writing failed: its folder {target.parent} does not exist; make it or "
                                  "give another path")
