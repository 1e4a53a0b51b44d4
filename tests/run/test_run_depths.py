"""eval.pack_cutoffs (memfit_gpu/run/depths.py): the run's ranking packed and answered at several pack depths.

The packs at depth k equal those of a read at pack.k=k (in process, with summaries in the ranking); a run at
pack.k=5 with eval.pack_cutoffs=[5,10] answers at k=10 what a run at pack.k=10 answers, with the same cache
keys (two real `memfit run`s of configs/smoke.yaml with the test-only echo reader, tests/seam_echo_backend.py:
what matters here is which prompts are sent, which the echo reply makes visible, never a score); a run without
eval.pack_cutoffs writes no depth files."""

from __future__ import annotations

import json
import shutil
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support.data import write_small_locomo
from support.env import memfit_env
from support.report_runs import REPO, SMOKE, echo_run, memfit  # tests/ is on sys.path

from memfit_gpu.config import ConfigError, load_config
from memfit_gpu.data import load_benchmark, select_from_config
from memfit_gpu.files import read_jsonl
from memfit_gpu.methods.base import MethodRun
from memfit_gpu.methods.memfit import MemFit
from memfit_gpu.methods.packs import questions_of
from memfit_gpu.methods.plain import Plain
from memfit_gpu.readers.types import Response
from memfit_gpu.run.depths import ROLE, check_depths
from memfit_gpu.run.pipeline import run


def test_pack_cutoffs_are_increasing_depths_of_a_ranking_method() -> None:
    assert load_config(None, ["eval.pack_cutoffs=[5,10,20,30]"]).eval.pack_cutoffs == [5, 10, 20, 30]
    assert load_config(None, []).eval.pack_cutoffs == []  # unset: the run's pack.k only
    with pytest.raises(ConfigError, match=r"eval.pack_cutoffs\[1\]=5 must be >= 1 and larger than the depth before"):
        load_config(None, ["eval.pack_cutoffs=[5,5]"])
    with pytest.raises(ConfigError, match=r"eval.pack_cutoffs\[0\]=0 must be >= 1"):
        load_config(None, ["eval.pack_cutoffs=[0,5]"])
    check_depths(load_config(None, ["method=plain", "eval.pack_cutoffs=[5]"]))
    with pytest.raises(ConfigError, match=r"needs method memfit or plain .*method=naive_rag has none"):
        check_depths(load_config(None, ["method=naive_rag", "eval.pack_cutoffs=[5]"]))


@pytest.mark.parametrize("asked", [["eval.pack_cutoffs=[5]"], ["eval.growth_points=[1]"]])
def test_a_run_asking_a_stage_its_method_cannot_do_is_refused_before_it_records_anything(
        asked: list[str], tmp_path: Path, shared_data: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Preflight refuses depths on a method without a ranking and growth on one without read_at, before
    config.yaml, so the corrected command works in the same directory."""
    monkeypatch.setenv("MEMFIT_DATA_DIR", str(shared_data))
    out = tmp_path / "refused"
    with pytest.raises(ConfigError, match=r"needs method .*method=full_context"):
        run(load_config(SMOKE, ["method=full_context", *asked]), out, progress=False)
    assert sorted(p.name for p in out.iterdir()) == [".lock"]  # no config.yaml: nothing recorded


class LeadSummaries:
    """A reader for the summary calls only: the first two excerpt bullets of each prompt (real text, no LLM)."""

    def generate(self, requests: list[Any]) -> list[Response]:
        out = []
        for request in requests:
            bullets = [line[2:] for line in str(request.messages[-1]["content"]).splitlines() if line.startswith("- ")]
            out.append(Response(" ".join(bullets[:2]), 0, 0, 0.0))
        return out


@pytest.mark.slow
@pytest.mark.parametrize("method", [MemFit, Plain])
def test_a_depth_packs_what_a_read_at_that_pack_k_packs(method: type[MemFit], tmp_path: Path, shared_data: Path) -> None:
    """LoCoMo conv-26's first three sessions, with segment summaries (memfit ranks them among the turns):
    the rows read at pack.k=5 packed at 2, 5 and 10 equal the rows of reads at pack.k=2, 5 and 10."""
    data = write_small_locomo(shared_data, tmp_path, questions=12)

    def read(k: int) -> tuple[MemFit, MethodRun, list[dict[str, Any]], dict[str, Any]]:
        cfg = load_config(SMOKE, [f"data.path={data}", "summary.enabled=true", "data.limit_questions=12", f"pack.k={k}", "pack.context_window=1",
                                  "index.device=cpu"])
        bench = load_benchmark("locomo", data)
        selected = select_from_config(bench, cfg.data)
        run = MethodRun(cfg, tmp_path, bench, selected.memories, questions_of(selected), reader=LeadSummaries)
        m = method()
        m.write(run)
        rows, diagnostics = m.read(run)
        return m, run, rows, diagnostics

    reads = {}
    for k in (2, 10, 5):  # the store of the last read stays open to pack its rows at the other depths
        m, run, rows, diagnostics = read(k)
        reads[k] = (rows, diagnostics)
        if k != 5:
            m.close()
    if method is MemFit:  # the ranking holds summaries, and some pack takes one
        assert any(r["pack"]["summaries"] for r in reads[10][0])
    try:
        for k, (rows, diagnostics) in reads.items():
            packed, packed_diagnostics = m.read_depth(run, reads[5][0], k)
            assert packed == rows
            for key in ("overall", "by_category", "questions", "reranker"):
                assert packed_diagnostics[key] == diagnostics[key]
            assert packed_diagnostics["method"]["pack_k"] == k
        assert {len(r["pack"]["selected"]) + len(r["pack"]["summaries"]) for r in reads[2][0]} == {2}
    finally:
        m.close()


# ------------------------------------------------------------------------------------------- real runs
def cache_keys(run: Path) -> set[str]:
    with sqlite3.connect(run / "cache.sqlite") as db:
        return {key for (key,) in db.execute("select key from responses")}


@pytest.fixture(scope="module")
def depth_runs(smoke_run_dir: tuple[Path, str], shared_data: Path, tmp_path_factory: pytest.TempPathFactory
               ) -> tuple[Path, Path]:
    """(a run at pack.k=10, a run at pack.k=5 with eval.pack_cutoffs=[5,10]), each on a copy of the session's
    smoke store."""
    root = tmp_path_factory.mktemp("depths")
    store = smoke_run_dir[0] / "store"
    k10 = echo_run(root / "k10", store, shared_data)
    cut = echo_run(root / "cutoffs", store, shared_data, "pack.k=5", "eval.pack_cutoffs=[5,10]")
    return k10, cut


@pytest.mark.slow
def test_pack_cutoffs_answer_at_k10_what_a_run_at_pack_k10_answers(depth_runs: tuple[Path, Path]) -> None:
    k10, cut = depth_runs
    assert not (k10 / "depths.jsonl").exists() and "depths" not in json.loads((k10 / "metrics.json").read_text())
    rows = read_jsonl(cut / "depths.jsonl")
    assert [(r["k"], r["questions"]) for r in rows if r["t"] == "depth"] == [(5, 6), (10, 6)]
    by_depth = {k: {r["question_id"]: r for r in rows if r["t"] == "question" and r["k"] == k} for k in (5, 10)}
    # k = 10: the answers and the packs' diagnostics of the run at pack.k=10, from the same prompts (cache keys)
    for prediction in read_jsonl(k10 / "predictions.jsonl"):
        depth = by_depth[10][prediction["question_id"]]
        for key in ("prediction", "raw_output", "scores", "retrieval", "gold", "category"):
            assert depth[key] == prediction[key], key
    assert cache_keys(k10) <= cache_keys(cut) and len(cache_keys(cut)) == 12
    # k = 5: the run's own answers, served from the cache
    for prediction in read_jsonl(cut / "predictions.jsonl"):
        assert by_depth[5][prediction["question_id"]]["raw_output"] == prediction["raw_output"]
    ledger = json.loads((cut / "ledger.json").read_text())
    assert ledger["roles"]["answer"]["calls"] == 6 and ledger["answer_keys"] == list(by_depth[5])  # one per question
    assert (ledger["roles"][ROLE]["calls"], ledger["roles"][ROLE]["cached"]) == (6, 6)  # k=10 asked, k=5 a hit
    assert ledger["phases"]["read"]["calls"] == 6  # the depths are evaluation: the run's read phase is its own
    # depths.json: tokens grow with the pack; the table's blocks are the depth rows' means
    summary = json.loads((cut / "depths.json").read_text())
    assert json.loads((cut / "metrics.json").read_text())["depths"] == summary
    assert [d["k"] for d in summary["depths"]] == [5, 10] and summary["pack_k"] == 5
    tokens = {d["k"]: d["input_tokens_per_question"] for d in summary["depths"]}
    assert tokens[5] < tokens[10]
    assert tokens[10] == sum(r["input_tokens"] for r in by_depth[10].values()) / 6
    for d in summary["depths"]:
        scored = [r["scores"]["paper"]["f1"] for r in by_depth[d["k"]].values()]
        assert d["overall"]["paper"]["f1"] == pytest.approx(sum(scored) / len(scored))
        hits = [r["retrieval"]["pack_hit"] for r in by_depth[d["k"]].values() if r["retrieval"]]
        assert d["retrieval"]["pack_hit"] == pytest.approx(sum(hits) / len(hits))
    assert "### Pack depth (eval.pack_cutoffs)" in (cut / "results.md").read_text()


@pytest.mark.slow
def test_a_resumed_run_serves_the_missing_depth_from_the_cache(depth_runs: tuple[Path, Path], tmp_path: Path,
                                                               shared_data: Path) -> None:
    _, cut = depth_runs
    again = tmp_path / "again"
    shutil.copytree(cut, again)
    for name in ("DONE", "metrics.json", "results.md", "depths.json"):
        (again / name).unlink()
    rows = read_jsonl(again / "depths.jsonl")
    (again / "depths.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows if r["k"] == 5))
    memfit(["run", "--config", str(again / "config.yaml"), "--out", str(again), "--quiet"], shared_data)
    assert read_jsonl(again / "depths.jsonl") == rows
    ledger = json.loads((again / "ledger.json").read_text())
    assert (ledger["roles"][ROLE]["calls"], ledger["roles"][ROLE]["cached"]) == (6, 12)  # no call made twice


@pytest.mark.slow
def test_killed_at_the_depth_stages_writes_a_run_resumes_to_the_same_rows_paying_each_call_once(
        depth_runs: tuple[Path, Path], smoke_run_dir: tuple[Path, str], tmp_path: Path, shared_data: Path) -> None:
    """SIGKILLed at the depth stage's durable writes, one after the other in one directory: after the first depth's
    rows (`depths:1`), then in the resumed process after the second depth's calls were paid and the ledger saved
    but before its rows (`depths.ledger:1`), then after depths.json (`depths.json`). Each rerun is the same
    command; the last finishes. The rows are the uninterrupted run's and every depth call is paid once."""
    _, cut = depth_runs
    out = tmp_path / "killed"
    store = tmp_path / "killed-store"
    shutil.copytree(smoke_run_dir[0] / "store", store)
    args = ["run", "--config", str(SMOKE), "--out", str(out), "--quiet", "reader.backend=echo", f"store.path={store}",
            "pack.k=5", "eval.pack_cutoffs=[5,10]"]
    command = [sys.executable, "-m", "memfit_gpu.cli", *args]
    for point, rows_before in (("depths:1", 7), ("depths.ledger:1", 7), ("depths.json", 14)):
        env = memfit_env(shared_data, plugins="seam_echo_backend", MEMFIT_FAULT=point)
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900, cwd=REPO)
        assert proc.returncode == -signal.SIGKILL, (point, proc.returncode, proc.stderr[-2000:])
        assert len(read_jsonl(out / "depths.jsonl")) == rows_before, point
        assert not (out / "DONE").exists()
    memfit(args, shared_data)  # the same command, unarmed: it finishes
    assert read_jsonl(out / "depths.jsonl") == read_jsonl(cut / "depths.jsonl")
    assert json.loads((out / "depths.json").read_text()) == json.loads((cut / "depths.json").read_text())
    ledger, reference = (json.loads((d / "ledger.json").read_text()) for d in (out, cut))
    # k=10's six calls paid once across four processes; k=5's six answers served from the run's own cache
    assert ledger["roles"][ROLE]["calls"] == reference["roles"][ROLE]["calls"] == 6
    assert ledger["roles"][ROLE]["input_tokens"] == reference["roles"][ROLE]["input_tokens"]
    assert ledger["roles"]["answer"]["calls"] == 6
