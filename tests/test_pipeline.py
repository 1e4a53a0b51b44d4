"""`memfit run` end to end on real data with the real packaged reader: outputs, resume, no repeat calls."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from memfit_gpu.config import load_config
from memfit_gpu.pipeline import RunError, read_jsonl, run

REPO = Path(__file__).resolve().parents[1]
SMOKE = REPO / "configs" / "smoke.yaml"


def _env(shared_data: Path) -> dict[str, str]:
    return {**os.environ, "MEMFIT_DATA_DIR": str(shared_data), "HF_HUB_OFFLINE": "1"}


def _cache_rows(run_dir: Path) -> int:
    with sqlite3.connect(run_dir / "cache.sqlite") as db:
        return db.execute("select count(*) from responses").fetchone()[0]


def _answer_stats(run_dir: Path) -> dict:
    return json.loads((run_dir / "ledger.json").read_text())["roles"]["answer"]


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory: pytest.TempPathFactory, shared_data: Path) -> Path:
    out = tmp_path_factory.mktemp("pipeline") / "smoke"
    proc = subprocess.run([sys.executable, "-m", "memfit_gpu.cli", "run", "--config", str(SMOKE), "--out", str(out),
                           "--quiet"], env=_env(shared_data), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| **Average** |" in proc.stdout  # the results table is printed
    return out


@pytest.mark.slow
def test_run_writes_every_output(smoke_run: Path):
    for name in ("config.yaml", "predictions.jsonl", "metrics.json", "ledger.json", "results.md", "packs.jsonl",
                 "diagnostics.json", "DONE"):
        assert (smoke_run / name).is_file(), name
    cfg = load_config(smoke_run / "config.yaml")
    assert cfg == load_config(SMOKE)
    preds = read_jsonl(smoke_run / "predictions.jsonl")
    assert [p["question_id"] for p in preds] == [f"conv-26:q{i}" for i in range(6)]
    assert all(set(p["scores"]) == {"paper", "locomo", "memgallery"} for p in preds)
    metrics = json.loads((smoke_run / "metrics.json").read_text())
    assert metrics["questions"] == 6 and metrics["metric_variant"] == "paper"
    assert set(metrics["by_category"]) == {p["category"] for p in preds}
    # average = mean of the category means (LoCoMo)
    means = [metrics["by_category"][c]["paper"]["f1"] for c in metrics["by_category"]]
    assert metrics["average"]["paper"]["f1"] == pytest.approx(sum(means) / len(means))
    assert metrics["reranker"]["backend"] == "none"
    assert metrics["retrieval"]["overall"]["hit@30"] >= metrics["retrieval"]["overall"]["pack_hit"] > 0
    answer = _answer_stats(smoke_run)
    assert answer["calls"] + answer["cached"] == 6 and answer["calls"] == 6
    assert json.loads((smoke_run / "ledger.json").read_text())["answer_keys"] == [p["question_id"] for p in preds]


@pytest.mark.slow
def test_rerun_of_a_finished_run_makes_no_call(smoke_run: Path, shared_data: Path):
    before = (smoke_run / "ledger.json").read_bytes(), _cache_rows(smoke_run)
    proc = subprocess.run([sys.executable, "-m", "memfit_gpu.cli", "run", "--config", str(SMOKE), "--out",
                           str(smoke_run), "--quiet"], env=_env(shared_data), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (smoke_run / "ledger.json").read_bytes() == before[0] and _cache_rows(smoke_run) == before[1]


@pytest.mark.slow
def test_answers_come_from_the_cache_when_predictions_are_lost(smoke_run: Path, tmp_path: Path, shared_data: Path,
                                                               monkeypatch: pytest.MonkeyPatch):
    """A run that lost its predictions (but kept cache.sqlite) answers again with zero backend calls."""
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(smoke_run, copy)
    for name in ("DONE", "predictions.jsonl", "metrics.json", "ledger.json", "results.md"):
        (copy / name).unlink()
    monkeypatch.setenv("MEMFIT_DATA_DIR", str(shared_data))
    old = [p["prediction"] for p in read_jsonl(smoke_run / "predictions.jsonl")]
    run(load_config(SMOKE), copy, progress=False)
    answer = _answer_stats(copy)
    assert (answer["calls"], answer["cached"]) == (0, 6)
    assert [p["prediction"] for p in read_jsonl(copy / "predictions.jsonl")] == old


@pytest.mark.slow
def test_killed_run_resumes_without_lost_or_duplicated_predictions(tmp_path: Path, shared_data: Path):
    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "memfit_gpu.cli", "run", "--config", str(SMOKE), "--out", str(out), "--quiet"]
    proc = subprocess.Popen(cmd, env=_env(shared_data), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    preds = out / "predictions.jsonl"
    deadline = time.time() + 900
    # Kill as soon as the first flush (3 of 6 answers) is on disk: the second batch is in flight.
    while time.time() < deadline and proc.poll() is None:
        if preds.exists() and preds.read_text().count("\n") >= 3:
            os.killpg(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.2)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    assert not (out / "DONE").exists()
    first = read_jsonl(preds)
    assert 3 <= len(first) < 6
    # A torn line, as a kill in the middle of a write leaves it, is dropped on resume.
    with open(preds, "a") as handle:
        handle.write('{"question_id": "conv-26:q')
    done = subprocess.run(cmd, env=_env(shared_data), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = read_jsonl(preds)
    ids = [r["question_id"] for r in rows]
    assert ids == [f"conv-26:q{i}" for i in range(6)]  # none lost, none twice, in order
    assert rows[: len(first)] == first  # finished work was kept, not redone
    answer = _answer_stats(out)
    assert answer["calls"] + answer["cached"] == 6
    assert json.loads((out / "ledger.json").read_text())["answer_keys"] == ids


def test_resuming_with_another_configuration_is_refused(tmp_path: Path, shared_data: Path,
                                                        monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("MEMFIT_DATA_DIR", str(shared_data))  # a run checks it can start before comparing configs
    out = tmp_path / "r"
    out.mkdir()
    (out / "config.yaml").write_text((REPO / "configs" / "smoke.yaml").read_text().replace("defaults: memfit.yaml", ""))
    cfg = load_config(REPO / "configs" / "smoke.yaml")
    (out / "config.yaml").write_text(__import__("memfit_gpu.config", fromlist=["to_yaml"]).to_yaml(cfg))
    other = load_config(REPO / "configs" / "smoke.yaml", ["pack.k=3"])
    with pytest.raises(RunError, match="pack.k"):
        run(other, out, progress=False)


def test_torn_jsonl_tail_is_cut_and_bad_lines_named(tmp_path: Path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"a": 1}\n{"a": 2}\n{"a"')
    assert read_jsonl(path) == [{"a": 1}, {"a": 2}]
    assert path.read_text() == '{"a": 1}\n{"a": 2}\n'
    path.write_text('{"a": 1}\nnot json\n')
    with pytest.raises(RunError, match="line 2"):
        read_jsonl(path)


@pytest.mark.slow
def test_profile_reports_every_stage_and_the_scaling_curve(smoke_run: Path, tmp_path: Path, shared_data: Path,
                                                           monkeypatch: pytest.MonkeyPatch):
    """memfit profile over a finished run (its clocks) plus a small real scaling sweep; PNG is a real image."""
    import shutil

    from memfit_gpu.profile import RETRIEVAL_STAGES, profile

    shutil.copytree(smoke_run, tmp_path / "prof" / "run")
    monkeypatch.setenv("MEMFIT_DATA_DIR", str(shared_data))
    result = profile(load_config(SMOKE), tmp_path / "prof", sizes=(1000, 3000), n_queries=8, progress=False)
    stages = result["stages"]
    assert set(RETRIEVAL_STAGES) <= set(stages) and {"encode", "read"} <= set(stages)
    assert stages["encode"]["items"] == 419 and stages["encode"]["seconds"] > 0  # conv-26 has 419 turns
    assert stages["read"]["items"] == 6
    assert sum(s["share"] for s in stages.values()) == pytest.approx(1.0)
    assert [r["episodes"] for r in result["scaling"]] == [1000, 3000]
    assert all(r["questions"] == 8 and r["search_s"] > 0 for r in result["scaling"])
    assert result["gpu"]["available"] in (True, False)
    saved = json.loads((tmp_path / "prof" / "profile.json").read_text())
    assert saved["stages"] == stages
    png = (tmp_path / "prof" / "profile.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000


@pytest.mark.slow
def test_judged_run_records_a_verdict_per_answer(tmp_path: Path, shared_data: Path, monkeypatch: pytest.MonkeyPatch):
    """eval.judge.enabled: one judge call per non-empty answer (role judge in the ledger), verdicts in
    predictions.jsonl and metrics.json. SmolLM2 cannot follow the judge format: an unreadable reply is WRONG."""
    monkeypatch.setenv("MEMFIT_DATA_DIR", str(shared_data))
    cfg = load_config(SMOKE, ["data.limit_questions=2", "eval.judge.enabled=true", "eval.judge.max_new_tokens=24"])
    out = tmp_path / "judged"
    metrics = run(cfg, out, progress=False)
    rows = read_jsonl(out / "predictions.jsonl")
    assert len(rows) == 2
    for row in rows:
        assert isinstance(row["judge"]["verdict"], bool) and row["judge"]["reason"]
    judge = json.loads((out / "ledger.json").read_text())["roles"]["judge"]
    non_empty = sum(1 for r in rows if r["prediction"].strip())
    assert judge["calls"] + judge["cached"] == non_empty
    expected = sum(r["judge"]["verdict"] for r in rows) / 2
    assert metrics["overall"]["judge"] == pytest.approx(expected)
    # the same answers judged again come from the cache
    for name in ("DONE", "predictions.jsonl", "metrics.json", "ledger.json", "results.md"):
        (out / name).unlink()
    run(cfg, out, progress=False)
    again = json.loads((out / "ledger.json").read_text())["roles"]
    assert (again["judge"]["calls"], again["answer"]["calls"]) == (0, 0)
    assert [r["judge"] for r in read_jsonl(out / "predictions.jsonl")] == [r["judge"] for r in rows]
