"""experiments/bench_users.py (many users in one live memory) on a tiny setting: three LoCoMo
conversations cut to their first 60 turns, five steps, one torch thread. It checks the JSON has every
figure, that every turn a step writes was written (the store's size), and that another user's add changed
nothing the asked user reads (`isolated`). The figures themselves are docs/benchmarks/history.md's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "experiments"))
import bench_users  # noqa: E402

pytestmark = pytest.mark.slow  # real MiniLM weights, a real store


def test_every_figure_is_there_and_users_are_isolated(tmp_path: Path) -> None:
    out = tmp_path / "users.json"
    result = bench_users.main(["--users", "3", "--turns", "60", "--searches", "5", "--threads", "1",
                               "--work-dir", str(tmp_path / "work"), "--json-out", str(out)])
    assert out.read_text().strip().startswith("{")
    assert (result["users"], result["searches"], result["k"]) == (3, 5, 10)
    # 55 written up front per user, then one held-back turn a step to another user and one to the asked one
    assert result["turns_stored"] == 3 * 55 + 5 + 5
    for kind in ("after_other_add", "unchanged", "after_own_add"):
        assert result[kind]["n"] == 5
        assert 0 < result[kind]["p50_ms"] <= result[kind]["p95_ms"] <= result[kind]["p99_ms"]
    assert result["ratio_after_other_add_to_unchanged"] == pytest.approx(
        result["after_other_add"]["p50_ms"] / result["unchanged"]["p50_ms"], abs=1e-3)
    assert result["isolated"] is True


def test_bad_arguments_exit_2_with_the_reason(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, reason in ((["--users", "1"], "at least 2"), (["--users", "3", "--turns", "4", "--searches", "5"],
                                                             "more turns than that")):
        with pytest.raises(SystemExit) as stop:
            bench_users.main(argv)
        assert stop.value.code == 2
        assert reason in capsys.readouterr().err
