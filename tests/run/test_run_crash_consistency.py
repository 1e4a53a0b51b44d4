"""A real `memfit run` killed (SIGKILL, via memfit_gpu.faults) at each durable write, then rerun.

Every run here is the real pipeline on real data: the first three sessions of LoCoMo conv-26 (58
turns; the first questions' evidence lies there), 4 questions answered 2 per flush, 2 summaries, all
by the packaged MiniLM encoder and SmolLM2 reader. An uninterrupted run is the reference; each kill is
placed exactly at a boundary by MEMFIT_FAULT=<point>:<n>, never by timing, and the rerun must leave
the directory as the reference left it: the same predictions (one per question), the same metrics
(timings aside), a ledger with exactly one answer call per question and the reference's call counts,
and a store that encoded only what no snapshot held when the process died. A kill after the build
stage starts from a copy of a run killed at the store build's end (`prepared`), not from nothing; one
after the summaries' snapshot or a prediction flush starts from a copy of a run killed there (each such
state is itself a kill scenario checked against the reference), so no scenario redoes the LLM calls
its kill point lies after.

Against a server (tests/support/counting_server.py: a real HTTP server that counts what it delivered), the
ledger a killed and resumed run reports holds exactly the calls and tokens the server was paid for,
and a question the server did not answer fails alone and is asked again by the rerun.
"""

from __future__ import annotations

import json
import shutil
import signal
import sqlite3
import subprocess
import sys
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
from support.counting_server import MODEL, CountingServer
from support.data import write_small_locomo
from support.env import memfit_env

from memfit_gpu.faults import parse_trace
from memfit_gpu.files import read_jsonl
from memfit_gpu.readers.ledger import Ledger, LedgerCheckError
from memfit_gpu.readers.reader import load_ledger
from memfit_gpu.readers.types import Response
from memfit_gpu.run.directory import run_lock
from memfit_gpu.store.log import RecordLog

REPO = Path(__file__).resolve().parents[2]
SMOKE = REPO / "configs" / "smoke.yaml"
QUESTIONS = [f"conv-26:q{i}" for i in range(4)]
# Small enough for ~20 s a run on one CPU core, large enough for two prediction flushes, two store
# batches (episodes, summaries) with their snapshots, and a summary layer the retrieval reads.
OVERRIDES = [
    "data.limit_questions=4", "reader.flush_every=2", "reader.max_new_tokens=4", "pack.k=3",
    "summary.enabled=true", "summary.max_summaries=2", "summary.max_new_tokens=6", "summary.min_chars=1",
    "summary.max_excerpts=3", "summary.excerpt_chars=80",
]
# Points that are not durable writes of their own: timings.json is rewritten after every stage (what it
# holds is excluded from the comparison), store.encode only counts the texts the store encodes, reader.load
# marks the reader's model loading.
NOT_BOUNDARIES = {"timings", "store.encode", "reader.load"}
# The run's durable writes; the reference run must cross each of them.
REQUIRED = {"config", "provenance", "store.log", "store.snapshot", "packs", "predictions", "summaries.ledger",
            "answer.ledger", "score.ledger", "metrics", "DONE", "reader.commit"}
# Second crossings of a durable write whose killed state a kept scenario reaches the same way, left out of
# the kill scenarios (each kind is still killed at least once): the summaries' snapshot staged (staged:1
# leaves a staged snapshot behind, store.log:3 the summaries logged beyond a complete snapshot), the second
# answer batch's commit before its ledger save (reader.commit:2, the first batch's), and that batch's ledger
# save before its flush (killed there with a torn chunk, below; answer.ledger:1 without one).
LEFT_OUT = ("store.snapshot.staged:2", "reader.commit:3", "answer.ledger:2")
# The end of the store's build: the last durable write before the first LLM call (summaries are made
# inside the build stage, so a stage boundary would come after calls). A kill after it starts from a copy
# of a run killed there.
LLM_POINTS = ("reader.commit", "summaries.ledger")


def prepared_at(trace: list[str], after_summaries: bool = False) -> str:
    """`name:n` of the reference trace: its last durable write before any LLM call (the store built,
    snapshotted and its build timings written); with after_summaries, the stage boundary (timings.json)
    after the build's last summary call instead."""
    if after_summaries and "summaries.ledger" in trace:
        last = max(i for i, name in enumerate(trace) if name == "summaries.ledger")
        end = next(i for i in range(last, len(trace)) if trace[i] == "timings")
        return f"timings:{trace[:end + 1].count('timings')}"
    first_call = next((i for i, name in enumerate(trace) if name in LLM_POINTS), len(trace))
    before = [name for name in trace[:first_call] if name not in NOT_BOUNDARIES]
    assert "store.snapshot" in before, f"no store snapshot before the first LLM call in {trace}"
    return f"{before[-1]}:{before.count(before[-1])}"


def reference_trace(reference: Path) -> list[str]:
    return [name for name, _ in parse_trace(reference.parent / "reference.trace")]


@pytest.fixture(scope="module")
def small_locomo(tmp_path_factory: pytest.TempPathFactory, shared_data: Path) -> Path:
    """conv-26 cut to its first three sessions (real turns and questions, written once per module)."""
    return write_small_locomo(shared_data, tmp_path_factory.mktemp("data"), questions=6)

def memfit_run(out: Path, data: Path, shared_data: Path, *extra_args: str,
               **env: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "memfit_gpu.cli", "run", "--config", str(SMOKE), "--out", str(out), "--quiet",
           f"data.path={data}", *OVERRIDES, *extra_args]
    return subprocess.run(cmd, env=memfit_env(shared_data, threads=1, **env), capture_output=True, text=True, timeout=900)


def comparable_metrics(run_dir: Path) -> dict[str, Any]:
    metrics = json.loads((run_dir / "metrics.json").read_text())
    metrics.pop("timings")
    metrics["retrieval"].pop("retrieve_stage_seconds")
    return metrics


def snapshot_coverage(store: Path) -> int:
    """Records covered by the newest complete snapshot (the one a reopen loads), 0 without one."""
    counts = [int(json.loads((p / "meta.json").read_text())["records"])
              for p in (store / "snapshots").glob("[0-9]*") if (p / "meta.json").exists()]
    return max(counts, default=0)


def store_texts(store: Path, first: int | None = None) -> int:
    """Episode and summary texts among the first `first` log records (all of them for None)."""
    log = RecordLog(store / "log.jsonl")
    try:
        return sum(1 for r in log.records[:first] if r.get("t") in ("episode", "summary"))
    finally:
        log.close()


def encoded(trace: Path) -> int:
    return sum(count or 0 for name, count in parse_trace(trace) if name == "store.encode") if trace.exists() else 0


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, small_locomo: Path, shared_data: Path) -> Path:
    out = tmp_path_factory.mktemp("crash") / "reference"
    trace = out.parent / "reference.trace"
    proc = memfit_run(out, small_locomo, shared_data, MEMFIT_FAULT_TRACE=str(trace))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["question_id"] for r in read_jsonl(out / "predictions.jsonl")] == QUESTIONS
    assert encoded(trace) == store_texts(out / "store") == 60  # 58 turns + 2 summaries, each encoded once
    # one reader (the summaries' and the answers'), its model loaded once, before the first call it generated
    crossed = reference_trace(out)
    assert crossed.count("reader.load") == 1 and crossed.index("reader.load") < crossed.index("reader.commit")
    return out


def prepare(out: Path, trace: list[str], data: Path, shared_data: Path, *extra_args: str,
            after_summaries: bool = False, **env: str) -> Path:
    """A run killed at the end of its store's build (prepared_at), for kill scenarios that start later; the
    durable writes it crossed are in `<out>.trace`."""
    killed = memfit_run(out, data, shared_data, *extra_args, MEMFIT_FAULT=prepared_at(trace, after_summaries),
                        MEMFIT_FAULT_TRACE=str(out.parent / f"{out.name}.trace"), **env)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert snapshot_coverage(out / "store") > 0
    return out


@pytest.fixture(scope="module")
def prepared(reference: Path, small_locomo: Path, shared_data: Path) -> Path:
    return prepare(reference.parent / "prepared", reference_trace(reference), small_locomo, shared_data)


def start_state(trace: list[str], point: str, after_summaries: bool = False) -> tuple[bool, str]:
    """Whether a kill at `point` (name:n of the reference trace) starts from the prepared copy, and the
    point as that run counts it (what the prepared run passed already is not passed again)."""
    cut = prepared_at(trace, after_summaries)
    if position(trace, point) <= position(trace, cut):
        return False, point
    return True, counted_from(trace, point, cut)


def position(trace: list[str], which: str) -> int:
    """Index in `trace` of `name:n` (its n-th crossing; n=1 when omitted)."""
    name, _, nth = which.partition(":")
    return [i for i, seen in enumerate(trace) if seen == name][int(nth or 1) - 1]


def counted_from(trace: list[str], point: str, cut: str) -> str:
    """`point` (name:n of the reference trace) as a run that starts from a copy of a run killed at `cut`
    counts it (what the copied run passed already is not passed again)."""
    name, _, nth = point.partition(":")
    return f"{name}:{int(nth or 1) - trace[:position(trace, cut) + 1].count(name)}"


def later_states(trace: list[str]) -> list[str]:
    """Where the kill scenarios' later starting states are cut (name:n of the reference trace), in order
    after prepared_at: the store's last snapshot (its summaries in it), then each prediction flush. Each
    of them is itself a kill scenario (started from the state before it), so every state a later scenario
    starts from is one whose rerun is checked against the reference."""
    flushes = [f"predictions:{n}" for n in range(1, trace.count("predictions") + 1)]
    return [f"store.snapshot:{trace.count('store.snapshot')}", *flushes]


def boundaries(reference: Path) -> list[str]:
    """`point:n` for every durable write the reference run crossed, in order."""
    seen: Counter[str] = Counter()
    points = []
    for name, _ in parse_trace(reference.parent / "reference.trace"):
        if name not in NOT_BOUNDARIES:
            seen[name] += 1
            points.append(f"{name}:{seen[name]}")
    return points


def check_resumed(run_dir: Path, reference: Path, label: str) -> list[str]:
    """What differs between a resumed directory and the reference (empty = nothing)."""
    problems = []
    rows = read_jsonl(run_dir / "predictions.jsonl")
    if rows != read_jsonl(reference / "predictions.jsonl"):
        problems.append(f"{label}: predictions {[r['question_id'] for r in rows]} differ from the reference")
    if comparable_metrics(run_dir) != comparable_metrics(reference):
        problems.append(f"{label}: metrics.json differs from the reference")
    ledger = Ledger.load(run_dir / "ledger.json")
    try:
        ledger.check_one_answer_per_question(QUESTIONS)
    except AssertionError as exc:
        problems.append(f"{label}: {exc}")
    if ledger.answer_keys != QUESTIONS:
        problems.append(f"{label}: ledger answer keys {ledger.answer_keys}")
    want = Ledger.load(reference / "ledger.json")
    answer, want_answer = ledger.roles["answer"], want.roles["answer"]
    # The ledger is saved right after each batch of calls, before anything else of it is durable: a kill
    # never loses a call's accounting, and what a rerun re-serves from the cache is not counted again.
    if (answer.calls, answer.cached) != (want_answer.calls, want_answer.cached):
        problems.append(f"{label}: answer calls/cached {answer.calls}/{answer.cached}, "
                        f"reference {want_answer.calls}/{want_answer.cached}")
    if ledger.roles["summary"].calls != want.roles["summary"].calls:
        problems.append(f"{label}: {ledger.roles['summary'].calls} summary calls, "
                        f"reference {want.roles['summary'].calls}")
    if not (run_dir / "DONE").exists():
        problems.append(f"{label}: no DONE")
    return problems


def test_a_resumed_ledger_does_not_count_a_re_served_answer_again():
    """A saved ledger's answers, re-served from the cache by the rerun that rewrites their lost
    predictions, are no new calls; a second answer for a question within one process still is."""
    fresh = Response("Paris", 20, 2, 0.5, cached=False, model="m")
    hit = Response("Paris", 20, 2, 0.0, cached=True, model="m")
    saved = Ledger()
    saved.record("answer", "q1", fresh, backend="transformers")
    resumed = Ledger.from_dict(json.loads(saved.to_json()))
    resumed.record("answer", "q1", hit, backend="transformers")  # its prediction was lost after the save
    resumed.record("answer", "q2", fresh, backend="transformers")
    assert resumed.answer_keys == ["q1", "q2"]
    assert (resumed.roles["answer"].calls, resumed.roles["answer"].cached) == (2, 0)
    resumed.check_one_answer_per_question(["q1", "q2"])
    resumed.record("answer", "q1", hit, backend="transformers")  # a bug answering q1 twice in one run
    with pytest.raises(LedgerCheckError, match=r"more than one answer call: \['q1 x2'\]"):
        resumed.check_one_answer_per_question(["q1", "q2"])
    # a call the cache lost is made again: its cost counts, the question keeps its one answer
    lost = Ledger.from_dict(json.loads(saved.to_json()))
    lost.record("answer", "q1", fresh, backend="transformers")
    assert lost.answer_keys == ["q1"] and lost.roles["answer"].calls == 2 and lost.roles["answer"].input_tokens == 40


@pytest.mark.slow
def test_kill_between_a_prediction_flush_and_the_ledger_save_resumes(tmp_path: Path, small_locomo: Path,
                                                                     shared_data: Path):
    """Killed right after the first flush of predictions, the rerun used to fail forever with
    `LedgerCheckError: 2 questions without an answer call` (a traceback, exit code 1). A torn line after
    the flushed rows, as a kill in the middle of a write leaves it, is dropped; the flushed rows are kept,
    not redone; none is lost or written twice."""
    out = tmp_path / "run"
    preds = out / "predictions.jsonl"
    killed = memfit_run(out, small_locomo, shared_data, "summary.enabled=false", MEMFIT_FAULT="predictions:1")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert not (out / "DONE").exists()
    first = read_jsonl(preds)
    assert [r["question_id"] for r in first] == QUESTIONS[:2]
    with run_lock(out):  # the killed run's lock died with it
        pass
    with open(preds, "a") as handle:
        handle.write('{"question_id": "conv-26:q')
    rerun = memfit_run(out, small_locomo, shared_data, "summary.enabled=false")
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    rows = read_jsonl(preds)
    assert [r["question_id"] for r in rows] == QUESTIONS  # none lost, none twice, in order
    assert rows[:len(first)] == first  # finished work was kept, not redone
    ledger = Ledger.load(out / "ledger.json")
    assert ledger.answer_keys == QUESTIONS
    assert (ledger.roles["answer"].calls, ledger.roles["answer"].cached) == (4, 0)
    # Without ledger.json (a report of the ledger) nothing is lost: the cache's entries hold every call.
    def cut_to_two_predictions() -> None:
        for name in ("DONE", "ledger.json", "metrics.json"):
            (out / name).unlink()
        with open(out / "predictions.jsonl", "r+b") as handle:
            handle.truncate(len(b"".join(handle.readlines()[:2])))

    cut_to_two_predictions()
    rerun = memfit_run(out, small_locomo, shared_data, "summary.enabled=false")
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "predictions have no answer call" not in rerun.stderr
    ledger = Ledger.load(out / "ledger.json")
    assert ledger.answer_keys == QUESTIONS and (ledger.roles["answer"].calls, ledger.roles["answer"].cached) == (4, 0)
    # Again as an older memfit left a kill between the two writes (its cache held no ledger entries): the
    # answers the predictions hold are accounted from the response cache (hits, not calls), the others answered.
    cut_to_two_predictions()
    with sqlite3.connect(out / "cache.sqlite") as conn:
        conn.execute("DELETE FROM calls")
    rerun = memfit_run(out, small_locomo, shared_data, "summary.enabled=false")
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "2 predictions have no answer call" in rerun.stderr
    assert [r["question_id"] for r in read_jsonl(out / "predictions.jsonl")] == QUESTIONS
    ledger = Ledger.load(out / "ledger.json")
    assert ledger.answer_keys == QUESTIONS
    assert (ledger.roles["answer"].calls, ledger.roles["answer"].cached) == (0, 4)


@pytest.mark.slow
def test_a_kill_at_every_durable_write_resumes_to_the_reference(reference: Path, prepared: Path, tmp_path: Path,
                                                                small_locomo: Path, shared_data: Path):
    points = boundaries(reference)
    names = {p.split(":")[0] for p in points}
    assert REQUIRED <= names, f"the reference run crossed no {sorted(REQUIRED - names)}"
    assert Counter(p.split(":")[0] for p in points)["predictions"] == 2
    # provenance.json is written before the first LLM call is accounted
    assert points.index("provenance:1") < min(points.index("summaries.ledger:1"), points.index("answer.ledger:1"))
    # A torn chunk: killed after the second ledger save, the file got the chunk's first row and half its
    # second (as a kill inside the write leaves it). The rerun cuts the half row and re-serves it.
    reference_lines = (reference / "predictions.jsonl").read_bytes().splitlines(keepends=True)
    torn = reference_lines[2] + reference_lines[3][: len(reference_lines[3]) // 2]
    assert set(LEFT_OUT) <= set(points), sorted(set(LEFT_OUT) - set(points))
    scenarios: list[tuple[str, bytes]] = [(p, b"") for p in points if p not in LEFT_OUT] + [("answer.ledger:2", torn)]
    # every kind of durable write the reference crossed is still a kill point
    assert {p.split(":")[0] for p, _ in scenarios} == names

    trace = [name for name, _ in parse_trace(reference.parent / "reference.trace")]
    # A scenario starts from the latest state cut before its kill point: `prepared` (the store built), or a
    # copy of a run killed later (later_states), so that it redoes no LLM call its kill point lies after.
    # The later states are cut one after the other from the one before, beside the first scenarios. A
    # scenario killed AT a cut is that state: its rerun starts from a copy of the state's killed run (the
    # same kill, from the same state before it), checked as every other scenario's killed run is.
    cuts = [prepared_at(trace), *later_states(trace)]
    last_commit = max(i for i, name in enumerate(trace) if name == "reader.commit")
    assert [position(trace, c) for c in cuts] == sorted({position(trace, c) for c in cuts}), cuts

    # each state's future is set as soon as it is cut: a scenario waits for its own state, not for the chain
    state_cut: list[Future[Path]] = [Future() for _ in cuts]
    state_cut[0].set_result(prepared)

    def cut_states() -> list[Path]:
        try:
            return chain_states()
        except BaseException as exc:
            for pending in state_cut:
                if not pending.done():
                    pending.set_exception(exc)
            raise

    def chain_states() -> list[Path]:
        states = [prepared]
        for before, cut in pairwise(cuts):
            state = tmp_path / f"state-{cut.replace(':', '-')}"
            shutil.copytree(states[-1], state)
            crossed = state.parent / f"{state.name}.trace"
            killed = memfit_run(state, small_locomo, shared_data, MEMFIT_FAULT=counted_from(trace, cut, before),
                                MEMFIT_FAULT_TRACE=str(crossed))
            assert killed.returncode == -signal.SIGKILL, f"cutting the state at {cut}: {killed.stderr[-2000:]}"
            # the copy crossed exactly the reference's durable writes from the state before to the cut
            writes = [name for name, _ in parse_trace(crossed) if name not in NOT_BOUNDARIES]
            want = [name for name in trace[position(trace, before) + 1:position(trace, cut) + 1]
                    if name not in NOT_BOUNDARIES]
            assert writes == want, f"cutting the state at {cut}: crossed {writes}, the reference {want}"
            states.append(state)
            state_cut[len(states) - 1].set_result(state)
        return states

    def scenario(index: int, point: str, tail: bytes) -> list[str]:
        label = f"killed at {point}" + (" with a torn chunk" if tail else "")
        out = tmp_path / f"s{index:02d}"
        traces = tmp_path / f"s{index:02d}.killed", tmp_path / f"s{index:02d}.rerun"
        later = [i for i, cut in enumerate(cuts) if position(trace, point) > position(trace, cut)]
        fault = point
        if point in cuts:  # the state cut here (killed there, its exit code checked where it was cut)
            state = state_cut[cuts.index(point)].result()
            shutil.copytree(state, out)
            shutil.copyfile(state.parent / f"{state.name}.trace", traces[0])
        else:
            if later:
                start = later[-1]
                shutil.copytree(state_cut[start].result(), out)
                fault = counted_from(trace, point, cuts[start])
            killed = memfit_run(out, small_locomo, shared_data, MEMFIT_FAULT=fault,
                                MEMFIT_FAULT_TRACE=str(traces[0]))
            if killed.returncode != -signal.SIGKILL:
                return [f"{label}: the run was not killed (exit code {killed.returncode}): {killed.stderr[-1500:]}"]
        last = parse_trace(traces[0])[-1][0]
        if last != point.split(":")[0]:
            return [f"{label}: the run died after {last}"]
        if tail:
            with open(out / "predictions.jsonl", "ab") as handle:
                handle.write(tail)
        store = out / "store"
        covered = store_texts(store, snapshot_coverage(store)) if (store / "log.jsonl").exists() else 0
        rerun = memfit_run(out, small_locomo, shared_data, MEMFIT_FAULT_TRACE=str(traces[1]))
        if rerun.returncode != 0:
            return [f"{label}: rerun exit code {rerun.returncode}: {rerun.stderr[-1500:]}"]
        problems = check_resumed(out, reference, label)
        # The model loads only for a call the killed run had not committed: after the last commit, never.
        loads = [name for name, _ in parse_trace(traces[1])].count("reader.load") if traces[1].exists() else 0
        if loads != (1 if position(trace, point) < last_commit else 0):
            problems.append(f"{label}: the rerun loaded the reader's model {loads} times")
        # Only texts no complete snapshot held at the kill are encoded again (a replay of the log's tail).
        if encoded(traces[1]) != store_texts(store) - covered:
            problems.append(f"{label}: the rerun encoded {encoded(traces[1])} texts, "
                            f"{store_texts(store) - covered} were not in a snapshot")
        if not problems:  # a failing scenario's directory stays for a look
            shutil.rmtree(out)
        return problems

    with ThreadPoolExecutor(max_workers=2) as pool:
        states = pool.submit(cut_states)  # first: the scenarios that need a later state wait for it
        results = pool.map(lambda args: scenario(*args), [(i, p, t) for i, (p, t) in enumerate(scenarios)])
        problems = [problem for result in results for problem in result]
        states.result()
    assert not problems, "\n".join(problems)


@pytest.mark.slow
def test_a_full_disk_is_one_line_and_the_rerun_resumes_to_the_reference(reference: Path, prepared: Path,
                                                                        tmp_path: Path, small_locomo: Path,
                                                                        shared_data: Path):
    """A full disk at the ledger save used to give three chained ENOSPC tracebacks naming no file,
    and lost the calls made since the last save. At the ledger report and at a response-cache commit,
    the run stops with one line naming the file (exit code 2); the same command then finishes as the
    reference did, its ledger counting every call once."""
    from memfit_gpu.faults import IO_FAULT_ENV

    def scenario(index: int, fault: str, file: str) -> list[str]:
        out = tmp_path / f"disk{index}"
        shutil.copytree(prepared, out)
        full = memfit_run(out, small_locomo, shared_data, **{IO_FAULT_ENV: fault})
        line = full.stderr.strip().splitlines()[-1] if full.stderr.strip() else ""
        problems = []
        if full.returncode != 2 or "Traceback" in full.stderr:
            problems.append(f"{fault}: exit code {full.returncode}: {full.stderr[-1500:]}")
        elif not line.startswith(f"memfit run: error: {out / file}") or "(ENOSPC); free space" not in line:
            problems.append(f"{fault}: {line}")
        rerun = memfit_run(out, small_locomo, shared_data)
        if rerun.returncode != 0:
            return [*problems, f"{fault}: rerun exit code {rerun.returncode}: {rerun.stderr[-1500:]}"]
        return problems + check_resumed(out, reference, f"full disk at {fault}")

    faults_at = [("ledger.json:ENOSPC:2", "ledger.json"), ("cache.sqlite:ENOSPC:2", "cache.sqlite")]
    with ThreadPoolExecutor(max_workers=2) as pool:
        problems = [p for result in pool.map(lambda args: scenario(*args), [(i, *f) for i, f in enumerate(faults_at)])
                    for p in result]
    assert not problems, "\n".join(problems)


# ----------------------------------------------------------------------------- against a counting server

SERVER_KEY_ENV = "MEMFIT_TEST_SERVER_KEY"  # reader.api_key_env: the server tells runs apart by their key
# What the server is paid for, as the ledger reports it: its calls and tokens over the roles that ask it.
PAID_ROLES = ("summary", "answer")
# The kills around the calls a server is paid for: after a response's commit (the summaries' before their
# ledger report; the first answer's while the second is in flight; the second's, which completes the first
# batch, before its ledger report), and after that batch's predictions.
SERVER_KILLS = ["reader.commit:1", "reader.commit:3", "reader.commit:4", "predictions:1"]


@pytest.fixture(scope="module")
def counting_server() -> Any:
    # Replies 0.3 s apart: at a kill, no reply is on its way (one whose client died waiting is not sent).
    server = CountingServer(gap_s=0.3)
    yield server
    server.close()


def server_args(server: CountingServer) -> list[str]:
    return ["reader.backend=openai", f"reader.model={MODEL}", f"reader.base_urls=[{server.url}]",
            "reader.concurrency=2", "reader.max_retries=1", "reader.timeout_s=60", f"reader.api_key_env={SERVER_KEY_ENV}"]


def server_run(out: Path, server: CountingServer, key: str, data: Path, shared_data: Path,
               **env: str) -> subprocess.CompletedProcess[str]:
    return memfit_run(out, data, shared_data, *server_args(server), **{SERVER_KEY_ENV: key, **env})


@pytest.fixture(scope="module")
def server_reference(tmp_path_factory: pytest.TempPathFactory, counting_server: CountingServer, small_locomo: Path,
                     shared_data: Path) -> Path:
    out = tmp_path_factory.mktemp("server") / "reference"
    proc = server_run(out, counting_server, "reference", small_locomo, shared_data,
                      MEMFIT_FAULT_TRACE=str(out.parent / "reference.trace"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert counting_server.paid["reference"]["calls"] == 6  # 2 summaries + 4 answers
    return out


def booked(ledger: Ledger) -> dict[str, int]:
    """The paid calls and tokens a ledger reports."""
    roles = [ledger.roles[role] for role in PAID_ROLES]
    return {"calls": sum(r.calls - r.errors for r in roles), "input_tokens": sum(r.input_tokens for r in roles),
            "output_tokens": sum(r.output_tokens for r in roles)}


def paid_problems(run_dir: Path, paid: Counter[str], label: str) -> list[str]:
    """What differs between the ledger's calls and tokens and what the server delivered."""
    booked_calls = booked(Ledger.load(run_dir / "ledger.json"))
    if booked_calls != {k: paid.get(k, 0) for k in booked_calls}:
        return [f"{label}: the ledger reports {booked_calls}, the server delivered {dict(paid)}"]
    return []


def by_question(run_dir: Path) -> dict[str, dict[str, Any]]:
    return {row["question_id"]: row for row in read_jsonl(run_dir / "predictions.jsonl")}


@pytest.mark.slow
def test_kills_against_a_server_leave_a_ledger_of_exactly_what_it_was_paid(
        counting_server: CountingServer, server_reference: Path, tmp_path: Path, small_locomo: Path,
        shared_data: Path) -> None:
    """Killed after a response was committed but before ledger.json reported it, a rerun
    reported 3 calls / 3 cached where 6 were paid. Each kill here, then the rerun, leaves a ledger whose
    calls and tokens are those the server delivered to both processes, and the reference's results."""
    trace = [name for name, _ in parse_trace(server_reference.parent / "reference.trace")]
    assert Counter(trace)["reader.commit"] == 6
    prepared = prepare(tmp_path / "prepared", trace, small_locomo, shared_data, *server_args(counting_server),
                       **{SERVER_KEY_ENV: "prepared"})
    assert not counting_server.paid["prepared"]  # the store's build asks the server nothing

    def scenario(index: int, point: str) -> list[str]:
        label, key, out = f"killed at {point}", f"s{index}", tmp_path / f"s{index}"
        from_prepared, fault = start_state(trace, point)
        assert from_prepared
        shutil.copytree(prepared, out)
        killed = server_run(out, counting_server, key, small_locomo, shared_data, MEMFIT_FAULT=fault)
        if killed.returncode != -signal.SIGKILL:
            return [f"{label}: the run was not killed (exit code {killed.returncode}): {killed.stderr[-1500:]}"]
        # What the killed process committed (cache.sqlite's entries): never more than the server delivered
        # to it. A response delivered while the SIGKILL lands is paid but never received, so the check is
        # exact from here on: the rerun (its own server key) must add exactly what it is delivered.
        committed = booked(load_ledger(out))
        delivered = counting_server.paid[key]
        if any(committed[k] > delivered[k] for k in committed):
            return [f"{label}: the killed run's entries {committed} exceed what the server delivered {dict(delivered)}"]
        rerun = server_run(out, counting_server, key + "-rerun", small_locomo, shared_data)
        if rerun.returncode != 0:
            return [f"{label}: rerun exit code {rerun.returncode}: {rerun.stderr[-1500:]}"]
        problems = paid_problems(out, Counter(committed) + counting_server.paid[key + "-rerun"], label)
        if by_question(out) != by_question(server_reference):
            problems.append(f"{label}: predictions differ from the reference")
        if comparable_metrics(out) != comparable_metrics(server_reference):
            problems.append(f"{label}: metrics.json differs from the reference")
        ledger = Ledger.load(out / "ledger.json")
        if sorted(ledger.answer_keys) != QUESTIONS:
            problems.append(f"{label}: ledger answer keys {ledger.answer_keys}")
        if not problems:
            shutil.rmtree(out)
        return problems

    assert not paid_problems(server_reference, counting_server.paid["reference"], "the reference")
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = pool.map(lambda args: scenario(*args), list(enumerate(SERVER_KILLS)))
        problems = [problem for result in results for problem in result]
    assert not problems, "\n".join(problems)


@pytest.mark.slow
def test_a_question_the_server_does_not_answer_fails_alone_and_is_asked_again(
        counting_server: CountingServer, server_reference: Path, tmp_path: Path, small_locomo: Path,
        shared_data: Path) -> None:
    """`message.content: null` used to become an empty, cached answer (a table of zeros, exit 0). Now
    that question alone fails after the transport's retries: the run answers the others, exits 1 with
    the count, caches nothing for it, and the rerun asks only that question again."""
    question = json.loads(small_locomo.read_text())[0]["qa"][2]["question"]
    counting_server.null_for["nulls"] = {question}
    out = tmp_path / "run"
    first = server_run(out, counting_server, "nulls", small_locomo, shared_data)
    assert first.returncode == 1, first.stderr[-3000:]
    line = first.stderr.strip().splitlines()[-1]
    assert line.startswith("memfit run: 1 of 4 questions got no answer (first: conv-26:q2: ")
    assert "message.content is null" in line and "rerun the same command" in line
    assert "Traceback" not in first.stderr
    assert counting_server.attempts["nulls"][question] == 2  # reader.max_retries=1: asked twice
    assert sorted(by_question(out)) == ["conv-26:q0", "conv-26:q1", "conv-26:q3"]
    assert not (out / "DONE").exists()
    counting_server.null_for["nulls"] = set()
    rerun = server_run(out, counting_server, "nulls", small_locomo, shared_data)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert by_question(out) == by_question(server_reference)
    metrics, want = comparable_metrics(out), comparable_metrics(server_reference)
    assert (metrics.pop("ledger"), want.pop("ledger")) == ({"answer_calls": 5}, {"answer_calls": 4})
    assert metrics == want
    answer = Ledger.load(out / "ledger.json").roles["answer"]
    assert (answer.calls, answer.errors, answer.cached) == (5, 1, 0)  # q2 twice: failed, then answered
    assert not paid_problems(out, counting_server.paid["nulls"], "after the rerun")
