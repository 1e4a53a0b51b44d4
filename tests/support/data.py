"""The benchmark data the tests read, and small real slices of it for tests that run (and kill) whole pipelines.

The data is ../shared/data beside the checkout, or $MEMFIT_SHARED_DATA (conftest.py's `shared_data` fixture
refuses to start without it).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
SHARED_DATA = Path(os.environ.get("MEMFIT_SHARED_DATA", REPO.parent / "shared" / "data"))
LOCOMO = Path("locomo") / "locomo10.json"  # below SHARED_DATA (or a test's `shared_data`)


def conv26(shared_data: Path) -> dict[str, Any]:
    """LoCoMo's first conversation (conv-26), as locomo10.json holds it."""
    return json.loads((shared_data / LOCOMO).read_text())[0]


def write_small_locomo(shared_data: Path, folder: Path, questions: int, pick: list[int] | None = None) -> Path:
    """LoCoMo conv-26 cut to its first three sessions and its first `questions` questions (or the questions
    at the positions `pick`), written to `folder` (real turns and questions, small enough for kill-and-resume
    runs)."""
    sample = conv26(shared_data)
    keep = {"session_1", "session_2", "session_3"}
    conversation = {k: v for k, v in sample["conversation"].items()
                    if not k.startswith("session_") or k.removesuffix("_date_time") in keep}
    path = folder / "locomo_conv26_s1-3.json"
    path.write_text(json.dumps([{"sample_id": sample["sample_id"], "conversation": conversation,
                                 "qa": [sample["qa"][i] for i in pick] if pick else sample["qa"][:questions]}]))
    return path


def write_tiny_locomo(shared_data: Path, folder: Path, turns: int, questions: int) -> Path:
    """LoCoMo conv-26 cut to the first `turns` turns of its first session and its first `questions` questions
    (for methods whose every write is a long LLM call, such as mem0's extraction)."""
    sample = conv26(shared_data)
    conversation = {k: v for k, v in sample["conversation"].items()
                    if not k.startswith("session_") or k.removesuffix("_date_time") == "session_1"}
    conversation["session_1"] = conversation["session_1"][:turns]
    path = folder / f"locomo_conv26_s1_{turns}turns.json"
    path.write_text(json.dumps([{"sample_id": sample["sample_id"], "conversation": conversation,
                                 "qa": sample["qa"][:questions]}]))
    return path
