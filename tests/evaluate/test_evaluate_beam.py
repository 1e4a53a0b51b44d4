"""BEAM's scoring (memfit_gpu/evaluate/beam.py) against cases computed by hand, Kendall's tau-b against
scipy.stats.kendalltau (what BEAM's compute_metrics.py calls), and BEAM's prompt files parsed, never run.

The judge here is a scripted function standing in for the reader (its replies chosen per rubric item), and
the prompt files are tests/support/beam_prompts.py's stand-ins (BEAM's own come with `memfit data fetch beam`):
machinery checks, no BEAM numbers."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import pytest
from scipy.stats import kendalltau
from support.beam_prompts import write_beam_prompts

from memfit_gpu.config import BeamEvalConfig, ConfigError, load_config
from memfit_gpu.evaluate.beam import (
    Alignment,
    BeamItem,
    BeamJudge,
    align,
    event_ordering_score,
    is_match,
    kendall_tau_b,
    render_table,
    summary,
)
from memfit_gpu.readers.prompts import (
    BeamPrompts,
    PromptError,
    build_answer_messages,
    judge_kind,
    resolve_protocol,
)
from memfit_gpu.readers.types import Request, Response
from memfit_gpu.run.inputs import resolve_inputs
from memfit_gpu.sweep.aggregate import aggregate, to_markdown
from memfit_gpu.sweep.spec import load_sweep


@pytest.fixture()
def prompts(tmp_path: Path) -> BeamPrompts:
    return BeamPrompts.load(write_beam_prompts(tmp_path / "beam"))


# ------------------------------------------------------------------------------------------------ tau-b
def test_kendall_tau_b_by_hand_and_against_scipy() -> None:
    # 6 pairs, 5 concordant, 1 discordant (2 and 3 swapped): (5 - 1) / 6
    assert kendall_tau_b([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(4 / 6)
    # ties: x has one tied pair, y none: (P - Q) / sqrt(untied_x * untied_y) = (4 - 1) / sqrt(5 * 6)
    assert kendall_tau_b([1, 1, 2, 3], [1, 2, 4, 3]) == pytest.approx(3 / (5 * 6) ** 0.5)
    assert kendall_tau_b([1], [1]) is None and kendall_tau_b([2, 2, 2], [1, 2, 3]) is None
    rng = random.Random(7)
    for _ in range(300):
        n = rng.randint(2, 12)
        x = [rng.randint(1, 6) for _ in range(n)]
        y = [rng.randint(1, 6) for _ in range(n)]
        expected = kendalltau(x, y, variant="b").statistic
        got = kendall_tau_b(x, y)
        if expected != expected:  # NaN: scipy's undefined tau-b
            assert got is None, (x, y)
        else:
            assert got == pytest.approx(expected, abs=1e-12), (x, y)


def test_event_ordering_score_by_hand() -> None:
    """Reference A, B, C; the reply's lines aligned to B, A and one line that matched nothing.
    tp 2, fp 1, fn 1: P = R = F1 = 2/3. Union A B C x (ties at rank 5): reference ranks 1 2 3 5, reply ranks
    2 1 5 3: pairs AB discordant, AC AX BC BX concordant, CX discordant: tau-b (4 - 2) / 6 = 1/3."""
    score = event_ordering_score(["A", "B", "C"], ["B", "A", "x"])
    assert score["precision"] == pytest.approx(2 / 3) and score["recall"] == pytest.approx(2 / 3)
    assert score["f1"] == pytest.approx(2 / 3)
    assert score["tau_b"] == pytest.approx(1 / 3)
    assert score["tau_b"] == pytest.approx(kendalltau([1, 2, 3, 5], [2, 1, 5, 3], variant="b").statistic)
    assert score["tau_norm"] == pytest.approx(2 / 3) and score["final_score"] == pytest.approx(4 / 9)
    perfect = event_ordering_score(["A", "B", "C"], ["A", "B", "C"])
    assert (perfect["f1"], perfect["tau_norm"], perfect["final_score"]) == (1.0, 1.0, 1.0)
    reversed_order = event_ordering_score(["A", "B", "C"], ["C", "B", "A"])
    assert (reversed_order["f1"], reversed_order["tau_norm"], reversed_order["final_score"]) == (1.0, 0.0, 0.0)
    nothing = event_ordering_score(["A", "B"], ["p", "q"])
    assert (nothing["f1"], nothing["final_score"]) == (0.0, 0.0)
    single = event_ordering_score(["A"], ["A"])  # one item: tau-b undefined (scipy: NaN), counted 0
    assert single["tau_undefined"] and (single["tau_b"], single["tau_norm"], single["final_score"]) == (None, 0.0, 0.0)


def test_alignment_asks_in_align_with_llms_order() -> None:
    """For each line in turn, the unused reference items in order until one matches (first match wins, 1-to-1)."""
    asked: list[tuple[str, str]] = []

    def same(reference: str, line: str) -> bool:
        asked.append((reference, line))
        return bool(line) and reference[0] == line[0]

    assert align(["A", "B", "C"], ["B?", "", "A!", "Bb"], same) == ["B", "", "A", "Bb"]
    assert asked == [("A", "B?"), ("B", "B?"), ("A", ""), ("C", ""), ("A", "A!"), ("C", "Bb")]
    alignment = Alignment(["A"], ["x", "y"])
    assert alignment.pending() == (0, 0)
    alignment.answer(True)
    assert alignment.pending() is None and alignment.aligned == ["A", "y"] and alignment.matched == [0, None]
    assert is_match("**YES**") and is_match("yes, the same") and not is_match("NO")


# ------------------------------------------------------------------------------------------ the judge
def _judge_reply(request: Request, grades: dict[str, object]) -> str:
    """A scripted judge: a rubric request gets the grade its item is given; a match request YES when the reply
    line starts with the reference item's first letter."""
    text = request.messages[-1]["content"]
    if request.messages[0]["role"] == "system":  # llm_equivalence's two messages
        first = text.split("First snippet: ", 1)[1].split(" \n", 1)[0]
        second = text.rsplit("Second snippet: ", 1)[1].strip()
        return "YES" if second[:1] == first[:1] else "NO"
    item = text.split("RUBRIC CRITERION: ", 1)[1].split("\n", 1)[0]
    grade = grades[item]
    return grade if isinstance(grade, str) else json.dumps({"score": grade, "reason": f"graded {grade}"})


class ScriptedReader:
    def __init__(self, grades: dict[str, object], unanswered: frozenset[str] = frozenset()) -> None:
        self.grades, self.unanswered = grades, unanswered
        self.batches: list[list[Request]] = []

    def __call__(self, requests: list[Request]) -> list[Response]:
        self.batches.append(list(requests))
        return [Response(_judge_reply(r, self.grades), 10, 5, 0.01, answered=r.key not in self.unanswered)
                for r in requests]


GRADES = {"says March 29": 1.0, "says sprint 2": 0.5, "says April 19": 0.0,
          "A setup": 1.0, "B tests": 1.0, "C deployment": 0.0, "bad item": "I cannot grade this."}


def test_rubric_mean_and_partial_credit(prompts: BeamPrompts) -> None:
    item = BeamItem("judge:1:information_extraction:0", "When does the sprint end?", "information_extraction",
                    ["says March 29", "says sprint 2", "says April 19"], "March 29.\n\nThen sprint 2 starts.")
    reader = ScriptedReader(GRADES)
    (record,) = BeamJudge(prompts, BeamEvalConfig()).score([item], reader)
    assert record["rubric_score"] == pytest.approx(0.5) and record["score"] == pytest.approx(0.5)  # (1 + .5 + 0) / 3
    assert record["verdict"] is True  # score >= eval.beam.accept_at (0.5)
    assert [r["score"] for r in record["rubric"]] == [1.0, 0.5, 0.0]
    assert record["reason"] == "rubric 1.5 of 3 items"
    assert [r.key for r in reader.batches[0]] == [f"judge:1:information_extraction:0:rubric:{i}" for i in range(3)]
    assert len(reader.batches) == 1 and {r.role for r in reader.batches[0]} == {"judge"}
    first = reader.batches[0][0].messages[0]["content"]
    # the prompt's QUESTION slot filled; the reply quoted (its later lines indented, memfit_gpu/quoting.py)
    assert "QUESTION: When does the sprint end?\nRUBRIC CRITERION: says March 29\n" in first
    assert "RESPONSE TO EVALUATE: March 29.\n\n    Then sprint 2 starts.\n" in first

    released = BeamEvalConfig(question="released", partial="floor")
    reader = ScriptedReader(GRADES)
    (record,) = BeamJudge(prompts, released).score([item], reader)
    assert record["score"] == pytest.approx(1 / 3)  # int(0.5) = 0, as compute_metrics.py counts it
    assert record["verdict"] is False
    assert [(r["judged"], r["score"]) for r in record["rubric"]] == [(1.0, 1.0), (0.5, 0.0), (0.0, 0.0)]
    assert "QUESTION: <question>\n" in reader.batches[0][0].messages[0]["content"]


def test_event_ordering_combines_tau_and_f1(prompts: BeamPrompts) -> None:
    """Reference [A setup, B tests, C deployment]; the reply's lines 'B ...', '', 'A ...': aligned B, '', A.
    tp 2 (A, B), fp 1 (the blank line), fn 1 (C): F1 2/3. Ranks over A B C '': reference 1 2 3 5, aligned
    3 1 5 2: 3 concordant, 3 discordant pairs: tau-b 0, tau_norm 1/2, final 1/3. Rubric: (1 + 1 + 0) / 3."""
    reply = "B: wrote the tests\n\nA: set the project up"
    item = BeamItem("judge:2:event_ordering:0", "In what order?", "event_ordering",
                    ["A setup", "B tests", "C deployment"], reply)
    results = {}
    for choice in ("tau_f1", "tau", "rubric"):
        reader = ScriptedReader(GRADES)
        (record,) = BeamJudge(prompts, BeamEvalConfig(event_ordering=choice, partial="floor")).score([item], reader)
        results[choice] = record["score"]
    assert results == pytest.approx({"tau_f1": 1 / 3, "tau": 0.5, "rubric": 2 / 3})
    ordering = record["event_ordering"]
    assert (ordering["f1"], ordering["tau_b"], ordering["matched"]) == (pytest.approx(2 / 3), 0.0, [1, None, 0])
    assert record["rubric_score"] == pytest.approx(2 / 3)  # partial floor leaves event ordering's rubric alone
    # the rubric calls and the first match call in one batch, then one match call per batch
    keys = [[r.key for r in batch] for batch in reader.batches]
    assert keys[0] == [f"judge:2:event_ordering:0:rubric:{i}" for i in range(3)] + ["judge:2:event_ordering:0:match:0:0"]
    assert keys[1:] == [["judge:2:event_ordering:0:match:0:1"], ["judge:2:event_ordering:0:match:1:0"],
                        ["judge:2:event_ordering:0:match:1:2"], ["judge:2:event_ordering:0:match:2:0"]]
    match = reader.batches[1][0].messages
    assert match == [{"role": "system", "content": "Same event? Reply YES or NO."},
                     {"role": "user", "content": "First snippet: B tests \n\n        Second snippet: B: wrote the tests"}]


def test_unparsed_unanswered_and_empty(prompts: BeamPrompts) -> None:
    judge = BeamJudge(prompts, BeamEvalConfig())
    bad = BeamItem("judge:3:summarization:0", "Summarise.", "summarization", ["says March 29", "bad item"], "March 29")
    empty = BeamItem("judge:3:summarization:1", "Summarise.", "summarization", ["says March 29"], "  ")
    lost = BeamItem("judge:3:knowledge_update:0", "How many?", "knowledge_update", ["says March 29"], "3")
    bare = BeamItem("judge:3:event_ordering:0", "In what order?", "event_ordering", [], "A\nB")
    reader = ScriptedReader(GRADES, unanswered=frozenset({"judge:3:knowledge_update:0:rubric:0"}))
    unparsed, empty_record, missing, no_rubric = judge.score([bad, empty, lost, bare], reader)
    assert (no_rubric["score"], no_rubric["verdict"]) == (0.0, False)  # nothing to judge, no call
    assert no_rubric["reason"].startswith("the question has no rubric items")
    assert unparsed["score"] == pytest.approx(0.5) and unparsed["unparsed"] and unparsed["unparsed_items"] == 1
    assert unparsed["rubric"][1]["reason"].startswith("unparsed judge reply (beam judge reply: no score")
    assert empty_record == {"verdict": False, "score": 0.0, "reason": "empty prediction (judged wrong without a call)",
                            "rubric": [], "rubric_score": 0.0}
    assert missing is None  # a rerun asks it again
    assert sum(len(batch) for batch in reader.batches) == 3  # no call for the empty reply or the bare question


# -------------------------------------------------------------------------------------------- the table
def _row(memory: str, ability: str, score: float, f1: float = 0.0, **judge: object) -> dict:
    return {"question_id": f"{memory}:{ability}", "memory_id": memory, "category": ability, "evaluated": True,
            "scores": {"paper": {"f1": f1, "bleu1": f1 / 2}}, "judge": {"verdict": score >= 0.5, "score": score,
                                                                        "rubric_score": score, **judge}}


def test_summary_is_the_mean_of_conversation_means() -> None:
    ordering = {"tau_norm": 0.5, "f1": 0.8, "final_score": 0.4}
    rows = [_row("1", "information_extraction", 1.0, 1.0), _row("1", "information_extraction", 0.0, 0.0),
            _row("2", "information_extraction", 1.0, 0.5),
            _row("1", "instruction_following", 0.5, 0.9), _row("2", "instruction_following", 1.0, 0.9),
            _row("1", "event_ordering", 0.4, event_ordering=ordering)]
    block = summary(rows)
    ie = block["abilities"]["information_extraction"]
    # conversation 1: (1 + 0) / 2, conversation 2: 1 -> 0.75 (the question mean would be 2/3)
    assert (ie["n"], ie["conversations"], ie["score"]) == (3, 2, pytest.approx(0.75))
    assert (ie["f1"], ie["bleu1"]) == (pytest.approx(0.5), pytest.approx(0.25))  # (0.5 + 0.5) / 2
    following = block["abilities"]["instruction_following"]
    assert following["score"] == pytest.approx(0.75) and "f1" not in following  # its gold is no reference answer
    assert block["abilities"]["event_ordering"]["event_ordering"] == pytest.approx(ordering)
    assert list(block["abilities"]) == ["event_ordering", "information_extraction", "instruction_following"]
    assert block["average"] == pytest.approx((0.4 + 0.75 + 0.75) / 3)
    table = render_table(block, {"event_ordering": "tau_f1", "partial": "keep"})
    assert "| Information Extraction |   3 |   0.750 | 0.500 |    0.250 |" in table
    assert "| Instruction Following  |   2 |   0.750 |     - |        - |" in table
    assert "| **Average**            |   6 |   0.633 |       |          |" in table
    assert "Event Ordering = (Kendall tau-b + 1) / 2 x F1 of the aligned items" in table


# ---------------------------------------------------------------------------------------- prompt files
def test_prompt_files_are_parsed_not_run(tmp_path: Path, prompts: BeamPrompts) -> None:
    assert prompts.judge_text("Q <rubric_item>", "R", "A") == (
        "\nQUESTION: Q <rubric_item>\nRUBRIC CRITERION: R\nRESPONSE TO EVALUATE: A\n"
        'Reply {"score": 1.0, 0.5 or 0.0, "reason": "..."}\n')  # one pass: a value's own slot text stays
    messages = build_answer_messages("When?", "EXCERPT 1 (recorded 15 March 2024): Speaker user says: hi",
                                     protocol="beam", beam_prompts=prompts)
    assert messages == [{"role": "user", "content": "\nCONTEXT:\nEXCERPT 1 (recorded 15 March 2024): Speaker user "
                                                    "says: hi\n\nQUESTION:\nWhen?\n\nRESPONSE:\n"}]
    folder = write_beam_prompts(tmp_path / "evil")
    marker = tmp_path / "ran"
    (folder / "src" / "prompts.py").write_text(
        f"open({str(marker)!r}, 'w')\nunified_llm_judge_base_prompt = '<rubric_item> <llm_response>'\n"
        "answer_generation_for_rag = '<context> <question>'\n")
    assert BeamPrompts.load(folder).judge == "<rubric_item> <llm_response>" and not marker.exists()
    (folder / "src" / "prompts.py").write_text("unified_llm_judge_base_prompt = '<rubric_item>'\n")
    with pytest.raises(PromptError, match=r"prompts.py: no module-level answer_generation_for_rag"):
        BeamPrompts.load(folder)


def test_missing_prompt_files_name_the_places_and_the_command(tmp_path: Path, monkeypatch, locomo_path: Path) -> None:
    monkeypatch.setenv("MEMFIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("MEMFIT_DATA_DIR", raising=False)
    source = tmp_path / "data" / "beam" / "100K" / "1"
    source.mkdir(parents=True)
    with pytest.raises(PromptError) as info:
        BeamPrompts.find(source)
    message = str(info.value)
    assert "\n" not in message and "run `memfit data fetch beam`" in message
    assert f"{source / 'src' / 'prompts.py'}" in message and f"{tmp_path / 'data' / 'beam' / 'src' / 'prompts.py'}" in message
    assert f"{tmp_path / 'cache' / 'data' / 'beam' / 'src' / 'prompts.py'}" in message
    write_beam_prompts(tmp_path / "data" / "beam")
    assert BeamPrompts.find(source).folder == str((tmp_path / "data" / "beam").resolve())
    assert replace(BeamEvalConfig(), accept_at=1.0).accept_at == 1.0
    # BEAM's judge on a benchmark without rubrics is refused before a run starts
    with pytest.raises(ConfigError, match="eval.judge.prompt=beam scores BEAM's rubric items, which "
                                          "data.benchmark=locomo does not have"):
        resolve_inputs(load_config(None, ["eval.judge.enabled=true", "eval.judge.prompt=beam",
                                          f"data.path={locomo_path}"]))


# ------------------------------------------------------------------------------------------------ configs
def test_the_beam_configs_load_with_beams_judge() -> None:
    repo = Path(__file__).resolve().parents[2]
    readers = {"beam_gpt41_nano": ("openai", "gpt-4.1-nano"), "beam_qwen25_32b": ("vllm", "Qwen/Qwen2.5-32B-Instruct"),
               "beam_llama4_maverick": ("openai", "meta-llama/Llama-4-Maverick-17B-128E-Instruct-FP8")}
    paper = load_config(repo / "configs" / "memfit.yaml")
    for stem, reader in readers.items():
        cfg = load_config(repo / "configs" / "experiments" / f"{stem}.yaml")
        assert (cfg.data.benchmark, cfg.data.split, cfg.reader.backend, cfg.reader.model) == ("beam", "100K", *reader)
        assert resolve_protocol(cfg.reader.protocol, "beam") == "beam" and judge_kind("beam", cfg.eval.judge.prompt) == "beam"
        assert (cfg.eval.judge.enabled, cfg.eval.judge.backend, cfg.eval.judge.model) == (True, "openai", "gpt-4.1-mini")
        assert (cfg.retrieve, cfg.rerank, cfg.pack, cfg.summary) == (paper.retrieve, paper.rerank, paper.pack, paper.summary)
    demo = load_config(repo / "configs" / "demo_beam.yaml")
    assert (demo.data.benchmark, demo.data.limit_memories, demo.data.limit_questions) == ("beam", 1, 20)
    assert (demo.reader.backend, demo.eval.judge.enabled, demo.eval.judge.backend) == ("transformers", True, "transformers")
    sweep = load_sweep(repo / "configs" / "sweeps" / "beam_splits_gpt41_nano.yaml")
    pairs = [(p.overrides["data.split"], p.overrides["method"]) for p in sweep.points]
    assert len(pairs) == 15 and ("10M", "full_context") not in pairs
    assert {s for s, _ in pairs} == {"100K", "500K", "1M", "10M"}


def test_a_sweeps_aggregate_shows_beams_average(tmp_path: Path) -> None:
    sweep_dir = tmp_path / "sw"
    points = [{"id": f"split={s}", "overrides": {"data.split": s}, "dir": str(sweep_dir / "points" / f"split={s}"),
               "state": "done"} for s in ("100K", "500K")]
    (sweep_dir).mkdir()
    (sweep_dir / "sweep.json").write_text(json.dumps({"name": "b", "sweep_keys": ["data.split"], "points": points}))
    for point, average in zip(points, (0.25, 0.125), strict=True):
        folder = Path(point["dir"])
        folder.mkdir(parents=True)
        (folder / "metrics.json").write_text(json.dumps({
            "questions": 400, "metric_variant": "paper", "average": {"paper": {"f1": 0.5, "bleu1": 0.25}, "judge": 0.5},
            "beam": {"average": average}, "retrieval": {"overall": {"pack_hit": 0.75}}}))
        (folder / "DONE").write_text("")
    columns, rows = aggregate(sweep_dir)
    assert columns == ["point", "data.split", "status", "metric", "f1", "bleu1", "judge", "beam", "pack_hit",
                       "questions"]
    assert [r["beam"] for r in rows] == [0.25, 0.125]
    assert "|   beam % |" in to_markdown(columns, rows) and "|    25.00 |" in to_markdown(columns, rows)
