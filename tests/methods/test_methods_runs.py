"""The methods' acceptance, on real data with the packaged models: every method through `memfit run`.

`memfit run --config configs/demo.yaml method=M data.limit_questions=3 data.path=F` (F: LoCoMo conv-26 cut
to its first three sessions, 58 real turns, with its first three questions, whose evidence lies there; MiniLM
encoder, SmolLM2-135M reader) for plain, naive_rag, full_context, lightmem_slm and memfit: the run directory's files, one answer call per question, no new call on a rerun, `memfit compare`
between methods and `memfit efficiency` over all five. Then plain against MemFit's path with the ablation
file's overrides, full context's truncation against the reader's own context, LightMem's calls per role,
and LightMem killed at its durable writes. The cut conversation keeps every path (LightMem's MTM windows and
a consolidation, MemFit's summaries, a full context that overflows its budget) at a seventh of the text the
whole conversation gives SmolLM2 to read; the full context's fit to the reader's own 8,192 tokens reads the
whole conversation (no generation). torch gets one thread (OMP_NUM_THREADS=1), which a busy 2-core box runs
several times faster than two.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml
from support.data import write_small_locomo
from support.env import memfit_env

from memfit_gpu.config import load_config
from memfit_gpu.data import load_benchmark, select_from_config
from memfit_gpu.faults import TRACE_ENV, parse_trace
from memfit_gpu.files import read_jsonl
from memfit_gpu.methods.base import MethodRun
from memfit_gpu.methods.common import TurnTable, mtm_windows
from memfit_gpu.methods.full_context import FullContext
from memfit_gpu.methods.lightmem import due_consolidations
from memfit_gpu.methods.memfit import MemFit
from memfit_gpu.methods.packs import questions_of
from memfit_gpu.readers.ledger import Ledger
from memfit_gpu.readers.prompts import build_answer_messages
from memfit_gpu.readers.reader import make_reader
from memfit_gpu.readers.types import ROLE_PHASES
from memfit_gpu.retrieve.pack import excerpt_tail
from memfit_gpu.run.pipeline import run
from memfit_gpu.store import RecordLog

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "configs" / "demo.yaml"
METHODS = ("plain", "naive_rag", "full_context", "lightmem_slm", "memfit")
QUESTIONS = [f"conv-26:q{i}" for i in range(3)]  # two temporal, one open-domain: one answer batch
OUTPUTS = ("config.yaml", "predictions.jsonl", "metrics.json", "ledger.json", "results.md", "packs.jsonl",
           "diagnostics.json", "DONE")

def memfit(*args: str, shared_data: Path, timeout: int = 3600, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "memfit_gpu.cli", *args], env=memfit_env(shared_data, threads=1, **env),
                          capture_output=True, text=True, timeout=timeout)


# What the tests here check (files, calls per role, caching, packs, truncation) does not depend on how long
# SmolLM2's texts are or how many summaries MemFit writes: the runs generate less than the demo (its 6
# summaries of 96 tokens, answers of 32, LightMem's 48-64-token notes), and the full context is bounded at
# 1,024 tokens (the demo's 2,048 halved; still well short of the 58 turns), which halves its prompts.
CUT = ["summary.max_summaries=2", "summary.max_new_tokens=24", "reader.max_new_tokens=8",
       "full_context.context_tokens=1024", "lightmem.mtm_max_new_tokens=16", "lightmem.consolidate_max_new_tokens=16",
       "lightmem.rewrite_max_new_tokens=16", "lightmem.rerank_max_new_tokens=8"]


def overrides(method: str, data: Path) -> list[str]:
    return [f"method={method}", f"data.limit_questions={len(QUESTIONS)}", f"data.path={data}", *CUT]


def demo_run(out: Path, method: str, shared_data: Path, data: Path, *extra: str,
             **env: str) -> subprocess.CompletedProcess[str]:
    # the overrides are one positional list: all of them before the options that follow it
    return memfit("run", "--config", str(DEMO), *overrides(method, data), *extra, "--out", str(out), "--quiet",
                  shared_data=shared_data, **env)


def cache_rows(run_dir: Path) -> int:
    with sqlite3.connect(run_dir / "cache.sqlite") as db:
        return db.execute("select count(*) from responses").fetchone()[0]


def calls_made(run_dir: Path) -> int:
    """Backend calls the directory's ledger entries record (readers/cache.py: every paid call, once)."""
    with sqlite3.connect(run_dir / "cache.sqlite") as db:
        return db.execute("select count(*) from calls where served = 'call'").fetchone()[0]


# the longest runs first
RUN_ORDER = ("lightmem_slm", "full_context", "memfit", "naive_rag", "plain")
# independent runs of one torch thread each: two at a time fill a 2-core CI machine
PARALLEL_RUNS = 2


@pytest.fixture(scope="module")
def conv26_s1_3(tmp_path_factory: pytest.TempPathFactory, shared_data: Path) -> Path:
    """conv-26 cut to its first three sessions (58 turns) with its first three questions."""
    return write_small_locomo(shared_data, tmp_path_factory.mktemp("conv26"), questions=len(QUESTIONS))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, shared_data: Path, conv26_s1_3: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("methods")
    with ThreadPoolExecutor(PARALLEL_RUNS) as pool:
        procs = dict(zip(RUN_ORDER, pool.map(lambda m: demo_run(root / m, m, shared_data, conv26_s1_3), RUN_ORDER),
                         strict=True))
    for method, proc in procs.items():
        assert proc.returncode == 0, f"{method}: {proc.stderr[-3000:]}"
        assert re.search(rf"^\| \*\*Average\*\* +\| +{len(QUESTIONS)} \|", proc.stdout, re.MULTILINE), proc.stdout
    assert sorted(RUN_ORDER) == sorted(METHODS)
    return {method: root / method for method in METHODS}


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_every_method_writes_a_run_directory_with_one_answer_call_per_question(runs: dict[str, Path], method: str,
                                                                              conv26_s1_3: Path):
    run_dir = runs[method]
    for name in OUTPUTS:
        assert (run_dir / name).is_file(), f"{method}: {name}"
    assert load_config(run_dir / "config.yaml") == load_config(DEMO, overrides(method, conv26_s1_3))
    predictions = read_jsonl(run_dir / "predictions.jsonl")
    assert [p["question_id"] for p in predictions] == QUESTIONS
    ledger = Ledger.load(run_dir / "ledger.json")
    ledger.check_one_answer_per_question(QUESTIONS)
    assert ledger.answer_keys == QUESTIONS and ledger.roles["answer"].calls == 3
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert (metrics["method"], metrics["questions"], metrics["ledger"]["answer_calls"]) == (method, 3, 3)
    assert metrics["retrieval"]["method"]["name"] == method
    phases = json.loads((run_dir / "ledger.json").read_text())["phases"]
    write_roles = {"memfit": ["summary"], "lightmem_slm": ["mtm_summary", "consolidate"]}.get(method, [])
    assert phases["write"]["calls"] == sum(ledger.roles[r].calls for r in write_roles)
    assert (phases["write"]["calls"] > 0) == (method in ("memfit", "lightmem_slm"))
    assert phases["read"]["calls"] == 3 + sum(ledger.roles[r].calls for r in ("rewrite", "rerank_slm"))


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_rerun_makes_no_new_call(runs: dict[str, Path], method: str, tmp_path: Path, shared_data: Path,
                                 conv26_s1_3: Path, monkeypatch: pytest.MonkeyPatch):
    run_dir = runs[method]
    before = (run_dir / "ledger.json").read_bytes(), cache_rows(run_dir)
    again = demo_run(run_dir, method, shared_data, conv26_s1_3)  # a finished run only reports
    assert again.returncode == 0, again.stderr[-2000:]
    assert (run_dir / "ledger.json").read_bytes() == before[0] and cache_rows(run_dir) == before[1]
    # Without its packs, predictions and ledger.json the run is made again from what it kept: the write-time
    # state (store, summaries, LightMem's log) asks for nothing, every read-time call is a cache hit (no
    # new call: the ledger, rebuilt from cache.sqlite's entries, holds the first run's calls), and the
    # predictions are the same.
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    for name in ("DONE", "packs.jsonl", "diagnostics.json", "predictions.jsonl", "metrics.json", "results.md",
                 "ledger.json"):
        (copy / name).unlink()
    monkeypatch.setenv("MEMFIT_DATA_DIR", str(shared_data))
    run(load_config(DEMO, overrides(method, conv26_s1_3)), copy, progress=False)
    first, second = Ledger.load(run_dir / "ledger.json"), Ledger.load(copy / "ledger.json")
    assert {r: s.calls for r, s in second.roles.items()} == {r: s.calls for r, s in first.roles.items()}
    assert calls_made(copy) == calls_made(run_dir) == sum(s.calls for s in first.roles.values())
    # what a rerun re-serves is counted as cached, except the answers, each of which has its one call
    assert {r: s.cached for r, s in second.roles.items()} == {
        r: s.cached + (s.calls + s.cached if ROLE_PHASES[r] == "read" and r != "answer" else 0)
        for r, s in first.roles.items()}
    assert cache_rows(copy) == before[1]
    assert read_jsonl(copy / "predictions.jsonl") == read_jsonl(run_dir / "predictions.jsonl")


@pytest.mark.slow
def test_plain_packs_are_memfit_with_the_ablation_overrides(runs: dict[str, Path], conv26_s1_3: Path):
    """method=plain == MemFit's path with configs/ablations/plain_retrieval.yaml's overrides."""
    ablation = yaml.safe_load((REPO / "configs" / "ablations" / "plain_retrieval.yaml").read_text())
    overrides = [f"data.limit_questions={len(QUESTIONS)}", f"data.path={conv26_s1_3}", "index.device=cpu", *CUT,
                 *(f"{section}.{key}={value}" for section, keys in ablation.items() if section != "defaults"
                   for key, value in keys.items() if not isinstance(value, dict)),
                 *(f"retrieve.prf.{key}={value}" for key, value in ablation["retrieve"]["prf"].items())]
    cfg = load_config(DEMO, overrides)
    selected = select_from_config(load_benchmark("locomo", conv26_s1_3), cfg.data)
    memfit_method = MemFit()  # MemFit's own method, without a reader: no summaries (plain has none either)
    try:
        run_ = MethodRun(cfg, None, selected, selected.memories, questions_of(selected))
        memfit_method.write(run_)
        expected = {row["question_id"]: row for row in memfit_method.read(run_)[0]}
    finally:
        memfit_method.close()
    plain = {r["question_id"]: r for r in read_jsonl(runs["plain"] / "packs.jsonl")}
    assert list(plain) == QUESTIONS
    for qid in QUESTIONS:
        for field in ("excerpts", "pack", "ranked", "prf_terms"):
            assert plain[qid][field] == expected[qid][field], (qid, field)


def check_oldest_dropped(pack: dict, cfg, count, room: int, table: TurnTable, turns: int, last_turn: str) -> dict:
    """The pack holds the newest turns of its memory (`turns` of them, the last `last_turn`) and exactly the
    fewest oldest ones are dropped for its answer prompt to fit `room` tokens; returns its truncation record."""
    truncation = pack["method_notes"]["truncation"]
    rows = table.memory_rows(table.memory_index(pack["memory_id"]))
    tails = [excerpt_tail(table, r, cfg.pack.resolve_dates, cfg.pack.max_excerpt_chars)[0] for r in rows]

    def tokens(first_kept: int) -> int:
        text = "\n".join(f"EXCERPT {i} {t}" for i, t in enumerate(tails[first_kept:], start=1))
        return count(build_answer_messages(pack["question"], text))

    dropped = truncation["turns_dropped"]
    assert truncation["turns"] == len(rows) == turns and 0 < dropped < turns
    assert pack["excerpts"] == "\n".join(f"EXCERPT {i} {t}" for i, t in enumerate(tails[dropped:], start=1))
    assert tokens(dropped) <= room < tokens(dropped - 1)
    assert truncation["first_kept_turn"] == pack["pack"]["episodes"][0]["turn_id"] == table.ep_turn_id[rows[dropped]]
    assert pack["pack"]["episodes"][-1]["turn_id"] == last_turn  # the last turn of the conversation stays
    return truncation


@pytest.mark.slow
def test_full_context_run_records_its_truncation(runs: dict[str, Path], conv26_s1_3: Path):
    """The run bounds the prompt by full_context.context_tokens (CPU-sized: CUT's), counted by the reader."""
    cfg = load_config(DEMO, overrides("full_context", conv26_s1_3))
    reader = make_reader(cfg.reader, None, progress=False)
    _, count = reader.prompt_token_limit()  # type: ignore[misc]
    reader.close()
    table = TurnTable.from_memories(load_benchmark("locomo", conv26_s1_3).memories)
    packs = {r["question_id"]: r for r in read_jsonl(runs["full_context"] / "packs.jsonl")}
    for prediction in read_jsonl(runs["full_context"] / "predictions.jsonl"):
        pack = packs[prediction["question_id"]]
        truncation = check_oldest_dropped(pack, cfg, count, 1024 - 8, table, 58, "D3:23")  # CUT's bound and answer
        assert prediction["method_notes"] == pack["method_notes"]
        assert truncation["bound"] == "full_context.context_tokens of 1,024 tokens less reader.max_new_tokens=8"
        assert "prompt_chars_cut" not in prediction and "truncated_tokens" not in prediction["reader_notes"]


@pytest.mark.slow
def test_full_context_fits_the_readers_own_context(shared_data: Path):
    """full_context.context_tokens null: the transformers reader's own context (SmolLM2: 8,192 tokens)."""
    cfg = load_config(DEMO, ["method=full_context", "data.limit_questions=5", "full_context.context_tokens=null"])
    bench = select_from_config(load_benchmark("locomo", shared_data / "locomo" / "locomo10.json"), cfg.data)
    reader = make_reader(cfg.reader, None, progress=False)
    context, count = reader.prompt_token_limit()  # type: ignore[misc]
    method = FullContext()
    run_ = MethodRun(cfg, None, bench, bench.memories, bench.questions(), reader=lambda: reader)
    method.write(run_)
    rows, diagnostics = method.read(run_)
    reader.close()
    assert context == 8192 and diagnostics["method"]["questions_truncated"] == 5
    for row in rows:
        truncation = check_oldest_dropped(row, cfg, count, context - 32, method.table,  # type: ignore[arg-type]
                                          419, "D19:15")
        assert truncation["bound"] == "the reader's context of 8,192 tokens less reader.max_new_tokens=32"


@pytest.mark.slow
def test_lightmem_calls_each_small_model_role_batched(runs: dict[str, Path], conv26_s1_3: Path):
    cfg = load_config(DEMO, overrides("lightmem_slm", conv26_s1_3))
    memory = load_benchmark("locomo", conv26_s1_3).memories[0]
    sessions = [i for i, s in enumerate(memory.sessions) for _ in s.turns]
    windows = len(mtm_windows(sessions, cfg.lightmem.mtm_window_turns, final=True))
    ledger = Ledger.load(runs["lightmem_slm"] / "ledger.json")
    assert ledger.roles["mtm_summary"].calls == windows
    assert ledger.roles["consolidate"].calls == len(due_consolidations(windows, cfg.lightmem.consolidate_every))
    assert ledger.roles["rewrite"].calls == 3
    packs = read_jsonl(runs["lightmem_slm"] / "packs.jsonl")
    # SLM-2 is asked only where there is more than one candidate to order
    assert ledger.roles["rerank_slm"].calls == sum(1 for p in packs if p["lightmem"]["candidates"] > 1)
    for pack in packs:
        assert sum(h["budget"] for h in pack["lightmem"]["hqs"]) == cfg.lightmem.top_k
        assert len(pack["lightmem"]["items"]) <= cfg.lightmem.top_k
        # the recent turns come first: session 3's, the last of the cut conversation
        assert pack["excerpts"].startswith("RECENT TURNS:\nEXCERPT 1 (recorded 9 June 2023): ")
    log = RecordLog(runs["lightmem_slm"] / "lightmem" / "log.jsonl")
    kinds = [r["t"] for r in log.records]
    log.close()
    assert (kinds.count("mtm"), kinds.count("ltm")) == (ledger.roles["mtm_summary"].calls,
                                                        ledger.roles["consolidate"].calls)


@pytest.mark.slow
def test_compare_and_efficiency_work_across_methods(runs: dict[str, Path], shared_data: Path, tmp_path: Path):
    for a, b in (("plain", "lightmem_slm"), ("naive_rag", "full_context"), ("memfit", "naive_rag")):
        proc = memfit("compare", str(runs[a]), str(runs[b]), shared_data=shared_data, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
    proc = memfit("efficiency", *(str(runs[m]) for m in METHODS), shared_data=shared_data, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    cells = [[c.strip() for c in line.strip().strip("|").split("|")] for line in proc.stdout.splitlines()]
    assert cells[0][:6] == ["run", "method", "reader", "questions", "write_calls", "read_calls"]
    assert [row[1] for row in cells[2:]] == list(METHODS)
    write_calls = {row[1]: int(row[4]) for row in cells[2:]}
    assert write_calls["plain"] == write_calls["naive_rag"] == write_calls["full_context"] == 0
    assert write_calls["memfit"] > 0 and write_calls["lightmem_slm"] > 0
    # the paper's tables: the efficiency table by method lists the five runs with the same write calls
    tables = subprocess.run([sys.executable, str(REPO / "experiments" / "paper_tables.py"), "--out",
                             str(tmp_path / "tables"), "--efficiency", *(f"{m}={runs[m]}" for m in METHODS)],
                            env=memfit_env(shared_data, threads=1), capture_output=True, text=True, timeout=300)
    assert tables.returncode == 0, tables.stderr[-2000:]
    rows = [line for line in (tmp_path / "tables" / "efficiency_methods.md").read_text().splitlines()
            if line.startswith("|")][2:]  # the table's lines less its header and rule
    by_method = {r[1]: r for r in ([c.strip() for c in line.strip("|").split("|")] for line in rows)}
    assert list(by_method) == list(METHODS)
    assert {m: int(r[3]) for m, r in by_method.items()} == write_calls


@pytest.mark.slow
def test_memfit_retrieve_runs_llm_free_methods_and_refuses_lightmem(runs: dict[str, Path], tmp_path: Path,
                                                                    shared_data: Path, conv26_s1_3: Path):
    refused = memfit("retrieve", "--config", str(DEMO), "--benchmark", "locomo", "--out", str(tmp_path / "lm"),
                     "method=lightmem_slm", shared_data=shared_data, timeout=300)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert refused.stderr.splitlines()[-1] == (
        "memfit retrieve: error: method=lightmem_slm retrieves with LLM calls (small language models): use "
        "`memfit run`, which makes and accounts for them")
    proc = memfit("retrieve", "--config", str(DEMO), "--benchmark", "locomo", "--data", str(conv26_s1_3), "--out",
                  str(tmp_path / "rag"), "--limit-questions", str(len(QUESTIONS)), "method=naive_rag", *CUT, shared_data=shared_data,
                  timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    mine = {r["question_id"]: r for r in read_jsonl(tmp_path / "rag" / "packs.jsonl")}
    for row in read_jsonl(runs["naive_rag"] / "packs.jsonl"):
        assert mine[row["question_id"]]["excerpts"] == row["excerpts"]


# ------------------------------------------------------------------------------------------ LightMem kills
SMALL = ["data.limit_questions=2", "reader.max_new_tokens=8", "lightmem.mtm_window_turns=6",
         "lightmem.consolidate_every=2", "lightmem.mtm_max_new_tokens=8", "lightmem.consolidate_max_new_tokens=8",
         "lightmem.rewrite_max_new_tokens=8", "lightmem.rerank_max_new_tokens=4", "lightmem.top_k=4"]


@pytest.fixture(scope="module")
def small_locomo(tmp_path_factory: pytest.TempPathFactory, shared_data: Path) -> Path:
    """conv-26 cut to its first three sessions (58 turns: 10 MTM windows of 6, 5 consolidations)."""
    return write_small_locomo(shared_data, tmp_path_factory.mktemp("data"), questions=4)


# Trace points that are no durable write of their own (as test_run_crash_consistency.py: timings.json is rewritten
# after every stage, store.encode counts the texts encoded)
NOT_BOUNDARIES = {"timings", "store.encode", "reader.load"}


def crossed(trace: Path) -> list[str]:
    return [name for name, _ in parse_trace(trace)]


def nth_crossing(trace: list[str], point: str) -> int:
    """Index in `trace` of `name:n`, its n-th crossing."""
    name, _, nth = point.partition(":")
    return [i for i, seen in enumerate(trace) if seen == name][int(nth) - 1]


@pytest.mark.slow
def test_lightmem_killed_at_its_durable_writes_resumes_to_the_reference(tmp_path: Path, small_locomo: Path,
                                                                        shared_data: Path):
    def lightmem(out: Path, **env: str) -> subprocess.CompletedProcess[str]:
        return demo_run(out, "lightmem_slm", shared_data, small_locomo, *SMALL, **env)

    reference = tmp_path / "reference"
    proc = lightmem(reference, **{TRACE_ENV: str(tmp_path / "reference.trace")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    trace = crossed(tmp_path / "reference.trace")
    want = Ledger.load(reference / "ledger.json")
    assert (want.roles["mtm_summary"].calls, want.roles["consolidate"].calls) == (10, 5)
    # mid-way through the per-turn appends; the MTM calls made and accounted, their entries not logged;
    # the LTM batches logged; the re-rank calls made and accounted, the packs not written
    points = ("store.log:30", "lightmem.mtm.ledger:1", "lightmem.ltm:1", "lightmem.rerank.ledger:1")
    assert [nth_crossing(trace, p) for p in points] == sorted(nth_crossing(trace, p) for p in points)
    # Each killed state after the MTM calls' is cut from a copy of the one before it (the kill point counted
    # as that run counts it), so that it makes again no call the state before made; each copy must cross
    # exactly the reference's durable writes between the two points (after redoing the step the earlier kill
    # interrupted). Every state is a scenario: its rerun is checked against the reference below.
    chained = points[1:]

    def kill(point: str) -> tuple[Path, subprocess.CompletedProcess[str], bool]:
        out = tmp_path / f"killed-{point.replace(':', '_')}"
        fault, index = point, points.index(point)
        if point in chained[1:]:
            before = points[index - 1]
            shutil.copytree(tmp_path / f"killed-{before.replace(':', '_')}", out)
            name, _, nth = point.partition(":")
            fault = f"{name}:{int(nth) - trace[:nth_crossing(trace, before) + 1].count(name)}"
        here = out.parent / f"{out.name}.trace"
        killed = lightmem(out, MEMFIT_FAULT=fault, **{TRACE_ENV: str(here)})
        if point in chained[1:] and killed.returncode == -signal.SIGKILL:
            # the copy crossed exactly the reference's durable writes from the state before to the point, after
            # it redid, in the reference's order, the writes of the step that state's kill interrupted (LightMem
            # serves that step's calls from the cache and logs them)
            writes = [name for name in crossed(here) if name not in NOT_BOUNDARIES]
            upto = [name for name in trace[:nth_crossing(trace, before) + 1] if name not in NOT_BOUNDARIES]
            between = [name for name in trace[nth_crossing(trace, before) + 1:nth_crossing(trace, point) + 1]
                       if name not in NOT_BOUNDARIES]
            redone, rest = writes[:len(writes) - len(between)], writes[len(writes) - len(between):]
            earlier = iter(upto)
            assert rest == between and all(name in earlier for name in redone), (point, writes, between)
        return out, killed, (out / "DONE").exists()

    def rerun(state: Path) -> tuple[Path, subprocess.CompletedProcess[str]]:
        out = tmp_path / state.name.removeprefix("killed-")
        shutil.copytree(state, out)
        return out, lightmem(out)

    # independent directories, one torch thread each: the chain of kills on one thread, on the other the first
    # kill and every rerun as soon as its state is there
    with ThreadPoolExecutor(PARALLEL_RUNS) as pool:
        def chain() -> list[tuple[tuple[Path, subprocess.CompletedProcess[str], bool], Future]]:
            states = []
            for point in chained:
                state = kill(point)
                states.append((state, pool.submit(rerun, state[0])))
            return states

        def first() -> tuple[tuple[Path, subprocess.CompletedProcess[str], bool], Future]:
            state = kill(points[0])
            return state, pool.submit(rerun, state[0])

        later = pool.submit(chain)
        started = [pool.submit(first).result(), *later.result()]
        killed_states = [state for state, _ in started]
        scenarios = [rerun_done.result() for _, rerun_done in started]
    for point, (_, killed, done_after_kill), (out, rerun_proc) in zip(points, killed_states, scenarios, strict=True):
        assert killed.returncode == -signal.SIGKILL, (point, killed.stderr[-2000:])
        assert not done_after_kill, point
        assert rerun_proc.returncode == 0, (point, rerun_proc.stderr[-3000:])
        assert read_jsonl(out / "predictions.jsonl") == read_jsonl(reference / "predictions.jsonl"), point
        assert read_jsonl(out / "packs.jsonl") == read_jsonl(reference / "packs.jsonl"), point
        got = Ledger.load(out / "ledger.json")
        assert got.answer_keys == want.answer_keys, point
        # every call was made once: the killed runs' calls are on its books, the rerun's hits are not calls
        assert {r: s.calls for r, s in got.roles.items()} == {r: s.calls for r, s in want.roles.items()}, point
