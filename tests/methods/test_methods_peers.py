"""The peer systems run from their own packages: the OpenAI-compatible endpoint over the run's reader and
encoder, and method=mem0 (mem0ai's own `Memory`) through `memfit run`, killed and resumed.

Real parts only: mem0's package with its embedded Qdrant, the packaged SmolLM2 reader and MiniLM encoder,
the OpenAI client mem0 itself uses. Each mem0 `add` sends SmolLM2 mem0's ~8,700-token extraction prompt
(about a minute on one core), so the run reads conv-26's first two turns: one `add` per speaker.
"""

from __future__ import annotations

import json
import shutil
import signal
import sqlite3
import subprocess
import sys
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import openai
import pytest
from support.data import write_tiny_locomo
from support.env import memfit_env
from support.files import files_holding

from memfit_gpu.config import load_config
from memfit_gpu.data import load_benchmark
from memfit_gpu.data.schema import DataError
from memfit_gpu.faults import FAULT_ENV
from memfit_gpu.files import read_jsonl, write_jsonl_atomic
from memfit_gpu.methods.peers.endpoint import EndpointLogic, PeerEndpoint, embedder_of
from memfit_gpu.methods.peers.mem0 import memory_class, memory_config, user_id
from memfit_gpu.methods.registry import method_entry
from memfit_gpu.readers.reader import calls_are_background, load_ledger, make_reader
from memfit_gpu.readers.registry import ENCODER_BACKEND, is_local

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "experiments"))
import bench_peers  # noqa: E402 - experiments/bench_peers.py, read by the run test below

DEMO = REPO / "configs" / "demo.yaml"
ENCODER = "sentence-transformers/all-MiniLM-L6-v2"


def _calls_per_role(run_dir: Path) -> Counter[tuple[str, str]]:
    """(role, served) -> call records in the directory's cache.sqlite (every entry, once)."""
    with sqlite3.connect(run_dir / "cache.sqlite") as db:
        return Counter({(role, served): n for role, served, n in
                        db.execute("select role, served, count(*) from calls group by role, served")})


@pytest.fixture()
def served(monkeypatch: pytest.MonkeyPatch) -> dict[str, Counter[str]]:
    """What the endpoint answered, per route and phase, counted from its HTTP answers' usage fields."""
    seen: dict[str, Counter[str]] = {"chat": Counter(), "embeddings": Counter()}

    def counting(route: str, original: Any) -> Any:
        def wrapped(self: EndpointLogic, body: dict[str, Any]) -> dict[str, Any]:
            answer = original(self, body)
            phase = self.serving.phase
            seen[route][f"{phase}:requests"] += 1
            seen[route][f"{phase}:prompt_tokens"] += answer["usage"]["prompt_tokens"]
            seen[route][f"{phase}:completion_tokens"] += answer["usage"].get("completion_tokens", 0)
            return answer
        return wrapped

    monkeypatch.setattr(EndpointLogic, "chat", counting("chat", EndpointLogic.chat))
    monkeypatch.setattr(EndpointLogic, "embeddings", counting("embeddings", EndpointLogic.embeddings))
    return seen


def test_a_real_mem0_memory_on_the_endpoint_has_every_request_in_the_ledger_once(
        tmp_path: Path, bi_encoder: Any, served: dict[str, Counter[str]]) -> None:
    cfg = load_config(DEMO)
    reader = make_reader(replace(cfg.reader, max_new_tokens=8), tmp_path, progress=False)
    logic = EndpointLogic("mem0", reader, embedder_of(bi_encoder, ENCODER))
    mem0_memory = memory_class(tmp_path / "home")
    with PeerEndpoint(logic) as endpoint:
        memory = mem0_memory.from_config(memory_config(endpoint.base_url, reader.model, ENCODER, bi_encoder.dim,
                                                       tmp_path / "mem0", 0.0, 8, api_key=endpoint.api_key))
        try:
            with logic.serve("write", "conv-26", "batch-1"):
                # infer=False: mem0 stores each message as it is (one embedding request each, no LLM call)
                memory.add([{"role": "user", "content": "Caroline: I went to a LGBTQ support group yesterday."},
                            {"role": "assistant", "content": "Melanie: That sounds powerful, Caroline!"}],
                           user_id="Caroline_conv-26", metadata={"timestamp": "8 May 2023"}, infer=False)
            with logic.serve("read", "conv-26", "q0"):
                found = memory.search("When did Caroline go to the support group?", top_k=5,
                                      filters={"user_id": "Caroline_conv-26"})
                client = openai.OpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key)
                reply = client.chat.completions.create(model=reader.model, max_tokens=4, temperature=0,
                                                       messages=[{"role": "user", "content": "Say yes."}])
                again = client.chat.completions.create(model=reader.model, max_tokens=4, temperature=0,
                                                       messages=[{"role": "user", "content": "Say yes."}])
        finally:
            memory.close()
    texts = [hit["memory"] for hit in found["results"]]
    assert texts[0] == "Caroline: I went to a LGBTQ support group yesterday.", texts
    assert reply.choices[0].message.content == again.choices[0].message.content
    assert reply.usage.prompt_tokens > 0 and reply.usage.completion_tokens > 0

    ledger = reader.ledger
    roles = {name: ledger.roles[name] for name in ("mem0_write", "mem0_read", "mem0_embed_write", "mem0_embed_read")}
    # two messages embedded at write, the question at read; two chat requests at read, the second a cache hit
    assert served["embeddings"]["write:requests"] == 2 and served["embeddings"]["read:requests"] == 1
    assert served["chat"]["read:requests"] == 2 and served["chat"]["write:requests"] == 0
    for phase in ("write", "read"):
        embed = roles[f"mem0_embed_{phase}"]
        assert (embed.calls, embed.input_tokens, embed.output_tokens) == (
            served["embeddings"][f"{phase}:requests"], served["embeddings"][f"{phase}:prompt_tokens"], 0)
    chat = roles["mem0_read"]
    assert (chat.calls, chat.cached) == (1, 1)
    assert chat.input_tokens == reply.usage.prompt_tokens and chat.output_tokens == reply.usage.completion_tokens
    assert roles["mem0_write"].calls == roles["mem0_write"].cached == 0
    assert ledger.models[f"encoder|{ENCODER}"].calls == 3
    # committed to cache.sqlite as they were served: a resumed run's ledger has them all, once
    reader.close()
    assert _calls_per_role(tmp_path) == Counter({("mem0_embed_write", "call"): 2, ("mem0_embed_read", "call"): 1,
                                                 ("mem0_read", "call"): 1, ("mem0_read", "hit"): 1})
    rebuilt = load_ledger(tmp_path)
    assert rebuilt.roles["mem0_embed_write"].input_tokens == served["embeddings"]["write:prompt_tokens"]
    assert rebuilt.cost()["usd"] == 0.0 and rebuilt.cost()["unpriced_models"] == []
    # the embeddings are no LLM calls: the write and read phases count chat calls only
    phases = rebuilt.phases()
    assert (phases["write"].calls, phases["read"].calls, phases["read"].cached, phases["embed"].calls) == (0, 1, 1, 3)


def _post(url: str, body: bytes, key: str | None) -> tuple[int, dict[str, Any]]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_the_endpoint_refuses_what_it_cannot_serve_by_name(tmp_path: Path, bi_encoder: Any) -> None:
    cfg = load_config(DEMO)
    reader = make_reader(cfg.reader, None, progress=False)
    logic = EndpointLogic("mem0", reader, embedder_of(bi_encoder, ENCODER))
    with PeerEndpoint(logic) as endpoint:
        base = endpoint.base_url
        assert base.startswith("http://127.0.0.1:")
        cases = {
            "not JSON": ("/chat/completions", b"{not json", 400, "not JSON"),
            "no messages": ("/chat/completions", b'{"messages": []}', 400, "messages must be a non-empty list"),
            "tools": ("/chat/completions", json.dumps({"messages": [{"role": "user", "content": "x"}],
                                                       "tools": [{"type": "function"}]}).encode(), 400, "tool calls"),
            "image part": ("/chat/completions", json.dumps({"messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "x"}}]}]}).encode(), 400, "messages[0].content[0]"),
            "token ids": ("/embeddings", b'{"input": [[1, 2, 3]]}', 400, "token ids are not served"),
            "dimensions": ("/embeddings", b'{"input": "x", "dimensions": 1536}', 400, "embeds in 384"),
            "route": ("/completions", b"{}", 404, "no route"),
        }
        for name, (route, body, status, words) in cases.items():
            code, answer = _post(base + route, body, endpoint.api_key)
            assert code == status, (name, answer)
            assert words in answer["error"]["message"], (name, answer)
        # Another process or user of the machine: without the endpoint's key (or with another) nothing is
        # served, so nobody spends the run's reader or adds to its ledger.
        good = json.dumps({"messages": [{"role": "user", "content": "Say yes."}], "max_tokens": 2}).encode()
        for key in (None, "memfit-local", endpoint.api_key[:-1]):
            for route in ("/chat/completions", "/embeddings"):
                code, answer = _post(base + route, good if route == "/chat/completions" else b'{"input": "x"}', key)
                assert code == 401 and "needs its bearer key" in answer["error"]["message"], (key, route, answer)
        with pytest.raises(urllib.error.HTTPError, match="401"):
            urllib.request.urlopen(base + "/models", timeout=30)
        listing = urllib.request.Request(base + "/models", headers={"Authorization": f"Bearer {endpoint.api_key}"})
        with urllib.request.urlopen(listing, timeout=30) as answer:
            assert [m["id"] for m in json.loads(answer.read())["data"]] == [reader.model, ENCODER]
        other = PeerEndpoint(logic)
        other.close()
        assert other.api_key != endpoint.api_key  # made afresh per endpoint
    reader.close()
    # nothing was accounted for the refused requests
    assert all(stats.calls == 0 for stats in reader.ledger.roles.values())
    assert ENCODER_BACKEND == "encoder" and is_local(ENCODER_BACKEND)  # the embeddings' backend costs nothing


def test_the_peer_s_write_time_chat_calls_are_background_work(bi_encoder: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """mem0's extraction (the write phase) in a live memory is consolidation: its calls are background work, so
    answers waiting for the reader go first (readers.reader.background_calls); its read-time calls are not."""
    reader = make_reader(replace(load_config(DEMO).reader, max_new_tokens=2), None, progress=False)
    logic = EndpointLogic("mem0", reader, embedder_of(bi_encoder, ENCODER))
    seen: list[tuple[str, bool]] = []
    generate = reader.generate

    def noting(requests, partial=False):  # noqa: ANN001, ANN202
        seen.extend((r.role, calls_are_background()) for r in requests)
        return generate(requests, partial)

    monkeypatch.setattr(reader, "generate", noting)
    body = {"messages": [{"role": "user", "content": "Say yes."}], "max_tokens": 2}
    for phase in ("write", "read"):
        with logic.serve(phase, "conv-26", "x"):
            logic.chat(body)
    reader.close()
    assert seen == [("mem0_write", True), ("mem0_read", False)]
    assert not calls_are_background()


def test_mem0_is_registered_as_a_live_reader_method_with_a_persistent_store() -> None:
    entry = method_entry("mem0")
    assert (entry.reader_free, entry.incremental, entry.live, entry.peer) == (False, True, True, True)
    assert not any(method_entry(name).peer for name in ("memfit", "plain", "naive_rag", "full_context", "lightmem_slm"))

def _run(out: Path, data: Path, shared_data: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "memfit_gpu.cli", "run", "--config", str(DEMO), "method=mem0",
                           f"data.path={data}", "mem0.max_tokens=48", "mem0.batch_size=2", "--out", str(out), "--quiet"],
                          env=memfit_env(shared_data, threads=1, **env), capture_output=True, text=True, timeout=1800)


def _memories(run_dir: Path) -> dict[str, list[str]]:
    """What each question's search returned (speaker, memory text), from packs.jsonl."""
    return {row["question_id"]: sorted(f"{hit['speaker']}: {hit['memory']}" for hit in row["mem0"])
            for row in read_jsonl(run_dir / "packs.jsonl")}


def test_mem0_run_killed_after_an_add_resumes_to_the_same_memories_and_predictions(
        tmp_path: Path, shared_data: Path) -> None:
    data = write_tiny_locomo(shared_data, tmp_path, turns=2, questions=2)
    out = tmp_path / "run"
    # killed after the second add (Melanie's) returned and the ledger was saved, before its mark
    killed = _run(out, data, shared_data, **{FAULT_ENV: "mem0.add.ledger:2"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    marks = read_jsonl(out / "mem0" / "added.jsonl")
    assert [m["batch"].split("\t")[2] for m in marks] == ["Caroline"]
    assert not (out / "packs.jsonl").exists()

    resumed = _run(out, data, shared_data)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    marks = read_jsonl(out / "mem0" / "added.jsonl")
    assert [m["batch"].split("\t")[2] for m in marks] == ["Caroline", "Melanie"]
    diagnostics = json.loads((out / "diagnostics.json").read_text())["method"]
    # Melanie's add finished before the kill: found in mem0's own files, not added again
    assert marks[1].get("found_in_store") is True
    assert (diagnostics["add_calls_this_process"], diagnostics["batches_already_added"]) == (0, 2)
    assert diagnostics["served"].get("chat_calls", 0) == 0
    ledger = json.loads((out / "ledger.json").read_text())["roles"]
    assert ledger["mem0_write"]["calls"] == 2  # each extraction paid once, over both processes
    assert ledger["answer"]["calls"] == 2
    assert ledger["mem0_embed_read"]["calls"] >= 2  # each question embedded once per speaker searched
    assert json.loads((out / "provenance.json").read_text())["packages"]["mem0ai"] == "2.2.1"
    stored = diagnostics["memories_per_user"]
    assert set(stored) == {"conv-26/Caroline", "conv-26/Melanie"}

    # the same run uninterrupted, from the same response cache: every call a cache hit, the same memories
    reference = tmp_path / "reference"
    reference.mkdir()
    shutil.copy(out / "cache.sqlite", reference / "cache.sqlite")
    copied = _calls_per_role(reference)
    whole = _run(reference, data, shared_data)
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert json.loads((reference / "diagnostics.json").read_text())["method"]["memories_per_user"] == stored
    assert _memories(reference) == _memories(out)
    answers = {r["question_id"]: r["prediction"] for r in read_jsonl(out / "predictions.jsonl")}
    assert answers == {r["question_id"]: r["prediction"] for r in read_jsonl(reference / "predictions.jsonl")}
    assert len(answers) == 2
    made = _calls_per_role(reference) - copied
    assert (made[("mem0_write", "call")], made[("mem0_write", "hit")]) == (0, 2)
    assert (made[("answer", "call")], made[("answer", "hit")]) == (0, 2)
    # what experiments/bench_peers.py reads of a mem0 run
    row = bench_peers.figures("mem0", out, turns=2, wall_s=1.0)
    assert (row["write_llm_calls"], row["write_llm_calls_per_1k_turns"], row["questions"]) == (2, 1000.0, 2)
    assert row["write_input_tokens"] == ledger["mem0_write"]["input_tokens"] > 8000  # mem0's extraction prompt
    assert row["embed_requests"] == sum(ledger[r]["calls"] for r in ("mem0_embed_write", "mem0_embed_read"))
    assert row["read_llm_calls"] == 2 and row["mem0_batch_size"] == 2 and row["mem0_search_s"]["n"] == 2
    assert row["f1"] == json.loads((out / "metrics.json").read_text())["overall"]["paper"]["f1"]
    whole_diagnostics = json.loads((reference / "diagnostics.json").read_text())["method"]
    assert whole_diagnostics["served"]["response_format_unhonoured"] == 2  # mem0 asks for JSON mode


def test_bench_peers_cuts_a_conversation_at_a_turn_and_keeps_the_questions_answerable(
        tmp_path: Path, shared_data: Path) -> None:
    path, turns, questions = bench_peers.cut_locomo(shared_data / "locomo" / "locomo10.json", tmp_path, 25, 4)
    memory = load_benchmark("jsonl", path).memories[0]
    kept = [turn.turn_id for session in memory.sessions for turn in session.turns]
    assert turns == len(kept) == 25 and kept[:2] == ["D1:1", "D1:2"] and kept[-1] == "D2:7"  # session 1: 18 turns
    assert [s.date_text for s in memory.sessions] == ["1:56 pm on 8 May, 2023", "1:14 pm on 25 May, 2023"]
    assert memory.speakers == ["Caroline", "Melanie"]
    assert questions == len(memory.questions) == 4
    assert all(set(q.evidence) <= set(kept) and q.category != "5" for q in memory.questions)
    rows = {"memfit": {"write_llm_calls": 2, "write_input_tokens": 900, "write_output_tokens": 100,
                       "build_s": 4.0, "read_tokens_per_question": 500.0},
            "mem0": {"write_llm_calls": 50, "write_input_tokens": 400_000, "write_output_tokens": 5_000,
                     "build_s": 200.0, "read_tokens_per_question": 300.0}}
    assert bench_peers.ratios(rows) == {"mem0": {"write_llm_calls": 25.0, "write_tokens": 405.0, "build_s": 50.0,
                                                 "read_tokens_per_question": 0.6}}

def _same_hits(found: list[Any], expected: list[Any]) -> bool:
    """The same memories in the same order from the same turns; scores as Qdrant stores vectors (float32 on
    disk: a reopened store's cosine differs in the 9th digit)."""
    return [(h.kind, h.text, h.turn_ids) for h in found] == [(h.kind, h.text, h.turn_ids) for h in expected] and \
        all(abs(a.score - b.score) < 1e-6 for a, b in zip(found, expected, strict=True))


def test_a_live_mem0_is_fed_as_turns_come_forgets_deleted_turns_and_erases_a_user(tmp_path: Path) -> None:
    """Memory.open(method="mem0"): every add feeds mem0 the new turns (one mem0 add per speaker and batch,
    under mem0_write); a search returns mem0's memories with the turns they came from; deleting a turn
    retires the memories of its batch and feeds its other turns again; a reopened memory feeds nothing
    twice; and after delete_user + compact no byte of the user (its words, its id) is in any file under the
    memory's folder, while the other user's memories are all there. The reader is the echo backend
    (tests/seam_echo_backend.py), which answers mem0's JSON-mode extraction with the first new message as
    the fact, so mem0 stores the users' words as a real model's memories would quote them."""
    import seam_echo_backend  # noqa: F401  (registers reader.backend=echo)

    from memfit_gpu.live import Memory

    overrides = ["rerank.backend=none", "reader.backend=echo", "live.consolidate=manual", "mem0.batch_size=2"]
    victim, keeper = "victim-7", "keeper-3"

    def turns(user: str) -> list[dict[str, str]]:
        words = "The Zorblaxian vault code is quibbleflux" if user == victim else "The Glimmerwick lantern glows mauveish"
        return [{"speaker": ["Ann", "Bob"][i % 2], "text": f"{words} {i}.", "turn_id": f"t{i}",
                 "timestamp": f"2024-03-01T10:{i:02d}:00"} for i in range(4)]

    folder = tmp_path / "memory"
    memory = Memory.open(folder, DEMO, method="mem0", overrides=overrides)
    try:
        memory.add(victim, turns(victim))
        memory.add(keeper, turns(keeper)[:2])
        memory.add(keeper, turns(keeper)[2:])
        ledger = json.loads((folder / "ledger.json").read_text())
        # per user: 2 speakers x one batch of 2 turns per add call; the victim's 4 turns in one call = 2 batches
        marks = read_jsonl(folder / "mem0" / "added.jsonl")
        assert sorted((m["user"], tuple(m["turns"])) for m in marks) == sorted(
            [(f"{u}/{s}", t) for u in (victim, keeper) for s in ("Ann", "Bob") for t in (("t0", "t1"), ("t2", "t3"))])
        assert ledger["roles"]["mem0_write"]["calls"] == 8
        hits = memory.search(keeper, ["Where does the lantern glow?"], k=10)[0]
        assert hits and {h.kind for h in hits} == {"memory"}
        assert all("Glimmerwick" in h.text and h.turn_ids in (["t0", "t1"], ["t2", "t3"]) for h in hits)
        assert not any("Zorblaxian" in h.text for h in hits)  # one user's memories only

        memory.delete(keeper, ["t1"])  # its batch (t0, t1) is retired for both speakers; t0 is fed again
        hits = memory.search(keeper, ["Where does the lantern glow?"], k=10)[0]
        assert not any("mauveish 1." in h.text for h in hits) and any(h.turn_ids == ["t0"] for h in hits)
        assert json.loads((folder / "ledger.json").read_text())["roles"]["mem0_write"]["calls"] == 10
    finally:
        memory.close()

    memory = Memory.open(folder, DEMO, method="mem0", overrides=overrides)
    try:  # reopened: nothing is fed twice, the same memories are found
        assert _same_hits(memory.search(keeper, ["Where does the lantern glow?"], k=10)[0], hits)
        assert json.loads((folder / "ledger.json").read_text())["roles"]["mem0_write"]["calls"] == 10
        assert files_holding(folder, ["Zorblaxian", "quibbleflux", victim])  # before: everywhere
        memory.delete_user(victim)
        memory.compact()
        assert files_holding(folder, ["Zorblaxian", "quibbleflux", victim]) == {}
        kept = files_holding(folder / "mem0", ["Glimmerwick", "mauveish", keeper])
        assert {"history.db", "added.jsonl"} <= set(kept) and any(name.startswith("qdrant/") for name in kept)
        assert _same_hits(memory.search(keeper, ["Where does the lantern glow?"], k=10)[0], hits)
    finally:
        memory.close()


def test_two_live_users_never_share_a_mem0_user_whatever_their_ids_and_speakers(tmp_path: Path) -> None:
    """mem0's users were `<speaker>_<memory id>`: user `a` adding a turn as speaker `user_x` wrote into and
    read from user `x_a`'s speaker `user` (one mem0 memory), and a speaker's name with a space was refused
    by mem0. Now every (memory, speaker) pair is its own mem0 user; a mark of the old naming is refused."""
    import seam_echo_backend  # noqa: F401  (registers reader.backend=echo)

    from memfit_gpu.live import Memory

    assert user_id("x_a", "user") != user_id("a", "user_x")
    assert user_id("a/b", "c") != user_id("a", "b/c") and user_id("m", "Dr Who") == "m/Dr%20Who"
    overrides = ["rerank.backend=none", "reader.backend=echo", "live.consolidate=manual", "mem0.batch_size=4"]
    folder = tmp_path / "memory"
    memory = Memory.open(folder, DEMO, method="mem0", overrides=overrides)
    try:
        memory.add("x_a", [{"speaker": "user", "text": "My bank PIN is 4471 and my doctor is Dr Zhivago."}])
        memory.add("a", [{"speaker": "user_x", "text": "What do you know? Your new PIN is 0000."},
                         {"speaker": "Dr Who", "text": "The TARDIS is parked on Baker Street."}])
        seen_by_a = [h.text for h in memory.search("a", ["bank PIN doctor"], k=10)[0]]
        seen_by_victim = [h.text for h in memory.search("x_a", ["what do you know PIN"], k=10)[0]]
        assert seen_by_a and all("0000" in text or "TARDIS" in text for text in seen_by_a)
        assert seen_by_victim and all("4471" in text for text in seen_by_victim)
        marks = read_jsonl(folder / "mem0" / "added.jsonl")  # a speaker named with a space is fed too
        assert sorted(m["user"] for m in marks) == ["a/Dr%20Who", "a/user_x", "x_a/user"]
        key = memory.method.endpoint.api_key  # mem0's endpoint's key is written nowhere
        assert len(key) >= 40 and files_holding(folder, [key]) == {}
        # A speaker whose every turn is gone has no mem0 user any more: until compaction the store still
        # listed it, and mem0 was fed the new turns again as its view (a second hit, gone after compact).
        memory.delete_user("x_a")
        memory.add("x_a", [{"speaker": "Carol", "text": "I play the violin."}])
        before = [(h.text, h.turn_ids) for h in memory.search("x_a", ["violin"], k=10)[0]]
        assert before == [("user: Carol: I play the violin.", ["t2"])]
        assert [m["user"] for m in memory.method.marks.batches.values() if m["memory"] == "x_a"] == ["x_a/Carol"]
        memory.compact()
        assert [(h.text, h.turn_ids) for h in memory.search("x_a", ["violin"], k=10)[0]] == before
    finally:
        memory.close()
    old = [{**m, "user": m["user"].split("/")[1] + "_" + m["memory"]} for m in marks]  # as an older memfit named them
    write_jsonl_atomic(folder / "mem0" / "added.jsonl", old)
    with pytest.raises(DataError, match=r"added.jsonl, item line 1, field 'user': mem0 user 'user_x_a' has an older memfit's naming"):
        Memory.open(folder, DEMO, method="mem0", overrides=overrides)


def test_bench_peers_puts_every_live_method_over_memfit_in_the_same_run() -> None:
    live = {"memfit": {"add_s_per_turn": {"n": 8, "p50": 0.02, "p95": 0.05}, "search_s": {"n": 2, "p50": 0.03, "p95": 0.04}},
            "mem0": {"add_s_per_turn": {"n": 8, "p50": 24.0, "p95": 40.0}, "search_s": {"n": 2, "p50": 0.12, "p95": None}}}
    assert bench_peers.live_ratios(live) == {"mem0": {"insert_p50_x": 1200.0, "insert_p95_x": 800.0,
                                                      "search_p50_x": 4.0, "search_p95_x": None}}
    assert bench_peers.live_ratios({"mem0": live["mem0"]}) == {}  # no MemFit in the run: no ratio
