"""Naive RAG: fixed-size token chunks of the whole history, dense top-k, no rerank.

Write: each memory's history is its turns' SPEC episode texts ("DATE: ... | Speaker X says: ...") one per
line, in conversation order, cut into chunks of `naive_rag.chunk_tokens` whitespace tokens that overlap
by `naive_rag.overlap_tokens` (the last chunk is shorter; no chunk lies wholly inside its predecessor's
overlap). Chunks cross turn and session boundaries: that is what makes the method naive. A chunk's text is
the history's own characters from its first to its last token (line breaks kept). Every chunk of every
memory is embedded in one pass of the run's bi-encoder and added to a FAISS DenseIndex partitioned by
memory, like the store's episodes.

Read: the questions are embedded in one pass and each searches its own memory's chunks: the top
`naive_rag.top_k` by cosine (only cosine > retrieve.dense_min_cosine, as the store's dense search), in
rank order, become the excerpts ("EXCERPT i (recorded <first date>[ to <last date>]): <chunk>"). No
date resolution, no neighbours, no reranker.

Nothing here calls an LLM, so the chunk index is not kept on disk: a run killed before packs.jsonl exists
chunks and encodes again (the same texts in the same single pass give the same vectors), and once
packs.jsonl exists nothing is rebuilt.

Live (memfit_gpu.Memory): the chunks are cut from the live memory's store (its live turns, rows = store
rows), all of them when the memory opens; after a write batch each touched memory is chunked again and
only the chunks that differ from the ones held (the tail, as turns are appended; everything after a
deleted turn) leave the index and enter it again, encoded in one pass. `chunks[i]` is the chunk of dense
row i (a replaced chunk keeps its slot, tombstoned in the index).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from memfit_gpu.index.dense import DenseIndex
from memfit_gpu.index.encoders import load_bi_encoder
from memfit_gpu.index.factory import dense_index
from memfit_gpu.methods.base import Hit, MethodRun
from memfit_gpu.methods.common import TurnTable, diagnostics_for, pack_json
from memfit_gpu.methods.packs import pack_row
from memfit_gpu.retrieve.pack import cut_excerpt, quote_lines
from memfit_gpu.retrieve.view import ReadView
from memfit_gpu.store.episodes import EpisodeStore

_TOKEN = re.compile(r"\S+")


@dataclass(frozen=True)
class Chunk:
    memory_idx: int
    text: str
    rows: tuple[int, ...]  # turn rows (TurnTable) it holds tokens of, in order
    tokens: tuple[int, int]  # [first, last) token positions in its memory's history


def chunk_starts(n_tokens: int, size: int, overlap: int) -> list[int]:
    """First token of each chunk: every size - overlap tokens, while the previous chunk leaves some of the
    history uncovered."""
    step = size - overlap
    return [0] + [s for s in range(step, n_tokens, step) if s + overlap < n_tokens] if n_tokens else []


def chunk_history(texts: Sequence[str], rows: Sequence[int], memory_idx: int, size: int,
                  overlap: int, first_token: int = 0, from_token: int = 0) -> list[Chunk]:
    """Chunks of one memory's history (texts: its turns' episode texts, rows: their rows). Or of its tail: the
    texts from the turn whose first token is the history's `first_token`-th to the end, and only the chunks that
    start at token `from_token` or later (>= first_token), as the whole history would cut them (the live
    memory chunks again only what a write changed)."""
    history = "\n".join(texts)
    spans: list[tuple[int, int]] = []
    owner: list[int] = []
    offset = 0
    for text, row in zip(texts, rows, strict=True):
        for match in _TOKEN.finditer(text):
            spans.append((offset + match.start(), offset + match.end()))
            owner.append(row)
        offset += len(text) + 1
    chunks = []
    total = first_token + len(spans)
    for start in chunk_starts(total, size, overlap):
        if start < from_token:
            continue
        stop = min(start + size, total)
        first, last = start - first_token, stop - first_token
        chunks.append(Chunk(memory_idx, history[spans[first][0]:spans[last - 1][1]],
                            tuple(dict.fromkeys(owner[first:last])), (start, stop)))
    return chunks


def chunk_dates(chunk: Chunk, table: TurnTable | ReadView) -> str:
    first, last = table.recorded(chunk.rows[0]), table.recorded(chunk.rows[-1])
    return first if first == last else f"{first} to {last}"


class NaiveRAG:
    name = "naive_rag"

    def __init__(self) -> None:
        self.table: TurnTable | ReadView | None = None
        self.chunks: list[Chunk] = []  # by dense row
        self.index: DenseIndex | None = None
        self.encoder: Any = None
        self.store: EpisodeStore | None = None  # live only
        self._rows_of: dict[int, list[int]] = {}  # live: memory index -> dense rows of its current chunks
        # live: memory index -> the turn rows chunked, and the history's token count before each (and at the end)
        self._turns_of: dict[int, np.ndarray] = {}
        self._tokens_of: dict[int, np.ndarray] = {}

    def write(self, run: MethodRun) -> None:
        cfg = run.cfg
        self.table = TurnTable.from_memories(run.memories)
        self.chunks = []
        for m_idx in range(len(self.table.memory_ids)):
            rows = self.table.memory_rows(m_idx)
            self.chunks.extend(chunk_history([self.table.ep_text[r] for r in rows], rows, m_idx,
                                             cfg.naive_rag.chunk_tokens, cfg.naive_rag.overlap_tokens))
        self.encoder = load_bi_encoder(cfg.index)
        vectors = self.encoder.encode([c.text for c in self.chunks], batch_size=cfg.index.encode_batch_size,
                                      progress=run.progress)
        self.index = dense_index(cfg.index, int(self.encoder.dim))
        if self.chunks:
            self.index.add(vectors, [c.memory_idx for c in self.chunks])

    def close(self) -> None:
        pass

    # ------------------------------------------------------------------------------ live
    def attach(self, run: MethodRun, store: EpisodeStore) -> None:
        self.store, self.encoder = store, store.encoder
        self.index = dense_index(run.cfg.index, int(self.encoder.dim))
        self.chunks, self._rows_of, self._turns_of, self._tokens_of = [], {}, {}, {}
        self.changed(run, list(store.memory_ids))

    def changed(self, run: MethodRun, memory_ids: list[str]) -> None:
        """Chunk the touched memories again from the first chunk a write can have changed; re-index the chunks
        that differ (module doc). A chunk of full size over turns before the first one added or deleted is the
        same chunk: an add costs its own turns' tokens, not the memory's whole history (on the write path,
        every user's searches wait for it)."""
        assert self.store is not None and self.index is not None
        cfg = run.cfg.naive_rag
        self.table = table = ReadView.from_store(self.store)
        stale: list[int] = []
        fresh: list[Chunk] = []
        for memory_id in memory_ids:
            m = self.store.memory_of(memory_id)
            rows = self.store.memory_rows(m)
            chunked, tokens = self._turns_of.get(m, rows[:0]), self._tokens_of.get(m, np.zeros(1, dtype=np.int64))
            prefix = min(len(chunked), len(rows))
            differ = np.flatnonzero(chunked[:prefix] != rows[:prefix])
            prefix = int(differ[0]) if len(differ) else prefix  # the turns before the first change
            held = self._rows_of.get(m, [])
            kept = 0  # full chunks wholly within those turns' tokens
            while kept < len(held) and self.chunks[held[kept]].tokens[1] <= tokens[prefix] and (
                    self.chunks[held[kept]].tokens[1] - self.chunks[held[kept]].tokens[0] == cfg.chunk_tokens):
                kept += 1
            step = cfg.chunk_tokens - cfg.overlap_tokens
            start = self.chunks[held[kept]].tokens[0] if kept < len(held) else (
                self.chunks[held[-1]].tokens[0] + step if held else 0)
            start = min(start, int(tokens[prefix]))
            first = int(np.searchsorted(tokens[:prefix + 1], start, side="right")) - 1  # the turn holding it
            added = [len(_TOKEN.findall(table.ep_text[int(r)])) for r in rows[prefix:]]
            self._turns_of[m] = rows.copy()
            self._tokens_of[m] = np.concatenate([tokens[:prefix + 1], tokens[prefix] + np.cumsum(added, dtype=np.int64)])
            tail = rows[first:].tolist()
            now = chunk_history([table.ep_text[r] for r in tail], tail, m, cfg.chunk_tokens, cfg.overlap_tokens,
                                first_token=int(tokens[first]), from_token=start)
            same = 0
            while same < min(len(held) - kept, len(now)) and self.chunks[held[kept + same]] == now[same]:
                same += 1
            stale.extend(held[kept + same:])
            fresh.extend(now[same:])
            self._rows_of[m] = held[:kept + same]
        if stale:
            self.index.delete(stale)
        if not fresh:
            return
        vectors = self.encoder.encode([c.text for c in fresh], batch_size=run.cfg.index.encode_batch_size)
        rows = self.index.add(vectors, [c.memory_idx for c in fresh]).tolist()
        if rows != list(range(len(self.chunks), len(self.chunks) + len(fresh))):
            raise RuntimeError(f"naive_rag: the chunk index gave rows {rows[:3]}..., expected {len(self.chunks)}...")
        self.chunks.extend(fresh)
        for chunk, row in zip(fresh, rows, strict=True):
            self._rows_of[chunk.memory_idx].append(row)

    def hits(self, row: dict[str, Any], k: int) -> list[Hit]:
        return [Hit("chunk", self.chunks[c["chunk"]].text, float(c["score"]), list(c["turn_ids"]),
                    {"dense": float(c["score"])}) for c in row["chunks"][:k]]

    def consolidate(self, run: MethodRun, memory_ids: list[str], holding: Any) -> dict[str, int]:
        return {}  # nothing is written off the query path

    def unconsolidated(self, memory_ids: list[str]) -> dict[str, int]:
        return {}

    def compact(self, run: MethodRun, store: EpisodeStore, purged: list[str]) -> None:
        """The store's rows were renumbered: chunk it all again."""
        self.attach(run, store)

    def read(self, run: MethodRun) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        return self._read(run, None)

    def read_at(self, run: MethodRun, turns: dict[str, int]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """Packs with each memory as it stood after its first `turns[memory]` turns (the growth analysis,
        growth.py): only the chunks of the one write that lie wholly within them, as a chunker fed the turns
        one by one would have emitted (the tail shorter than a chunk is still pending)."""
        assert self.table is not None, "NaiveRAG.read_at before write"
        last = {self.table.memory_index(m): self.table.memory_rows(self.table.memory_index(m))[n - 1] if n else -1
                for m, n in turns.items()}
        return self._read(run, {c for c, chunk in enumerate(self.chunks)
                                if chunk.rows[-1] <= last.get(chunk.memory_idx, chunk.rows[-1])})

    def _read(self, run: MethodRun, allowed: set[int] | None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        assert self.table is not None and self.index is not None, "NaiveRAG.read before write"
        cfg, table = run.cfg, self.table
        questions = run.questions
        embeddings = self.encoder.encode([q.question for q in questions], batch_size=cfg.index.encode_batch_size)
        memory = [table.memory_index(q.memory_id) for q in questions]
        # with a subset allowed (growth), every chunk of the memory is fetched and the top_k allowed kept
        k = cfg.naive_rag.top_k if allowed is None else max(Counter(c.memory_idx for c in self.chunks).values(), default=1)
        if self.chunks:
            scores, found = self.index.search(embeddings, memory, k, min_score=cfg.retrieve.dense_min_cosine)
        else:
            scores = found = torch.full((len(questions), 0), -1)
        ranked, packs = [], []
        for i in range(len(questions)):
            hits = [(int(c), float(s)) for c, s in zip(found[i].tolist(), scores[i].tolist(), strict=True)
                    if c >= 0 and (allowed is None or c in allowed)][:cfg.naive_rag.top_k]
            rows = list(dict.fromkeys(r for c, _ in hits for r in self.chunks[c].rows))
            ranked.append(rows)
            packs.append(hits)
        chunks_held = len(self.chunks) if allowed is None else len(allowed)
        method = {"name": self.name, "chunks": chunks_held, "chunk_tokens": cfg.naive_rag.chunk_tokens,
                  "overlap_tokens": cfg.naive_rag.overlap_tokens, "top_k": cfg.naive_rag.top_k}
        diagnostics, records = diagnostics_for(table, questions, ranked, ranked, ranked, method)
        diagnostics["encoder"] = self.encoder.info()
        out = []
        for q, hits, rows, record in zip(questions, packs, ranked, records, strict=True):
            lines, cut_total = [], 0
            for rank, (c, _) in enumerate(hits, start=1):
                body, cut = cut_excerpt(quote_lines(self.chunks[c].text), cfg.pack.max_excerpt_chars)
                lines.append(f"EXCERPT {rank} (recorded {chunk_dates(self.chunks[c], table)}): {body}")
                cut_total += cut
            chunks = [{"chunk": c, "score": score, "tokens": list(self.chunks[c].tokens),
                       "turn_ids": [table.ep_turn_id[r] for r in self.chunks[c].rows]} for c, score in hits]
            extra = {"excerpt_chars_cut": cut_total} if cut_total else {}
            out.append(pack_row(q, self.name, {"pack": pack_json(rows, rows, table.ep_turn_id),
                                               "excerpts": "\n".join(lines), "retrieval": record, "chunks": chunks,
                                               **extra}))
        return out, diagnostics
