"""The answer stage of `memfit run`: one answer call per question, judged behind the answers, appended to
DIR/predictions.jsonl a batch at a time; and `Answering`, which answers and scores as the run does for the
answers, the growth points and the pack depths alike.

    judge = RunJudge(inputs, out, ledger, progress)     the run's judge (eval.judge), on its own cached reader
    answering = Answering(cfg.eval, make_request, reader, account, text_encode, judge, benchmark=cfg.data.benchmark)
    answer_questions(inputs, out, questions, packs, answering, progress)

Write order per batch (pipeline.py says why): the reader commits its calls to the response cache, the ledger
is saved, then the rows with their verdicts are appended. A question that got no answer or no verdict gets no
row; once the others are written, UnansweredError counts them and the same command asks only those again.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from memfit_gpu import faults
from memfit_gpu.config import EvalConfig
from memfit_gpu.data import Question
from memfit_gpu.evaluate import beam as beam_scoring
from memfit_gpu.evaluate import text_metrics
from memfit_gpu.evaluate.judge import (
    empty_verdict,
    is_empty_prediction,
    parse_judge_reply,
)
from memfit_gpu.evaluate.metrics import rule_category, score_all
from memfit_gpu.files import append_jsonl, read_jsonl
from memfit_gpu.methods.answers import AnswerRequest
from memfit_gpu.readers.clean import clean_answer, reply_text
from memfit_gpu.readers.ledger import Ledger
from memfit_gpu.readers.prompts import build_judge_messages
from memfit_gpu.readers.reader import Reader, make_reader
from memfit_gpu.readers.types import Request, Response
from memfit_gpu.run.directory import RunError
from memfit_gpu.run.inputs import RunInputs

log = logging.getLogger(__name__)


class UnansweredError(RuntimeError):
    """Questions the reader (or the judge) got no answer for after its retries: every other question is
    answered and saved; the same command asks only these again."""


def _question_payload(q: Question) -> dict[str, Any]:
    return {"question_id": q.question_id, "memory_id": q.memory_id, "category": q.category,
            "evaluated": q.evaluated, "question": q.question, "gold": q.answer}


@dataclass(frozen=True)
class Answered:
    """One question's answer as the run scores it: the reader's response, the cleaned prediction and its scores."""
    response: Response
    prediction: str  # the reply as cleaned (readers/clean.py): what the metrics and the judge read
    abstained: bool
    scores: dict[str, Any]  # per eval.metrics variant: F1 and BLEU-1
    text_scores: dict[str, float] | None  # eval.text_metrics; None when it asks for none
    cut: dict[str, int]  # what the prompt bound cut from the request ({} when nothing)

    def text_fields(self) -> dict[str, Any]:
        """The row's `text_scores`, present only when eval.text_metrics asks for some."""
        return {"text_scores": self.text_scores} if self.text_scores is not None else {}


@dataclass
class Answering:
    """Answers questions on their packs and scores them as the run scores: one for the answers, the growth
    points and the pack depths, so all three build the same requests, clean and score the same way, and
    judge with the same judge.

    account(point): saves the ledger, then passes the named kill point (the pipeline's `ledger_saved`)."""
    eval: EvalConfig
    make_request: AnswerRequest
    reader: Reader
    account: Callable[[str], None]
    text_encode: Callable[[list[str]], Any] | None = None  # the run's bi-encoder, for eval.text_metrics sbert
    judge: RunJudge | None = None
    # the benchmark scored (data.benchmark): the locomo variant's category rules are LoCoMo's own (rule_category)
    benchmark: str = field(kw_only=True)  # required: each caller says which benchmark it scores

    def scored(self, questions: Sequence[Question], responses: Sequence[Response],
               cuts: Sequence[dict[str, int]]) -> list[Answered]:
        """The responses cleaned and scored: eval.metrics per variant, and eval.text_metrics (one encoder pass)."""
        cleaned = [clean_answer(r.text) for r in responses]
        predictions = [c.text for c in cleaned]
        golds = [q.answer for q in questions]
        categories = [rule_category(q.category, self.benchmark) for q in questions]
        scores = score_all(predictions, golds, categories, self.eval.metrics)
        texts: Sequence[dict[str, float] | None] = (
            text_metrics.text_scores(predictions, golds, self.eval.text_metrics, self.text_encode)
            if self.eval.text_metrics else [None] * len(questions))
        return [Answered(response, clean.text, clean.abstained, score, text, cut)
                for response, clean, score, text, cut in zip(responses, cleaned, scores, texts, cuts, strict=True)]

    def answer(self, questions: Sequence[Question], packs: Sequence[dict[str, Any]], role: str,
               key: Callable[[Question], str], point: str) -> list[Answered]:
        """One answer call per question on its pack (role `role`, ledger key `key(question)`), the ledger saved
        (kill point `point`), then scored."""
        built = [self.make_request(q, pack, role=role, key=key(q)) for q, pack in zip(questions, packs, strict=True)]
        responses = self.reader.generate([request for request, _ in built])
        self.account(point)
        return self.scored(questions, responses, [cut for _, cut in built])

    def verdicts(self, questions: Sequence[Question], answered: Sequence[Answered]) -> list[dict[str, Any] | None]:
        """The judge's verdict per answer (None throughout when the run has no judge)."""
        if self.judge is None:
            return [None] * len(questions)
        return self.judge(list(questions), [a.prediction for a in answered], [a.response.text for a in answered])


def answer_questions(inputs: RunInputs, out: Path, questions: list[Question], packs: dict[str, dict[str, Any]],
                     answering: Answering, progress: bool) -> None:
    """One answer call per question, appended to predictions.jsonl a batch at a time.

    Every unanswered question is offered to the reader at once (`Reader.generate_batches`): a server
    keeps as many requests in flight as it allows, and reader.flush_every sets how many answers are
    committed together (an in-process backend also generates that many per call, so with a bf16 reader
    another flush_every can change greedy answers: config.yaml keeps it, and a resume uses it). The judge runs on its own thread behind the answers, a batch at a time, so
    the reader never waits for it. Per batch: the reader has committed its calls to the response cache,
    the ledger is saved, then the rows (with their verdicts) are appended, in batch order. A kill before
    the rows are complete loses only rows the rerun re-serves from the cache, which the ledger does not
    count twice (Ledger.accounted_keys). A question that got no answer or no verdict (a server's failures
    after its retries) gets no row; once the others are written, UnansweredError counts them."""
    cfg = inputs.cfg
    reader, judge = answering.reader, answering.judge

    def request_for(q: Question) -> tuple[Request, dict[str, int]]:
        return answering.make_request(q, packs[q.question_id])

    pred_path = out / "predictions.jsonl"
    answered = {r["question_id"]: r for r in read_jsonl(pred_path)}
    todo = [q for q in questions if q.question_id not in answered]
    if answered:
        log.info("answer: %d questions already answered, %d to go", len(answered), len(todo))
    _account_answered(out, [q for q in questions if q.question_id in answered], answered, reader, request_for)
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
        answering.account("answer.ledger")
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
            # scored as every answer of the run is (ROUGE-L / METEOR / SBERT too when eval.text_metrics asks)
            scored = answering.scored(chunk, [response for _, response in batch], [prompt_cuts[i] for i, _ in batch])
            rows = []
            for q, a in zip(chunk, scored, strict=True):
                pack = packs[q.question_id]
                rows.append({**_question_payload(q), "prediction": a.prediction, "raw_output": a.response.text,
                             "abstained": a.abstained, "scores": a.scores, **a.text_fields(), "judge": None,
                             "retrieval": pack.get("retrieval"), **a.cut,
                             # a method's own record of the context it built (full_context: its truncation)
                             **({"method_notes": pack["method_notes"]} if "method_notes" in pack else {}),
                             # what the reader had to change (truncated tokens, dropped images) or why
                             # this answer alone failed (empty prediction, scored as such)
                             "reader_notes": a.response.notes, "reader_error": a.response.error})
            verdicts = judging.submit(answering.verdicts, chunk, scored) if judging else None
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
                      request_for: Callable[[Question], tuple[Request, dict[str, int]]]) -> None:
    """Put predictions the ledger does not account for on its books, from the response cache.

    Only a directory an older memfit left (it appended predictions before saving the ledger, and was
    killed in between) or one whose ledger.json was removed has them. Their rows stay as they are; the
    re-served cached text must be the row's raw output, else the row did not come from this run."""
    ledger, ledger_path = reader.ledger, out / "ledger.json"
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


class RunJudge:
    """LLM judge over a chunk of answers, through its own cached reader (role judge).

    eval.judge.prompt auto = the benchmark's judge: MemGallery's graded prompt, LongMemEval's per-type
    CORRECT/WRONG prompts (abstention for `_abs`), BEAM's rubric judge (evaluate/beam.py: several calls a question, on
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
