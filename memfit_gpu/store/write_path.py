"""A write batch's records, in chunks of store.write_budget_mb, made from the store's columns.

EpisodeStore (store/episodes.py) writes a batch chunk by chunk: each chunk is encoded first, then logged,
applied to the columns (store/columns.py) and indexed, and the batch is closed by one commit record and a
snapshot. This module makes the records of those chunks from whole memories or single turns, given the
store's `StoreColumns` explicitly (a new memory takes the next memory number, a speaker not seen before
gets a speaker record). Chunking changes nothing stored: the log, the BM25 state and the vectors are the
same bytes as a one-chunk build.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from memfit_gpu.data.schema import Memory, Turn
from memfit_gpu.store.columns import StoreColumns
from memfit_gpu.store.text import episode_text

# What one pending episode costs a write chunk, for store.write_budget_mb: its record (a dict), its text
# (several copies: record, log line, column), its token ids and their sort (per character, tokens being
# shorter than 4 characters on average) and its vector (float32, and the torch copy).
_RECORD_BYTES = 1500
_BYTES_PER_CHAR = 20
_BYTES_PER_DIM = 8

Chunk = tuple[list[dict[str, Any]], torch.Tensor | None, bool]


def memory_records(columns: StoreColumns, memory_id: str, speakers: Sequence[str],
                   pending: dict[str, int]) -> tuple[int, list[dict[str, Any]]]:
    """The memory number of `memory_id` and the records that create it (or add its new speakers).
    pending: the memories this batch creates, id -> number (updated)."""
    if memory_id in pending:  # created earlier in this batch (maybe applied already, by an earlier chunk)
        return pending[memory_id], []
    if memory_id in columns.memory_index:
        memory = columns.memory_index[memory_id]
        known = columns.speaker_index[memory]
        return memory, [{"t": "speaker", "memory": memory, "name": name} for name in dict.fromkeys(speakers) if name not in known]
    memory = max(len(columns.memory_ids), max(pending.values(), default=-1) + 1)
    pending[memory_id] = memory
    return memory, [{"t": "memory", "memory": memory, "id": memory_id, "speakers": list(dict.fromkeys(speakers))}]


def episode_record(row: int, memory: int, session_id: str, turn: Turn) -> dict[str, Any]:
    record = {
        "t": "episode",
        "row": row,
        "memory": memory,
        "session": session_id,
        "turn": turn.turn_id,
        "speaker": turn.speaker,
        "ts": turn.timestamp,
        "date": turn.date_text,
        "images": [image.image_id for image in turn.images if image.image_id],
        "text": episode_text(turn),
    }
    if turn.images:  # how the body's image parts split (a caption may hold "] "): text.split_images
        record["image_parts"] = [[image.image_id or None, len(image.caption)] for image in turn.images]
    return record


def chunk_cost(record: dict[str, Any], dim: int) -> int:
    """What a record with a text costs a write (or replay) chunk, in bytes."""
    return _RECORD_BYTES + _BYTES_PER_CHAR * len(record["text"]) + _BYTES_PER_DIM * dim


def precomputed_vectors(memory: Memory, dim: int) -> np.ndarray:
    """A memory's `extra["embeddings"]` [turns, dim] (add_memories(precomputed=True))."""
    vectors = memory.extra.get("embeddings")
    turns = sum(len(s.turns) for s in memory.sessions)
    if vectors is None:
        raise ValueError(f"EpisodeStore.add_memories(precomputed=True): memory {memory.memory_id!r} has no "
                         f"extra['embeddings'] (memfit_gpu.data.synth writes them with embedding_dim)")
    vectors = np.asarray(vectors, dtype=np.float32)
    if vectors.shape != (turns, dim):
        raise ValueError(f"EpisodeStore.add_memories(precomputed=True): memory {memory.memory_id!r} has "
                         f"embeddings of shape {vectors.shape}, expected ({turns}, {dim})")
    return vectors


def batch_chunks(columns: StoreColumns, memories: Iterable[Memory], precomputed: bool, dim: int,
                 budget_mb: float) -> Iterator[Chunk]:
    """The batch's records (and precomputed vectors) in chunks of about `budget_mb`, built lazily: a
    memory's turns may span chunks; nothing of a later chunk exists before it is asked for. Each chunk
    is applied to `columns` before the next is asked for (its rows follow theirs). The flag marks the
    chunk known to be the last (the memories ran out while it was being filled)."""
    budget = budget_mb * (1 << 20)
    pending: dict[str, int] = {}
    row = columns.size
    records: list[dict[str, Any]] = []
    vectors: list[np.ndarray] = []
    used = 0

    def cut(last: bool) -> Chunk:
        nonlocal records, vectors, used
        given: torch.Tensor | None = None
        if precomputed:
            given = torch.from_numpy(np.concatenate(vectors)) if vectors else torch.empty((0, dim))
        out = records, given, last
        records, vectors, used = [], [], 0
        return out

    for memory in memories:
        memory_idx, created = memory_records(columns, memory.memory_id, memory.speakers, pending)
        records.extend(created)
        given = precomputed_vectors(memory, dim) if precomputed else None
        taken = 0  # turns of this memory whose vectors are in `vectors`
        position = 0
        for session in memory.sessions:
            for turn in session.turns:
                record = episode_record(row, memory_idx, session.session_id, turn)
                records.append(record)
                row += 1
                position += 1
                used += chunk_cost(record, dim)
                if used >= budget:
                    if given is not None:
                        vectors.append(given[taken:position])
                        taken = position
                    yield cut(False)
        if given is not None and taken < position:
            vectors.append(given[taken:position])
    if records:
        yield cut(True)


def turn_records(columns: StoreColumns, turns: Sequence[tuple[str, Turn, str | None, Sequence[str]]]
                 ) -> tuple[list[dict[str, Any]], list[int]]:
    """The records of new turns of any memories, (memory id, turn, session id, speakers) each, and their
    rows. A turn without a session id is in the session its date text names."""
    records: list[dict[str, Any]] = []
    pending: dict[str, int] = {}
    rows: list[int] = []
    row = columns.size
    for memory_id, turn, session_id, speakers in turns:
        memory_idx, created = memory_records(columns, memory_id, speakers, pending)
        records.extend(created)
        records.append(episode_record(row, memory_idx, session_id if session_id is not None else turn.date_text,
                                      turn))
        rows.append(row)
        row += 1
    return records, rows
