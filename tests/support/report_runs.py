"""Run directories for the report's and the pack depths' tests.

`write_run`: hand-made, the files `memfit run` writes (config.yaml, metrics.json by evaluate.tables.summarize,
predictions.jsonl, packs.jsonl, ledger.json, timings.json, DONE) for questions given as plain values, so a report of
any shape (a benchmark's categories, a method's row fields, LongMemEval-S's size) is built without a reader.
`echo_run`: a real `memfit run` of configs/smoke.yaml with the test-only echo reader (tests/seam_echo_backend.py:
it answers with its prompt's first line, so what a run sends is visible; no score from it means anything) on a copy
of a store that holds the conversation already (no encoding)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memfit_gpu.config import load_config, to_yaml
from memfit_gpu.evaluate.metrics import score_all
from memfit_gpu.evaluate.tables import summarize
from memfit_gpu.readers.ledger import Ledger
from support.env import memfit_env

REPO = Path(__file__).resolve().parents[2]
SMOKE = REPO / "configs" / "smoke.yaml"


@dataclass
class FakeQuestion:
    question_id: str
    category: str
    gold: str
    prediction: str
    evidence: list[str]
    excerpts: list[tuple[str, str]]  # (turn id, text) per EXCERPT, in pack order
    ranked: list[str] = field(default_factory=list)  # turn ids in rank order (default: the excerpts' order)
    selected: int | None = None  # how many of the excerpts were chosen on their own merit (default all)
    judge: bool | None = None
    fields: dict[str, Any] = field(default_factory=dict)  # the method's own pack row fields (None drops `ranked`)


def write_run(out: Path, questions: Sequence[FakeQuestion], benchmark: str = "locomo",
              overrides: Sequence[str] = ()) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    cfg = load_config(None, [f"data.benchmark={benchmark}", *overrides])
    (out / "config.yaml").write_text(to_yaml(cfg))
    scores = score_all([q.prediction for q in questions], [q.gold for q in questions],
                       [q.category for q in questions], cfg.eval.metrics)
    predictions, packs = [], []
    for q, score in zip(questions, scores, strict=True):
        ranked = q.ranked or [t for t, _ in q.excerpts]
        selected = [t for t, _ in q.excerpts][: q.selected if q.selected is not None else len(q.excerpts)]
        record = None if not q.evidence else {"pack_hit": any(t in q.evidence for t in selected),
                                              "hit@30": any(t in q.evidence for t in ranked[:30])}
        predictions.append({"question_id": q.question_id, "memory_id": "m1", "category": q.category, "evaluated": True,
                            "question": f"question {q.question_id}?", "gold": q.gold, "prediction": q.prediction,
                            "raw_output": q.prediction, "abstained": False, "scores": score,
                            "judge": None if q.judge is None else {"verdict": q.judge, "reason": "because", "score": 1.0},
                            "retrieval": record, "reader_notes": {}, "reader_error": None})
        packs.append({"question_id": q.question_id, "memory_id": "m1", "question": f"question {q.question_id}?",
                      "category": q.category, "evidence": q.evidence, "gold": q.gold, "method": cfg.method,
                      "reranker": {"backend": "none"}, "prf_terms": [],
                      "ranked": [{"kind": "episode", "row": i, "turn_id": t} for i, t in enumerate(ranked)],
                      "pack": {"episodes": [{"row": i, "turn_id": t, "selected": t in selected}
                                            for i, (t, _) in enumerate(q.excerpts)],
                               "selected": [{"row": i, "turn_id": t} for i, t in enumerate(selected)], "summaries": []},
                      "excerpts": "\n".join(f"EXCERPT {i} (recorded 8 May 2023): {text}"
                                            for i, (_, text) in enumerate(q.excerpts, start=1)),
                      "retrieval": record})
        packs[-1].update(q.fields)
        packs[-1] = {k: v for k, v in packs[-1].items() if v is not None}
    metrics = summarize(predictions, judge=cfg.eval.judge.enabled, benchmark=benchmark, n_boot=50)
    metrics.update(name=out.name, benchmark=benchmark, method=cfg.method, questions=len(questions),
                   metric_variant="paper")
    (out / "metrics.json").write_text(json.dumps(metrics))
    (out / "predictions.jsonl").write_text("".join(json.dumps(p) + "\n" for p in predictions))
    (out / "packs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in packs))
    (out / "ledger.json").write_text(Ledger().to_json())
    (out / "timings.json").write_text(json.dumps({"load": 1.0, "build": 2.0, "retrieve": 0.5, "answer": 3.0}))
    (out / "DONE").write_text("done\n")
    return out


def pack_texts(run: Path) -> dict[str, Any]:
    """packs.jsonl's rows by question id."""
    return {json.loads(line)["question_id"]: json.loads(line) for line in (run / "packs.jsonl").read_text().splitlines()}


def memfit(args: Sequence[str], shared_data: Path, env: Mapping[str, str] | None = None
           ) -> subprocess.CompletedProcess[str]:
    """`python -m memfit_gpu.cli ARGS` with the echo reader loadable; asserts exit code 0."""
    full = memfit_env(shared_data, plugins="seam_echo_backend", **(env or {}))
    proc = subprocess.run([sys.executable, "-m", "memfit_gpu.cli", *args], env=full, capture_output=True, text=True,
                          timeout=900, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def echo_run(out: Path, store: Path, shared_data: Path, *overrides: str, env: Mapping[str, str] | None = None) -> Path:
    """configs/smoke.yaml with the echo reader on a copy of `store` (OUT-store beside OUT)."""
    copy = out.parent / f"{out.name}-store"
    shutil.copytree(store, copy)
    memfit(["run", "--config", str(SMOKE), "--out", str(out), "--quiet", "reader.backend=echo", f"store.path={copy}",
            *overrides], shared_data, env)
    return out
