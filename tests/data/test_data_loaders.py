"""Loaders on the real benchmark files (../shared/data) and on small broken fixtures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memfit_gpu.cli import main
from memfit_gpu.config import ConfigError, DataConfig
from memfit_gpu.data import (
    DataNotFoundError,
    load_benchmark,
    resolve_data_path,
    select_from_config,
    select_questions,
)
from memfit_gpu.data._read import parse_iso_day, parse_locomo_date, parse_longmemeval_date
from memfit_gpu.data.locomo import parse_evidence
from memfit_gpu.data.schema import HUGE_TURN_CHARS, Benchmark, DataError, Image, written_turn_id


@pytest.fixture(scope="module")
def locomo(locomo_path: Path) -> Benchmark:
    return load_benchmark("locomo", locomo_path)


@pytest.fixture(scope="module")
def memgallery(shared_data: Path) -> Benchmark:
    return load_benchmark("memgallery", shared_data / "memgallery" / "dialog")


@pytest.fixture(scope="module")
def longmemeval(shared_data: Path) -> Benchmark:
    return load_benchmark("longmemeval", shared_data / "longmemeval" / "longmemeval_oracle_sample47.json")


def _counts(benchmark: Benchmark) -> tuple[int, int, int, int, int]:
    questions = benchmark.questions()
    return (
        len(benchmark.memories),
        sum(len(m.sessions) for m in benchmark.memories),
        sum(len(m.turns()) for m in benchmark.memories),
        len(questions),
        sum(q.evaluated for q in questions),
    )


# ---------------------------------------------------------------- LoCoMo


def test_locomo_acceptance_counts(locomo: Benchmark) -> None:
    assert _counts(locomo) == (10, 272, 5882, 1986, 1540)
    assert [m.memory_id for m in locomo.memories][:2] == ["conv-26", "conv-30"]


def test_locomo_sessions_come_from_session_keys_not_date_keys(locomo: Benchmark) -> None:
    conv26 = locomo.memories[0]
    # conv-26 has 35 session_N_date_time keys but only 19 sessions.
    assert [s.session_id for s in conv26.sessions] == [f"session_{n}" for n in range(1, 20)]
    first = conv26.sessions[0]
    assert (first.date_text, first.timestamp) == ("1:56 pm on 8 May, 2023", "2023-05-08T13:56:00")
    turn = first.turns[0]
    assert (turn.turn_id, turn.speaker, turn.text) == (
        "D1:1",
        "Caroline",
        "Hey Mel! Good to see you! How have you been?",
    )
    assert (turn.timestamp, turn.date_text) == ("2023-05-08T13:56:00", "1:56 pm on 8 May, 2023")
    assert conv26.speakers == ["Caroline", "Melanie"]
    assert sum(len(m.questions) for m in locomo.memories[:2]) == 199 + 105


def test_locomo_images(locomo: Benchmark) -> None:
    images = [i for m in locomo.memories for t in m.turns() for i in t.images]
    assert len(images) == 1226  # every blip_caption
    assert sum(i.path is not None for i in images) == 910  # every img_url list
    assert all(i.image_id is None for i in images)
    d1_5 = next(t for t in locomo.memories[0].turns() if t.turn_id == "D1:5")
    assert d1_5.images == [
        Image(
            caption="a photo of a dog walking past a wall with a painting of a woman",
            image_id=None,
            path="https://i.redd.it/l7hozpetnhlb1.jpg",
        )
    ]
    assert d1_5.extra["image_query"] == "transgender pride flag mural"


def test_locomo_questions_answers_and_categories(locomo: Benchmark) -> None:
    questions = {q.question_id: q for q in locomo.questions()}
    q1 = questions["conv-26:q1"]
    assert (q1.question, q1.answer, q1.category) == (
        "When did Melanie paint a sunrise?",
        "2022",
        "2",
    )  # int answer
    assert (q1.evidence, q1.evidence_sessions, q1.evaluated) == (["D1:12"], ["session_1"], True)
    by_category: dict[str, int] = {}
    for q in questions.values():
        by_category[q.category] = by_category.get(q.category, 0) + 1
    assert by_category == {"1": 282, "2": 321, "3": 96, "4": 841, "5": 446}
    assert all(q.evaluated == (q.category != "5") for q in questions.values())
    adversarial_only = [q for q in questions.values() if q.extra.get("answer_from") == "adversarial_answer"]
    assert len(adversarial_only) == 444
    assert all(q.answer == q.extra["adversarial_answer"] and q.category == "5" for q in adversarial_only)
    # Two category-5 items carry both: the real answer wins, the adversarial one stays in extra.
    both = questions["conv-26:q167"]
    assert (both.answer, both.extra["adversarial_answer"]) == ("No", "Yes")
    assert "answer_from" not in both.extra


def test_locomo_problems_report_every_quirk(locomo: Benchmark) -> None:
    problems = locomo.problems
    assert len(problems) == 15
    assert problems[0] == (
        "locomo conv-26: 16 session_N_date_time keys with no session_N (sessions 20..35): ignored"
    )
    expected_lines = {
        "locomo conv-26:q37: evidence 'D8:6; D9:17' read as ['D8:6', 'D9:17']",
        "locomo conv-42:q88: evidence 'D' nothing readable, dropped unreadable ['D']",
        "locomo conv-43:q18: evidence 'D:11:26' read as ['D11:26']",
        "locomo conv-50:q69: evidence 'D30:05' read as ['D30:5']",
        "locomo conv-49:q31: evidence 'D9:1 D4:4 D4:6' read as ['D9:1', 'D4:4', 'D4:6']",
        "locomo conv-42:q58: evidence D10:19 names no turn of conv-42: kept",
        "locomo conv-47:q38: evidence D4:36 names no turn of conv-47: kept",
    }
    assert expected_lines <= set(problems)
    assert sum("no evidence given" in p for p in problems) == 4
    assert sum(" read as " in p or "nothing readable" in p for p in problems) == 7
    assert problems[-1].startswith("locomo: 444 category-5 questions have only 'adversarial_answer'")

    questions = {q.question_id: q for q in locomo.questions()}
    assert questions["conv-26:q37"].evidence == ["D8:6", "D9:17"]
    assert questions["conv-26:q37"].extra["evidence_raw"] == ["D8:6; D9:17"]
    assert questions["conv-26:q37"].evidence_sessions == ["session_8", "session_9"]
    assert questions["conv-42:q88"].evidence == ["D1:18", "D1:20"]  # raw ['D1:18', 'D', 'D1:20']
    assert questions["conv-42:q88"].extra["evidence_raw"] == ["D1:18", "D", "D1:20"]
    assert questions["conv-43:q18"].evidence == [
        "D1:14",
        "D2:7",
        "D4:7",
        "D5:15",
        "D11:26",
        "D20:21",
        "D26:36",
    ]
    assert questions["conv-50:q69"].evidence == ["D30:5"]
    assert questions["conv-26:q30"].evidence == []


@pytest.mark.parametrize(
    ("raw", "ids", "unreadable"),
    [
        ("D3:7", ["D3:7"], []),
        ("D8:6; D9:17", ["D8:6", "D9:17"], []),
        ("D9:1 D4:4 D4:6", ["D9:1", "D4:4", "D4:6"], []),
        ("D", [], ["D"]),
        ("D:11:26", ["D11:26"], []),
        ("D30:05", ["D30:5"], []),
        ("", [], []),
        ("D1:2, x", ["D1:2"], ["x"]),
    ],
)
def test_parse_evidence(raw: str, ids: list[str], unreadable: list[str]) -> None:
    assert parse_evidence(raw) == (ids, unreadable)


def test_date_parsers() -> None:
    assert parse_locomo_date("1:56 pm on 8 May, 2023") == "2023-05-08T13:56:00"
    assert parse_locomo_date("12:05 am on 1 January, 2023") == "2023-01-01T00:05:00"
    assert parse_locomo_date("12:30 pm on 31 December, 2022") == "2022-12-31T12:30:00"
    assert parse_locomo_date("10:04 AM on 19 Dec, 2023") == "2023-12-19T10:04:00"
    assert parse_locomo_date("1:56 pm on 31 February, 2023") is None
    assert parse_locomo_date("8 May 2023") is None
    assert parse_longmemeval_date("2023/05/27 (Sat) 21:08") == "2023-05-27T21:08:00"
    assert parse_longmemeval_date("2023/05/27") == "2023-05-27T00:00:00"
    assert parse_longmemeval_date("27/05/2023 (Sat) 21:08") is None
    assert parse_iso_day("2024-06-17") == "2024-06-17T00:00:00"
    assert parse_iso_day("2024-13-17") is None


# ---------------------------------------------------------------- LongMemEval


def test_longmemeval_acceptance_counts(longmemeval: Benchmark) -> None:
    assert _counts(longmemeval) == (47, 86, 1011, 47, 47)
    assert all(m.memory_id == m.questions[0].question_id for m in longmemeval.memories)
    assert longmemeval.problems == []


def test_longmemeval_sessions_sorted_by_date_and_evidence(longmemeval: Benchmark) -> None:
    memory = next(m for m in longmemeval.memories if m.memory_id == "gpt4_93f6379c")
    # File order is _2 (13:14), _1 (03:59), _3 (20:31).
    assert [(s.session_id, s.timestamp) for s in memory.sessions] == [
        ("answer_544fe66c_1", "2023-05-25T03:59:00"),
        ("answer_544fe66c_2", "2023-05-25T13:14:00"),
        ("answer_544fe66c_3", "2023-05-25T20:31:00"),
    ]
    assert memory.sessions[0].date_text == "2023/05/25 (Thu) 03:59"
    question = memory.questions[0]
    assert question.evidence == ["answer_544fe66c_2:1", "answer_544fe66c_3:1"]  # turns with has_answer
    assert question.evidence_sessions == ["answer_544fe66c_2", "answer_544fe66c_1", "answer_544fe66c_3"]
    assert (question.question_date, question.extra["question_date_text"]) == (
        "2023-05-25T07:58:00",
        "2023/05/25 (Thu) 07:58",
    )
    assert (question.answer, question.category, question.abstention) == (
        "Page Turners",
        "temporal-reasoning",
        False,
    )
    first = memory.sessions[0].turns[0]
    assert (first.turn_id, first.speaker) == ("answer_544fe66c_1:1", "user")
    assert [t.speaker for t in memory.sessions[0].turns[:2]] == ["user", "assistant"]
    assert memory.speakers == ["user", "assistant"]


def test_longmemeval_answers_and_abstention(longmemeval: Benchmark) -> None:
    questions = {q.question_id: q for q in longmemeval.questions()}
    assert questions["157a136e"].answer == "43"  # an integer in the file
    assert [q for q in questions if questions[q].abstention] == ["gpt4_fe651585_abs"]
    categories: dict[str, int] = {}
    for q in questions.values():
        categories[q.category] = categories.get(q.category, 0) + 1
    assert categories == {
        "temporal-reasoning": 13, "knowledge-update": 10, "multi-session": 8,
        "single-session-preference": 8, "single-session-user": 4, "single-session-assistant": 4,
    }  # fmt: skip


def test_longmemeval_folder_reads_all_sample_files(shared_data: Path) -> None:
    benchmark = load_benchmark("longmemeval", shared_data / "longmemeval")
    assert _counts(benchmark)[0] == 49
    assert sum(q.abstention for q in benchmark.questions()) == 2


def _lme_record(question_id: str, dates: list[str], has_answer: list[bool]) -> dict:
    return {
        "question_id": question_id,
        "question_type": "single-session-user",
        "question": "q?",
        "answer": 7,
        "question_date": "2023/06/01 (Thu) 10:00",
        "haystack_session_ids": [f"s{i}" for i in range(len(dates))],
        "haystack_dates": dates,
        "haystack_sessions": [
            [
                {"role": "user", "content": f"turn of s{i}", "has_answer": flag},
                {"role": "assistant", "content": "ok"},
            ]
            for i, flag in enumerate(has_answer)
        ],
        "answer_session_ids": ["s1"],
    }


def test_longmemeval_sort_is_stable_and_duplicates_skipped(tmp_path: Path) -> None:
    dates = ["2023/05/02 (Tue) 09:00", "2023/05/01 (Mon) 09:00", "2023/05/02 (Tue) 09:00"]
    records = [_lme_record("a", dates, [False, True, False]), _lme_record("a", dates, [False, True, False])]
    records.append(_lme_record("c", dates[:1], [True]))  # answer_session_ids ["s1"] is not in its haystack
    path = tmp_path / "longmemeval_oracle.json"
    path.write_text(json.dumps(records))
    benchmark = load_benchmark("longmemeval", path)
    assert [m.memory_id for m in benchmark.memories] == ["a", "c"]
    assert [s.session_id for s in benchmark.memories[0].sessions] == [
        "s1",
        "s0",
        "s2",
    ]  # s0, s2 tie: file order
    assert benchmark.memories[0].questions[0].evidence == ["s1:1"]
    assert benchmark.memories[0].questions[0].answer == "7"
    assert benchmark.problems == [
        "longmemeval longmemeval_oracle.json item 1: question_id 'a' already loaded (the same record): skipped",
        "longmemeval c: answer_session_ids ['s1'] are not in the haystack: kept",
    ]


def test_two_different_longmemeval_records_with_one_question_id_are_an_error_naming_both(tmp_path: Path) -> None:
    """The second record was skipped with only a problem line: which of the two was the question depended on
    file order. An identical copy (sample files may share a record) is still skipped."""
    day = ["2023/05/01 (Mon) 09:00"]
    other = _lme_record("a", day, [True]) | {"answer": 8}
    path = _write(tmp_path, "lme.json", [_lme_record("a", day, [True]), _lme_record("b", day, [True]), other])
    with pytest.raises(DataError) as info:
        load_benchmark("longmemeval", path)
    assert str(info.value) == (f"{path}, item 2, field 'question_id': 'a' is also the question_id of item 0, a "
                               "different record: each question needs its own id")
    folder = tmp_path / "samples"
    folder.mkdir()
    first = _write(folder, "a.json", [_lme_record("a", day, [True])])
    second = _write(folder, "b.json", [_lme_record("b", day, [True]), other])
    with pytest.raises(DataError) as info:
        load_benchmark("longmemeval", folder)
    assert str(info.value) == (f"{second}, item 1, field 'question_id': 'a' is also the question_id of item 0 of "
                               f"{first}, a different record: each question needs its own id")
    second.write_text(json.dumps([_lme_record("b", day, [True]), _lme_record("a", day, [True])]))
    benchmark = load_benchmark("longmemeval", folder)
    assert [m.memory_id for m in benchmark.memories] == ["a", "b"]
    assert "longmemeval b.json item 1: question_id 'a' already loaded (the same record): skipped" in benchmark.problems


def test_longmemeval_folder_prefers_official_split(tmp_path: Path) -> None:
    (tmp_path / "longmemeval_oracle.json").write_text(
        json.dumps([_lme_record("o", ["2023/05/01 (Mon) 09:00"], [True])])
    )
    (tmp_path / "longmemeval_s_cleaned.json").write_text(
        json.dumps([_lme_record("s", ["2023/05/01 (Mon) 09:00"], [True])])
    )
    assert resolve_data_path("longmemeval", tmp_path) == [tmp_path / "longmemeval_s_cleaned.json"]
    assert load_benchmark("longmemeval", tmp_path, split="oracle").memories[0].memory_id == "o"
    with pytest.raises(DataNotFoundError, match="memfit data fetch longmemeval"):
        load_benchmark("longmemeval", tmp_path, split="m")


# ---------------------------------------------------------------- MemGallery


def test_memgallery_acceptance_counts(memgallery: Benchmark) -> None:
    assert _counts(memgallery) == (20, 240, 3962, 1711, 1711)
    images = [i for m in memgallery.memories for t in m.turns() for i in t.images]
    assert len(images) == 1003
    assert sum(q.image is not None for q in memgallery.questions()) == 487
    assert len(memgallery.problems) == 3
    assert memgallery.problems[1] == (
        "memgallery Education_Career_Research_Lifestyle:q82: VS answer '3' does not name only images "
        "of the scenario: kept as written"
    )


def test_memgallery_rounds_images_and_speakers(memgallery: Benchmark) -> None:
    memory = memgallery.memories[0]
    assert memory.memory_id == "AI_Robotics_Automation_Future_Tech"
    assert memory.speakers == ["User", "Julian Vance"]
    assert memory.extra["character_profile"]["name"] == "Julian Vance"
    session = memory.sessions[0]
    assert (session.session_id, session.date_text, session.timestamp) == (
        "D1",
        "2024-06-17",
        "2024-06-17T00:00:00",
    )
    turn = session.turns[2]
    user = "Can it play a role in the medical field?"
    assert (turn.turn_id, turn.speaker, turn.extra["user"]) == ("D1:3", "User", user)
    assert turn.text == f"{user} | Assistant: {turn.extra['assistant']}"
    assert turn.extra["assistant"].startswith("Absolutely. AI already assists doctors")
    assert len(turn.images) == 1
    assert (turn.images[0].image_id, turn.images[0].path) == (
        "D1:IMG_001",
        "../image/AI_Robotics_Automation_Future_Tech/D1_IMG_001.jpg",
    )
    assert turn.images[0].caption.startswith("Futuristic hospital operating room")


def test_memgallery_questions_clues_and_question_images(memgallery: Benchmark) -> None:
    questions = memgallery.memories[0].questions
    vs = questions[0]
    assert (vs.question_id, vs.category, vs.answer) == (
        "AI_Robotics_Automation_Future_Tech:q0",
        "VS",
        "D1:IMG_002",
    )
    assert (vs.evidence, vs.evidence_sessions, vs.extra["answer_image_ids"]) == (
        ["D1:4"],
        ["D1"],
        ["D1:IMG_002"],
    )
    vr = questions[31]
    assert (vr.category, vr.answer, vr.evidence, vr.evidence_sessions) == (
        "VR",
        "2024-09-10",
        ["D6:1", "D6:2"],
        ["D6"],
    )
    assert vr.image is not None
    assert vr.image.path == "../image/AI_Robotics_Automation_Future_Tech/QA_IMG_001.png"
    assert vr.image.caption.startswith("Cartoon robot artist wearing a brown beret")
    assert vr.image.image_id is None
    # AR questions carry no clue rounds; every other point does.
    assert {q.category for q in memgallery.questions() if not q.evidence} == {"AR"}


def test_memgallery_text_without_assistant_reply(tmp_path: Path) -> None:
    scenario = {
        "multi_session_dialogues": [
            {
                "session_id": "D1",
                "date": "2024-01-02",
                "dialogues": [{"round": "D1:1", "user": "hi", "assistant": ""}],
            }
        ],
        "human-annotated QAs": [
            {"point": "FR", "question": "?", "answer": 5, "session_id": "D1", "clue": ["D1:1"]}
        ],
    }
    (tmp_path / "one.json").write_text(json.dumps(scenario))
    benchmark = load_benchmark("memgallery", tmp_path)
    turn = benchmark.memories[0].sessions[0].turns[0]
    assert (turn.text, turn.images, benchmark.memories[0].speakers) == ("hi", [], ["User"])
    question = benchmark.memories[0].questions[0]
    assert (question.answer, question.evidence_sessions) == ("5", ["D1"])


# ---------------------------------------------------------------- broken files


def _write(tmp_path: Path, name: str, content: object) -> Path:
    path = tmp_path / name
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


def _locomo_sample() -> dict:
    return {
        "sample_id": "c1",
        "conversation": {
            "speaker_a": "A",
            "speaker_b": "B",
            "session_1_date_time": "1:56 pm on 8 May, 2023",
            "session_1": [{"speaker": "A", "dia_id": "D1:1", "text": "hello"}],
        },
        "qa": [{"question": "q?", "answer": "a", "evidence": ["D1:1"], "category": 4}],
    }


def test_broken_json_names_the_file(tmp_path: Path) -> None:
    path = _write(tmp_path, "locomo10.json", '[{"sample_id": ')
    with pytest.raises(DataError, match=r"locomo10\.json: not valid JSON") as info:
        load_benchmark("locomo", path)
    assert info.value.file == str(path)


@pytest.mark.parametrize(
    ("edit", "item", "field_name", "reason"),
    [
        (lambda s: s["conversation"]["session_1"][0].pop("text"), 1, "conversation.session_1[0].text", "missing"),
        (lambda s: s["qa"][0].update(question=3), 1, "qa[0].question", "expected str, got int"),
        (lambda s: s["qa"][0].update(answer=["a"]), 1, "qa[0].answer", "expected str or int, got list"),
        (lambda s: s["qa"][0].pop("answer"), 1, "qa[0].answer", "missing"),
        (lambda s: s["qa"][0].update(evidence=[3]), 1, "qa[0].evidence[0]", "expected str, got int"),
        (lambda s: s["conversation"].pop("session_1_date_time"), 1, "conversation.session_1_date_time", "missing"),
        (lambda s: s["conversation"].update(session_1_date_time="May 8"), 1, "conversation.session_1_date_time",
         "is not like"),
        (lambda s: s.pop("qa"), 1, "qa", "missing"),
        # a label outside LoCoMo's five loaded as a sixth category, averaged into the category means
        (lambda s: s["qa"][0].update(category=7), 1, "qa[0].category",
         "7 is not a LoCoMo category (1 multi-hop, 2 temporal, 3 open-domain, 4 single-hop, 5 adversarial)"),
        (lambda s: s["qa"][0].update(category="adversarial"), 1, "qa[0].category", "'adversarial' is not a LoCoMo"),
        # NaN and Infinity (Python's json reads them) became the gold text "nan" / "inf"
        (lambda s: s["qa"][0].update(answer=float("nan")), 1, "qa[0].answer", "nan is not a finite number"),
        (lambda s: s["qa"][0].update(answer=None, category=5, adversarial_answer=float("-inf")), 1,
         "qa[0].adversarial_answer", "-inf is not a finite number"),
    ],
)  # fmt: skip
def test_broken_locomo_names_file_item_field(
    tmp_path: Path, edit, item: int, field_name: str, reason: str
) -> None:
    broken = _locomo_sample()
    edit(broken)
    path = _write(tmp_path, "locomo10.json", [_locomo_sample() | {"sample_id": "c0"}, broken])
    with pytest.raises(DataError) as info:
        load_benchmark("locomo", path)
    assert (info.value.file, info.value.item, info.value.field) == (str(path), item, field_name)
    assert reason in str(info.value)
    assert str(info.value).startswith(f"{path}, item {item}, field {field_name!r}: ")


def test_json_error_message_reads_once(tmp_path: Path) -> None:
    path = _write(tmp_path, "locomo10.json", '[{"sample_id": "c1')
    with pytest.raises(DataError) as info:
        load_benchmark("locomo", path)
    assert str(info.value) == f"{path}: not valid JSON (Unterminated string starting at line 1 column 16)"


def test_a_key_written_twice_in_a_benchmark_file_is_an_error_naming_the_key_and_its_object(tmp_path: Path) -> None:
    """Python's json keeps the last of a repeated key: `"answer": "Rex", "answer": "Max"` loaded as Max, the
    first value lost without a word."""
    text = json.dumps([_locomo_sample()], indent=1).replace('"answer": "a"', '"answer": "Rex", "answer": "Max"')
    path = _write(tmp_path, "locomo10.json", text)
    assert text.split("\n")[16] == "   {"  # line 17: the "{" of the object that repeats the key
    with pytest.raises(DataError) as info:
        load_benchmark("locomo", path)
    assert str(info.value) == (f"{path}, field 'answer': written twice in the object at line 17 column 4 (JSON "
                               "would keep the last value and lose the first silently)")
    # one line, as MemGallery's files are: the column finds the object
    scenario = json.dumps(_scenario()).replace('"user": "hi"', '"user": "hi", "user": "bye"')
    column = scenario.index('{"round": "D1:1"') + 1
    path = _write(tmp_path, "one.json", scenario)
    with pytest.raises(DataError) as info:
        load_benchmark("memgallery", path)
    assert str(info.value) == (f"{path}, field 'user': written twice in the object at line 1 column {column} (JSON "
                               "would keep the last value and lose the first silently)")


def test_json_errors_name_the_position_once_in_every_reader(tmp_path: Path, capsys) -> None:
    """jsonl lines and predictions files printed "Unterminated string starting at at column 13"."""
    from memfit_gpu.evaluate.compare import PredictionsError, read_predictions

    own = _write(tmp_path, "own.jsonl", '{"user_id": "u\n')
    with pytest.raises(DataError) as info:
        load_benchmark("jsonl", own)
    assert str(info.value) == f"{own}, item line 1: not valid JSON (Unterminated string starting at column 13)"
    predictions = _write(tmp_path, "predictions.jsonl", '{"question_id": "q')
    with pytest.raises(PredictionsError) as info:
        read_predictions(predictions)
    assert str(info.value) == f"{predictions}:1: not valid JSON (Unterminated string starting at column 17)"
    assert main(["data", "validate", str(tmp_path / "missing.jsonl")]) == 2
    assert capsys.readouterr().err == f"memfit data: error: {tmp_path / 'missing.jsonl'}: no such file\n"


def test_locomo_turn_quirks_are_reported(tmp_path: Path) -> None:
    sample = _locomo_sample()
    sample["conversation"]["session_1"] = [
        {"speaker": "A", "dia_id": "D1:1", "text": "hello"},
        {"speaker": "B", "dia_id": "D1:1", "text": "a second D1:1"},
        {"speaker": "A", "dia_id": "D1:2", "text": "   "},
        {"speaker": "B", "dia_id": "D1:1", "text": "x" * (HUGE_TURN_CHARS + 1)},
        {"speaker": "A", "dia_id": "D1:1#dup3", "text": "an id like a renamed one"},
    ]
    benchmark = load_benchmark("locomo", _write(tmp_path, "locomo10.json", [sample]))
    memory = benchmark.memories[0]
    # later carriers of a repeated id get #dup<n>, skipping an id the file already uses
    assert [t.turn_id for t in memory.turns()] == ["D1:1", "D1:1#dup2", "D1:2", "D1:1#dup4", "D1:1#dup3"]
    assert [written_turn_id(t.turn_id) for t in memory.turns()] == ["D1:1", "D1:1", "D1:2", "D1:1", "D1:1"]
    assert memory.questions[0].evidence == ["D1:1"]  # as written: diagnostics match every carrier
    assert benchmark.problems == [
        f"locomo c1: turn D1:1 holds {HUGE_TURN_CHARS + 1:,} characters (more than {HUGE_TURN_CHARS:,}): kept; "
        "its excerpt is cut to pack.max_excerpt_chars",
        "locomo c1: turn ids repeated within the memory, later turns renamed (D1:1 -> D1:1#dup2, "
        "D1:1 -> D1:1#dup4); evidence naming such an id matches every turn that carries it",
        "locomo c1: 1 empty turn (D1:2): kept",
    ]


def test_empty_questions_gold_answers_and_conversations_are_quirks_excluded_from_scoring(tmp_path: Path) -> None:
    """An empty conversation, an empty gold answer ("", "   ") and an empty question were
    accepted and scored with no quirk. Each is reported, counted and never selected for a run."""
    sample = _locomo_sample()
    sample["qa"] = [{"question": "q?", "answer": "a", "evidence": ["D1:1"], "category": 4},
                    {"question": "q2?", "answer": "", "evidence": ["D1:1"], "category": 4},
                    {"question": "q3?", "answer": "   ", "evidence": ["D1:1"], "category": 1},
                    {"question": "  ", "answer": "a", "evidence": ["D1:1"], "category": 2}]
    silent = _locomo_sample()
    silent["sample_id"] = "c2"
    silent["conversation"]["session_1"] = [{"speaker": "A", "dia_id": "D1:1", "text": " "}]
    benchmark = load_benchmark("locomo", _write(tmp_path, "locomo10.json", [sample, silent]))
    assert [p for p in benchmark.problems if "excluded" in p] == [
        "locomo c1: the gold answer is empty for 2 questions (c1:q1, c1:q2): excluded from scoring",
        "locomo c1: the question is empty for 1 question (c1:q3): excluded from scoring",
        "locomo c2: the conversation is empty for 1 question (c2:q0): excluded from scoring",
    ]
    assert [q.question_id for q in benchmark.questions() if q.evaluated] == ["c1:q0"]
    assert benchmark.questions()[1].extra["excluded"] == "the gold answer is empty"
    for selected in (select_questions(benchmark), select_questions(benchmark, include_categories=["1", "2", "4"])):
        assert [q.question_id for q in selected.questions()] == ["c1:q0"]
    from memfit_gpu.data.stats import benchmark_stats

    stats = benchmark_stats(benchmark)
    assert (stats["evaluated_questions"], stats["excluded_questions"]) == (1, 4)


def test_a_question_without_gold_is_never_scored_whichever_categories_are_selected(tmp_path: Path) -> None:
    """A category-5 question with neither `answer` nor `adversarial_answer` was left out of the check for an
    empty gold answer (category 5 is not scored by default); `exclude_categories=[]` then scored it against ""."""
    sample = _locomo_sample()
    sample["qa"] += [{"question": "q5?", "adversarial_answer": "trap", "evidence": ["D1:1"], "category": 5},
                     {"question": "q5 bare?", "evidence": ["D1:1"], "category": 5}]
    benchmark = load_benchmark("locomo", _write(tmp_path, "locomo10.json", [sample]))
    bare = benchmark.questions()[2]
    assert (bare.answer, bare.evaluated, bare.extra) == ("", False, {"answer_from": "missing",
                                                                      "excluded": "the gold answer is empty"})
    assert benchmark.problems == [
        "locomo c1: the gold answer is empty for 1 question (c1:q2): excluded from scoring",
        "locomo: 1 category-5 questions have only 'adversarial_answer': answer set to it, kept in "
        "extra['adversarial_answer'] (category 5 is not evaluated)",
    ]
    for selected in (select_questions(benchmark, exclude_categories=[]), select_questions(benchmark,
                                                                                          include_categories=["5"])):
        assert [(q.question_id, q.answer, q.evaluated) for q in selected.questions() if q.category == "5"] == [
            ("c1:q1", "trap", True)]


def test_longmemeval_system_role_and_empty_turn_are_reported(tmp_path: Path) -> None:
    record = _lme_record("a", ["2023/05/01 (Mon) 09:00"], [True])
    record["haystack_sessions"][0].insert(0, {"role": "system", "content": "You are a helpful assistant."})
    record["haystack_sessions"][0][2]["content"] = ""
    benchmark = load_benchmark("longmemeval", _write(tmp_path, "lme.json", [record]))
    assert [t.speaker for t in benchmark.memories[0].turns()] == ["system", "user", "assistant"]
    assert benchmark.problems == [
        "longmemeval a: answer_session_ids ['s1'] are not in the haystack: kept",
        "longmemeval a: turns with role 'system' (not user or assistant): kept, the role is the speaker",
        "longmemeval a: 1 empty turn (s0:3): kept",
    ]


def test_memgallery_repeated_round_is_reported(tmp_path: Path) -> None:
    scenario = _scenario()
    rounds = scenario["multi_session_dialogues"][0]["dialogues"]
    rounds.append(dict(rounds[0]))
    benchmark = load_benchmark("memgallery", _write(tmp_path, "one.json", scenario))
    ids = [t.turn_id for t in benchmark.memories[0].turns()]
    assert ids[-1] == rounds[0]["round"] + "#dup2" and len(set(ids)) == len(ids)
    assert sum("turn ids repeated" in p for p in benchmark.problems) == 1


def test_real_benchmarks_have_no_turn_quirks(locomo: Benchmark, memgallery: Benchmark, longmemeval: Benchmark) -> None:
    """The defaults change nothing on the real files: no repeated id, empty, huge or system turn."""
    for benchmark in (locomo, memgallery, longmemeval):
        assert not [p for p in benchmark.problems if any(
            word in p for word in ("turn ids repeated", "empty turn", "characters (more than", "role"))]
        longest = max(len(t.text) for m in benchmark.memories for t in m.turns())
        assert longest < HUGE_TURN_CHARS


def test_good_locomo_fixture_loads(tmp_path: Path) -> None:
    benchmark = load_benchmark("locomo", _write(tmp_path, "locomo10.json", [_locomo_sample()]))
    assert _counts(benchmark) == (1, 1, 1, 1, 1)
    assert benchmark.problems == []


@pytest.mark.parametrize(
    ("edit", "field_name", "reason"),
    [
        (lambda r: r["haystack_dates"].pop(), "haystack_sessions", "must have the same length"),
        (lambda r: r["haystack_sessions"][0][0].update(has_answer="yes"), "haystack_sessions[0][0].has_answer",
         "expected bool, got str"),
        (lambda r: r["haystack_sessions"][0][1].pop("content"), "haystack_sessions[0][1].content", "missing"),
        (lambda r: r.update(haystack_sessions={}), "haystack_sessions", "expected list, got dict"),
        (lambda r: r.update(question_date="yesterday"), "question_date", "is not like"),
        (lambda r: r.pop("question_type"), "question_type", "missing"),
        # a mistyped question type loaded as a seventh category
        (lambda r: r.update(question_type="temporal_reasoning"), "question_type",
         "'temporal_reasoning' is not a LongMemEval question type (single-session-user, single-session-preference, "
         "single-session-assistant, multi-session, temporal-reasoning, knowledge-update); did you mean "
         "'temporal-reasoning'?"),
        (lambda r: r.update(answer=float("inf")), "answer", "inf is not a finite number"),
    ],
)  # fmt: skip
def test_broken_longmemeval_names_file_item_field(tmp_path: Path, edit, field_name: str, reason: str) -> None:
    broken = _lme_record("b", ["2023/05/01 (Mon) 09:00"], [True])
    edit(broken)
    path = _write(tmp_path, "lme.json", [_lme_record("a", ["2023/05/01 (Mon) 09:00"], [False]), broken])
    with pytest.raises(DataError) as info:
        load_benchmark("longmemeval", path)
    assert (info.value.file, info.value.item, info.value.field) == (str(path), 1, field_name)
    assert reason in str(info.value)


def test_broken_longmemeval_top_level(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="expected a list of questions, got dict"):
        load_benchmark("longmemeval", _write(tmp_path, "lme.json", {"question_id": "x"}))


def _scenario() -> dict:
    return {
        "character_profile": {"name": "Ann"},
        "multi_session_dialogues": [
            {
                "session_id": "D1",
                "date": "2024-01-02",
                "dialogues": [
                    {"round": "D1:1", "user": "hi", "assistant": "hello"},
                    {"round": "D1:2", "user": "look", "assistant": "nice", "image_id": ["D1:IMG_001"],
                     "input_image": ["../image/x/D1_IMG_001.jpg"], "image_caption": ["a cat"]},
                ],
            }
        ],
        "human-annotated QAs": [{"point": "FR", "question": "?", "answer": "a", "session_id": ["D1"], "clue": ["D1:1"]}],
    }  # fmt: skip


@pytest.mark.parametrize(
    ("edit", "item", "field_name", "reason"),
    [
        (lambda s: s.pop("human-annotated QAs"), None, "human-annotated QAs", "missing"),
        (lambda s: s["multi_session_dialogues"][0]["dialogues"][0].update(user=None), "multi_session_dialogues[0]",
         "dialogues[0].user", "missing"),
        (lambda s: s["multi_session_dialogues"][0]["dialogues"][0].update(user=["hi"]), "multi_session_dialogues[0]",
         "dialogues[0].user", "expected str, got list"),
        (lambda s: s["multi_session_dialogues"][0]["dialogues"][1]["image_caption"].append("b"),
         "multi_session_dialogues[0]", "dialogues[1].image_id", "one of each per image"),
        (lambda s: s["multi_session_dialogues"][0].update(date="Jan 2"), "multi_session_dialogues[0]", "date",
         "is not like"),
        (lambda s: s["human-annotated QAs"][0].update(question_image="q.png"), "human-annotated QAs[0]",
         "image_caption", "missing"),
        (lambda s: s["human-annotated QAs"][0].update(clue=[1]), "human-annotated QAs[0]", "clue",
         "expected a list of str"),
        (lambda s: s["human-annotated QAs"][0].update(point="FRR"), "human-annotated QAs[0]", "point",
         "'FRR' is not a MemGallery point (FR, MR, TR, VR, TTL, VS, CD, KR, AR)"),
        (lambda s: s["human-annotated QAs"][0].update(answer=float("nan")), "human-annotated QAs[0]", "answer",
         "nan is not a finite number"),
    ],
)  # fmt: skip
def test_broken_memgallery_names_file_item_field(
    tmp_path: Path, edit, item, field_name: str, reason: str
) -> None:
    _write(tmp_path, "a_good.json", _scenario())
    broken = _scenario()
    edit(broken)
    path = _write(tmp_path, "b_broken.json", broken)
    with pytest.raises(DataError) as info:
        load_benchmark("memgallery", tmp_path)
    assert (info.value.file, info.value.item, info.value.field) == (str(path), item, field_name)
    assert reason in str(info.value)


# ---------------------------------------------------------------- path resolution and selection


def test_path_resolution_order(tmp_path: Path, shared_data: Path, locomo_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("MEMFIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("MEMFIT_DATA_DIR", raising=False)
    with pytest.raises(DataNotFoundError) as info:
        load_benchmark("locomo")
    assert "run `memfit data fetch locomo` or pass --path" in str(info.value)
    assert str(tmp_path / "cache" / "data") in str(info.value)

    # The cache, laid out like ../shared/data.
    cached = tmp_path / "cache" / "data" / "locomo" / "locomo10.json"
    cached.parent.mkdir(parents=True)
    cached.write_text(json.dumps([_locomo_sample()]))
    assert resolve_data_path("locomo") == [cached]

    # $MEMFIT_DATA_DIR beats the cache; an explicit path beats both.
    monkeypatch.setenv("MEMFIT_DATA_DIR", str(shared_data))
    assert resolve_data_path("locomo") == [shared_data / "locomo" / "locomo10.json"]
    assert resolve_data_path("memgallery") == sorted((shared_data / "memgallery" / "dialog").glob("*.json"))
    assert resolve_data_path("locomo", cached) == [cached]
    assert resolve_data_path("locomo", shared_data / "locomo") == [locomo_path]
    assert (
        resolve_data_path("memgallery", shared_data / "memgallery")[0].parent
        == shared_data / "memgallery" / "dialog"
    )
    with pytest.raises(DataNotFoundError, match="does not exist"):
        load_benchmark("locomo", tmp_path / "nowhere.json")
    with pytest.raises(ValueError, match="unknown benchmark 'lococo'"):
        load_benchmark("lococo")


def test_select_questions(locomo: Benchmark, longmemeval: Benchmark) -> None:
    def count(b: Benchmark) -> tuple[int, int]:
        return len(b.memories), len(b.questions())

    assert count(select_questions(locomo)) == (10, 1540)  # evaluated set: category 5 left out
    assert count(select_questions(locomo, include_categories=["5"])) == (10, 446)
    assert count(select_questions(locomo, include_categories=["4", "5"], exclude_categories=["5"])) == (
        10,
        841,
    )
    assert count(select_questions(locomo, limit_memories=2)) == (2, 152 + 81)
    assert count(select_questions(locomo, limit_questions=3)) == (10, 30)
    assert count(select_from_config(locomo, DataConfig())) == (10, 1540)
    assert count(select_from_config(locomo, DataConfig(limit_memories=1, limit_questions=5))) == (1, 5)
    # Memories left without questions are dropped before limit_memories counts.
    temporal = select_questions(longmemeval, include_categories=["temporal-reasoning"], limit_memories=20)
    assert count(temporal) == (13, 13)
    selected = select_questions(locomo, limit_memories=1)
    assert selected.memories[0].sessions is locomo.memories[0].sessions  # shared, not copied
    assert len(locomo.memories[0].questions) == 199  # the input is untouched
    with pytest.raises(ValueError, match="limit_questions must be >= 0"):
        select_questions(locomo, limit_questions=-1)


def test_a_category_list_naming_no_category_of_the_benchmark_is_refused(locomo: Benchmark, longmemeval: Benchmark,
                                                                       tmp_path: Path, caplog) -> None:
    """LoCoMo's categories are 1..5: `exclude_categories=[adversarial]` excluded nothing and scored all 1,986
    questions (category 5 too), and an unknown label in include_categories was ignored."""
    labels = "1 (multi-hop), 2 (temporal), 3 (open-domain), 4 (single-hop), 5 (adversarial)"
    with pytest.raises(ConfigError) as info:
        select_from_config(locomo, DataConfig(exclude_categories=["adversarial"]))
    assert str(info.value) == (f"data.exclude_categories: 'adversarial' is no category of locomo: its categories are "
                               f"{labels}; did you mean '5' instead of 'adversarial'?")
    with pytest.raises(ConfigError) as info:
        select_from_config(locomo, DataConfig(include_categories=["1", "2", "3", "4", "adversarial", "6"]))
    assert str(info.value) == (f"data.include_categories: '6', 'adversarial' are no categories of locomo: its "
                               f"categories are {labels}; did you mean '5' instead of 'adversarial'?")
    with pytest.raises(ConfigError, match=r"^data.include_categories: 'temporal_reasoning' is no category of "
                                          r"longmemeval: .* did you mean 'temporal-reasoning' instead"):
        select_questions(longmemeval, include_categories=["temporal_reasoning"])
    assert len(select_questions(locomo, exclude_categories=["5"]).questions()) == 1540
    assert len(select_questions(locomo, exclude_categories=[]).questions()) == 1986
    # a category the benchmark has, though no question of this file does, selects nothing
    one = load_benchmark("locomo", _write(tmp_path, "locomo10.json", [_locomo_sample()]))
    assert select_questions(one, include_categories=["5"]).questions() == []
    # own data: its labels are whatever its questions carry
    own = _write(tmp_path, "own.jsonl", json.dumps({"user_id": "u", "sessions": [{"turns": [
        {"speaker": "A", "text": "hi"}]}], "questions": [{"question": "q?", "answer": "a", "category": "who"}]}))
    with pytest.raises(ConfigError, match=r"^data.include_categories: 'what' is no category of jsonl: its categories "
                                          r"are who$"):
        select_questions(load_benchmark("jsonl", own), include_categories=["what"])
    # a MemGallery point the file holds no question of is one of its nine points all the same (its spec names
    # only four): selecting it selects nothing, and a label that is no point is refused
    gallery = Benchmark("memgallery", "test")
    assert select_questions(gallery, include_categories=["FR"]).questions() == []
    with pytest.raises(ConfigError, match=r"'FRR' is no category of memgallery: its categories are TTL "
                                          r"\(test-time learning\), .*FR, MR, TR, CD, AR; did you mean 'FR'"):
        select_questions(gallery, include_categories=["FRR"])
    # the default an older memfit wrote into every run's config.yaml still reads, with a warning
    with caplog.at_level("WARNING", logger="memfit_gpu.data"):
        assert len(select_questions(longmemeval, exclude_categories=["5"]).questions()) == 47
    assert "data.exclude_categories=['5'] names no category of longmemeval" in caplog.text


def test_a_split_the_benchmark_does_not_have_is_refused_naming_its_splits(shared_data: Path) -> None:
    """data.split was taken for any benchmark: LongMemEval's 1M raised a ValueError deep in its loader,
    LoCoMo ignored it, and BEAM with `oracle` made the device plan count no data."""
    with pytest.raises(ConfigError, match=r"data.split='1M' is no split of longmemeval: its splits are s, m, oracle"):
        resolve_data_path("longmemeval", shared_data, "1M")
    with pytest.raises(ConfigError, match=r"data.split='s' is no split of locomo: it has no splits"):
        resolve_data_path("locomo", shared_data, "s")
    with pytest.raises(ConfigError, match=r"data.split='oracle' is no split of beam: its splits are 100K"):
        resolve_data_path("beam", shared_data, "oracle")
    assert resolve_data_path("beam", shared_data, "100K")
