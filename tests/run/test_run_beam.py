"""BEAM through memfit's commands, on the real conversation 1 of the 128K split (188 messages, 20 questions):
`memfit retrieve` (hit@k and pack hit for every question with evidence) and the live Memory (the same ranking
as the offline read) on the whole conversation; on its first batch's first 11 turns (24 of its 60 messages,
the same 20 questions) each reader-free method's retrieval, every other method's live memory, every method
through `memfit run`, a judged run of the embedded default (configs/demo_beam.yaml: SmolLM2-135M as reader
and judge) killed and resumed, and `memfit judge-audit` on it;
and a run refused in one line when BEAM's prompt files are missing.

BEAM's src/prompts.py and compute_metrics.py are not in ../shared (`memfit data fetch beam` brings them): the
runs read tests/support/beam_prompts.py's stand-ins, and the reader of the every-method runs is the test-only echo
backend (tests/seam_echo_backend.py). Both check the machinery; no number here is a BEAM result.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import seam_echo_backend  # noqa: F401  (registers reader.backend=echo in this process, for the live Memory)
from support.beam_prompts import write_beam_prompts
from support.env import memfit_env

from memfit_gpu.data import load_benchmark
from memfit_gpu.faults import FAULT_ENV
from memfit_gpu.files import read_jsonl
from memfit_gpu.live import Memory
from memfit_gpu.readers.ledger import Ledger

REPO = Path(__file__).resolve().parents[2]
DEMO_BEAM = REPO / "configs" / "demo_beam.yaml"
PAPER = REPO / "configs" / "memfit.yaml"
METHODS = ("memfit", "plain", "naive_rag", "full_context", "lightmem_slm")

pytestmark = pytest.mark.slow  # the packaged MiniLM (and SmolLM2 in the judged run)


@pytest.fixture(scope="module")
def conversation(shared_data: Path) -> Path:
    return shared_data / "beam" / "100K" / "1"


# The retrievals, runs and live memories below check machinery that holds for any number of messages (files,
# calls, scored questions, resumption, the echo prompt, truncation, ranked hits): they read the first batch's
# first 11 turns (24 of its 60 messages, the 11th user message of 40 words or more among them), and so encode
# 24 messages, not 60.
FIRST_TURNS = 11


@pytest.fixture(scope="module")
def first_turns(tmp_path_factory: pytest.TempPathFactory, conversation: Path) -> Path:
    """Conversation 1 cut to the first FIRST_TURNS turns of its first batch (24 messages, all 20 questions)."""
    root = tmp_path_factory.mktemp("first_turns") / "1"
    shutil.copytree(conversation, root)
    batch = json.loads((conversation / "chat.json").read_text())[0]
    (root / "chat.json").write_text(json.dumps([{**batch, "turns": batch["turns"][:FIRST_TURNS]}]))
    return root


@pytest.fixture(scope="module")
def beam_data(tmp_path_factory: pytest.TempPathFactory, first_turns: Path) -> Path:
    """A data folder with conversation 1's first turns (first_turns) as beam/100K/1 and the stand-in prompt
    files as beam/src/."""
    root = tmp_path_factory.mktemp("beam_data")
    shutil.copytree(first_turns, root / "beam" / "100K" / "1")
    write_beam_prompts(root / "beam")
    return root


def messages(data: Path) -> int:
    """How many messages a conversation folder holds (its turn ids are 0, 1, ...)."""
    return sum(len(m) for batch in json.loads((data / "chat.json").read_text()) for m in batch["turns"])


def memfit(*args: str, data: Path, cache: Path, timeout: int = 1800, **env: str) -> subprocess.CompletedProcess[str]:
    env = memfit_env(data, threads=1, plugins=env.pop("MEMFIT_PLUGINS", None), MEMFIT_CACHE=str(cache), **env)
    return subprocess.run([sys.executable, "-m", "memfit_gpu.cli", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def retrieved(tmp_path_factory: pytest.TempPathFactory, conversation: Path) -> Path:
    out = tmp_path_factory.mktemp("retrieve") / "memfit"
    done = memfit("retrieve", "--config", str(PAPER), "--benchmark", "beam", "--data", str(conversation), "--out",
                  str(out), "rerank.backend=none", data=conversation, cache=out.parent / "cache")
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def test_retrieve_reports_hits_for_every_question_with_evidence(retrieved: Path) -> None:
    diagnostics = json.loads((retrieved / "diagnostics.json").read_text())
    assert (diagnostics["questions_total"], diagnostics["questions"]) == (20, 18)
    assert diagnostics["questions_without_evidence_ids"] == ["1:abstention:0", "1:abstention:1"]
    assert diagnostics["unmatched_evidence"] == 0
    overall = diagnostics["overall"]
    assert overall["questions"] == 18
    assert {"hit@5", "hit@10", "hit@20", "hit@30", "pack_hit", "pack_hit_window", "mrr"} <= set(overall)
    assert all(0.0 <= overall[k] <= 1.0 for k in ("hit@10", "pack_hit", "mrr"))
    assert sorted(diagnostics["by_category"]) == sorted(
        ["contradiction_resolution", "event_ordering", "information_extraction", "instruction_following",
         "knowledge_update", "multi_session_reasoning", "preference_following", "summarization", "temporal_reasoning"])
    rows = read_jsonl(retrieved / "packs.jsonl")
    assert len(rows) == 20
    for row in rows:
        if row["evidence"]:
            assert isinstance(row["retrieval"]["pack_hit"], bool) and "hit@10" in row["retrieval"], row["question_id"]
        else:
            assert row["retrieval"] is None
    contradiction = next(r for r in rows if r["question_id"] == "1:contradiction_resolution:0")
    assert contradiction["evidence"] == ["58", "24"]  # message ids: {first_statement: [58], second_statement: [24]}


@pytest.mark.parametrize("method", ["plain", "naive_rag", "full_context"])
def test_the_reader_free_methods_retrieve_on_beam(tmp_path: Path, first_turns: Path, method: str) -> None:
    out = tmp_path / method
    done = memfit("retrieve", "--config", str(PAPER), "--benchmark", "beam", "--data", str(first_turns), "--out",
                  str(out), "rerank.backend=none", f"method={method}", "full_context.context_tokens=4096",
                  data=first_turns, cache=tmp_path / "cache")
    assert done.returncode == 0, done.stderr[-3000:]
    diagnostics = json.loads((out / "diagnostics.json").read_text())
    named = diagnostics["method"]["name"] if isinstance(diagnostics["method"], dict) else diagnostics["method"]
    # scored: the questions with evidence among the cut's messages (the first batch's 60 hold that of 13)
    memory = load_benchmark("beam", first_turns).memories[0]
    held = {t.turn_id for t in memory.turns()}
    with_evidence = sum(1 for q in memory.questions if held & set(q.evidence))
    assert 0 < with_evidence < 18 and (named, diagnostics["questions"]) == (method, with_evidence)
    assert diagnostics["questions_total"] == 20
    rows = read_jsonl(out / "packs.jsonl")
    assert len(rows) == 20
    if method == "full_context":  # the history cut to its newest messages (4,096 tokens at 4 characters a token)
        truncation = rows[0]["method_notes"]["truncation"]
        assert truncation["turns"] == messages(first_turns) == 24 and truncation["turns_dropped"] > 0
        assert truncation["turns_kept"] + truncation["turns_dropped"] == 24


def test_the_live_memory_reads_beam_as_the_offline_run_does(tmp_path: Path, conversation: Path,
                                                            retrieved: Path) -> None:
    """Conversation 1's messages added to a live Memory (as an agent would, batch by batch) rank every question's
    candidates as `memfit retrieve` did: the same k = 10 message ids in the same order."""
    memory = load_benchmark("beam", conversation).memories[0]
    offline = {r["question_id"]: [s["turn_id"] for s in r["pack"]["selected"]] for r in read_jsonl(retrieved / "packs.jsonl")}
    overrides = ["rerank.backend=none", "reader.backend=echo", "live.consolidate=manual", "summary.enabled=false"]
    with Memory.open(tmp_path / "live", config=PAPER, overrides=overrides) as live:
        for session in memory.sessions:
            live.add("1", [{"speaker": t.speaker, "text": t.text, "timestamp": t.timestamp, "turn_id": t.turn_id,
                            "session_id": session.session_id, "date_text": t.date_text} for t in session.turns])
        assert [t["turn_id"] for t in live.turns("1")] == [str(i) for i in range(188)]
        hits = live.search("1", [q.question for q in memory.questions], k=10)
    for question, found in zip(memory.questions, hits, strict=True):
        assert [h.turn_ids[0] for h in found] == offline[question.question_id], question.question_id


@pytest.mark.parametrize("method", ["plain", "naive_rag", "lightmem_slm"])
def test_every_other_live_method_holds_and_searches_beam(tmp_path: Path, first_turns: Path, method: str) -> None:
    """The other methods with a live write path (full_context has none) take the first turns' messages as an
    agent adds them and answer a search with ranked hits over them. plain and naive_rag find a user message
    by its own words (twenty from its middle rank it first); LightMem-SLM reads through its reader's
    rewrite and its consolidated notes (none here: the echo reader, consolidation manual), so it gives its
    short-term turns, the newest."""
    memory = load_benchmark("beam", first_turns).memories[0]
    n = messages(first_turns)
    assert n == 24 and len(list(memory.turns())) == n
    overrides = ["rerank.backend=none", "reader.backend=echo", "live.consolidate=manual", "summary.enabled=false"]
    user_turns = [t for t in memory.turns() if t.speaker == "user" and len(t.text.split()) >= 40]
    wanted = {t.turn_id: " ".join(t.text.split()[10:30]) for t in (user_turns[1], user_turns[5], user_turns[10])}
    with Memory.open(tmp_path / "live", config=PAPER, method=method, overrides=overrides) as live:
        for session in memory.sessions:
            live.add("1", [{"speaker": t.speaker, "text": t.text, "timestamp": t.timestamp, "turn_id": t.turn_id,
                            "session_id": session.session_id, "date_text": t.date_text} for t in session.turns])
        assert [t["turn_id"] for t in live.turns("1")] == [str(i) for i in range(n)]
        hits = live.search("1", list(wanted.values()), k=5)
    for (turn_id, query), found in zip(wanted.items(), hits, strict=True):
        assert 0 < len(found) <= 5 and [h.score for h in found] == sorted((h.score for h in found), reverse=True)
        assert all(int(t) < n for h in found for t in h.turn_ids)
        if method == "lightmem_slm":
            assert [h.turn_ids for h in found] == [[str(i)] for i in range(n - len(found), n)]
        else:
            assert turn_id in found[0].turn_ids, (method, query, [(h.kind, h.turn_ids) for h in found])


@pytest.mark.parametrize("method", METHODS)
def test_every_method_runs_on_beam(tmp_path: Path, beam_data: Path, method: str) -> None:
    out = tmp_path / method
    args = ("run", "--config", str(DEMO_BEAM), f"method={method}", "reader.backend=echo", "eval.judge.enabled=false",
            "data.limit_questions=2", "--out", str(out), "--quiet")
    done = memfit(*args, data=beam_data, cache=tmp_path / "cache", MEMFIT_PLUGINS="seam_echo_backend")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = read_jsonl(out / "predictions.jsonl")
    assert [r["question_id"] for r in rows] == ["1:abstention:0", "1:abstention:1"]
    answer = Ledger.load(out / "ledger.json").roles["answer"]
    assert answer.calls + answer.cached == 2
    prompt = rows[0]["raw_output"]
    assert prompt == "CONTEXT:"  # the echo of BEAM's answer prompt (the stand-in's first line): protocol beam
    if method == "full_context":  # the whole history does not fit reader.max_prompt_chars: oldest messages dropped
        truncation = rows[0]["method_notes"]["truncation"]
        assert truncation["turns"] == messages(beam_data / "beam" / "100K" / "1") == 24
        assert truncation["turns_dropped"] > 0


def test_judged_demo_run_resumes_after_a_kill_and_writes_the_ability_table(tmp_path: Path, beam_data: Path) -> None:
    """The embedded default (SmolLM2-135M reads and judges) on three questions of conversation 1 (its two
    abstention questions and an event-ordering one), SIGKILLed right after its first two predictions are
    appended; the same command finishes it without asking a finished question or verdict again."""
    out = tmp_path / "demo"
    # the test session's cache (`make test` makes a new one): SmolLM2's GGUF is converted once per session there,
    # not again here (~26 s); the data comes from MEMFIT_DATA_DIR
    cache = Path(os.environ.get("MEMFIT_CACHE") or tmp_path / "cache")
    args = ("run", "--config", str(DEMO_BEAM), "data.include_categories=[abstention,event_ordering]",
            "data.limit_questions=3", "summary.enabled=false", "reader.max_new_tokens=16", "reader.flush_every=2",
            "eval.judge.max_new_tokens=32", "--out", str(out), "--quiet")
    killed = memfit(*args, data=beam_data, cache=cache, **{FAULT_ENV: "predictions:1"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    first = read_jsonl(out / "predictions.jsonl")
    assert [r["question_id"] for r in first] == ["1:abstention:0", "1:abstention:1"]
    assert all(r["judge"] is not None and "rubric" in r["judge"] for r in first)
    judge_calls = Ledger.load(out / "ledger.json").roles["judge"].calls
    assert judge_calls == 2  # one rubric item each

    done = memfit(*args, data=beam_data, cache=cache)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = read_jsonl(out / "predictions.jsonl")
    assert [r["question_id"] for r in rows] == ["1:abstention:0", "1:abstention:1", "1:event_ordering:0"]
    assert rows[:2] == first  # kept, not redone
    ordering = rows[2]["judge"]
    assert len(ordering["rubric"]) == 3 and "event_ordering" in ordering
    lines = rows[2]["raw_output"].strip().split("\n")
    assert len(ordering["event_ordering"]["matched"]) == len(lines)
    ledger = Ledger.load(out / "ledger.json")
    assert ledger.roles["answer"].calls + ledger.roles["answer"].cached == 3
    assert ledger.roles["judge"].calls >= judge_calls + 3 + 1  # its rubric items and at least one match call
    metrics = json.loads((out / "metrics.json").read_text())
    beam = metrics["beam"]
    assert list(beam["abilities"]) == ["abstention", "event_ordering"]
    assert [(b["n"], b["conversations"]) for b in beam["abilities"].values()] == [(2, 1), (1, 1)]
    assert beam["average"] == pytest.approx((beam["abilities"]["abstention"]["score"]
                                             + beam["abilities"]["event_ordering"]["score"]) / 2)
    assert beam["scoring"] == {"question": "fill", "partial": "keep", "event_ordering": "tau_f1", "accept_at": 0.5}
    results = (out / "results.md").read_text()
    assert results.startswith("### BEAM: 3 questions, 2 abilities\n")
    assert "| Abstention     |   2 |" in results and "| Event Ordering |   1 |" in results
    record = json.loads((out / "provenance.json").read_text())
    assert record["judge"]["kind"] == "beam"
    assert set(record["judge"]["prompts"]) == {"src/prompts.py", "src/evaluation/compute_metrics.py"}
    assert set(record["prompts"]["answer"]) == {"src/prompts.py"}

    audited = memfit("judge-audit", str(out), data=beam_data, cache=cache)
    assert audited.returncode == 0, audited.stderr[-3000:]
    report = json.loads((out / "judge_audit.json").read_text())
    assert report["judge"]["kind"] == "beam" and report["questions"] == 3
    kinds = {(i["question_id"], i["kind"]) for i in report["items"]}
    assert ("1:abstention:0", "decline_abstention") in kinds and ("1:event_ordering:0", "gold") in kinds
    assert all(i["outcome"] in ("accepted", "rejected", "unparsed") for i in report["items"])
    # the run's own predictions were judged by the run: every call of theirs came from its cache
    predictions = [i for i in report["items"] if i["kind"] == "prediction"]
    assert [i["outcome"] == "accepted" for i in predictions] == [r["judge"]["verdict"] for r in rows]


def test_a_run_without_the_prompt_files_stops_in_one_line(tmp_path: Path, conversation: Path) -> None:
    data = tmp_path / "data"
    shutil.copytree(conversation, data / "beam" / "100K" / "1")
    out = tmp_path / "run"
    done = memfit("run", "--config", str(DEMO_BEAM), "--out", str(out), "--quiet", data=data, cache=tmp_path / "cache")
    assert done.returncode == 2
    message = done.stderr.strip().splitlines()[-1]
    assert message.startswith("memfit run: error: BEAM's judge and answer prompts (src/prompts.py and "
                              "src/evaluation/compute_metrics.py of mohammadtavakoli78/BEAM) are not at ")
    assert "run `memfit data fetch beam`" in message
    assert f"{tmp_path / 'cache' / 'data' / 'beam' / 'src' / 'prompts.py'}" in message
    assert not (out / "config.yaml").exists()  # refused before the run recorded anything
