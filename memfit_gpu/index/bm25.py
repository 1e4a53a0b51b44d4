"""BM25 over many memories at once, as batched torch sparse operations (SPEC write path 2).

Scoring is bm25s's ``lucene`` form with every statistic taken per memory:

    idf(t)   = ln(1 + (N - df(t) + 0.5) / (df(t) + 0.5))
    score    = sum over query tokens t (each occurrence counts) of
               idf(t) * tf / (tf + k1 * (1 - b + b * dl / avgdl))

with N the memory's live documents, df(t) its live documents containing t and avgdl their mean
length in tokens.

`BM25Index` (the fast path) keys its vocabulary by (memory, token), so every term id belongs to
exactly one memory: a query can only reach its own memory's postings, which isolates memories by
construction and spends no work across them. Postings (term, row, tf) are appended to growable
tensors; nothing stored is rewritten on `add`. On the first search after a change, the per-posting
weights of the memories that changed are recomputed in one vectorised pass and laid out in a
term-slot x position CSR matrix, where a row's position is its rank among its memory's live rows and
slots order the terms memory by memory, so the blocks of the memories that did not change are copied
as they were (a server's write to one user costs the next read that user's postings, not the store's). Scoring a batch of queries is then one
segmented scatter (query, term) -> postings into a padded [queries, max docs] float64 matrix (a
Triton kernel on CUDA, see `memfit_gpu.kernels.segmented_scatter`), rounded to float32 once, then one
`topk`; there is no Python loop over queries or memories in the scoring. The sums are exact, so the
scores do not depend on the order of the additions (see bm25_postings._GRID_BITS). `search(kernels="triton")`
scores each question over its own memory only (ragged, no padded block) and keeps a running top-k
per question (`memfit_gpu.kernels.segment_topk`): the same bits.

Storage is compact, so that LongMemEval-M (~2.75M rows, ~130M postings, ~11M terms) fits in host
memory: one global token table (str -> token id, the only Python strings), terms as int arrays
(memory, token id) with a sorted int64 key array for lookups, postings as two int32 columns (term, tf)
in row order with one start offset per row, nothing per posting in Python. `add_texts` tokenises and
maps a chunk of texts to token ids text by text (no token lists for the whole chunk), and the CSR
layout is built in bounded slices of postings (a counting sort by slot), so neither the write path nor
the first search holds a full-size temporary per posting beyond the CSR itself. The layout (its
building, brought up to date memory by memory, and its readers) is index/bm25_postings.py.

`ReferenceBM25` (index/bm25_reference.py) is the readable oracle; both implement
`index.protocols.LexicalIndex`.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import numpy as np
import torch

from memfit_gpu.buffers import GrowableArray, GrowableTensor
from memfit_gpu.devices import is_oom
from memfit_gpu.index.bm25_postings import (
    Layout,
    PostingColumns,
    count_live_df,
    lay_out,
    lucene_idf,
    postings_of,
    query_memory,
    rows_at,
)
from memfit_gpu.index.protocols import (
    as_int_list,
    check_batch,
    check_k,
    check_kernels,
    check_pairs,
    check_term_order,
)
from memfit_gpu.index.tokenize import TOKEN_PATTERN
from memfit_gpu.kernels.segment_topk import padded_topk, segment_topk_triton
from memfit_gpu.kernels.segmented_scatter import segmented_scatter_add, segmented_scatter_add_triton

__all__ = ["BM25Index"]

# Cap on the padded score matrix built per chunk of queries (elements); bounds search memory.
log = logging.getLogger(__name__)
T = TypeVar("T")

_CHUNK_ELEMENTS = 1 << 24
# Cap on the ragged float64 scores of one kernel launch (`search(kernels="triton")`), in elements.
_RAGGED_ELEMENTS = 1 << 25
# The most (query, term) pairs one query may sum: below it every partial sum is exact in float64, in any
# order (the grid of the posting weights, bm25_postings._GRID_BITS).
_MAX_QUERY_PAIRS = 1 << 16
# State format: 2 = a global token list and int term arrays; 1 (older snapshots) = one token string per term.
_STATE_VERSION = 2
_TOKEN_BITS = 32  # a term's lookup key is (memory << _TOKEN_BITS) | token id


def _check_query_pairs(pair_query: torch.Tensor, n_queries: int) -> None:
    if pair_query.numel() <= _MAX_QUERY_PAIRS:
        return
    per_query = torch.bincount(pair_query, minlength=n_queries)
    worst = int(per_query.argmax())
    if int(per_query[worst]) > _MAX_QUERY_PAIRS:
        raise ValueError(f"BM25 search: query {worst} has {int(per_query[worst])} known tokens; exact scoring "
                         f"supports up to {_MAX_QUERY_PAIRS} per query")


class BM25Index:
    """Batched BM25 over many memories; rows are global, sequential and never reused.

    Tensors live on ``device``; the token table (strings) and the term lookup keys stay on the host.
    `add` returns new row ids on the CPU; `search` and `scores` return tensors on ``device``.
    """

    has_kernels = True  # search(kernels="triton"): the ragged path of retrieve.kernels

    def __init__(self, k1: float = 1.5, b: float = 0.75, device: str | torch.device = "cpu"):
        self.k1 = float(k1)
        self.b = float(b)
        self.device = torch.device(device)
        self._num_memories = 0
        # the global token table: token -> token id, and back
        self._token_id: dict[str, int] = {}
        self._token_text: list[str] = []
        # terms: term id -> token id (host), sorted lookup keys (memory << 32 | token) and their term ids
        self._term_token = GrowableArray(np.int32)
        self._key_sorted = np.zeros(0, dtype=np.int64)
        self._key_term = np.zeros(0, dtype=np.int64)
        dev = self.device
        # postings, appended row by row: a row's postings are contiguous, in first-occurrence order
        self._post_term = GrowableTensor(torch.int32, dev)
        self._post_tf = GrowableTensor(torch.int32, dev)
        # per row
        self._row_memory = GrowableTensor(torch.long, dev)
        self._row_len = GrowableTensor(torch.long, dev)
        self._row_post_start = GrowableTensor(torch.long, dev)
        self._deleted = GrowableTensor(torch.bool, dev, fill=False)
        # per term / per memory live statistics, kept current on add and delete
        self._term_memory = GrowableTensor(torch.long, dev)
        self._df = GrowableTensor(torch.long, dev)
        self._mem_docs = GrowableTensor(torch.long, dev)
        self._mem_tokens = GrowableTensor(torch.long, dev)
        # term slots (_prepare): a term's place among its memory's terms, and each memory's term count
        self._term_local = GrowableTensor(torch.long, dev)
        self._mem_terms = GrowableTensor(torch.long, dev)
        self._cache: Layout | None = None  # the search layout (bm25_postings.lay_out)
        self._dirty: set[int] = set()  # memories changed since the cache was laid out
        # every token's rank in str order and its length (feedback_terms), grown with the token table
        self._token_sorted: list[str] = []
        self._token_rank = np.zeros(0, dtype=np.int64)
        self._token_len = np.zeros(0, dtype=np.int64)

    # ------------------------------------------------------------------ vocabulary
    @property
    def num_terms(self) -> int:
        """Terms ever seen: one per (memory, token) pair."""
        return self._term_token.size

    def _token_ids(self, texts_or_tokens: Iterable[Any], tokenized: bool) -> tuple[np.ndarray, np.ndarray]:
        """(token id of every token, token count of every document), new tokens added to the table.

        Documents are tokenised (or read) and mapped one at a time, so no list of token strings for the
        whole batch is ever held."""
        table = self._token_id
        get = table.get
        findall = TOKEN_PATTERN.findall
        ids: list[int | None] = []
        lengths: list[int] = []
        for doc in texts_or_tokens:
            tokens = doc if tokenized else findall(doc.lower())
            mapped = list(map(get, tokens))
            if None in mapped:
                for i, t in enumerate(tokens):
                    if mapped[i] is None:
                        mapped[i] = table.setdefault(t, len(table))
                        if mapped[i] == len(self._token_text):
                            self._token_text.append(t)
            ids.extend(mapped)
            lengths.append(len(mapped))
        return np.asarray(ids, dtype=np.int64), np.asarray(lengths, dtype=np.int64)

    def _lookup(self, mem: np.ndarray, token: np.ndarray) -> np.ndarray:
        """Term id of each (memory, token id) pair; -1 where the memory has never seen the token."""
        keys = (mem.astype(np.int64) << _TOKEN_BITS) | token.astype(np.int64)
        out = np.full(len(keys), -1, dtype=np.int64)
        if not len(self._key_sorted) or not len(keys):
            return out
        at = np.searchsorted(self._key_sorted, keys)
        safe = np.minimum(at, len(self._key_sorted) - 1)
        found = (at < len(self._key_sorted)) & (self._key_sorted[safe] == keys) & (token >= 0)
        out[found] = self._key_term[safe[found]]
        return out

    def _query_terms(self, tokens: Sequence[Sequence[str]], mems: Sequence[int]) -> np.ndarray:
        """Term id (-1: unknown) of every token of every list, flattened in order; nothing is added."""
        get = self._token_id.get
        flat = np.fromiter((get(t, -1) for toks in tokens for t in toks), dtype=np.int64)
        lengths = np.fromiter((len(toks) for toks in tokens), dtype=np.int64, count=len(tokens))
        return self._lookup(np.repeat(np.asarray(mems, dtype=np.int64), lengths), flat)

    def term_id(self, memory_idx: int, token: str) -> int:
        """The term id of `token` in one memory; -1 when that memory has never seen it."""
        tok = self._token_id.get(token, -1)
        return int(self._lookup(np.asarray([memory_idx]), np.asarray([tok]))[0])

    def _new_terms(self, keys: np.ndarray, term_memory: np.ndarray, term_token: np.ndarray) -> None:
        """Register new terms (keys not known yet, in term id order) and merge their lookup keys."""
        first = self.num_terms
        ids = np.arange(first, first + len(keys), dtype=np.int64)
        order = np.argsort(keys, kind="stable")
        at = np.searchsorted(self._key_sorted, keys[order])
        self._key_sorted = np.insert(self._key_sorted, at, keys[order])
        self._key_term = np.insert(self._key_term, at, ids[order])
        self._term_token.extend(term_token)
        memory = torch.from_numpy(term_memory.astype(np.int64))
        self._term_memory.extend(memory)
        # each new term takes its memory's next local place (terms in id order)
        if memory.numel():
            self._mem_terms.ensure(int(memory.max()) + 1)
            held = self._mem_terms.view
            by_memory = torch.sort(memory, stable=True).indices
            count = torch.bincount(memory, minlength=held.numel())
            before = (torch.cumsum(count, 0) - count)[memory[by_memory]]
            local = torch.empty_like(memory)
            local[by_memory] = torch.arange(memory.numel()) - before
            self._term_local.extend(local + held.cpu()[memory])
            held += count.to(held.device)

    # ------------------------------------------------------------------ write
    @property
    def num_rows(self) -> int:
        """Rows ever added (deleted rows included: their numbers are never reused)."""
        return self._row_len.size

    @property
    def num_memories(self) -> int:
        return self._num_memories

    @property
    def num_postings(self) -> int:
        return self._post_term.size

    def add(self, tokens: list[list[str]], memory_idx: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Append one document per token list to its memory; returns the new row ids (CPU LongTensor)."""
        mems = check_batch(tokens, memory_idx, "token lists")
        token_ids, lengths = self._token_ids(tokens, tokenized=True)
        return self._add_ids(token_ids, lengths, mems)

    def add_texts(self, texts: Sequence[str], memory_idx: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """`add(tokenize_many(texts), memory_idx)`, tokenising text by text (no token lists held for the
        whole batch): the write path's call."""
        mems = check_batch(texts, memory_idx, "texts")
        token_ids, lengths = self._token_ids(texts, tokenized=False)
        return self._add_ids(token_ids, lengths, mems)

    def _add_ids(self, token_ids: np.ndarray, lengths: np.ndarray, mems: list[int]) -> torch.Tensor:
        """Append documents given as token ids (flat) and token counts: postings (term, tf) per document
        in first-occurrence order; a (memory, token) pair seen for the first time becomes the next term id,
        in order of first appearance (documents in order, tokens in order)."""
        first_row = self.num_rows
        if not mems:
            return torch.empty(0, dtype=torch.long)
        self._num_memories = max(self._num_memories, max(mems) + 1)
        n_new = len(mems)
        mem_np = np.asarray(mems, dtype=np.int64)
        # distinct (document, token) pairs in first-occurrence order, with their counts
        n_tokens = max(len(self._token_text), 1)
        doc = np.repeat(np.arange(n_new, dtype=np.int64), lengths)
        pair = doc * n_tokens + token_ids
        unique, first_at, tf = np.unique(pair, return_index=True, return_counts=True)
        order = np.argsort(first_at, kind="stable")
        unique, tf = unique[order], tf[order]
        post_doc, post_token = unique // n_tokens, unique % n_tokens
        post_mem = mem_np[post_doc]
        post_term = self._lookup(post_mem, post_token)
        unknown = np.flatnonzero(post_term < 0)
        if len(unknown):
            keys = (post_mem[unknown] << _TOKEN_BITS) | post_token[unknown]
            new_keys, first_seen = np.unique(keys, return_index=True)
            by_appearance = np.argsort(first_seen, kind="stable")
            rank = np.empty(len(new_keys), dtype=np.int64)
            rank[by_appearance] = np.arange(len(new_keys))
            post_term[unknown] = self.num_terms + rank[np.searchsorted(new_keys, keys)]
            appear = new_keys[by_appearance]
            self._new_terms(appear, appear >> _TOKEN_BITS, appear & ((1 << _TOKEN_BITS) - 1))
        counts = np.bincount(post_doc, minlength=n_new)

        rows = torch.arange(first_row, first_row + n_new, dtype=torch.long)
        counts_t = torch.from_numpy(counts.astype(np.int64))
        mem_t = torch.from_numpy(mem_np)
        len_t = torch.from_numpy(lengths.astype(np.int64))
        term_t = torch.from_numpy(post_term)
        starts = self._post_term.size + torch.cumsum(counts_t, 0) - counts_t

        self._row_post_start.extend(starts)
        self._row_memory.extend(mem_t)
        self._row_len.extend(len_t)
        self._deleted.ensure(self.num_rows)
        self._post_term.extend(term_t)
        self._post_tf.extend(torch.from_numpy(tf.astype(np.int32)))
        self._df.ensure(self.num_terms)
        self._mem_docs.ensure(self._num_memories)
        self._mem_tokens.ensure(self._num_memories)
        dev = self.device
        term_d = term_t.to(dev)
        self._df.view.index_add_(0, term_d, torch.ones_like(term_d))
        self._mem_docs.view.index_add_(0, mem_t.to(dev), torch.ones_like(mem_t, device=dev))
        self._mem_tokens.view.index_add_(0, mem_t.to(dev), len_t.to(dev))
        self._dirty.update(mems)
        return rows

    def delete(self, rows: Sequence[int] | torch.Tensor) -> None:
        """Tombstone rows: they leave results and their memory's N, df and avgdl. Repeats are no-ops."""
        row_list = as_int_list(rows)
        bad = [r for r in row_list if not 0 <= r < self.num_rows]
        if bad:
            raise IndexError(f"BM25 delete: row {bad[0]} does not exist (rows 0..{self.num_rows - 1})")
        if not row_list:
            return
        dev = self.device
        row_t = torch.unique(torch.tensor(row_list, dtype=torch.long, device=dev))
        row_t = row_t[~self._deleted.view[row_t]]
        if row_t.numel() == 0:
            return
        terms = self._post_term.view[postings_of(self._row_post_start.view, self._post_term.size, row_t)[1]].long()
        self._df.view.index_add_(0, terms, torch.full_like(terms, -1))
        mem_t = self._row_memory.view[row_t]
        self._mem_docs.view.index_add_(0, mem_t, torch.full_like(mem_t, -1))
        self._mem_tokens.view.index_add_(0, mem_t, -self._row_len.view[row_t])
        self._deleted.view[row_t] = True
        self._dirty.update(torch.unique(mem_t).tolist())

    # ------------------------------------------------------------------ statistics
    def _idf_of_terms(self, df: torch.Tensor, mem: torch.Tensor) -> torch.Tensor:
        return lucene_idf(df, self._mem_docs.view[mem])

    def idf(self, tokens: list[list[str]], memory_idx: Sequence[int] | torch.Tensor) -> list[list[float]]:
        """idf of arbitrary tokens within each list's memory (a token the memory lacks has df = 0)."""
        mems = check_batch(tokens, memory_idx, "token lists")
        flat_terms = self._query_terms(tokens, mems).tolist()
        flat_mems = [m for toks, m in zip(tokens, mems, strict=True) for _ in toks]
        if not flat_terms:
            return [[] for _ in tokens]
        dev = self.device
        terms = torch.tensor(flat_terms, dtype=torch.long, device=dev)
        mem_t = torch.tensor(flat_mems, dtype=torch.long, device=dev)
        known = terms >= 0
        df = torch.zeros_like(terms)
        df[known] = self._df.view[terms[known]]
        # memories never seen have N = 0
        self._mem_docs.ensure(max(flat_mems) + 1)
        self._mem_tokens.ensure(max(flat_mems) + 1)
        values = self._idf_of_terms(df, mem_t).tolist()
        out: list[list[float]] = []
        offset = 0
        for toks in tokens:
            out.append(values[offset : offset + len(toks)])
            offset += len(toks)
        return out

    def memory_stats(self, memory_idx: int) -> tuple[int, float]:
        """(live docs N, avgdl) of one memory."""
        if memory_idx >= self._mem_docs.size:
            return 0, 0.0
        n_docs = int(self._mem_docs.view[memory_idx])
        n_tokens = int(self._mem_tokens.view[memory_idx])
        return n_docs, (n_tokens / n_docs if n_docs else 0.0)

    def doc_tokens(self, rows: Sequence[int] | torch.Tensor) -> list[list[str]]:
        """Distinct tokens of each row, in first-occurrence order (tombstoned rows keep theirs)."""
        row_list = as_int_list(rows)
        bad = [r for r in row_list if not 0 <= r < self.num_rows]
        if bad:
            raise IndexError(f"BM25 doc_tokens: row {bad[0]} does not exist (rows 0..{self.num_rows - 1})")
        starts = self._row_post_start.view
        n_post = self._post_term.size
        terms = self._post_term.view
        term_token, token_text = self._term_token.view, self._token_text
        out = []
        for r in row_list:
            end = int(starts[r + 1]) if r + 1 < self.num_rows else n_post
            ids = terms[int(starts[r]) : end].cpu().numpy()
            out.append([token_text[t] for t in term_token[ids].tolist()])
        return out

    def _token_order(self) -> tuple[np.ndarray, np.ndarray]:
        """(rank in Python's str order, length in characters) of every token id, kept up to date as the
        token table grows: new tokens are merged into the sorted list (bisect), so a write costs the next
        read its new tokens, not a sort of the whole vocabulary."""
        texts = self._token_text
        n_old = len(self._token_rank)
        if n_old == len(texts):
            return self._token_rank, self._token_len
        lengths = np.fromiter(map(len, texts[n_old:]), dtype=np.int64, count=len(texts) - n_old)
        self._token_len = np.concatenate([self._token_len, lengths])
        if (len(texts) - n_old) * 8 > n_old:  # many new tokens (or a loaded index): one sort
            order = sorted(range(len(texts)), key=texts.__getitem__)
            self._token_sorted = [texts[i] for i in order]
            self._token_rank = np.empty(len(texts), dtype=np.int64)
            self._token_rank[order] = np.arange(len(texts))
            return self._token_rank, self._token_len
        fresh = sorted(range(n_old, len(texts)), key=texts.__getitem__)
        at = np.fromiter((bisect.bisect_left(self._token_sorted, texts[i]) for i in fresh), dtype=np.int64,
                         count=len(fresh))
        rank = np.empty(len(texts), dtype=np.int64)
        # an old token moves up by the new ones that sort before it; new token j lands after the j before it
        rank[:n_old] = self._token_rank + np.searchsorted(at, self._token_rank, side="right")
        final = at + np.arange(len(fresh))
        rank[fresh] = final
        for i, place in zip(fresh, final.tolist(), strict=True):
            self._token_sorted.insert(place, texts[i])
        self._token_rank = rank
        return self._token_rank, self._token_len

    def feedback_terms(self, rows: torch.Tensor, min_chars: int, terms: int,
                       term_order: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Per query, the first `terms` distinct terms of its rows [Q, D] (-1 pads) with at least
        `min_chars` characters, in `term_order`, read from the postings in one pass (tombstoned rows
        keep theirs): "alphabetical" by token text; "idf" by idf descending, ties by token text (inside
        one memory idf falls strictly as df rises, so the order is (live df ascending, token) and needs
        no float). A query's terms all belong to its memory, so only tokens are ever compared.

        Returns (query index, term id) pairs, query by query, each query's terms in that order: the
        queries already encoded for `search_encoded`. The rows must belong to their query's memory (a
        term id is a (memory, token) pair). PRF (retrieve/prf.py) asks it for its expansion terms."""
        check_term_order(term_order)
        dev = self.device
        rows = torch.as_tensor(rows, dtype=torch.long).to(dev)
        owner, slot = torch.nonzero(rows >= 0, as_tuple=True)
        picked = rows[owner, slot]
        empty = torch.zeros(0, dtype=torch.long, device=dev)
        if picked.numel() == 0 or terms <= 0:
            return empty, empty
        if int(picked.max()) >= self.num_rows:
            raise IndexError(f"BM25 feedback_terms: row {int(picked.max())} does not exist (rows 0..{self.num_rows - 1})")
        entry, postings = postings_of(self._row_post_start.view, self._post_term.size, picked)
        # the candidates are few (a question's feedback rows): ordered on the host
        term = self._post_term.view[postings].long().cpu().numpy()
        query = owner[entry].cpu().numpy()
        token_rank, token_len = self._token_order()
        token = self._term_token.view[term]
        keep = token_len[token] >= min_chars
        term, query, token = term[keep], query[keep], token[keep]
        if term_order == "alphabetical":
            keys = (token_rank[token], query)
        else:
            keys = (token_rank[token], self._df.view[torch.from_numpy(term).to(dev)].cpu().numpy(), query)
        order = np.lexsort(keys)
        term, query = term[order], query[order]
        # a term read from several rows of one query is kept once (equal pairs are adjacent now)
        first = np.ones(len(term), dtype=bool)
        first[1:] = (term[1:] != term[:-1]) | (query[1:] != query[:-1])
        term, query = term[first], query[first]
        counts = np.bincount(query, minlength=rows.shape[0])
        place = np.arange(len(query)) - (np.cumsum(counts) - counts)[query]
        take = place < terms
        return torch.from_numpy(query[take]).to(dev), torch.from_numpy(term[take]).to(dev)

    def term_tokens(self, term_ids: torch.Tensor) -> list[str]:
        """The token text of each term id."""
        ids = term_ids.reshape(-1).cpu().numpy()
        texts = self._token_text
        return [texts[t] for t in self._term_token.view[ids].tolist()]

    # ------------------------------------------------------------------ search
    def _prepare(self) -> Layout:
        """The search layout (bm25_postings.lay_out), kept until the next change and then brought up to
        date for the memories that changed only."""
        if self._cache is not None and not self._dirty:
            return self._cache
        for buf in (self._mem_docs, self._mem_tokens, self._mem_terms):
            buf.ensure(self._num_memories)
        columns = PostingColumns(
            post_term=self._post_term.view, post_tf=self._post_tf.view, row_post_start=self._row_post_start.view,
            row_memory=self._row_memory.view, row_len=self._row_len.view, deleted=self._deleted.view,
            term_memory=self._term_memory.view, term_local=self._term_local.view, df=self._df.view,
            mem_docs=self._mem_docs.view, mem_tokens=self._mem_tokens.view, mem_terms=self._mem_terms.view,
            num_memories=self._num_memories, k1=self.k1, b=self.b,
        )
        self._cache = lay_out(self._cache, self._dirty, columns)
        self._dirty.clear()
        return self._cache

    def _encode_queries(self, queries: list[list[str]], mems: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(query index, term id) per query token the query's memory knows; repeats kept (each counts)."""
        lengths = torch.tensor([len(t) for t in queries], dtype=torch.long)
        pair_query = torch.repeat_interleave(torch.arange(len(queries)), lengths)
        pair_term = torch.from_numpy(self._query_terms(queries, mems))
        known = pair_term >= 0
        return pair_query[known].to(self.device), pair_term[known].to(self.device)

    def _score_block(
        self, cache: Layout, pair_query: torch.Tensor, pair_term: torch.Tensor, n_queries: int, width: int
    ) -> torch.Tensor:
        """Scores [n_queries, width] float32: exact float64 sums (see _GRID_BITS), rounded once."""
        slot = cache["dense_slot"][pair_term]
        dense = slot >= 0
        if bool(dense.any()):
            # (query, dense term) counts times the dense rows: one sparse x dense product, no [pairs, width]
            # copy of the rows; a repeated query token counts twice (its count is 2)
            weights = cache["dense_weight"]
            counts = torch.sparse_coo_tensor(
                torch.stack([pair_query[dense], slot[dense]]),
                torch.ones(int(dense.sum()), dtype=torch.float64, device=self.device),
                (n_queries, weights.shape[0]), check_invariants=False,
            )
            acc = torch.sparse.mm(counts, weights[:, :width] if width < weights.shape[1] else weights).contiguous()
            pair_query, pair_term = pair_query[~dense], pair_term[~dense]
        else:
            acc = torch.zeros((n_queries, width), dtype=torch.float64, device=self.device)
        segmented_scatter_add(acc.view(-1), pair_query * width, cache["slot"][pair_term], cache["term_ptr"],
                              cache["post_col"], cache["post_weight"])
        return acc.float()

    def scores(
        self, queries: list[list[str]], memory_idx: Sequence[int] | torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Full score vector of each query over its memory's live rows, in row order.

        Returns (scores [Q, D] float32, rows [Q, D] long) with D the most live docs of any queried
        memory; columns past a query's own memory are padded with score 0 and row -1.
        """
        mems = check_batch(queries, memory_idx, "queries")
        cache = self._prepare()
        if not mems:
            return torch.zeros((0, 0), device=self.device), torch.zeros((0, 0), dtype=torch.long, device=self.device)
        # the row layout depends only on the memory: build it once per distinct memory, then copy rows
        memories, which = torch.unique(torch.tensor(mems, dtype=torch.long, device=self.device), return_inverse=True)
        mem_docs, mem_start = query_memory(cache, memories)
        width = int(mem_docs.max())
        pair_query, pair_term = self._encode_queries(queries, mems)
        out = self._score_block(cache, pair_query, pair_term, len(queries), width)
        cols = torch.arange(width, device=self.device).expand(memories.numel(), width)
        return out, rows_at(cache, mem_docs, mem_start, cols).index_select(0, which)

    def search(
        self, queries: list[list[str]], memory_idx: Sequence[int] | torch.Tensor, k: int, kernels: str = "torch"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k rows of each query's memory with score > 0: (scores [Q,k] float32, rows [Q,k] long).

        Sorted by score descending, then row ascending; missing slots hold score 0 and row -1.
        kernels: "torch" (padded blocks, any device) or "triton" (ragged per-question scores and a
        running top-k, `memfit_gpu.kernels`; CUDA tensors, or CPU ones under TRITON_INTERPRET=1).
        Both give the same bits.
        """
        k = check_k(k)
        check_kernels(kernels)
        mems = check_batch(queries, memory_idx, "queries")
        if not mems:
            return self._search_pairs(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), mems, k)
        pair_query, pair_term = self._encode_queries(queries, mems)
        return self._on_cpu_after_oom(
            lambda backend: self._search_pairs(pair_query, pair_term, mems, k, backend),
            kernels)

    def search_encoded(
        self, pair_query: torch.Tensor, pair_term: torch.Tensor, memory_idx: Sequence[int] | torch.Tensor, k: int,
        kernels: str = "torch",
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`search` for queries given as (query index, term id) pairs, query indexes ascending (as
        `feedback_terms` returns them); a query with no pair scores nothing. Same results as `search`
        on the term tokens in the same order."""
        k = check_k(k)
        check_kernels(kernels)
        mems = as_int_list(memory_idx)
        pair_query = torch.as_tensor(pair_query, dtype=torch.long).to(self.device)
        pair_term = torch.as_tensor(pair_term, dtype=torch.long).to(self.device)
        check_pairs(pair_query, pair_term, len(mems), self.num_terms)
        if pair_query.numel():
            mem_t = torch.tensor(mems, dtype=torch.long, device=self.device)
            if bool((self._term_memory.view[pair_term] != mem_t[pair_query]).any()):
                raise ValueError("BM25 search_encoded: a term id belongs to another memory than its query")
        return self._on_cpu_after_oom(
            lambda backend: self._search_pairs(pair_query, pair_term, mems, k, backend),
            kernels)

    def _on_cpu_after_oom(self, search: Callable[[str], T], kernels: str) -> T:
        """Run `search(kernels)`; when the GPU runs out of memory even for one question at a time (the
        torch path halves its blocks first), move the index to the CPU for good, loudly, and search
        there with the torch path: same bits (the sums are order-independent and both paths agree),
        slower, instead of a run that dies."""
        try:
            return search(kernels)
        except Exception as exc:
            if self.device.type != "cuda" or not is_oom(exc):
                raise
            where = self.device
            self._cache = None
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            log.warning("BM25Index: out of memory on %s (%s): the index moves to the CPU for the rest of this "
                        "process (index.device=cpu starts it there; memfit plan shows what each GPU holds)",
                        where, str(exc).splitlines()[0][:200])
            self.to("cpu")
            return search("torch")

    def _search_pairs(
        self, pair_query: torch.Tensor, pair_term: torch.Tensor, mems: list[int], k: int, kernels: str = "torch"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n_queries = len(mems)
        dev = self.device
        pair_query, pair_term = pair_query.to(dev), pair_term.to(dev)  # after a move to the CPU (OOM)
        top_scores = torch.zeros((n_queries, k), dtype=torch.float32, device=dev)
        top_rows = torch.full((n_queries, k), -1, dtype=torch.long, device=dev)
        if n_queries == 0:
            return top_scores, top_rows
        _check_query_pairs(pair_query, n_queries)
        cache = self._prepare()
        q_docs, q_start = query_memory(cache, torch.tensor(mems, dtype=torch.long, device=dev))
        width = int(q_docs.max())
        if width == 0:
            return top_scores, top_rows
        if kernels == "triton":
            return self._search_ragged(cache, pair_query, pair_term, q_docs, q_start, k)
        kk = min(k, width)
        chunk = max(1, _CHUNK_ELEMENTS // width)
        q0 = 0
        while q0 < n_queries:
            q1 = min(q0 + chunk, n_queries)
            lo, hi = torch.searchsorted(pair_query, torch.tensor([q0, q1], device=dev)).tolist()
            try:
                block = self._score_block(cache, pair_query[lo:hi] - q0, pair_term[lo:hi], q1 - q0, width)
                vals, cols = padded_topk(block, kk)
            except Exception as exc:
                if not is_oom(exc) or q1 - q0 == 1:
                    raise
                chunk = (q1 - q0) // 2  # a smaller block of questions, same bits (each question's row is its own)
                log.warning("BM25Index: out of memory on %s scoring %d questions at once: %d at a time now",
                            dev, q1 - q0, chunk)
                continue
            rows = rows_at(cache, q_docs[q0:q1], q_start[q0:q1], cols)
            hit = vals > 0
            top_scores[q0:q1, :kk] = torch.where(hit, vals, 0.0)
            top_rows[q0:q1, :kk] = torch.where(hit, rows, -1)
            q0 = q1
        return top_scores, top_rows

    def _search_ragged(
        self, cache: Layout, pair_query: torch.Tensor, pair_term: torch.Tensor, q_docs: torch.Tensor,
        q_start: torch.Tensor, k: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The Triton path: each question's scores over its own memory only (no padded block), then a
        running top-k per question. Chunked over questions to bound the float64 scores."""
        dev = self.device
        n_queries = q_docs.numel()
        seg_end = torch.cumsum(q_docs, 0)
        # question chunks whose segments fit _RAGGED_ELEMENTS (a question larger than that goes alone)
        cuts = [0]
        while cuts[-1] < n_queries:
            used = int(seg_end[cuts[-1] - 1]) if cuts[-1] else 0
            cuts.append(max(cuts[-1] + 1, int(torch.searchsorted(seg_end, used + _RAGGED_ELEMENTS, right=True))))
        bounds = torch.searchsorted(pair_query, torch.tensor(cuts, device=dev)).tolist()
        parts = []
        for i in range(len(cuts) - 1):
            q0, q1 = cuts[i], min(cuts[i + 1], n_queries)
            seg_ptr = torch.zeros(q1 - q0 + 1, dtype=torch.long, device=dev)
            seg_ptr[1:] = torch.cumsum(q_docs[q0:q1], 0)
            acc = torch.zeros(int(seg_ptr[-1]), dtype=torch.float64, device=dev)
            lo, hi = bounds[i], bounds[i + 1]
            segmented_scatter_add_triton(acc, seg_ptr.index_select(0, pair_query[lo:hi] - q0),
                                         cache["slot"][pair_term[lo:hi]], cache["term_ptr"], cache["post_col"],
                                         cache["post_weight"])
            parts.append(segment_topk_triton(acc, seg_ptr, q_start[q0:q1], cache["rows_by_memory"], k))
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

    # ------------------------------------------------------------------ persistence
    def trim(self) -> None:
        """Drop the spare capacity of every buffer (then `state_dict` shares storage with nothing else)."""
        for buf in self._buffers():
            buf.trim()

    def state_dict(self) -> dict[str, Any]:
        """Tensors (CPU) + the token list; `load_state_dict` of it scores identically.

        The big tensors are views of the index's own (trimmed) buffers on a CPU index, not copies:
        treat them as read-only."""
        self.trim()

        def out(buf: GrowableTensor) -> torch.Tensor:
            return buf.view if buf.view.device.type == "cpu" else buf.view.cpu()

        return {
            "version": _STATE_VERSION,
            "k1": self.k1,
            "b": self.b,
            "num_memories": self._num_memories,
            "tokens": list(self._token_text),
            "term_token": torch.from_numpy(self._term_token.view.copy()),
            "term_memory": out(self._term_memory),
            "post_term": out(self._post_term),
            "post_tf": out(self._post_tf),
            "row_memory": out(self._row_memory),
            "row_len": out(self._row_len),
            "row_post_start": out(self._row_post_start),
            "deleted": out(self._deleted),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        version = state.get("version")
        if version not in (1, _STATE_VERSION):
            raise ValueError(f"BM25Index state: version {version!r} is not 1 or {_STATE_VERSION}")
        term_memory = state["term_memory"].long().cpu()
        fresh = BM25Index(k1=state["k1"], b=state["b"], device=self.device)
        if version == 1:  # one token string per term
            terms: list[str] = list(state["terms"])
            if len(terms) != term_memory.numel():
                raise ValueError(f"BM25Index state: {len(terms)} terms but {term_memory.numel()} term_memory entries")
            table = fresh._token_id
            term_token = np.fromiter((table.setdefault(t, len(table)) for t in terms), dtype=np.int64, count=len(terms))
            fresh._token_text = list(table)
        else:
            fresh._token_text = list(state["tokens"])
            fresh._token_id = {t: i for i, t in enumerate(fresh._token_text)}
            term_token = state["term_token"].long().cpu().numpy()
            if len(term_token) != term_memory.numel():
                raise ValueError(f"BM25Index state: {len(term_token)} term tokens but {term_memory.numel()} "
                                 f"term_memory entries")
        fresh._num_memories = int(state["num_memories"])
        keys = (term_memory.numpy() << _TOKEN_BITS) | term_token
        fresh._new_terms(keys, term_memory.numpy(), term_token)
        fresh._post_term.extend(state["post_term"])
        fresh._post_tf.extend(state["post_tf"])
        fresh._row_memory.extend(state["row_memory"].long())
        fresh._row_len.extend(state["row_len"].long())
        fresh._row_post_start.extend(state["row_post_start"].long())
        fresh._deleted.extend(state["deleted"].bool())
        # live statistics are integers, recomputed exactly from the live rows and postings
        live = ~fresh._deleted.view
        fresh._df.ensure(fresh.num_terms)
        count_live_df(fresh._df.view, fresh._post_term.view, fresh._row_post_start.view, live)
        fresh._mem_docs.ensure(fresh._num_memories)
        fresh._mem_tokens.ensure(fresh._num_memories)
        live_mem = fresh._row_memory.view[live]
        fresh._mem_docs.view.index_add_(0, live_mem, torch.ones_like(live_mem))
        fresh._mem_tokens.view.index_add_(0, live_mem, fresh._row_len.view[live])
        self.__dict__.update(fresh.__dict__)

    def _buffers(self) -> tuple[GrowableTensor, ...]:
        return (self._post_term, self._post_tf, self._row_memory, self._row_len, self._row_post_start, self._deleted,
                self._term_memory, self._df, self._mem_docs, self._mem_tokens, self._term_local, self._mem_terms)

    def nbytes(self) -> dict[str, int]:
        """Bytes held by the postings, the per-row and per-term columns, and the search cache."""
        cache = self._cache or {}
        terms = self._term_token.view.nbytes + self._key_sorted.nbytes + self._key_term.nbytes
        terms += sum(b.view.numel() * b.view.element_size() for b in (self._term_memory, self._df))
        return {
            "postings": sum(b.view.numel() * b.view.element_size() for b in (self._post_term, self._post_tf)),
            "rows": sum(b.view.numel() * b.view.element_size()
                        for b in (self._row_memory, self._row_len, self._row_post_start, self._deleted)),
            "terms": int(terms),
            "search_cache": sum(t.numel() * t.element_size() for t in cache.values() if isinstance(t, torch.Tensor)),
        }

    def to(self, device: str | torch.device) -> BM25Index:
        """Move every tensor to ``device`` (in place; returns self)."""
        self.device = torch.device(device)
        for buf in self._buffers():
            buf.to(self.device)
        self._cache = None
        return self
