"""Answer cleaning (SPEC read path 9): from a reader's raw output to the answer that is scored.

Only the reply's own final answer counts, never text it quotes (an excerpt may hold `{"answer": ...}`
or `Answer:` lines of its own). The reply's own lines start at column 0; an indented line or one that
starts with `>` is quoted text (excerpts reach the prompt with every line after their first indented,
memfit_gpu/quoting.py, so an echoed excerpt stays indented). The raw reply is parsed as the reader wrote
it: nothing is stripped first (quoting.reply_start drops only blank lines before it and a tokenizer's one
leading space), so a reply whose first line is an indented echo never has that line read as its own.
Order: thinking blocks; then, one layer at a time while one is found: code fences opened at column 0 (a reply that is one fenced block, else the reply's LAST such block); a JSON
object's `answer` field, only when the whole remaining text is that object; the text after the LAST
`ANSWER:` marker at column 0, up to the first blank, quoted or `EXCERPT n` line after it (what follows
is explanation or quotation, not the answer); surrounding quotes and markdown
emphasis (each layer found is stripped of its whitespace and peeled again, so `"ANSWER: \"Paris\""`
and a fenced JSON both come out as `Paris`); a pass that finds no layer ends it, and the rest is the
answer, stripped. NOT_FOUND in any case, with a space or underscore, alone or with
punctuation around it, means the reader abstained; so does NOT_FOUND (with the underscore) leading an
answer that goes on to explain.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

from memfit_gpu.quoting import QUOTE_INDENT, reply_start

NOT_FOUND = "NOT_FOUND"

_FENCE = re.compile(r"^```[\w+-]*[ \t]*\n?(.*?)\n?```$", re.DOTALL)
_INNER_FENCE = re.compile(r"^```[\w+-]*[ \t]*\n(.*?)\n?```", re.DOTALL | re.MULTILINE)
# `Answer:`, `**Answer:**`, `Final answer -` at the start of one of the reply's own lines (column 0); a
# hyphen joined to a letter ("Answer-driven") is part of a word, not a marker. The `**` closing a bold marker
# goes with it, not one that opens a bold answer ("Answer: **Paris**").
_ANSWER_MARKER = re.compile(r"^(\*\*)?(?:final\s+)?answer(?:\*\*)?[ \t]*(?:[:：]|-(?![^\W\d_]))[ \t]*(?(1)(?:\*\*)?)",
                            re.IGNORECASE | re.MULTILINE)
# Where the answer after a marker ends: a blank line, a line the reply quotes (indented by QUOTE_INDENT or a
# tab, as an echoed excerpt's continuation lines are, or markdown-quoted) or an echoed `EXCERPT n` header.
# A line indented less (a list under "Answer: two hobbies:") is the answer's own.
_ANSWER_END = re.compile(rf"^(?:[ \t]*$|{QUOTE_INDENT}|\t|>|EXCERPT \d)", re.MULTILINE)
_QUOTES = [('"', '"'), ("'", "'"), ("\u201c", "\u201d"), ("\u2018", "\u2019"), ("`", "`"), ("**", "**"),
           ("__", "__")]
_NOT_FOUND = re.compile(r"^[\W_]*not[\s_-]*found[\W_]*$", re.IGNORECASE)
_NOT_FOUND_LEAD = re.compile(r"^[^\w]*not_found(?!\w)", re.IGNORECASE)  # not not_found_error
# A reasoning model's thinking (Qwen3 without enable_thinking=false, gpt-oss through some servers) is not the
# answer; an unclosed block (cut by max_new_tokens) leaves no answer at all.
_THINK = re.compile(r"<think>.*?(</think>|$)", re.DOTALL | re.IGNORECASE)


@dataclass(frozen=True)
class CleanAnswer:
    text: str  # the answer to score; NOT_FOUND when abstained
    abstained: bool


def _json_answer(text: str) -> str | None:
    """The `answer` field when the whole text is one JSON object that has one."""
    if not (text.startswith("{") and text.endswith("}")):
        return None
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return None
    if isinstance(data, dict):
        for key in ("answer", "Answer", "ANSWER"):
            if key in data:
                value = data[key]
                if isinstance(value, list):
                    return ", ".join(str(v) for v in value)
                return "" if value is None else str(value)
    return None


def _after_last_marker(text: str) -> str:
    """The text after the last line-leading answer marker (the reply's final answer), else the text."""
    last = None
    for last in _ANSWER_MARKER.finditer(text):  # noqa: B007 - the last match is wanted
        pass
    if last is None:
        return text
    answer = text[last.end():]
    start = len(answer) - len(answer.lstrip())  # "Answer:" alone on its line: the answer is on the next
    line_end = answer.find("\n", start)
    end = _ANSWER_END.search(answer, line_end + 1) if line_end >= 0 else None
    return answer if end is None else answer[:end.start()]


def _strip_quotes(text: str) -> str:
    changed = True
    while changed and len(text) >= 2:
        changed = False
        for left, right in _QUOTES:
            if len(text) >= len(left) + len(right) and text.startswith(left) and text.endswith(right):
                inner = text[len(left):len(text) - len(right)]
                # "a" and "b" is not a quoted string: only strip when the quote does not reappear inside.
                if left in ("**", "__") or (left not in inner and right not in inner):
                    text = inner.strip()
                    changed = True
    return text


def _peel(text: str) -> str | None:
    """The text inside the reply's outermost layer (a fence, a whole-reply JSON answer, a column-0
    answer marker, surrounding quotes), or None when it has none."""
    fenced = _FENCE.match(text)
    if fenced:
        return fenced.group(1)
    if "```" in text:
        blocks = _INNER_FENCE.findall(text)
        if blocks:
            return blocks[-1]
    answer = _json_answer(text)
    if answer is not None:
        return answer
    after = _after_last_marker(text)
    if after is not text:
        return after
    unquoted = _strip_quotes(text)
    return None if unquoted == text else unquoted


def clean_answer(raw: str | None) -> CleanAnswer:
    text = reply_start(_THINK.sub("", raw or "")).rstrip()
    for _ in range(8):  # fence > JSON > marker > quotes, and a few more: each pass peels one layer
        inner = _peel(text)
        if inner is None:
            break
        text = inner.strip()
    text = text.strip()
    # Small readers often add an explanation after the token: NOT_FOUND (underscore form) leading the answer
    # decides; the spaced "not found" only counts alone, since "Not found in ..., but X" is prose.
    if _NOT_FOUND.match(text) or _NOT_FOUND_LEAD.match(text):
        return CleanAnswer(NOT_FOUND, True)
    return CleanAnswer(text, False)


def reply_text(raw: str | None) -> str:
    """The reply as the reader wrote it, less a reasoning model's thinking and the blank lines around it:
    what a judge that reads whole replies (BEAM's rubric judge: code fences, lists and all) is shown."""
    return reply_start(_THINK.sub("", raw or "")).rstrip()


def clean_answers(raws: Sequence[str | None]) -> list[CleanAnswer]:
    return [clean_answer(r) for r in raws]
