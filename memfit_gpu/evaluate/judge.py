"""The LLM judge: the reader config it runs with, and its replies read into {"verdict": bool, "reason": str,
"score": float}. (Its prompts are built in readers/prompts.py: `judge_kind`, `build_judge_messages`.)

Four judges, four reply formats:
- ``paper``: the MemFit paper's judge answers JSON with a CORRECT/WRONG label and a reason. Small
  judges wrap it in code fences, add text around it, or drop the JSON. The parser collects every verdict
  the judge states as its own: the label of each of its own top-level JSON objects (an object on an
  indented or `>`-quoted line, or inside a quotation its line opened, is text the judge quotes, such as
  the prediction under judgement, never its verdict), and in the text outside every object a
  `verdict: X` field, a reply that starts with the label (`WRONG: ...`) and any label in capitals. It
  refuses to guess: a reply whose own verdicts disagree (`{"verdict": "WRONG"} ... {"verdict":
  "CORRECT"}`, `WRONG {"verdict": "CORRECT"}`, `The answer is WRONG. It claims "CORRECT".`), or that
  negates its label (`I cannot say it is CORRECT`: a no, not, never, cannot or n't earlier in the
  label's clause), or states none, is unparsed (JudgeParseError; `parse_judge_reply(strict=False)`
  records it as `unparsed`, never as CORRECT): prose such as "The answer is wrong; the correct date is
  ..." names both labels in lower case and is not guessed at either. score = 1.0 for CORRECT, 0.0 for
  WRONG.
- ``memgallery``: Mem-Gallery's graded judge (data/memgallery/prompt/llm_judge.txt) answers
  ``{"score": <0, 0.25, 0.5, 0.75, or 1>, "reasoning": "..."}``. Mem-Gallery's released
  evaluation.py snaps the grade to 0 / 0.5 / 1 (below 0.25 -> 0, below 0.75 -> 0.5, else 1) before
  averaging; ``grades="official"`` (default) reproduces that, ``grades="five"`` keeps the five
  grades. The verdict is grade >= 0.75 on the judge's own grade ("largely accurate ... captures the
  core information"), the same bar as the paper judge's CORRECT; the threshold is a parameter.
- ``longmemeval``: LongMemEval's per-type judges (prompts/judge_longmemeval_*.txt: the rules of its
  evaluate_qa.py per question type, abstention for `_abs`) ask for the same JSON verdict as the paper's
  judge (SPEC: a JSON verdict and a reason), so their replies are read by the paper's parser. (They were
  read as LongMemEval's released yes/no replies, `'yes' in reply.lower()`: a reply in the format asked,
  `{"verdict": "CORRECT", ...}`, counted wrong, and a WRONG whose reason said "yesterday" counted correct.)

- ``beam``: BEAM's rubric judge (its src/prompts.py unified_llm_judge_base_prompt, one call per rubric item;
  evaluate/beam.py runs it) answers ``{"score": 1.0 | 0.5 | 0.0, "reason": "..."}``. BEAM's
  compute_metrics.py takes the `score` of the first JSON object it finds (json_repair as a fallback);
  here the score of the judge's own top-level objects with one (else its `score:` lines), in [0, 1];
  scores that disagree, or none, are unparsed (the item scores 0 and the question counts the reply as
  unparsed; the released code would stop the whole evaluation on such a reply). verdict = score >= 0.5
  for one item; a question's verdict and score are evaluate/beam.py's.

The memgallery grade is likewise the grade of the judge's own top-level objects with a score (else the
`score:` fields on its own lines); grades that disagree are unparsed, as conflicting labels are.

An empty prediction is wrong without asking a judge (SPEC): `needs_judge` and `empty_verdict` say
so. An abstention ("NOT_FOUND") is not empty: on LongMemEval's `_abs` questions declining is right.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from memfit_gpu.config import JudgeConfig, MemFitConfig, ReaderConfig
from memfit_gpu.quoting import reply_start
from memfit_gpu.readers.prompts import JUDGE_KINDS

_LABEL_KEYS = ("verdict", "label", "judgment", "judgement", "result", "grade", "answer", "decision")
_REASON_KEYS = ("reason", "reasoning", "explanation", "rationale", "justification")
_LABEL_FIELD = re.compile(r"\b(?:verdict|label|judge?ment|result|grade|decision)[\"'*]*\s*[:=]\s*[\"'*]*"
                          r"(CORRECT|INCORRECT|WRONG)\b", re.IGNORECASE)
_LEADING_LABEL = re.compile(r"^[\s*_#\"'`]*(CORRECT|INCORRECT|WRONG)(?=[\s*_\"'`.:,;!\-\u2013\u2014]|$)",
                            re.IGNORECASE)
# a label in capitals anywhere in the judge's own text (outside its objects and quotations)
_CAPITAL_LABEL = re.compile(r"(?<![\w-])(CORRECT|INCORRECT|WRONG)(?![\w-])")
# a label in capitals inside quotes the judge opened ('It claims "CORRECT".'): not its verdict, but a
# reply that names the other label so is not read as stating one
_QUOTED_CAPITAL_LABEL = re.compile(r"[\"\u201c']\s*(CORRECT|INCORRECT|WRONG)\s*[.!]?\s*[\"\u201d']")
_NEGATION = re.compile(r"\b(?:not|no|never|cannot|nor|neither)\b|n['\u2019]t\b", re.IGNORECASE)
_SCORE_FIELD = re.compile(r"[\"']?score[\"']?\s*[:=]\s*\"?([0-9]*\.?[0-9]+)", re.IGNORECASE)



class JudgeParseError(ValueError):
    """A judge reply that carries no verdict; the message quotes the start of the reply."""

    def __init__(self, kind: str, reply: str, why: str):
        snippet = reply.strip().replace("\n", " ")[:160]
        super().__init__(f"{kind} judge reply: {why}: {snippet!r}")
        self.kind = kind
        self.reply = reply


def reader_config_for_judge(judge: JudgeConfig, reader: ReaderConfig) -> ReaderConfig:
    """The judge's own backend/model/URLs (the reader's URLs when it has none), greedy, text only; the
    rest (timeouts, retries, batch size, instances) from the reader config, which is left untouched."""
    return replace(reader, backend=judge.backend, model=judge.model,
                   base_urls=list(judge.base_urls) or list(reader.base_urls),
                   max_new_tokens=judge.max_new_tokens, temperature=0.0, images="none", instances=reader.instances)


def judge_settings(cfg: MemFitConfig, force: bool = False) -> ReaderConfig | None:
    """The judge's reader settings when eval.judge.enabled, or `force` (`memfit judge-audit` judges whatever the
    setting says); None: no judge. A run derives them once, into its inputs (run/inputs.py RunInputs.judge)."""
    if not (cfg.eval.judge.enabled or force):
        return None
    return reader_config_for_judge(cfg.eval.judge, cfg.reader)


def is_empty_prediction(prediction: str | None) -> bool:
    """True for a prediction that must be judged wrong without a judge call (None or blank)."""
    return prediction is None or not str(prediction).strip()


def needs_judge(predictions: Sequence[str | None]) -> list[bool]:
    """Per prediction: does it need a judge call? (Empty predictions are wrong without one.)"""
    return [not is_empty_prediction(p) for p in predictions]


def empty_verdict() -> dict[str, Any]:
    """The judge record of an empty prediction (no call made)."""
    return {"verdict": False, "reason": "empty prediction (judged wrong without a call)", "score": 0.0}


def _quoted_at(text: str, position: int) -> bool:
    """Whether `position` lies in text the reply quotes: on an indented or `>`-quoted line, or inside a
    quotation its line opened (an odd number of straight double quotes before it, or an open curly one)."""
    line_start = text.rfind("\n", 0, position) + 1
    before = text[line_start:position]
    return (text[line_start:line_start + 1] in (" ", "\t", ">") or before.count('"') % 2 == 1
            or before.count("\u201c") > before.count("\u201d"))


def _field_start(text: str, position: int) -> int:
    """Where a `verdict: X` field at `position` starts, its JSON key's quote and brace included."""
    for char in ('"', "{"):
        if position > 0 and text[position - 1] == char:
            position -= 1
    return position


def _own_lines(text: str) -> str:
    """The reply without the lines it quotes (indented or `>`-quoted), each line kept in place as blank."""
    return "\n".join("" if line[:1] in (" ", "\t", ">") else line for line in text.split("\n"))


def _json_spans(text: str) -> list[tuple[int, int, Any, bool]]:
    """(start, end, value, quoted) of every top-level JSON value that starts with `{`, in order (an object
    nested in another is part of it, not a verdict of its own; `quoted`: one the reply quotes, not the
    judge's). Fences need no special case: the scan finds objects inside them."""
    decoder = json.JSONDecoder()
    found: list[tuple[int, int, Any, bool]] = []
    start = text.find("{")
    while start != -1:
        try:
            value, end = decoder.raw_decode(text, start)
        except json.JSONDecodeError:
            start = text.find("{", start + 1)
            continue
        found.append((start, end, value, _quoted_at(text, start)))
        start = text.find("{", end)
    return found


def _json_objects(text: str) -> list[dict[str, Any]]:
    """The judge's own top-level JSON objects, in the order they appear."""
    return [value for _, _, value, quoted in _json_spans(text) if isinstance(value, dict) and not quoted]


def _outside_objects(text: str) -> str:
    """The reply with every JSON object blanked (newlines kept, so lines and positions stay): what the
    judge writes around its objects."""
    pieces, at = [], 0
    for start, end, _, _ in _json_spans(text):
        pieces.append(text[at:start])
        pieces.append(re.sub(r"[^\n]", " ", text[start:end]))
        at = end
    pieces.append(text[at:])
    return "".join(pieces)


def _lower_keys(obj: dict) -> dict[str, Any]:
    return {str(k).strip().lower(): v for k, v in obj.items()}


def _reason(obj: dict[str, Any]) -> str:
    for key in _REASON_KEYS:
        if obj.get(key) is not None:
            return str(obj[key]).strip()
    return ""


def _object_label(fields: dict[str, Any]) -> str | None:
    """CORRECT or WRONG from the first label key of one JSON object that holds one, else None."""
    for key in _LABEL_KEYS:
        value = fields.get(key)
        if isinstance(value, bool):
            return "CORRECT" if value else "WRONG"
        if isinstance(value, str):
            word = value.strip().strip(".!").upper()
            if word in ("CORRECT", "WRONG", "INCORRECT"):
                return "CORRECT" if word == "CORRECT" else "WRONG"
    return None


def _negated(text: str, position: int) -> bool:
    """Whether the clause that holds `position` negates it before it (no, not, never, cannot, n't)."""
    clause_start = max(text.rfind(stop, 0, position) for stop in ".!?;,:\n") + 1
    return _NEGATION.search(text[clause_start:position]) is not None


def parse_paper_reply(reply: str) -> dict[str, Any]:
    """CORRECT/WRONG judge reply -> {"verdict", "reason", "score"}; JudgeParseError if it states no
    verdict unambiguously (none, conflicting ones, a negated one; module doc)."""
    text = reply_start(reply or "")
    stated: list[str] = []
    reason = None
    for obj in _json_objects(text):
        fields = _lower_keys(obj)
        label = _object_label(fields)
        if label is not None:
            stated.append(label)
            reason = _reason(fields)
    prose = _own_lines(_outside_objects(text))
    negated = False
    fields = [m for m in _LABEL_FIELD.finditer(prose) if not _quoted_at(prose, _field_start(prose, m.start()))]
    stated += ["CORRECT" if m.group(1).upper() == "CORRECT" else "WRONG" for m in fields]
    taken = [range(m.start(), m.end()) for m in fields]
    leading = _LEADING_LABEL.match(prose)
    if leading is not None:
        stated.append("CORRECT" if leading.group(1).upper() == "CORRECT" else "WRONG")
        taken.append(range(leading.start(1), leading.end(1)))
    for match in _CAPITAL_LABEL.finditer(prose):
        if any(match.start() in span for span in taken) or _quoted_at(prose, match.start()):
            continue
        stated.append("CORRECT" if match.group(1) == "CORRECT" else "WRONG")
        negated = negated or _negated(prose, match.start())
    for match in _QUOTED_CAPITAL_LABEL.finditer(prose):  # "CORRECT" in quotes: a label it names, not states
        if _quoted_at(prose, match.start(1)) and not any(match.start(1) in span for span in taken):
            stated.append("CORRECT" if match.group(1) == "CORRECT" else "WRONG")
    labels = set(stated)
    if len(labels) == 1 and not negated:
        verdict = labels.pop() == "CORRECT"
        return {"verdict": verdict, "reason": reason if reason is not None else text.strip(), "score": float(verdict)}
    if len(labels) > 1:
        why = "conflicting verdicts (both CORRECT and WRONG)"
    elif negated:
        why = "a negated verdict"
    elif re.search(r"correct|wrong", text, re.IGNORECASE):
        why = "no verdict it states (a verdict field, a leading label, or a label in capitals)"
    else:
        raise JudgeParseError("paper", text, "no CORRECT/WRONG label")
    raise JudgeParseError("paper", text, f"no verdict it states unambiguously: {why}")


def snap_memgallery_grade(grade: float) -> float:
    """Mem-Gallery's released rounding of a grade: < 0.25 -> 0, < 0.75 -> 0.5, else 1."""
    if grade < 0.25:
        return 0.0
    if grade < 0.75:
        return 0.5
    return 1.0


def parse_memgallery_reply(reply: str, grades: str = "official", correct_at: float = 0.75) -> dict[str, Any]:
    """Graded judge reply -> {"verdict", "reason", "score"}; score in [0, 1]."""
    if grades not in ("official", "five"):
        raise ValueError(f"grades must be 'official' or 'five', got {grades!r}")
    text = reply_start(reply or "")
    grade, reason = _stated_scores("memgallery", text)[-1]
    if not 0.0 <= grade <= 1.0:
        raise JudgeParseError("memgallery", text, f"score {grade} outside [0, 1]")
    score = snap_memgallery_grade(grade) if grades == "official" else grade
    return {"verdict": grade >= correct_at, "reason": reason, "score": float(score)}


def _stated_scores(kind: str, text: str) -> list[tuple[float, str]]:
    """(score, reason) of every score the judge states as its own: its top-level objects' `score`, else the
    `score:` fields on its own lines."""
    found: list[tuple[float, str]] = []
    for obj in _json_objects(text):
        fields = _lower_keys(obj)
        if "score" in fields:
            try:
                found.append((float(fields["score"]), _reason(fields)))
            except (TypeError, ValueError):
                continue
    if not found:
        found = [(float(m.group(1)), text.strip()) for m in _SCORE_FIELD.finditer(_own_lines(text))]
    if not found:
        raise JudgeParseError(kind, text, "no score")
    if len({g for g, _ in found}) > 1:
        raise JudgeParseError(kind, text, f"conflicting scores ({', '.join(f'{g:g}' for g, _ in found)})")
    return found


def parse_beam_reply(reply: str) -> dict[str, Any]:
    """One rubric item's judge reply -> {"verdict", "reason", "score"}; score in [0, 1] as the judge gave it
    (evaluate/beam.py applies eval.beam.partial)."""
    text = reply_start(reply or "")
    score, reason = _stated_scores("beam", text)[-1]
    if not 0.0 <= score <= 1.0:
        raise JudgeParseError("beam", text, f"score {score} outside [0, 1]")
    return {"verdict": score >= 0.5, "reason": reason, "score": float(score)}


def parse_judge_reply(reply: str, kind: str = "paper", strict: bool = True, **options: Any) -> dict[str, Any]:
    """Dispatch on the judge kind. strict=False records a reply that states no verdict unambiguously as
    `unparsed` (`{"verdict": False, "score": 0.0, "unparsed": True, "reason": "unparsed judge reply ..."}`:
    never CORRECT, counted in metrics.json as `judge_unparsed`) instead of raising."""
    parsers = {
        "paper": parse_paper_reply,
        "memgallery": parse_memgallery_reply,
        "longmemeval": parse_paper_reply,  # its prompts ask for the paper's JSON verdict (module doc)
        "beam": parse_beam_reply,
    }
    if kind not in parsers:
        raise ValueError(f"unknown judge kind {kind!r}; choose one of {', '.join(JUDGE_KINDS)}")
    try:
        return parsers[kind](reply, **options)
    except JudgeParseError as exc:
        if strict:
            raise
        return {"verdict": False, "reason": f"unparsed judge reply ({exc})", "score": 0.0, "unparsed": True}
