"""`memfit judge-audit RUN_DIR`: how far a finished run's judge can be trusted, on the run's own questions.

For every scored question (predictions.jsonl rows with `evaluated` true) the run's judge (eval.judge: its
backend, model and prompt, through the run's response cache) is asked about answers whose truth is known:

    gold        the question's gold answer                                   should be accepted
    other_gold  another scored question's gold answer of the same category   should be rejected
    perturbed   the gold answer with its first date or number changed        should be rejected
    negated     the gold answer negated, where that is simple (yes <-> no, an auxiliary verb + not)
                                                                             should be rejected
    decline     "I don't know."                                              should be rejected

(an abstention question, whose right answer is to decline, gets the gold and the decline, both to be
accepted: `decline_abstention`). A kind that does not apply to a question (no other gold in its category,
no number or date to change, nothing simple to negate) is not asked. Per category the audit reports the
accept rate on gold (true-accept), on each kind of wrong answer (false-accept) and on all of them pooled,
and how often the judge's verdict on the run's own predictions agrees with token F1 >= 0.5 (the run's
eval.table_metric variant). A reply that states no verdict (evaluate/judge.py's JudgeParseError) counts as
not accepted and is counted as unparsed; a request the backend failed is counted as an error and left out
of the rates (a rerun asks it again).

Deterministic given the seed (eval.seed, or --seed): each question's draws come from its own generator
seeded with "<seed>:<question_id>", and the judge runs greedy. Every call goes through the run's reader
cache (cache.sqlite) and is counted in its ledger.json under role judge (phase eval); a killed audit reruns
from the cache. Writes RUN_DIR/judge_audit.json (every probe with its outcome) and judge_audit.md.

BEAM's judge (evaluate/beam.py) scores a candidate with several calls (one per rubric item, event ordering's
matcher); a candidate is accepted when its score reaches eval.beam.accept_at, unparsed when it is not and
some rubric reply held no score. The run's own predictions are judged on the reply as the reader wrote it,
as the run's judge read them, under the run's keys (the same calls, served from its cache).
"""

from __future__ import annotations

import logging
import random
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memfit_gpu import faults, provenance
from memfit_gpu.config import MemFitConfig
from memfit_gpu.data import Question, read_benchmark, select_from_config
from memfit_gpu.evaluate.beam import BeamItem, BeamJudge
from memfit_gpu.evaluate.compare import PredictionsError, read_predictions
from memfit_gpu.evaluate.judge import (
    JudgeParseError,
    is_empty_prediction,
    parse_judge_reply,
)
from memfit_gpu.evaluate.metrics import paper_tokens, rule_category, score
from memfit_gpu.evaluate.tables import category_name, category_order
from memfit_gpu.files import atomic_write_text, write_json_atomic
from memfit_gpu.locks import DirectoryBusyError, exclusive, lock_path, lock_wait_s
from memfit_gpu.months import MONTH_NAMES
from memfit_gpu.readers.clean import reply_text
from memfit_gpu.readers.ledger import Ledger
from memfit_gpu.readers.prompts import build_judge_messages
from memfit_gpu.readers.reader import make_reader
from memfit_gpu.readers.types import Request, Response
from memfit_gpu.render import markdown_table
from memfit_gpu.run.directory import run_config
from memfit_gpu.run.inputs import RunInputs, data_record, judge_record, model_record, resolve_inputs
from memfit_gpu.run.preflight import check_judge_can_start

log = logging.getLogger(__name__)

REPORT_JSON = "judge_audit.json"
REPORT_MD = "judge_audit.md"
DECLINE = "I don't know."
AGREEMENT_F1 = 0.5
PROBES: dict[str, str] = {
    "gold": "the question's gold answer (should be accepted: true-accept)",
    "other_gold": "another scored question's gold answer of the same category (should be rejected)",
    "perturbed": "the gold answer with its first date or number changed (should be rejected)",
    "negated": "the gold answer negated where that is simple (should be rejected)",
    "decline": f"{DECLINE!r} (should be rejected)",
    "decline_abstention": f"{DECLINE!r} on an abstention question (should be accepted)",
}
WRONG = ("other_gold", "perturbed", "negated")
OUTCOMES = ("accepted", "rejected", "unparsed", "error")
_WEEKDAYS = ("monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday")
_NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
                 "twelve")
_TITLED = "|".join(w.title() for w in (*MONTH_NAMES, *_WEEKDAYS))
# month and weekday names only capitalised (a date; "may" is a verb), number words in any case
_PERTURBABLE = re.compile(rf"\b(?:(?P<name>(?-i:{_TITLED}))|(?P<digits>\d+)|(?P<word>{'|'.join(_NUMBER_WORDS)}))\b",
                          re.IGNORECASE)
_FLIP = {"yes": "no", "no": "yes", "true": "false", "false": "true"}
_LEADING_YES_NO = re.compile(r"^(?P<lead>(?:likely|probably|definitely|maybe)\s+)?(?P<word>yes|no|true|false)\b",
                             re.IGNORECASE)
_CONTRACTED = {"can't": "can", "won't": "will", "don't": "do", "doesn't": "does", "didn't": "did", "isn't": "is",
               "aren't": "are", "wasn't": "was", "weren't": "were"}
_NEGATIVE = re.compile(r"\b(?:not\s+|(?P<short>" + "|".join(re.escape(k) for k in _CONTRACTED) + r"))", re.IGNORECASE)
_AUXILIARY = re.compile(r"\b(is|are|was|were|can|will|would|could|should|does|did|do)\b", re.IGNORECASE)


class AuditError(ValueError):
    """A run directory the audit cannot use as asked (exit code 2)."""


@dataclass(frozen=True)
class Probe:
    question_id: str
    category: str
    kind: str  # a PROBES key, or "prediction" (the run's own answer, for the agreement with F1)
    candidate: str
    expected: bool | None  # accepting it is right (None: the run's prediction, judged against F1)
    f1: float | None = None


def _cased(word: str, like: str) -> str:
    return word.title() if like[:1].isupper() else word


def perturb(text: str, rng: random.Random) -> str | None:
    """`text` with its first month or weekday name, number or number word changed (a year by 1 to 3), or
    None when it holds none."""
    match = _PERTURBABLE.search(text)
    if match is None:
        return None
    found = match.group(0)
    if match.group("name"):
        names = MONTH_NAMES if found.lower() in MONTH_NAMES else _WEEKDAYS
        new = _cased(rng.choice([n for n in names if n != found.lower()]), found)
    elif match.group("digits"):
        value = int(found)
        if len(found) == 4 and 1900 <= value <= 2100:
            value += rng.choice((-3, -2, -1, 1, 2, 3))
        else:
            step = rng.choice((1, 2, 3))
            value = value + step if value < step or rng.random() < 0.5 else value - step
        new = str(value).zfill(len(found))
    else:
        new = _cased(rng.choice([w for w in _NUMBER_WORDS if w != found.lower()]), found)
    return text[:match.start()] + new + text[match.end():]


def negate(text: str) -> str | None:
    """`text` negated where that is simple: a leading yes/no/true/false flipped ("Likely yes" -> "Likely no"),
    a negation removed ("did not go" -> "did go", "didn't" -> "did"), or `not` after the first auxiliary
    verb ("is a nurse" -> "is not a nurse"); None otherwise."""
    stripped = text.strip()
    lead = _LEADING_YES_NO.match(stripped)
    if lead is not None:
        word = lead.group("word")
        return stripped[:lead.start("word")] + _cased(_FLIP[word.lower()], word) + stripped[lead.end("word"):]
    negative = _NEGATIVE.search(stripped)
    if negative is not None:
        short = negative.group("short")
        replacement = _cased(_CONTRACTED[short.lower()], short) if short else ""
        return stripped[:negative.start()] + replacement + stripped[negative.end():]
    auxiliary = _AUXILIARY.search(stripped)
    if auxiliary is not None:
        return stripped[:auxiliary.end()] + " not" + stripped[auxiliary.end():]
    return None


def _same_answer(a: str, b: str) -> bool:
    return paper_tokens(a) == paper_tokens(b)


def probes_for(questions: Sequence[Question], seed: int) -> list[Probe]:
    """Every question's probes (PROBES), in question order and PROBES order; deterministic given `seed`."""
    golds: dict[str, list[str]] = {}
    for q in questions:
        golds.setdefault(q.category, []).append(str(q.answer))
    pools = {category: sorted(set(answers)) for category, answers in golds.items()}
    probes: list[Probe] = []
    for q in questions:
        gold = str(q.answer)
        rng = random.Random(f"{seed}:{q.question_id}")
        probes.append(Probe(q.question_id, q.category, "gold", gold, True))
        if q.abstention:
            probes.append(Probe(q.question_id, q.category, "decline_abstention", DECLINE, True))
            continue
        others = [g for g in pools[q.category] if paper_tokens(g) and not _same_answer(g, gold)]
        candidates = {"other_gold": rng.choice(others) if others else None, "perturbed": perturb(gold, rng),
                      "negated": negate(gold), "decline": DECLINE}
        for kind, candidate in candidates.items():
            if candidate is not None and not _same_answer(candidate, gold):
                probes.append(Probe(q.question_id, q.category, kind, candidate, False))
    return probes


def _outcome(response: Response, kind: str) -> str:
    if response.error is not None:
        return "error"
    try:
        verdict = parse_judge_reply(response.text, kind=kind, strict=True)
    except JudgeParseError:
        return "unparsed"
    return "accepted" if verdict["verdict"] else "rejected"


def _counts(outcomes: Iterable[str]) -> dict[str, Any]:
    tally = {name: 0 for name in OUTCOMES}
    for outcome in outcomes:
        tally[outcome] += 1
    asked = sum(tally.values())
    answered = asked - tally["error"]
    return {"asked": asked, "accepted": tally["accepted"], "unparsed": tally["unparsed"], "errors": tally["error"],
            "rate": tally["accepted"] / answered if answered else None}


def _agreement(items: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    judged = [i for i in items if i["outcome"] != "error"]
    agree = sum((i["outcome"] == "accepted") == (i["f1"] >= AGREEMENT_F1) for i in judged)
    return {"asked": len(items), "agree": agree, "rate": agree / len(judged) if judged else None,
            "accepted_below_f1": sum(i["outcome"] == "accepted" and i["f1"] < AGREEMENT_F1 for i in judged),
            "rejected_at_f1": sum(i["outcome"] != "accepted" and i["f1"] >= AGREEMENT_F1 for i in judged),
            "unparsed": sum(i["outcome"] == "unparsed" for i in judged),
            "errors": len(items) - len(judged)}


def _block(items: Sequence[Mapping[str, Any]], questions: int) -> dict[str, Any]:
    block: dict[str, Any] = {"questions": questions}
    for kind in PROBES:
        block[kind] = _counts(i["outcome"] for i in items if i["kind"] == kind)
    block["wrong"] = _counts(i["outcome"] for i in items if i["kind"] in WRONG)
    block["agreement"] = _agreement([i for i in items if i["kind"] == "prediction"])
    return block


def _check_data(run_dir: Path, inputs: RunInputs, selected: Any) -> None:
    """The benchmark files must be the ones the run read (its provenance.json), else the questions and
    golds the audit asks about are not the run's."""
    record = provenance.read(run_dir)
    if record is None:
        log.warning("%s has no %s (a run made before memfit recorded provenance): the benchmark files are not "
                    "checked against the run's", run_dir, provenance.FILE)
        return
    now = {"data": data_record(inputs, selected)}
    changed = [d for d in provenance.differences({"data": record.get("data")}, now, ("data",))
               if not d.field.startswith("data.quirks")]
    if changed:
        raise AuditError(f"{run_dir / provenance.FILE}: the benchmark files differ from the run's: "
                         f"{provenance.describe(changed[0], now)}; audit with the data the run read")


def _judge_overrides(overrides: Sequence[str]) -> list[str]:
    wrong = [o for o in overrides if not o.split("=", 1)[0].startswith("eval.judge.")]
    if wrong:
        raise AuditError(f"only eval.judge.* settings may be changed for an audit, not {', '.join(wrong)}")
    return list(overrides)


def audit(run_dir: str | Path, overrides: Sequence[str] = (), seed: int | None = None,
          progress: bool = True) -> dict[str, Any]:
    """Audit the judge of the finished run in `run_dir` (module doc); returns judge_audit.json's content.

    overrides: eval.judge.* settings that replace the run's (another judge on the same questions; the
    report says so). seed: None = the run's eval.seed.

    Raises:
        AuditError: not a finished run, busy, other benchmark files than the run's, a bad override.
    """
    run_dir = Path(run_dir)
    for name in ("config.yaml", "predictions.jsonl", "DONE"):
        if not (run_dir / name).is_file():
            raise AuditError(f"{run_dir} is not a finished run (no {name}): finish it with `memfit run` first")
    cfg = run_config(run_dir, _judge_overrides(overrides))  # an emptied config.yaml is an error, not the defaults
    seed = cfg.eval.seed if seed is None else seed
    try:
        with exclusive(lock_path(run_dir), "wait for it to end", lock_wait_s()):
            return _audit_locked(run_dir, cfg, seed, not overrides and cfg.eval.judge.enabled, progress)
    except DirectoryBusyError as exc:
        raise AuditError(str(exc)) from None


def _audit_locked(run_dir: Path, cfg: MemFitConfig, seed: int, runs_own: bool, progress: bool) -> dict[str, Any]:
    inputs = resolve_inputs(cfg, judge_alone=True)  # the judge the audit runs, whether the run had one or not
    with inputs.in_force():  # the judge loads the weights the report records
        return _audit(run_dir, inputs, seed, runs_own, progress)


def _audit(run_dir: Path, inputs: RunInputs, seed: int, runs_own: bool, progress: bool) -> dict[str, Any]:
    cfg = inputs.cfg
    bench = read_benchmark(cfg.data.benchmark, inputs.files)
    selected = select_from_config(bench, cfg.data)
    _check_data(run_dir, inputs, selected)
    by_id = {q.question_id: q for q in selected.questions()}
    try:  # every reader of predictions reads them so: each row an object naming its question and category
        _, evaluated, _ = read_predictions(run_dir)
    except PredictionsError as exc:
        raise AuditError(str(exc)) from None
    rows = list(evaluated.values())
    unknown = [r["question_id"] for r in rows if r["question_id"] not in by_id]
    if unknown:
        raise AuditError(f"{run_dir / 'predictions.jsonl'}: questions {unknown[:5]} are not in {bench.source} as "
                         "the run's data.* settings select it")
    questions = [by_id[r["question_id"]] for r in rows]
    variant = cfg.eval.table_metric
    kind = inputs.judge_kind
    probes = probes_for(questions, seed)
    for row, q in zip(rows, questions, strict=True):
        stored = (row.get("scores") or {}).get(variant) or {}
        category = rule_category(q.category, cfg.data.benchmark)
        f1 = float(stored["f1"]) if "f1" in stored else score(row.get("prediction"), q.answer, category, variant)["f1"]
        # BEAM's judge read the reply as written (the run's judge calls, served from its cache)
        judged = reply_text(row.get("raw_output")) if kind == "beam" else str(row.get("prediction") or "")
        probes.append(Probe(q.question_id, q.category, "prediction", judged, None, f1))

    check_judge_can_start(inputs)
    if kind == "beam":
        return _report(run_dir, inputs, seed, runs_own, bench, selected, questions, probes,
                       *_beam_outcomes(run_dir, inputs, bench, by_id, probes, progress))
    assert inputs.prompts is not None, "inputs resolved without readers"
    memgallery_dir = inputs.prompts.memgallery_dir
    outcomes: list[str | None] = [None] * len(probes)
    requests, where = [], []
    for i, probe in enumerate(probes):
        if is_empty_prediction(probe.candidate):  # wrong without a call, as the run's judge has it
            outcomes[i] = "rejected"
            continue
        q = by_id[probe.question_id]
        messages = build_judge_messages(q.question, q.answer, probe.candidate, q.category, kind,
                                        memgallery_dir=memgallery_dir, abstention=q.abstention)
        # the run's own answers under the key the run's judge used: the same call, served from its cache
        key = f"judge:{q.question_id}" if probe.kind == "prediction" else f"audit:{probe.kind}:{q.question_id}"
        requests.append(Request(messages, role="judge", key=key))
        where.append(i)

    ledger_path = run_dir / "ledger.json"
    ledger = Ledger.load(ledger_path) if ledger_path.exists() else Ledger()
    reader = make_reader(inputs.judge, run_dir, ledger=ledger,
                         progress=progress)
    made = 0
    try:
        for batch in reader.generate_batches(requests, max(1, cfg.reader.flush_every), progress=progress) if requests else ():
            for j, response in batch:
                outcomes[where[j]] = _outcome(response, kind)
                made += int(not response.cached)
            ledger.save(ledger_path)  # the batch's calls are in the cache; now in the ledger too
            faults.point("audit.ledger")
    finally:
        reader.close()
    log.info("judge audit: %d judge requests, %d made now, %d from the cache (ledger.json: role judge)",
             len(requests), made, len(requests) - made)
    return _report(run_dir, inputs, seed, runs_own, bench, selected, questions, probes, outcomes, len(requests))


def _beam_outcomes(run_dir: Path, inputs: RunInputs, bench: Any, by_id: Mapping[str, Question],
                   probes: Sequence[Probe], progress: bool) -> tuple[list[str | None], int]:
    """Every probe scored by BEAM's judge (all probes' calls in one batch per alignment step), its outcome,
    and how many judge requests that took."""
    cfg = inputs.cfg
    assert inputs.prompts is not None and inputs.prompts.beam is not None, "BEAM's judge without its prompts"
    judge = BeamJudge(inputs.prompts.beam, cfg.eval.beam)
    items = []
    for probe in probes:
        q = by_id[probe.question_id]
        key = f"judge:{q.question_id}" if probe.kind == "prediction" else f"audit:{probe.kind}:{q.question_id}"
        items.append(BeamItem(key, q.question, q.category, list(q.extra.get("rubric") or []), probe.candidate))
    ledger_path = run_dir / "ledger.json"
    ledger = Ledger.load(ledger_path) if ledger_path.exists() else Ledger()
    reader = make_reader(inputs.judge, run_dir, ledger=ledger,
                         progress=progress)
    asked = 0

    def generate(requests: list[Request]) -> list[Response]:
        nonlocal asked
        asked += len(requests)
        responses = reader.generate(requests, partial=True)
        ledger.save(ledger_path)  # the batch's calls are in the cache; now in the ledger too
        faults.point("audit.ledger")
        return responses

    try:
        records = judge.score(items, generate)
    finally:
        reader.close()
    log.info("judge audit: %d BEAM judge requests (ledger.json: role judge)", asked)
    outcomes: list[str | None] = []
    for record in records:
        if record is None:
            outcomes.append("error")
        elif record["verdict"]:
            outcomes.append("accepted")
        else:
            outcomes.append("unparsed" if record.get("unparsed") else "rejected")
    return outcomes, asked


def _report(run_dir: Path, inputs: RunInputs, seed: int, runs_own: bool, bench: Any, selected: Any,
            questions: Sequence[Question], probes: Sequence[Probe], outcomes: Sequence[str | None],
            judge_requests: int) -> dict[str, Any]:
    """judge_audit.json and judge_audit.md from every probe's outcome."""
    cfg = inputs.cfg
    variant = cfg.eval.table_metric
    items = [{"question_id": p.question_id, "category": p.category, "kind": p.kind, "candidate": p.candidate,
              "expected": p.expected, **({"f1": p.f1} if p.f1 is not None else {}), "outcome": outcomes[i]}
             for i, p in enumerate(probes)]
    order = category_order([q.category for q in questions])
    report = {
        "run_dir": str(run_dir), "benchmark": bench.name, "seed": seed,
        "judge": judge_record(inputs), "judge_of_the_run": runs_own,
        # the judge's model as provenance.json records a model (its weights' sha256 when they load here)
        "judge_model": next(model_record(u) for u in inputs.models if u.role == "judge"),
        "agreement_metric": f"{variant} F1 >= {AGREEMENT_F1}",
        "questions": len(questions), "judge_requests": judge_requests, "probes": PROBES,
        "overall": _block(items, len(questions)),
        "by_category": {c: {"name": category_name(c, bench.name),
                            **_block([i for i in items if i["category"] == c],
                                     sum(q.category == c for q in questions))} for c in order},
        "items": items,
    }
    write_json_atomic(run_dir / REPORT_JSON, report)
    faults.point("audit.json")
    atomic_write_text(run_dir / REPORT_MD, render_markdown(report))
    faults.point("audit.md")
    return report


def _cell(counts: Mapping[str, Any], key: str = "accepted") -> str:
    answered = counts["asked"] - counts["errors"]
    if not answered:
        return "-"
    return f"{counts[key]}/{answered} ({100.0 * counts['rate']:.1f} %)"


def render_markdown(report: Mapping[str, Any]) -> str:
    """judge_audit.md: one row per category and Overall; each cell `accepted/asked (rate)`."""
    header = ["Category", "n", "gold (true-accept)", "other gold", "perturbed", "negated", "all wrong",
              f"{DECLINE!r}", "agrees with F1 >= 0.5"]
    cells = []
    blocks = [(f"{b['name']} ({c})" if b["name"] != c else c, b) for c, b in report["by_category"].items()]
    for label, block in [*blocks, ("**Overall**", report["overall"])]:
        agreement = block["agreement"]
        answered = agreement["asked"] - agreement["errors"]
        agree = f"{agreement['agree']}/{answered} ({100.0 * agreement['rate']:.1f} %)" if answered else "-"
        cells.append([label, str(block["questions"]), _cell(block["gold"]), _cell(block["other_gold"]),
                      _cell(block["perturbed"]), _cell(block["negated"]), _cell(block["wrong"]),
                      _cell(block["decline"]), agree])
    judge = report["judge"]
    prompts = ", ".join(f"{name} sha256 {digest[:12]}" for name, digest in judge.get("prompts", {}).items())
    overall = report["overall"]
    unparsed = sum(overall[k]["unparsed"] for k in PROBES) + overall["agreement"]["unparsed"]
    errors = sum(overall[k]["errors"] for k in PROBES) + overall["agreement"]["errors"]
    lines = [
        f"### Judge audit: {report['run_dir']}", "",
        f"Judge: {judge['backend']} `{judge['model']}`, {judge['kind']} judge ({prompts})"
        f"{'' if report['judge_of_the_run'] else '; not the judge the run was scored with'}. "
        f"{report['questions']} scored questions, {report['judge_requests']} judge requests, seed {report['seed']}.",
        "",
        "Each cell: answers the judge accepted / answers it was asked about. The gold column should be near "
        "100 %; every other column but the last near 0 % (a false accept). Last column: the judge's verdict on "
        f"the run's own predictions agrees with {report['agreement_metric']}.",
        "",
        markdown_table(header, cells, align=["left"] + ["right"] * (len(header) - 1)).rstrip("\n"),
        "",
        f"Replies without a verdict (counted as not accepted): {unparsed}; failed requests (left out): {errors}.",
    ]
    abstention = overall["decline_abstention"]
    if abstention["asked"]:
        lines.append(f"Abstention questions: {DECLINE!r} accepted {_cell(abstention)} (should be accepted).")
    return "\n".join(lines) + "\n"
