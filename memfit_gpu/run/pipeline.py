"""build -> retrieve -> read -> score, resumable.

    memfit run --config configs/memfit.yaml --out runs/x [key=value ...]

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
answers the others, then stops before scoring (`UnansweredError`, exit code 1), and the same command
asks only those again.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from memfit_gpu import faults, provenance
from memfit_gpu.config import MemFitConfig, load_config, to_dict, to_yaml
from memfit_gpu.data import Benchmark, Question, read_benchmark, select_from_config
from memfit_gpu.evaluate import beam as beam_scoring
from memfit_gpu.evaluate import text_metrics
from memfit_gpu.evaluate.judge import (
    empty_verdict,
    is_empty_prediction,
    parse_judge_reply,
)
from memfit_gpu.evaluate.metrics import score_all
from memfit_gpu.evaluate.tables import render_markdown, summarize
from memfit_gpu.files import append_jsonl, atomic_write_text, read_jsonl
from memfit_gpu.index.encoders import TextEncoder, load_bi_encoder
from memfit_gpu.locks import DirectoryBusyError, exclusive, lock_path, lock_wait_s
from memfit_gpu.mappings import flatten
from memfit_gpu.methods.answers import AnswerRequest, answer_requests
from memfit_gpu.methods.base import MethodRun, StageClock
from memfit_gpu.methods.packs import DIAGNOSTICS, questions_of, saved_packs, write_packs
from memfit_gpu.methods.registry import make_method
from memfit_gpu.readers.clean import clean_answer, reply_text
from memfit_gpu.readers.ledger import Ledger, LedgerCheckError
from memfit_gpu.readers.prompts import build_judge_messages
from memfit_gpu.readers.reader import Reader, load_ledger, make_reader
from memfit_gpu.readers.types import Request
from memfit_gpu.report import ReportError, build_report, question_records, question_table, read_run
from memfit_gpu.run.depths import check_depths, render_depths, run_depths
from memfit_gpu.run.growth import check_growth, run_growth
from memfit_gpu.run.inputs import RunInputs, collect, resolve_inputs
from memfit_gpu.run.preflight import check_can_start
from memfit_gpu.run.tracking import Tracker

log = logging.getLogger(__name__)


class RunError(RuntimeError):
    """A run directory that cannot be resumed as asked."""


class UnansweredError(RuntimeError):
    """Questions the reader (or the judge) got no answer for after its retries: every other question is
    answered and saved; the same command asks only these again."""


@contextmanager
def run_lock(out: Path) -> Iterator[None]:
    """Hold the run directory's lock (memfit_gpu.locks) for the whole run: two processes writing one
    directory would duplicate predictions and interleave the store log."""
    try:
        wait_s = lock_wait_s()
    except ValueError as exc:
        raise RunError(str(exc)) from None
    try:
        with exclusive(lock_path(out), "wait for it to end or use another --out directory", wait_s):
            yield
    except DirectoryBusyError as exc:
        raise RunError(str(exc)) from None


class StageTimer(StageClock):
    """Wall time per stage (methods/base.StageClock: nested stages count once), accumulated across resumed
    invocations in timings.json, which is saved after every stage."""

    def __init__(self, path: Path, seconds: dict[str, float] | None = None) -> None:
        super().__init__(seconds, ended=lambda clock: self._save())
        self.path = path

    @classmethod
    def load(cls, path: Path) -> StageTimer:
        seconds = json.loads(path.read_text()) if path.exists() else {}
        return cls(path, {k: float(v) for k, v in seconds.items()})

    def _save(self) -> None:
        if sys.exc_info()[0] is not None:
            # the stage failed: its own failure is what the user must see, not a second one (a full disk) here
            try:
                atomic_write_text(self.path, json.dumps(self.seconds, indent=2))
            except OSError as exc:
                log.warning("%s not updated: %s", self.path, exc)
            return
        atomic_write_text(self.path, json.dumps(self.seconds, indent=2))
        faults.point("timings")


def _check_config(cfg: MemFitConfig, out: Path) -> None:
    """A resumed run must have the configuration it started with: anything else mixes two runs."""
    resolved = out / "config.yaml"
    text = to_yaml(cfg)
    if not resolved.exists():
        atomic_write_text(resolved, text)
        faults.point("config")
        return
    before = load_config(resolved)
    if before != cfg:
        flat_a, flat_b = flatten(to_dict(before)), flatten(to_dict(cfg))
        diff = sorted(k for k in flat_a.keys() | flat_b.keys() if flat_a.get(k) != flat_b.get(k))
        raise RunError(
            f"{out} was started with a different configuration ({', '.join(diff[:8])}"
            f"{' ...' if len(diff) > 8 else ''}); use a new --out directory for a different configuration"
        )


def _question_payload(q: Question) -> dict[str, Any]:
    return {"question_id": q.question_id, "memory_id": q.memory_id, "category": q.category,
            "evaluated": q.evaluated, "question": q.question, "gold": q.answer}


def run(cfg: MemFitConfig, out_dir: str | Path, progress: bool = True,
        allow_provenance_change: bool = False) -> dict[str, Any]:
    """Run (or resume) one configuration into `out_dir`; returns metrics.json's content.

    A resume whose provenance (code, packages, data files, weights, judge, prompts: provenance.CHECKED)
    differs from the record the run started with is refused (RunError naming the field and its file)
    unless `allow_provenance_change`, which records the change in provenance.json."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with run_lock(out):
        if (out / "DONE").exists():
            _check_config(cfg, out)
            log.info("%s is finished (DONE exists): nothing to do", out)
            return json.loads((out / "metrics.json").read_text())
        # before config.yaml: a run refused here leaves the directory free for the corrected one
        check_growth(cfg)
        check_depths(cfg)
        # what the run reads, resolved once, then checked and planned: retrieval where the device plan put it
        # (index.device=auto: off the vLLM engines' GPUs); preflight, provenance and the stages read the record
        inputs = check_can_start(resolve_inputs(cfg))
        # config.yaml keeps the configuration as given, so a resume on another node plans again
        _check_config(cfg, out)
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
        bench = read_benchmark(cfg.data.benchmark, inputs.files)
        selected = select_from_config(bench, cfg.data)
        questions = questions_of(selected)
        if not questions:
            raise RunError(f"no questions selected from {bench.source} (data.* settings leave none)")
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
    except (json.JSONDecodeError, TypeError) as exc:
        raise RunError(f"{ledger_path}: not a ledger memfit wrote ({exc})") from None
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

    judge: _Judge | None = None
    try:
        # the memory system under test (memfit_gpu/methods) makes the packs; answer and score are shared
        method_run = MethodRun(placed, out, bench, selected.memories, questions, reader=get_reader,
                               account=ledger_saved, progress=progress, stage=timer.stage, prompts=prompts)
        packs = _method_packs(out, timer, method_run)

        sbert = text_encode if "sbert" in cfg.eval.text_metrics else None
        with timer.stage("answer"):  # the reader and the judge load here (their time is the answers')
            # one answer builder and one judge for the answers, the growth points and the depths
            make_request = answer_requests(cfg, bench, get_reader(), prompts)
            judge = _Judge(inputs, out, ledger, progress) if inputs.judge is not None else None
            _answer(inputs, out, questions, packs, make_request, get_reader(), judge, ledger, ledger_path, progress,
                    text_encode)

        if cfg.eval.growth_points:  # the same trajectory scored at several memory sizes
            with timer.stage("growth"):
                run_growth(cfg, out, method_run, make_request, ledger_saved, sbert)

        if cfg.eval.pack_cutoffs:  # the paper's Table 10: the same ranking answered at each pack depth
            with timer.stage("depths"):
                run_depths(cfg, out, method_run, packs, make_request, ledger_saved, sbert, judge, bench.name)

        with timer.stage("score"):
            # the weights that embedded (loaded here when a resumed run had answered everything before)
            text_settings = text_metrics.settings(
                cfg.eval.text_metrics, sbert_encoder().info() if "sbert" in cfg.eval.text_metrics else None)
            metrics = _score(inputs, out, bench, questions, ledger, timer, record, text_settings)
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




def _answer(inputs: RunInputs, out: Path, questions: list[Question], packs: dict[str, dict[str, Any]],
            make_request: AnswerRequest, reader: Reader, judge: _Judge | None, ledger: Ledger, ledger_path: Path,
            progress: bool, text_encode: Callable[[list[str]], Any] | None = None) -> None:
    """One answer call per question, appended to predictions.jsonl a batch at a time.

    Every unanswered question is offered to the reader at once (`Reader.generate_batches`): a server
    keeps as many requests in flight as it allows, and reader.flush_every only sets how many answers
    are committed together. The judge runs on its own thread behind the answers, a batch at a time, so
    the reader never waits for it. Per batch: the reader has committed its calls to the response cache,
    the ledger is saved, then the rows (with their verdicts) are appended, in batch order. A kill before
    the rows are complete loses only rows the rerun re-serves from the cache, which the ledger does not
    count twice (Ledger.accounted_keys). A question that got no answer or no verdict (a server's failures
    after its retries) gets no row; once the others are written, UnansweredError counts them."""
    cfg = inputs.cfg

    def request_for(q: Question) -> tuple[Request, dict[str, int]]:
        return make_request(q, packs[q.question_id])

    pred_path = out / "predictions.jsonl"
    answered = {r["question_id"]: r for r in read_jsonl(pred_path)}
    todo = [q for q in questions if q.question_id not in answered]
    if answered:
        log.info("answer: %d questions already answered, %d to go", len(answered), len(todo))
    _account_answered(out, [q for q in questions if q.question_id in answered], answered, reader, request_for,
                      ledger, ledger_path)
    judging = ThreadPoolExecutor(max_workers=1, thread_name_prefix="judge") if judge is not None else None
    waiting: deque[tuple[list[dict[str, Any]], Future[list[dict[str, Any] | None]] | None]] = deque()
    bar = tqdm(total=len(questions), initial=len(answered), desc="answer", unit="q", disable=not progress)

    unanswered: list[tuple[str, str]] = []  # (question id, why): no answer or no verdict came back

    def write(rows: list[dict[str, Any]], verdicts: Future[list[dict[str, Any] | None]] | None) -> None:
        if verdicts is not None:
            for row, verdict in zip(rows, verdicts.result(), strict=True):
                row["judge"] = verdict
            unanswered.extend((row["question_id"], "the judge gave no verdict") for row in rows if row["judge"] is None)
            rows = [row for row in rows if row["judge"] is not None]
        ledger.save(ledger_path)
        faults.point("answer.ledger")
        append_jsonl(pred_path, rows)
        faults.point("predictions")
        bar.update(len(rows))

    try:
        requests, prompt_cuts = zip(*[request_for(q) for q in todo], strict=True) if todo else ((), ())
        for batch in reader.generate_batches(list(requests), max(1, cfg.reader.flush_every)):
            unanswered.extend((todo[i].question_id, str(r.error)) for i, r in batch if not r.answered)
            batch = [(i, r) for i, r in batch if r.answered]
            if not batch:
                continue
            chunk = [todo[i] for i, _ in batch]
            responses = [response for _, response in batch]
            cleaned = [clean_answer(r.text) for r in responses]
            scores = score_all([c.text for c in cleaned], [q.answer for q in chunk], [q.category for q in chunk],
                               cfg.eval.metrics)
            # ROUGE-L / ROUGE-2 / METEOR / SBERT when eval.text_metrics asks (one encoder pass a batch)
            texts = (text_metrics.text_scores([c.text for c in cleaned], [q.answer for q in chunk],
                                              cfg.eval.text_metrics, text_encode)
                     if cfg.eval.text_metrics else [None] * len(chunk))
            rows = []
            for (i, resp), q, clean, score, text in zip(batch, chunk, cleaned, scores, texts, strict=True):
                rows.append({**_question_payload(q), "prediction": clean.text, "raw_output": resp.text,
                             "abstained": clean.abstained, "scores": score,
                             **({"text_scores": text} if text is not None else {}), "judge": None,
                             "retrieval": packs[q.question_id].get("retrieval"), **prompt_cuts[i],
                             # a method's own record of the context it built (full_context: its truncation)
                             **({"method_notes": packs[q.question_id]["method_notes"]}
                                if "method_notes" in packs[q.question_id] else {}),
                             # what the reader had to change (truncated tokens, dropped images) or why
                             # this answer alone failed (empty prediction, scored as such)
                             "reader_notes": resp.notes, "reader_error": resp.error})
            verdicts = (judging.submit(judge, chunk, [c.text for c in cleaned], [r.text for r in responses])
                        if judging and judge else None)
            waiting.append((rows, verdicts))
            while waiting and (waiting[0][1] is None or waiting[0][1].done()):
                write(*waiting.popleft())
        while waiting:
            write(*waiting.popleft())
        bar.close()
        if unanswered:
            raise UnansweredError(
                f"{len(unanswered)} of {len(questions)} questions got no answer (first: {unanswered[0][0]}: "
                f"{unanswered[0][1]}); the other answers are in {pred_path}: rerun the same command to ask only these "
                f"again")
    finally:
        if judging is not None:
            judging.shutdown(wait=True, cancel_futures=True)


def _account_answered(out: Path, questions: list[Question], answered: dict[str, dict[str, Any]], reader: Reader,
                      request_for: Callable[[Question], tuple[Request, dict[str, int]]], ledger: Ledger,
                      ledger_path: Path) -> None:
    """Put predictions the ledger does not account for on its books, from the response cache.

    Only a directory an older memfit left (it appended predictions before saving the ledger, and was
    killed in between) or one whose ledger.json was removed has them. Their rows stay as they are; the
    re-served cached text must be the row's raw output, else the row did not come from this run."""
    accounted = set(ledger.answer_keys)
    missing = [q for q in questions if q.question_id not in accounted]
    if not missing:
        return
    log.warning("%s: %d predictions have no answer call in %s: accounting them from the response cache",
                out / "predictions.jsonl", len(missing), ledger_path)
    for q, response in zip(missing, reader.generate([request_for(q)[0] for q in missing]), strict=True):
        raw_output = answered[q.question_id]["raw_output"]
        if response.cached and response.text != raw_output:
            raise RunError(f"{out / 'predictions.jsonl'}: question {q.question_id}: raw_output {raw_output!r} is not "
                           f"the answer cache.sqlite holds for it ({response.text!r}); the row is not from this run")
        if not response.cached:
            log.warning("%s: question %s was not in the response cache: answered again to account for it "
                        "(the prediction keeps its first answer)", out / "predictions.jsonl", q.question_id)
    ledger.save(ledger_path)


class _Judge:
    """LLM judge over a chunk of answers, through its own cached reader (role judge).

    eval.judge.prompt auto = the benchmark's judge: MemGallery's graded prompt, LongMemEval's per-type
    yes/no prompts (abstention for `_abs`), BEAM's rubric judge (evaluate/beam.py: several calls a question, on
    the reply as the reader wrote it), the paper's CORRECT/WRONG judge otherwise."""

    def __init__(self, inputs: RunInputs, out: Path, ledger: Ledger, progress: bool):
        prompts = inputs.prompts
        assert inputs.judge is not None and inputs.judge_kind is not None and prompts is not None, \
            "a judge for a run without one"
        self.kind = inputs.judge_kind
        self.memgallery_dir = prompts.memgallery_dir
        self.beam = None
        if self.kind == "beam":
            assert prompts.beam is not None, "BEAM's judge without BEAM's prompts (resolve_inputs finds them)"
            self.beam = beam_scoring.BeamJudge(prompts.beam, inputs.cfg.eval.beam)
        self.reader = make_reader(inputs.judge, out, ledger=ledger, progress=progress)

    def __call__(self, questions: list[Question], predictions: list[str],
                 raw_outputs: list[str] | None = None) -> list[dict[str, Any] | None]:
        """One verdict per question; None where the judge got no answer (a rerun asks it again). BEAM's judge
        reads `raw_outputs` (code fences and lists are what it judges), the others the cleaned predictions."""
        if self.beam is not None:
            replies = raw_outputs if raw_outputs is not None else predictions
            items = [beam_scoring.BeamItem(f"judge:{q.question_id}", q.question, q.category,
                                           list(q.extra.get("rubric") or []), reply_text(reply))
                     for q, reply in zip(questions, replies, strict=True)]
            return self.beam.score(items, lambda requests: self.reader.generate(requests, partial=True))
        verdicts: list[dict[str, Any] | None] = [None] * len(questions)
        requests, where = [], []
        for i, (q, pred) in enumerate(zip(questions, predictions, strict=True)):
            if is_empty_prediction(pred):
                verdicts[i] = empty_verdict()
                continue
            messages = build_judge_messages(q.question, q.answer, pred, q.category, self.kind,
                                            memgallery_dir=self.memgallery_dir, abstention=q.abstention)
            requests.append(Request(messages, role="judge", key=f"judge:{q.question_id}", owner=q.memory_id))
            where.append(i)
        for i, resp in zip(where, self.reader.generate(requests, partial=True) if requests else [], strict=True):
            if resp.answered:
                verdicts[i] = parse_judge_reply(resp.text, kind=self.kind, strict=False)
        return verdicts

    def close(self) -> None:
        self.reader.close()


def _beam_references(questions: list[Question]) -> dict[str, bool]:
    """Per ability, whether its gold texts are reference answers (BEAM's loader says per question)."""
    references: dict[str, bool] = {}
    for q in questions:
        references[q.category] = references.get(q.category, True) and bool(q.extra.get("reference_answer", True))
    return references


def _score(inputs: RunInputs, out: Path, bench: Benchmark, questions: list[Question], ledger: Ledger,
           timer: StageTimer, record: dict[str, Any], text_settings: dict[str, Any] | None = None) -> dict[str, Any]:
    cfg = inputs.cfg
    rows = read_jsonl(out / "predictions.jsonl")
    by_id: dict[str, dict[str, Any]] = {}
    for row in rows:
        if row["question_id"] in by_id:
            raise RunError(f"{out / 'predictions.jsonl'}: question {row['question_id']} appears twice")
        by_id[row["question_id"]] = row
    missing = [q.question_id for q in questions if q.question_id not in by_id]
    if missing:
        raise RunError(f"{out / 'predictions.jsonl'}: {len(missing)} questions have no prediction: {missing[:10]}")
    try:
        ledger.check_one_answer_per_question([q.question_id for q in questions])
    except LedgerCheckError as exc:
        raise RunError(f"{out / 'ledger.json'}: {exc}") from None
    ordered = [by_id[q.question_id] for q in questions]
    metrics = summarize(ordered, variant=cfg.eval.table_metric, judge=inputs.judge is not None, benchmark=bench.name,
                        n_boot=cfg.eval.bootstrap_samples, seed=cfg.eval.seed)
    metrics["name"] = cfg.name
    metrics["benchmark"] = bench.name
    metrics["method"] = cfg.method
    metrics["questions"] = len(questions)
    metrics["metric_variant"] = cfg.eval.table_metric
    metrics["retrieval"] = json.loads((out / DIAGNOSTICS).read_text())
    # what ranked the candidates, as the method recorded it (a method without a reranker: backend none)
    metrics["reranker"] = metrics["retrieval"].get("reranker", {"backend": "none"})
    metrics["timings"] = dict(timer.seconds)
    metrics["ledger"] = {"answer_calls": ledger.roles["answer"].calls + ledger.roles["answer"].cached}
    if cfg.eval.text_metrics and text_settings is not None:
        metrics["text_metrics"] = text_settings
    if (out / "growth.json").is_file():
        metrics["growth"] = json.loads((out / "growth.json").read_text())
    if cfg.eval.pack_cutoffs:
        metrics["depths"] = json.loads((out / "depths.json").read_text())
    if inputs.judge_kind == "beam":
        # BEAM's per-ability table (its paper's layout), from the rubric scores; memfit's table follows it
        metrics["beam"] = beam_scoring.summary(ordered, cfg.eval.table_metric, _beam_references(questions))
        metrics["beam"]["scoring"] = to_dict(cfg)["eval"]["beam"]
    atomic_write_text(out / "metrics.json", json.dumps(metrics, indent=2))
    faults.point("metrics")
    ledger.save(out / "ledger.json")
    faults.point("score.ledger")
    table = render_markdown(metrics, benchmark=bench.name) + "\n" + provenance.markdown_block(record)
    if "beam" in metrics:
        table = beam_scoring.render_table(metrics["beam"], metrics["beam"]["scoring"]) + "\n" + table
    if "depths" in metrics:
        table += "\n" + render_depths(metrics["depths"])
    atomic_write_text(out / "results.md", table)
    faults.point("results")
    return metrics
