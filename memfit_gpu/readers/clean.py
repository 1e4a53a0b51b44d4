"""Answer cleaning (SPEC read path 9): from a reader's raw output to the answer that is scored.

Only the reply's own final answer counts, never text it quotes (an excerpt may hold `{"answer": ...}`
or `Answer:` lines of its own). The reply's own lines start at column 0; an indented line or one that
starts with `>` is quoted text (excerpts reach the prompt with every line after their first indented,
memfit_gpu/quoting.py, so an echoed excerpt stays indented). Order: thinking blocks and whitespace; code
fences opened at column 0 (a reply that is one fenced block, else the reply's LAST such block); a JSON
object's `answer` field, only when the whole remaining text is that object; the text after the LAST
`ANSWER:` marker at column 0, up to the first blank, quoted or `EXCERPT n` line after it (what follows
is explanation or quotation, not the answer); surrounding quotes and markdown
emphasis; whitespace again (repeated until stable, so `"ANSWER: \"Paris\""` and a fenced JSON both come
out as `Paris`). NOT_FOUND in any case, with a space or underscore, alone or with
punctuation around it, means the reader abstained; so does NOT_FOUND (with the underscore) leading an
answer that goes on to explain.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

NOT_FOUND = "NOT_FOUND"

_FENCE = re.compile(r"^```[\w+-]*[ \t]*\n?(.*?)\n?```$", re.DOTALL)
_INNER_FENCE = re.compile(r"^```[\w+-]*[ \t]*\n(.*?)\n?```", re.DOTALL | re.MULTILINE)
# `Answer:`, `**Answer:**`, `Final answer -` at the start of one of the reply's own lines (column 0).
_ANSWER_MARKER = re.compile(r"^(?:\*\*)?(?:final\s+)?answer(?:\*\*)?[ \t]*[:：\-][ \t]*(?:\*\*)?",
                            re.IGNORECASE | re.MULTILINE)
# Where the answer after a marker ends: a blank line, a line the reply quotes (indented, as an echoed
# excerpt's continuation lines are, or markdown-quoted) or an echoed `EXCERPT n` header.
_ANSWER_END = re.compile(r"^(?:[ \t]*$|[ \t]+\S|>|EXCERPT \d)", re.MULTILINE)
_QUOTES = [('"', '"'), ("'", "'"), ("\u201c", "\u201d"), ("\u2018", "\u2019"), ("`", "`"), ("**", "**"),
           ("__", "__")]
_NOT_FOUND = re.compile(r"^[\W_]*not[\s_-]*found[\W_]*$", re.IGNORECASE)
_NOT_FOUND_LEAD = re.compile(r"^[^\w]*not_found(?![a-z0-9])", re.IGNORECASE)
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


def clean_answer(raw: str | None) -> CleanAnswer:
    text = _THINK.sub("", raw or "").strip()
    for _ in range(4):  # each pass peels one layer; four covers fence > JSON > prefix > quotes
        before = text
        fenced = _FENCE.match(text)
        if fenced:
            text = fenced.group(1).strip()
        elif "```" in text:
            blocks = _INNER_FENCE.findall(text)
            if blocks:
                text = blocks[-1].strip()
        answer = _json_answer(text)
        if answer is not None:
            text = answer.strip()
        text = _after_last_marker(text).strip()
        text = _strip_quotes(text).strip()
        if text == before:
            break
    # Small readers often add an explanation after the token: NOT_FOUND (underscore form) leading the answer
    # decides; the spaced "not found" only counts alone, since "Not found in ..., but X" is prose.
    if _NOT_FOUND.match(text) or _NOT_FOUND_LEAD.match(text):
        return CleanAnswer(NOT_FOUND, True)
    return CleanAnswer(text, False)


def clean_answers(raws: Sequence[str | None]) -> list[CleanAnswer]:
    return [clean_answer(r) for r in raws]
