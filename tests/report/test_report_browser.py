"""`memfit report` of two real runs, opened in headless Chromium (tests/support/chromium.py, Debian's package) and checked
through its DOM: the results and comparison tables, the failure attribution counts (equal to counts this test
works out from packs.jsonl and predictions.jsonl itself), a question's evidence marked with its rank, the
viewer's filters, no script error and no request but the file itself; a screenshot is kept as a CI artifact
($MEMFIT_TEST_ARTIFACTS, default runs/test-artifacts/). The same runs' W&B run (offline) gets the per-question
table and the report.

Run A is the session's smoke run (configs/smoke.yaml, SmolLM2); run B is configs/smoke.yaml at pack.k=5 with
eval.pack_cutoffs=[5,10] and W&B on, answered by the test-only echo reader on a copy of A's store (no encoding, no
model: the report's machinery is under test, not the answers)."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
from support.chromium import Chromium  # tests/ is on sys.path
from support.report_runs import REPO, echo_run
from support.wandb_offline import read_offline_run

from memfit_gpu.cli import main
from memfit_gpu.evaluate.compare import compare_runs
from memfit_gpu.files import read_jsonl
from memfit_gpu.report import question_records, question_table, read_run
from memfit_gpu.report.build import TABLE_COLUMNS
from memfit_gpu.run.tracking import RUN_ID_FILE

pytestmark = pytest.mark.slow

ARTIFACTS = Path(os.environ.get("MEMFIT_TEST_ARTIFACTS", REPO / "runs" / "test-artifacts"))


@pytest.fixture(scope="module")
def runs(smoke_run_dir: tuple[Path, str], shared_data: Path, tmp_path_factory: pytest.TempPathFactory
         ) -> tuple[Path, Path, Path]:
    """(run A, run B, B's W&B folder)."""
    root = tmp_path_factory.mktemp("report-runs")
    wandb_dir = root / "wandb-files"
    b = echo_run(root / "k5-depths", smoke_run_dir[0] / "store", shared_data, "pack.k=5", "eval.pack_cutoffs=[5,10]",
                 "tracking.wandb.enabled=true", "tracking.wandb.project=memfit-test",
                 env={"WANDB_MODE": "offline", "WANDB_DIR": str(wandb_dir), "WANDB_SILENT": "true"})
    return smoke_run_dir[0], b, wandb_dir


def written_id(turn_id: str) -> str:
    return turn_id.split("#dup")[0]


def expected_outcomes(run: Path) -> dict[str, str]:
    """Each question's outcome, worked out here from the run's files (neither run has a judge: F1 >= 0.5 is
    correct; a rank counts the ranked turns; retrieved = within the first 30)."""
    packs = {row["question_id"]: row for row in read_jsonl(run / "packs.jsonl")}
    out = {}
    for p in read_jsonl(run / "predictions.jsonl"):
        pack = packs[p["question_id"]]
        evidence = set(pack["evidence"])
        turns = [c["turn_id"] for c in pack["ranked"] if c["kind"] == "episode"]
        ranks = [i for i, t in enumerate(turns, start=1) if written_id(t) in evidence]
        hit = any(written_id(s["turn_id"]) in evidence for s in pack["pack"]["selected"])
        assert pack["retrieval"] is None or pack["retrieval"]["pack_hit"] == hit
        if p["scores"]["paper"]["f1"] >= 0.5:
            out[p["question_id"]] = "correct"
        elif pack["retrieval"] is None:
            out[p["question_id"]] = "no_evidence"
        elif hit:
            out[p["question_id"]] = "reader_missed"
        elif ranks and ranks[0] <= 30:
            out[p["question_id"]] = "cut_from_pack"
        else:
            out[p["question_id"]] = "not_retrieved"
    return out


COUNTS = """Array.from(document.querySelectorAll("td.count")).map((td) =>
    [td.dataset.run, td.dataset.category, td.dataset.outcome, Number(td.textContent)])"""


def test_the_report_of_two_real_runs_in_chromium(runs: tuple[Path, Path, Path], tmp_path: Path) -> None:
    a, b, _ = runs
    out = tmp_path / "report.html"
    assert main(["report", str(a), str(b), "--out", str(out)]) == 0
    outcomes = [expected_outcomes(a), expected_outcomes(b)]
    categories = {p["question_id"]: p["category"] for p in read_jsonl(a / "predictions.jsonl")}
    metrics = [json.loads((r / "metrics.json").read_text()) for r in (a, b)]
    compared = compare_runs(a, b)

    with Chromium(tmp_path / "profile") as browser:
        browser.open(out.as_uri())
        # the results table of each run: its categories, Average and Overall, the Average F1 of metrics.json
        tables = browser.evaluate("""Array.from(document.querySelectorAll("table.results")).map((t) =>
            Array.from(t.querySelectorAll("tr")).slice(1).map((tr) => Array.from(tr.cells).map((c) => c.textContent.trim())))""")
        assert len(tables) == 2
        for table, m in zip(tables, metrics, strict=True):
            assert [row[0] for row in table] == [f"{c['name']} ({cat})" for cat, c in m["by_category"].items()] + [
                "Average", "Overall"]
            assert table[-2][2].startswith(f"{100 * m['average']['paper']['f1']:.2f}")
            assert table[-2][1] == "6"
        # the paired comparison, as memfit compare computes it
        overall = browser.evaluate("""Array.from(document.querySelectorAll("#compare-1 tr")).map((tr) =>
            Array.from(tr.cells).map((c) => c.textContent.trim())).find((r) => r[0] === "overall")""")
        assert overall[5:] == [f"{compared['overall']['p_value']:.4f}", str(compared["overall"]["gained"]),
                               str(compared["overall"]["lost"])]
        assert browser.evaluate("""Array.from(document.querySelectorAll("#config-diff code")).map((c) => c.textContent)""") \
            == ["eval.pack_cutoffs", "pack.k", "reader.backend", "store.path", "tracking.wandb.enabled",
                "tracking.wandb.project"]
        # the attribution counts per run, category and outcome, and their totals
        cells = browser.evaluate(COUNTS)
        found: dict[tuple[str, str, str], int] = {(r, c, o): n for r, c, o, n in cells}
        for run, expected in enumerate(outcomes):
            for outcome in ("correct", "not_retrieved", "cut_from_pack", "reader_missed", "no_evidence"):
                for category in set(categories.values()):
                    n = sum(1 for q, o in expected.items() if o == outcome and categories[q] == category)
                    assert found[(str(run), category, outcome)] == n, (run, category, outcome)
                assert found[(str(run), "all", outcome)] == sum(1 for o in expected.values() if o == outcome)
        assert len(found) == 2 * 5 * (len(set(categories.values())) + 1)
        # a question whose evidence run A packed: the excerpt of that turn is marked, with its rank
        qid = next(q for q, o in outcomes[0].items() if o == "reader_missed")
        pack = next(r for r in read_jsonl(a / "packs.jsonl") if r["question_id"] == qid)
        evidence = next(s["turn_id"] for s in pack["pack"]["selected"] if written_id(s["turn_id"]) in pack["evidence"])
        rank = 1 + [c["turn_id"] for c in pack["ranked"] if c["kind"] == "episode"].index(evidence)
        number = 1 + [e["turn_id"] for e in pack["pack"]["episodes"]].index(evidence)
        line = next(x for x in pack["excerpts"].splitlines() if x.startswith(f"EXCERPT {number} "))
        marked = browser.evaluate(f"""Array.from(document.querySelectorAll(
            'article[data-qid="{qid}"] section.answer[data-run="0"] .excerpt.evidence')).map((e) =>
            [e.dataset.turns, e.querySelector(".rank").textContent, e.textContent])""")
        assert [m[:2] for m in marked] == [[evidence, f"{written_id(evidence)}: turn rank {rank}"]]
        assert marked[0][2].endswith(line)
        # the viewer's filters: run A's questions whose reader missed the packed evidence
        shown = browser.evaluate("""(() => { document.getElementById("filter-run").value = "0";
            const outcome = document.getElementById("filter-outcome"); outcome.value = "reader_missed";
            outcome.dispatchEvent(new Event("change"));
            return [window.memfitReport.shown(),
                    Array.from(document.querySelectorAll("article.question:not(.hidden)")).map((q) => q.dataset.qid)]; })()""")
        missed = [q for q, o in outcomes[0].items() if o == "reader_missed"]
        assert shown == [len(missed), missed]
        # run B's pack depths
        assert browser.evaluate("document.querySelectorAll('table.depths tr').length") == 3
        assert browser.evaluate("document.querySelectorAll('figure svg').length") == 4  # scores, attribution, frontier, depths
        assert browser.script_errors == []
        # nothing but the file itself (and data: URLs) was asked for
        assert browser.requests and browser.requests[0] == out.as_uri()
        assert all(url.startswith(("file://", "data:")) for url in browser.requests), browser.requests
        browser.evaluate("""(() => { document.getElementById("filter-outcome").value = "";
            document.getElementById("filter-outcome").dispatchEvent(new Event("change")); })()""")
        shot = browser.screenshot(ARTIFACTS / "report.png")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_request_recorder_sees_a_page_that_reaches_out(tmp_path: Path) -> None:
    """The check above is only as good as the recorder: a page with an image on a server is seen asking for it."""
    page = tmp_path / "out.html"
    page.write_text('<!DOCTYPE html><html><body><img src="http://192.0.2.1/x.png"></body></html>')
    with Chromium(tmp_path / "profile") as browser:
        browser.open(page.as_uri())
        assert "http://192.0.2.1/x.png" in browser.requests


def test_the_wandb_run_gets_the_question_table_and_the_report(runs: tuple[Path, Path, Path]) -> None:
    _, b, wandb_dir = runs
    run_id = (b / RUN_ID_FILE).read_text().strip()
    pattern = re.compile(rf"offline-run-\d{{8}}_\d{{6}}-{re.escape(run_id)}(-\d+)?")
    (folder,) = [f for f in (wandb_dir / "wandb").glob("offline-run-*") if pattern.fullmatch(f.name)]
    record = read_offline_run(folder, wait_s=30)
    table = next(row["questions"] for row in record.history if "questions" in row)
    assert (table["_type"], table["nrows"], table["ncols"]) == ("table-file", 6, len(TABLE_COLUMNS))
    data: dict[str, Any] = json.loads((folder / "files" / table["path"]).read_text())
    columns, rows = question_table(question_records(read_run(b, b.name)))
    assert data["columns"] == columns and data["data"] == json.loads(json.dumps(rows))
    artifact = next(x for x in record.artifacts if x["type"] == "report")
    assert artifact["files"] == ["report.html"]
    md5 = base64.b64encode(hashlib.md5((b / "report.html").read_bytes()).digest()).decode()
    assert artifact["digests"]["report.html"] == md5
    page = (b / "report.html").read_text()  # the report of this one run: its depths, its six questions
    assert page.count('<table class="depths">') == 1 and page.count('<article class="question"') == 6
