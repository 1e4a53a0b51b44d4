"""BEAM's loader on the real 128K split (../shared/data/beam/100K, the repository's folders at b2a3ee8) and on
the hub's parquet layout, written here from the same files (BEAM's download script's columns: one row per
conversation, `chat` as flat message lists per batch, `probing_questions` as a Python literal string)."""

from __future__ import annotations

import functools
import http.server
import json
import shutil
import subprocess
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from memfit_gpu.cli import main
from memfit_gpu.data import DataError, DataNotFoundError, load_benchmark, resolve_data_path
from memfit_gpu.data.beam import ABILITIES
from memfit_gpu.data.fetch import FetchError, download_verified, fetch_benchmark, files_for, git_blob_of

ABILITY_COUNTS = {ability: 40 for ability in ABILITIES}


@pytest.fixture(scope="module")
def beam_folder(shared_data: Path) -> Path:
    return shared_data / "beam" / "100K"


@pytest.fixture(scope="module")
def beam(beam_folder: Path):
    return load_benchmark("beam", beam_folder)


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:  # keep pytest output clean
        pass


@pytest.fixture()
def served(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """An http.server on 127.0.0.1 serving tmp_path/www (no network here); yields (base URL, folder)."""
    root = tmp_path / "www"
    root.mkdir()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", root
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def _hub_row(folder: Path) -> dict:
    """One conversation as the hub's parquet holds it: batches as flat message lists, questions as a literal."""
    chat = json.loads((folder / "chat.json").read_text())
    questions = json.loads((folder / "probing_questions" / "probing_questions.json").read_text())
    return {"conversation_id": folder.name, "conversation_seed": {"category": "x"}, "narratives": "",
            "user_profile": {"user_info": "", "user_relationships": ""}, "conversation_plan": "",
            "user_questions": [], "chat": [[m for turn in batch["turns"] for m in turn] for batch in chat],
            "probing_questions": repr(questions)}


def _write_parquet(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _shape(benchmark) -> list:
    """Everything the loader made of the data, per memory, to compare two layouts."""
    out = []
    for m in benchmark.memories:
        out.append((m.memory_id, m.speakers,
                    [(s.session_id, s.timestamp, s.date_text, [(t.turn_id, t.speaker, t.text, t.extra) for t in s.turns])
                     for s in m.sessions],
                    [(q.question_id, q.category, q.question, q.answer, q.evidence, q.evidence_sessions, q.abstention,
                      q.extra) for q in m.questions]))
    return out


def test_real_split_counts(beam) -> None:
    assert len(beam.memories) == 20
    assert [m.memory_id for m in beam.memories] == [str(i) for i in range(1, 21)]
    assert sum(len(m.turns()) for m in beam.memories) == 5732
    assert sum(len(m.sessions) for m in beam.memories) == 90
    questions = beam.questions()
    assert len(questions) == 400
    assert Counter(q.category for q in questions) == ABILITY_COUNTS
    assert all(q.evaluated for q in questions)
    assert sum(q.abstention for q in questions) == 40
    assert {q.category for q in questions if q.abstention} == {"abstention"}
    # 40 abstention questions have no source_chat_ids, 5 others an empty list: 355 with evidence, every id a message
    assert sum(bool(q.evidence) for q in questions) == 355
    turns = {(m.memory_id, t.turn_id) for m in beam.memories for t in m.turns()}
    assert all((q.memory_id, e) in turns for q in questions for e in q.evidence)
    # the one quirk: conversation 4's message 97 is 348,853 characters long
    assert beam.problems == ["beam 4: turn 97 holds 348,853 characters (more than 100,000): kept; its excerpt is "
                             "cut to pack.max_excerpt_chars"]


def test_real_conversation_mapping(beam) -> None:
    first = beam.memories[0]
    assert first.speakers == ["user", "assistant"]
    # batches -> sessions, dated by the time anchor on each batch's first message
    assert [(s.session_id, s.timestamp, s.date_text, len(s.turns)) for s in first.sessions] == [
        ("batch-1", "2024-03-15T00:00:00", "March-15-2024", 60),
        ("batch-2", "2024-04-05T00:00:00", "April-05-2024", 56),
        ("batch-3", "2024-04-25T00:00:00", "April-25-2024", 72),
    ]
    turn = first.sessions[0].turns[0]
    # message id -> turn id, role -> speaker, content stored verbatim: BEAM's readers get the marker too
    assert (turn.turn_id, turn.speaker) == ("0", "user")
    assert turn.text.endswith("ensure I meet my deadlines by then? ->-> 1,1")
    assert turn.extra == {"beam_turn": 0, "index": "1,1", "question_type": "main_question",
                          "time_anchor": "March-15-2024", "marker": "1,1"}
    assert first.sessions[0].turns[1].extra == {"beam_turn": 0}  # the assistant's reply
    assert [t.turn_id for t in first.turns()] == [str(i) for i in range(188)]
    by_id = {q.question_id: q for q in first.questions}
    contradiction = by_id["1:contradiction_resolution:0"]
    assert contradiction.evidence == ["58", "24"]  # {first_statement: [58], second_statement: [24]}, in order
    assert contradiction.evidence_sessions == ["batch-1"]  # batch 1 holds messages 0-59
    assert contradiction.extra["rubric"][0] == "LLM response should state: there is contradictory information"
    assert contradiction.extra["gold_field"] == "ideal_answer" and contradiction.extra["reference_answer"]
    assert by_id["1:event_ordering:1"].evidence == ["6", "62", "118", "120"]  # 118 given twice, kept once
    instruction = by_id["1:instruction_following:0"]
    assert instruction.answer == "Response should include code examples formatted with syntax highlighting."
    assert (instruction.extra["gold_field"], instruction.extra["reference_answer"]) == ("expected_compliance", False)
    assert by_id["1:abstention:0"].evidence == [] and by_id["1:abstention:0"].abstention


def test_stats_command(capsys, beam_folder: Path) -> None:
    assert main(["data", "stats", "beam", "--path", str(beam_folder), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [stats[k] for k in ("memories", "sessions", "turns", "questions")] == [20, 90, 5732, 400]
    assert stats["by_category"] == ABILITY_COUNTS
    # 12,232,070 characters of messages / 4
    assert stats["tokens_approx"] == 3_058_018
    assert stats["units"] == {"memories": "conversations", "sessions": "batches", "turns": "messages",
                              "category": "ability"}
    assert main(["data", "stats", "beam", "--path", str(beam_folder)]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert ["conversations", "20"] in rows and ["messages", "5732"] in rows and ["batches", "90"] in rows
    assert ["tokens", "(approx.)", "3058018"] in rows
    assert ["ability", "all", "evaluated"] in rows and ["summarization", "40", "40"] in rows


def test_found_in_a_data_folder_by_split(shared_data: Path, monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MEMFIT_DATA_DIR", str(shared_data))
    monkeypatch.setenv("MEMFIT_CACHE", str(tmp_path))
    files = resolve_data_path("beam")  # the default split, 100K: chat.json + probing_questions.json each
    assert len(files) == 40 and files[0] == shared_data / "beam" / "100K" / "1" / "chat.json"
    assert files[1] == shared_data / "beam" / "100K" / "1" / "probing_questions" / "probing_questions.json"
    with pytest.raises(DataNotFoundError, match="no beam data found .*run `memfit data fetch beam` or pass --path"):
        resolve_data_path("beam", split="500K")
    one = load_benchmark("beam", shared_data / "beam" / "100K" / "7" / "chat.json")  # one conversation's file
    assert [m.memory_id for m in one.memories] == ["7"] and len(one.questions()) == 20


def test_parquet_layout_gives_the_same_benchmark(beam, beam_folder: Path, tmp_path: Path) -> None:
    rows = [_hub_row(beam_folder / str(i)) for i in range(1, 21)]
    hub = tmp_path / "hub"
    _write_parquet(hub / "data" / "100K-00000-of-00001.parquet", rows)
    _write_parquet(hub / "data" / "500K-00000-of-00001.parquet", rows[:1])
    parquet = load_benchmark("beam", hub)  # the default split's file of the hub's data/ folder
    assert parquet.source == str(hub / "data" / "100K-00000-of-00001.parquet")
    assert len(parquet.memories) == 20 and sum(len(m.turns()) for m in parquet.memories) == 5732
    assert Counter(q.category for q in parquet.questions()) == ABILITY_COUNTS
    assert _shape(parquet) == _shape(beam)
    assert parquet.problems == beam.problems
    assert [m.memory_id for m in load_benchmark("beam", hub, split="500K").memories] == ["1"]


def test_ten_million_plans_both_layouts(beam_folder: Path, tmp_path: Path) -> None:
    """BEAM-10M: a chat of plans. The repository's chat.json numbers ids across plans; the hub's plans may
    start again at 0, renumbered as BEAM's combine_10m_chats does: both give the same memory."""
    chat = json.loads((beam_folder / "1" / "chat.json").read_text())
    questions = (beam_folder / "1" / "probing_questions" / "probing_questions.json").read_text()
    folder = tmp_path / "10M" / "1"
    (folder / "probing_questions").mkdir(parents=True)
    (folder / "probing_questions" / "probing_questions.json").write_text(questions)
    (folder / "chat.json").write_text(json.dumps([{"plan-1": chat[:2]}, {"plan-2": chat[2:]}]))
    repository = load_benchmark("beam", folder)
    memory = repository.memories[0]
    assert [s.session_id for s in memory.sessions] == ["plan-1:batch-1", "plan-1:batch-2", "plan-2:batch-3"]
    assert [t.turn_id for t in memory.turns()] == [str(i) for i in range(188)]
    assert repository.problems == []

    first_plan_ids = sum(len(t) for b in chat[:2] for t in b["turns"])  # 116
    restarted = [dict(m, id=m["id"] - first_plan_ids) for t in chat[2]["turns"] for m in t]
    plans = [{"plan-1": [[m for t in b["turns"] for m in t] for b in chat[:2]], "plan-2": None},
             {"plan-1": None, "plan-2": [restarted]}]
    path = _write_parquet(tmp_path / "10M-00000-of-00001.parquet",
                          [{"conversation_id": "1", "chat": plans, "probing_questions": questions}])
    hub = load_benchmark("beam", path)
    assert hub.problems == ["beam 1: message ids start again in a plan: renumbered on from the plan before "
                            "(plan-2 +116), as BEAM's combine_10m_chats numbers the repository's chat.json"]
    assert _shape(hub)[0][2][2][3] == _shape(repository)[0][2][2][3]  # plan-2's messages, ids as the repository's
    assert [t.turn_id for t in hub.memories[0].turns()] == [str(i) for i in range(188)]


def test_bad_input_names_file_item_and_field(beam_folder: Path, tmp_path: Path) -> None:
    folder = tmp_path / "100K" / "3"
    shutil.copytree(beam_folder / "3", folder)
    chat_path = folder / "chat.json"
    chat = json.loads(chat_path.read_text())
    del chat[1]["turns"][2][1]["content"]
    chat_path.write_text(json.dumps(chat))
    with pytest.raises(DataError) as info:
        load_benchmark("beam", folder)
    assert str(info.value) == f"{chat_path}, field 'chat[1].turns[2][1].content': required field is missing"

    chat[1]["turns"][2][1]["content"] = "fixed"
    chat_path.write_text(json.dumps(chat))
    questions_path = folder / "probing_questions" / "probing_questions.json"
    questions = json.loads(questions_path.read_text())
    questions["summarization"][1]["rubric"] = "not a list"
    questions_path.write_text(json.dumps(questions))
    with pytest.raises(DataError, match=r"probing_questions.json, field 'summarization\[1\].rubric': expected a list"):
        load_benchmark("beam", folder)
    questions_path.unlink()
    with pytest.raises(DataError, match="probing_questions.json: conversation 3: its probing questions file is "
                                        "missing"):
        load_benchmark("beam", chat_path)

    bad = _write_parquet(tmp_path / "hub" / "100K.parquet", [{"conversation_id": "1", "chat": []}])
    with pytest.raises(DataError) as info:
        load_benchmark("beam", bad)
    assert str(info.value) == (f"{bad}, field 'probing_questions': column missing (the file has conversation_id, "
                               "chat)")
    broken = _write_parquet(tmp_path / "hub2" / "100K.parquet",
                            [{"conversation_id": "9", "chat": [[{"role": "user", "id": 0, "content": "hi ->-> 1,1",
                                                                 "time_anchor": "March-15-2024"}]],
                              "probing_questions": "{'abstention': [{'question': 'x', 'rubric': ["}])
    with pytest.raises(DataError, match=r"item conversation 9, field 'probing_questions': neither a Python literal "
                                        "nor JSON"):
        load_benchmark("beam", broken)


@pytest.mark.parametrize(("ability", "field", "value", "reason"), [
    ("information_extraction", "answer", ["a", "b"], "expected str or int, got list"),
    ("summarization", "ideal_summary", {"summary": "x"}, "expected str or int, got dict"),
    ("instruction_following", "expected_compliance", True, "expected str or int, got bool"),
    ("abstention", "ideal_response", float("nan"), "nan is not a finite number"),
    ("temporal_reasoning", "answer", float("inf"), "inf is not a finite number"),
])
def test_a_gold_answer_of_the_wrong_type_is_an_error_naming_the_field(beam_folder: Path, tmp_path: Path, ability: str,
                                                                      field: str, value: object, reason: str) -> None:
    """A gold field of another type than BEAM's text (every ability of the real files writes a str) read as
    "the gold answer is empty" and left the scores with only a problem line; NaN became the gold text "nan"."""
    folder = tmp_path / "100K" / "3"
    shutil.copytree(beam_folder / "3", folder)
    questions_path = folder / "probing_questions" / "probing_questions.json"
    questions = json.loads(questions_path.read_text())
    questions[ability][1][field] = value
    questions_path.write_text(json.dumps(questions))
    with pytest.raises(DataError) as info:
        load_benchmark("beam", folder)
    assert str(info.value) == f"{questions_path}, field '{ability}[1].{field}': {reason}"


def test_a_repeated_batch_number_is_renamed_not_merged_into_one_session(beam_folder: Path, tmp_path: Path) -> None:
    """Batches numbered 1, 1, 3 became two store sessions: both batch-1's turns merged into one session."""
    folder = tmp_path / "100K" / "3"
    shutil.copytree(beam_folder / "3", folder)
    chat = json.loads((folder / "chat.json").read_text())
    chat[1]["batch_number"] = 1
    (folder / "chat.json").write_text(json.dumps(chat))
    benchmark = load_benchmark("beam", folder)
    real = load_benchmark("beam", beam_folder / "3")
    assert [(s.session_id, len(s.turns)) for s in benchmark.memories[0].sessions] == [
        ("batch-1", 58), ("batch-1#1", 64), ("batch-3", 72)]
    assert [t.turn_id for t in benchmark.memories[0].turns()] == [t.turn_id for t in real.memories[0].turns()]
    renamed = {"batch-2": "batch-1#1"}
    assert [q.evidence_sessions for q in benchmark.questions()] == [
        [renamed.get(s, s) for s in q.evidence_sessions] for q in real.questions()]
    assert benchmark.problems == ["beam 3: batch number repeated: later batches renamed ('batch-1' -> 'batch-1#1')"]


def test_a_key_written_twice_in_the_hubs_questions_literal_is_an_error(tmp_path: Path) -> None:
    """The hub's probing_questions string is read with ast.literal_eval, which keeps the last of a repeated key:
    a second `'abstention'` list replaced the first without a word."""
    chat = [[{"role": "user", "id": 0, "content": "hi ->-> 1,1", "time_anchor": "March-15-2024"}]]
    one = "[{'question': 'q', 'answer': 'a', 'rubric': ['r']}]"
    path = _write_parquet(tmp_path / "hub" / "100K.parquet", [{"conversation_id": "9", "chat": chat,
                                                               "probing_questions": f"{{'abstention': {one},\n"
                                                                                    f" 'abstention': {one}}}"}])
    with pytest.raises(DataError) as info:
        load_benchmark("beam", path)
    assert str(info.value) == (f"{path}, item conversation 9, field 'probing_questions': key 'abstention' appears "
                               "twice in the dict at line 2 (the literal would keep the last value and lose the first "
                               "silently)")


def test_evidence_from_references_and_undated_batches(tmp_path: Path) -> None:
    """Without source_chat_ids, the `chat_id N` mentions of conversation_references are the evidence; a batch
    without a readable anchor takes the date before it."""
    folder = tmp_path / "1"
    (folder / "probing_questions").mkdir(parents=True)
    message = {"role": "user", "content": "Plan my week ->-> 1,1", "question_type": "main_question", "index": "1,1"}
    chat = [{"batch_number": 1, "time_anchor": None, "turns": [[dict(message, id=0, time_anchor="May-02-2024"),
                                                                {"role": "assistant", "id": 1, "content": "Sure."}]]},
            {"batch_number": 2, "time_anchor": "soon", "turns": [[dict(message, id=2),
                                                                  {"role": "assistant", "id": 3, "content": "Ok."}]]}]
    (folder / "chat.json").write_text(json.dumps(chat))
    questions = {"knowledge_update": [{"question": "q", "answer": "a", "rubric": ["r"],
                                       "conversation_references": ["chat_id: 2", "Session 4: text", "chat_id 9"]}]}
    (folder / "probing_questions" / "probing_questions.json").write_text(json.dumps(questions))
    benchmark = load_benchmark("beam", folder)
    question = benchmark.questions()[0]
    assert (question.evidence, question.evidence_sessions) == (["2", "9"], ["batch-2"])
    assert question.extra["evidence_from"] == "conversation_references"
    assert [s.timestamp for s in benchmark.memories[0].sessions] == ["2024-05-02T00:00:00"] * 2
    assert benchmark.problems == [
        "beam 1: batches without a readable time anchor take the date of the batch before (the first such the next "
        "dated one): batch-2 ('soon')",
        "beam 1: evidence naming no message of the conversation: kept (1:knowledge_update:0 ['9'])",
    ]


# ------------------------------------------------------------------------------------------------- fetch
def test_catalogue_pins_the_repository(shared_data: Path) -> None:
    """`memfit data fetch beam` brings a split's folders and BEAM's prompt files from the repository at commit
    b2a3ee8: the 100K files are the ones in ../shared (same sha256 and size); the two source files every split
    brings; the largest files, which the catalogue could only name by their git blob id, are checked by it."""
    shared = dict(reversed(line.split()) for line in (shared_data / "SHA256SUMS").read_text().splitlines())
    entries = files_for("beam")
    assert len(entries) == 42
    data, prompts = entries[:40], entries[40:]
    for entry in data:
        assert entry["sha256"] == shared[f"./{entry['path']}"], entry["path"]
        assert entry["size"] == (shared_data / entry["path"]).stat().st_size
        assert entry["url"] == ("https://raw.githubusercontent.com/mohammadtavakoli78/BEAM/"
                                f"b2a3ee8ba12d68f83143dda191097dc3e028ddd3/chats/{entry['path'].removeprefix('beam/')}")
    assert [(e["path"], e["size"]) for e in prompts] == [("beam/src/prompts.py", 633_462),
                                                        ("beam/src/evaluation/compute_metrics.py", 19_806)]
    assert [len(files_for("beam", s)) for s in ("500K", "1M", "10M")] == [72, 72, 22]
    by_blob = [e for s in ("1M", "10M") for e in files_for("beam", s) if "git_blob" in e]
    assert len(by_blob) == 36 and all("sha256" not in e for e in by_blob)
    assert {e["path"].rsplit("/", 1)[1] for e in by_blob} == {"chat.json"}
    with pytest.raises(ValueError, match="unknown BEAM split '2M': choose one of 100K, 10M, 1M, 500K"):
        files_for("beam", "2M")


def test_git_blob_verification(served, tmp_path: Path) -> None:
    base, www = served
    (www / "chat.json").write_bytes(b'[{"batch_number": 1}]\n')
    expected = subprocess.run(["git", "hash-object", str(www / "chat.json")], capture_output=True, text=True,
                              check=True).stdout.strip()
    assert git_blob_of(www / "chat.json") == expected  # git's own id for the bytes
    target = tmp_path / "cache" / "chat.json"
    assert download_verified(f"{base}/chat.json", target, None, progress=False, git_blob=expected) == target
    assert target.read_bytes() == (www / "chat.json").read_bytes()
    with pytest.raises(FetchError, match="git blob id mismatch: expected 0{40}, got " + expected):
        download_verified(f"{base}/chat.json", tmp_path / "other.json", None, progress=False, git_blob="0" * 40)
    assert not (tmp_path / "other.json").exists() and not (tmp_path / "other.json.part").exists()


def test_fetch_from_a_mirror(shared_data: Path, tmp_path: Path) -> None:
    """The 40 files of the 100K split come from a mirror verified; the prompt files, which ../shared does not
    ship, are then missing from it: the error names the file and nothing partial is left."""
    dest = tmp_path / "cache"
    with pytest.raises(FetchError, match=r"beam/src/prompts.py: download failed"):
        fetch_benchmark("beam", dest, mirror=str(shared_data), progress=False)
    got = sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file())
    assert len(got) == 40 and got[0] == "beam/100K/1/chat.json"
    assert len(load_benchmark("beam", dest).questions()) == 400  # the cache is laid out like a data folder
