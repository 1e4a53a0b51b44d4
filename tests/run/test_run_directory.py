"""run/directory.py: what a run directory's own bookkeeping files must be, and what a damaged one says."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memfit_gpu.run.directory import RunError, StageTimer


def test_stage_times_accumulate_across_invocations(tmp_path: Path) -> None:
    path = tmp_path / "timings.json"
    timer = StageTimer.load(path)
    timer.seconds["build"] = 2.5
    timer._save()
    again = StageTimer.load(path)
    assert again.seconds == {"build": 2.5} and json.loads(path.read_text()) == {"build": 2.5}


@pytest.mark.parametrize("content", [b'{"load": ', b"[]", b'{"build": "x"}', b"\xff"])
def test_a_damaged_timings_file_is_a_run_error_naming_it(tmp_path: Path, content: bytes) -> None:
    """A resume over a timings.json that is not JSON, not an object of numbers or not UTF-8 was a traceback."""
    path = tmp_path / "timings.json"
    path.write_bytes(content)
    with pytest.raises(RunError) as refused:
        StageTimer.load(path)
    assert str(refused.value).startswith(f"{path}")
    assert str(refused.value).endswith(": not the stage times memfit writes; delete it to resume (only the earlier "
                                       "invocations' stage times are lost, no result)")
