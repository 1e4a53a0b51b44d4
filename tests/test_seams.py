"""One seam per extension. The registries' names are the config's choices; a reader backend, a
benchmark and a method are added from tests/ alone (one module and one registry call each: the seam_*.py
modules beside this file, loaded by `memfit` through MEMFIT_PLUGINS) and `memfit run` runs end to end with
them; your own data in the jsonl format is validated, runs with the real reader and judge, and a LoCoMo or
LongMemEval file written in that format gives identical packs.

The echo backend answers with the first line of its prompt: the runs that use it check the machinery (which
code ran, what was written, what the ledger holds), never a score.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.data import write_small_locomo
from support.encoding import cached_embed

from memfit_gpu import config
from memfit_gpu.cli import main
from memfit_gpu.config import MemFitConfig, load_config
from memfit_gpu.data import load_benchmark, select_from_config
from memfit_gpu.data.jsonl import read, to_jsonl
from memfit_gpu.data.registry import REGISTRY as BENCHMARKS
from memfit_gpu.data.schema import DataError
from memfit_gpu.data.spec import JUDGE_KINDS, PROTOCOLS
from memfit_gpu.evaluate.metrics import VARIANTS
from memfit_gpu.files import read_jsonl
from memfit_gpu.methods.base import LIVE_MEMBERS, MethodRun
from memfit_gpu.methods.memfit import MemFit
from memfit_gpu.methods.packs import questions_of
from memfit_gpu.methods.registry import REGISTRY as METHODS
from memfit_gpu.methods.registry import MethodEntry, method_settings, register_method
from memfit_gpu.plugins import PLUGINS_ENV
from memfit_gpu.readers.ledger import Ledger
from memfit_gpu.readers.registry import REGISTRY as BACKENDS
from memfit_gpu.readers.types import ROLE_PHASES, register_role
from memfit_gpu.retrieve.batched import retrieve_batch
from memfit_gpu.retrieve.reference import retrieve_one
from memfit_gpu.retrieve.view import ReadView
from memfit_gpu.store import EpisodeStore

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
SMOKE = REPO / "configs" / "smoke.yaml"
EXAMPLE = REPO / "configs" / "data" / "example.jsonl"
EXAMPLE_QUESTIONS = ["alice:q0", "alice:q1", "alice:q2", "alice:q3", "alice:q4", "bob:q0", "bob:q1", "bob:q2"]


# ------------------------------------------------------------------------------------------- registries
def test_registry_keys_are_the_configs_choices() -> None:
    """Each name list exists once: config.py spells the built-in names (it imports nothing of memfit_gpu),
    each registry holds an entry per name, and a register call adds to both (config.register_choice)."""
    assert tuple(METHODS) == config.choices("method") and config.choices("method")[:len(config.METHODS)] == config.METHODS
    assert tuple(BENCHMARKS) == config.choices("data.benchmark")
    assert config.choices("data.benchmark")[:len(config.BENCHMARKS)] == config.BENCHMARKS
    # data.split takes every split a built-in benchmark's spec names (LongMemEval's, BEAM's)
    assert set(config._CHOICES["data.split"]) == {None, *(s for spec in BENCHMARKS.values() for s in spec.splits)}
    assert tuple(BACKENDS) == config.choices("reader.backend")
    assert config.choices("reader.backend")[:3] == config.READER_BACKENDS
    assert config._CHOICES["eval.judge.backend"] is config._REGISTERED["reader.backend"]  # any reader backend judges
    # the other names config.py must spell for itself, checked against their one owner
    assert set(config._CHOICES["reader.protocol"]) == {"auto", *PROTOCOLS}
    assert set(config._CHOICES["eval.judge.prompt"]) == {"auto", *JUDGE_KINDS}
    assert config._CHOICES["eval.table_metric"] == config._METRICS == VARIANTS
    with pytest.raises(config.ConfigError, match=r"data.benchmark='tiny' is not one of locomo, longmemeval"):
        load_config(None, ["data.benchmark=tiny"])  # registered only where its module is loaded


def test_a_method_entry_carries_its_roles_settings_and_prompt_folder() -> None:
    """What a method needs besides its code is its entry's: the built-in entries' roles are the ledger's
    built-in roles, their settings are MemFitConfig's sections, LightMem's prompt folder holds its prompts."""
    cfg = load_config(None, ["lightmem.prompt_dir=lightmem"])
    for name, entry in METHODS.items():
        assert all(ROLE_PHASES[role] == phase for role, phase in entry.roles.items()), name
    assert {role for entry in METHODS.values() for role in entry.roles} == set(ROLE_PHASES) - {
        "summary", "answer", "judge", "growth_answer", "depth_answer"}
    assert method_settings(cfg, "naive_rag") is cfg.naive_rag and method_settings(cfg, "lightmem_slm") is cfg.lightmem
    assert method_settings(cfg, "memfit") is None
    assert sorted(p.name for p in METHODS["lightmem_slm"].prompts(cfg).glob("*.txt")) == [
        "consolidate.txt", "mtm_summary.txt", "rerank.txt", "rewrite.txt"]
    with pytest.raises(ValueError, match="already registered in phase 'write'"):
        register_role("summary", "read")
    # a live entry is a LiveMethod: every built-in one is, and one that is not is refused when registered
    assert all(callable(getattr(entry.make, m, None)) for entry in METHODS.values() if entry.live for m in LIVE_MEMBERS)
    with pytest.raises(ValueError, match=r"method 'half_live': live=True asks for a LiveMethod .*; MemFit lacks "
                                         r"unconsolidated"):
        # a plugin's live method written before LiveMethod had `unconsolidated`
        older = type("MemFit", (), {m: lambda self, *args: None for m in LIVE_MEMBERS if m != "unconsolidated"})
        register_method("half_live", MethodEntry(older, live=True))
    assert "half_live" not in METHODS
    # one whose compact takes (run, store), written before a compaction named the users that had deleted turns:
    # refused here, not at a compaction that has rewritten the store already (and at every open after it)
    two_args = type("MemFit", (), {**{m: lambda self, *args: None for m in LIVE_MEMBERS},
                                   "compact": lambda self, run, store: None})
    with pytest.raises(ValueError, match=r"method 'old_compact': MemFit.compact must take \(run, store, purged\)"):
        register_method("old_compact", MethodEntry(two_args, live=True))
    assert "old_compact" not in METHODS


def test_what_asks_a_backend_entry() -> None:
    """The ledger, the plan, preflight, slurm and full_context read the entry, not the name."""
    vllm, openai, transformers = BACKENDS["vllm"], BACKENDS["openai"], BACKENDS["transformers"]
    cfg = load_config(None, ["reader.instances=3", "reader.tensor_parallel_size=2",
                             "reader.base_urls=[http://h:1/v1]"])
    assert (vllm.gpus(cfg.reader), openai.gpus(cfg.reader), transformers.gpus(cfg.reader)) == (6, 0, 0)
    assert (vllm.plan, openai.plan, transformers.plan) == ("engines", "server", "in_process")
    assert openai.urls(cfg.reader) == ["http://h:1/v1"] and vllm.urls(cfg.reader) == []
    assert (vllm.local, openai.local, vllm.context, transformers.context) == (True, False, "max_model_len", "backend")
    assert not openai.weights and vllm.weights


# ------------------------------------------------------------------------------------ added from tests/
def _memfit(*args: str, shared_data: Path, plugins: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "MEMFIT_DATA_DIR": str(shared_data), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           PLUGINS_ENV: plugins, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "memfit_gpu.cli", *args], env=env, capture_output=True, text=True,
                          timeout=900)


TINY = """\
# two memories of the test-only `tiny` chat-log format (tests/seam_tiny_benchmark.py)
M ann
T 2024-01-05T09:00:00 | Ann | My sister Jo moved to Oslo last winter.
T 2024-01-05T09:00:00 | Max | Does she like the cold?
T 2024-02-11T18:00:00 | Ann | Jo says the dark afternoons are the hardest part.
Q fact | Where did Ann's sister move? | Oslo | 1
M max
T 2024-03-01T12:00:00 | Max | I bought a red bicycle for the commute.
T 2024-03-01T12:00:00 | Ann | Nice, how far is your office?
T 2024-03-01T12:00:00 | Max | Eleven kilometres along the canal.
Q fact | What colour is Max's bicycle? | red | 1
Q fact | How far is Max's office? | eleven kilometres | 3
"""


@pytest.mark.slow
def test_a_backend_and_a_benchmark_added_from_tests_run_memfit_end_to_end(tmp_path: Path, shared_data: Path) -> None:
    """MemFit's own method over the test-only `tiny` benchmark, answered by the test-only `echo` backend."""
    data = tmp_path / "tiny.txt"
    data.write_text(TINY)
    out = tmp_path / "run"
    proc = _memfit("run", "--config", str(SMOKE), "--out", str(out), "--quiet", "data.benchmark=tiny",
                   f"data.path={data}", "data.limit_memories=null", "reader.backend=echo",
                   shared_data=shared_data, plugins="seam_echo_backend,seam_tiny_benchmark")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Tiny" in proc.stdout  # the results table is headed by the benchmark's own title
    predictions = read_jsonl(out / "predictions.jsonl")
    assert [p["question_id"] for p in predictions] == ["ann:q0", "max:q0", "max:q1"]
    packs = {p["question_id"]: p for p in read_jsonl(out / "packs.jsonl")}
    for prediction in predictions:
        pack = packs[prediction["question_id"]]
        assert pack["method"] == "memfit" and pack["ranked"] and pack["retrieval"]["pack_hit"] is True
        # the echo of the answer prompt's first line: the reader received MemFit's prompt
        assert prediction["raw_output"] == (REPO / "memfit_gpu" / "prompts" / "answer.txt").read_text().splitlines()[0]
    ledger = Ledger.load(out / "ledger.json")
    ledger.check_one_answer_per_question(["ann:q0", "max:q0", "max:q1"])
    assert list(ledger.models) == ["echo|HuggingFaceTB/SmolLM2-135M-Instruct"]
    assert json.loads((out / "ledger.json").read_text())["cost"]["by_model"] == {
        "echo|HuggingFaceTB/SmolLM2-135M-Instruct": 0.0}  # a local backend: no price (its entry says so)
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["benchmark"] == "tiny" and metrics["by_category"]["fact"]["name"] == "single fact"
    assert metrics["retrieval"]["overall"]["pack_hit"] == 1.0


@pytest.mark.slow
def test_a_method_added_from_tests_runs_memfit_end_to_end(tmp_path: Path, shared_data: Path) -> None:
    """The test-only `recent_turns` method over the example own-data file, answered by `echo`; then
    `memfit retrieve` writes the same rows through the same seam."""
    out = tmp_path / "run"
    plugins = "seam_echo_backend,seam_recent_turns_method"
    proc = _memfit("run", "--config", str(SMOKE), "--out", str(out), "--quiet", "data.benchmark=jsonl",
                   f"data.path={EXAMPLE}", "data.limit_memories=null", "method=recent_turns", "pack.k=3",
                   "reader.backend=echo", shared_data=shared_data, plugins=plugins)
    assert proc.returncode == 0, proc.stderr[-3000:]
    packs = read_jsonl(out / "packs.jsonl")
    assert [p["question_id"] for p in packs] == EXAMPLE_QUESTIONS
    alice = packs[0]
    assert alice["method"] == "recent_turns" and [e["turn_id"] for e in alice["pack"]["episodes"]] == [
        "s3:1", "s3:2", "s3:3"]
    assert alice["excerpts"].startswith("EXCERPT 1 (recorded 1 June 2024): Speaker Alice says: I am flying to Lisbon")
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["method"] == "recent_turns" and metrics["retrieval"]["method"] == {"name": "recent_turns",
                                                                                      "turns": 3}
    assert metrics["reranker"] == {"backend": "none"}  # what the method recorded, whatever rerank.backend says
    retrieved = tmp_path / "retrieve"
    proc = _memfit("retrieve", "--config", str(SMOKE), "--benchmark", "jsonl", "--data", str(EXAMPLE), "--out",
                   str(retrieved), "data.limit_memories=null", "method=recent_turns", "pack.k=3",
                   shared_data=shared_data, plugins=plugins)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert read_jsonl(retrieved / "packs.jsonl") == packs


@pytest.mark.slow
def test_a_method_with_its_own_settings_role_and_prompts_runs_end_to_end(tmp_path: Path, shared_data: Path) -> None:
    """The test-only `session_notes` method (tests/seam_session_notes_method.py): its settings are
    plugins.session_notes.*, its write calls take its own role `session_note` (phase write), its prompt
    folder is in provenance.json; nothing of it is in memfit_gpu."""
    out = tmp_path / "run"
    plugins = "seam_echo_backend,seam_session_notes_method"
    args = ("run", "--config", str(SMOKE), "--out", str(out), "--quiet", "data.benchmark=jsonl", f"data.path={EXAMPLE}",
            "data.limit_memories=null", "method=session_notes", "reader.backend=echo")
    refused = _memfit(*args, "plugins.session_notes.turns=0", shared_data=shared_data, plugins=plugins)
    assert refused.returncode == 2 and "plugins.session_notes: turns=0 must be at least 1" in refused.stderr
    assert not out.exists()  # refused before anything was written
    unknown = _memfit(*args, "plugins.nothing.x=1", shared_data=shared_data, plugins=plugins)
    assert unknown.returncode == 2 and "plugins.nothing is not a registered section" in unknown.stderr
    proc = _memfit(*args, "plugins.session_notes.turns=1", shared_data=shared_data, plugins=plugins)
    assert proc.returncode == 0, proc.stderr[-3000:]
    sessions = [(m.memory_id, s.session_id) for m in load_benchmark("jsonl", EXAMPLE).memories for s in m.sessions]
    ledger = json.loads((out / "ledger.json").read_text())
    assert ledger["roles"]["session_note"]["calls"] == len(sessions) == 5
    assert ledger["role_phases"]["session_note"] == "write"
    assert ledger["phases"]["write"]["calls"] == len(sessions) and ledger["phases"]["read"]["calls"] == 8
    # a process without the plugin still totals the role in its phase (ledger.json records it)
    assert Ledger.load(out / "ledger.json").phases()["write"].calls == len(sessions)
    packs = {p["question_id"]: p for p in read_jsonl(out / "packs.jsonl")}
    alice = packs["alice:q0"]
    # the echo reader's reply is the note prompt's first line: the method's own prompt reached the reader
    notes = [line for line in alice["excerpts"].splitlines() if line.startswith("NOTE ")]
    assert notes[0] == "NOTE 1 NOTE s1 of alice: Guess what, I adopted a dog yesterday! His name is Rex."
    assert len(notes) == sum(1 for user, _ in sessions if user == "alice")
    assert [e["turn_id"] for e in alice["pack"]["episodes"]] == ["s3:3"]  # plugins.session_notes.turns=1
    config_yaml = (out / "config.yaml").read_text()
    assert "session_notes:" in config_yaml and "turns: 1" in config_yaml
    prompts = json.loads((out / "provenance.json").read_text())["prompts"]["session_notes"]
    assert set(prompts) == {"session_note.txt"}
    assert prompts["session_note.txt"] == hashlib.sha256((TESTS / "seam_prompts" / "session_note.txt").read_bytes()).hexdigest()


@pytest.mark.slow
def test_a_read_path_stage_added_from_tests_runs_memfit_end_to_end(tmp_path: Path, shared_data: Path) -> None:
    """`memfit run` with the test-only `newest_first` stage loaded through MEMFIT_PLUGINS: its setting
    reaches the read path (the packed episodes stand newest first), config.yaml keeps both, and the same
    command without the plugin is refused before anything is written."""
    out = tmp_path / "run"
    args = ("run", "--config", str(SMOKE), "--out", str(out), "--quiet", "data.benchmark=jsonl", f"data.path={EXAMPLE}",
            "data.limit_memories=null", "reader.backend=echo", "retrieve.stages=[newest_first]",
            "plugins.newest_first.weight=100.0")
    refused = _memfit(*args, shared_data=shared_data, plugins="seam_echo_backend")
    assert refused.returncode == 2 and "plugins.newest_first is not a registered section" in refused.stderr
    bare = _memfit(*args[:-1], shared_data=shared_data, plugins="seam_echo_backend")  # without its settings
    assert bare.returncode == 2 and "retrieve.stages[0]='newest_first' is not a registered" in bare.stderr
    assert not out.exists()
    proc = _memfit(*args, shared_data=shared_data, plugins="seam_echo_backend,seam_newest_first_stage")
    assert proc.returncode == 0, proc.stderr[-3000:]
    when = {(m.memory_id, t.turn_id): t.timestamp for m in load_benchmark("jsonl", EXAMPLE).memories for t in m.turns()}
    packs = read_jsonl(out / "packs.jsonl")
    assert [p["question_id"] for p in packs] == EXAMPLE_QUESTIONS
    for pack in packs:
        times = [when[(pack["memory_id"], c["turn_id"])] for c in pack["ranked"] if c["kind"] == "episode"]
        assert len(times) > 1 and times == sorted(times, reverse=True), pack["question_id"]
    config_yaml = (out / "config.yaml").read_text()
    assert "- newest_first" in config_yaml and "weight: 100.0" in config_yaml
    stage_seconds = json.loads((out / "diagnostics.json").read_text())["retrieve_stage_seconds"]
    assert stage_seconds["stage_7_added"] >= 0


def _example_store(bi_encoder):  # the example own-data file's memories, with extractive summaries
    from conftest import lead_summaries  # tests/conftest.py (tests/ is on sys.path)

    store = EpisodeStore(None, MemFitConfig(), bi_encoder)
    store.add_memories(load_benchmark("jsonl", EXAMPLE).memories, progress=False)
    store.build_summaries(lead_summaries, progress=False)
    return store


def test_a_read_path_stage_added_from_tests_runs_in_both_read_paths(bi_encoder) -> None:
    """The test-only `newest_first` stage (tests/seam_newest_first_stage.py), one module and one registry
    call: `retrieve.stages=[newest_first]` runs it after the rerank in the batched path and the reference,
    which stay identical, and its weight (plugins.newest_first.weight) reorders the candidates."""
    import seam_newest_first_stage  # noqa: F401  (registers the stage, as MEMFIT_PLUGINS would)

    store = _example_store(bi_encoder)
    bench = load_benchmark("jsonl", EXAMPLE)
    questions = [(q.question, q.memory_id) for m in bench.memories for q in m.questions]
    texts, mems = [q for q, _ in questions], [m for _, m in questions]

    embed = cached_embed(bi_encoder)

    results = {}
    for weight in (None, "0.0", "100.0"):
        overrides = ["rerank.backend=none", *([] if weight is None else
                                              ["retrieve.stages=[newest_first]", f"plugins.newest_first.weight={weight}"])]
        cfg = load_config(REPO / "configs" / "memfit.yaml", overrides)
        batched = retrieve_batch(ReadView.from_store(store), cfg, texts, mems, embed=embed)
        view = ReadView.from_store(store)
        reference = [retrieve_one(view, cfg, t, m, embed) for t, m in questions]
        for a, b in zip(batched, reference, strict=True):
            assert a.pack_key() == b.pack_key(), a.question
            assert [(c["kind"], c["row"], c["final"]) for c in a.ranked] == [(c["kind"], c["row"], c["final"]) for c in b.ranked]
        results[weight] = (batched, view)
    plain, _ = results[None]
    zero, _ = results["0.0"]
    assert [r.ranked for r in zero] == [r.ranked for r in plain]  # weight 0 changes nothing
    heavy, view = results["100.0"]
    assert [r.ranked for r in heavy] != [r.ranked for r in plain]
    for result in heavy:  # the episodes now stand newest first
        times = [view.ep_time[c["row"]] for c in result.ranked if c["kind"] == "episode"]
        assert times == sorted(times, reverse=True), result.question
    with pytest.raises(config.ConfigError, match=r"retrieve.stages\[0\]='oldest_first' is not a registered"):
        load_config(None, ["retrieve.stages=[oldest_first]"])


def test_an_unknown_plugin_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PLUGINS_ENV, "no_such_plugin_module")
    assert main(["compare", str(tmp_path), str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(
        "memfit compare: error: $MEMFIT_PLUGINS names 'no_such_plugin_module', which cannot be imported")


# ------------------------------------------------------------------------------------------ your own data
BROKEN = [
    {"user_id": "u1", "sessions": [{"timestamp": "2024-13-01", "turns": [{"speaker": "A", "text": "hi"}]}],
     "questions": [{"question": "Q?", "category": "x", "evidence": ["S1:9"]}]},
    {"user_id": "u1", "sessions": [{"timestamp": "2024-01-01", "turns": [
        {"turn_id": "t", "speaker": "A", "text": "a"}, {"turn_id": "t", "speaker": "", "text": "b", "colour": 1}]}]},
]


def test_validate_reports_every_problem_with_line_and_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    broken = tmp_path / "broken.jsonl"
    broken.write_text("\n".join(json.dumps(m) for m in BROKEN) + "\nnot json\n")
    benchmark, report = read(broken)
    assert report.errors == [
        f"{broken}, item line 1 (user 'u1'), field 'sessions[0].timestamp': '2024-13-01' is not an ISO 8601 date or "
        "time (e.g. 2024-03-02 or 2024-03-02T10:00:00)",
        f"{broken}, item line 1 (user 'u1'), field 'questions[0].answer': required field is missing",
        f"{broken}, item line 2 (user 'u1'), field 'sessions[0].turns[1].colour': unknown field (allowed: turn_id, "
        "speaker, text, images, timestamp, date_text)",
        f"{broken}, item line 2 (user 'u1'), field 'sessions[0].turns[1].turn_id': 't' is also the id of "
        "sessions[0].turns[0]: turn ids must be unique within a memory",
        f"{broken}, item line 2 (user 'u1'), field 'sessions[0].turns[1].speaker': must not be empty",
        f"{broken}, item line 2 (user 'u1'), field 'user_id': also the user_id of line 1: ids must be unique",
        f"{broken}, item line 3: not valid JSON (Expecting value at column 1)",
    ]
    assert report.warnings == [f"{broken}, item line 1 (user 'u1'), field 'questions[0].evidence': names no turn of "
                               "this memory: S1:9 (kept; diagnostics count it as unmatched)"]
    assert main(["data", "validate", str(broken)]) == 2
    out, err = capsys.readouterr()
    # the file's warnings, then the quirks a run would handle (the missing gold answer: left unscored)
    assert benchmark.problems == [*report.warnings, "jsonl u1: the gold answer is empty for 1 question (u1:q0): "
                                                    "excluded from scoring"]
    assert out.splitlines() == [f"error: {e}" for e in report.errors] + [f"warning: {w}" for w in benchmark.problems]
    assert err.strip() == f"memfit data: error: {broken}: 7 error(s), 2 warning(s) (listed above)"
    # loading names the first problem and how many more there are
    with pytest.raises(DataError, match=r"broken.jsonl, item line 1 \(user 'u1'\), field 'sessions\[0\].timestamp': "
                                        r"'2024-13-01' is not an ISO 8601 .* \(and 6 more problems: `memfit data "
                                        r"validate .*broken.jsonl` lists them\)"):
        load_benchmark("jsonl", broken)
    assert main(["data", "validate", str(EXAMPLE)]) == 0
    assert capsys.readouterr().out.strip() == f"ok: {EXAMPLE}: 2 memories, 17 turns, 8 questions (8 scored by default), 0 warning(s)"


def test_sessions_out_of_time_order_are_a_warning_naming_both(tmp_path: Path) -> None:
    """Sessions are the conversation in file order; one dated before an earlier one passed silently."""
    record = {"user_id": "u1", "sessions": [
        {"timestamp": "2023-03-05T10:00:00", "turns": [{"speaker": "A", "text": "first"}]},
        {"timestamp": "2023-03-02T10:00:00", "turns": [{"speaker": "A", "text": "second"}]},
        {"timestamp": "2023-03-06T10:00:00", "turns": [{"speaker": "A", "text": "third"}]}]}
    path = tmp_path / "order.jsonl"
    path.write_text(json.dumps(record) + "\n")
    _, report = read(path)
    assert report.errors == []
    assert report.warnings == [f"{path}, item line 1 (user 'u1'), field 'sessions[1].timestamp': 2023-03-02T10:00:00 "
                               "is before sessions[0]'s 2023-03-05T10:00:00: sessions are read in file order as the "
                               "conversation's order; list them in time order (or fix the timestamp)"]


def test_the_example_file_loads_as_documented() -> None:
    bench = load_benchmark("jsonl", EXAMPLE)
    alice, bob = bench.memories
    assert [q.question_id for q in bench.questions()] == EXAMPLE_QUESTIONS
    first = alice.sessions[0].turns[2]
    assert (first.turn_id, first.date_text, first.timestamp) == ("s1:3", "10:00 am on 2 March, 2024",
                                                                 "2024-03-02T10:00:00")
    assert first.images[0].caption == "a brown and white beagle puppy on a blue blanket"
    assert [t.turn_id for t in bob.turns()] == ["a:1", "a:2", "a:3", "b:1", "b:2"]  # ids by default
    assert bob.sessions[0].date_text == "10 January, 2024" and bob.sessions[1].date_text == "8:00 pm on 20 February, 2024"
    assert alice.questions[2].question_date == "2024-04-20T00:00:00" and bob.questions[0].abstention


@pytest.mark.slow
def test_own_data_runs_the_whole_pipeline_with_the_real_reader_and_judge(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """The example file through `memfit run` with the packaged SmolLM2 as reader and judge, on each user's
    first question (bob's has no evidence: it is a question to decline)."""
    out = tmp_path / "mine"
    assert main(["run", "--config", str(SMOKE), "--out", str(out), "--quiet", "data.benchmark=jsonl",
                 f"data.path={EXAMPLE}", "data.limit_memories=null", "data.limit_questions=1", "reader.max_new_tokens=8",
                 "eval.judge.enabled=true", "eval.judge.max_new_tokens=16"]) == 0
    asked = ["alice:q0", "bob:q0"]
    predictions = read_jsonl(out / "predictions.jsonl")
    assert [p["question_id"] for p in predictions] == asked
    assert all(p["judge"] is not None and isinstance(p["judge"]["verdict"], bool) for p in predictions)
    Ledger.load(out / "ledger.json").check_one_answer_per_question(asked)
    metrics = json.loads((out / "metrics.json").read_text())
    # diagnostics where evidence is given: alice's question (its gold turn s1:1), not bob's
    assert metrics["retrieval"]["overall"]["questions"] == 1 and metrics["retrieval"]["questions_without_evidence"] == 1
    assert predictions[0]["retrieval"]["pack_hit"] is True and predictions[1]["retrieval"] is None
    assert set(metrics["by_category"]) == {"single-hop", "unanswerable"}
    assert metrics["overall"]["judge"] is not None and metrics["ledger"]["answer_calls"] == 2
    assert "Own data (jsonl)" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize("name", ["locomo", "longmemeval"])
def test_a_benchmark_written_as_jsonl_gives_identical_packs(name: str, tmp_path: Path, shared_data: Path,
                                                           bi_encoder, monkeypatch: pytest.MonkeyPatch) -> None:
    """Load the real file, write it in the own-data format (`memfit data convert`), load that: MemFit's packs
    (rankings, excerpts, diagnostics) are the same row for row."""
    # conv-26's first three sessions (58 turns, 20 questions); three oracle histories
    source = {"locomo": write_small_locomo(shared_data, tmp_path, questions=20),
              "longmemeval": shared_data / "longmemeval" / "longmemeval_oracle_sample47.json"}[name]
    memories = {"locomo": 1, "longmemeval": 3}[name]
    converted = tmp_path / f"{name}.jsonl"
    assert main(["data", "convert", name, "--path", str(source), "--out", str(converted)]) == 0
    monkeypatch.setattr("memfit_gpu.methods.memfit.load_bi_encoder", lambda index: bi_encoder)  # loaded once

    def packs(benchmark: str, path: Path) -> tuple[list[dict], dict]:
        cfg = load_config(REPO / "configs" / "memfit.yaml", [f"data.benchmark={benchmark}", f"data.path={path}",
                                                             f"data.limit_memories={memories}", "rerank.backend=none",
                                                             "index.device=cpu"])
        selected = select_from_config(load_benchmark(benchmark, path), cfg.data)
        method = MemFit()
        try:
            run = MethodRun(cfg, None, selected, selected.memories, questions_of(selected))
            method.write(run)
            rows, diagnostics = method.read(run)
        finally:
            method.close()
        return rows, {k: diagnostics[k] for k in ("overall", "by_category", "questions_total")}

    original, again = packs(name, source), packs("jsonl", converted)
    assert len(original[0]) >= 3 and original == again
    _, report = read(converted)
    assert report.errors == []
    # converting the converted file changes nothing
    assert to_jsonl(load_benchmark("jsonl", converted).memories) == converted.read_text()
