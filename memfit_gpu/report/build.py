"""`memfit report RUN_DIR [RUN_DIR ...] --out report.html`: one self-contained HTML file of finished runs.

What the page holds, and where each part comes from (nothing a run wrote is recomputed another way):
- a header per run: provenance.json's summary (provenance.summary, results.md's block), the configuration keys the
  runs differ in (config.yaml, flattened), the ledger's calls, tokens and cost per role (the USD unknown, its
  unpriced models named, when a hosted model has no price), timings.json's stages;
- the results table per category in the paper's layout (metrics.json; 95 % percentile bootstrap intervals:
  metrics.json's for Average and Overall, the same bootstrap per category, evaluate/stats.py) and, from two
  runs on, each run against the first as `memfit compare` tests it (evaluate/compare.py compare_runs: paired
  sign-flip permutation test, gained / lost questions, provenance drift; runs whose gold answer or question text
  differs under one question id are refused), under each table the reader errors and unparsed judge replies
  results.md states;
- the failure attribution per category (evaluate/attribution.py: one outcome per question, the rule stated on
  the page) as counts and a stacked bar;
- a per-question viewer: filters by category, outcome and run; per question the gold answer, each run's
  prediction, score, verdict ("unparsed" where the judge's reply stated none: counted as wrong) and judge reply,
  the pack as the reader saw it (packs.jsonl `excerpts`) with the evidence turns marked and their rank in the
  method's ranking (each run's eval.hit_list named);
- figures (report/plots.py): scores per category per run, accuracy against cost and latency (`memfit
  efficiency`'s rows) with their frontier, accuracy and prompt tokens against the pack depth (depths.json), and
  latency percentiles of an experiments/bench_online.py JSON when one is given.

The file needs no network and no server: styles, script, figures (inline SVG) and data are in it. Its size is
held to `max_bytes` (the page states the limit): when the pack texts would pass it, the excerpts that are not
evidence are trimmed to the longest length that fits (then, only if that is not enough, the evidence too), each
with a note of how many characters it lost; nothing is left out silently, and packs.jsonl keeps every text.
"""

from __future__ import annotations

import html
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import numpy as np

from memfit_gpu import provenance
from memfit_gpu.evaluate.attribution import (
    CORRECT_F1,
    CORRECTNESS_RULE,
    DEFAULT_TOP_N,
    OUTCOMES,
    Attributed,
    attribute_run,
    matches,
    outcome_counts,
)
from memfit_gpu.evaluate.compare import PredictionsError, check_same_questions, compare_runs
from memfit_gpu.evaluate.efficiency import DEFAULT_PRICE_MODEL
from memfit_gpu.evaluate.stats import bootstrap_mean_ci
from memfit_gpu.evaluate.tables import benchmark_title, category_name, category_order
from memfit_gpu.files import atomic_write_text
from memfit_gpu.mappings import flatten
from memfit_gpu.readers.ledger import load_prices, recorded_cost, usd_text
from memfit_gpu.report import plots
from memfit_gpu.report.runs import ReportError, RunFiles, labels_for, read_run

DEFAULT_MAX_BYTES = 20 * 1024 * 1024
PAGE_SIZE = 20  # questions the viewer shows at a time
MIN_EXCERPT_CHARS = 200  # trimming stops here: an excerpt shorter than this says too little to keep the page
_EXCERPT_LINE = re.compile(r"EXCERPT (\d+) ")
# store/text.py episode_body: `[Image {id}: {caption}] ` (MemGallery's ids), `[Image: {caption}] ` without one
_IMAGE = re.compile(r"\[Image(?: [^:\]]+)?: ")


@dataclass(frozen=True)
class Report:
    path: Path
    bytes: int
    max_bytes: int
    excerpts: int  # excerpt blocks on the page
    trimmed: int  # of them, trimmed to keep the size
    cap: int | None  # the length they were trimmed to (None: nothing trimmed)


# ------------------------------------------------------------------------------------------ per question
def question_records(run: RunFiles, top_n: int = DEFAULT_TOP_N) -> list[dict[str, Any]]:
    """One record per evaluated question of the run: what the viewer shows and the W&B table holds (its flat part:
    TABLE_COLUMNS)."""
    attributed = {a.question_id: a for a in attribute_run(run.packs, run.predictions, run.variant, top_n, run.hit_list)}
    out = []
    for row in run.predictions:
        a = attributed[row["question_id"]]
        pack = run.packs[row["question_id"]]
        scores = (row.get("scores") or {}).get(run.variant) or {}
        judge = row.get("judge") if isinstance(row.get("judge"), dict) else None
        out.append({
            "question_id": row["question_id"], "memory_id": row.get("memory_id"), "category": a.category,
            "category_name": category_name(a.category, run.benchmark), "question": row.get("question", ""),
            "gold": row.get("gold"), "prediction": row.get("prediction", ""), "raw_output": row.get("raw_output", ""),
            "f1": scores.get("f1"), "bleu1": scores.get("bleu1"),
            "judge": None if judge is None else judge.get("verdict"),
            "judge_reply": None if judge is None else judge.get("reason"),
            "judge_score": None if judge is None else judge.get("score"),
            # a reply that stated no verdict the parser could read: its verdict is false, and counted so
            "judge_unparsed": bool(judge is not None and judge.get("unparsed")),
            "correct": a.correct, "outcome": a.outcome, "evidence": list(pack.get("evidence") or []),
            "ranking": a.evidence.ranking, "ranks": dict(a.evidence.ranks), "in_pack": dict(a.evidence.in_pack),
            "selected": [e["turn_id"] for e in (pack.get("pack") or {}).get("selected") or []],
            "pack_hit": None if not a.evidence.annotated else a.evidence.pack_hit,
            "notes": _notes(row, pack),
        })
    return out


TABLE_COLUMNS = ("question_id", "memory_id", "category", "category_name", "question", "gold", "prediction", "f1",
                 "bleu1", "judge", "correct", "outcome", "evidence", "evidence_ranks", "pack_hit")


def question_table(records: Sequence[dict[str, Any]]) -> tuple[list[str], list[list[Any]]]:
    """(columns, rows) of the per-question table (TABLE_COLUMNS): the report viewer's records as flat cells, one
    type per column (evidence and ranks as text), for the run's W&B table."""
    rows = []
    for r in records:
        ranks = "; ".join(f"{e} {_rank_text(r['ranking'], r['ranks'].get(e))}" for e in r["evidence"])
        cells = {**r, "evidence": ", ".join(r["evidence"]), "evidence_ranks": ranks,
                 "gold": None if r["gold"] is None else str(r["gold"])}
        rows.append([cells[c] for c in TABLE_COLUMNS])
    return list(TABLE_COLUMNS), rows


def _rank_text(ranking: str | None, rank: int | None) -> str:
    if ranking is None:
        return "no ranking"
    if rank is None:
        return "not ranked"
    return f"{ranking} rank {rank}"


def _notes(prediction: dict[str, Any], pack: dict[str, Any]) -> list[str]:
    """What changed the context or the answer of one question, as the run recorded it."""
    notes = []
    if prediction.get("prompt_chars_cut"):
        notes.append(f"the answer prompt was cut by {prediction['prompt_chars_cut']:,} characters to fit the reader "
                     "(the end of the excerpts went)")
    if pack.get("excerpt_chars_cut"):
        notes.append(f"{pack['excerpt_chars_cut']:,} characters cut from excerpts longer than pack.max_excerpt_chars")
    truncation = (pack.get("method_notes") or {}).get("truncation")
    if isinstance(truncation, dict) and truncation.get("turns_dropped"):
        notes.append(f"{truncation['turns_dropped']:,} of {truncation.get('turns', '?'):,} turns dropped to fit the "
                     f"reader (first kept: {truncation.get('first_kept_turn')}; bound {truncation.get('bound')})")
    if prediction.get("reader_error"):
        notes.append(f"reader error: {prediction['reader_error']}")
    for key, value in (prediction.get("reader_notes") or {}).items():
        notes.append(f"reader: {key} = {value}")
    return notes


def excerpt_blocks(pack: dict[str, Any]) -> list[dict[str, Any]]:
    """The pack's excerpt text in blocks as the reader saw it: one per `EXCERPT n` (with the turns it quotes, where
    the method's row says: memfit / plain / full_context one turn per excerpt, naive_rag a chunk's turns) and one
    per other structure line run (REMEMBERED FACTS, a method's headers). Stored text never starts a line at column
    0 (quoting.quote_lines), so every line that does is the template's."""
    blocks: list[dict[str, Any]] = []
    for line in str(pack.get("excerpts") or "").splitlines():
        match = _EXCERPT_LINE.match(line)
        if match:
            blocks.append({"kind": "excerpt", "number": int(match.group(1)), "lines": [line]})
        elif blocks and (not line.strip() or line[0].isspace() or blocks[-1]["kind"] == "text"):
            blocks[-1]["lines"].append(line)
        else:
            blocks.append({"kind": "text", "number": None, "lines": [line]})
    excerpts = [b for b in blocks if b["kind"] == "excerpt"]
    episodes = [e["turn_id"] for e in (pack.get("pack") or {}).get("episodes") or []]
    chunks = pack.get("chunks")
    if isinstance(chunks, list) and len(chunks) == len(excerpts):
        turns = [list(c.get("turn_ids") or []) for c in chunks]
    elif len(episodes) == len(excerpts):
        turns = [[t] for t in episodes]
    else:  # a method whose excerpts are not one turn each in pack order (lightmem_slm): no turn marks
        turns = [[] for _ in excerpts]
    for block, turn_ids in zip(excerpts, turns, strict=True):
        block["turn_ids"] = turn_ids
    for block in blocks:
        block.setdefault("turn_ids", [])
        block["text"] = "\n".join(block.pop("lines")).rstrip("\n")
    return blocks


def _segments(text: str) -> list[tuple[str, str]]:
    """("text" | "image", piece): image ids (`[Image id: caption]`, MemGallery's turns) marked as such."""
    out: list[tuple[str, str]] = []
    position = 0
    for match in _IMAGE.finditer(text):
        end = text.find("]", match.end())
        if end < 0:
            break
        if match.start() > position:
            out.append(("text", text[position:match.start()]))
        out.append(("image", text[match.start():end + 1]))
        position = end + 1
    if position < len(text):
        out.append(("text", text[position:]))
    return out


def _trimmed(text: str, cap: int | None) -> tuple[str, int]:
    if cap is None or len(text) <= cap:
        return text, 0
    return text[:cap], len(text) - cap


# ------------------------------------------------------------------------------------------- the page
def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100.0 * value:.2f}"


def _ci(interval: Sequence[float] | None) -> str:
    return "" if not interval else f"[{100.0 * interval[0]:.1f}, {100.0 * interval[1]:.1f}]"


def _results_table(run: RunFiles) -> dict[str, Any]:
    """The paper's table of one run with 95 % intervals: per category F1 [CI], BLEU-1, judge [CI], then Average and
    Overall (metrics.json's intervals)."""
    metrics, variant = run.metrics, run.variant
    settings = run.config.get("eval") or {}
    n_boot, seed = int(settings.get("bootstrap_samples", 1000)), int(settings.get("seed", 0))
    rows = []
    for cat, block in metrics["by_category"].items():
        members = [r for r in run.predictions if str(r["category"]) == cat]
        f1 = [float(r["scores"][variant]["f1"]) for r in members]
        verdicts = [float(bool(r["judge"]["verdict"])) for r in members
                    if isinstance(r.get("judge"), dict) and r["judge"].get("verdict") is not None]
        rows.append({"label": block["name"] if block["name"] == cat else f"{block['name']} ({cat})", "n": block["n"],
                     "f1": _pct(block[variant]["f1"]), "f1_ci": _ci(bootstrap_mean_ci(f1, n_boot=n_boot, seed=seed)),
                     "bleu1": _pct(block[variant]["bleu1"]), "judge": _pct(block.get("judge")),
                     "judge_ci": _ci(bootstrap_mean_ci(verdicts, n_boot=n_boot, seed=seed)) if verdicts else "",
                     "total": False})
    ci = metrics.get("ci95") or {}
    blocks = [("Average", "average", metrics["average"])]
    if metrics.get("averaging") == "category_mean":
        blocks.append(("Overall", "overall", metrics["overall"]))
    for label, key, block in blocks:
        interval = ci.get(key) or {}
        rows.append({"label": label, "n": block["n"], "f1": _pct(block[variant]["f1"]),
                     "f1_ci": _ci((interval.get(variant) or {}).get("f1")), "bleu1": _pct(block[variant]["bleu1"]),
                     "judge": _pct(block.get("judge")), "judge_ci": _ci(interval.get("judge")), "total": True})
    if metrics.get("averaging") == "category_mean":
        rule = f"Average = unweighted mean of the {len(metrics['by_category'])} category means; Overall = every question alike"
    else:
        rule = "Average = every question alike"
    # results.md's two lines (evaluate/tables.py render_markdown): read_run checked metrics.json's counts are these
    verdicts = [r["judge"] for r in run.predictions
                if isinstance(r.get("judge"), dict) and r["judge"].get("verdict") is not None]
    return {"rows": rows, "variant": variant, "rule": rule, "n_boot": n_boot, "seed": seed,
            "judged": any(r["judge"] != "-" for r in rows), "questions": len(run.predictions),
            "reader_errors": sum(1 for r in run.predictions if r.get("reader_error")),
            "verdicts": len(verdicts), "unparsed": sum(1 for j in verdicts if j.get("unparsed"))}


def _comparison(base: RunFiles, other: RunFiles) -> dict[str, Any]:
    """`memfit compare BASE OTHER --variant V` (V: the report's variant, the results tables'), as rows."""
    try:
        result = compare_runs(base.path, other.path, variant=base.variant)
    except PredictionsError as exc:  # runs that share no question, a row compare cannot read: one line, exit 2
        raise ReportError(str(exc)) from None
    rows = []
    for cat, r in result["by_category"].items():
        rows.append((r["name"] if r["name"] == cat else f"{r['name']} ({cat})", r, r["mean_a"], r["mean_b"]))
    overall = result["overall"]
    rows.append(("overall", overall, overall["mean_a"], overall["mean_b"]))
    cats = list(result["by_category"].values())
    rows.append(("average of categories", result["category_mean"], float(np.mean([c["mean_a"] for c in cats])),
                 float(np.mean([c["mean_b"] for c in cats]))))
    test = ("exact sign-flip permutation test" if result["method"] == "exact"
            else f"sign-flip permutation test, {result['n_permutations']} permutations, seed {result['seed']}")
    return {"a": base.label, "b": other.label, "metric": result["metric"], "paired": result["paired"], "test": test,
            "rows": [{"label": label, "n": r["n"], "a": _pct(a), "b": _pct(b), "diff": f"{100.0 * r['diff']:+.2f}",
                      "p": f"{r['p_value']:.4f}", "gained": r["gained"], "lost": r["lost"]} for label, r, a, b in rows],
            "only_a": len(result["only_a"]), "only_b": len(result["only_b"]),
            "lines": [*(f"warning: {w}" for w in result["warnings"]), *result["provenance"]]}


def _check_same_questions(runs: Sequence[RunFiles]) -> None:
    """ReportError naming the first question id whose gold answer or question text differs between a run and the
    first run that holds it: the viewer shows one gold and one question per id, and the comparisons pair by id."""
    first: dict[str, tuple[RunFiles, dict[str, Any]]] = {}
    for run in runs:
        for row in run.predictions:
            holder, held = first.setdefault(row["question_id"], (run, row))
            if holder is not run:
                try:
                    check_same_questions(holder.path / "predictions.jsonl", {row["question_id"]: held},
                                         run.path / "predictions.jsonl", {row["question_id"]: row})
                except PredictionsError as exc:
                    raise ReportError(str(exc)) from None


def _config_diff(runs: Sequence[RunFiles]) -> list[dict[str, Any]]:
    flat = [flatten(run.config) for run in runs]
    keys = sorted(set().union(*flat))
    return [{"key": key, "values": [json.dumps(f.get(key)) if key in f else "(absent)" for f in flat]}
            for key in keys if len({json.dumps(f.get(key), sort_keys=True) for f in flat}) > 1]


def _header(run: RunFiles) -> dict[str, Any]:
    ledger = run.ledger
    roles = [{"role": role, "calls": s.get("calls", 0), "cached": s.get("cached", 0),
              "input_tokens": s.get("input_tokens", 0), "output_tokens": s.get("output_tokens", 0),
              "wall_s": f"{s.get('wall_s', 0.0):.1f}"}
             for role, s in (ledger.get("roles") or {}).items() if s.get("calls", 0) or s.get("cached", 0)]
    cost = recorded_cost(ledger)
    reader = run.config.get("reader") or {}
    return {"label": run.label, "path": str(run.path), "name": run.metrics.get("name"), "method": run.method,
            "benchmark": benchmark_title(run.benchmark) or run.benchmark, "questions": run.metrics.get("questions"),
            "reader": f"{reader.get('backend')} {reader.get('model')}",
            "provenance": provenance.summary(run.provenance) if run.provenance else None,
            "in_run": ", ".join(f"{c} {category_name(c, run.benchmark)}"
                                for c in category_order(str(r["category"]) for r in run.predictions)),
            "roles": roles, "usd": usd_text(cost), "unpriced": bool(cost["unpriced_models"]), "hit_list": run.hit_list,
            "timings": [(stage, f"{seconds:.1f}") for stage, seconds in run.timings.items()],
            "total_s": f"{sum(run.timings.values()):.1f}", "warnings": run.warnings}


def _accuracy(run: RunFiles, every_judged: bool) -> float | None:
    average = run.metrics["average"]
    return average.get("judge") if every_judged else average[run.variant]["f1"]


def _depth_table(run: RunFiles, every_judged: bool) -> list[dict[str, Any]]:
    assert run.depths is not None
    out = []
    for d in run.depths["depths"]:
        average = d["average"]
        out.append({"k": d["k"], "run_k": d["k"] == run.depths.get("pack_k"), "n": d["questions"],
                    "tokens": f"{d['input_tokens_per_question']:.0f}", "f1": _pct(average[run.variant]["f1"]),
                    "bleu1": _pct(average[run.variant]["bleu1"]), "judge": _pct(average.get("judge")),
                    "pack_hit": _pct((d.get("retrieval") or {}).get("pack_hit")),
                    "accuracy": average.get("judge") if every_judged else average[run.variant]["f1"],
                    "input_tokens": d["input_tokens_per_question"]})
    return out


def _viewer(runs: Sequence[RunFiles], records: Sequence[Sequence[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One entry per question of any run (the first run's order, then the others'), each run's answer beside."""
    by_run = [{r["question_id"]: r for r in rs} for rs in records]
    order = list(dict.fromkeys(qid for rs in records for qid in (r["question_id"] for r in rs)))
    out = []
    for qid in order:
        first = next(by[qid] for by in by_run if qid in by)
        answers = []
        for i, (run, by) in enumerate(zip(runs, by_run, strict=True)):
            record = by.get(qid)
            if record is None:
                answers.append(None)
                continue
            pack = run.packs[qid]
            blocks = []
            for block in excerpt_blocks(pack):
                evidence = [e for e in record["evidence"] if any(matches(t, e) for t in block["turn_ids"])]
                blocks.append({**block, "evidence": evidence,
                               "ranks": [_rank_text(record["ranking"], record["ranks"].get(e)) for e in evidence]})
            summaries = [s for s in (pack.get("pack") or {}).get("summaries") or []
                         if any(matches(t, e) for t in s.get("members") or [] for e in record["evidence"])]
            answers.append({**record, "run": i, "blocks": blocks, "summary_evidence": len(summaries),
                            "evidence_rows": [{"id": e, "rank": _rank_text(record["ranking"], record["ranks"].get(e)),
                                               "selected": any(matches(t, e) for t in record["selected"]),
                                               "in_pack": record["in_pack"].get(e, False)}
                                              for e in record["evidence"]]})
        out.append({"question_id": qid, "memory_id": first["memory_id"], "category": first["category"],
                    "category_name": first["category_name"], "question": first["question"], "gold": first["gold"],
                    "evidence": first["evidence"], "answers": answers,
                    "outcomes": " ".join(f"{i}:{a['outcome']}" for i, a in enumerate(answers) if a is not None)})
    return out


def _apply_cap(questions: Sequence[dict[str, Any]], cap: int | None, evidence_cap: int | None) -> int:
    """Trim every excerpt block's text to `cap` (evidence blocks to `evidence_cap`); sets each block's segments and
    note; returns how many were trimmed."""
    trimmed = 0
    for q in questions:
        for answer in q["answers"]:
            if answer is None:
                continue
            for block in answer["blocks"]:
                text, cut = _trimmed(block["text"], evidence_cap if block["evidence"] else cap)
                block["segments"] = _segments(text)
                block["cut"] = cut
                trimmed += bool(cut)
    return trimmed


def _excerpt_sizes(questions: Sequence[dict[str, Any]]) -> tuple[list[int], list[int]]:
    """(escaped UTF-8 sizes of the non-evidence blocks' texts, of the evidence blocks' texts)."""
    plain, evidence = [], []
    for q in questions:
        for answer in q["answers"]:
            for block in answer["blocks"] if answer else []:
                (evidence if block["evidence"] else plain).append(len(html.escape(block["text"]).encode("utf-8")))
    return plain, evidence


def _largest_cap(sizes: Sequence[int], budget: float) -> int | None:
    """The largest per-text cap c with sum(min(size, c)) <= budget (None when none fits at MIN_EXCERPT_CHARS)."""
    if sum(sizes) <= budget:
        return max(sizes, default=0)
    low, high = MIN_EXCERPT_CHARS, max(sizes, default=0)
    if sum(min(s, low) for s in sizes) > budget:
        return None
    while low < high:
        mid = (low + high + 1) // 2
        if sum(min(s, mid) for s in sizes) <= budget:
            low = mid
        else:
            high = mid - 1
    return low


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.PackageLoader("memfit_gpu.report", "templates"),
                             autoescape=jinja2.select_autoescape(["html", "j2"]), undefined=jinja2.StrictUndefined,
                             trim_blocks=True, lstrip_blocks=True)
    # provenance.summary writes `code` spans (Markdown): shown as code, the rest escaped
    env.filters["code_spans"] = lambda text: jinja2.utils.markupsafe.Markup(
        re.sub(r"`([^`]+)`", r"<code>\1</code>", str(jinja2.utils.markupsafe.escape(text))))
    env.filters["json_attr"] = lambda value: json.dumps(value, ensure_ascii=False)
    return env


def build_report(run_dirs: Sequence[str | Path], out: str | Path, online: str | Path | None = None,
                 top_n: int = DEFAULT_TOP_N, max_bytes: int = DEFAULT_MAX_BYTES,
                 price_model: str | None = DEFAULT_PRICE_MODEL, prices_path: str | Path | None = None,
                 title: str | None = None) -> Report:
    """Write the report of `run_dirs` to `out` (module doc); returns what it holds."""
    if not run_dirs:
        raise ReportError("memfit report needs at least one run directory")
    if top_n < 1:
        raise ReportError(f"--top-n {top_n}: the ranking depth that counts as retrieved must be >= 1")
    paths = [Path(p) for p in run_dirs]
    names = labels_for(paths)
    # every run at the first run's table variant: a column, a figure's axis or a comparison never mixes two
    first = read_run(paths[0], names[0])
    runs = [first, *(read_run(p, name, first.variant) for p, name in zip(paths[1:], names[1:], strict=True))]
    price = None
    if price_model is not None:
        prices = load_prices(prices_path)
        if price_model not in prices:
            raise ReportError(f"--price-model {price_model!r} has no price in {prices_path or 'configs/prices.yaml'} "
                              f"(have: {', '.join(sorted(prices))})")
        price = prices[price_model]
    bench_online = _read_online(Path(online)) if online is not None else None
    _check_same_questions(runs)

    records = [question_records(run, top_n) for run in runs]
    attributed = [attribute_run(run.packs, run.predictions, run.variant, top_n, run.hit_list) for run in runs]
    categories = category_order(str(r["category"]) for run in runs for r in run.predictions)
    benchmark = runs[0].benchmark
    labels = [category_name(c, benchmark) for c in categories]
    every_judged = all(_accuracy(run, True) is not None for run in runs)
    accuracy_label = "Average judge accuracy" if every_judged else "Average F1"
    efficiency = [run.efficiency(price) for run in runs]

    figures = _figures(runs, categories, labels, attributed, efficiency, every_judged, accuracy_label, bench_online)
    viewer = _viewer(runs, records)
    context = {
        "title": title or f"memfit report: {', '.join(run.label for run in runs)}",
        "runs": [_header(run) for run in runs],
        "config_diff": _config_diff(runs),
        "drift": provenance.drift({run.label: run.provenance for run in runs}) if len(runs) > 1 else [],
        "results": [_results_table(run) for run in runs],
        "comparisons": [_comparison(runs[0], run) for run in runs[1:]],
        "attribution": [_attribution_table(a, categories, labels) for a in attributed],
        "outcomes": OUTCOMES, "colours": plots.OUTCOME_COLOURS, "run_colours": [plots.run_colour(i) for i in range(len(runs))],
        "correctness_rule": CORRECTNESS_RULE, "correct_f1": CORRECT_F1, "top_n": top_n,
        "efficiency": [{**row, "label": run.label} for row, run in zip(efficiency, runs, strict=True)],
        "price_model": price_model,
        "depths": [{"label": run.label, "rows": _depth_table(run, every_judged)} for run in runs if run.depths],
        "accuracy_label": accuracy_label,
        "online": bench_online,
        "figures": figures,
        "categories": list(zip(categories, labels, strict=True)),
        "questions": viewer, "page_size": PAGE_SIZE,
        "max_mb": max_bytes / 1024 / 1024,
    }
    template = _environment().get_template("report.html.j2")
    page, trimmed, cap = _fit(template, context, viewer, max_bytes)
    out = Path(out)
    atomic_write_text(out, page)
    return Report(out, len(page.encode("utf-8")), max_bytes, context["size"]["excerpts"], trimmed, cap)


NOTE_BYTES = 200  # a trimmed excerpt's note, in the page


def _fit(template: jinja2.Template, context: dict[str, Any], viewer: Sequence[dict[str, Any]], max_bytes: int
         ) -> tuple[str, int, int | None]:
    """(the page, excerpts trimmed, the length they were trimmed to) within max_bytes: the whole texts when they
    fit; else every excerpt that is not evidence trimmed to the longest length that fits, and only when even
    MIN_EXCERPT_CHARS each is too much, the evidence excerpts too. Each try leaves more room (the caps count
    characters, the page bytes)."""
    plain, evidence = _excerpt_sizes(viewer)
    context["size"] = {"trimmed": 0, "excerpts": len(plain) + len(evidence), "cap": None, "evidence_cap": None}
    _apply_cap(viewer, None, None)
    page = template.render(**context)
    size = len(page.encode("utf-8"))
    if size <= max_bytes:
        return page, 0, None
    fixed = size - sum(plain) - sum(evidence)  # what is not excerpt text stays as it is
    for room in (0.97, 0.9, 0.8, 0.65):
        budget = (max_bytes - fixed) * room - NOTE_BYTES * (len(plain) + len(evidence))
        floor = sum(min(p, MIN_EXCERPT_CHARS) for p in plain)
        if budget - sum(evidence) >= floor:
            cap, evidence_cap = _largest_cap(plain, budget - sum(evidence)), None
        else:
            cap, evidence_cap = MIN_EXCERPT_CHARS, _largest_cap(evidence, budget - floor)
            if evidence_cap is None:
                break
        trimmed = _apply_cap(viewer, cap, evidence_cap)
        context["size"].update(trimmed=trimmed, cap=cap, evidence_cap=evidence_cap)
        page = template.render(**context)
        size = len(page.encode("utf-8"))
        if size <= max_bytes:
            return page, trimmed, cap
    raise ReportError(f"the report of {len(context['runs'])} runs and {len(viewer)} questions does not fit in "
                      f"{context['max_mb']:g} MB even with every excerpt trimmed to {MIN_EXCERPT_CHARS} characters "
                      f"({size / 1024 / 1024:.1f} MB at the last try): raise --max-mb or report fewer runs")


def _attribution_table(attributed: Sequence[Attributed], categories: Sequence[str], labels: Sequence[str]
                       ) -> dict[str, Any]:
    counts = outcome_counts(attributed)
    rows = [{"category": c, "label": label, "counts": counts.get(c) or dict.fromkeys(OUTCOMES, 0),
             "n": sum((counts.get(c) or {}).values())} for c, label in zip(categories, labels, strict=True)
            if c in counts]
    total = {o: sum(r["counts"][o] for r in rows) for o in OUTCOMES}
    return {"rows": rows, "total": total, "n": sum(total.values()), "counts": counts}


def _figures(runs: Sequence[RunFiles], categories: Sequence[str], labels: Sequence[str],
             attributed: Sequence[Sequence[Attributed]], efficiency: Sequence[dict[str, Any]], every_judged: bool,
             accuracy_label: str, bench_online: dict[str, Any] | None) -> dict[str, str | None]:
    names = [run.label for run in runs]
    variant = runs[0].variant
    panels: dict[str, list[list[float | None]]] = {
        f"F1 ({variant})": [[(run.metrics["by_category"].get(c) or {}).get(run.variant, {}).get("f1") for c in categories]
                            for run in runs]}
    if every_judged:
        panels["judge accuracy"] = [[(run.metrics["by_category"].get(c) or {}).get("judge") for c in categories]
                                    for run in runs]
    cost: dict[str, list[float | None]] = {
        "read tokens / question": [(row["read_input_tokens"] + row["read_output_tokens"]) / row["questions"]
                                   if row["questions"] else None for row in efficiency],
        "latency s / question": [row["latency_s_per_question"] for row in efficiency]}
    if any(row["est_usd"] for row in efficiency):
        cost["est. USD / 1000 questions"] = [1000 * row["est_usd"] / row["questions"] if row["est_usd"] is not None
                                             and row["questions"] else None for row in efficiency]
    series = []
    for i, run in enumerate(runs):
        if run.depths:
            rows = _depth_table(run, every_judged)
            series.append((run.label, i, [r["k"] for r in rows], [r["accuracy"] for r in rows],
                           [r["input_tokens"] for r in rows]))
    return {
        "scores": plots.category_scores(categories, labels, names, panels),
        "attribution": plots.attribution_bars(categories, labels, names, [outcome_counts(a) for a in attributed],
                                              OUTCOMES),
        "frontier": plots.frontier(names, [_accuracy(run, every_judged) for run in runs], accuracy_label, cost),
        "depths": plots.depths(series, accuracy_label),
        "latency": plots.latency(bench_online["table"], bench_online["levels"]) if bench_online else None,
    }


def _read_online(path: Path) -> dict[str, Any]:
    """experiments/bench_online.py's JSON (its last stdout line or --json-out file): the latency table and levels."""
    if not path.is_file():
        raise ReportError(f"--online {path}: no such file (experiments/bench_online.py --json-out FILE writes it)")
    text = path.read_text(encoding="utf-8").strip()
    try:
        data = json.loads(text.splitlines()[-1] if text and not text.startswith("{\n") else text)
    except (json.JSONDecodeError, IndexError):
        raise ReportError(f"--online {path}: not the JSON experiments/bench_online.py prints") from None
    if not isinstance(data, dict) or not isinstance(data.get("table"), list):
        raise ReportError(f"--online {path}: no `table` of latency percentiles (experiments/bench_online.py's JSON)")
    levels = (data.get("concurrency") or {}).get("levels") or []
    return {"path": str(path), "table": data["table"], "levels": levels,
            "conversations": data.get("conversations"), "turns": data.get("turns"), "questions": data.get("questions"),
            "cpus": data.get("cpus")}
