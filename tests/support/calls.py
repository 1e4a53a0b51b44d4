"""How often memfit's own functions are called during a test, wherever a module imported them by name."""

from __future__ import annotations

import functools
import inspect
import sys
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest


class CallCounter:
    """Counts the calls of the functions `watch` names, by label (the function's qualified name, and the
    `key` of its arguments when given). The original runs unchanged; monkeypatch restores it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.monkeypatch = monkeypatch
        self.counts: Counter[str] = Counter()

    def watch(self, owner: Any, name: str, key: Callable[..., str] | None = None) -> None:
        """Count `owner.name` (a module's function, or a class's classmethod). A module function is replaced in
        every loaded memfit_gpu module that holds it under that name too (`from x import name`)."""
        original = inspect.getattr_static(owner, name)
        is_classmethod = isinstance(original, classmethod)
        func = original.__func__ if is_classmethod else original
        label = f"{getattr(owner, '__name__', owner)}.{name}"

        @functools.wraps(func)
        def counted(*args: Any, **kwargs: Any) -> Any:
            shown = args[1:] if is_classmethod else args
            self.counts[label + (f"[{key(*shown, **kwargs)}]" if key else "")] += 1
            return func(*args, **kwargs)

        if is_classmethod:
            self.monkeypatch.setattr(owner, name, classmethod(counted))
            return
        holders = [m for m in list(sys.modules.values())
                   if getattr(m, "__name__", "").startswith("memfit_gpu") and m.__dict__.get(name) is func]
        assert owner in holders, f"{label}: not a memfit_gpu module's function"
        for module in holders:
            self.monkeypatch.setattr(module, name, counted)

    def more_than_once(self) -> dict[str, int]:
        return {label: n for label, n in self.counts.items() if n > 1}
