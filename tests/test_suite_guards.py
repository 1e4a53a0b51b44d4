"""The suite's own guards (tests/conftest.py): a machine that cannot hold the suite's files is refused at the
start in one line, instead of failing part way with hundreds of "No space left on device" errors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_too_little_free_disk_is_refused_at_the_start_in_one_line(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    env["MEMFIT_TEST_MIN_FREE_GIB"] = "1000000"  # more than any disk here holds
    # Both places are checked, in path order: the model cache (not yet made: its disk is its parent's) first.
    env["MEMFIT_CACHE"] = str(tmp_path / "cache")
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--basetemp", str(tmp_path / "t"),
                           "-q", "tests/test_mappings.py"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 4, done.stdout[-2000:] + done.stderr[-2000:]  # pytest's usage error
    message = [line for line in done.stderr.splitlines() if "GiB free" in line]
    assert len(message) == 1 and message[0].startswith(f"ERROR: {tmp_path / 'cache'}: "), done.stderr[-2000:]
    assert "the test suite needs 1000000.0 GiB there" in message[0] and "MEMFIT_TEST_MIN_FREE_GIB" in message[0]
    assert "passed" not in done.stdout  # nothing ran
