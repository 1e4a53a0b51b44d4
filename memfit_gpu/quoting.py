"""Quoted text: stored or generated text placed inside a prompt so that no line of it can pass for a
line of the prompt's own structure.

Every line after the first that holds more than whitespace is indented by QUOTE_INDENT, so lines that
start at column 0 (`EXCERPT n`, `Question:`, `Gold answer:`, instructions) only ever come from a
template. The answer excerpts (retrieve/pack.py), the methods' notes and the judge's view of the
prediction (readers/prompts.py) are quoted by this one function; a reply's own lines are told from
quoted ones the same way (readers/clean.py).
"""

from __future__ import annotations

import re

QUOTE_INDENT = "    "
# Whatever a reader might take for a line break: \r\n, \n, \r, vertical tab, form feed, the file/group/record
# separators, NEL and the Unicode line and paragraph separators (what str.splitlines() splits on).
LINE_BREAK = re.compile("(\r\n|[\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029])")


def quote_lines(text: str) -> str:
    """`text` with QUOTE_INDENT before every line after the first that holds more than whitespace, so no
    line of it can pass for a line of the prompt's own structure. Line breaks and blank lines stay."""
    if LINE_BREAK.search(text) is None:
        return text
    pieces = LINE_BREAK.split(text)  # line, break, line, break, ..., line
    for i in range(2, len(pieces), 2):
        if pieces[i].strip():
            pieces[i] = QUOTE_INDENT + pieces[i]
    return "".join(pieces)

_BLANK_START = re.compile(r"\A(?:[ \t]*(?:\r\n|\n|\r))+")


def reply_start(text: str) -> str:
    """A reader's raw reply made ready for telling its own lines from quoted ones: the blank lines before
    its first line dropped, and a single leading space (a tokenizer's word-boundary marker decoded at the
    start: " Paris") removed. Nothing else: a first line indented by QUOTE_INDENT (two or more spaces, or a
    tab) stays indented, because it is an echoed excerpt's continuation line, never the reply's own."""
    text = _BLANK_START.sub("", text)
    if text.startswith(" ") and not text.startswith("  "):
        text = text[1:]
    return text
