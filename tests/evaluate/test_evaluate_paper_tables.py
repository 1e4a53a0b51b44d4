"""Paper experiment configs and the paper's tables (memfit_gpu.evaluate.paper_tables, experiments/paper_tables.py).

Configs: every configs/experiments/ file loads; every configs/sweeps/paper_* point loads with its overrides and
changes exactly what its configs/ablations/ file changes. Tables: small run directories written here (their
numbers are test inputs) with every expected cell computed by hand in the comments; and, slow, two real runs
of configs/smoke.yaml.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support.data import write_small_locomo
from support.env import memfit_env

from memfit_gpu.cli import main
from memfit_gpu.config import load_config, to_dict, to_yaml
from memfit_gpu.evaluate import paper_tables as pt
from memfit_gpu.evaluate.tables import summarize
from memfit_gpu.mappings import flatten
from memfit_gpu.readers.ledger import Ledger, ModelStats, RoleStats
from memfit_gpu.readers.prompts import JUDGE_KINDS
from memfit_gpu.sweep.spec import load_sweep, point_overrides

REPO = Path(__file__).resolve().parents[2]
EXPERIMENTS = REPO / "configs" / "experiments"
ABLATIONS = REPO / "configs" / "ablations"
PAPER_SWEEPS = sorted((REPO / "configs" / "sweeps").glob("paper_*.yaml"))


# ------------------------------------------------------------------------------------------- configs


def _diff(changed, base) -> dict[str, Any]:
    a, b = flatten(to_dict(changed)), flatten(to_dict(base))
    return {k: a[k] for k in a if a[k] != b.get(k) and k not in ("name", "tracking.wandb.group")}


def test_experiment_configs_load_with_the_paper_readers_and_judge():
    files = sorted(EXPERIMENTS.glob("*.yaml"))
    loaded = {f.stem: load_config(f) for f in files}  # a typo in any key raises ConfigError here
    expected = {
        "locomo_qwen3_8b": ("locomo", "Qwen/Qwen3-8B", "none"),
        "locomo_gemma3_27b": ("locomo", "google/gemma-3-27b-it", "none"),
        "memgallery_qwen25vl_7b_text": ("memgallery", "Qwen/Qwen2.5-VL-7B-Instruct", "none"),
        "memgallery_qwen25vl_7b_question": ("memgallery", "Qwen/Qwen2.5-VL-7B-Instruct", "question"),
        "memgallery_qwen25vl_7b_retrieved": ("memgallery", "Qwen/Qwen2.5-VL-7B-Instruct", "retrieved"),
        "longmemeval_s_qwen3_8b": ("longmemeval", "Qwen/Qwen3-8B", "none"),
        "efficiency_locomo_gemma3_27b": ("locomo", "google/gemma-3-27b-it", "none"),
    }
    assert set(expected) <= set(loaded)
    paper = load_config(REPO / "configs" / "memfit.yaml")
    for stem, (benchmark, model, images) in expected.items():
        cfg = loaded[stem]
        assert (cfg.data.benchmark, cfg.reader.model, cfg.reader.images) == (benchmark, model, images), stem
        assert cfg.reader.backend == "vllm"
        # the reader GPUs of one 4-GPU server, leaving GPU 3 to the judge server
        assert cfg.reader.instances * cfg.reader.tensor_parallel_size <= 3
        # retrieval is the paper's everywhere: only data, reader, eval and tracking differ from memfit.yaml
        assert {k.split(".")[0] for k in _diff(cfg, paper)} <= {"data", "reader", "eval", "tracking"}, stem
        assert cfg.eval.judge.prompt in ("auto", *JUDGE_KINDS)
        if stem.startswith("efficiency"):
            assert not cfg.eval.judge.enabled
        else:
            assert cfg.eval.judge.enabled and cfg.eval.judge.model == "openai/gpt-oss-20b"
    assert loaded["memgallery_qwen25vl_7b_text"].eval.judge.prompt == "paper"
    assert loaded["longmemeval_s_qwen3_8b"].data.exclude_categories == []


def _ablation_file_for(point_name: str) -> Path | None:
    if point_name in ("full", "default"):
        return None  # = configs/memfit.yaml
    if point_name == "narrow_pools_30_40":
        return ABLATIONS / "no_wide_scan.yaml"  # the paper row narrows both numbers at once
    return ABLATIONS / f"{point_name}.yaml"


def test_paper_sweeps_load_and_points_match_the_ablation_files():
    assert len(PAPER_SWEEPS) >= 5
    paper = load_config(REPO / "configs" / "memfit.yaml")
    covered: set[str] = set()
    for path in PAPER_SWEEPS:
        spec = load_sweep(path)  # validates every point's config
        base = load_config(spec.config)
        for point in spec.points:
            cfg = load_config(spec.config, point_overrides(spec.name, spec.fixed, point))
            ablation_file = _ablation_file_for(point.point_id)
            want = {} if ablation_file is None else _diff(load_config(ablation_file), paper)
            assert ablation_file is None or ablation_file.exists(), f"{path.name}: {point.point_id}"
            assert _diff(cfg, base) == want, f"{path.name}: point {point.point_id}"
            if ablation_file is not None:
                covered.add(ablation_file.stem)
    # every ablation/sensitivity file of configs/ablations/ is some paper sweep's point
    assert covered == {f.stem for f in ABLATIONS.glob("*.yaml")}


# -------------------------------------------------------------------------------- synthetic run dirs


def _row(qid: str, cat: str, f1: float, bleu1: float, verdict: bool, memory: str = "m1") -> dict[str, Any]:
    return {"question_id": qid, "memory_id": memory, "category": cat, "evaluated": True, "question": "q",
            "gold": "g", "prediction": "p", "raw_output": "p", "abstained": False,
            "scores": {"paper": {"f1": f1, "bleu1": bleu1}},
            "judge": {"verdict": verdict, "reason": "", "score": float(verdict)}, "retrieval": None}


def _ledger(answer_in: int = 8000, answer_out: int = 80, answer_calls: int = 8) -> dict[str, Any]:
    ledger = Ledger()
    ledger.roles["summary"] = RoleStats(calls=3, input_tokens=3000, output_tokens=300, wall_s=6.0, gpu_seconds=6.0)
    ledger.roles["answer"] = RoleStats(calls=answer_calls, input_tokens=answer_in, output_tokens=answer_out,
                                       wall_s=4.0, gpu_seconds=4.0)
    ledger.roles["judge"] = RoleStats(calls=answer_calls, input_tokens=1, output_tokens=1)
    ledger.answer_keys = [f"q{i}" for i in range(answer_calls)]
    return ledger.to_dict()


def write_run(path: Path, rows: list[dict[str, Any]], benchmark: str = "locomo", model: str = "reader/A",
              retrieval: dict[str, Any] | None = None, ledger: dict[str, Any] | None = None,
              method: str = "memfit") -> Path:
    """A finished run directory with the files `memfit run` writes, from hand-chosen predictions."""
    path.mkdir(parents=True)
    cfg = load_config(REPO / "configs" / "memfit.yaml", [f"data.benchmark={benchmark}", f"reader.model={model}",
                                                          f"method={method}"])
    (path / "config.yaml").write_text(to_yaml(cfg))
    (path / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    metrics = summarize(rows, variant="paper", judge=True, benchmark=benchmark, ci=False)
    metrics["retrieval"] = retrieval or {"overall": {"questions": len(rows), "pack_hit": 0.5, "hit@30": 0.5},
                                         "by_category": {}}
    metrics["timings"] = {"load": 1.0, "build": 10.0, "summaries": 6.0, "retrieve": 0.4, "answer": 5.0, "score": 0.1}
    (path / "metrics.json").write_text(json.dumps(metrics))
    (path / "ledger.json").write_text(json.dumps(ledger or _ledger(answer_calls=len(rows))))
    (path / "DONE").write_text("2026-01-01T00:00:00\n")
    return path


# LoCoMo, 8 questions, 2 per category: (id, category, F1, BLEU-1, judge verdict, memory)
FULL = [("q1", "1", 1.0, 0.9, True), ("q2", "1", 0.4, 0.3, False), ("q3", "2", 0.6, 0.5, True),
        ("q4", "2", 0.2, 0.1, True), ("q5", "3", 0.3, 0.2, False), ("q6", "3", 0.1, 0.1, True),
        ("q7", "4", 0.8, 0.7, True), ("q8", "4", 0.9, 0.8, True)]
PLAIN = [("q1", "1", 0.5, 0.4, False), ("q2", "1", 0.4, 0.3, False), ("q3", "2", 0.6, 0.5, True),
         ("q4", "2", 0.0, 0.0, False), ("q5", "3", 0.3, 0.2, False), ("q6", "3", 0.1, 0.1, False),
         ("q7", "4", 0.8, 0.7, True), ("q8", "4", 0.5, 0.4, True)]
NO_PRF = [("q1", "1", 0.5, 0.4, False)] + FULL[1:4] + [("q5", "3", 0.5, 0.4, True)] + FULL[5:]


def _rows(spec):
    return [_row(q, c, f, b, v, "m1" if int(q[1:]) <= 4 else "m2") for q, c, f, b, v in spec]


FULL_RETRIEVAL = {"overall": {"questions": 8, "pack_hit": 0.75, "hit@30": 0.875},
                  "by_category": {"1": {"questions": 2, "pack_hit": 0.5, "hit@30": 1.0},
                                  "2": {"questions": 2, "pack_hit": 1.0, "hit@30": 1.0},
                                  "3": {"questions": 2, "pack_hit": 0.5, "hit@30": 0.5},
                                  "4": {"questions": 2, "pack_hit": 1.0, "hit@30": 1.0}}}


@pytest.fixture()
def sweep_dir(tmp_path: Path) -> Path:
    """A sweep directory as `memfit sweep --out` leaves it: sweep.json and points/<id>/."""
    root = tmp_path / "sweep"
    write_run(root / "points" / "full", _rows(FULL), retrieval=FULL_RETRIEVAL)
    write_run(root / "points" / "no_prf", _rows(NO_PRF))
    write_run(root / "points" / "plain_retrieval", _rows(PLAIN), ledger=_ledger(answer_in=4400))
    points = [{"id": p, "dir": f"/elsewhere/{p}", "state": "done"} for p in ("full", "no_prf", "plain_retrieval")]
    (root / "sweep.json").write_text(json.dumps({"name": "t", "points": points}))
    return root


EXACT = pt.PairedTests(method="exact")


def _markdown_rows(text: str) -> list[list[str]]:
    """The rows of the Markdown tables in `text` as cells without their padding (header and rule included)."""
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in text.splitlines() if line.startswith("|")]


def test_table1_locomo_cells(sweep_dir: Path):
    table = pt.locomo_main(pt.expand(str(sweep_dir)))
    # full: multi-hop F1 (1.0 + 0.4) / 2 = 70.00, BLEU-1 (0.9 + 0.3) / 2 = 60.00, judge 1 of 2 = 50.00
    assert [table.cell("full", c) for c in ("multi-hop F1", "multi-hop BLEU-1", "multi-hop Judge")] == \
        ["70.00", "60.00", "50.00"]
    # category F1 means 0.7, 0.4, 0.2, 0.85 -> average 53.75; BLEU-1 0.6, 0.3, 0.15, 0.75 -> 45.00;
    # judge 0.5, 1.0, 0.5, 1.0 -> 75.00
    assert [table.cell("full", c) for c in ("Average F1", "Average BLEU-1", "Average Judge")] == \
        ["53.75", "45.00", "75.00"]
    # plain: F1 means 0.45, 0.3, 0.2, 0.65 -> 40.00; temporal judge 1 of 2
    assert table.cell("plain_retrieval", "Average F1") == "40.00"
    assert table.cell("plain_retrieval", "temporal Judge") == "50.00"
    assert table.cell("full", "Reader") == "reader/A" and table.cell("full", "n") == "8"
    assert _markdown_rows(table.markdown())[2][:6] == ["full", "reader/A", "8", "70.00", "60.00", "50.00"]


def test_table1_states_the_categories_its_average_is_the_mean_of(tmp_path: Path, sweep_dir: Path):
    """The note said "the four category means" of a run with three categories (a smoke run has no single-hop
    question): it names the categories averaged."""
    assert pt.locomo_main(pt.expand(str(sweep_dir))).notes[0] == (
        "F1 / BLEU-1: metric variant `paper`, x100. Average = unweighted mean of the four category means (each Judge "
        "column likewise); n = scored questions.")
    three = write_run(tmp_path / "three", _rows(FULL[:6]))
    assert pt.locomo_main([pt.load_run(three)]).notes[0] == (
        "F1 / BLEU-1: metric variant `paper`, x100. Average = unweighted mean of the 3 category means the runs scored "
        "(multi-hop, temporal, open-domain) (each Judge column likewise); n = scored questions.")
    table = pt.locomo_main(pt.expand_all([str(three), str(sweep_dir / "points" / "full")]))
    assert table.notes[0] == (
        "F1 / BLEU-1: metric variant `paper`, x100. Average = unweighted mean of the means of the categories each run "
        "scored (three: 3 (multi-hop, temporal, open-domain); full: 4 (multi-hop, temporal, open-domain, single-hop)) "
        "(each Judge column likewise); n = scored questions.")


def _provenance(run: Path, data_sha: str, judge: str = "j") -> None:
    record = {"schema": 1, "data": {"files": {"locomo10.json": {"sha256": data_sha * 64}}},
              "judge": {"enabled": True, "model": judge}, "models": {}, "prompts": {}}
    (run / "provenance.json").write_text(json.dumps(record))


def test_tables_say_where_the_runs_provenance_differs(tmp_path: Path, sweep_dir: Path):
    """`memfit tables` combined runs of other data or another judge without a word (the paired tests' provenance
    lines were dropped; unjudged runs had none): each table of several runs ends with provenance.drift's lines, as
    `memfit aggregate` prints them."""
    points = sweep_dir / "points"
    for point_id in ("full", "no_prf"):
        _provenance(points / point_id, "a")
    _provenance(points / "plain_retrieval", "b", judge="other")
    runs = pt.expand(str(sweep_dir))
    drift = ["warning: data: full and plain_retrieval differ in data.files.locomo10.json.sha256 (full: aaaaaaaaaaaa; "
             "plain_retrieval: bbbbbbbbbbbb)",
             "warning: judge: full and plain_retrieval differ in judge.model (full: j; plain_retrieval: other)"]
    for table in (pt.locomo_main(runs), pt.ablation(runs, EXACT), pt.retrieval_diagnostics(runs),
                  pt.sensitivity(runs, EXACT, baseline="full"),
                  *pt.efficiency(runs), pt.efficiency_methods(runs)):
        assert table.notes[-2:] == drift, table.key
        assert table.markdown().endswith(f"- {drift[0]}\n- {drift[1]}\n")
    # Table 6: each reader's plain run first, the reference
    assert pt.plain_vs_memfit(pt.pairs_from_sweeps([str(sweep_dir)]), EXACT).notes[-2:] == [
        "warning: data: plain_retrieval and full differ in data.files.locomo10.json.sha256 (plain_retrieval: "
        "bbbbbbbbbbbb; full: aaaaaaaaaaaa)",
        "warning: judge: plain_retrieval and full differ in judge.model (plain_retrieval: other; full: j)"]
    # a run without provenance.json is said to be not compared; one run alone is compared with nothing
    (points / "no_prf" / "provenance.json").unlink()
    notes = pt.ablation(runs, EXACT).notes
    assert "note: no_prf has no provenance.json (made before memfit recorded provenance): not compared" in notes
    assert not any(n.startswith(("note:", "warning:")) for n in pt.locomo_main(runs[:1]).notes)
    # runs of one provenance: nothing to say
    _provenance(points / "no_prf", "a")
    assert not any(n.startswith(("note:", "warning:")) for n in pt.locomo_main(runs[:2]).notes)
    # through the CLI: under the table in OUT/tables.md
    out = tmp_path / "tables"
    assert main(["tables", "--out", str(out), "--locomo-main", str(sweep_dir)]) == 0
    assert f"- {drift[1]}" in (out / "tables.md").read_text()


def test_unjudged_runs_of_other_gold_answers_are_refused(tmp_path: Path):
    """Unjudged runs were checked for the same question ids only: runs of other gold answers (other data) had the
    difference of their averages printed."""
    rows = _rows(FULL)
    for row in rows:
        row["judge"] = None
    full = write_run(tmp_path / "full", rows)
    other = write_run(tmp_path / "other", [{**r, "gold": "another"} if r["question_id"] == "q3" else r for r in rows])
    with pytest.raises(pt.TablesError) as info:
        pt.ablation(pt.expand_all([str(full), str(other)]), EXACT, baseline="full")
    assert str(info.value) == (
        f"paired test full vs other: {full}/predictions.jsonl:3 and {other}/predictions.jsonl:3: question q3: field "
        "'gold' differs ('g' against 'another'): the runs asked other questions under one id (other data), so their "
        "scores measure different things and are not compared")


def test_table6_plain_vs_memfit_paired_test(sweep_dir: Path):
    table = pt.plain_vs_memfit(pt.pairs_from_sweeps([f"Reader A={sweep_dir}"]), EXACT)
    # judge 3/8 -> 6/8; full gains q1, q4, q6 and loses none: three +1 differences, exact p = 2 / 2**3
    assert [table.cell("Reader A", c) for c in ("n", "Plain Judge", "MemFit Judge", "Judge diff", "p",
                                                "Gained", "Lost")] == \
        ["8", "37.50", "75.00", "+37.50", "0.2500", "3", "0"]
    # average F1 40.00 -> 53.75
    assert [table.cell("Reader A", c) for c in ("Plain Avg F1", "MemFit Avg F1", "F1 diff")] == \
        ["40.00", "53.75", "+13.75"]
    # without a label the row is the reader model from config.yaml
    assert pt.plain_vs_memfit(pt.pairs_from_sweeps([str(sweep_dir)]), EXACT).formatted()[0][0] == "reader/A"


def test_ablation_table_deltas_to_full(sweep_dir: Path):
    table = pt.ablation(pt.expand(str(sweep_dir)), EXACT)
    # no_prf: multi-hop (0.5 + 0.4) / 2 = 45.00, open-domain (0.5 + 0.1) / 2 = 30.00; average
    # (0.45 + 0.4 + 0.3 + 0.85) / 4 = 50.00; BLEU-1 (0.35 + 0.3 + 0.25 + 0.75) / 4 = 41.25
    assert [table.cell("no_prf", c) for c in ("multi-hop F1", "open-domain F1", "Avg F1", "Avg BLEU-1")] == \
        ["45.00", "30.00", "50.00", "41.25"]
    # judge still 6/8 (q1 lost, q5 gained): diff +0.00, both sign vectors' sums reach |0|: p = 4/4
    assert [table.cell("no_prf", c) for c in ("Judge", "F1 diff", "Judge diff", "p", "Gained", "Lost")] == \
        ["75.00", "-3.75", "+0.00", "1.0000", "1", "1"]
    assert [table.cell("plain_retrieval", c) for c in ("F1 diff", "Judge diff", "p", "Lost")] == \
        ["-13.75", "-37.50", "0.2500", "3"]
    assert table.cell("full", "Judge diff") == "-"


def test_retrieval_diagnostics_table(sweep_dir: Path):
    table = pt.retrieval_diagnostics(pt.expand(str(sweep_dir)))
    assert [table.cell("full", c) for c in ("n", "Pack hit", "Hit@30", "multi-hop pack hit", "open-domain hit@30")] \
        == ["8", "75.00", "87.50", "50.00", "50.00"]
    assert table.cell("no_prf", "temporal pack hit") == "-"  # no per-category block in that run


def test_retrieval_diagnostics_say_what_each_hit_at_30_ranked(tmp_path: Path):
    """Runs of eval.hit_list final (summaries hold ranks) and episodes (the turns alone) stood side by side in one
    Hit@30 column without a word: a column says which, and a note warns when they differ."""
    final = write_run(tmp_path / "final", _rows(FULL), retrieval={**FULL_RETRIEVAL, "hit_list": "final"})
    episodes = write_run(tmp_path / "episodes", _rows(FULL), retrieval={**FULL_RETRIEVAL, "hit_list": "episodes"})
    older = write_run(tmp_path / "older", _rows(FULL), retrieval=FULL_RETRIEVAL)  # diagnostics before the setting
    table = pt.retrieval_diagnostics(pt.expand_all([str(final), str(episodes), str(older)]))
    assert [table.cell(label, "Hit list") for label in ("final", "episodes", "older")] == ["final", "episodes",
                                                                                        "episodes"]
    assert table.notes[1] == ("warning: the runs' Hit@30 rank over different lists (final: final, episodes: episodes, "
                              "older: episodes): those columns are not comparable between them (rerun with one "
                              "eval.hit_list)")
    alike = pt.retrieval_diagnostics(pt.expand_all([str(episodes), str(older)]))
    assert not any("different lists" in note for note in alike.notes)


def test_sensitivity_tokens_relative_to_default(tmp_path: Path):
    default = write_run(tmp_path / "default", _rows(FULL))  # answer prompts 8000 tokens / 8 calls
    k5 = write_run(tmp_path / "k5", _rows(PLAIN), ledger=_ledger(answer_in=4400))
    table = pt.sensitivity([pt.load_run(default), pt.load_run(k5)], EXACT)
    # 4400 / 8 = 550 tokens per question, 550 / 1000 = x0.55
    assert [table.cell("k5", c) for c in ("Input tokens / question", "Tokens vs default", "Judge diff", "p")] == \
        ["550", "x0.55", "-37.50", "0.2500"]
    assert [table.cell("default", c) for c in ("Input tokens / question", "Tokens vs default", "Judge diff")] == \
        ["1000", "x1.00", "-"]


def test_memgallery_table(tmp_path: Path):
    text = write_run(tmp_path / "text", [_row("a", "TTL", 0.5, 0.5, True), _row("b", "TTL", 0.7, 0.7, False),
                                         _row("c", "VS", 0.2, 0.2, False), _row("d", "FR", 1.0, 1.0, True)],
                     benchmark="memgallery")
    image = write_run(tmp_path / "question", [_row("a", "TTL", 0.9, 0.9, True), _row("b", "TTL", 0.9, 0.9, True),
                                              _row("c", "VS", 0.2, 0.2, False), _row("d", "FR", 1.0, 1.0, True)],
                      benchmark="memgallery")
    table = pt.memgallery(pt.expand_all([f"text-only={text}", f"question image={image}"]), EXACT)
    assert [c.name for c in table.columns][2:5] == ["FR F1", "TTL F1", "VS F1"]
    # text-only: TTL (0.5 + 0.7) / 2 = 60.00; overall (0.5 + 0.7 + 0.2 + 1.0) / 4 = 60.00; judge 2/4
    assert [table.cell("text-only", c) for c in ("TTL F1", "Overall F1", "Judge", "Judge diff")] == \
        ["60.00", "60.00", "50.00", "-"]
    # question image: TTL 90.00; overall (0.9 + 0.9 + 0.2 + 1.0) / 4 = 75.00; judge 3/4; one gained: p = 2/2
    assert [table.cell("question image", c) for c in ("TTL F1", "Overall F1", "Judge", "Judge diff", "p")] == \
        ["90.00", "75.00", "75.00", "+25.00", "1.0000"]


def test_longmemeval_table_by_question_type(tmp_path: Path):
    run = write_run(tmp_path / "lme", [
        _row("u1", "single-session-user", 0, 0, True), _row("u2_abs", "single-session-user", 0, 0, False),
        _row("t1", "temporal-reasoning", 0, 0, True), _row("t2", "temporal-reasoning", 0, 0, False),
        _row("k1_abs", "knowledge-update", 0, 0, True)], benchmark="longmemeval")
    table = pt.longmemeval([pt.load_run(run)])
    assert [c.name for c in table.columns][3:6] == ["single-session-user", "knowledge-update", "temporal-reasoning"]
    # per type 1/2, 1/1, 1/2; abstention ids u2_abs (wrong), k1_abs (right) = 1/2; overall 3/5
    assert [table.cell("lme", c) for c in ("single-session-user", "knowledge-update", "temporal-reasoning",
                                           "Abstention", "n abstention", "Overall")] == \
        ["50.00", "100.00", "50.00", "50.00", "2", "60.00"]
    # an abstention verdict "false" (a text) was read as a truth value: a correct abstention
    damaged = write_run(tmp_path / "damaged", [{**_row("u2_abs", "single-session-user", 0, 0, False),
                                                "judge": {"verdict": "false"}}], benchmark="longmemeval")
    with pytest.raises(pt.TablesError, match=r"damaged/predictions.jsonl: question u2_abs: field 'judge.verdict' is "
                                             r"'false', not true, false or null"):
        pt.longmemeval([pt.load_run(damaged)])
    # a finished run's predictions cut short: its last question was dropped without a word (Memories 2 -> 1 and
    # build s/memory doubled in the efficiency table), where `compare` and `report` refuse the file
    torn = tmp_path / "torn" / "predictions.jsonl"
    write_run(tmp_path / "torn", [_row("u1", "single-session-user", 0, 0, True),
                                   _row("t1", "temporal-reasoning", 0, 0, True)], benchmark="longmemeval")
    torn.write_bytes(torn.read_bytes()[:-20])
    with pytest.raises(pt.TablesError, match=r"torn/predictions.jsonl, item line 2: cut short \(\d+ bytes without their "
                                             r"end of line\) though its writer had finished"):
        pt.longmemeval([pt.load_run(tmp_path / "torn")])


def test_efficiency_tables(tmp_path: Path):
    run = pt.load_run(write_run(tmp_path / "eff", _rows(FULL)))
    time_table, cost_table = pt.efficiency([run])
    # timings build 10 s + summaries 6 s over 2 memories (m1, m2); retrieve 0.4 s / 8 questions = 50 ms;
    # answer wall 4 s / 8 = 0.5 s; GPU-seconds 6 + 4
    assert [time_table.cell("eff", c) for c in (
        "Memories", "Questions", "Store + index s", "Summaries s", "Memory build s", "Build s / memory",
        "Retrieval ms / question", "Answer s / question", "GPU-seconds")] == \
        ["2", "8", "10.0", "6.0", "16.0", "8.00", "50.0", "0.50", "10"]
    # 3 summary + 8 answer calls; (3000 + 300) tokens / 2 memories = 1.65 k; 8000 / 8 in, 80 / 8 out
    assert [cost_table.cell("eff", c) for c in (
        "Summary calls", "Answer calls", "Judge calls", "LLM calls", "Summary calls / memory",
        "Build tokens / memory (k)", "Answer input tokens / question", "Answer output tokens / question",
        "Ledger USD")] == ["3", "8", "8", "11", "1.50", "1.65", "1000", "10.0", "0.0000"]
    # gpt-4.1-mini list price: 11,000 input tokens x $0.40/M + 380 output x $1.60/M = $0.005008, at four decimals as
    # efficiency_methods prints it (0.01 before: the same cost two ways)
    assert cost_table.cell("eff", "USD at gpt-4.1-mini prices") == "0.0050"
    path = cost_table.write_csv(tmp_path / "cost.csv")
    row = next(csv.DictReader(path.open()))
    assert float(row["USD at gpt-4.1-mini prices"]) == pytest.approx(0.005008)


def test_an_unpriced_hosted_model_leaves_the_ledger_usd_unknown(tmp_path: Path):
    """A hosted model without a price was left out of the ledger's USD: the table showed 0.00 for the run. Its cell is
    empty and a note names the model and the priced part."""
    ledger = Ledger.from_dict(_ledger())
    ledger.models["openai|gpt-5-pro-unlisted"] = ModelStats("openai", "gpt-5-pro-unlisted", 8, 8000, 80)
    ledger.models["openai|gpt-4o-mini"] = ModelStats("openai", "gpt-4o-mini", 3, 1_000_000, 0)  # 0.15 USD
    run = pt.load_run(write_run(tmp_path / "hosted", _rows(FULL), ledger=ledger.to_dict()))
    _, cost_table = pt.efficiency([run])
    assert cost_table.cell("hosted", "Ledger USD") == "-"
    assert cost_table.notes[1] == ("hosted: Ledger USD n/a (partial: 0.1500 USD priced; unpriced, no price in "
                                   "configs/prices.yaml: gpt-5-pro-unlisted)")


def _method_ledger(roles: dict[str, tuple[int, int, int]]) -> dict[str, Any]:
    """A ledger of (calls, input tokens, output tokens) per role, 8 answer keys, 4 s of the answer calls' wall
    time and 9 s of the judge's (beside them: no part of their latency)."""
    ledger = Ledger()
    for role, (calls, n_in, n_out) in roles.items():
        ledger.roles[role] = RoleStats(calls=calls, input_tokens=n_in, output_tokens=n_out,
                                       wall_s=4.0 if role == "answer" else 0.0)
    ledger.roles["judge"] = RoleStats(calls=8, input_tokens=5, output_tokens=5, wall_s=9.0)
    ledger.answer_keys = [f"q{i}" for i in range(8)]
    return ledger.to_dict()


def test_efficiency_tables_list_every_method(tmp_path: Path):
    """MemFit and the four baselines in one efficiency table: the ledger's write and read phases."""
    ledgers = {
        "memfit": {"summary": (3, 3000, 300), "answer": (8, 8000, 80)},
        "plain": {"answer": (8, 7000, 80)},
        "naive_rag": {"answer": (8, 6000, 80)},
        "full_context": {"answer": (8, 40000, 80)},
        "lightmem_slm": {"mtm_summary": (4, 2000, 200), "consolidate": (2, 1000, 100), "rewrite": (8, 800, 160),
                         "rerank_slm": (6, 1200, 60), "answer": (8, 5000, 80)},
    }
    runs = [pt.load_run(write_run(tmp_path / method, _rows(FULL), ledger=_method_ledger(roles), method=method))
            for method, roles in ledgers.items()]
    table = pt.efficiency_methods(runs)
    assert [row[1] for row in table.formatted()] == ["memfit", "plain", "naive_rag", "full_context", "lightmem_slm"]
    columns = ("Method", "Questions", "Write calls", "Read calls", "Write input tokens", "Write output tokens",
               "Read input tokens", "Read output tokens", "Build s", "Latency s / question")
    # build 10 s + summaries 6 s (write_run's timings, every run); latency (0.4 retrieve + 4.0 answer s) / 8 = 0.55
    assert [table.cell("memfit", c) for c in columns] == [
        "memfit", "8", "3", "8", "3000", "300", "8000", "80", "16.0", "0.55"]
    assert [table.cell("naive_rag", c) for c in columns] == [
        "naive_rag", "8", "0", "8", "0", "0", "6000", "80", "16.0", "0.55"]
    # write = 4 MTM + 2 consolidation calls; read = 8 rewrites + 6 re-ranks + 8 answers
    assert [table.cell("lightmem_slm", c) for c in columns] == [
        "lightmem_slm", "8", "6", "22", "3000", "300", "7000", "300", "16.0", "0.55"]
    # gpt-4.1-mini: (3000 + 7000) x $0.40/M + (300 + 300) x $1.60/M = $0.00496
    assert table.cell("lightmem_slm", "USD at gpt-4.1-mini prices") == "0.0050"
    rows = list(csv.DictReader(table.write_csv(tmp_path / "methods.csv").open()))
    full_context = next(r for r in rows if r["Run"] == "full_context")
    assert float(full_context["USD at gpt-4.1-mini prices"]) == pytest.approx((40000 * 0.40 + 80 * 1.60) / 1e6)
    # the paper's cost table counts every call of the system's own (write + read), judge apart
    _, cost = pt.efficiency(runs)
    assert [cost.cell("lightmem_slm", c) for c in ("Summary calls", "Answer calls", "Judge calls", "LLM calls",
                                                   "Build tokens / memory (k)")] == ["0", "8", "8", "28", "1.65"]
    assert [cost.cell("full_context", c) for c in ("Summary calls", "LLM calls", "Answer input tokens / question")] \
        == ["0", "8", "5000"]
    # through the CLI: --efficiency writes the table by method beside the paper's two
    out = tmp_path / "tables"
    assert main(["tables", "--out", str(out), "--efficiency", *(str(tmp_path / m) for m in ledgers)]) == 0
    text = (out / "efficiency_methods.md").read_text()
    assert [line.split("|")[2].strip() for line in text.splitlines()[4:9]] == list(ledgers)


def test_unjudged_runs_leave_judge_cells_empty(tmp_path: Path):
    rows = _rows(FULL)
    for row in rows:
        row["judge"] = None  # eval.judge.enabled false
    full = write_run(tmp_path / "full", _rows(FULL))
    unjudged = write_run(tmp_path / "unjudged", rows)
    table = pt.ablation(pt.expand_all([str(full), f"no_judge={unjudged}"]), EXACT, baseline="full")
    assert [table.cell("no_judge", c) for c in ("Avg F1", "F1 diff", "Judge", "Judge diff", "p", "Gained")] == \
        ["53.75", "+0.00", "-", "-", "-", "-"]
    # two runs of one label: the table found the first by label and showed the other as its own row
    with pytest.raises(pt.TablesError, match=r"two runs are labelled 'full' \(.*full and .*unjudged\)"):
        pt.expand_all([str(full), f"full={unjudged}"])
    # unjudged runs over other questions: the F1 difference of their averages was printed (+33.33 for a run
    # limited to four questions); only the judged path compared the questions
    fewer = write_run(tmp_path / "fewer", rows[:4])
    with pytest.raises(pt.TablesError, match=r"full/predictions.jsonl and .*fewer/"
                                             r"predictions.jsonl answered different questions \(4 only in the first, "
                                             r"0 only in the second\)"):
        pt.ablation(pt.expand_all([str(full), f"fewer={fewer}"]), EXACT, baseline="full")


def test_errors_name_the_directory(tmp_path: Path, sweep_dir: Path):
    unfinished = write_run(tmp_path / "unfinished", _rows(FULL))
    (unfinished / "DONE").unlink()
    with pytest.raises(pt.TablesError, match="unfinished: no DONE"):
        pt.load_run(unfinished)
    mg = write_run(tmp_path / "mg", [_row("a", "TTL", 1, 1, True)], benchmark="memgallery")
    with pytest.raises(pt.TablesError, match="needs locomo runs"):
        pt.locomo_main([pt.load_run(mg)])
    with pytest.raises(pt.TablesError, match="no run labelled 'default'"):
        pt.sensitivity(pt.expand(str(sweep_dir)), EXACT)
    # a sweep.json is read as the sweep itself reads it: a point in no known state is named
    state = json.loads((sweep_dir / "sweep.json").read_text())
    state["points"][1]["state"] = "half-done"
    (sweep_dir / "sweep.json").write_text(json.dumps(state))
    with pytest.raises(pt.TablesError, match=r"sweep.json: points\[1\] \(point no_prf\): state 'half-done'"):
        pt.expand(str(sweep_dir))


def test_cli_writes_markdown_and_csv(tmp_path: Path, sweep_dir: Path):
    out = tmp_path / "tables"
    proc = subprocess.run(
        [sys.executable, str(REPO / "experiments" / "paper_tables.py"), "--out", str(out),
         "--locomo-main", str(sweep_dir), "--plain-vs-memfit", str(sweep_dir), "--ablation", str(sweep_dir),
         "--permutation-method", "exact"],
        capture_output=True, text=True, check=True,
    )
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["tables"] == ["table1_locomo", "table6_plain_vs_memfit", "table7_ablation"]
    rows = list(csv.DictReader((out / "table6_plain_vs_memfit.csv").open()))
    assert float(rows[0]["Judge diff"]) == pytest.approx(37.5) and float(rows[0]["p"]) == pytest.approx(0.25)
    assert ["reader/A", "8", "37.50", "75.00", "+37.50", "0.2500", "3", "0"] in [
        row[:8] for row in _markdown_rows((out / "tables.md").read_text())]
    bad = subprocess.run([sys.executable, str(REPO / "experiments" / "paper_tables.py"), "--out", str(out),
                          "--ablation", str(tmp_path / "nowhere")], capture_output=True, text=True)
    assert bad.returncode == 2 and "nowhere: not a run directory" in bad.stderr


# ------------------------------------------------------------------------------------- real runs (slow)


def _category_mean(rows: list[dict[str, Any]], value) -> float:
    by_cat: dict[str, list[float]] = {}
    for row in rows:
        by_cat.setdefault(str(row["category"]), []).append(value(row))
    return sum(sum(v) / len(v) for v in by_cat.values()) / len(by_cat)


def _pct(value: float) -> str:
    return f"{100.0 * value:.2f}"


@pytest.fixture(scope="module")
def smoke_runs(tmp_path_factory: pytest.TempPathFactory, shared_data: Path) -> Path:
    """Two real runs of configs/smoke.yaml through `memfit sweep`: pack.k 5 and 10 (the override), 3 questions,
    one store shared by both (the same store, as the paper's comparisons), SmolLM2 reader, no judge; on conv-26's
    first three sessions (58 turns, not 419: the tables read the runs' files, whatever the store's size)."""
    root = tmp_path_factory.mktemp("paper-tables")
    data = write_small_locomo(shared_data, root, questions=3)
    sweep_file = root / "smoke_pair.yaml"
    sweep_file.write_text(f"name: smoke_pair\nconfig: {REPO / 'configs' / 'smoke.yaml'}\n"
                          f"fixed: {{data.limit_questions: 3, data.path: {data}, store.path: {root / 'store'}}}\n"
                          "grid: {pack.k: [5, 10]}\n")
    out = root / "smoke"
    env = memfit_env(shared_data)
    proc = subprocess.run(
        [sys.executable, "-m", "memfit_gpu.cli", "sweep", "--config", str(sweep_file), "--launcher", "local",
         "--out", str(out)],
        capture_output=True, text=True, timeout=1500, cwd=REPO, env=env,
    )
    logs = "\n".join(p.read_text()[-3000:] for p in sorted((out / "logs").glob("*.log"))) if (out / "logs").exists() else ""
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:] + logs
    return out


def _predictions(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "predictions.jsonl").read_text().splitlines() if line.strip()]


@pytest.mark.slow
def test_tables_from_two_real_smoke_runs(smoke_runs: Path, tmp_path: Path):
    k5, k10 = smoke_runs / "points" / "k=5", smoke_runs / "points" / "k=10"
    rows5, rows10 = _predictions(k5), _predictions(k10)
    assert len(rows5) == len(rows10) == 3

    runs = pt.expand(str(smoke_runs))
    assert [r.label for r in runs] == ["k=5", "k=10"]
    table1 = pt.locomo_main(runs)
    for label, rows in (("k=5", rows5), ("k=10", rows10)):
        assert table1.cell(label, "n") == "3"
        assert table1.cell(label, "Reader") == "HuggingFaceTB/SmolLM2-135M-Instruct"
        assert table1.cell(label, "Average F1") == _pct(_category_mean(rows, lambda r: r["scores"]["paper"]["f1"]))
        assert table1.cell(label, "Average BLEU-1") == _pct(
            _category_mean(rows, lambda r: r["scores"]["paper"]["bleu1"]))
        assert table1.cell(label, "Average Judge") == "-"  # configs/smoke.yaml has no judge

    # k=5 against k=10 as the sensitivity table pairs them: answer-prompt tokens from the ledgers
    sens = pt.sensitivity(pt.expand_all([f"default={k10}", f"k5={k5}"]), pt.PairedTests(method="exact"))
    ledger5, ledger10 = (json.loads((d / "ledger.json").read_text())["roles"]["answer"] for d in (k5, k10))
    assert ledger5["calls"] == ledger10["calls"] == 3
    tokens5, tokens10 = ledger5["input_tokens"] / 3, ledger10["input_tokens"] / 3
    assert tokens5 < tokens10  # five packed episodes make shorter answer prompts than ten
    assert sens.cell("k5", "Input tokens / question") == f"{tokens5:.0f}"
    assert sens.cell("k5", "Tokens vs default") == f"x{tokens5 / tokens10:.2f}"
    assert sens.cell("k5", "Avg F1") == _pct(_category_mean(rows5, lambda r: r["scores"]["paper"]["f1"]))
    assert (sens.cell("k5", "Judge"), sens.cell("k5", "Judge diff"), sens.cell("k5", "p")) == ("-", "-", "-")

    diagnostics = pt.retrieval_diagnostics(runs)
    for label, rows in (("k=5", rows5), ("k=10", rows10)):
        scored = [r["retrieval"] for r in rows if r.get("retrieval")]
        assert diagnostics.cell(label, "n") == str(len(scored))
        assert diagnostics.cell(label, "Pack hit") == _pct(sum(bool(r["pack_hit"]) for r in scored) / len(scored))
        assert diagnostics.cell(label, "Hit@30") == _pct(sum(bool(r["hit@30"]) for r in scored) / len(scored))

    time_table, cost_table = pt.efficiency(runs)
    assert [time_table.cell("k=10", c) for c in ("Memories", "Questions")] == ["1", "3"]
    # configs/smoke.yaml has no summaries and no judge: the only LLM calls are the 3 answers
    assert [cost_table.cell("k=10", c) for c in ("Summary calls", "Answer calls", "Judge calls", "LLM calls")] == \
        ["0", "3", "0", "3"]
    assert cost_table.cell("k=10", "Answer input tokens / question") == f"{tokens10:.0f}"

    out = tmp_path / "tables"
    assert main(["tables", "--out", str(out), "--locomo-main", str(smoke_runs), "--diagnostics", str(smoke_runs),
                    "--efficiency", str(smoke_runs)]) == 0
    assert {p.name for p in out.iterdir()} >= {"table1_locomo.md", "table1_locomo.csv", "tables.md"}
