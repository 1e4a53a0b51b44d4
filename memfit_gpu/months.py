"""English month names: the one table the loaders (LoCoMo dates) and the question parser (month
boosts, relative dates in excerpts) read, so that no module depends on the locale."""

from __future__ import annotations

MONTH_NAMES = (
    "january", "february", "march", "april", "may", "june",
    "july", "august", "september", "october", "november", "december",
)

# lowercase full name or 3-letter abbreviation -> 1..12
MONTH_NUMBER: dict[str, int] = {}
for _number, _name in enumerate(MONTH_NAMES, start=1):
    MONTH_NUMBER[_name] = _number
    MONTH_NUMBER[_name[:3]] = _number
