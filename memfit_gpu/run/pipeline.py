"""build -> retrieve -> read -> score, resumable.

    memfit run --config configs/memfit.yaml --out runs/x [key=value ...]

The stages in order, each in its module: the inputs resolved and checked (inputs.py, preflight.py), the run
directory's lock, config.yaml and timings (directory.py), the questions selected from the benchmark (preflight
read it for the device plan) and the provenance recorded,
the method's build and retrieve (packs.jsonl), the answers with the judge behind them (answer.py), the growth
points and pack depths when asked (growth.py, depths.py), the scores (score.py), W&B (tracking.py), DONE.

A run directory holds everything a run made (docs/concepts/design.md "Run directory"). Every stage leaves its
result on disk before the next starts, and a rerun with the same directory picks up where it stopped:
the store reopens (no re-encoding), summaries and answers come from the response cache (no repeat LLM
call), predictions are appended per batch and never duplicated, and `DONE` marks a finished run, which
a rerun only reports. One process writes a directory at a time (an exclusive lock on `DIR/.lock`), and
a directory started with another configuration, finished or not, is refused.

Write order, so that a kill anywhere leaves a state the rerun completes to the same results: the
response cache commits each group of calls together with their ledger entries, then `ledger.json`
reports the ledger, then the predictions are appended; a rerun rebuilds the ledger from the cache's
entries (`load_ledger`), re-serves a lost prediction from the cache and does not count it again. Every
durable write is a `faults.point`, where tests kill runs (tests/run/test_run_crash_consistency.py).

A question whose answer (or verdict) a server never gave after its retries gets no row: the run
answers the others, then stops before scoring (answer.py `UnansweredError`, exit code 1), and the same command
asks only those again.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from memfit_gpu import faults, provenance
from memfit_gpu.config import MemFitConfig
from memfit_gpu.data.schema import DataError
from memfit_gpu.evaluate import text_metrics
from memfit_gpu.files import atomic_write_text, read_json_object, read_jsonl
from memfit_gpu.index.encoders import TextEncoder, load_bi_encoder
from memfit_gpu.methods.answers import answer_requests
from memfit_gpu.methods.base import MethodRun
from memfit_gpu.methods.packs import questions_of, saved_packs, write_packs
from memfit_gpu.methods.registry import make_method
from memfit_gpu.readers.reader import Reader, load_ledger, make_reader
from memfit_gpu.report import ReportError, build_report, question_records, question_table, read_run
from memfit_gpu.run.answer import Answering, RunJudge, answer_questions
from memfit_gpu.run.depths import run_depths
from memfit_gpu.run.directory import RunError, StageTimer, record_config, refuse_foreign, run_lock
from memfit_gpu.run.growth import run_growth
from memfit_gpu.run.inputs import RunInputs, collect, resolve_inputs
from memfit_gpu.run.preflight import check_can_start
from memfit_gpu.run.score import score_run
from memfit_gpu.run.tracking import Tracker

log = logging.getLogger(__name__)


def run(cfg: MemFitConfig, out_dir: str | Path, progress: bool = True,
        allow_provenance_change: bool = False) -> dict[str, Any]:
    """Run (or resume) one configuration into `out_dir`; returns metrics.json's content.

    A resume whose provenance (code, packages, data files, weights, judge, prompts: provenance.CHECKED)
    differs from the record the run started with is refused (RunError naming the field and its file)
    unless `allow_provenance_change`, which records the change in provenance.json."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with run_lock(out):
        refuse_foreign(out)  # a live memory's folder: its users' store is no experiment's
        if (out / "DONE").exists():
            record_config(cfg, out)
            log.info("%s is finished (DONE exists): nothing to do", out)
            return read_json_object(out / "metrics.json")  # DataError naming it when damaged
        # what the run reads, resolved once, then checked and planned: retrieval where the device plan put it
        # (index.device=auto: off the vLLM engines' GPUs); preflight, provenance and the stages read the record.
        # Before config.yaml: a run refused here leaves the directory free for the corrected one.
        inputs = resolve_inputs(cfg)
        with inputs.in_force():  # the weights found here are the ones every stage loads
            inputs = check_can_start(inputs)
            # config.yaml keeps the configuration as given, so a resume on another node plans again
            record_config(cfg, out)
            return _run_locked(inputs, out, progress, allow_provenance_change)


def _run_locked(inputs: RunInputs, out: Path, progress: bool, allow_provenance_change: bool) -> dict[str, Any]:
    timer = StageTimer.load(out / "timings.json")
    tracker = Tracker.start(inputs.cfg, out)
    try:
        metrics = _run_stages(inputs, out, timer, progress, tracker, allow_provenance_change)
        tracker.log_timings(timer.seconds)
        tracker.log_metrics({k: v for k, v in metrics.items() if k in ("overall", "average", "retrieval")})
        tracker.log_predictions(read_jsonl(out / "predictions.jsonl"), out / "predictions.jsonl")
        if tracker.enabled:
            _log_report(tracker, out)
    finally:
        tracker.finish()
    atomic_write_text(out / "DONE", time.strftime("%Y-%m-%dT%H:%M:%S") + "\n")
    faults.point("DONE")
    return metrics


def _log_report(tracker: Tracker, out: Path) -> None:
    """The W&B run gets `memfit report`'s per-question table (the viewer's records: outcome, evidence ranks, pack
    hit) and the report of this run (DIR/report.html) as an artifact. The run's results are complete by now, so
    a report that cannot be made is a warning, not a failed run."""
    try:
        report = build_report([out], out / "report.html")
        tracker.log_table("questions", *question_table(question_records(read_run(out, out.name))))
    except ReportError as exc:
        log.warning("W&B gets no report of %s: %s", out, exc)
        return
    tracker.log_files("report", [report.path])


def _run_stages(inputs: RunInputs, out: Path, timer: StageTimer, progress: bool, tracker: Tracker,
                allow_provenance_change: bool) -> dict[str, Any]:
    """The stages, on inputs.placed: the config with index.device where the device plan put retrieval (encoders,
    BM25)."""
    cfg, placed, prompts = inputs.cfg, inputs.placed, inputs.prompts
    assert prompts is not None, "a run's inputs resolved without readers"
    with timer.stage("load"):
        bench, selected = inputs.benchmark, inputs.selected  # read and selected once, by preflight (the device plan)
        assert bench is not None and selected is not None, "a run's inputs not checked by preflight"
        questions = questions_of(selected)  # preflight refused a selection without any
        log.info("run: %s, %d memories, %d questions -> %s", bench.name, len(selected.memories), len(questions), out)
        # before any LLM call: what makes this run's numbers, compared on every resume
        record = collect(inputs, selected)  # the encoders' dtype as resolved where the plan put them
        if not (out / provenance.FILE).exists() and (out / "predictions.jsonl").exists():
            log.warning("%s: a directory started by a memfit that recorded no provenance: recorded now, after its "
                        "first answers (recorded_late)", out)
            record["recorded_late"] = True
        try:
            record = provenance.reconcile(out, record, allow_provenance_change)
        except provenance.ProvenanceError as exc:
            raise RunError(str(exc)) from None
        tracker.log_provenance(record)

    ledger_path = out / "ledger.json"
    try:
        ledger = load_ledger(out)  # from the entries cache.sqlite committed with the responses
    except DataError as exc:  # names ledger.json and the field
        raise RunError(f"{exc}: not a ledger memfit wrote (delete it: the counts are rebuilt from cache.sqlite)") \
            from None
    reader: Reader | None = None

    def get_reader() -> Reader:
        nonlocal reader
        if reader is None:
            reader = make_reader(cfg.reader, out, ledger=ledger, progress=progress)
        return reader

    def ledger_saved(point: str) -> None:
        ledger.save(ledger_path)
        faults.point(point)

    text_encoder: TextEncoder | None = None

    def sbert_encoder() -> TextEncoder:
        """The run's bi-encoder for the SBERT text metric (eval.text_metrics), loaded on first use."""
        nonlocal text_encoder
        if text_encoder is None:
            text_encoder = load_bi_encoder(placed.index)
        return text_encoder

    def text_encode(texts: list[str]) -> Any:
        return sbert_encoder().encode(texts, batch_size=cfg.index.encode_batch_size)

    judge: RunJudge | None = None
    try:
        # the memory system under test (memfit_gpu/methods) makes the packs; answer and score are shared
        method_run = MethodRun(placed, out, bench, selected.memories, questions, reader=get_reader,
                               account=ledger_saved, progress=progress, stage=timer.stage, prompts=prompts)
        packs = _method_packs(out, timer, method_run)

        with timer.stage("answer"):  # the reader's and the judge's models load with their first uncached call
            # one answer builder, scoring and judge for the answers, the growth points and the depths
            make_request = answer_requests(cfg, bench, get_reader(), prompts)
            judge = RunJudge(inputs, out, ledger, progress) if inputs.judge is not None else None
            answering = Answering(cfg.eval, make_request, get_reader(), ledger_saved, text_encode, judge,
                                  benchmark=bench.name)
            answer_questions(inputs, out, questions, packs, answering, progress)

        if cfg.eval.growth_points:  # the same trajectory scored at several memory sizes
            with timer.stage("growth"):
                run_growth(out, method_run, answering)

        if cfg.eval.pack_cutoffs:  # the paper's Table 10: the same ranking answered at each pack depth
            with timer.stage("depths"):
                run_depths(out, method_run, packs, answering, bench.name)

        with timer.stage("score"):
            # the weights that embedded (loaded here when a resumed run had answered everything before)
            text_settings = text_metrics.settings(
                cfg.eval.text_metrics, sbert_encoder().info() if "sbert" in cfg.eval.text_metrics else None)
            metrics = score_run(inputs, out, bench, questions, ledger, timer.seconds, record, text_settings)
    finally:
        if judge is not None:
            judge.close()
        if reader is not None:
            reader.close()
        if text_encoder is not None and hasattr(text_encoder, "close"):
            text_encoder.close()
    return metrics


def _method_packs(out: Path, timer: StageTimer, run: MethodRun) -> dict[str, dict[str, Any]]:
    """packs.jsonl + diagnostics.json, made once by the configured method (its write-time work in stage
    build, less any stage of its own such as summaries, then its packs in stage retrieve) and written
    atomically: a resumed run that finds them complete reuses them (same excerpts, same prompts) and runs
    neither step."""
    saved = saved_packs(out, run.questions)
    if saved is not None:
        return saved
    method = make_method(run.cfg.method)
    try:
        with timer.stage("build"):
            method.write(run)
        with timer.stage("retrieve"):
            rows, diagnostics = method.read(run)
    finally:
        method.close()
    return write_packs(out, rows, diagnostics)
