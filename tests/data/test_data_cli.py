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


def _image_paths(memories) -> list[str]:
    return [i.path for m in memories for t in m.turns() for i in t.images] + [
        q.image.path for m in memories for q in m.questions if q.image is not None]


def test_convert_writes_image_paths_that_name_the_same_files_from_the_output(capsys, shared_data: Path,
                                                                             tmp_path: Path) -> None:
    """MemGallery's image paths (../image/<scenario>/D1_IMG_001.jpg) are relative to its dialog/ folder;
    convert copied them as written, while the jsonl format reads them from the output file's folder: all
    1,490 named no file (1,490 validate warnings, MissingImageError in a run with reader.images)."""
    from memfit_gpu.data import load_benchmark
    from memfit_gpu.data.jsonl import read

    dialog = shared_data / "memgallery" / "dialog"
    every = tmp_path / "every.jsonl"  # the real 20 scenarios: far from the data, so absolute paths
    assert main(["data", "convert", "memgallery", "--path", str(dialog), "--out", str(every)]) == 0
    original = _image_paths(load_benchmark("memgallery", str(dialog)).memories)
    converted = _image_paths(read(every)[0].memories)
    assert len(original) == len(converted) == 1490 and original[0].startswith("../image/")
    assert [str((every.parent / p).resolve()) for p in converted] == [str((dialog / p).resolve()) for p in original]
    if dialog.resolve().parts[1] != tmp_path.resolve().parts[1]:  # nothing but the root in common
        assert converted == [str((dialog / p).resolve()) for p in original]
    # one real scenario in MemGallery's layout, its images there (the shared data has none): beside the data,
    # the paths stay relative, and the converted file reads with every image found
    scenario = sorted(dialog.glob("*.json"))[0]
    root = tmp_path / "memgallery"
    (root / "dialog").mkdir(parents=True)
    (root / "dialog" / scenario.name).write_bytes(scenario.read_bytes())
    paths = _image_paths(load_benchmark("memgallery", str(root / "dialog")).memories)
    for path in paths:
        (root / "dialog" / path).parent.mkdir(parents=True, exist_ok=True)
        (root / "dialog" / path).write_bytes(b"\xff\xd8 an image")
    out = root / "mine" / "data" / "scenario.jsonl"
    out.parent.mkdir(parents=True)
    capsys.readouterr()
    assert main(["data", "convert", "memgallery", "--path", str(root / "dialog"), "--out", str(out)]) == 0
    written = _image_paths(read(out)[0].memories)
    assert written == [f"../../{p.removeprefix('../')}" for p in paths] and paths[0].startswith("../image/")
    assert all((out.parent / p).is_file() for p in written)
    capsys.readouterr()
    assert main(["data", "validate", str(out)]) == 0
    assert "is not at" not in capsys.readouterr().out
    # converted where the paths already name the files (the dialog folder itself): kept as written
    again = root / "dialog" / "again.jsonl"
    assert main(["data", "convert", "memgallery", "--path", str(root / "dialog" / scenario.name), "--out",
                 str(again)]) == 0
    assert _image_paths(read(again)[0].memories) == paths


LIVE_REFUSED = (  # a file a run reads, and a live memory refuses (`memfit store import`)
    {"user_id": "alice smith", "sessions": [{"turns": [{"speaker": "Alice", "text": "hi"}]}]},
    {"user_id": "carol", "sessions": [{"session_id": "s1", "turns": [
        {"speaker": "Carol", "text": "look"},
        {"speaker": "Carol", "text": "  ", "images": [{"caption": "a photo of a dog"}]}]}]},
)


def test_validate_live_lists_what_a_live_memory_refuses(capsys, tmp_path: Path) -> None:
    """`memfit data validate` said ok to a file `memfit store import` then refused (a user id with a space,
    a turn with an image and no text). --live lists those as errors, by line and field; a line the reader
    refuses is named once, by the reader."""
    path = tmp_path / "own.jsonl"
    reader_error = {"user_id": "dave", "sessions": [{"turns": [{"speaker": "", "text": " "}]}]}
    path.write_text("".join(json.dumps(r) + "\n" for r in LIVE_REFUSED[:1]) + "\nnot json\n"
                    + "".join(json.dumps(r) + "\n" for r in (reader_error, *LIVE_REFUSED[1:])))
    assert main(["data", "validate", str(path)]) == 2
    plain = capsys.readouterr().out.splitlines()
    assert [line for line in plain if line.startswith("error:")] == [
        f"error: {path}, item line 3: not valid JSON (Expecting value at column 1)",
        f"error: {path}, item line 4 (user 'dave'), field 'sessions[0].turns[0].speaker': must not be empty"]
    assert main(["data", "validate", "--live", str(path)]) == 2
    live = capsys.readouterr()
    assert [line for line in live.out.splitlines() if line.startswith("error:")] == [
        f"error: {path}, item line 3: not valid JSON (Expecting value at column 1)",
        f"error: {path}, item line 4 (user 'dave'), field 'sessions[0].turns[0].speaker': must not be empty",
        f"error: {path}, item line 1 (user 'alice smith'), field 'user_id': user id 'alice smith' is not valid: 1 to "
        "128 characters, ASCII letters, digits and _ - . @ : only, starting with a letter or digit",
        f"error: {path}, item line 5 (user 'carol'), field 'sessions[0].turns[1].text': must be a non-empty string, "
        "got '  '"]
    assert [line for line in live.out.splitlines() if not line.startswith("error:")] == [
        line for line in plain if not line.startswith("error:")]
    assert live.err.strip().splitlines()[-1] == f"memfit data: error: {path}: 4 error(s), 2 warning(s) (listed above)"
    path.write_text(json.dumps({"user_id": "alice", "sessions": [{"turns": [{"speaker": "Alice", "text": "hi"}]}]}))
    assert main(["data", "validate", "--live", str(path)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"ok: {path}: 1 memories, 1 turns, 0 questions (0 scored by default), 0 warning(s)"]
