"""The baseline methods, piece by piece: plain's switches, naive RAG's chunking, full context's truncation
record, LightMem-SLM's routing, top-K budget, consolidation trigger, graph typing and user isolation, the
ledger's phases and the efficiency table. End-to-end runs are in tests/methods/test_methods_runs.py (slow).

LightMem's SLMs are played here by `ScriptedSLM`, which answers each role by a fixed rule on its prompt:
these tests check what the method does with replies (which calls it makes, how it routes, what it keeps
apart), not what a model would reply, and no reported number comes from it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from memfit_gpu.config import ConfigError, load_config
from memfit_gpu.data.schema import Benchmark, Memory, Question, Session, Turn
from memfit_gpu.evaluate.efficiency import COLUMNS, EfficiencyError, efficiency_table
from memfit_gpu.methods.base import MethodRun
from memfit_gpu.methods.common import TurnTable
from memfit_gpu.methods.full_context import FullContext, fewest_dropped
from memfit_gpu.methods.lightmem import (
    Graph,
    LightMem,
    due_consolidations,
    mtm_windows,
    parse_consolidation,
    parse_hqs,
    rerank_order,
    route,
    select,
)
from memfit_gpu.methods.naive_rag import NaiveRAG, chunk_history, chunk_starts
from memfit_gpu.methods.plain import SWITCHES, plain_config
from memfit_gpu.readers.ledger import Ledger
from memfit_gpu.readers.prompts import build_answer_messages, prompt_chars
from memfit_gpu.readers.types import ROLE_PHASES, Request, Response
from memfit_gpu.retrieve.pack import QUOTE_INDENT
from memfit_gpu.sweep.spec import load_sweep, point_overrides

REPO = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------------------------- config
def test_method_key_takes_the_five_methods_and_refuses_others():
    for method in ("memfit", "plain", "naive_rag", "full_context", "lightmem_slm"):
        assert load_config(REPO / "configs" / "demo.yaml", [f"method={method}"]).method == method
    with pytest.raises(ConfigError, match=r"method='lightmem' is not one of memfit, plain, naive_rag, full_context, "
                                          r"lightmem_slm"):
        load_config(REPO / "configs" / "demo.yaml", ["method=lightmem"])
    with pytest.raises(ConfigError, match=r"naive_rag.overlap_tokens=8 must be smaller than naive_rag.chunk_tokens=8"):
        load_config(None, ["naive_rag.chunk_tokens=8", "naive_rag.overlap_tokens=8"])
    with pytest.raises(ConfigError, match=r"lightmem.top_k=0 is out of range: it must be >= 1"):
        load_config(None, ["lightmem.top_k=0"])


def test_every_method_config_names_its_method():
    for path in sorted((REPO / "configs" / "methods").glob("*.yaml")):
        assert load_config(path).method == path.stem


# ---------------------------------------------------------------------------------------------- plain
def test_plain_switches_are_the_ablation_file():
    """method=plain applies exactly configs/ablations/plain_retrieval.yaml's switches (and no summaries)."""
    ablation = yaml.safe_load((REPO / "configs" / "ablations" / "plain_retrieval.yaml").read_text())
    ablation.pop("defaults")

    def flat(data: dict, prefix: str = "") -> dict:
        out = {}
        for key, value in data.items():
            out.update(flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {prefix + key: value})
        return out

    assert flat(ablation) == SWITCHES
    base = load_config(REPO / "configs" / "demo.yaml")
    plain = plain_config(load_config(REPO / "configs" / "demo.yaml", ["method=plain"]))
    expected = load_config(REPO / "configs" / "demo.yaml",
                           ["method=plain", "summary.enabled=false"] + [f"{k}={v}" for k, v in SWITCHES.items()])
    assert plain == expected and plain != base
    # SPEC: plain = its five ablation switches off (context window, PRF, summary expansion, wide scan,
    # summaries); the metadata boosts are none of them (they were turned off too)
    assert {key.split(".")[-1] for key in SWITCHES} == {"scan_top_k", "rerank_pool", "summaries", "summary_expansion",
                                                         "enabled", "context_window"}
    assert plain.retrieve.boosts_enabled and plain.retrieve.boosts == base.retrieve.boosts


# ---------------------------------------------------------------------------------------------- naive RAG
def test_chunk_starts_step_by_size_minus_overlap_and_cover_the_end():
    assert chunk_starts(0, 128, 32) == []
    assert chunk_starts(100, 128, 32) == [0]
    assert chunk_starts(128, 128, 32) == [0]
    assert chunk_starts(129, 128, 32) == [0, 96]  # the second chunk holds the one token the first misses
    assert chunk_starts(300, 128, 32) == [0, 96, 192]  # 192 + 128 > 300: no fourth chunk inside the overlap
    assert chunk_starts(10, 4, 0) == [0, 4, 8]


def test_chunks_are_the_histories_own_text_with_their_turns():
    texts = ["DATE: 1 May | Speaker A says: one two three", "DATE: 1 May | Speaker B says: four\tfive",
             "DATE: 2 May | Speaker A says: six"]
    chunks = chunk_history(texts, [10, 11, 12], 0, size=8, overlap=3)
    # 10 + 9 + 8 = 27 whitespace tokens; a chunk every 8 - 3 = 5 tokens while the last leaves some uncovered
    assert [c.tokens for c in chunks] == [(0, 8), (5, 13), (10, 18), (15, 23), (20, 27)]
    assert [c.text for c in chunks] == [
        "DATE: 1 May | Speaker A says: one",
        "A says: one two three\nDATE: 1 May",  # the history's own characters: line breaks kept
        "DATE: 1 May | Speaker B says: four",
        "B says: four\tfive\nDATE: 2 May |",  # and tabs
        "2 May | Speaker A says: six",
    ]
    assert [c.rows for c in chunks] == [(10,), (10, 11), (11,), (11, 12), (12,)]
    assert {c.memory_idx for c in chunks} == {0}


# ---------------------------------------------------------------------------------------------- full context
def _turn(turn_id: str, speaker: str, text: str, day: int) -> Turn:
    return Turn(turn_id, speaker, text, f"2023-05-{day:02d}T10:00:00", f"10:00 am on {day} May, 2023")


def _memory(memory_id: str, turns: list[tuple[str, str, str, int]], questions: list[tuple[str, str]],
            speakers: tuple[str, ...] = ("Alex", "Sam")) -> Memory:
    sessions: dict[int, Session] = {}
    for turn_id, speaker, text, day in turns:
        session = sessions.setdefault(day, Session(f"s{day}", f"10:00 am on {day} May, 2023",
                                                   f"2023-05-{day:02d}T10:00:00"))
        session.turns.append(_turn(turn_id, speaker, text, day))
    qs = [Question(f"{memory_id}:q{i}", memory_id, q, a, "4", evidence=[]) for i, (q, a) in enumerate(questions)]
    return Memory(memory_id, list(sessions.values()), qs, list(speakers))


def _bench(*memories: Memory) -> Benchmark:
    return Benchmark("locomo", "tests", list(memories))


def test_fewest_dropped_is_the_smallest_fitting_cut():
    assert fewest_dropped(10, lambda d: d >= 0) == 0
    assert fewest_dropped(10, lambda d: d >= 7) == 7
    assert fewest_dropped(10, lambda d: d >= 10) == 10
    assert fewest_dropped(10, lambda d: False) == 10  # nothing fits: everything goes, the answer stage says why


def test_full_context_drops_the_oldest_turns_and_records_it():
    turns = [(f"D{i}", "Alex" if i % 2 else "Sam", f"turn number {i} " + "word " * 20, 1 + i // 4) for i in range(12)]
    memory = _memory("m", turns, [("What did Alex say last?", "x")])
    whole = load_config(REPO / "configs" / "demo.yaml", ["method=full_context"])
    run = MethodRun(whole, None, _bench(memory), [memory], memory.questions)
    method = FullContext()
    method.write(run)
    rows, diagnostics = method.read(run)
    assert rows[0]["method_notes"] == {"truncation": {"turns": 12, "turns_kept": 12, "turns_dropped": 0,
                                                      "chars_dropped": 0, "first_kept_turn": "D0", "bound": None}}
    assert rows[0]["excerpts"].startswith("EXCERPT 1 (recorded 1 May 2023): Speaker Sam says: turn number 0 ")
    assert diagnostics["method"]["questions_truncated"] == 0
    tails = [line.split(" ", 2)[2] for line in rows[0]["excerpts"].splitlines()]  # "(recorded ...): ..." per turn

    def tokens(first_kept: int) -> int:  # the answer prompt's tokens at 4 characters a token
        text = "\n".join(f"EXCERPT {i} {t}" for i, t in enumerate(tails[first_kept:], start=1))
        return -(-prompt_chars(build_answer_messages(memory.questions[0].question, text)) // 4)

    # a 600-token budget (no reader here: full_context.context_tokens, counted at 4 characters a token)
    cfg = load_config(REPO / "configs" / "demo.yaml", ["method=full_context", "full_context.context_tokens=600"])
    rows, diagnostics = method.read(MethodRun(cfg, None, _bench(memory), [memory], memory.questions))
    truncation = rows[0]["method_notes"]["truncation"]
    dropped = truncation["turns_dropped"]
    room = 600 - cfg.reader.max_new_tokens
    assert 0 < dropped < 12 and tokens(dropped) <= room < tokens(dropped - 1)  # the fewest whole turns, oldest first
    assert truncation == {"turns": 12, "turns_kept": 12 - dropped, "turns_dropped": dropped,
                          "chars_dropped": sum(len(t) for t in tails[:dropped]), "first_kept_turn": f"D{dropped}",
                          "bound": "full_context.context_tokens of 600 tokens less reader.max_new_tokens=32"}
    assert rows[0]["excerpts"] == "\n".join(f"EXCERPT {i} {t}" for i, t in enumerate(tails[dropped:], start=1))
    assert [p["turn_id"] for p in rows[0]["pack"]["episodes"]] == [f"D{i}" for i in range(dropped, 12)]
    assert diagnostics["method"]["questions_truncated"] == 1


def test_full_context_names_max_prompt_chars_when_it_is_the_bound():
    turns = [(f"D{i}", "Alex", "x" * 200, 1) for i in range(10)]
    memory = _memory("m", turns, [("Q?", "a")])
    cfg = load_config(REPO / "configs" / "demo.yaml", ["method=full_context", "reader.max_prompt_chars=2000"])
    method = FullContext()
    run = MethodRun(cfg, None, _bench(memory), [memory], memory.questions)
    method.write(run)
    rows, _ = method.read(run)
    truncation = rows[0]["method_notes"]["truncation"]
    assert truncation["bound"] == "reader.max_prompt_chars=2,000"
    messages = build_answer_messages("Q?", rows[0]["excerpts"])
    assert prompt_chars(messages) <= 2000
    assert truncation["turns_kept"] == rows[0]["excerpts"].count("EXCERPT ") and truncation["turns_kept"] < 10


def test_naive_rag_searches_only_its_memorys_chunks_by_cosine(bi_encoder, monkeypatch: pytest.MonkeyPatch):
    """Dense top-k over the question's own memory's chunks, best cosine first, no rerank: two memories
    that both talk about an Alex never lend each other a chunk."""
    monkeypatch.setattr("memfit_gpu.methods.naive_rag.load_bi_encoder", lambda index: bi_encoder)
    alpine, urban = _two_users()
    cfg = load_config(REPO / "configs" / "demo.yaml", [
        "method=naive_rag", "naive_rag.chunk_tokens=12", "naive_rag.overlap_tokens=4", "naive_rag.top_k=2",
        "index.device=cpu", "retrieve.dense_min_cosine=-1.0"])
    run = MethodRun(cfg, None, _bench(alpine, urban), [alpine, urban], alpine.questions + urban.questions)
    method = NaiveRAG()
    method.write(run)
    rows, diagnostics = method.read(run)
    chunks = method.chunks
    # each history re-chunked by hand: the same chunks, memory by memory
    table = TurnTable.from_memories([alpine, urban])
    expected_chunks = [c for m in (0, 1) for c in chunk_history(
        [table.ep_text[r] for r in table.memory_rows(m)], table.memory_rows(m), m, 12, 4)]
    assert chunks == expected_chunks and {c.memory_idx for c in chunks} == {0, 1}
    vectors = bi_encoder.encode([c.text for c in chunks])
    assert diagnostics["method"] == {"name": "naive_rag", "chunks": len(chunks), "chunk_tokens": 12,
                                     "overlap_tokens": 4, "top_k": 2}
    assert diagnostics["encoder"] == bi_encoder.info() and diagnostics["encoder"]["encoder_backend"] == "packed"
    for m_idx, (row, question) in enumerate(zip(rows, run.questions, strict=True)):
        own = [i for i, c in enumerate(chunks) if c.memory_idx == m_idx]
        cosine = (vectors[own] @ bi_encoder.encode([question.question])[0]).tolist()
        best = [own[i] for i in sorted(range(len(own)), key=lambda i: -cosine[i])[:2]]
        assert [c["chunk"] for c in row["chunks"]] == best
        assert [c["score"] for c in row["chunks"]] == pytest.approx(sorted(cosine, reverse=True)[:2], abs=1e-5)
        dates = [sorted({table.recorded(r) for r in chunks[c].rows}, key=lambda d: int(d.split()[0])) for c in best]
        assert row["excerpts"] == "\n".join(
            f"EXCERPT {rank} (recorded {' to '.join(d)}): " + chunks[c].text.replace("\n", "\n" + QUOTE_INDENT)
            for rank, (c, d) in enumerate(zip(best, dates, strict=True), start=1))
        turn_ids = {p["turn_id"] for p in row["pack"]["episodes"]}
        assert turn_ids == {table.ep_turn_id[r] for c in best for r in chunks[c].rows}
        assert {t[0] for t in turn_ids} == {"AB"[m_idx]}


# ---------------------------------------------------------------------------------------------- LightMem units
def test_mtm_windows_split_sessions_and_keep_the_last_one_open_until_final():
    sessions = [0, 0, 0, 0, 0, 1, 1, 2, 2, 2]
    assert mtm_windows(sessions, 3, final=True) == [[0, 1, 2], [3, 4], [5, 6], [7, 8, 9]]
    assert mtm_windows(sessions[:9], 3, final=False) == [[0, 1, 2], [3, 4], [5, 6]]  # [7, 8] may still grow
    assert mtm_windows(sessions[:9], 3, final=True) == [[0, 1, 2], [3, 4], [5, 6], [7, 8]]


def test_consolidation_is_due_only_when_enough_new_entries_accumulated():
    assert due_consolidations(2, 3) == []
    assert due_consolidations(3, 3) == [0]
    assert due_consolidations(5, 3) == [0]
    assert due_consolidations(7, 3) == [0, 1]  # entry 6 waits for two more
    assert due_consolidations(7, 3, {0}) == [1]
    assert due_consolidations(6, 3, {0, 1}) == []


def test_graph_nodes_and_edges_are_typed():
    reply = "\n".join([
        "Entity: Paris", "- Concept: Capital City", "Paris | IsA | Capital City", "Project X | has property | Completed.",
        "SNN | RelatedTo | Neural Operator", "High Density | Implies | Congestion", "Alex | Likes | Hiking",
        "Concept: project x", "just some words", "Paris | IsA | paris", "", "Sam | IsA | " + "y" * 81,
    ])
    parsed = parse_consolidation(reply)
    assert parsed.nodes == [("Paris", "Entity"), ("Capital City", "Concept"), ("project x", "Concept")]
    assert parsed.edges == [("Paris", "IsA", "Capital City"), ("Project X", "HasProperty", "Completed"),
                            ("SNN", "RelatedTo", "Neural Operator"), ("High Density", "Implies", "Congestion")]
    assert parsed.dropped == 4  # unknown relation, no form, a self-loop, a name over 80 characters
    graph = Graph()
    graph.merge(parsed, [0, 1])
    types = dict(zip(graph.names, graph.types, strict=True))
    # declared types win (project x is declared a Concept in this batch); undeclared ends take their edge's
    assert types == {"Paris": "Entity", "Capital City": "Concept", "project x": "Concept", "Completed": "Concept",
                     "SNN": "Entity", "Neural Operator": "Entity", "High Density": "Concept", "Congestion": "Concept"}
    assert [(graph.names[h], r, graph.names[t]) for h, r, t in graph.edges] == [
        ("Paris", "IsA", "Capital City"), ("project x", "HasProperty", "Completed"),
        ("SNN", "RelatedTo", "Neural Operator"), ("High Density", "Implies", "Congestion")]
    # a later batch links by name (case and spacing aside) and never retypes a node
    graph.merge(parse_consolidation("Entity: capital  city\nPARIS | RelatedTo | Lyon"), [2])
    assert len(graph.names) == 9 and graph.types[graph.names.index("Capital City")] == "Concept"
    assert graph.sources[graph.names.index("Paris")] == [0, 1, 2]
    assert graph.document(graph.names.index("Paris")) == "Paris (Entity): Paris IsA Capital City; Paris RelatedTo Lyon"
    assert graph.document(graph.names.index("Lyon")) == "Lyon (Entity): Paris RelatedTo Lyon"


def test_hypothetical_queries_are_parsed_and_routed_under_the_budget():
    reply = ("1. MTM: What did Alex say about hiking?\n- **LTM**: What is the Alps?\nnoise\n"
             "MTM: what did alex say about hiking?\nLTM: What did Alex say about hiking?\nMTM: y")
    hqs = parse_hqs(reply, "Q?", max_hqs=3)
    assert [(h.text, h.tier) for h in hqs] == [("What did Alex say about hiking?", "mtm"), ("What is the Alps?", "ltm"),
                                                ("What did Alex say about hiking?", "ltm")]
    assert [(h.text, h.tier) for h in parse_hqs("I cannot help.", "Q?", 3)] == [("Q?", "mtm")]
    both = {"mtm": True, "ltm": True}
    plan = route(hqs, "slm", both, top_k=8)
    assert [(h.tier, h.budget) for h in plan] == [("mtm", 3), ("ltm", 3), ("ltm", 2)]
    assert sum(h.budget for h in plan) == 8
    assert [(h.tier, h.budget) for h in route(hqs, "mtm", both, top_k=2)] == [("mtm", 1), ("mtm", 1)]
    # a tier the user has nothing in sends its HQs to the other
    assert [h.tier for h in route(hqs, "slm", {"mtm": True, "ltm": False}, top_k=8)] == ["mtm", "mtm", "mtm"]
    assert [h.tier for h in route(hqs, "ltm", {"mtm": True, "ltm": False}, top_k=8)] == ["mtm", "mtm", "mtm"]


def test_selection_keeps_the_fixed_top_k_budget():
    order = ["a", "b", "c", "d", "e", "f", "g"]  # SLM-2's order over every HQ's candidates
    per_hq = [["c", "a", "b"], ["a", "d", "e", "f"]]
    # HQ 1 takes its 2 best (a, b); HQ 2 takes 2 of its own that are not taken (d, e)
    assert select(per_hq, [2, 2], order, 4) == ["a", "b", "d", "e"]
    # HQ 1 can use 3 of its budget of 5: the 2 it cannot use pass on to HQ 2 (budget 1 + 2)
    assert select([["a", "b", "c"], ["d", "e", "f", "g"]], [5, 1], order, 6) == ["a", "b", "c", "d", "e", "f"]
    # never more than top_k, whatever the budgets hold
    assert len(select([order, order], [4, 4], order, 5)) == 5
    assert select([["g"], []], [3, 3], order, 6) == ["g"]  # fewer candidates than the budget: fewer items
    assert rerank_order("I pick 3, then 1. Also 9 and 3.", ["x", "y", "z"]) == ["z", "x", "y"]


# ---------------------------------------------------------------------------------------------- LightMem write/read
class ScriptedSLM:
    """Stand-in for the SLMs: a fixed rule per role (see the module doc); records every request."""

    def __init__(self) -> None:
        self.requests: list[Request] = []

    def generate(self, requests: list[Request]) -> list[Response]:
        self.requests.extend(requests)
        return [Response(self.reply(r), 1, 1, 0.0) for r in requests]

    def prompt_token_limit(self) -> None:
        return None

    @staticmethod
    def reply(request: Request) -> str:
        text = request.messages[-1]["content"]
        if request.role == "mtm_summary":  # the window's turns, joined
            return " ".join(re.findall(r"^- \w+: (.*)$", text, re.MULTILINE))
        if request.role == "consolidate":  # "<name> likes <thing>" in the notes -> typed edges
            return "\n".join(f"Entity: {a}\n{a} | RelatedTo | {b}" for a, b in re.findall(r"(\w+) likes (\w+)", text))
        if request.role == "rewrite":
            question = re.search(r"^Question: (.*)$", text, re.MULTILINE).group(1)  # type: ignore[union-attr]
            return f"MTM: {question}\nLTM: {question}"
        return "2, 1"  # rerank_slm


ALPINE = [("A1", "Alex", "Alex likes hiking in the Alps every summer.", 1),
          ("A2", "Sam", "Sam likes skiing near Zermatt.", 1),
          ("A3", "Alex", "Alex likes cheese from Gruyere.", 1),
          ("A4", "Sam", "Sam likes trains through the mountains.", 2),
          ("A5", "Alex", "Alex likes lakes at dawn.", 2)]


def _two_users() -> tuple[Memory, Memory]:
    urban = [("B1", "Alex", "Alex likes painting in Paris studios.", 1),
             ("B2", "Kim", "Kim likes jazz in Montmartre.", 1),
             ("B3", "Alex", "Alex likes croissants at the corner cafe.", 1),
             ("B4", "Kim", "Kim likes museums on rainy Sundays.", 2)]
    return (_memory("alpine", ALPINE, [("What does Alex like?", "hiking")]),
            _memory("urban", urban, [("What does Alex like?", "painting")], speakers=("Alex", "Kim")))


@pytest.fixture
def lightmem_cfg():
    return load_config(REPO / "configs" / "demo.yaml", [
        "method=lightmem_slm", "lightmem.mtm_window_turns=2", "lightmem.consolidate_every=2", "lightmem.top_k=3",
        "lightmem.stm_turns=1", "index.device=cpu"])


def _lightmem_run(cfg, out: Path, memories: tuple[Memory, ...], slm: ScriptedSLM) -> MethodRun:
    questions = [q for m in memories for q in m.questions]
    return MethodRun(cfg, out, _bench(*memories), list(memories), questions, reader=lambda: slm)


def test_lightmem_writes_per_turn_and_triggers_consolidation(tmp_path: Path, lightmem_cfg, bi_encoder,
                                                             monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr("memfit_gpu.methods.lightmem.load_bi_encoder", lambda index: bi_encoder)
    alpine, urban = _two_users()
    slm = ScriptedSLM()
    method = LightMem()
    method.write(_lightmem_run(lightmem_cfg, tmp_path, (alpine, urban), slm))
    # windows of 2 turns per session: alpine [A1 A2] [A3] [A4 A5], urban [B1 B2] [B3] [B4]: 6 MTM calls in one
    # batch; 3 entries each, consolidation every 2: one LTM batch per user (entry 2 waits), one call batch
    assert [(r.role, r.key) for r in slm.requests] == [
        ("mtm_summary", "mtm:alpine:0"), ("mtm_summary", "mtm:alpine:1"), ("mtm_summary", "mtm:alpine:2"),
        ("mtm_summary", "mtm:urban:0"), ("mtm_summary", "mtm:urban:1"), ("mtm_summary", "mtm:urban:2"),
        ("consolidate", "ltm:alpine:0"), ("consolidate", "ltm:urban:0")]
    assert method.store is not None and method.store.size == 9  # every turn through append_turn
    assert method.stats == {"turns_appended": 9, "mtm_written": 6, "ltm_batches_written": 2}
    consolidate = slm.requests[6].messages[0]["content"]
    assert "Alex likes hiking" in consolidate and "Alex likes cheese" in consolidate
    assert "Alex likes lakes" not in consolidate  # entry 2 is not consolidated yet
    method.close()
    # a rerun finds everything in the store and the log: no turn appended, no call
    again, slm2 = LightMem(), ScriptedSLM()
    again.write(_lightmem_run(lightmem_cfg, tmp_path, (alpine, urban), slm2))
    assert slm2.requests == [] and again.stats == {"turns_appended": 0, "mtm_written": 0, "ltm_batches_written": 0}
    again.close()
    # the conversation goes on (a new session): its window is the fourth entry, and with it the second
    # group of two is complete, so the second consolidation is due
    grown = _memory("alpine", ALPINE + [("A6", "Sam", "Sam likes fondue with bread.", 3)], [("Q?", "a")])
    slm3 = ScriptedSLM()
    third = LightMem()
    third.write(_lightmem_run(lightmem_cfg, tmp_path, (grown,), slm3))
    assert [(r.role, r.key) for r in slm3.requests] == [("mtm_summary", "mtm:alpine:3"), ("consolidate", "ltm:alpine:1")]
    third.close()


def test_lightmem_keeps_users_apart(tmp_path: Path, lightmem_cfg, bi_encoder, monkeypatch: pytest.MonkeyPatch):
    """Two users who both have an Alex: their MTM, graphs and retrieved items never mix."""
    monkeypatch.setattr("memfit_gpu.methods.lightmem.load_bi_encoder", lambda index: bi_encoder)
    alpine, urban = _two_users()
    slm = ScriptedSLM()
    method = LightMem()
    run = _lightmem_run(lightmem_cfg, tmp_path, (alpine, urban), slm)
    method.write(run)
    rows, diagnostics = method.read(run)
    assert method.memlog is not None
    graphs = {u: method.memlog.user(u).graph for u in ("alpine", "urban")}
    assert sorted(graphs["alpine"].names) == ["Alex", "Sam", "cheese", "hiking", "skiing"]
    assert sorted(graphs["urban"].names) == ["Alex", "Kim", "croissants", "jazz", "painting"]
    alpine_row, urban_row = rows
    assert "Paris" not in alpine_row["excerpts"] and "painting" not in alpine_row["excerpts"]
    assert "Alps" not in urban_row["excerpts"] and "hiking" not in urban_row["excerpts"]
    for row, user in ((alpine_row, "alpine"), (urban_row, "urban")):
        knowledge = row["excerpts"].split("KNOWLEDGE:\n")[1].splitlines()
        assert knowledge and all(line.split(" (")[0][2:] in graphs[user].names for line in knowledge)
    assert {p["turn_id"][0] for p in alpine_row["pack"]["episodes"]} == {"A"}
    assert {p["turn_id"][0] for p in urban_row["pack"]["episodes"]} == {"B"}
    for row in rows:
        hqs = row["lightmem"]["hqs"]
        assert [(h["tier"], h["budget"]) for h in hqs] == [("mtm", 2), ("ltm", 1)]
        assert len(row["lightmem"]["items"]) <= 3  # the fixed top-K budget
    # one rewrite and one rerank call per question, each batched across the two users' questions
    read_calls = [(r.role, r.key) for r in slm.requests if ROLE_PHASES[r.role] == "read"]
    assert read_calls == [("rewrite", "rewrite:alpine:q0"), ("rewrite", "rewrite:urban:q0"),
                          ("rerank_slm", "rerank:alpine:q0"), ("rerank_slm", "rerank:urban:q0")]
    assert diagnostics["method"]["users"] == 2 and diagnostics["method"]["mtm_entries"] == 6
    method.close()


@pytest.mark.slow
def test_naive_rag_and_lightmem_encode_with_the_configured_encoder_backend(tmp_path: Path, lightmem_cfg):
    """index.encoder_backend reaches every method's bi-encoder (index/encoders/backends.load_bi_encoder):
    naive_rag and lightmem_slm once loaded MiniLM packed whatever it said. diagnostics.json records which
    backend encoded."""
    alpine, urban = _two_users()
    backend = ["index.encoder_backend=sentence-transformers"]
    rag_cfg = load_config(REPO / "configs" / "demo.yaml", ["method=naive_rag", "index.device=cpu", *backend])
    rag = NaiveRAG()
    run = MethodRun(rag_cfg, None, _bench(alpine, urban), [alpine, urban], alpine.questions + urban.questions)
    rag.write(run)
    _, rag_diagnostics = rag.read(run)
    assert rag_diagnostics["encoder"]["encoder_backend"] == "sentence-transformers"
    lightmem = LightMem()
    lightmem_run = _lightmem_run(load_config(REPO / "configs" / "demo.yaml", [
        "method=lightmem_slm", "lightmem.mtm_window_turns=2", "index.device=cpu", *backend]),
        tmp_path, (alpine, urban), ScriptedSLM())
    try:
        lightmem.write(lightmem_run)
        _, lightmem_diagnostics = lightmem.read(lightmem_run)
    finally:
        lightmem.close()
    assert lightmem_diagnostics["encoder"]["encoder_backend"] == "sentence-transformers"
    assert lightmem_diagnostics["encoder"]["path"] == rag_diagnostics["encoder"]["path"]  # the same weights


# ---------------------------------------------------------------------------------------------- ledger, efficiency
def test_ledger_totals_roles_per_phase():
    ledger = Ledger()
    for role, n_in in (("summary", 10), ("mtm_summary", 20), ("consolidate", 30), ("answer", 40), ("rewrite", 50),
                       ("rerank_slm", 60), ("judge", 70)):
        ledger.record(role, f"{role}-key", Response("x", n_in, 2, 0.5), backend="transformers")
    ledger.record("rewrite", "again", Response("x", 99, 9, 0.0, cached=True), backend="transformers")
    phases = ledger.to_dict()["phases"]
    assert {p: (s["calls"], s["cached"], s["input_tokens"], s["output_tokens"]) for p, s in phases.items()} == {
        "write": (3, 0, 60, 6), "read": (3, 1, 150, 6), "eval": (1, 0, 70, 2), "embed": (0, 0, 0, 0)}
    assert Ledger.from_dict(json.loads(ledger.to_json())).to_dict()["phases"] == phases  # derived, not stored


def _finished_run(path: Path, method: str | None, roles: dict[str, tuple[int, int, int, int]],
                  timings: dict[str, float], questions: int) -> Path:
    path.mkdir()
    config = {"name": "x", "reader": {"model": "HuggingFaceTB/SmolLM2-135M-Instruct"}}
    if method is not None:
        config["method"] = method
    (path / "config.yaml").write_text(yaml.safe_dump(config))
    ledger = Ledger()
    for role, (calls, cached, n_in, n_out) in roles.items():
        for i in range(calls):
            ledger.record(role, f"{role}{i}", Response("x", n_in, n_out, 0.1), backend="transformers")
        for i in range(cached):
            ledger.record(role, f"{role}c{i}", Response("x", 0, 0, 0.0, cached=True), backend="transformers")
    ledger.add_wall("answer", 5.0)
    ledger.add_wall("judge", 40.0)  # beside the answers (and the pack depths' verdicts): no part of their latency
    ledger.save(path / "ledger.json")
    (path / "timings.json").write_text(json.dumps(timings))
    (path / "metrics.json").write_text(json.dumps({"questions": questions}))
    (path / "DONE").write_text("done\n")
    return path


def test_efficiency_table_splits_write_and_read(tmp_path: Path):
    memfit = _finished_run(tmp_path / "memfit", None, {"summary": (2, 0, 100, 10), "answer": (4, 0, 50, 5)},
                           {"build": 3.0, "summaries": 2.0, "retrieve": 1.0, "answer": 9.0}, 4)
    light = _finished_run(tmp_path / "light", "lightmem_slm",
                          {"mtm_summary": (3, 0, 200, 20), "consolidate": (1, 0, 300, 30), "rewrite": (4, 0, 40, 4),
                           "rerank_slm": (3, 1, 60, 6), "answer": (4, 0, 50, 5)},
                          {"build": 10.0, "retrieve": 2.0, "answer": 6.0}, 4)
    rows = efficiency_table([memfit, light], price_model="gpt-4.1-mini")
    assert list(rows[0]) == COLUMNS
    m, lm = rows
    assert (m["method"], m["write_calls"], m["read_calls"], m["write_input_tokens"], m["read_input_tokens"]) == (
        "memfit", 2, 4, 200, 200)
    # (1 retrieve s + 5 answer calls' s) / 4: it was (retrieve + answer stage - the judge's wall time) / 4, which
    # went negative with a judge slower than the answers beside it (or judging the pack depths too)
    assert (m["build_s"], m["latency_s_per_question"]) == (5.0, 1.5)
    assert (lm["method"], lm["write_calls"], lm["read_calls"], lm["cached"]) == ("lightmem_slm", 4, 12, 1)
    assert (lm["write_input_tokens"], lm["write_output_tokens"]) == (3 * 200 + 300, 3 * 20 + 30)
    assert (lm["read_input_tokens"], lm["read_output_tokens"]) == (4 * 40 + 3 * 60 + 4 * 50, 4 * 4 + 3 * 6 + 4 * 5)
    assert lm["est_usd"] == round((900 + 540) / 1e6 * 0.40 + (90 + 54) / 1e6 * 1.60, 6)
    assert lm["ledger_usd"] == 0.0  # a local backend costs nothing in the ledger
    (light / "DONE").unlink()
    with pytest.raises(EfficiencyError, match=rf"{light} has no DONE: not a finished memfit run"):
        efficiency_table([light])


def test_turn_table_rows_follow_the_conversation():
    alpine, urban = _two_users()
    table = TurnTable.from_memories([alpine, urban])
    assert table.memory_rows(1) == [5, 6, 7, 8] and table.ep_turn_id[5] == "B1"
    assert table.recorded(3) == "2 May 2023" and table.memory_index("urban") == 1


def test_baselines_sweep_runs_every_method_with_one_reader():
    spec = load_sweep(REPO / "configs" / "sweeps" / "baselines_locomo_qwen3_8b.yaml")
    configs = [load_config(spec.config, point_overrides(spec.name, spec.fixed, p)) for p in spec.points]
    assert [p.point_id for p in spec.points] == [c.method for c in configs] == [
        "memfit", "plain", "naive_rag", "full_context", "lightmem_slm"]
    assert {(c.reader.backend, c.reader.model) for c in configs} == {("vllm", "Qwen/Qwen3-8B")}
    assert [c.reader.max_model_len for c in configs] == [16384, 16384, 16384, 32768, 16384]
