"""metrics.json, the Markdown table and the CSV from a small hand-scored set of predictions."""

from __future__ import annotations

import csv

import pytest

from memfit_gpu.evaluate.tables import render_markdown, summarize, write_csv
from memfit_gpu.render import csv_text, markdown_table


def _row(qid, cat, f1, b1, verdict, evaluated=True, locomo_f1=None):
    return {
        "question_id": qid,
        "category": cat,
        "evaluated": evaluated,
        "scores": {
            "paper": {"f1": f1, "bleu1": b1},
            "locomo": {"f1": f1 if locomo_f1 is None else locomo_f1, "bleu1": b1},
        },
        "judge": None if verdict is None else {"verdict": verdict, "reason": "", "score": float(verdict)},
    }


ROWS = [
    _row("q1", "1", 1.0, 1.0, True, locomo_f1=0.5),
    _row("q2", "1", 0.0, 0.0, False),
    _row("q3", "2", 0.5, 0.25, True),
    _row("q4", "4", 1.0, 1.0, True),
    _row("q5", "4", 1.0, 1.0, True),
    _row("q6", "4", 0.4, 0.1, False),
    _row("q7", "5", 0.0, 0.0, False, evaluated=False),  # adversarial: not scored
]
# category means (paper): 1 -> F1 0.5, BLEU 0.5, judge 1/2; 2 -> 0.5, 0.25, 1; 4 -> 0.8, 0.7, 2/3
# Average (category_mean): F1 (0.5 + 0.5 + 0.8) / 3 = 0.6; BLEU (0.5 + 0.25 + 0.7) / 3 = 0.48333;
#   judge (1/2 + 1 + 2/3) / 3 = 13/18
# Overall: F1 3.9 / 6 = 0.65; BLEU 3.35 / 6 = 0.558333; judge 4/6


def test_summarize_locomo_category_mean():
    m = summarize(ROWS, variant="paper", benchmark="locomo", ci=False)
    assert m["questions"] == 6 and m["averaging"] == "category_mean" and m["metric_variant"] == "paper"
    assert m["variants"] == ["paper", "locomo"]
    assert list(m["by_category"]) == ["1", "2", "4"]
    cat1 = m["by_category"]["1"]
    assert cat1["name"] == "multi-hop" and cat1["n"] == 2
    assert cat1["paper"] == {"f1": pytest.approx(0.5), "bleu1": pytest.approx(0.5)}
    assert cat1["locomo"]["f1"] == pytest.approx(0.25)  # (0.5 + 0) / 2
    assert cat1["judge"] == pytest.approx(0.5) and cat1["judged"] == 2
    assert m["by_category"]["4"]["paper"]["f1"] == pytest.approx(0.8)
    assert m["by_category"]["4"]["judge"] == pytest.approx(2 / 3)
    assert m["average"]["paper"]["f1"] == pytest.approx(0.6)
    assert m["average"]["paper"]["bleu1"] == pytest.approx(1.45 / 3)
    assert m["average"]["judge"] == pytest.approx(13 / 18)
    assert m["overall"]["paper"]["f1"] == pytest.approx(0.65)
    assert m["overall"]["paper"]["bleu1"] == pytest.approx(3.35 / 6)
    assert m["overall"]["judge"] == pytest.approx(4 / 6)
    assert "ci95" not in m


def test_summarize_question_mean_and_missing_judge():
    m = summarize(ROWS, variant="locomo", averaging="question_mean", ci=False)
    assert m["averaging"] == "question_mean"
    assert m["average"]["paper"]["f1"] == pytest.approx(0.65)  # = overall
    assert m["average"]["locomo"]["f1"] == pytest.approx(3.4 / 6)
    partly = [dict(r) for r in ROWS]
    partly[2]["judge"] = None  # category 2 has no verdict left
    m = summarize(partly, benchmark="locomo", ci=False)
    assert m["by_category"]["2"]["judge"] is None and m["by_category"]["2"]["judged"] == 0
    assert m["average"]["judge"] is None  # a mean over some categories only would mislead
    assert m["overall"]["judge"] == pytest.approx(3 / 5) and m["overall"]["judged"] == 5
    assert summarize(ROWS, judge=False, ci=False)["overall"].get("judge", "absent") == "absent"


def test_summarize_ci_is_seeded_and_brackets_the_point():
    m = summarize(ROWS, benchmark="locomo", n_boot=2000, seed=4)
    ci = m["ci95"]
    assert ci["n_boot"] == 2000 and ci["seed"] == 4 and "within each category" in ci["method"]
    lo, hi = ci["average"]["paper"]["f1"]
    assert lo <= m["average"]["paper"]["f1"] <= hi
    lo, hi = ci["overall"]["judge"]
    assert 0.0 <= lo <= 4 / 6 <= hi <= 1.0
    assert ci["average"]["judge"][0] <= 13 / 18 <= ci["average"]["judge"][1]
    assert summarize(ROWS, benchmark="locomo", n_boot=2000, seed=4)["ci95"] == ci


def test_summarize_errors():
    with pytest.raises(ValueError, match="'memgallery' is not scored"):
        summarize(ROWS, variant="memgallery")
    with pytest.raises(ValueError, match="unknown averaging rule"):
        summarize(ROWS, averaging="median")
    with pytest.raises(ValueError, match="no evaluated predictions"):
        summarize([ROWS[-1]])


def test_render_markdown_paper_layout():
    m = summarize(ROWS, variant="paper", benchmark="locomo", n_boot=500)
    text = render_markdown(m)
    assert "### LoCoMo: 6 questions" in text
    assert "Metric variant: `paper`" in text and "mean of the 3 category means" in text
    # the table itself, as render.markdown_table lays it out: numbers right-aligned, padded to width
    assert (
        "| Category       |   n |    F1 |   BLEU-1 |   Judge |\n"
        "|:---------------|----:|------:|---------:|--------:|\n"
        "| multi-hop (1)  |   2 | 50.00 |    50.00 |   50.00 |\n"
        "| temporal (2)   |   1 | 50.00 |    25.00 |  100.00 |\n"
        "| single-hop (4) |   3 | 80.00 |    70.00 |   66.67 |\n"
        "| **Average**    |   6 | 60.00 |    48.33 |   72.22 |\n"
        "| **Overall**    |   6 | 65.00 |    55.83 |   66.67 |\n"
    ) in text
    assert "adversarial" not in text
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    assert len(rows) == 1 + 3 + 2  # header, three categories, Average and Overall


def test_render_markdown_says_how_many_judge_replies_were_unparsed():
    """An unparsed judge reply counts as not correct; results.md says how many there were (it did not)."""
    assert "stated no verdict" not in render_markdown(summarize(ROWS, benchmark="locomo", ci=False))
    rows = [dict(r) for r in ROWS]
    rows[1]["judge"] = {"verdict": False, "reason": "unparsed judge reply (x)", "score": 0.0, "unparsed": True}
    m = summarize(rows, benchmark="locomo", ci=False)
    assert m["overall"]["judge_unparsed"] == 1 and m["overall"]["judge"] == pytest.approx(4 / 6)
    assert ("1 of 6 judge replies stated no verdict the parser could read: each is counted as not correct"
            in render_markdown(m))


def test_render_markdown_says_how_many_answers_failed_at_the_reader():
    """A request the reader failed alone is answered empty for good (scored as such); results.md said nothing."""
    assert summarize(ROWS, benchmark="locomo", ci=False)["reader_errors"] == 0
    rows = [dict(r) for r in ROWS]
    rows[1]["reader_error"] = "prompt too long"
    rows[6]["reader_error"] = "not evaluated: not counted"
    m = summarize(rows, benchmark="locomo", ci=False)
    assert m["reader_errors"] == 1
    assert "1 of 6 answers failed at the reader and are scored as empty predictions" in render_markdown(m)


def test_write_csv(tmp_path):
    m = summarize(ROWS, variant="paper", benchmark="locomo", ci=False)
    path = write_csv(m, tmp_path / "metrics.csv")
    with path.open(newline="") as handle:
        table = list(csv.DictReader(handle))
    assert [r["category"] for r in table] == ["1", "2", "4", "average", "overall"]
    assert table[0]["name"] == "multi-hop" and table[0]["n"] == "2"
    assert float(table[3]["paper_f1"]) == pytest.approx(0.6)
    assert float(table[3]["judge"]) == pytest.approx(13 / 18)
    assert float(table[4]["locomo_f1"]) == pytest.approx(3.4 / 6)
    assert {r["averaging"] for r in table} == {"category_mean"}


def test_one_renderer_pads_aligns_escapes_and_keeps_number_text():
    text = markdown_table(["run", "F1"], [["a|b", "5.50"], ["long name", "100.00"]], align=["left", "right"])
    assert text == (
        "| run       |     F1 |\n"
        "|:----------|-------:|\n"
        "| a\\|b      |   5.50 |\n"
        "| long name | 100.00 |\n"
    )
    assert markdown_table(["x"], []) == "| x   |\n|-----|\n"  # no rows: the header alone
    with pytest.raises(ValueError, match="2 columns"):
        markdown_table(["a", "b"], [["1"]])
    assert csv_text(["a", "b"], [[None, 0.25], ["x,y", 3]]) == 'a,b\n,0.25\n"x,y",3\n'
