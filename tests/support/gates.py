"""A reader generation held in flight for as long as a test needs it (the live memory's concurrency tests)."""

from __future__ import annotations

import threading
from typing import Any

import pytest


def gate(monkeypatch: pytest.MonkeyPatch, live: Any, held: Any) -> tuple[threading.Event, threading.Event]:
    """The memory's reader holds a batch for which `held(requests)` is true until the test sets `release`
    (`inside` is set once it is held): a generation in flight, as long as the test needs it."""
    backend = live.reader().backend
    generate, inside, release = backend.generate, threading.Event(), threading.Event()

    def gated(requests):  # noqa: ANN001, ANN202
        if held(requests):
            inside.set()
            assert release.wait(30)
        return generate(requests)

    monkeypatch.setattr(backend, "generate", gated)
    return inside, release
