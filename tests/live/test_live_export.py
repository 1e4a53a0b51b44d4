"""A live memory's users taken out and in: `Memory.export` / `memfit store export` write a user as one line
of the own-data jsonl format (turns, sessions, timestamps, images, and its summaries with the turn ids
they cover), `import_memories` / `memfit store import` add it back, and a round trip into an empty memory
gives the same search results, for memfit (summaries restored from the file) and lightmem_slm (notes
made again by the reader). GET /v1/users/{u}/export returns the same line as the command.

Real parts: LoCoMo conv-26's first four sessions, the packaged MiniLM, the real store; the reader is the
echo backend (tests/seam_echo_backend.py: summaries and notes quote the first excerpt of their prompt).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import seam_echo_backend  # noqa: F401  (registers reader.backend=echo)
from support.env import memfit_env
from support.live_server import DEMO, LiveServer

from memfit_gpu.data import load_benchmark
from memfit_gpu.data.jsonl import read
from memfit_gpu.live import Memory
from memfit_gpu.serve.keys import new_key

REPO = Path(__file__).resolve().parents[2]
OVERRIDES = ["rerank.backend=none", "reader.backend=echo", "live.consolidate=manual", "summary.min_chars=1"]

pytestmark = pytest.mark.slow  # real MiniLM, real store


@pytest.fixture(scope="module")
def conversation(locomo_path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    memory = load_benchmark("locomo", locomo_path).memories[0]
    turns = [{"speaker": t.speaker, "text": t.text, "timestamp": t.timestamp, "turn_id": t.turn_id,
              "session_id": s.session_id, "date_text": t.date_text} for s in memory.sessions[:4] for t in s.turns]
    turns[3] = {**turns[3], "images": [{"caption": "a photo of a sunset", "image_id": "img-7"}]}
    # an undated turn in a dated session (omitted in the file, it took the session's timestamp on import)
    turns[5] = {k: v for k, v in turns[5].items() if k not in ("timestamp", "date_text")}
    questions = [q.question for q in memory.questions[:30]]
    return turns, questions


def hits_of(memory: Memory, questions: list[str]) -> list[list[tuple[str, list[str]]]]:
    return [[(h.text, h.turn_ids) for h in hits] for hits in memory.search("u1", questions, k=10)]


@pytest.mark.parametrize("method", ["memfit", "lightmem_slm"])
def test_export_then_import_into_an_empty_memory_searches_the_same(tmp_path: Path, conversation, method: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEMFIT_TEST_ECHO_PREFIX", "EXCERPT 1")
    turns, questions = conversation
    with Memory.open(tmp_path / "a", DEMO, overrides=OVERRIDES, method=method) as source:
        for start in range(0, len(turns), 17):  # added as an agent would, batch by batch
            source.add("u1", turns[start:start + 17])
        source.add("u2", [{"speaker": "Bob", "text": "another user's words", "turn_id": "b1"}])
        written = source.consolidate()
        assert sum(written.values()) > 0, written
        line = source.export("u1", summaries=True)
        expected, stored = hits_of(source, questions), source.turns("u1")
        summaries = source.store.summaries.live_rows(source.store.memory_of("u1")).size
    assert sum(len(s["turns"]) for s in line["sessions"]) == len(turns)
    assert [s["session_id"] for s in line["sessions"]] == ["session_1", "session_2", "session_3", "session_4"]
    assert line["sessions"][0]["turns"][3]["images"] == [{"caption": "a photo of a sunset", "image_id": "img-7"}]
    assert len(line.get("summaries", [])) == summaries  # memfit: its summaries; lightmem: none (notes are its own)
    file = tmp_path / "u1.jsonl"
    file.write_text(json.dumps(line) + "\n")
    bench, report = read(file)
    assert report.errors == [] and [m.memory_id for m in bench.memories] == ["u1"]
    with Memory.open(tmp_path / "b", DEMO, overrides=OVERRIDES, method=method) as target:
        counts = target.import_memories(bench.memories)
        assert counts == {"users": 1, "turns": len(turns), "duplicates": 0, "summaries": summaries}
        if method == "lightmem_slm":
            assert target.consolidate() == written
        assert hits_of(target, questions) == expected
        assert target.turns("u1") == stored and stored[5]["timestamp"] is None
        assert target.export("u1", summaries=True) == line
        again = target.import_memories(bench.memories)
        assert again == {"users": 1, "turns": 0, "duplicates": len(turns), "summaries": 0}


def test_the_store_commands_and_the_export_route_write_the_same_line(tmp_path: Path, conversation,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEMFIT_TEST_ECHO_PREFIX", "EXCERPT 1")
    turns, _ = conversation
    config = tmp_path / "config.yaml"
    config.write_text(f"defaults: {DEMO}\nrerank:\n  backend: none\nreader:\n  backend: echo\nlive:\n"
                      "  consolidate: manual\nsummary:\n  min_chars: 1\n")
    with Memory.open(tmp_path / "m", config) as memory:
        memory.add("u1", turns)
        memory.consolidate()
    env = memfit_env(plugins="seam_echo_backend")
    cli = [sys.executable, "-m", "memfit_gpu.cli", "store"]
    out = tmp_path / "u1.jsonl"
    done = subprocess.run([*cli, "export", str(tmp_path / "m"), "--user", "u1", "--out", str(out), "--summaries",
                           "--config", str(config)], capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert f"memfit store export: u1: {len(turns)} turn(s) in 4 session(s)" in done.stdout
    imported = subprocess.run([*cli, "import", str(tmp_path / "copy"), str(out), "--config", str(config)],
                              capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    assert imported.returncode == 0, imported.stderr
    assert f"1 user(s), {len(turns)} turn(s) stored, 0 already there" in imported.stdout
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"user_id": "u9", "sessions": [{"turns": [{"speaker": "A"}]}]}\n')
    refused = subprocess.run([*cli, "import", str(tmp_path / "copy"), str(bad), "--config", str(config)],
                             capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    assert refused.returncode == 2 and "field 'sessions[0].turns[0].text'" in refused.stderr, refused.stderr
    keys_file = tmp_path / "keys.jsonl"
    key = new_key(keys_file, ["u1"])
    server = LiveServer(tmp_path / "copy", keys_file, ["rerank.backend=none", "reader.backend=echo",
                                                        "live.consolidate=manual"]).start()
    try:
        with httpx.Client(base_url=server.url, timeout=120, headers={"Authorization": f"Bearer {key}"}) as client:
            served = client.get("/v1/users/u1/export", params={"summaries": "true"})
            assert served.status_code == 200 and served.json() == json.loads(out.read_text())
            assert client.get("/v1/users/u2/export").status_code == 403
        assert server.stop() == 0
    finally:
        server.kill()


def test_a_refused_import_leaves_the_memory_as_it_was_and_names_the_field_by_its_path(tmp_path: Path, capsys) -> None:
    """A turn with an image and blank text passes the file's reader and is refused by a live memory. `memfit
    store import` opened the memory first (and created it when missing); the refusal named neither the file
    nor the turn's place in it (`add, item user 'u2' turn 1, field 'text'`, a number counted across sessions)."""
    from memfit_gpu.cli import main
    from memfit_gpu.data.schema import DataError

    config = tmp_path / "config.yaml"
    config.write_text(f"defaults: {DEMO}\nrerank:\n  backend: none\nreader:\n  backend: echo\nlive:\n"
                      "  consolidate: manual\n")
    folder = tmp_path / "m"
    with Memory.open(folder, config) as memory:
        memory.add("u1", [{"speaker": "Ann", "text": "I keep bees."}])
    before = {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"user_id": "u2", "sessions": [
        {"session_id": "s1", "turns": [{"speaker": "Bo", "text": "hello"}]},
        {"session_id": "s2", "turns": [{"speaker": "Bo", "text": " \n", "images": [{"caption": "a dog"}]}]}]}) + "\n")
    assert main(["store", "import", str(folder), str(bad), "--config", str(config)]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"memfit store: error: {bad}, item line 1 (user 'u2'), field 'sessions[1].turns[0].text': must be a "
        "non-empty string, got ' \\n'")
    assert {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()} == before
    bench, report = read(bad)
    assert report.errors == []
    with Memory.open(folder, config) as memory:
        with pytest.raises(DataError) as refused:
            memory.import_memories(bench.memories)
        assert str(refused.value) == ("import, item user 'u2', field 'sessions[1].turns[0].text': must be a non-empty "
                                      "string, got ' \\n'")
        assert memory.users() == ["u1"]


def test_an_export_keeps_each_turn_s_date_words_and_the_conversation_order(tmp_path: Path) -> None:
    """An export dropped a turn's date text where it equalled its session's, and the reader then gave a turn
    with its own timestamp the text made from that timestamp, and an undated turn none: the episode texts'
    `DATE:` changed on import (and BM25 and dense scores with them). Sessions whose turns interleave were
    grouped, which reordered the conversation. Both come back as they were now."""
    turns = [
        {"speaker": "Ann", "text": "I keep bees.", "turn_id": "a1", "session_id": "A",
         "timestamp": "2024-03-02T10:00:00", "date_text": "early March 2024"},
        {"speaker": "Ann", "text": "My sister lives in Oslo.", "turn_id": "a2", "session_id": "A",
         "timestamp": "2024-03-02T11:00:00", "date_text": "early March 2024"},
        {"speaker": "Bob", "text": "A word from another session.", "turn_id": "b1", "session_id": "B",
         "timestamp": "2024-03-03T09:00:00"},
        {"speaker": "Ann", "text": "Back to the first session.", "turn_id": "a3", "session_id": "A",
         "timestamp": "2024-03-02T12:00:00", "date_text": "early March 2024"},
        {"speaker": "Ann", "text": "An undated turn with its words.", "turn_id": "a4", "session_id": "A",
         "date_text": "early March 2024"},
    ]

    def texts(memory: Memory) -> list[str]:
        return [memory.store.text[int(r)] for r in memory.store.live_turns("u1")]

    with Memory.open(tmp_path / "a", DEMO, overrides=OVERRIDES) as source:
        source.add("u1", turns)
        line, before, order = source.export("u1"), texts(source), [t["turn_id"] for t in source.turns("u1")]
    assert order == ["a1", "a2", "b1", "a3", "a4"]
    assert [s["session_id"] for s in line["sessions"]] == ["A", "B", "A"]
    file = tmp_path / "u1.jsonl"
    file.write_text(json.dumps(line) + "\n")
    bench, report = read(file)
    assert report.errors == []
    with Memory.open(tmp_path / "b", DEMO, overrides=OVERRIDES) as target:
        target.import_memories(bench.memories)
        assert [t["turn_id"] for t in target.turns("u1")] == order
        assert texts(target) == before  # every DATE: as it was
        assert target.export("u1") == line


def test_an_export_gives_each_image_its_caption_and_id_back(tmp_path: Path) -> None:
    """An export split a turn's stored body back into images and text by looking for "] ": a caption holding
    one was cut there (the rest went into the text), and an image without an id before one with an id made
    every image plain text, so a re-import lost the ids. The store logs each image's part of the body now."""
    images = [{"caption": "a dog", "image_id": None}, {"caption": "a sign saying [1] here", "image_id": "cat1"}]
    turn = {"speaker": "Ann", "text": "look] at this", "turn_id": "t1", "images": [
        {k: v for k, v in image.items() if v is not None} for image in images]}
    with Memory.open(tmp_path / "a", DEMO, overrides=OVERRIDES) as source:
        source.add("u1", [turn])
        line = source.export("u1")
    exported = line["sessions"][0]["turns"][0]
    assert (exported["text"], exported["images"]) == ("look] at this", [
        {"caption": "a dog"}, {"caption": "a sign saying [1] here", "image_id": "cat1"}])
    file = tmp_path / "u1.jsonl"
    file.write_text(json.dumps(line) + "\n")
    with Memory.open(tmp_path / "b", DEMO, overrides=OVERRIDES) as target:
        target.import_memories(read(file)[0].memories)
        assert target.export("u1") == line
        assert target.store.image_ids[0] == ("cat1",)


def test_an_export_names_no_speaker_whose_every_turn_was_deleted(tmp_path: Path) -> None:
    """The export listed every speaker the user's memory ever had: a speaker whose only turn was deleted was
    still named, even after delete_user and a new add (until a compaction). It names the live turns' speakers."""
    secret = {"speaker": "Dr. Zhivago Secret", "text": "Call me at the clinic.", "turn_id": "s1"}
    with Memory.open(tmp_path / "m", DEMO, overrides=OVERRIDES) as memory:
        memory.add("u1", [{"speaker": "Ann", "text": "I keep bees.", "turn_id": "a1"}, secret])
        assert memory.export("u1")["speakers"] == ["Ann", "Dr. Zhivago Secret"]
        memory.delete("u1", ["s1"])
        assert memory.export("u1")["speakers"] == ["Ann"]
        memory.delete_user("u1")
        memory.add("u1", [{"speaker": "Bob", "text": "A new start.", "turn_id": "b1"}])
        assert memory.export("u1")["speakers"] == ["Bob"]
        assert "Zhivago" not in json.dumps(memory.export("u1"))


def test_an_import_whose_summary_cannot_be_stored_stores_nothing(tmp_path: Path) -> None:
    """import_memories added every turn, then failed on a summary naming a turn the memory does not have: the
    turns stayed without their summaries. Summaries are checked first now, their times by the rule of a turn's
    (a time that is no ISO 8601 local time was stored as unknown, one with a UTC offset shifted to UTC)."""
    from memfit_gpu.data.schema import DataError, Session, Turn
    from memfit_gpu.data.schema import Memory as DataMemory

    memory = DataMemory("u2", sessions=[Session("s1", "", "", [Turn("a1", "Ann", "I keep bees.", "", "")])])
    memory.extra["summaries"] = [{"text": "Ann keeps bees.", "turn_ids": ["a1", "nope"]},
                                 {"text": "Ann keeps bees.", "turn_ids": ["a1"], "event": "last spring"}]
    with Memory.open(tmp_path / "m", DEMO, overrides=OVERRIDES) as live:
        with pytest.raises(DataError) as refused:
            live.import_memories([memory])
        assert str(refused.value) == ("import, item user 'u2', field 'summaries[0].turn_ids': a list of the turn ids "
                                      "of this memory's own turns, at least one")
        assert live.users() == []
        for event, why in (("last spring", "'last spring' is not an ISO 8601 date or time"),
                           ("2023-05-08T13:56:00+02:00", "has a UTC offset: give local time without one")):
            memory.extra["summaries"] = [{"text": "Ann keeps bees.", "turn_ids": ["a1"], "event": event}]
            with pytest.raises(DataError, match="field 'summaries\\[0\\].event': .*" + re.escape(why)):
                live.import_memories([memory])
            assert live.users() == []
        memory.extra["summaries"] = [{"text": "Ann keeps bees.", "turn_ids": ["a1"], "event": "20230508T135600"}]
        assert live.import_memories([memory])["summaries"] == 1
        assert live.export("u2", summaries=True)["summaries"][0]["event"] == "2023-05-08T13:56:00"
