"""Pack depth in one run (the paper's Table 10, sensitivity to k): `memfit run ... eval.pack_cutoffs=[5,10,20,30]`.

The run retrieves once, at its own pack.k, as always. After its answers, every question is answered again at
each depth k of eval.pack_cutoffs on the top k of the same ranking: `Method.read_depth` (methods/base.py
DepthMethod; memfit and plain) packs the ranked candidates of packs.jsonl at depth k with the batched path's
own assembly, which gives the rows a run at pack.k=k writes (nothing before the pack depends on k). Each
question gets one answer call per depth (role `depth_answer`, key `depth:<k>:<question id>`, phase eval, so
the run's own one-answer-per-question check and its efficiency row are untouched), built by the same answer
builder: at k = pack.k the request is the run's own answer (a cache hit), at another k it is the request a run
at pack.k=k makes, with the same cache key, so `eval.pack_cutoffs` answers what separate runs at each k
answer and a later run at that k is served from the cache. With the judge on, each depth's answers are judged
as the run's are (role judge; an answer judged before is a cache hit).

`DIR/depths.jsonl` holds one `depth` row per k (the pack diagnostics at k) and one row per question (appended
a depth at a time, after the ledger is saved: a rerun skips the depths it finds and is served the rest from the
response cache); `DIR/depths.json` the per-depth summary: questions, prompt tokens per question (the answer
calls' input tokens, cache hits included: what the reader reads at that depth), the results table's blocks
(evaluate/tables.py summarize: per category, Average, Overall, judge) and the pack hit rates. metrics.json
carries it as `depths`, results.md as a table.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from memfit_gpu import faults, render
from memfit_gpu.config import ConfigError, MemFitConfig
from memfit_gpu.evaluate.tables import summarize
from memfit_gpu.files import append_jsonl, atomic_write_text, read_json_object
from memfit_gpu.methods.base import MethodRun
from memfit_gpu.methods.registry import make_method, method_entry, methods_with
from memfit_gpu.run.answer import Answering
from memfit_gpu.run.directory import whole_groups

log = logging.getLogger(__name__)

ROLE = "depth_answer"
ROWS = "depths.jsonl"
SUMMARY = "depths.json"


def check_depths(cfg: MemFitConfig) -> None:
    """eval.pack_cutoffs needs a method whose pack is the top k of a ranking (its registry entry's `depths`)."""
    if cfg.eval.pack_cutoffs and not method_entry(cfg.method).depths:
        raise ConfigError(f"eval.pack_cutoffs={cfg.eval.pack_cutoffs} needs method {' or '.join(sorted(methods_with('depths')))} "
                          f"(a pack that is the top k of a ranking); method={cfg.method} has none")


def depth_key(k: int, question_id: str) -> str:
    """The ledger key of one question's answer call at depth k."""
    return f"depth:{k}:{question_id}"


def run_depths(out: Path, run: MethodRun, packs: dict[str, dict[str, Any]], answering: Answering,
               benchmark: str | None) -> dict[str, Any]:
    """Answer and score every depth not yet in DIR/depths.jsonl (module doc); returns depths.json's content.

    packs: the run's packs.jsonl rows by question id (at pack.k)."""
    cfg = run.cfg
    path = out / ROWS
    rows = whole_groups(path, "depth", "k")
    done = {int(r["k"]) for r in rows if r.get("t") == "depth"}
    todo = [k for k in cfg.eval.pack_cutoffs if k not in done]
    if todo:
        ranked = [packs[q.question_id] for q in run.questions]
        method = make_method(cfg.method)
        try:
            if any(k != cfg.pack.k for k in todo):
                method.write(run)  # the one write: already stored, so it asks for nothing and encodes nothing
            for k in todo:
                if k == cfg.pack.k:
                    made, diagnostics = ranked, read_json_object(out / "diagnostics.json")
                else:
                    made, diagnostics = method.read_depth(run, ranked, k)  # type: ignore[attr-defined]
                new = _score_depth(run, answering, k, made, diagnostics)
                append_jsonl(path, new)
                faults.point("depths")
                rows += new
        finally:
            method.close()
    summary = depth_summary(cfg, rows, benchmark)
    atomic_write_text(out / SUMMARY, json.dumps(summary, indent=2) + "\n")
    faults.point("depths.json")
    return summary


def _score_depth(run: MethodRun, answering: Answering, k: int, made: Sequence[dict[str, Any]],
                 diagnostics: dict[str, Any]) -> list[dict[str, Any]]:
    """One depth: one answer call per question on its pack at k, scored (and judged) as the run scores; the rows
    to append (the `depth` row with the pack diagnostics, then one per question)."""
    questions = run.questions
    answered = answering.answer(questions, made, ROLE, lambda q: depth_key(k, q.question_id), "depths.ledger")
    verdicts = answering.verdicts(questions, answered)
    out: list[dict[str, Any]] = [{"t": "depth", "k": k, "questions": len(questions),
                                  "retrieval": diagnostics.get("overall"), "by_category": diagnostics.get("by_category")}]
    for q, pack, a, verdict in zip(questions, made, answered, verdicts, strict=True):
        out.append({"t": "question", "k": k, "question_id": q.question_id, "memory_id": q.memory_id,
                    "category": q.category, "evaluated": q.evaluated, "question": q.question, "gold": q.answer,
                    "prediction": a.prediction, "raw_output": a.response.text, "abstained": a.abstained,
                    "scores": a.scores, **a.text_fields(), "judge": verdict,
                    "retrieval": pack.get("retrieval"), "input_tokens": int(a.response.input_tokens),
                    "output_tokens": int(a.response.output_tokens), **a.cut})
    log.info("pack depth %d: %d questions answered", k, len(questions))
    return out


def depth_summary(cfg: MemFitConfig, rows: Sequence[dict[str, Any]], benchmark: str | None) -> dict[str, Any]:
    """depths.json: per depth (in eval.pack_cutoffs order) the questions, the prompt and answer tokens per question,
    the results table's blocks (evaluate.tables.summarize, no intervals) and the pack hit rates."""
    depths = []
    for k in cfg.eval.pack_cutoffs:
        head = next((r for r in rows if r.get("t") == "depth" and int(r["k"]) == k), None)
        scored = [r for r in rows if r.get("t") == "question" and int(r["k"]) == k]
        if head is None or not scored:
            continue
        table = summarize(scored, variant=cfg.eval.table_metric, judge=cfg.eval.judge.enabled, benchmark=benchmark,
                          ci=False)
        depths.append({"k": k, "questions": len(scored),
                       "input_tokens_per_question": float(np.mean([r["input_tokens"] for r in scored])),
                       "output_tokens_per_question": float(np.mean([r["output_tokens"] for r in scored])),
                       "overall": table["overall"], "average": table["average"], "by_category": table["by_category"],
                       "retrieval": head.get("retrieval")})
    return {"method": cfg.method, "pack_k": cfg.pack.k, "metric_variant": cfg.eval.table_metric, "depths": depths}


def render_depths(summary: dict[str, Any]) -> str:
    """results.md's table of the depths: k, questions, prompt tokens per question, Average F1 / BLEU-1, judge, pack hit."""
    variant = summary["metric_variant"]

    def pct(value: Any) -> str:
        return "-" if value is None else f"{100.0 * value:.2f}"

    cells = []
    for d in summary["depths"]:
        hit = (d.get("retrieval") or {}).get("pack_hit")
        cells.append([f"{d['k']}" + (" (run)" if d["k"] == summary["pack_k"] else ""), str(d["questions"]),
                      f"{d['input_tokens_per_question']:.0f}", pct(d["average"][variant]["f1"]),
                      pct(d["average"][variant]["bleu1"]), pct(d["average"].get("judge")), pct(hit)])
    return "\n".join([
        "### Pack depth (eval.pack_cutoffs)", "",
        f"The run's ranking packed at each depth k, one answer call per question per depth; Average of `{variant}` "
        "F1 / BLEU-1 and judge x100, prompt tokens = the answer calls' input tokens per question.", "",
        render.markdown_table(["k", "n", "Input tokens / question", "Avg F1", "Avg BLEU-1", "Judge", "Pack hit"], cells,
                              align=["left"] + ["right"] * 6).rstrip("\n"), ""])
