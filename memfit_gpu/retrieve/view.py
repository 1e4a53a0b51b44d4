"""What the read path needs from a store, as flat arrays indexed by episode row / summary row.

`ReadView.from_store(store)` reads an `EpisodeStore` (memfit_gpu/store); `ReadView.from_memories`
builds the same thing straight from loaded memories with the real BM25 and FAISS indexes (no
summaries), so retrieval can run and be tested without a persistent store. Everything derived
(speaker bit masks, time order, session neighbours) is computed once per view and
cached here, never per question.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
import torch

from memfit_gpu.config import MemFitConfig
from memfit_gpu.data.schema import Memory
from memfit_gpu.index.encoders import TextEncoder
from memfit_gpu.index.factory import dense_index, lexical_index
from memfit_gpu.index.protocols import DenseSearch, LexicalIndex
from memfit_gpu.index.tokenize import tokenize_many
from memfit_gpu.names import MAX_SPEAKERS, mentions, normalise
from memfit_gpu.retrieve.dates import recorded_date
from memfit_gpu.store.episodes import EpisodeStore
from memfit_gpu.store.text import episode_text


@dataclass
class ReadView:
    memory_ids: list[str]
    speakers: list[list[str]]  # per memory_idx: known speaker names
    # episodes, by global row
    ep_memory: np.ndarray  # int64
    ep_session: np.ndarray  # int64, unique per (memory, session)
    ep_position: np.ndarray  # int64, turn order within the memory
    ep_time: np.ndarray  # datetime64[s]
    ep_speaker: list[str]
    ep_text: Sequence[str]  # a list, or the store's TextColumn (UTF-8 bytes, decoded per row)
    ep_turn_id: Sequence[str]
    ep_deleted: np.ndarray  # bool
    ep_bm25: LexicalIndex
    ep_dense: DenseSearch
    # summaries, by summary row (empty when the store has none)
    sm_memory: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    sm_text: list[str] = field(default_factory=list)
    sm_members: list[list[int]] = field(default_factory=list)
    sm_time: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype="datetime64[s]"))  # event time (boosts)
    sm_recorded: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype="datetime64[s]"))  # last member ("as of")
    sm_bm25: LexicalIndex | None = None
    sm_dense: DenseSearch | None = None
    encoder_info: dict[str, Any] = field(default_factory=dict)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_memories(cls, memories: Sequence[Memory], encoder: TextEncoder | None, cfg: MemFitConfig,
                      progress: bool = False,
                      embeddings: torch.Tensor | None = None) -> ReadView:
        """Episodes of `memories` in the configured lexical and dense indexes (index/factory.py); no summaries.

        embeddings: precomputed episode embeddings in turn order (else `encoder.encode`; encoder may then be None)."""
        texts, mem, sess, pos, times, spk, tids = [], [], [], [], [], [], []
        memory_ids, speakers = [], []
        session_counter = 0
        for m_idx, memory in enumerate(memories):
            memory_ids.append(memory.memory_id)
            names = list(dict.fromkeys(memory.speakers or [t.speaker for t in memory.turns()]))
            speakers.append(names)
            p = 0
            for session in memory.sessions:
                for turn in session.turns:
                    texts.append(episode_text(turn))
                    mem.append(m_idx)
                    sess.append(session_counter)
                    pos.append(p)
                    times.append(np.datetime64(turn.timestamp or session.timestamp, "s"))
                    spk.append(turn.speaker)
                    tids.append(turn.turn_id)
                    p += 1
                session_counter += 1
        if embeddings is None:
            embeddings = encoder.encode(texts, batch_size=cfg.index.encode_batch_size, progress=progress)
        # built as the store builds its own (index/factory.py)
        bm25 = lexical_index(cfg.index)
        bm25.add(tokenize_many(texts), mem)
        dense = dense_index(cfg.index, int(embeddings.shape[1]))
        dense.add(embeddings, mem)
        info = encoder.info() if hasattr(encoder, "info") else {}
        return cls(
            memory_ids=memory_ids, speakers=speakers,
            ep_memory=np.asarray(mem, dtype=np.int64), ep_session=np.asarray(sess, dtype=np.int64),
            ep_position=np.asarray(pos, dtype=np.int64), ep_time=np.asarray(times, dtype="datetime64[s]"),
            ep_speaker=spk, ep_text=texts, ep_turn_id=tids, ep_deleted=np.zeros(len(texts), dtype=bool),
            ep_bm25=bm25, ep_dense=dense, encoder_info=info,
        )

    @classmethod
    def from_store(cls, store: EpisodeStore, previous: ReadView | None = None) -> ReadView:
        """Columns and indexes of an EpisodeStore (memfit_gpu/store, docs/concepts/design.md).

        previous: an earlier view of the same store (a live memory's, before its last writes): the
        speaker masks it computed are carried over for the rows whose memory kept its speakers
        (`_carry_speaker_masks`), so a write to one memory costs the next read the new rows only."""
        def col(name: str) -> Any:
            if not hasattr(store, name):
                raise AttributeError(f"EpisodeStore has no read-side column {name!r} (docs/concepts/design.md store/)")
            return getattr(store, name)

        memory_ids = list(col("memory_ids"))
        speaker_of = col("speaker")
        speakers_by_memory: list[list[str]] = [[] for _ in memory_ids]
        mem = np.asarray(col("memory_idx"), dtype=np.int64)
        for m, name in zip(mem.tolist(), speaker_of, strict=False):
            if name not in speakers_by_memory[m]:
                speakers_by_memory[m].append(name)
        known = getattr(store, "speakers", None)
        if isinstance(known, (list, dict)) and len(known) == len(memory_ids):
            for m, names in enumerate(known.values() if isinstance(known, dict) else known):
                for name in names:
                    if name not in speakers_by_memory[m]:
                        speakers_by_memory[m].append(name)
        sums = list(getattr(store, "summaries", []) or [])
        encoder = getattr(store, "encoder", None)
        info = encoder.info() if hasattr(encoder, "info") else {}
        view = cls(
            memory_ids=memory_ids, speakers=speakers_by_memory,
            ep_memory=mem, ep_session=np.asarray(col("session_idx"), dtype=np.int64),
            ep_position=np.asarray(col("position"), dtype=np.int64),
            ep_time=np.asarray(col("timestamp"), dtype="datetime64[s]"),
            ep_speaker=list(speaker_of), ep_text=col("text"), ep_turn_id=col("turn_id"),
            ep_deleted=np.asarray(col("deleted"), dtype=bool),
            ep_bm25=col("episode_bm25"), ep_dense=col("episode_dense"),
            sm_memory=np.asarray([s.memory_idx for s in sums], dtype=np.int64),
            sm_text=[s.text for s in sums], sm_members=[list(map(int, s.members)) for s in sums],
            sm_time=np.asarray([np.datetime64(s.event_time, "s") for s in sums], dtype="datetime64[s]"),
            sm_recorded=np.asarray([np.datetime64(s.recorded_time, "s") for s in sums], dtype="datetime64[s]"),
            sm_bm25=getattr(store, "summary_bm25", None) if sums else None,
            sm_dense=getattr(store, "summary_dense", None) if sums else None,
            encoder_info=info,
        )
        if previous is not None:
            view._carry_speaker_masks(previous)
        return view

    def _carry_speaker_masks(self, previous: ReadView) -> None:
        """Take `previous`'s episode speaker masks for the rows it already had, where their memory's
        speaker list is unchanged (a new speaker changes a memory's bits); compute the other rows.

        A store's rows are append-only while it keeps its text column (it makes a new one when it
        reopens or is compacted), so the rows of `previous` are this view's first rows exactly when
        both read the same column object and it has not shrunk."""
        done = previous.__dict__.get("_speaker_masks")
        n_old = len(previous.ep_memory)  # its rows then (the text column it shares has grown since)
        if not done or previous.ep_text is not self.ep_text or n_old > self.num_episodes:
            return
        if previous.memory_ids != self.memory_ids[:len(previous.memory_ids)]:
            return
        old_names, names = previous.speakers_lower, self.speakers_lower
        kept_memory = np.asarray([m < len(old_names) and old_names[m] == low for m, low in enumerate(names)],
                                 dtype=bool)
        keep = np.zeros(self.num_episodes, dtype=bool)
        keep[:n_old] = kept_memory[self.ep_memory[:n_old]] if len(kept_memory) else False
        redo = np.flatnonzero(~keep)
        texts = [self.ep_text[r] for r in redo.tolist()]
        speakers = [self.ep_speaker[r] for r in redo.tolist()]
        for key, mask in done.items():
            kind, min_chars, match = key
            if kind != "ep":
                continue
            out = np.zeros(self.num_episodes, dtype=np.int64)
            out[:n_old][keep[:n_old]] = mask[keep[:n_old]]
            out[redo] = self._mask_of(texts, speakers, self.ep_memory[redo], names, min_chars, match)
            self._speaker_masks[key] = out

    # ------------------------------------------------------------------ lookups
    @property
    def num_episodes(self) -> int:
        return len(self.ep_text)

    @property
    def has_summaries(self) -> bool:
        return len(self.sm_text) > 0 and self.sm_bm25 is not None and self.sm_dense is not None

    def memory_index(self, memory_id: str) -> int:
        try:
            return self._memory_lookup[memory_id]
        except KeyError:
            raise KeyError(f"memory {memory_id!r} is not in the store ({len(self.memory_ids)} memories)") from None

    @cached_property
    def _memory_lookup(self) -> dict[str, int]:
        return {m: i for i, m in enumerate(self.memory_ids)}

    @cached_property
    def speakers_lower(self) -> list[list[str]]:
        """Per memory: lowercased speaker names, in bit order of the speaker masks."""
        out = []
        for m, names in enumerate(self.speakers):
            low = list(dict.fromkeys(normalise(n) for n in names))
            if len(low) > MAX_SPEAKERS:
                raise ValueError(f"memory {self.memory_ids[m]!r}: {len(low)} speakers, at most {MAX_SPEAKERS} supported")
            out.append(low)
        return out

    @staticmethod
    def _mask_of(texts: Sequence[str], speakers: Sequence[str], memory: np.ndarray, names: list[list[str]],
                 min_chars: int, match: str) -> np.ndarray:
        """Per row, bit s set when speaker s of the row's memory matches the row (SPEC read path 2).

        match "speaker": the row is that speaker's own turn (its speaker field); "mention": also when
        its text names the speaker as a whole word (`memfit_gpu.names`). A bit the speaker field
        already set is not searched for."""
        bit_maps = [{name: bit for bit, name in enumerate(ns) if len(name) >= min_chars} for ns in names]
        masks = [0] * len(texts)
        for row, m in enumerate(memory.tolist()):
            bit_of = bit_maps[m]
            if not bit_of:
                continue
            own = bit_of.get(normalise(speakers[row])) if speakers else None
            bits = 0 if own is None else 1 << own
            if match == "mention":
                low = texts[row].lower()
                for name, bit in bit_of.items():
                    if not (bits >> bit) & 1 and mentions(low, name):
                        bits |= 1 << bit
            masks[row] = bits
        return np.asarray(masks, dtype=np.int64)

    def episode_speaker_mask(self, min_chars: int, match: str) -> np.ndarray:
        key = ("ep", min_chars, match)
        if key not in self._speaker_masks:
            self._speaker_masks[key] = self._mask_of(self.ep_text, self.ep_speaker, self.ep_memory,
                                                     self.speakers_lower, min_chars, match)
        return self._speaker_masks[key]

    def summary_speaker_mask(self, min_chars: int, match: str) -> np.ndarray:
        """match "speaker": the speakers with a turn among the summary's members (a summary's
        metadata is its provenance); "mention": the names its text mentions (a summary has no turn
        of its own)."""
        key = ("sm", min_chars, match)
        if key not in self._speaker_masks:
            if match == "mention":
                mask = self._mask_of(self.sm_text, [], self.sm_memory, self.speakers_lower, min_chars, match)
            else:
                own = self.episode_speaker_mask(min_chars, "speaker")
                mask = np.asarray([np.bitwise_or.reduce(own[members]) if members else 0
                                   for members in self.sm_members], dtype=np.int64)
            self._speaker_masks[key] = mask
        return self._speaker_masks[key]

    @cached_property
    def _speaker_masks(self) -> dict[tuple[str, int, str], np.ndarray]:
        return {}

    @staticmethod
    def _year_month(times: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each time's year and month (1-12); 0 and 0 for an undated one (NaT), which no question names (NaT's
        integer would otherwise read as May of a year long before any)."""
        undated = np.isnat(times)
        years = np.where(undated, 0, times.astype("datetime64[Y]").astype(np.int64) + 1970)
        months = np.where(undated, 0, times.astype("datetime64[M]").astype(np.int64) % 12 + 1)
        return years, months

    @cached_property
    def ep_year_month(self) -> tuple[np.ndarray, np.ndarray]:
        return self._year_month(self.ep_time)

    @cached_property
    def sm_year_month(self) -> tuple[np.ndarray, np.ndarray]:
        return self._year_month(self.sm_time)

    @cached_property
    def time_rank(self) -> np.ndarray:
        """Rank of each episode in time order: (memory, timestamp, position)."""
        order = np.lexsort((self.ep_position, self.ep_time.astype(np.int64), self.ep_memory))
        rank = np.empty(len(order), dtype=np.int64)
        rank[order] = np.arange(len(order))
        return rank

    @cached_property
    def time_rank_tensor(self) -> torch.Tensor:
        return torch.from_numpy(self.time_rank)

    def neighbour_table(self, window: int) -> torch.Tensor:
        """[n_rows, 2*window+1] live rows of the same session at offsets -window..window in turn
        order (-1 where the session has none; a deleted row has none at all)."""
        key = ("table", window)
        if key not in self._neighbour_cache:
            order, place = self.session_order
            order_t = torch.from_numpy(order)
            place_t = torch.from_numpy(place)
            session = torch.from_numpy(self.ep_session)
            offsets = torch.arange(-window, window + 1)
            at = place_t[:, None] + offsets[None, :]
            inside = (place_t[:, None] >= 0) & (at >= 0) & (at < len(order))
            rows = torch.where(inside, order_t[at.clamp(0, max(len(order) - 1, 0))], -1)
            same = inside & (session[rows.clamp(min=0)] == session[:, None])
            self._neighbour_cache[key] = torch.where(same, rows, -1)
        return self._neighbour_cache[key]

    @cached_property
    def time_rank_list(self) -> list[int]:
        return self.time_rank.tolist()

    @cached_property
    def session_order(self) -> tuple[np.ndarray, np.ndarray]:
        """Live rows sorted by (session, position) and each row's place in that list (-1 when deleted)."""
        live = np.flatnonzero(~self.ep_deleted)
        order = live[np.lexsort((self.ep_position[live], self.ep_session[live]))]
        place = np.full(self.num_episodes, -1, dtype=np.int64)
        place[order] = np.arange(len(order))
        return order, place

    def neighbours(self, row: int, window: int) -> list[int]:
        """Live rows of the same session within +/- window turns (the row itself included), in turn order."""
        key = (row, window)
        cached = self._neighbour_cache.get(key)
        if cached is None:
            cached = self._neighbour_cache[key] = self._neighbours(row, window)
        return cached

    @cached_property
    def _neighbour_cache(self) -> dict[tuple[int, int], list[int]]:
        return {}

    @cached_property
    def _session_lists(self) -> tuple[list[int], list[int], list[int]]:
        order, place = self.session_order
        return order.tolist(), place.tolist(), self.ep_session.tolist()

    def _neighbours(self, row: int, window: int) -> list[int]:
        order, place, session = self._session_lists
        i = place[row]
        if i < 0:
            return []
        lo, hi = max(0, i - window), min(len(order), i + window + 1)
        return [r for r in order[lo:hi] if session[r] == session[row]]

    @cached_property
    def members_padded(self) -> torch.Tensor:
        """[n_summaries, max_members] episode rows, -1 padded."""
        width = max((len(m) for m in self.sm_members), default=0)
        out = torch.full((len(self.sm_members), max(width, 1)), -1, dtype=torch.long)
        for i, members in enumerate(self.sm_members):
            if members:
                out[i, : len(members)] = torch.tensor(members, dtype=torch.long)
        return out

    def recorded(self, row: int) -> str:
        """The episode's date as excerpts print it ("unknown date" when it has no timestamp)."""
        day = self._ep_day[row]
        text = self._day_text.get(day)
        if text is None:
            text = self._day_text[day] = recorded_date(self.ep_time[row])
        return text

    @cached_property
    def _ep_day(self) -> list[int]:
        return self.ep_time.astype("datetime64[D]").astype(np.int64).tolist()

    @cached_property
    def _day_text(self) -> dict[int, str]:
        return {}

    def summary_date(self, srow: int) -> str:
        """The summary's "as of" date as excerpts print it ("unknown date" when its turns had none)."""
        return recorded_date(self.sm_recorded[srow])
