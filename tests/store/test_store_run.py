"""`memfit run` (configs/smoke.yaml, real data, real encoder and reader) over a store damaged on disk:
corruption stops the run with a one-line error and exit code 2 and rewrites nothing; a torn tail and a
damaged snapshot give exactly the results of the undamaged run."""

from __future__ import annotations

import json
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from support.env import memfit_env

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SMOKE = REPO / "configs" / "smoke.yaml"
# What a run makes after its store: removed so that a rerun retrieves over the store again (the response
# cache stays, so the same prompts are answered from it; the ledger and timings start again).
AFTER_STORE = ("DONE", "packs.jsonl", "diagnostics.json", "predictions.jsonl", "metrics.json", "results.md",
               "ledger.json", "timings.json")


def _memfit_run(out: Path, shared_data: Path) -> subprocess.CompletedProcess:
    env = memfit_env(shared_data)
    return subprocess.run([sys.executable, "-m", "memfit_gpu.cli", "run", "--config", str(SMOKE), "--out", str(out),
                           "--quiet"], env=env, capture_output=True, text=True, timeout=1200)


@pytest.fixture(scope="module")
def smoke_run(smoke_run_dir: tuple[Path, str]) -> Path:
    return smoke_run_dir[0]  # conftest.py: one run of configs/smoke.yaml per session, read-only (copied to damage)


def _rerun_copy(smoke_run: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(smoke_run, out)
    for name in AFTER_STORE:
        (out / name).unlink()
    return out


def _log_lines(run: Path) -> list[bytes]:
    return (run / "store" / "log.jsonl").read_bytes().splitlines(keepends=True)


def _same_results(run: Path, smoke_run: Path) -> None:
    for name in ("predictions.jsonl", "packs.jsonl"):
        assert (run / name).read_bytes() == (smoke_run / name).read_bytes(), name
    diagnostics, reference = (json.loads((d / "diagnostics.json").read_text()) for d in (run, smoke_run))
    diagnostics.pop("retrieve_stage_seconds"), reference.pop("retrieve_stage_seconds")
    assert diagnostics == reference
    metrics, reference = (json.loads((d / "metrics.json").read_text()) for d in (run, smoke_run))
    for numbers in (metrics, reference):  # wall time, and answers now served from the cache
        numbers.pop("timings"), numbers.pop("ledger"), numbers["retrieval"].pop("retrieve_stage_seconds")
    assert metrics == reference and metrics["questions"] == 6
    # The same prompts (retrieval was the same): every answer came from the cache, so no call was made
    # beyond the first run's six, which the ledger (rebuilt from cache.sqlite's entries) still holds.
    ledger = json.loads((run / "ledger.json").read_text())["roles"]["answer"]
    assert (ledger["calls"], ledger["cached"]) == (6, 0)
    assert _calls_made(run) == _calls_made(smoke_run) == 6


def _calls_made(run_dir: Path) -> int:
    """Backend calls the directory's ledger entries record (readers/cache.py: every paid call, once)."""
    with sqlite3.connect(run_dir / "cache.sqlite") as db:
        return db.execute("select count(*) from calls where served = 'call'").fetchone()[0]


def _error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert not (Path(proc.args[proc.args.index("--out") + 1]) / "DONE").exists()
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("memfit run: error: ") and "Traceback" not in proc.stderr
    return last


def test_smoke_store_is_one_committed_batch(smoke_run: Path):
    lines = _log_lines(smoke_run)
    assert len(lines) == 1 + 1 + 419 + 1  # header, memory, 419 turns, commit
    assert lines[-1].endswith(b'{"t":"commit","records":420}\n')


def test_a_flipped_byte_in_the_middle_of_the_log_stops_the_run(smoke_run: Path, tmp_path: Path, shared_data: Path):
    run = _rerun_copy(smoke_run, tmp_path)
    log_path = run / "store" / "log.jsonl"
    lines = _log_lines(run)
    offset = sum(len(line) for line in lines[:215]) + 100  # inside record 216 (the 214th turn)
    data = bytearray(log_path.read_bytes())
    data[offset] ^= 0x01
    log_path.write_bytes(bytes(data))
    line = _error_line(_memfit_run(run, shared_data))
    start = sum(len(line) for line in lines[:215])
    assert f"{log_path}, item record 216 (line 216, byte {start}): checksum mismatch" in line
    assert log_path.read_bytes() == bytes(data)  # the evidence is not rewritten


def test_five_bytes_cut_from_the_middle_of_the_log_stop_the_run(smoke_run: Path, tmp_path: Path, shared_data: Path):
    run = _rerun_copy(smoke_run, tmp_path)
    log_path = run / "store" / "log.jsonl"
    lines = _log_lines(run)
    start = sum(len(line) for line in lines[:215])
    data = log_path.read_bytes()
    cut = data[: start + 100] + data[start + 105 :]
    log_path.write_bytes(cut)
    line = _error_line(_memfit_run(run, shared_data))
    assert f"{log_path}, item record 216 (line 216, byte {start}): missing newline" in line
    assert log_path.read_bytes() == cut


@pytest.mark.parametrize("cut", [5, 300])
def test_a_torn_last_record_is_dropped_and_the_run_gives_the_same_results(smoke_run: Path, tmp_path: Path,
                                                                          shared_data: Path, cut: int):
    """5: the commit record is torn; 300: the last turn too. Either way the store batch never happened, so
    the rerun stores the conversation again (not 418 of its turns) and every result is the undamaged run's."""
    run = _rerun_copy(smoke_run, tmp_path)
    log_path = run / "store" / "log.jsonl"
    full = log_path.read_bytes()
    log_path.write_bytes(full[:-cut])
    proc = _memfit_run(run, shared_data)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "torn last record" in proc.stderr and "never committed" in proc.stderr
    assert log_path.read_bytes() == full
    _same_results(run, smoke_run)


def test_a_flipped_bit_in_the_snapshot_vectors_is_caught_and_the_run_gives_the_same_results(
        smoke_run: Path, tmp_path: Path, shared_data: Path):
    run = _rerun_copy(smoke_run, tmp_path)
    (snapshot,) = (run / "store" / "snapshots").iterdir()
    vectors = snapshot / "episode_dense" / "vectors.npy"
    data = bytearray(vectors.read_bytes())
    data[len(data) - 419 * 384 * 4 + (213 * 384 + 7) * 4 + 3] ^= 0x40  # one float of turn 213, far off
    vectors.write_bytes(bytes(data))
    proc = _memfit_run(run, shared_data)
    assert proc.returncode == 0, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "episode_dense/vectors.npy fails its sha256" in errors[0]
    assert "re-encoding 419 texts" in proc.stderr
    _same_results(run, smoke_run)
    assert vectors.read_bytes() == (smoke_run / "store" / "snapshots" / snapshot.name / "episode_dense"
                                    / "vectors.npy").read_bytes()  # the rebuild wrote a good snapshot again
