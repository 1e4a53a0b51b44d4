"""LightMem-SLM (../shared/papers/lightmem-slm-paper.txt): memory written and read by small models.

Memory, partitioned by user (here: one memory of the benchmark = one user id):
- STM, short-term memory: the user's turns, stored one turn at a time through the live path
  (`EpisodeStore.append_turn`) in the run's store; the reader sees the last `lightmem.stm_turns`.
- MTM, mid-term memory: interaction summaries. SLM-3 (role `mtm_summary`) writes one note per window of
  `lightmem.mtm_window_turns` consecutive turns of one session.
- LTM, long-term memory: a graph of Entity and Concept nodes joined by IsA, HasProperty, RelatedTo and
  Implies edges (paper Table 9). Offline consolidation (role `consolidate`) runs when
  `lightmem.consolidate_every` new MTM entries have accumulated, over exactly those entries.

Online, per question: SLM-1 (role `rewrite`, paper Table 1) rewrites the question into at most
`lightmem.max_hqs` hypothetical queries (HQs), each marked MTM or LTM; the fixed budget of
`lightmem.top_k` items is split over the HQs; each HQ searches its tier by cosine with metadata
constraints (the user id, always; the speakers it names, for MTM); SLM-2 (role `rerank_slm`) re-ranks the
candidates of all HQs for semantic consistency; each HQ then takes its budget in SLM-2's order. The
excerpts are the STM turns, the chosen MTM notes and LTM nodes (with their edges), in that order.

Every SLM call goes through the run's reader (response cache, ledger; write roles `mtm_summary` and
`consolidate`, read roles `rewrite` and `rerank_slm`) and each kind is one batch across all users and
questions. The prompts are memfit_gpu/prompts/lightmem/*.txt.

Durability. The turns are the store's (its log commits each appended turn; the writer snapshots the
store when it is done). MTM entries and LTM batches go to `DIR/lightmem/log.jsonl`, the store's record
log format (length + CRC32 framed records), each write batch closed by a commit record; a batch without
its commit (a killed writer) is dropped whole on open. Which windows and which consolidations are due is
a pure function of the stored turns and entries, so a rerun computes what is missing and asks only for
that, and the response cache serves any call the killed run already made: a rerun makes no new call.
Order per batch: the calls (cached), the ledger (`MethodRun.account`), then the log.

Where the paper is silent, this implementation chooses (and the defaults are in config.LightMemConfig):
- One model: the SLMs are the run's reader (`reader.*`), so that a comparison with one reader holds every
  method to the same model. Every SLM call is greedy (`lightmem.temperature` 0).
- An "interaction" is a window of mtm_window_turns turns within one session; a session's last window may
  be shorter. While a session may still grow (the live path), its last partial window stays open; the
  benchmark's write closes every window (the history is complete when its questions are asked).
- Consolidation sees only the new MTM notes, not the graph: linkage to the existing graph is by name (a
  node is the same node when its name matches case- and space-insensitively), so the consolidation calls
  of one write are independent and batched. Entries left over after the last full group stay in MTM only.
- Node and edge typing from SLM output: `Entity: X` / `Concept: X` lines declare types; an endpoint that
  is not declared takes the type its edge implies (IsA and HasProperty: Entity head, Concept tail;
  Implies: Concept both; RelatedTo: Entity both). A node keeps the type it first got (never retyped).
  Edges of another relation, unparseable lines and names longer than 80 characters are dropped and counted.
- LTM is searched as one document per node that has an edge: "name (type): name REL other; ...".
- Routing: SLM-1's MTM/LTM marks (`lightmem.routing=slm`), or all HQs to one tier (`mtm` | `ltm`, the
  paper's MTM-only / LTM-only ablations). An HQ routed to a tier the user has nothing in goes to the
  other. When SLM-1's reply holds no marked line, the question itself is the one HQ, routed to MTM.
- Budget: top_k split evenly over the HQs (the first ones get the remainder); budget an HQ cannot use
  (too few candidates) passes to the next HQ, then to the best remaining candidates of any HQ. Coarse
  retrieval fetches coarse_factor x budget candidates per HQ; only cosine > retrieve.dense_min_cosine.
- Speaker constraint: an MTM HQ that names speakers of the user (whole word, as MemFit's boosts) keeps
  entries of windows in which one of them speaks, unless that leaves none.
- SLM-2 reads the numbered candidates and replies with numbers; those it names come first in its order,
  the rest follow in coarse order. With one candidate or none, or lightmem.rerank=false, no call is made.
- Vectors: MTM notes and LTM node documents are embedded with the run's bi-encoder when the read stage
  starts (all of them in one pass, so every rerun computes the same vectors), into FAISS DenseIndexes
  partitioned by user like the store's.

`lightmem.ltm_updates=false` writes no LTM at all (the paper's "no update" variant);
`lightmem.noise.*` injects errors at three points (SLM-1's HQs after routing, SLM-3's notes before they are
logged, the searchable MTM at read time), made as methods/lightmem_noise.py says, each one hook here;
`read_at` reads the memory as it stood after some turns of each user (MemoryView over UserMemory.prefix),
for the growth analysis (memfit_gpu/run/growth.py), from the one write of the whole trajectory.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from memfit_gpu import faults
from memfit_gpu.config import MemFitConfig
from memfit_gpu.data.schema import DataError, Memory, Question
from memfit_gpu.index.dense import DenseIndex
from memfit_gpu.index.encoders import load_bi_encoder
from memfit_gpu.index.factory import dense_index
from memfit_gpu.methods.base import Hit, MethodRun, episode_hit
from memfit_gpu.methods.common import diagnostics_for, mtm_windows, pack_json
from memfit_gpu.methods.lightmem_noise import noise_hqs, noise_notes, noisy_entries, read_noise
from memfit_gpu.methods.packs import pack_row
from memfit_gpu.names import mentioned, normalise
from memfit_gpu.readers.prompts import PROMPT_DIR, fill, load_prompt
from memfit_gpu.readers.types import Request
from memfit_gpu.retrieve.pack import excerpt_tail, quote_lines
from memfit_gpu.retrieve.view import ReadView
from memfit_gpu.store import EpisodeStore, RecordLog, StoreCorruptError

log = logging.getLogger(__name__)

LOG_FORMAT = 1
NODE_TYPES = ("Entity", "Concept")
RELATIONS = ("IsA", "HasProperty", "RelatedTo", "Implies")
TIERS = ("mtm", "ltm")
MAX_NAME_CHARS = 80
# the type an undeclared endpoint takes from its edge: relation -> (head, tail)
EDGE_TYPES = {"IsA": ("Entity", "Concept"), "HasProperty": ("Entity", "Concept"),
              "RelatedTo": ("Entity", "Entity"), "Implies": ("Concept", "Concept")}
_RELATION_OF = {re.sub(r"\W", "", r).lower(): r for r in RELATIONS}
_NODE_LINE = re.compile(r"^\W*(entity|concept)\s*[:\-]\s*(.+)$", re.IGNORECASE)
_EDGE_LINE = re.compile(r"^\W*(.+?)\s*\|\s*([A-Za-z ]+?)\s*\|\s*(.+)$")
_HQ_LINE = re.compile(r"^[\s\-*\d.)]*\b(MTM|LTM)\b[\s*]*[:\-]\s*(.+)$", re.IGNORECASE)
_NUMBER = re.compile(r"\d+")
Item = tuple[str, int]  # (tier, id): an MTM entry number or an LTM node id, within its user
Scored = tuple[Item, float]  # an item and its cosine to an HQ


# ---------------------------------------------------------------------------------------------- write side
def due_consolidations(entries: int, every: int, done: set[int] | frozenset[int] = frozenset()) -> list[int]:
    """Consolidation batches due when a user has `entries` MTM entries: batch b covers entries
    [b * every, (b + 1) * every) and is due once all of them exist, unless done."""
    return [b for b in range(entries // every) if b not in done]


def clean_name(text: str) -> str | None:
    """A node name as written by the SLM, without quotes, brackets or trailing punctuation; None if empty
    or longer than MAX_NAME_CHARS."""
    name = re.sub(r"\s+", " ", text).strip().strip("\"'`*[]()<>").strip(" .,;:")
    return name if name and len(name) <= MAX_NAME_CHARS else None


def node_key(name: str) -> str:
    return re.sub(r"\s+", " ", name).strip().casefold()


@dataclass
class ParsedGraph:
    nodes: list[tuple[str, str]] = field(default_factory=list)  # (name, type), declarations in order
    edges: list[tuple[str, str, str]] = field(default_factory=list)  # (head, relation, tail)
    dropped: int = 0  # non-empty lines that are no declaration or edge of a known relation


def parse_consolidation(text: str) -> ParsedGraph:
    """Node declarations and typed edges in a consolidation reply (see the module doc)."""
    parsed = ParsedGraph()
    for line in text.splitlines():
        if not line.strip():
            continue
        node = _NODE_LINE.match(line)
        if node and "|" not in line:
            name = clean_name(node.group(2))
            if name is None:
                parsed.dropped += 1
            else:
                parsed.nodes.append((name, node.group(1).capitalize()))
            continue
        edge = _EDGE_LINE.match(line)
        relation = _RELATION_OF.get(re.sub(r"\W", "", edge.group(2)).lower()) if edge else None
        head = clean_name(edge.group(1)) if edge else None
        tail = clean_name(edge.group(3)) if edge else None
        if relation is None or head is None or tail is None or node_key(head) == node_key(tail):
            parsed.dropped += 1
            continue
        parsed.edges.append((head, relation, tail))
    return parsed


@dataclass
class Graph:
    """One user's LTM graph: nodes by id, edges as (head id, relation, tail id), provenance = MTM entries."""

    names: list[str] = field(default_factory=list)
    types: list[str] = field(default_factory=list)
    sources: list[list[int]] = field(default_factory=list)
    edges: list[tuple[int, str, int]] = field(default_factory=list)
    edge_sources: list[list[int]] = field(default_factory=list)
    _by_key: dict[str, int] = field(default_factory=dict)
    _edge_index: dict[tuple[int, str, int], int] = field(default_factory=dict)

    def node(self, name: str, kind: str, entries: Sequence[int]) -> int:
        key = node_key(name)
        found = self._by_key.get(key)
        if found is None:
            found = self._by_key[key] = len(self.names)
            self.names.append(name)
            self.types.append(kind)
            self.sources.append([])
        for entry in entries:
            if entry not in self.sources[found]:
                self.sources[found].append(entry)
        return found

    def merge(self, parsed: ParsedGraph, entries: Sequence[int]) -> None:
        """Add a consolidation's nodes and edges (typing: module doc)."""
        declared: dict[str, str] = {}
        for name, kind in parsed.nodes:
            declared.setdefault(node_key(name), kind)
        for name, _ in parsed.nodes:
            self.node(name, declared[node_key(name)], entries)
        for head, relation, tail in parsed.edges:
            head_kind, tail_kind = EDGE_TYPES[relation]
            h = self.node(head, declared.get(node_key(head), head_kind), entries)
            t = self.node(tail, declared.get(node_key(tail), tail_kind), entries)
            key = (h, relation, t)
            if key not in self._edge_index:
                self._edge_index[key] = len(self.edges)
                self.edges.append(key)
                self.edge_sources.append([])
            where = self.edge_sources[self._edge_index[key]]
            where.extend(e for e in entries if e not in where)

    def document(self, node: int) -> str | None:
        """The node's search text ("name (type): name REL other; ..."), None when it has no edge."""
        facts = [f"{self.names[h]} {r} {self.names[t]}" for h, r, t in self.edges if node in (h, t)]
        return f"{self.names[node]} ({self.types[node]}): {'; '.join(facts)}" if facts else None


@dataclass
class UserMemory:
    """What the log holds for one user: MTM entries by number, LTM batches done, the graph."""

    mtm: dict[int, dict[str, Any]] = field(default_factory=dict)
    ltm_done: set[int] = field(default_factory=set)
    graph: Graph = field(default_factory=Graph)
    dropped: int = 0
    batches: dict[int, dict[str, Any]] = field(default_factory=dict)  # LTM records by batch, in log order

    def prefix(self, last_row: int) -> UserMemory:
        """The memory as it stood once the store rows up to `last_row` were written (growth analysis): the
        MTM entries whose windows lie there, the LTM batches all of whose entries do (merged in log order)."""
        out = UserMemory(mtm={e: r for e, r in self.mtm.items() if max(r["rows"]) <= last_row})
        for record in self.batches.values():
            if all(int(e) in out.mtm for e in record["entries"]):
                out.apply_ltm(record)
        return out

    def apply_ltm(self, record: dict[str, Any]) -> None:
        entries = [int(e) for e in record["entries"]]
        parsed = ParsedGraph([(str(n), str(k)) for n, k in record["nodes"]],
                             [(str(h), str(r), str(t)) for h, r, t in record["edges"]])
        self.graph.merge(parsed, entries)
        self.ltm_done.add(int(record["batch"]))
        self.batches[int(record["batch"])] = record
        self.dropped += int(record.get("dropped", 0))


@dataclass
class MemoryView:
    """Users' memories as a LightMemLog offers them (`user`), e.g. each as it stood at a growth point."""

    users: dict[str, UserMemory]

    def user(self, user: str) -> UserMemory:
        return self.users.setdefault(user, UserMemory())


class LightMemLog:
    """DIR/lightmem/log.jsonl: a RecordLog of MTM entries and LTM batches, in committed write batches."""

    def __init__(self, path: Path, cfg: MemFitConfig) -> None:
        self.log = RecordLog(path)
        self.users: dict[str, UserMemory] = {}
        settings: dict[str, Any] = {"window": cfg.lightmem.mtm_window_turns, "every": cfg.lightmem.consolidate_every}
        if cfg.lightmem.noise.write:  # noisy notes are stored: a log holds one noise setting (absent = none)
            settings["write_noise"] = [cfg.lightmem.noise.write, cfg.lightmem.noise.seed]
        if not self.log.records:
            self.append([{"t": "header", "format": LOG_FORMAT, **settings}], commit=False)
            return
        header = self.log.records[0]
        if header.get("t") != "header" or header.get("format") != LOG_FORMAT:
            raise StoreCorruptError(str(path), "record 1", "format", f"not a LightMem log of format {LOG_FORMAT}")
        if {k: header.get(k) for k in settings} != settings:
            raise DataError(str(path), "record 1", "window", f"written with {header} but the run asks for "
                            f"{settings}: use a new run directory for other LightMem write settings")
        committed = self._committed()
        if committed < len(self.log.records):
            log.warning("%s: dropping the last %d records, a write batch its killed writer never committed",
                        path, len(self.log.records) - committed)
            self.log.drop_records(committed)
        for record in self.log.records[1:]:
            self._apply(record)

    def _committed(self) -> int:
        committed = start = 1
        for number, record in enumerate(self.log.records[1:], 1):
            if record.get("t") != "commit":
                continue
            if record.get("records") != number - start:
                raise StoreCorruptError(str(self.log.path), f"record {number + 1}", "records",
                                        "a commit whose count does not match its batch; the file was left unmodified")
            committed = start = number + 1
        return committed

    def user(self, user: str) -> UserMemory:
        return self.users.setdefault(user, UserMemory())

    def _apply(self, record: dict[str, Any]) -> None:
        kind = record.get("t")
        if kind == "mtm":
            self.user(record["user"]).mtm[int(record["entry"])] = record
        elif kind == "ltm":
            self.user(record["user"]).apply_ltm(record)
        elif kind != "commit":
            raise StoreCorruptError(str(self.log.path), None, "t", f"unknown LightMem record type {kind!r}")

    def append(self, records: list[dict[str, Any]], commit: bool = True) -> None:
        if not records:
            return
        self.log.append([*records, {"t": "commit", "records": len(records)}] if commit else records)
        for record in records:
            if record.get("t") != "header":
                self._apply(record)

    def close(self) -> None:
        self.log.close()


def prompt_folder(cfg: MemFitConfig) -> Path:
    """The folder of LightMem's four SLM prompts (lightmem.prompt_dir: under memfit_gpu/prompts/, or a path)."""
    folder = Path(cfg.lightmem.prompt_dir)
    return folder if folder.is_absolute() else Path(str(PROMPT_DIR)) / folder


def _prompt(cfg: MemFitConfig, name: str) -> str:
    return load_prompt(name, str(prompt_folder(cfg)))


def _speakers(names: Sequence[str]) -> str:
    return " and ".join(names) if len(names) <= 2 else ", ".join(names[:-1]) + " and " + names[-1]


class LightMem:
    name = "lightmem_slm"

    def __init__(self) -> None:
        self.store: EpisodeStore | None = None
        self.memlog: LightMemLog | None = None
        self.view: ReadView | None = None
        self._view_generation = -1
        self._tiers: tuple[Any, TierIndex] | None = None  # (what it was built from, the index)
        self.stats: dict[str, int] = {}

    # ------------------------------------------------------------------------------------ write path
    def write(self, run: MethodRun) -> None:
        cfg = run.cfg
        if run.out is None or run.reader is None:
            raise ValueError("method=lightmem_slm needs a run directory and a reader (memfit run), "
                             "its memory is written and read by small language models")
        self.store = EpisodeStore(run.store_location(), cfg, load_bi_encoder(cfg.index))
        appended = sum(self._append_turns(memory) for memory in run.memories)
        self.store.snapshot()  # the next open loads the appended turns instead of encoding them again
        faults.point("lightmem.turns")
        self.memlog = LightMemLog(run.out / "lightmem" / "log.jsonl", cfg)
        reader = run.reader()
        users = [m.memory_id for m in run.memories]
        mtm = self._write_mtm(run, reader, users, final=True)
        ltm = self._write_ltm(run, reader, users)
        self.stats = {"turns_appended": appended, "mtm_written": mtm, "ltm_batches_written": ltm}
        log.info("lightmem: %d turns appended, %d MTM entries and %d LTM batches written", appended, mtm, ltm)

    def current_view(self) -> ReadView:
        """The store's ReadView, built again after the store changed (live writes)."""
        assert self.store is not None
        if self.view is None or self._view_generation != self.store.generation:
            self.view, self._view_generation = ReadView.from_store(self.store), self.store.generation
        return self.view

    def _append_turns(self, memory: Memory) -> int:
        """The user's turns not yet in the store, one `append_turn` each (the live write path)."""
        assert self.store is not None
        turns = [(session.session_id, turn) for session in memory.sessions for turn in session.turns]
        stored: list[str] = []
        if memory.memory_id in self.store.memory_ids:
            rows = self.store.memory_rows(self.store.memory_of(memory.memory_id), live=False)
            stored = [str(self.store.turn_id[r]) for r in rows]
        if stored != [turn.turn_id for _, turn in turns[:len(stored)]]:
            raise DataError(str(self.store.path), memory.memory_id, "turn",
                            "the store holds turns that are not this memory's first turns: use a new run directory")
        for session_id, turn in turns[len(stored):]:
            self.store.append_turn(memory.memory_id, turn, session_id=session_id, speakers=memory.speakers)
        return len(turns) - len(stored)

    def _user_rows(self, user: str, live: bool = False) -> list[int]:
        """The user's rows in order: every row ever (MTM windows are cut over them, so a deletion never
        moves a window), or only the live ones (what the reader may see)."""
        assert self.store is not None
        if user not in self.store.memory_ids:
            return []
        return self.store.memory_rows(self.store.memory_of(user), live=live).tolist()

    def _write_mtm(self, run: MethodRun, reader: Any, users: list[str], final: bool) -> int:
        """SLM-3 notes of every closed window that has none yet, one batch across users."""
        jobs, requests = self._mtm_jobs(run.cfg, users, final)
        if not jobs:
            return 0
        responses = reader.generate(requests)
        run.account("lightmem.mtm.ledger")
        self._log_mtm(run.cfg, jobs, responses)
        return len(jobs)

    def _mtm_jobs(self, cfg: MemFitConfig, users: list[str], final: bool) -> tuple[list[dict[str, Any]], list[Request]]:
        """The MTM entries due (closed windows without a note; `final`: the last window closes too) and
        their SLM-3 requests; a window whose turns were all deleted gets an empty note, with no call."""
        assert self.store is not None and self.memlog is not None
        view = self.current_view()
        template = _prompt(cfg, "mtm_summary.txt")
        jobs: list[dict[str, Any]] = []
        for user in users:
            rows = self._user_rows(user)
            done = self.memlog.user(user).mtm
            sessions = [int(view.ep_session[r]) for r in rows]
            for entry, positions in enumerate(mtm_windows(sessions, cfg.lightmem.mtm_window_turns, final=final)):
                window = [rows[p] for p in positions]
                if entry in done:
                    if done[entry]["rows"] != window:
                        raise StoreCorruptError(
                            str(self.memlog.log.path), None, "rows", f"MTM entry {entry} of {user} covers "
                            f"rows {done[entry]['rows']}, the store's window is {window}")
                    continue
                shown = [r for r in window if not view.ep_deleted[r]]
                speakers = list(dict.fromkeys(view.ep_speaker[r] for r in window))
                lines = [f"- {view.ep_speaker[r]}: {quote_lines(self.store.body(r)[:cfg.lightmem.turn_chars])}"
                         for r in shown]
                first, last = view.recorded(window[0]), view.recorded(window[-1])
                prompt = fill(template, speakers=_speakers(speakers), turns="\n".join(lines),
                              date=first if first == last else f"{first} to {last}") if shown else None
                jobs.append({"t": "mtm", "user": user, "entry": entry,
                             "session": self.store.session_ids[int(view.ep_session[window[0]])],
                             "turns": [view.ep_turn_id[r] for r in window], "rows": window, "date": last,
                             "speakers": speakers, "prompt": prompt})
        requests = [Request([{"role": "user", "content": j["prompt"]}], role="mtm_summary",
                            max_new_tokens=cfg.lightmem.mtm_max_new_tokens, temperature=cfg.lightmem.temperature,
                            key=f"mtm:{j['user']}:{j['entry']}", owner=j["user"]) for j in jobs if j["prompt"] is not None]
        return jobs, requests

    def _log_mtm(self, cfg: MemFitConfig, jobs: list[dict[str, Any]], responses: Sequence[Any]) -> None:
        assert self.memlog is not None
        texts = iter(responses)
        records = []
        for job in jobs:
            prompt = job.pop("prompt")
            records.append({**job, "text": "" if prompt is None else next(texts).text.strip()})
        # SLM-3 write noise over the batch's written notes (0: none; a window with no turn left has none)
        written = [i for i, r in enumerate(records) if r["text"]]
        noisy = [records[i] for i in written]
        noise_notes(noisy, cfg.lightmem.noise.write, cfg.lightmem.noise.seed, "write")
        for i, record in zip(written, noisy, strict=True):
            records[i] = record
        self.memlog.append(records)
        faults.point("lightmem.mtm")

    def _write_ltm(self, run: MethodRun, reader: Any, users: list[str]) -> int:
        """Consolidations due (module doc), one batch across users."""
        jobs, requests = self._ltm_jobs(run.cfg, users)
        if not jobs:
            return 0
        responses = reader.generate(requests)
        run.account("lightmem.ltm.ledger")
        self._log_ltm(jobs, responses)
        return len(jobs)

    def _ltm_jobs(self, cfg: MemFitConfig, users: list[str]) -> tuple[list[tuple[str, int, list[int]]], list[Request]]:
        assert self.memlog is not None
        if not cfg.lightmem.ltm_updates:  # the paper's "no update" variant: LTM stays empty
            return [], []
        every = cfg.lightmem.consolidate_every
        template = _prompt(cfg, "consolidate.txt")
        jobs: list[tuple[str, int, list[int]]] = []
        requests: list[Request] = []
        for user_id in users:
            user = self.memlog.user(user_id)
            for batch in due_consolidations(len(user.mtm), every, user.ltm_done):
                entries = list(range(batch * every, (batch + 1) * every))
                notes = "\n".join(f"- ({user.mtm[e]['date']}) {quote_lines(user.mtm[e]['text'])}" for e in entries)
                speakers = list(dict.fromkeys(s for e in entries for s in user.mtm[e]["speakers"]))
                jobs.append((user_id, batch, entries))
                requests.append(Request([{"role": "user", "content": fill(template, speakers=_speakers(speakers),
                                                                           notes=notes)}],
                                        role="consolidate", max_new_tokens=cfg.lightmem.consolidate_max_new_tokens,
                                        temperature=cfg.lightmem.temperature, key=f"ltm:{user_id}:{batch}",
                                        owner=user_id))
        return jobs, requests

    def _log_ltm(self, jobs: list[tuple[str, int, list[int]]], responses: Sequence[Any]) -> None:
        assert self.memlog is not None
        records = []
        for (user_id, batch, entries), response in zip(jobs, responses, strict=True):
            parsed = parse_consolidation(response.text)
            records.append({"t": "ltm", "user": user_id, "batch": batch, "entries": entries,
                            "nodes": [list(n) for n in parsed.nodes], "edges": [list(e) for e in parsed.edges],
                            "dropped": parsed.dropped})
        self.memlog.append(records)
        faults.point("lightmem.ltm")

    def close(self) -> None:
        if self.memlog is not None:
            self.memlog.close()
            self.memlog = None
        if self.store is not None:
            self.store.close()

    # ------------------------------------------------------------------------------ live
    def attach(self, run: MethodRun, store: EpisodeStore) -> None:
        if run.out is None:
            raise ValueError("method=lightmem_slm keeps its notes in the memory's folder: it needs one")
        if self.memlog is not None:
            self.memlog.close()
        self.store, self.view, self._tiers = store, None, None
        self.memlog = LightMemLog(run.out / "lightmem" / "log.jsonl", run.cfg)

    def changed(self, run: MethodRun, memory_ids: list[str]) -> None:
        """Nothing online but the turns (STM), which are the store's; notes wait for consolidate."""

    def hits(self, row: dict[str, Any], k: int) -> list[Hit]:
        """The chosen MTM notes and LTM nodes (SLM-2's order), then the STM turns the excerpts show."""
        assert self.store is not None and self._tiers is not None
        tiers, user = self._tiers[1], row["memory_id"]
        out = []
        for item in row["lightmem"]["items"]:
            key = (item["tier"], int(item["id"]))
            turns = [str(self.store.turn_id[r]) for r in tiers.rows_of(user, key)]
            out.append(Hit(item["tier"], tiers.note(user, key) if key[0] == "mtm" else tiers.text(user, key),
                           float(item["score"] if item["score"] is not None else 0.0), turns,
                           {"dense": item["score"]}))
        chosen = {t for h in out for t in h.turn_ids}
        for episode in row["pack"]["episodes"]:
            if episode["turn_id"] not in chosen:
                out.append(episode_hit(self.store, int(episode["row"]), 0.0, {}))
        return out[:k]

    def consolidate(self, run: MethodRun, memory_ids: list[str],
                    holding: Callable[[], AbstractContextManager[Any]]) -> dict[str, int]:
        """MTM notes of the windows closed since (a session's last window stays open while it may grow),
        then the LTM consolidations due; the SLM calls run without holding the memory."""
        assert run.reader is not None
        reader = run.reader()
        with holding():
            jobs, requests = self._mtm_jobs(run.cfg, memory_ids, final=False)
        responses = reader.generate(requests) if requests else []
        with holding():
            run.account("lightmem.mtm.ledger")
            if jobs:
                self._log_mtm(run.cfg, jobs, responses)
            ltm_jobs, ltm_requests = self._ltm_jobs(run.cfg, memory_ids)
        ltm_responses = reader.generate(ltm_requests) if ltm_requests else []
        with holding():
            run.account("lightmem.ltm.ledger")
            if ltm_jobs:
                self._log_ltm(ltm_jobs, ltm_responses)
        return {"mtm_entries": len(jobs), "ltm_batches": len(ltm_jobs)}

    def unconsolidated(self, memory_ids: list[str]) -> dict[str, int]:
        """The live turns that no MTM entry covers (a compaction drops a user's entries: all of them)."""
        assert self.memlog is not None
        out = {}
        for user in memory_ids:
            noted = {r for entry in self.memlog.user(user).mtm.values() for r in entry["rows"]}
            out[user] = sum(1 for r in self._user_rows(user, live=True) if r not in noted)
        return out

    def compact(self, run: MethodRun, store: EpisodeStore, purged: list[str]) -> None:
        """After the store's compaction (rows renumbered, deleted turns gone): the log is rewritten with
        each kept MTM entry's rows renumbered; every record of a user that lost turns (`purged`, or one whose
        turns the store no longer has) goes: its windows moved, and the next consolidate writes them again
        from the turns that are left. A user is dropped by name, not by its turns' ids: a new turn may have
        taken a deleted turn's id, and a note over the deleted one must not pass for a note over it."""
        assert self.memlog is not None
        path = self.memlog.log.path
        kept: list[dict[str, Any]] = []
        gone: set[str] = set(purged)
        for record in self.memlog.log.records[1:]:
            if record.get("t") != "mtm":
                continue
            rows = [store.has_turn(record["user"], t) if record["user"] in store.memory_ids else None
                    for t in record["turns"]]
            if any(r is None for r in rows):
                gone.add(record["user"])
        for record in self.memlog.log.records[1:]:
            kind = record.get("t")
            if kind == "commit" or record.get("user") in gone:
                continue
            if kind == "mtm":
                record = {**record, "rows": [store.has_turn(record["user"], t) for t in record["turns"]]}
            kept.append(record)
        self.memlog.close()
        self.memlog = None
        fresh = path.with_name(path.name + ".compact")
        fresh.unlink(missing_ok=True)
        rewritten = LightMemLog(fresh, run.cfg)
        rewritten.append(kept)
        rewritten.close()
        os.replace(fresh, path)
        self.attach(run, store)

    # ------------------------------------------------------------------------------------- read path
    def read(self, run: MethodRun) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        assert self.store is not None and self.memlog is not None, "read before write"
        return self._read(run, None, {})

    def read_at(self, run: MethodRun, turns: dict[str, int]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """Packs for run.questions with each user's memory as it stood after its first `turns[user]` turns
        (the growth analysis, growth.py): MTM entries of windows within them, LTM of batches within them,
        STM their last turns. Everything comes from the one write of the whole trajectory."""
        assert self.store is not None and self.memlog is not None, "read before write"
        last_rows = {}
        for u, n in turns.items():
            rows = self._user_rows(u)
            last_rows[u] = rows[min(n, len(rows)) - 1] if n and rows else -1
        return self._read(run, MemoryView({u: self.memlog.user(u).prefix(r) for u, r in last_rows.items()}),
                          last_rows)

    def _read(self, run: MethodRun, at: MemoryView | None,
              last_rows: dict[str, int]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The read path over the whole log (`at` None) or over the memory as it stood at a point (`at`,
        with each user's last row in `last_rows`)."""
        assert self.store is not None and self.memlog is not None, "read before write"
        cfg, view = run.cfg, self.current_view()
        lm = cfg.lightmem
        reader = run.reader()  # type: ignore[misc]
        users = [m.memory_id for m in run.memories] if run.memories else list(self.store.memory_ids)
        memory: LightMemLog | MemoryView = self.memlog if at is None else at
        tiers = (self._tier_index(cfg, users) if at is None
                 else TierIndex.build(at, users, self.store.encoder, cfg, self.store.deleted))
        questions = run.questions
        speakers = {u: view.speakers[view.memory_index(u)] for u in users}

        # SLM-1: rewrite + route, one batch
        rewrite = _prompt(cfg, "rewrite.txt")
        replies = reader.generate([
            Request([{"role": "user", "content": fill(rewrite, speakers=_speakers(speakers[q.memory_id]),
                                                      question=q.question, question_date=q.question_date,
                                                      max_hqs=lm.max_hqs)}],
                    role="rewrite", max_new_tokens=lm.rewrite_max_new_tokens, temperature=lm.temperature,
                    key=f"rewrite:{q.question_id}", owner=q.memory_id) for q in questions])
        run.account("lightmem.rewrite.ledger")
        plans = [route(parse_hqs(r.text, q.question, lm.max_hqs), lm.routing, tiers.has(q.memory_id), lm.top_k)
                 for q, r in zip(questions, replies, strict=True)]
        plans = noise_hqs(plans, questions, lm.noise.hq, lm.noise.seed)  # SLM-1 noise (0: none)

        # coarse vector retrieval with metadata constraints, every HQ in one encoder pass
        candidates = tiers.search(plans, questions, speakers, cfg)

        # SLM-2: re-rank each question's candidates, one batch
        orders = self._rerank(run, reader, questions, candidates, tiers)
        chosen = [select([[c for c, _ in hq_cands] for hq_cands in cands], [hq.budget for hq in plan], order, lm.top_k)
                  for plan, cands, order in zip(plans, candidates, orders, strict=True)]

        ranked, selected, rows_out = [], [], []
        for q, plan, cands, picks in zip(questions, plans, candidates, chosen, strict=True):
            user = q.memory_id
            user_rows = [r for r in self._user_rows(user, live=True) if r <= last_rows.get(user, r)]
            stm = user_rows[-lm.stm_turns:] if lm.stm_turns else []
            provenance = list(dict.fromkeys(r for item in picks for r in tiers.rows_of(user, item)))
            ranked.append(provenance)
            selected.append(list(dict.fromkeys(stm + provenance)))
            score = {c: s for hq_cands in cands for c, s in hq_cands}
            rows_out.append((q, plan, picks, stm, score))
        # what the memory holds, the same however many runs wrote it (a resumed run's own work is logged only)
        method = {"name": self.name, "users": len(users),
                  "turns": sum(len([r for r in self._user_rows(u) if r <= last_rows.get(u, r)]) for u in users),
                  "mtm_entries": sum(len(memory.user(u).mtm) for u in users),
                  "ltm_nodes": sum(len(memory.user(u).graph.names) for u in users),
                  "ltm_edges": sum(len(memory.user(u).graph.edges) for u in users),
                  "ltm_batches": sum(len(memory.user(u).ltm_done) for u in users),
                  "ltm_lines_dropped": sum(memory.user(u).dropped for u in users)}
        if lm.noise.hq or lm.noise.write or lm.noise.mtm:
            method["noise"] = {"hqs_replaced": sum(hq.noise_from is not None for plan in plans for hq in plan),
                               "notes_replaced_write": sum(len(noisy_entries(memory.user(u), "write")) for u in users),
                               "notes_replaced_mtm": len(tiers.noisy)}
        diagnostics, records = diagnostics_for(view, questions, ranked, selected, selected, method)
        diagnostics["encoder"] = self.store.encoder.info()
        out = []
        for (q, plan, picks, stm, score), rows, record in zip(rows_out, selected, records, strict=True):
            hqs = [{"text": hq.text, "tier": hq.tier, "budget": hq.budget,
                    **({"noise_from": hq.noise_from} if hq.noise_from is not None else {})} for hq in plan]
            items = [{"tier": tier, "id": item, "score": score.get((tier, item)),
                      **({"noise": True} if tiers.is_noisy(q.memory_id, (tier, item)) else {})} for tier, item in picks]
            excerpts = self._excerpts(cfg, q.memory_id, stm, picks, tiers)
            out.append(pack_row(q, self.name, {
                "pack": pack_json(rows, rows, view.ep_turn_id), "excerpts": excerpts, "retrieval": record,
                "lightmem": {"hqs": hqs, "candidates": len(score), "items": items},
                "method_notes": {"hqs": [[hq.tier, hq.text] for hq in plan]}}))
        return out, diagnostics

    def _tier_index(self, cfg: MemFitConfig, users: list[str]) -> TierIndex:
        """The MTM / LTM search index of `users`, built again only when the log or the deletions changed
        (a live memory reads many times between consolidations). Entries over a deleted turn are hidden."""
        assert self.store is not None and self.memlog is not None
        key = (tuple(users), len(self.memlog.log), int(self.store.deleted.sum()))
        if self._tiers is None or self._tiers[0] != key:
            self._tiers = key, TierIndex.build(self.memlog, users, self.store.encoder, cfg, self.store.deleted)
        return self._tiers[1]

    def _rerank(self, run: MethodRun, reader: Any, questions: list[Question], candidates: list[list[list[Scored]]],
                tiers: TierIndex) -> list[list[Item]]:
        """Each question's candidates (union over its HQs, coarse order) in SLM-2's order."""
        lm = run.cfg.lightmem
        unions = [list(dict.fromkeys(c for hq_cands in cands for c, _ in hq_cands)) for cands in candidates]
        asks = [i for i, union in enumerate(unions) if lm.rerank and len(union) > 1]
        orders = [list(u) for u in unions]
        if not asks:
            return orders
        template = _prompt(run.cfg, "rerank.txt")
        requests = []
        for i in asks:
            listing = "\n".join(f"[{n}] {quote_lines(tiers.text(questions[i].memory_id, c))}"
                                for n, c in enumerate(unions[i], start=1))
            requests.append(Request([{"role": "user", "content": fill(template, question=questions[i].question,
                                                                       candidates=listing)}],
                                    role="rerank_slm", max_new_tokens=lm.rerank_max_new_tokens,
                                    temperature=lm.temperature, key=f"rerank:{questions[i].question_id}",
                                    owner=questions[i].memory_id))
        replies = reader.generate(requests)
        run.account("lightmem.rerank.ledger")
        for i, reply in zip(asks, replies, strict=True):
            orders[i] = rerank_order(reply.text, unions[i])
        return orders

    def _excerpts(self, cfg: MemFitConfig, user: str, stm: list[int], picks: list[Item],
                  tiers: TierIndex) -> str:
        view = self.current_view()
        parts = []
        if stm:
            lines = [f"EXCERPT {i} {excerpt_tail(view, r, cfg.pack.resolve_dates, cfg.pack.max_excerpt_chars)[0]}"
                     for i, r in enumerate(stm, start=1)]
            parts.append("RECENT TURNS:\n" + "\n".join(lines))
        notes = [f"- (recorded {tiers.date(user, c)}) {quote_lines(tiers.note(user, c))}"
                 for c in picks if c[0] == "mtm"]
        if notes:
            parts.append("MEMORY NOTES:\n" + "\n".join(notes))
        facts = [f"- {quote_lines(tiers.text(user, c))}" for c in picks if c[0] == "ltm"]
        if facts:
            parts.append("KNOWLEDGE:\n" + "\n".join(facts))
        return "\n\n".join(parts)


# ------------------------------------------------------------------------------------------ read side
@dataclass
class HQ:
    text: str
    tier: str  # mtm | ltm
    budget: int = 0
    noise_from: str | None = None  # the question whose HQ text replaced this one (noise.hq)


def parse_hqs(reply: str, question: str, max_hqs: int) -> list[HQ]:
    """SLM-1's marked lines ("MTM: ..." / "LTM: ..."), at most max_hqs, repeats (same tier, same text up to
    case) dropped; the question itself routed to MTM when there is none."""
    hqs: list[HQ] = []
    seen: set[tuple[str, str]] = set()
    for line in reply.splitlines():
        match = _HQ_LINE.match(line)
        if not match:
            continue
        text, tier = match.group(2).strip().strip("\"'"), match.group(1).lower()
        if text and (tier, text.casefold()) not in seen:
            seen.add((tier, text.casefold()))
            hqs.append(HQ(text, tier))
        if len(hqs) == max_hqs:
            break
    return hqs or [HQ(question, "mtm")]


def route(hqs: list[HQ], routing: str, available: dict[str, bool], top_k: int) -> list[HQ]:
    """Each HQ's tier (routing slm | mtm | ltm; an empty tier sends it to the other) and its share of the
    top_k budget (even split, the first HQs get the remainder; HQs beyond top_k get none and are dropped)."""
    hqs = hqs[:top_k]
    out = []
    for i, hq in enumerate(hqs):
        tier = hq.tier if routing == "slm" else routing
        if not available.get(tier, False):
            other = "ltm" if tier == "mtm" else "mtm"
            tier = other if available.get(other, False) else tier
        out.append(HQ(hq.text, tier, top_k // len(hqs) + (1 if i < top_k % len(hqs) else 0)))
    return out


def rerank_order(reply: str, candidates: Sequence[Any]) -> list[Any]:
    """Candidates in SLM-2's order: the numbers its reply names (1-based, first mention), then the rest in
    their given order."""
    named = []
    for match in _NUMBER.finditer(reply):
        n = int(match.group())
        if 1 <= n <= len(candidates) and candidates[n - 1] not in named:
            named.append(candidates[n - 1])
    return named + [c for c in candidates if c not in named]


def select(per_hq: Sequence[Sequence[Any]], budgets: Sequence[int], order: Sequence[Any], top_k: int) -> list[Any]:
    """The final items under the fixed top_k budget: each HQ takes its budget of its own candidates in
    `order`; what it cannot use passes to the next HQ, then to the best remaining candidates. Returned in
    `order`."""
    rank = {c: i for i, c in enumerate(order)}
    chosen: list[Any] = []
    carry = 0
    for cands, budget in zip(per_hq, budgets, strict=True):
        want = budget + carry
        mine = [c for c in sorted(cands, key=lambda c: rank.get(c, len(rank))) if c not in chosen][:want]
        chosen.extend(mine)
        carry = want - len(mine)
    pool = {c for cands in per_hq for c in cands}
    chosen.extend([c for c in order if c in pool and c not in chosen][:max(0, min(carry, top_k - len(chosen)))])
    return sorted(chosen[:top_k], key=lambda c: rank.get(c, len(rank)))


@dataclass
class TierIndex:
    """The MTM entries and LTM node documents of every user, embedded and searchable per user and tier.
    An item is (tier, id): the MTM entry number or the LTM node id, within its user."""

    users: list[str]
    docs: dict[str, list[tuple[int, str, int]]]  # tier -> (user index, text, item id) in index row order
    index: dict[str, DenseIndex]
    memlog: LightMemLog | MemoryView
    speakers_of: dict[tuple[str, int], list[str]]  # (user, MTM entry) -> who speaks in its window
    ltm_texts: dict[tuple[str, int], str]  # (user, node) -> its document
    encoder: Any
    noisy: dict[tuple[str, int], str] = field(default_factory=dict)  # noise.mtm: (user, entry) -> text held

    @classmethod
    def build(cls, memlog: LightMemLog | MemoryView, users: list[str], encoder: Any, cfg: MemFitConfig,
              deleted: np.ndarray | None = None) -> TierIndex:
        """`deleted` (the store's tombstones): an MTM entry over a deleted turn is not searched, nor is an
        LTM node one of whose source entries it is (a deleted turn is found nowhere)."""
        docs: dict[str, list[tuple[int, str, int]]] = {"mtm": [], "ltm": []}
        speakers: dict[tuple[str, int], list[str]] = {}
        texts: dict[tuple[str, int], str] = {}
        noise = cfg.lightmem.noise
        noisy = read_noise([memlog.user(u).mtm[e] for u in users for e in sorted(memlog.user(u).mtm)
                            if memlog.user(u).mtm[e]["text"]], noise.mtm, noise.seed)
        for u, user in enumerate(users):
            memory = memlog.user(user)
            hidden = {e for e, record in memory.mtm.items()
                      if deleted is not None and deleted[np.asarray(record["rows"], dtype=np.int64)].any()}
            for entry in sorted(memory.mtm):
                record = memory.mtm[entry]
                speakers[(user, entry)] = list(record["speakers"])
                if record["text"] and entry not in hidden:
                    text = noisy.get((user, entry), record["text"])
                    docs["mtm"].append((u, f"DATE: {record['date']} | {text}", entry))
            for node in range(len(memory.graph.names)):
                document = memory.graph.document(node)
                if document is not None and not hidden.intersection(memory.graph.sources[node]):
                    docs["ltm"].append((u, document, node))
                    texts[(user, node)] = document
        everything = docs["mtm"] + docs["ltm"]
        vectors = encoder.encode([text for _, text, _ in everything], batch_size=cfg.index.encode_batch_size)
        index = {}
        start = 0
        for tier in TIERS:
            # exact search whatever index.dense_factory says: every item of the user is a candidate
            index[tier] = dense_index(cfg.index, int(encoder.dim), factory="Flat")
            n = len(docs[tier])
            if n:
                index[tier].add(vectors[start:start + n], [u for u, _, _ in docs[tier]])
            start += n
        return cls(users, docs, index, memlog, speakers, texts, encoder, noisy)

    def has(self, user: str) -> dict[str, bool]:
        u = self.users.index(user)
        return {tier: any(owner == u for owner, _, _ in self.docs[tier]) for tier in TIERS}

    def text(self, user: str, item: Item) -> str:
        tier, ident = item
        if tier == "ltm":
            return self.ltm_texts[(user, ident)]
        return f"({self.date(user, item)}) {self.note(user, item)}"

    def note(self, user: str, item: Item) -> str:
        return self.noisy.get((user, item[1]), str(self.memlog.user(user).mtm[item[1]]["text"]))

    def is_noisy(self, user: str, item: Item) -> bool:
        """An MTM item whose text is noise (noise.write when stored, noise.mtm at read time)."""
        return item[0] == "mtm" and ((user, item[1]) in self.noisy
                                     or "noise" in self.memlog.user(user).mtm[item[1]])

    def date(self, user: str, item: Item) -> str:
        return str(self.memlog.user(user).mtm[item[1]]["date"])

    def rows_of(self, user: str, item: Item) -> list[int]:
        """Store rows behind an item: an MTM entry's window; an LTM node's source entries' windows."""
        memory = self.memlog.user(user)
        entries = [item[1]] if item[0] == "mtm" else memory.graph.sources[item[1]]
        # a noisy note stands for no turn of its window (lightmem_noise.py)
        return [int(r) for e in entries if not self.is_noisy(user, ("mtm", e)) for r in memory.mtm[e]["rows"]]

    def search(self, plans: list[list[HQ]], questions: Sequence[Question], speakers: dict[str, list[str]],
               cfg: MemFitConfig) -> list[list[list[Scored]]]:
        """Per question, per HQ: ((tier, id), cosine) candidates, coarse_factor x budget of them."""
        lm = cfg.lightmem
        flat = [(qi, hi, hq) for qi, plan in enumerate(plans) for hi, hq in enumerate(plan)]
        out: list[list[list[Scored]]] = [[[] for _ in plan] for plan in plans]
        if not flat:
            return out
        encoder_input = [hq.text for _, _, hq in flat]
        vectors = self.encoder.encode(encoder_input, batch_size=cfg.index.encode_batch_size)
        for tier in TIERS:
            where = [i for i, (_, _, hq) in enumerate(flat) if hq.tier == tier and hq.budget > 0]
            if not where or not self.docs[tier]:
                continue
            owners = [self.users.index(questions[flat[i][0]].memory_id) for i in where]
            # every item of the user: the speaker constraint filters before the cut to coarse_factor x budget
            k = max(int(np.bincount([u for u, _, _ in self.docs[tier]]).max()), 1)
            scores, rows = self.index[tier].search(vectors[where], owners, k, min_score=cfg.retrieve.dense_min_cosine)
            for j, i in enumerate(where):
                qi, hi, hq = flat[i]
                user = questions[qi].memory_id
                hits = [((tier, self.docs[tier][r][2]), float(s))
                        for r, s in zip(rows[j].tolist(), scores[j].tolist(), strict=True) if r >= 0]
                if tier == "mtm":
                    named = mentioned(hq.text.lower(), speakers[user], cfg.retrieve.boosts.min_speaker_chars)
                    kept = [h for h in hits if named & {normalise(s) for s in self.speakers_of[(user, h[0][1])]}]
                    hits = kept if named and kept else hits
                out[qi][hi] = hits[:lm.coarse_factor * hq.budget]
        return out
