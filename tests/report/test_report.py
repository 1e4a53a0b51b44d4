"""`memfit report` on hand-made run directories (tests/support/report_runs.py): how a pack's excerpts are split and marked
for every method's row shape, MemGallery's image ids, a LongMemEval-S-sized report kept to its size limit with
every trimmed excerpt noted, the refusals. tests/report/test_report_browser.py opens a report of real runs in Chromium."""

from __future__ import annotations

import html
import json
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
from support.report_runs import REPO, FakeQuestion, write_run  # tests/ is on sys.path

from memfit_gpu.cli import main
from memfit_gpu.evaluate.efficiency import COLUMNS, efficiency_row
from memfit_gpu.evaluate.tables import category_name, summarize
from memfit_gpu.readers.ledger import Ledger
from memfit_gpu.readers.types import Response
from memfit_gpu.report import ReportError, build_report, plots, question_records, question_table, read_run
from memfit_gpu.report.build import TABLE_COLUMNS, _segments, excerpt_blocks

TURN = "Speaker Ann says: " + "we talked about the garden and the long summer evenings by the lake " * 14  # ~1000 chars


def test_excerpt_blocks_follow_each_methods_row() -> None:
    # memfit: the facts block, then one excerpt per pack episode; a turn's later lines are indented (quote_lines)
    memfit = {"excerpts": "REMEMBERED FACTS:\n- Ann keeps bees (as of 8 May 2023)\n\nEXCERPT 1 (recorded 8 May 2023): "
                          "Speaker Ann says: line one\n    line two\n\n    after a blank line\nEXCERPT 2 (recorded 9 May "
                          "2023): Speaker Bo says: hi",
              "pack": {"episodes": [{"turn_id": "D1:1"}, {"turn_id": "D1:2"}]}}
    blocks = excerpt_blocks(memfit)
    assert [(b["kind"], b["number"], b["turn_ids"]) for b in blocks] == [
        ("text", None, []), ("excerpt", 1, ["D1:1"]), ("excerpt", 2, ["D1:2"])]
    assert blocks[0]["text"] == "REMEMBERED FACTS:\n- Ann keeps bees (as of 8 May 2023)"
    assert blocks[1]["text"].endswith("line two\n\n    after a blank line")
    # naive_rag: an excerpt per chunk, with the chunk's turns
    naive = {"excerpts": "EXCERPT 1 (recorded 8 May 2023): a b c\nEXCERPT 2 (recorded 8 May 2023): c d",
             "chunks": [{"turn_ids": ["S1:1", "S1:2"]}, {"turn_ids": ["S1:2", "S1:3"]}],
             "pack": {"episodes": [{"turn_id": t} for t in ("S1:1", "S1:2", "S1:3")]}}
    assert [b["turn_ids"] for b in excerpt_blocks(naive)] == [["S1:1", "S1:2"], ["S1:2", "S1:3"]]
    # lightmem_slm: recent turns and notes that are not one turn each in pack order: shown, not marked
    lightmem = {"excerpts": "RECENT TURNS:\nEXCERPT 1 (recorded 8 May 2023): x\n\nMEMORY NOTES:\n- (recorded 8 May "
                            "2023) y", "pack": {"episodes": [{"turn_id": "a"}, {"turn_id": "b"}]}}
    blocks = excerpt_blocks(lightmem)
    assert [(b["kind"], b["turn_ids"]) for b in blocks] == [("text", []), ("excerpt", []), ("text", [])]
    assert blocks[2]["text"] == "MEMORY NOTES:\n- (recorded 8 May 2023) y"


def test_image_ids_are_marked() -> None:
    text = "Speaker A says: [Image img_12: a red kite] [Image: a boat] look at these"
    assert _segments(text) == [("text", "Speaker A says: "), ("image", "[Image img_12: a red kite]"), ("text", " "),
                               ("image", "[Image: a boat]"), ("text", " look at these")]


def _questions(n: int, excerpts: int, text: str = TURN) -> list[FakeQuestion]:
    """n questions of 5 categories; question i's evidence is turn t{i % excerpts} (every 7th has none)."""
    out = []
    for i in range(n):
        turns = [(f"t{j}", f"{text} ({i}, {j})") for j in range(excerpts)]
        evidence = [] if i % 7 == 0 else [f"t{i % excerpts}"]
        out.append(FakeQuestion(f"q{i}", str(1 + i % 5), "the lake", "the lake" if i % 3 == 0 else "no idea", evidence,
                                turns, selected=excerpts // 2))
    return out


def test_a_memgallery_run_shows_its_image_ids_and_category_names(tmp_path: Path) -> None:
    q = FakeQuestion("s1:q0", "VS", "red", "red", ["D1:1"],
                     [("D1:1", "Speaker A says: [Image img_12: a red kite] look"), ("D1:2", "Speaker B says: nice")])
    run = write_run(tmp_path / "mg", [q], benchmark="memgallery")
    report = build_report([run], tmp_path / "r.html")
    page = report.path.read_text()
    assert '<span class="image">[Image img_12: a red kite]</span>' in page
    assert "visual-centric search (VS)" in page  # the benchmark's category names
    (record,) = question_records(read_run(run, "mg"))
    assert (record["outcome"], record["ranks"], record["pack_hit"]) == ("correct", {"D1:1": 1}, True)


@pytest.mark.parametrize("benchmark, categories", [
    ("locomo", ["1", "2", "3", "4"]), ("longmemeval", ["temporal-reasoning", "knowledge-update"]),
    ("memgallery", ["TTL", "VS"]), ("jsonl", ["my label", "another"]), ("beam", ["abstention", "event_ordering"])])
def test_every_benchmark_gets_its_category_names(tmp_path: Path, benchmark: str, categories: list[str]) -> None:
    questions = [FakeQuestion(f"q{i}", c, "x", "x" if i % 2 else "y", ["t0"], [("t0", "a turn"), ("t1", "b")],
                              judge=bool(i % 2)) for i, c in enumerate(categories * 2)]
    run = write_run(tmp_path / benchmark, questions, benchmark=benchmark, overrides=["eval.judge.enabled=true"])
    page = build_report([run], tmp_path / "r.html").path.read_text()
    for c in categories:
        name = category_name(c, benchmark)
        assert f'<option value="{c}">{name}{"" if name == c else f" ({c})"}</option>' in page
    # judged: correct is the verdict (the odd questions), the others' evidence was packed
    outcomes = re.findall(r'<section class="answer" data-run="0" data-outcome="(\w+)"', page)
    assert outcomes == ["reader_missed", "correct"] * len(categories)


def test_every_methods_rows_in_one_report(tmp_path: Path) -> None:
    """memfit, naive_rag (chunks), full_context (no ranking, a truncation) and lightmem_slm (no turn ranking) side by
    side: each gets its ranks, its notes and its outcome; the first is the others' baseline."""
    turns = [("D1:1", "Speaker A says: one"), ("D1:2", "Speaker B says: two")]
    base = dict(category="1", gold="two", prediction="no", evidence=["D1:2"], excerpts=turns)
    runs = [
        write_run(tmp_path / "memfit", [FakeQuestion("q0", **base, selected=1)]),
        write_run(tmp_path / "naive_rag", [FakeQuestion("q0", **base, fields={
            "ranked": None, "method": "naive_rag",
            "chunks": [{"chunk": 0, "turn_ids": ["D1:1"]}, {"chunk": 1, "turn_ids": ["D1:2"]}]})],
            overrides=["method=naive_rag"]),
        write_run(tmp_path / "full_context", [FakeQuestion("q0", **{**base, "excerpts": turns[:1]}, fields={
            "ranked": None, "method": "full_context",
            "method_notes": {"truncation": {"turns": 2, "turns_kept": 1, "turns_dropped": 1, "first_kept_turn": "D1:1",
                                            "bound": "reader.max_prompt_chars=10"}}})], overrides=["method=full_context"]),
        write_run(tmp_path / "lightmem", [FakeQuestion("q0", **{**base, "excerpts": turns[:1]}, fields={
            "ranked": None, "method": "lightmem_slm", "lightmem": {"hqs": [], "items": []}})],
            overrides=["method=lightmem_slm"]),
    ]
    page = build_report(runs, tmp_path / "r.html").path.read_text()
    answers = re.findall(r'<section class="answer" data-run="(\d)" data-outcome="(\w+)"', page)
    assert answers == [("0", "cut_from_pack"), ("1", "reader_missed"), ("2", "cut_from_pack"), ("3", "not_retrieved")]
    assert "<td>turn rank 2</td>" in page and "<td>chunk rank 2</td>" in page and page.count("<td>no ranking</td>") == 2
    assert "1 of 2 turns dropped to fit the reader (first kept: D1:1; bound reader.max_prompt_chars=10)" in page
    assert page.count('<table class="comparison"') == 3


@pytest.mark.slow
def test_a_longmemeval_s_sized_report_keeps_to_its_size_limit(tmp_path: Path) -> None:
    """500 questions x 50 excerpts of ~1,000 characters (25 MB of pack text, LongMemEval-S's shape): the page stays
    under the 20 MB default, the excerpts that are not evidence are trimmed to one length, each with its note, the
    evidence excerpts stay whole, and the page says so; under a limit nothing can meet it says why."""
    run = write_run(tmp_path / "lme", _questions(500, 50), benchmark="longmemeval")
    out = tmp_path / "report.html"
    report = build_report([run], out)
    size = out.stat().st_size
    assert size == report.bytes <= report.max_bytes == 20 * 1024 * 1024
    assert report.excerpts == 500 * 50 and report.cap is not None and 200 <= report.cap < len(TURN)
    page = out.read_text()
    notes = re.findall(r"\[\.\.\. ([\d,]+) more characters trimmed to keep this report under 20 MB", page)
    assert len(notes) == report.trimmed
    evidence_blocks = sum(1 for i in range(500) if i % 7)  # one evidence excerpt per question that has evidence
    assert report.trimmed == 500 * 50 - evidence_blocks
    assert f"{report.trimmed} of {report.excerpts} excerpts are trimmed to {report.cap} characters" in page
    # an evidence excerpt is whole: question 1's evidence is turn t1
    assert f"{TURN} (1, 1)" in page
    assert page.count("<article class=\"question\"") == 500
    with pytest.raises(ReportError, match=r"does not fit in 2 MB even with every excerpt trimmed to 200 characters"):
        build_report([run], tmp_path / "small.html", max_bytes=2 * 1024 * 1024)


def test_the_wandb_table_is_the_viewers_records(tmp_path: Path) -> None:
    run = write_run(tmp_path / "a", _questions(4, 3, "short turn"))
    records = question_records(read_run(run, "a"))
    columns, rows = question_table(records)
    assert columns == list(TABLE_COLUMNS)
    assert [row[columns.index("outcome")] for row in rows] == [r["outcome"] for r in records]
    assert rows[1][columns.index("evidence_ranks")] == "t1 turn rank 2"
    assert rows[0][columns.index("evidence")] == "" and rows[0][columns.index("pack_hit")] is None


def test_the_latency_percentiles_of_a_bench_online_json(tmp_path: Path) -> None:
    """experiments/bench_online.py's own table (method_table over its replays) and concurrency levels, as its JSON
    holds them: a table and a figure of P50 / P95 / P99 per kind of call, and the concurrent P95."""
    sys.path.insert(0, str(REPO / "experiments"))
    import bench_online  # the script's own shapes: what its JSON holds

    def timed(ms: list[float]) -> dict[str, Any]:
        return bench_online.percentiles([m / 1000 for m in ms])

    replays = {"memfit": {"api": {"insert": timed([4, 5, 6]), "search": timed([10, 12, 30]), "e2e": timed([900, 1000])},
                          "http": {"insert": timed([6, 7, 8]), "search": timed([14, 15, 40]), "e2e": None}}}
    levels = [{"clients": n, "batched": {"p95_ms": 20.0 * n}, "unbatched": {"p95_ms": 30.0 * n}} for n in (1, 4, 16)]
    online = tmp_path / "online.json"
    online.write_text("progress\n" + json.dumps({"conversations": 1, "turns": 419, "questions": 152, "cpus": 2,
                                                 "replay": replays, "table": bench_online.method_table(replays),
                                                 "concurrency": {"levels": levels}}) + "\n")
    run = write_run(tmp_path / "a", _questions(3, 2, "t"))
    page = build_report([run], tmp_path / "r.html", online=online).path.read_text()
    rows = re.findall(r"<tr><td>memfit</td><td>(api|http)</td>(.*?)</tr>", page)
    cells = {path: re.findall(r'<td class="num">([^<]*)</td>', rest) for path, rest in rows}
    assert cells["api"][:3] == [str(p) for p in (timed([4, 5, 6])[k] for k in ("p50_ms", "p95_ms", "p99_ms"))]
    assert cells["http"][-3:] == ["-", "-", "-"]  # no answers through HTTP
    figure = re.search(r'<figure id="figure-latency">(.*?)</figure>', page, re.S).group(1)
    assert "search P95 ms" in figure and "end to end (answer)" in figure and "concurrent clients" in figure


def test_refusals_name_the_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "empty").mkdir()
    assert main(["report", str(tmp_path / "empty"), "--out", str(tmp_path / "r.html")]) == 2
    assert "config.yaml is missing: " in capsys.readouterr().err
    run = write_run(tmp_path / "a", _questions(3, 2, "t"))
    # damaged files a run wrote whole: one line naming the file (and the field), no traceback
    damaged = [("config.yaml", b"pack: [", "config.yaml: not valid YAML ("),
               ("metrics.json", b"{}", "metrics.json, field 'questions': missing"),
               ("metrics.json", b"[]", "metrics.json: expected a JSON object, got list"),
               ("ledger.json", b"\xff", "ledger.json: not UTF-8 text (byte 0)"),
               ("timings.json", b'{"build": "x"}', "timings.json, field 'build': expected a number, got 'x'")]
    for name, content, message in damaged:
        kept = (run / name).read_bytes()
        (run / name).write_bytes(content)
        for command in (["report", str(run), "--out", str(tmp_path / "r.html")], ["efficiency", str(run)]):
            assert main(command) == 2, (name, content, command)
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1 and message in err[0], (command, err)
        (run / name).write_bytes(kept)
    kept = (run / "predictions.jsonl").read_text()
    first = json.loads(kept.splitlines()[0])
    (run / "predictions.jsonl").write_text(json.dumps({**first, "scores": "x"}) + "\n" + kept.split("\n", 1)[1])
    assert main(["report", str(run), "--out", str(tmp_path / "r.html")]) == 2
    assert "predictions.jsonl:1: question " in capsys.readouterr().err
    (run / "predictions.jsonl").write_text(kept)
    (run / "metrics.json").unlink()
    assert main(["report", str(run), "--out", str(tmp_path / "r.html")]) == 2
    assert f"{run / 'metrics.json'} does not exist" in capsys.readouterr().err
    good = write_run(tmp_path / "b", _questions(3, 2, "t"))
    assert main(["report", str(good), "--out", str(tmp_path / "r.html"), "--online", str(tmp_path / "none.json")]) == 2
    assert "--online" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text(json.dumps({"replay": {}}))
    assert main(["report", str(good), "--out", str(tmp_path / "r.html"), "--online", str(tmp_path / "bad.json")]) == 2
    assert "no `table` of latency percentiles" in capsys.readouterr().err


# ------------------------------------------------------------------ metrics.json against predictions.jsonl
def _judged_run(path: Path) -> Path:
    """Six judged questions of four categories: category 1's F1 is 0.5 (one right of two), its judge 0.5."""
    answers = [("1", "red", "red", True), ("1", "blue", "green", False), ("2", "May 2023", "May 2023", True),
               ("2", "tea", "coffee", True), ("3", "cat", "cat", True), ("4", "lake", "sea", False)]
    questions = [FakeQuestion(f"q{i}", c, gold, prediction, [f"t{i}"], [(f"t{i}", f"turn {i}")], judge=verdict)
                 for i, (c, gold, prediction, verdict) in enumerate(answers)]
    return write_run(path, questions, overrides=["eval.judge.enabled=true"])


def _edit_rows(path: Path, edit: Any) -> None:
    """Rewrite a JSONL file's rows as `edit(rows)` returns them."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps(row) + "\n" for row in edit(rows)))


def _edit_json(path: Path, edit: Any) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def _report_error(runs: list[Path], out: Path, capsys: pytest.CaptureFixture[str]) -> str:
    """`memfit report RUNS`'s one error line; asserts exit code 2 (no traceback)."""
    assert main(["report", *map(str, runs), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def _recategorise(rows: list[dict[str, Any]], old: str, new: str) -> list[dict[str, Any]]:
    return [{**r, "category": new} if r["category"] == old else r for r in rows]


def _unevaluate(rows: list[dict[str, Any]], category: str) -> list[dict[str, Any]]:
    return [{**r, "evaluated": False} if r["category"] == category else r for r in rows]


def _set_f1(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows[1]["scores"]["paper"]["f1"] = 1.0
    return rows


def _flip_verdict(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows[1]["judge"]["verdict"] = True
    return rows


STALE = "; the two files are not of one scoring (one was edited or replaced)"


@pytest.mark.parametrize("edit, message", [
    (lambda rows: rows[:-1], "metrics.json, field 'questions': 6, but {run}/predictions.jsonl holds 5 evaluated "
                             "questions" + STALE),
    (lambda rows: _unevaluate(rows, "1"), "metrics.json, field 'questions': 6, but {run}/predictions.jsonl holds 4 "
                                          "evaluated questions" + STALE),
    (lambda rows: [{**rows[0], "category": "2"}, *rows[1:]],
     "metrics.json, category '1', field 'n': 2, but predictions.jsonl holds 1 evaluated questions of it" + STALE),
    (lambda rows: _recategorise(rows, "1", "9"),
     "metrics.json, category '1', field 'n': 2, but predictions.jsonl holds no evaluated question of it" + STALE),
    (lambda rows: _recategorise(rows, "4", "9"),
     "metrics.json, category '4', field 'n': 1, but predictions.jsonl holds no evaluated question of it" + STALE),
    (_set_f1, "metrics.json, category '1', field 'paper.f1': 0.5, but its questions' mean in predictions.jsonl is 1"
              + STALE),
    (_flip_verdict, "metrics.json, category '1', field 'judge': 0.5, but predictions.jsonl holds an accuracy of 1 "
                    "over 2 verdicts for its questions" + STALE),
])
def test_a_metrics_json_that_is_not_the_scoring_of_the_predictions_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], edit: Any, message: str) -> None:
    """The table's numbers are metrics.json's, its intervals, comparisons and attribution predictions.jsonl's: a row
    deleted, moved, marked unevaluated or rescored after scoring would put an estimate beside another set's interval
    (a deleted row of a one-question category: its F1 shown with the interval [0.0, 0.0]). One line, exit 2."""
    run = _judged_run(tmp_path / "a")
    assert main(["report", str(run), "--out", str(tmp_path / "r.html")]) == 0
    _edit_rows(run / "predictions.jsonl", edit)
    assert _report_error([run], tmp_path / "r.html", capsys) == (
        f"memfit report: error: {run}/{message.format(run=run)}")


def _rescored(run: Path, out: Path, variant: str, keep: tuple[str, ...] | None = None) -> Path:
    """A copy of `run` whose metrics.json is summarised at table metric `variant` (`memfit run ...
    eval.table_metric=VARIANT` of the same answers), its predictions scored at `keep` only (None: as they are)."""
    shutil.copytree(run, out)
    if keep is not None:
        _edit_rows(out / "predictions.jsonl", lambda rows: [
            {**r, "scores": {v: s for v, s in r["scores"].items() if v in keep}} for r in rows])
    rows = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    metrics = summarize(rows, variant=variant, judge=False, benchmark="locomo", n_boot=50)
    metrics.update(name=out.name, benchmark="locomo", method="memfit", questions=len(rows), metric_variant=variant)
    (out / "metrics.json").write_text(json.dumps(metrics))
    return out


def test_every_run_is_read_at_the_first_runs_table_variant(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Two runs of the same answers, the second's table at the locomo variant (multi-hop splits the gold answer at
    its commas, open-domain keeps what precedes a semicolon): every table, figure and comparison of the report
    reads both at the first run's variant, and says so; a run without that variant is refused, named."""
    answers = [("1", "paris, london", "paris"), ("1", "red, blue", "red"), ("3", "blue; because sky", "blue"),
               ("3", "cat; pet", "cat"), ("2", "May 2023", "May 2023"), ("4", "tea", "tea")]
    a = write_run(tmp_path / "pa", [FakeQuestion(f"q{i}", c, gold, prediction, [f"t{i}"], [(f"t{i}", "a turn")])
                                    for i, (c, gold, prediction) in enumerate(answers)])
    b = _rescored(a, tmp_path / "lo", "locomo")
    panels: list[dict[str, Any]] = []
    real = plots.category_scores
    monkeypatch.setattr(plots, "category_scores", lambda *args: panels.append(args[3]) or real(*args))

    paper = [2 / 3, 1.0, 7 / 12, 1.0]  # categories 1-4 at paper; locomo: [0.5, 1.0, 1.0, 1.0]
    for runs, variant, f1 in (([a, b], "paper", paper), ([b, a], "locomo", [0.5, 1.0, 1.0, 1.0])):
        page = build_report(runs, tmp_path / "r.html").path.read_text()
        assert panels.pop() == {f"F1 ({variant})": [pytest.approx(f1), pytest.approx(f1)]}
        cells = [re.findall(r'<td class="num">([\d.]+) <span class="ci">', table)
                 for table in re.findall(r'<table class="results" data-run="\d">(.*?)</table>', page, re.S)]
        average = sum(f1) / 4
        assert cells[0] == cells[1] == [f"{100 * v:.2f}" for v in (*f1, average, 9 / 12 if variant == "paper" else 5 / 6)]
        assert page.count(f"Metric variant <code>{variant}</code>") == 2
        assert f"Metric: {variant} f1 (x100)" in page  # the comparison too
        own = "locomo" if variant == "paper" else "paper"
        assert (f"warning: its own table metric is {own}; this report shows every run at {variant} (the first "
                "run&#39;s), which its metrics.json and predictions.jsonl also hold") in page

    only = _rescored(a, tmp_path / "only", "locomo", keep=("locomo",))
    assert _report_error([a, only], tmp_path / "r.html", capsys) == (
        f"memfit report: error: {only}/predictions.jsonl:1: question q0, field 'scores.paper': missing; run only has no "
        "paper scores, and the report reads it at paper, the first run's table metric (its own is locomo)")
    _edit_rows(only / "predictions.jsonl", lambda rows: [{**r, "scores": {**r["scores"], "paper": {"f1": 0.0, "bleu1": 0.0}}}
                                                          for r in rows])
    assert _report_error([a, only], tmp_path / "r.html", capsys) == (
        f"memfit report: error: {only}/metrics.json, category '1', field 'paper': missing; run only has no paper "
        "scores, and the report reads it at paper, the first run's table metric (its own is locomo)")


def test_runs_that_share_no_question_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Two runs of other questions (another data.offset) cannot be compared: `memfit compare`'s line, exit 2."""
    a = write_run(tmp_path / "a", _questions(3, 2, "t"))
    b = write_run(tmp_path / "b", [FakeQuestion(f"x{q.question_id}", q.category, q.gold, q.prediction, q.evidence,
                                                q.excerpts) for q in _questions(3, 2, "t")])
    assert _report_error([a, b], tmp_path / "r.html", capsys) == (
        f"memfit report: error: {a}/predictions.jsonl and {b}/predictions.jsonl share no evaluated question_id")


def _depths(variant: str) -> dict[str, Any]:
    """depths.json of one depth (run/depths.py's shape) whose average holds `variant` only."""
    return {"method": "memfit", "pack_k": 5, "metric_variant": variant,
            "depths": [{"k": 5, "questions": 6, "input_tokens_per_question": 120.0, "retrieval": {"pack_hit": 1.0},
                        "average": {"n": 6, variant: {"f1": 0.5, "bleu1": 0.5}}}]}


@pytest.mark.parametrize("file, edit, message", [
    ("predictions.jsonl", lambda rows: [{**rows[0], "scores": {"locomo": rows[0]["scores"]["locomo"]}}, *rows[1:]],
     "predictions.jsonl:1: question q0, field 'scores.paper': missing; run a has no paper scores, and the report "
     "reads it at paper, its table metric"),
    ("predictions.jsonl", lambda rows: [{**rows[0], "scores": None}, *rows[1:]],
     "predictions.jsonl:1: question q0, field 'scores': null; run a has no paper scores, and the report reads it at "
     "paper, its table metric"),
    ("predictions.jsonl", lambda rows: [{**rows[0], "scores": {"paper": {"f1": 1.0}}}, *rows[1:]],
     "predictions.jsonl:1: question q0, field 'scores.paper.bleu1': None, not a number"),
    ("packs.jsonl", lambda rows: [{k: v for k, v in rows[0].items() if k != "question_id"}, *rows[1:]],
     "packs.jsonl, row 1: field 'question_id' missing or not a string"),
    ("packs.jsonl", lambda rows: [rows[0], ["q1"], *rows[2:]], "packs.jsonl, row 2: not a JSON object"),
    ("metrics.json", lambda m: m["by_category"]["1"].pop("paper"),
     "metrics.json, category '1', field 'paper': missing; run a has no paper scores, and the report reads it at "
     "paper, its table metric"),
    ("metrics.json", lambda m: m.update(by_category="x"), "metrics.json, field 'by_category': expected dict, got str"),
    ("metrics.json", lambda m: m["by_category"].update({"5": {**m["by_category"]["4"], "n": 0}}),
     "metrics.json, category '5', field 'n': 0, but predictions.jsonl holds no evaluated question of it; the two files "
     "are not of one scoring (one was edited or replaced)"),
    ("metrics.json", lambda m: m["by_category"].update({"2": [1]}),
     "metrics.json, category '2': expected an object, got list"),
    ("metrics.json", lambda m: m["by_category"]["3"].update(n="1"), "metrics.json, category '3', field 'n': '1', not a count"),
    ("metrics.json", lambda m: m["average"].pop("paper"),
     "metrics.json, average, field 'paper': missing; run a has no paper scores, and the report reads it at paper, "
     "its table metric"),
    # Average and the counts under the table were shown as metrics.json held them (an average F1 of 0.9 as 90.00)
    ("metrics.json", lambda m: m["average"]["paper"].update(f1=0.9),
     "metrics.json, average, field 'paper.f1': 0.9, but the mean of its category means in predictions.jsonl is 0.5; "
     "the two files are not of one scoring (one was edited or replaced)"),
    ("metrics.json", lambda m: m["average"].update(judge=0.9),
     "metrics.json, average, field 'judge': 0.9, but predictions.jsonl holds judge accuracies whose mean is 0.625 for "
     "its categories; the two files are not of one scoring (one was edited or replaced)"),
    ("metrics.json", lambda m: m["average"].update(categories=3),
     "metrics.json, average, field 'categories': 3, but predictions.jsonl holds 4 categories; the two files are not "
     "of one scoring (one was edited or replaced)"),
    ("metrics.json", lambda m: m.update(averaging="median"),
     "metrics.json, field 'averaging': 'median', not one of category_mean, question_mean"),
    ("metrics.json", lambda m: m.update(reader_errors=2),
     "metrics.json, field 'reader_errors': 2, but predictions.jsonl holds 0 answers with a reader error; the two "
     "files are not of one scoring (one was edited or replaced)"),
    ("metrics.json", lambda m: m["overall"].update(judge_unparsed=1),
     "metrics.json, field 'overall.judge_unparsed': 1, but predictions.jsonl holds 0 unparsed judge replies; the two "
     "files are not of one scoring (one was edited or replaced)"),
    ("depths.json", lambda d: d.update(_depths("locomo")),
     "depths.json, depth k=5 average, field 'paper': missing; run a has no paper scores, and the report reads it at "
     "paper, its table metric"),
])
def test_a_damaged_field_is_refused_naming_it(tmp_path: Path, capsys: pytest.CaptureFixture[str], file: str,
                                             edit: Any, message: str) -> None:
    """A field the report reads, missing or of another type: one line naming the file, the question or category and
    the field, exit 2 (a KeyError, TypeError or AttributeError traceback, exit 1, before)."""
    run = _judged_run(tmp_path / "a")
    if file == "depths.json":
        (run / file).write_text(json.dumps(_depths("paper")))
        assert main(["report", str(run), "--out", str(tmp_path / "r.html")]) == 0  # the sound one is read
    if file.endswith(".jsonl"):
        _edit_rows(run / file, edit)
    else:
        _edit_json(run / file, edit)
    assert _report_error([run], tmp_path / "r.html", capsys) == f"memfit report: error: {run}/{message}"


# ------------------------------------------------------------------ what the page states beside the numbers
def test_an_unpriced_hosted_model_makes_the_cost_unknown_not_zero(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """A run whose hosted model has no price cost 0.0 in the report's header and `memfit efficiency`'s ledger_usd
    (the ledger left the model out of its total): the cost is unknown, and the model is named."""
    run = write_run(tmp_path / "hosted", _questions(3, 2, "t"))
    ledger = Ledger()
    for i in range(3):
        ledger.record("answer", f"q{i}", Response("x", 1000, 10, 0.1, model="gpt-5-pro-unlisted"), "openai")
    (run / "ledger.json").write_text(ledger.to_json())
    page = build_report([run], tmp_path / "r.html").path.read_text()
    assert ('<div class="warn usd">USD (hosted models at their list price; local backends cost 0): n/a (partial: '
            "0.0000 USD priced; unpriced, no price in configs/prices.yaml: gpt-5-pro-unlisted)</div>") in page
    row = efficiency_row(run)
    assert (row["ledger_usd"], row["unpriced_models"]) == (None, "gpt-5-pro-unlisted")
    assert main(["efficiency", str(run)]) == 0
    cells = [c.strip() for c in capsys.readouterr().out.splitlines()[2].strip("|").split("|")]
    assert cells[COLUMNS.index("ledger_usd")] == "n/a" and cells[COLUMNS.index("unpriced_models")] == "gpt-5-pro-unlisted"
    # a local reader costs 0, as before
    local = write_run(tmp_path / "local", _questions(3, 2, "t"))
    page = build_report([local], tmp_path / "r.html").path.read_text()
    assert ('<div class="note usd">USD (hosted models at their list price; local backends cost 0): 0.0000</div>'
            in page)
    assert (efficiency_row(local)["ledger_usd"], efficiency_row(local)["unpriced_models"]) == (0.0, None)


def test_runs_of_other_gold_answers_or_questions_under_one_id_are_refused(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """The comparison paired questions by id alone, and the viewer showed the first run's question and gold for all:
    runs made on other data were compared without a word. One line naming the question and the field, exit 2."""
    questions = _questions(3, 2, "t")
    a = write_run(tmp_path / "a", questions)
    b = write_run(tmp_path / "b", [*questions[:2], FakeQuestion("q2", questions[2].category, "the sea",
                                                                 questions[2].prediction, [], questions[2].excerpts)])
    assert _report_error([a, b], tmp_path / "r.html", capsys) == (
        f"memfit report: error: {a}/predictions.jsonl and {b}/predictions.jsonl: question q2: field 'gold' differs "
        "('the lake' against 'the sea'): the runs asked other questions under one id (other data), so their scores "
        "measure different things and are not compared")
    c = write_run(tmp_path / "c", questions)
    _edit_rows(c / "predictions.jsonl", lambda rows: [{**r, "question": "what else?"} if r["question_id"] == "q1" else r
                                                     for r in rows])
    assert _report_error([a, c], tmp_path / "r.html", capsys) == (
        f"memfit report: error: {a}/predictions.jsonl and {c}/predictions.jsonl: question q1: field 'question' "
        "differs ('question q1?' against 'what else?'): the runs asked other questions under one id (other data), so "
        "their scores measure different things and are not compared")
    # a question the first run lacks is held to the first run that has it
    d = write_run(tmp_path / "d", [FakeQuestion("x0", "1", "red", "red", [], [("t0", "a")])])
    e = write_run(tmp_path / "e", [*questions[:1], FakeQuestion("x0", "1", "blue", "red", [], [("t0", "a")])])
    assert _report_error([a, d, e], tmp_path / "r.html", capsys).startswith(
        f"memfit report: error: {d}/predictions.jsonl and {e}/predictions.jsonl: question x0: field 'gold' differs")


def test_unparsed_verdicts_and_reader_errors_are_stated(tmp_path: Path) -> None:
    """results.md states the judge replies that stated no verdict and the answers the reader failed; the page said
    neither, and showed an unparsed reply's verdict as WRONG."""
    run = _judged_run(tmp_path / "a")

    def damage(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        rows[1]["judge"]["unparsed"] = True  # its verdict stays false: counted as not correct
        rows[5]["reader_error"] = "timed out"
        return rows

    _edit_rows(run / "predictions.jsonl", damage)
    rows = [json.loads(line) for line in (run / "predictions.jsonl").read_text().splitlines()]
    metrics = json.loads((run / "metrics.json").read_text())
    metrics.update(summarize(rows, judge=True, benchmark="locomo", n_boot=50))
    (run / "metrics.json").write_text(json.dumps(metrics))
    page = build_report([run], tmp_path / "r.html").path.read_text()
    assert ('<div class="warn reader-errors">Reader errors: 1 of 6 answers failed at the reader and are scored as '
            "empty predictions") in page
    assert ('<div class="warn judge-unparsed">Unparsed judge replies: 1 of 6 stated no verdict the parser could '
            "read; each is counted as not correct in the Judge column") in page
    verdicts = re.findall(r'judge <b class="verdict[^"]*">(\w+)</b>([^·]*)·', page)
    assert [v for v, _ in verdicts] == ["CORRECT", "unparsed", "CORRECT", "CORRECT", "CORRECT", "WRONG"]
    assert verdicts[1][1].startswith(" (the reply stated no verdict the parser could read; counted as wrong)")
    clean = build_report([_judged_run(tmp_path / "b")], tmp_path / "r.html").path.read_text()
    assert '<div class="note reader-errors">Reader errors: 0 of 6 answers' in clean
    assert '<div class="note judge-unparsed">Unparsed judge replies: 0 of 6' in clean


def test_each_runs_hit_list_and_the_latency_rule_are_stated(tmp_path: Path) -> None:
    """The attribution note said ranks count turns for memfit and plain, where eval.hit_list=final (the default)
    gives summaries ranks too; the latency note named a rule the code does not use."""
    final = write_run(tmp_path / "final", _questions(3, 2, "t"))
    _edit_json(final / "metrics.json", lambda m: m.update(retrieval={"hit_list": "final"}))
    older = write_run(tmp_path / "older", _questions(3, 2, "t"))  # diagnostics made before the setting
    page = build_report([final, older], tmp_path / "r.html").path.read_text()
    assert ("for memfit and plain they count what the run's hit@k counts (<code>eval.hit_list</code>): with "
            "<code>final</code> every item of the final ranked list, a summary holding a rank too, with "
            "<code>episodes</code> the turns alone:\nfinal <code class=\"hit-list\">final</code>; older <code "
            "class=\"hit-list\">episodes</code>.</p>") in page
    assert ("latency = (timings.json <code>retrieve</code> + the answer role's wall time, ledger.json "
            "<code>roles.answer.wall_s</code>) / questions, a mean over one batched pass (the judge's calls are not in "
            "it).") in page


@pytest.mark.parametrize("name", ["r$x$", "r$\\foo{$"])
def test_a_run_named_with_dollar_signs_is_drawn_as_written(tmp_path: Path, name: str) -> None:
    """matplotlib read a `$` pair in a run's name as TeX: `r$x$` was drawn as math, `r$\\foo{$` stopped the report
    with a mathtext traceback."""
    run = write_run(tmp_path / name, _questions(3, 2, "t"))
    page = build_report([run], tmp_path / "r.html").path.read_text()
    figure = re.search(r'<figure id="figure-scores">(.*?)</figure>', page, re.S).group(1)
    # the legend's text element holds the name as written (drawn as math, it was glyph runs of `r` and `x`)
    assert re.search(r"<text [^>]*>" + re.escape(html.escape(name, quote=False)) + "</text>", figure)
