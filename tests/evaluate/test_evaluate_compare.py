"""`memfit compare` on two small run directories written here, with hand-computed results."""

from __future__ import annotations

import json
import re

import pytest

from memfit_gpu.cli import main
from memfit_gpu.config import ConfigError, load_config, to_yaml
from memfit_gpu.evaluate.compare import PredictionsError, compare_runs, compare_seeds, format_comparison

# question: (category, verdict A, verdict B)
PAIRS = {
    "conv-1:q1": ("1", False, True),
    "conv-1:q2": ("1", False, True),
    "conv-1:q3": ("1", True, True),
    "conv-1:q4": ("2", True, False),
    "conv-1:q5": ("2", True, True),
    "conv-1:q6": ("4", False, True),
    "conv-1:q7": ("4", False, False),
    "conv-1:q8": ("4", True, True),
}
# overall: A 4/8, B 6/8, diff 1/4; gained q1 q2 q6, lost q4. Non-zero differences +1 +1 -1 +1
#   (sum 2): |sum| >= 2 for 10 of the 16 sign vectors -> exact p = 10/16.
# category 1: A 1/3, B 1, gained 2 -> exact p = 2/4; category 2: A 1, B 1/2, lost 1 -> p = 1;
# category 4: A 1/3, B 2/3, gained 1 -> p = 1.
# mean of category means: (2/3 - 1/2 + 1/3) / 3 = 1/6; weighted differences +1/9, +1/9, -1/6, +1/9;
#   |signed sum| >= 1/6 in 10 of 16 (3/9 - 1/6 = 1/6 exactly ties the observed value).


def _record(qid, category, verdict, prediction="x", gold="x", scores=True, evaluated=True):
    row = {
        "question_id": qid,
        "memory_id": qid.split(":")[0],
        "category": category,
        "evaluated": evaluated,
        "question": "?",
        "gold": gold,
        "prediction": prediction,
        "judge": None if verdict is None else {"verdict": verdict, "reason": "", "score": float(verdict)},
    }
    if scores:
        row["scores"] = {"paper": {"f1": float(verdict or 0), "bleu1": float(verdict or 0)}}
    return row


def _write(run_dir, rows):
    run_dir.mkdir()
    (run_dir / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run_dir


@pytest.fixture
def runs(tmp_path):
    rows_a = [_record(q, c, a) for q, (c, a, _) in PAIRS.items()]
    rows_b = [_record(q, c, b) for q, (c, _, b) in PAIRS.items()]
    rows_a.append(_record("conv-1:q9", "4", True))  # only in A
    rows_b.insert(0, _record("conv-1:q10", "4", False))  # only in B
    rows_a.append(_record("conv-1:q11", "5", True, evaluated=False))  # adversarial: ignored
    rows_b.append(_record("conv-1:q11", "5", False, evaluated=False))
    return _write(tmp_path / "A", rows_a), _write(tmp_path / "B", rows_b)


def test_compare_exact_hand_values(runs):
    result = compare_runs(*runs, method="exact")
    assert result["metric"] == "judge"  # both runs carry verdicts
    assert result["paired"] == 8
    assert result["only_a"] == ["conv-1:q9"] and result["only_b"] == ["conv-1:q10"]
    overall = result["overall"]
    assert overall["mean_a"] == pytest.approx(0.5) and overall["mean_b"] == pytest.approx(0.75)
    assert overall["diff"] == pytest.approx(0.25)
    assert (overall["gained"], overall["lost"], overall["n"]) == (3, 1, 8)
    assert overall["p_value"] == pytest.approx(10 / 16)
    cats = result["by_category"]
    assert list(cats) == ["1", "2", "4"]
    assert cats["1"]["name"] == "multi-hop"
    assert (cats["1"]["gained"], cats["1"]["lost"], cats["1"]["p_value"]) == (2, 0, pytest.approx(0.5))
    assert cats["1"]["diff"] == pytest.approx(2 / 3)
    assert (cats["2"]["gained"], cats["2"]["lost"], cats["2"]["p_value"]) == (0, 1, pytest.approx(1.0))
    assert cats["2"]["diff"] == pytest.approx(-0.5)
    assert (cats["4"]["gained"], cats["4"]["lost"], cats["4"]["p_value"]) == (1, 0, pytest.approx(1.0))
    assert result["category_mean"]["diff"] == pytest.approx(1 / 6)
    assert result["category_mean"]["p_value"] == pytest.approx(10 / 16)


def test_compare_monte_carlo_is_seeded_and_close_to_exact(runs):
    mc = compare_runs(*runs, n_permutations=20_000, seed=3)
    assert mc["overall"]["p_value"] == pytest.approx(10 / 16, abs=0.015)
    assert mc["by_category"]["1"]["p_value"] == pytest.approx(0.5, abs=0.015)
    assert compare_runs(*runs, n_permutations=20_000, seed=3) == mc


def test_permutations_and_seed_default_to_run_a_config(runs):
    """eval.permutation_samples and eval.seed (read by nothing before) are compare's defaults, from run A's
    config.yaml; a bare predictions file gets the config defaults; explicit values win."""
    run_a, run_b = runs
    default = compare_runs(run_a, run_b)
    assert (default["n_permutations"], default["seed"]) == (10_000, 0)
    (run_a / "config.yaml").write_text(to_yaml(load_config(None, ["eval.permutation_samples=300", "eval.seed=7"])))
    configured = compare_runs(run_a, run_b)
    assert (configured["n_permutations"], configured["seed"]) == (300, 7)
    assert configured == compare_runs(run_a, run_b, n_permutations=300, seed=7)
    assert compare_runs(run_a, run_b, n_permutations=50)["seed"] == 7
    (run_a / "config.yaml").write_text("eval:\n  permutation_samples: 0\n")
    with pytest.raises(ConfigError, match="eval.permutation_samples"):
        compare_runs(run_a, run_b)


def test_cli_table_and_json(runs, capsys):
    run_a, run_b = runs
    assert main(["compare", str(run_a), str(run_b), "--exact"]) == 0
    out = capsys.readouterr().out
    assert "metric: judge (x100); paired questions: 8; exact sign-flip permutation test" in out
    # the one renderer's console table (memfit_gpu/render.py): cells as formatted, columns padded
    rows = {re.split(r"\s{2,}", line)[0]: re.split(r"\s{2,}", line)[1:] for line in out.splitlines()}
    # diff's 95 % bootstrap interval (SPEC: comparisons get bootstrap intervals): multi-hop's differences are
    # 1, 1, 0, so 1,000 resamples reach both 0 and 1
    assert rows["multi-hop (1)"] == ["3", "33.33", "100.00", "+66.67", "[+0.00, +100.00]", "0.5000", "2", "0"]
    overall = rows["overall"]
    assert overall[:4] + overall[5:] == ["8", "50.00", "75.00", "+25.00", "0.6250", "3", "1"]
    result = compare_runs(run_a, run_b, method="exact")
    lo, hi = result["overall"]["ci95"]
    assert overall[4] == f"[{100 * lo:+.2f}, {100 * hi:+.2f}]" and lo < 0.25 < hi and result["n_boot"] == 1000
    # the average of categories: its means are the category means' (mean_b - mean_a = diff), its interval
    # resamples within each category
    cm = result["category_mean"]
    assert cm["mean_b"] - cm["mean_a"] == pytest.approx(cm["diff"])
    assert cm["ci95"][0] <= cm["diff"] <= cm["ci95"][1]
    # --bootstrap sets the resamples (it was read by --seeds alone)
    assert main(["compare", str(run_a), str(run_b), "--json", "--bootstrap", "200"]) == 0
    assert json.loads(capsys.readouterr().out)["n_boot"] == 200
    assert "only in A: 1 questions (conv-1:q9)" in out
    assert "only in B: 1 questions (conv-1:q10)" in out

    assert (
        main(["compare", str(run_a), str(run_b / "predictions.jsonl"), "--json", "--permutations", "500"])
        == 0
    )
    data = json.loads(capsys.readouterr().out)
    assert data["n_permutations"] == 500 and data["overall"]["n_permutations"] == 500
    assert (data["overall"]["gained"], data["overall"]["lost"]) == (3, 1)
    assert data["overall"]["p_value"] >= 1 / 501


def test_f1_default_when_a_run_has_no_verdicts_and_rescoring(tmp_path):
    # B has no judge and no stored scores: F1 is computed from its prediction and gold (paper variant).
    rows_a = [_record("m:q1", "4", True, gold="Paris France"), _record("m:q2", "4", False, gold="Lyon")]  # F1 1, 0
    rows_b = [
        _record("m:q1", "4", None, prediction="Paris", gold="Paris France", scores=False),  # F1 2/3
        _record("m:q2", "4", None, prediction="Lyon", gold="Lyon", scores=False),  # F1 1
    ]
    result = compare_runs(_write(tmp_path / "A", rows_a), _write(tmp_path / "B", rows_b), method="exact")
    assert result["metric"] == "paper f1"
    assert result["overall"]["mean_b"] == pytest.approx((2 / 3 + 1) / 2)
    assert result["overall"]["diff"] == pytest.approx((2 / 3 + 1) / 2 - 0.5)
    assert (result["overall"]["gained"], result["overall"]["lost"]) == (1, 1)
    # differences -1/3 and +1 (sum 2/3): signed sums 4/3, 2/3, -2/3, -4/3 all reach |2/3| -> p = 1
    assert result["overall"]["p_value"] == pytest.approx(1.0)
    with pytest.raises(
        PredictionsError, match=r"B/predictions.jsonl: 2 paired questions have no judge verdict"
    ):
        compare_runs(tmp_path / "A", tmp_path / "B", metric="judge")


def test_bad_line_names_file_and_line(tmp_path, capsys):
    good = _write(tmp_path / "A", [_record("m:q1", "4", True)])
    bad = tmp_path / "B"
    bad.mkdir()
    (bad / "predictions.jsonl").write_text(json.dumps(_record("m:q1", "4", True)) + "\n\n{not json}\n")
    with pytest.raises(PredictionsError, match=r"B/predictions.jsonl:3: not valid JSON"):
        compare_runs(good, bad)
    assert main(["compare", str(good), str(bad)]) == 2
    assert "B/predictions.jsonl:3: not valid JSON" in capsys.readouterr().err
    (bad / "predictions.jsonl").write_text(json.dumps({"category": "4"}) + "\n")
    with pytest.raises(PredictionsError, match=r"predictions.jsonl:1: field 'question_id' missing"):
        compare_runs(good, bad)
    assert main(["compare", str(good), str(tmp_path / "nowhere")]) == 2
    assert "no predictions file" in capsys.readouterr().err


@pytest.mark.parametrize(("damage", "said"), [
    # a verdict "false" read as a truth value was a correct answer: the judge's mean went up
    ({"judge": {"verdict": "false"}}, "field 'judge.verdict' is 'false', not true, false or null"),
    ({"judge": "yes"}, "field 'judge' is 'yes', not the judge's record"),
    # an F1 of 7 was averaged in (a mean of 250.00); NaN stopped the test naming no file; a list, a traceback
    ({"scores": {"paper": {"f1": 7.0, "bleu1": 0.5}}}, "field 'scores.paper.f1' is 7.0, not a number from 0 to 1"),
    ({"scores": {"paper": {"f1": float("nan"), "bleu1": 0.5}}}, "field 'scores.paper.f1' is nan"),
    ({"scores": {"paper": {"f1": [0.5]}}}, "field 'scores.paper.f1' is [0.5]"),
    ({"scores": {"paper": {"f1": True}}}, "field 'scores.paper.f1' is True"),
    ({"scores": [0.5]}, "field 'scores' is [0.5], not a mapping"),
    ({"scores": {"paper": 0.5}}, "field 'scores.paper' is 0.5, not a mapping"),
    # a category lost (None) was a category of its own in the table, and moved the average of categories
    ({"category": None}, "field 'category' is None, not a category label"),
])
def test_a_row_holding_what_no_run_writes_is_refused_naming_its_field(tmp_path, capsys, damage, said):
    good = _write(tmp_path / "A", [_record("m:q1", "4", True), _record("m:q2", "4", False)])
    bad = _write(tmp_path / "B", [_record("m:q1", "4", True), {**_record("m:q2", "4", False), **damage}])
    with pytest.raises(PredictionsError) as info:
        compare_runs(good, bad)
    assert str(info.value).startswith(f"{bad / 'predictions.jsonl'}:2: question m:q2: {said}")
    assert main(["compare", str(good), str(bad)]) == 2
    assert said in capsys.readouterr().err


def test_duplicate_lines_use_the_later_one(tmp_path):
    rows_a = [_record("m:q1", "4", False), _record("m:q1", "4", True)]
    rows_b = [_record("m:q1", "4", True)]
    result = compare_runs(_write(tmp_path / "A", rows_a), _write(tmp_path / "B", rows_b), method="exact")
    assert result["paired"] == 1 and result["overall"]["diff"] == 0.0 and result["overall"]["p_value"] == 1.0
    assert any("appears again" in w for w in result["warnings"])
    assert "appears again" in format_comparison(result)


def test_rescoring_applies_locomos_category_rules_to_locomo_runs_only(tmp_path):
    """The locomo variant rescored own data labelled "3" by LoCoMo's rule (the gold cut at ";"): a run's
    config.yaml says which benchmark it read; a bare predictions file of categories 1-5 is taken as LoCoMo."""
    rows = [_record("m:q1", "3", None, prediction="Paris", gold="Paris; the capital", scores=False),
            _record("m:q2", "3", None, prediction="Lyon", gold="Lyon", scores=False)]
    run_a, run_b = _write(tmp_path / "A", rows), _write(tmp_path / "B", rows)
    bare = compare_runs(run_a, run_b, metric="f1", variant="locomo", method="exact")
    assert bare["overall"]["mean_a"] == pytest.approx(1.0)  # taken as LoCoMo: "Paris" is the whole gold
    (run_a / "config.yaml").write_text(to_yaml(load_config(None, ["data.benchmark=jsonl"])))
    own = compare_runs(run_a, run_b, metric="f1", variant="locomo", method="exact")
    assert own["overall"]["mean_a"] == pytest.approx((2 / 3 + 1) / 2)  # plain F1: "paris" of "paris capital"


@pytest.mark.parametrize(("field", "a", "b"), [("gold", "7 May 2023", "something else"), ("question", "When?", "Why?")])
def test_runs_that_asked_other_questions_under_one_id_are_refused(tmp_path, capsys, field, a, b):
    """Questions were paired by id alone: runs whose stored gold answer or question text differs under one id (other
    data) were tested against each other without a word. Refused naming the first such question and the field."""
    rows = [_record("m:q1", "4", True), _record("m:q2", "4", False)]
    run_a = _write(tmp_path / "A", [rows[0], {**rows[1], field: a}])
    run_b = _write(tmp_path / "B", [rows[0], {**rows[1], field: b}])
    said = (f"{run_a / 'predictions.jsonl'}:2 and {run_b / 'predictions.jsonl'}:2: question m:q2: field '{field}' "
            f"differs ({a!r} against {b!r}): the runs asked other questions under one id (other data), so their scores "
            "measure different things and are not compared")
    with pytest.raises(PredictionsError) as info:
        compare_runs(run_a, run_b)
    assert str(info.value) == said
    assert main(["compare", str(run_a), str(run_b)]) == 2
    assert capsys.readouterr().err.strip() == f"memfit compare: error: {said}"
    # over seeds: a B seed of other data, and an A seed of other data than the first A seed
    same = _write(tmp_path / "A2", [rows[0], {**rows[1], field: a}])
    with pytest.raises(PredictionsError, match=f"question m:q2: field '{field}' differs"):
        compare_seeds([run_a, same], [run_b])
    with pytest.raises(PredictionsError, match=f"question m:q2: field '{field}' differs"):
        compare_seeds([run_a, run_b], [same])
    # a row that lacks the field (an older file) is not held to it
    bare = _write(tmp_path / "bare", [rows[0], {k: v for k, v in rows[1].items() if k != field}])
    assert compare_runs(run_a, bare)["paired"] == 2
