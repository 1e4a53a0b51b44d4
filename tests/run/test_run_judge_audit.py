"""`memfit judge-audit` with scripted judges (tests/support/audit_judges.py): no model is loaded.

The run directories here are finished runs as `memfit run` leaves them for the audit (config.yaml,
predictions.jsonl with scores, DONE), over real LoCoMo questions (conv-26's first three sessions): half the
predictions are the gold answer, half a wrong one. The audit reads nothing else of a run.
"""

from __future__ import annotations

import json
import random
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from support import audit_judges  # noqa: F401  (registers the scripted judge backends: tests/ is on sys.path)
from support.data import write_small_locomo
from support.env import memfit_env

from memfit_gpu import provenance
from memfit_gpu.cli import main
from memfit_gpu.config import load_config, to_yaml
from memfit_gpu.data import load_benchmark, select_from_config
from memfit_gpu.evaluate.metrics import score_all
from memfit_gpu.files import append_jsonl, read_jsonl
from memfit_gpu.readers.ledger import Ledger
from memfit_gpu.run.inputs import data_record, resolve_inputs
from memfit_gpu.run.judge_audit import PROBES, WRONG, AuditError, audit, negate, perturb, probes_for

REPO = Path(__file__).resolve().parents[2]
SMOKE = REPO / "configs" / "smoke.yaml"
QUESTIONS = 16


def make_run(out: Path, data: Path, judge_backend: str = "audit_accept_all") -> Path:
    """A finished run of `data`'s first QUESTIONS questions: even ones answered with their gold, odd ones
    with "Paris" (wrong for every one of them)."""
    cfg = load_config(SMOKE, [f"data.path={data}", f"data.limit_questions={QUESTIONS}", "eval.judge.enabled=true",
                              f"eval.judge.backend={judge_backend}"])
    selected = select_from_config(load_benchmark(cfg.data.benchmark, cfg.data.path), cfg.data)
    questions = selected.questions()
    predictions = [q.answer if i % 2 == 0 else "Paris" for i, q in enumerate(questions)]
    scores = score_all(predictions, [q.answer for q in questions], [q.category for q in questions], cfg.eval.metrics)
    out.mkdir(parents=True)
    (out / "config.yaml").write_text(to_yaml(cfg))
    append_jsonl(out / "predictions.jsonl", [
        {"question_id": q.question_id, "memory_id": q.memory_id, "category": q.category, "evaluated": True,
         "question": q.question, "gold": q.answer, "prediction": p, "scores": s, "judge": None}
        for q, p, s in zip(questions, predictions, scores, strict=True)])
    (out / "DONE").write_text("2026-12-01T00:00:00\n")
    return out


@pytest.fixture(scope="module")
def small_locomo(tmp_path_factory: pytest.TempPathFactory, shared_data: Path) -> Path:
    return write_small_locomo(shared_data, tmp_path_factory.mktemp("data"), questions=QUESTIONS)


@pytest.fixture(scope="module")
def accept_all_audit(tmp_path_factory: pytest.TempPathFactory, small_locomo: Path) -> tuple[Path, dict]:
    run_dir = make_run(tmp_path_factory.mktemp("audit") / "run", small_locomo)
    return run_dir, audit(run_dir, progress=False)


def _rate(block: dict, kind: str) -> float | None:
    return block[kind]["rate"]


def test_a_judge_that_accepts_everything_false_accepts_every_wrong_answer(accept_all_audit):
    run_dir, report = accept_all_audit
    overall = report["overall"]
    assert report["questions"] == QUESTIONS and report["judge_of_the_run"] is True
    assert _rate(overall, "gold") == 1.0 and overall["gold"]["asked"] == QUESTIONS
    for kind in (*WRONG, "wrong", "decline"):
        assert overall[kind]["asked"] > 0 and _rate(overall, kind) == 1.0, kind
    assert overall["decline"]["asked"] == QUESTIONS  # no abstention question in LoCoMo
    # the counts per category add up to the questions audited, and to each kind's total
    assert sum(b["questions"] for b in report["by_category"].values()) == QUESTIONS
    for kind in PROBES:
        assert sum(b[kind]["asked"] for b in report["by_category"].values()) == overall[kind]["asked"]
    # agreement with F1 >= 0.5: the judge accepts all, so it agrees exactly where F1 >= 0.5
    f1_ok = sum(i["f1"] >= 0.5 for i in report["items"] if i["kind"] == "prediction")
    assert overall["agreement"] == {"asked": QUESTIONS, "agree": f1_ok, "rate": f1_ok / QUESTIONS,
                                    "accepted_below_f1": QUESTIONS - f1_ok, "rejected_at_f1": 0, "unparsed": 0,
                                    "errors": 0}
    table = (run_dir / "judge_audit.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("|")][2:]  # header and rule first
    assert len(rows) == len(report["by_category"]) + 1 and rows[-1].startswith("| **Overall**")
    assert sum(int(row.split("|")[2]) for row in rows[:-1]) == QUESTIONS
    assert f"| {QUESTIONS}/{QUESTIONS} (100.0 %) |" in rows[-1]
    assert json.loads((run_dir / "judge_audit.json").read_text()) == report


def test_a_judge_that_accepts_only_the_exact_gold_false_accepts_nothing(accept_all_audit, tmp_path: Path):
    run_dir = tmp_path / "run"
    shutil.copytree(accept_all_audit[0], run_dir)
    report = audit(run_dir, ["eval.judge.backend=audit_exact_gold"], progress=False)
    overall = report["overall"]
    assert report["judge_of_the_run"] is False and report["judge"]["backend"] == "audit_exact_gold"
    assert _rate(overall, "gold") == 1.0
    for kind in (*WRONG, "wrong", "decline"):
        assert _rate(overall, kind) == 0.0, kind
    # it accepts the gold predictions (F1 1) and rejects "Paris" (F1 0): full agreement
    assert overall["agreement"]["rate"] == 1.0
    assert "not the judge the run was scored with" in (run_dir / "judge_audit.md").read_text()


def test_the_audit_is_deterministic_cached_and_counted_under_judge(accept_all_audit, tmp_path: Path):
    run_dir = tmp_path / "run"
    shutil.copytree(accept_all_audit[0], run_dir)
    before = Ledger.load(run_dir / "ledger.json").roles["judge"]
    first = json.loads((run_dir / "judge_audit.json").read_text())
    # every request made by the first audit is in the ledger under role judge, phase eval
    assert before.calls + before.cached == first["judge_requests"] and before.calls > 0
    ledger = json.loads((run_dir / "ledger.json").read_text())
    assert ledger["phases"]["eval"]["calls"] == before.calls
    again = audit(run_dir, progress=False)
    after = Ledger.load(run_dir / "ledger.json").roles["judge"]
    assert {**again, "run_dir": None} == {**first, "run_dir": None}
    assert (after.calls, after.cached) == (before.calls, before.cached + first["judge_requests"])  # all cached
    # another seed draws other wrong answers for some questions (each question has its own generator)
    questions = select_from_config(load_benchmark("locomo", load_config(run_dir / "config.yaml").data.path),
                                   load_config(run_dir / "config.yaml").data).questions()
    assert probes_for(questions, 0) == probes_for(questions, 0) != probes_for(questions, 1)


@pytest.mark.slow
def test_a_killed_audit_reruns_from_the_cache_to_the_same_report(accept_all_audit, tmp_path: Path, shared_data: Path):
    run_dir = tmp_path / "run"
    shutil.copytree(accept_all_audit[0], run_dir)
    for name in ("judge_audit.json", "judge_audit.md", "ledger.json", "cache.sqlite"):
        (run_dir / name).unlink()
    env = memfit_env(threads=1, plugins="support.audit_judges")
    cmd = [sys.executable, "-m", "memfit_gpu.cli", "judge-audit", str(run_dir), "--quiet"]
    killed = subprocess.run(cmd, env={**env, "MEMFIT_FAULT": "audit.ledger:1"}, capture_output=True, text=True,
                            timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert not (run_dir / "judge_audit.json").exists()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    reference = accept_all_audit[1]
    assert {**json.loads((run_dir / "judge_audit.json").read_text()), "run_dir": None} == {**reference, "run_dir": None}
    assert done.stdout == (run_dir / "judge_audit.md").read_text()
    # the calls the killed audit made are not made (nor counted as made) again
    want = Ledger.load(accept_all_audit[0] / "ledger.json").roles["judge"]
    assert Ledger.load(run_dir / "ledger.json").roles["judge"].calls == want.calls


def test_an_audit_with_other_data_than_the_run_is_refused(small_locomo: Path, tmp_path: Path):
    data = tmp_path / "locomo.json"
    shutil.copy(small_locomo, data)
    run_dir = make_run(tmp_path / "run", data)
    cfg = load_config(run_dir / "config.yaml")
    selected = select_from_config(load_benchmark("locomo", data), cfg.data)
    provenance.write(run_dir, {"schema": provenance.SCHEMA, "data": data_record(resolve_inputs(cfg), selected)})
    with open(data, "a") as handle:
        handle.write("\n")  # the same questions, another file
    with pytest.raises(AuditError, match=rf"differ from the run's: data.files.locomo.json.bytes was (\d+), now \d+ \({data}\)"):
        audit(run_dir, progress=False)


def test_what_the_audit_refuses_exits_2_in_one_line(small_locomo: Path, tmp_path: Path, capsys):
    run_dir = make_run(tmp_path / "run", small_locomo)
    assert main(["judge-audit", "--quiet", str(run_dir), "reader.model=other"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "memfit judge-audit: error: only eval.judge.* settings may be changed for an audit, not reader.model=other")
    # a row's F1 of 7 was read as it was (the F1-agreement column then agreed with any verdict)
    rows = read_jsonl(run_dir / "predictions.jsonl")
    rows[0]["scores"]["paper"]["f1"] = 7.0
    (run_dir / "predictions.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert main(["judge-audit", str(run_dir), "--quiet"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"memfit judge-audit: error: {run_dir / 'predictions.jsonl'}:1: question {rows[0]['question_id']}: field "
        "'scores.paper.f1' is 7.0, not a number from 0 to 1")
    # a row without its question id, or a line that is no object: a KeyError / AttributeError traceback (exit 1)
    rows[0]["scores"]["paper"]["f1"] = 0.5
    for first, says in (({k: v for k, v in rows[0].items() if k != "question_id"},
                         "field 'question_id' missing or not a string"),
                        ([1, 2], "expected a JSON object, got list")):
        (run_dir / "predictions.jsonl").write_text("".join(json.dumps(row) + "\n" for row in [first, *rows[1:]]))
        assert main(["judge-audit", str(run_dir), "--quiet"]) == 2
        assert capsys.readouterr().err.splitlines()[-1] == (
            f"memfit judge-audit: error: {run_dir / 'predictions.jsonl'}:1: {says}")
    (run_dir / "DONE").unlink()
    assert main(["judge-audit", str(run_dir), "--quiet"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"memfit judge-audit: error: {run_dir} is not a finished run (no DONE): finish it with `memfit run` first")


def test_wrong_answers_of_the_same_type():
    rng = random.Random("t")
    assert negate("Yes") == "No" and negate("Likely yes") == "Likely no" and negate("no.") == "yes."
    assert negate("She did not go") == "She did go" and negate("He didn't") == "He did"
    assert negate("Melanie is a nurse") == "Melanie is not a nurse"
    assert negate("Sweden") is None and negate("mental health") is None
    assert perturb("Sweden", rng) is None and perturb("adoption agencies", rng) is None
    for _ in range(20):
        year = int(perturb("2022", rng))
        assert year != 2022 and 2019 <= year <= 2025
        day, month, year = perturb("7 May 2023", rng).split()
        assert day != "7" and int(day) >= 0 and (month, year) == ("May", "2023")
        month = perturb("in June", rng).split()[1]
        assert month != "June" and month.lower() in {"january", "february", "march", "april", "may", "july",
                                                     "august", "september", "october", "november", "december"}
        assert perturb("three kids", rng).split()[1] == "kids" and perturb("three kids", rng) != "three kids"
    assert perturb("It may rain", rng) is None  # only a capitalised month name is a date
