"""`memfit data stats|fetch` through the real entry point (main([...]) and one subprocess)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.env import memfit_env

from memfit_gpu.cli import main


def _stats(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main(["data", "stats", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_stats_locomo_from_data_dir(capsys, shared_data: Path, monkeypatch) -> None:
    monkeypatch.setenv("MEMFIT_DATA_DIR", str(shared_data))
    stats = _stats(capsys, "locomo")
    assert {k: stats[k] for k in ("memories", "sessions", "turns", "questions", "evaluated_questions")} == {
        "memories": 10, "sessions": 272, "turns": 5882, "questions": 1986, "evaluated_questions": 1540,
    }  # fmt: skip
    assert stats["by_category"] == {"1": 282, "2": 321, "3": 96, "4": 841, "5": 446}
    assert stats["images"] == 1226
    assert stats["problems"]["count"] == 15
    assert len(stats["problems"]["first"]) == 5


def test_stats_memgallery(capsys, shared_data: Path) -> None:
    stats = _stats(capsys, "memgallery", "--path", str(shared_data / "memgallery" / "dialog"))
    assert [stats[k] for k in ("memories", "sessions", "turns", "questions")] == [20, 240, 3962, 1711]
    assert stats["by_category"] == {
        "AR": 184, "CD": 81, "FR": 219, "KR": 81, "MR": 206, "TR": 123, "TTL": 337, "VR": 174, "VS": 306,
    }  # fmt: skip
    assert (stats["images"], stats["question_images"]) == (1003, 487)


def test_stats_longmemeval_subprocess(shared_data: Path) -> None:
    path = shared_data / "longmemeval" / "longmemeval_oracle_sample47.json"
    result = subprocess.run(
        [sys.executable, "-m", "memfit_gpu.cli", "data", "stats", "longmemeval", "--path", str(path), "--json"],
        capture_output=True, text=True, timeout=120, env=memfit_env(),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    stats = json.loads(result.stdout.strip().splitlines()[-1])
    assert (stats["questions"], stats["memories"], stats["abstention_questions"]) == (47, 47, 1)


def test_stats_table(capsys, locomo_path: Path) -> None:
    assert main(["data", "stats", "locomo", "--path", str(locomo_path), "--problems", "1"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"locomo  ({locomo_path})"
    # the one renderer's console tables (memfit_gpu/render.py): a row per count, a row per category
    assert "evaluated_questions            1540" in out.splitlines()
    assert "5             446            0" in out.splitlines()
    assert "... 14 more" in out


def test_stats_errors_are_one_line(capsys, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("MEMFIT_CACHE", str(tmp_path))
    monkeypatch.delenv("MEMFIT_DATA_DIR", raising=False)
    assert main(["data", "stats", "locomo"]) == 2
    assert "run `memfit data fetch locomo` or pass --path" in capsys.readouterr().err
    broken = tmp_path / "locomo10.json"
    broken.write_text("{")
    assert main(["data", "stats", "locomo", "--path", str(broken)]) == 2
    assert f"memfit data: error: {broken}: not valid JSON" in capsys.readouterr().err


def test_fetch_command(capsys, shared_data: Path, tmp_path: Path) -> None:
    dest = tmp_path / "cache"
    assert (
        main(["data", "fetch", "locomo", "--dest", str(dest), "--mirror", str(shared_data), "--no-progress"])
        == 0
    )
    assert capsys.readouterr().out.strip() == str(dest / "locomo" / "locomo10.json")
    assert main(["data", "fetch", "locomo", "--split", "s", "--dest", str(dest)]) == 2
    assert "--split applies to longmemeval or beam only" in capsys.readouterr().err


def test_help_explains(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(["data", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "$MEMFIT_DATA_DIR" in out and "stats" in out and "fetch" in out
