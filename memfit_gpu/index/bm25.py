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
weights are recomputed in one vectorised pass and laid out as a term x position CSR matrix, where
a row's position is its rank among its memory's live rows. Scoring a batch of queries is then one
segmented scatter (query, term) -> postings into a padded [queries, max docs] float64 matrix (a
Triton kernel on CUDA, see `memfit_gpu.kernels.segmented_scatter`), rounded to float32 once, then one
`topk`; there is no Python loop over queries or memories in the scoring. The sums are exact, so the
scores do not depend on the order of the additions (see _GRID_BITS). `search(kernels="triton")`
scores each question over its own memory only (ragged, no padded block) and keeps a running top-k
per question (`memfit_gpu.kernels.segment_topk`): the same bits.

`ReferenceBM25` (index/bm25_reference.py) is the readable oracle; both implement
`index.protocols.LexicalIndex`.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch

from memfit_gpu.buffers import GrowableTensor
from memfit_gpu.index.protocols import (
    as_int_list,
    check_batch,
    check_k,
    check_kernels,
    check_pairs,
    check_term_order,
)
from memfit_gpu.kernels.segment_topk import padded_topk, segment_topk_triton
from memfit_gpu.kernels.segmented_scatter import segmented_scatter_add, segmented_scatter_add_triton

__all__ = ["BM25Index"]

# Cap on the padded score matrix built per chunk of queries (elements); bounds search memory.
_CHUNK_ELEMENTS = 1 << 24
# Cap on the ragged float64 scores of one kernel launch (`search(kernels="triton")`), in elements.
_RAGGED_ELEMENTS = 1 << 25
# A term whose live df reaches 1/_DENSE_FACTOR of the widest memory is scored as a dense row.
_DENSE_FACTOR = 8
# Exact, order-independent sums (why CPU and GPU rank identically, run after run). Every posting
# weight is a float32 on the grid 2^-_GRID_BITS (`_on_grid`); weights are < 2^5 (idf <= ln(1 + N / 1.5)
# < 21.1 for N < 2^31 and tf / (tf + norm) <= 1); a query sums at most _MAX_QUERY_PAIRS of them. So
# every partial sum is a multiple of 2^-32 below 2^(16 + 5) = 2^(53 - 32): exactly representable in
# float64. Float64 accumulation is then exact in any order (index_add_, sparse.mm, GPU atomics), and
# the one rounding to float32 at the end gives the same bits everywhere. The grid changes no weight
# >= 2^-9 (their float32 spacing is already >= 2^-32); smaller ones (terms in nearly every document)
# move by < 2^-33, far below the float32 rounding of any score they join.
_GRID_BITS = 32
_MAX_QUERY_PAIRS = 1 << 16
_STATE_VERSION = 1


def _on_grid(weight: torch.Tensor) -> torch.Tensor:
    """float32 weights rounded (half to even) to multiples of 2^-_GRID_BITS; still float32, exactly:
    a weight below 2^-9 becomes m x 2^-32 with m < 2^23, and larger ones are unchanged."""
    scale = float(2**_GRID_BITS)
    return (weight.double() * scale).round_().div_(scale).float()


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

    Tensors live on ``device``; the vocabulary (strings) stays in Python dicts, one per memory.
    `add` returns new row ids on the CPU; `search` and `scores` return tensors on ``device``.
    """

    has_kernels = True  # search(kernels="triton"): the ragged path of retrieve.kernels

    def __init__(self, k1: float = 1.5, b: float = 0.75, device: str | torch.device = "cpu"):
        self.k1 = float(k1)
        self.b = float(b)
        self.device = torch.device(device)
        self._vocab: list[dict[str, int]] = []  # per memory: token -> global term id
        self._term_token: list[str] = []  # term id -> token
        dev = self.device
        # postings, appended row by row: a row's postings are contiguous, in first-occurrence order
        self._post_term = GrowableTensor(torch.long, dev)
        self._post_row = GrowableTensor(torch.long, dev)
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
        self._cache: dict[str, torch.Tensor] | None = None

    # ------------------------------------------------------------------ write
    @property
    def num_rows(self) -> int:
        """Rows ever added (deleted rows included: their numbers are never reused)."""
        return self._row_len.size

    @property
    def num_memories(self) -> int:
        return len(self._vocab)

    def add(self, tokens: list[list[str]], memory_idx: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Append one document per token list to its memory; returns the new row ids (CPU LongTensor)."""
        mems = check_batch(tokens, memory_idx, "token lists")
        first_row = self.num_rows
        if not mems:
            return torch.empty(0, dtype=torch.long)
        if max(mems) >= len(self._vocab):
            self._vocab.extend({} for _ in range(max(mems) + 1 - len(self._vocab)))
        term_memory_new: list[int] = []
        post_term: list[int] = []
        post_tf: list[int] = []
        post_count: list[int] = []
        for doc_tokens, mem in zip(tokens, mems, strict=True):
            vocab = self._vocab[mem]
            counts = Counter(doc_tokens)
            for token, tf in counts.items():
                term = vocab.get(token)
                if term is None:
                    term = len(self._term_token)
                    vocab[token] = term
                    self._term_token.append(token)
                    term_memory_new.append(mem)
                post_term.append(term)
                post_tf.append(tf)
            post_count.append(len(counts))
        n_new = len(mems)
        rows = torch.arange(first_row, first_row + n_new, dtype=torch.long)
        counts_t = torch.tensor(post_count, dtype=torch.long)
        mem_t = torch.tensor(mems, dtype=torch.long)
        len_t = torch.tensor([len(t) for t in tokens], dtype=torch.long)
        term_t = torch.tensor(post_term, dtype=torch.long)
        starts = self._post_term.size + torch.cumsum(counts_t, 0) - counts_t

        self._row_post_start.extend(starts)
        self._row_memory.extend(mem_t)
        self._row_len.extend(len_t)
        self._deleted.ensure(self.num_rows)
        self._post_term.extend(term_t)
        self._post_row.extend(torch.repeat_interleave(rows, counts_t))
        self._post_tf.extend(torch.tensor(post_tf, dtype=torch.int32))
        self._term_memory.extend(torch.tensor(term_memory_new, dtype=torch.long))
        self._df.ensure(len(self._term_token))
        self._mem_docs.ensure(len(self._vocab))
        self._mem_tokens.ensure(len(self._vocab))
        dev = self.device
        self._df.view.index_add_(0, term_t.to(dev), torch.ones_like(term_t, device=dev))
        self._mem_docs.view.index_add_(0, mem_t.to(dev), torch.ones_like(mem_t, device=dev))
        self._mem_tokens.view.index_add_(0, mem_t.to(dev), len_t.to(dev))
        self._cache = None
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
        terms = self._post_term.view[self._postings_of(row_t)[1]]
        self._df.view.index_add_(0, terms, torch.full_like(terms, -1))
        mem_t = self._row_memory.view[row_t]
        self._mem_docs.view.index_add_(0, mem_t, torch.full_like(mem_t, -1))
        self._mem_tokens.view.index_add_(0, mem_t, -self._row_len.view[row_t])
        self._deleted.view[row_t] = True
        self._cache = None

    def _postings_of(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(position in `rows`, posting index) of every posting of the given rows, row by row."""
        dev = self.device
        starts = self._row_post_start.view[rows]
        lengths = self._post_end()[rows] - starts
        total = int(lengths.sum())
        first = torch.cumsum(lengths, 0) - lengths
        entry = torch.repeat_interleave(torch.arange(rows.numel(), device=dev), lengths, output_size=total)
        return entry, starts[entry] + torch.arange(total, device=dev) - first[entry]

    def _post_end(self) -> torch.Tensor:
        starts = self._row_post_start.view
        tail = torch.tensor([self._post_term.size], dtype=torch.long, device=starts.device)
        return torch.cat([starts[1:], tail])

    # ------------------------------------------------------------------ statistics
    def _idf_of_terms(self, df: torch.Tensor, mem: torch.Tensor) -> torch.Tensor:
        n_docs = self._mem_docs.view[mem].double()
        df = df.double()
        return torch.log1p((n_docs - df + 0.5) / (df + 0.5))

    def idf(self, tokens: list[list[str]], memory_idx: Sequence[int] | torch.Tensor) -> list[list[float]]:
        """idf of arbitrary tokens within each list's memory (a token the memory lacks has df = 0)."""
        mems = check_batch(tokens, memory_idx, "token lists")
        flat_terms = [
            (self._vocab[m].get(t, -1) if m < len(self._vocab) else -1)
            for toks, m in zip(tokens, mems, strict=True)
            for t in toks
        ]
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
        starts = self._row_post_start.view.tolist()
        n_post = self._post_term.size
        terms = self._post_term.view
        out = []
        for r in row_list:
            end = starts[r + 1] if r + 1 < len(starts) else n_post
            out.append([self._term_token[t] for t in terms[starts[r] : end].tolist()])
        return out

    def _term_orders(self) -> dict[str, torch.Tensor]:
        """Every term id in each `feedback_terms` order, cached with the scoring layout.

        "alphabetical": by token text. "idf": idf descending, ties by token text; inside one memory
        idf falls strictly as df rises, so the order is (live df ascending, token) and needs no float."""
        cache = self._prepare()
        orders = cache.get("term_orders")
        if orders is None:
            dev = self.device
            tokens = self._term_token
            alphabetical = torch.tensor(sorted(range(len(tokens)), key=tokens.__getitem__), dtype=torch.long,
                                        device=dev)
            by_idf = alphabetical[torch.argsort(self._df.view[alphabetical], stable=True)]
            orders = {"alphabetical": alphabetical, "idf": by_idf,
                      "length": torch.tensor([len(t) for t in tokens], dtype=torch.long, device=dev)}
            for name in ("alphabetical", "idf"):
                rank = torch.empty_like(orders[name])
                rank[orders[name]] = torch.arange(rank.numel(), device=dev)
                orders["rank_" + name] = rank
            cache["term_orders"] = orders
        return orders

    def feedback_terms(self, rows: torch.Tensor, min_chars: int, terms: int,
                       term_order: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Per query, the first `terms` distinct terms of its rows [Q, D] (-1 pads) with at least
        `min_chars` characters, in `term_order` (see `_term_orders`), read from the postings in one
        tensor pass (tombstoned rows keep theirs).

        Returns (query index, term id) pairs, query by query, each query's terms in that order: the
        queries already encoded for `search_encoded`. The rows must belong to their query's memory (a
        term id is a (memory, token) pair). PRF (retrieve/prf.py) asks it for its expansion terms."""
        check_term_order(term_order)
        dev = self.device
        rows = torch.as_tensor(rows, dtype=torch.long).to(dev)
        owner, slot = torch.nonzero(rows >= 0, as_tuple=True)
        picked = rows[owner, slot]
        if picked.numel() == 0 or terms <= 0:
            empty = torch.zeros(0, dtype=torch.long, device=dev)
            return empty, empty
        if int(picked.max()) >= self.num_rows:
            raise IndexError(f"BM25 feedback_terms: row {int(picked.max())} does not exist (rows 0..{self.num_rows - 1})")
        entry, postings = self._postings_of(picked)
        term = self._post_term.view[postings]
        query = owner[entry]
        orders = self._term_orders()
        keep = orders["length"][term] >= min_chars
        n_terms = len(self._term_token)
        # one sorted unique over (query, rank) dedups each query's terms and puts them in order
        key = torch.unique(query[keep] * n_terms + orders["rank_" + term_order][term[keep]])
        query, rank = key // n_terms, key % n_terms
        counts = torch.bincount(query, minlength=rows.shape[0])
        place = torch.arange(key.numel(), device=dev) - (torch.cumsum(counts, 0) - counts)[query]
        take = place < terms
        return query[take], orders[term_order][rank[take]]

    def term_tokens(self, term_ids: torch.Tensor) -> list[str]:
        """The token text of each term id."""
        tokens = self._term_token
        return [tokens[t] for t in term_ids.tolist()]

    # ------------------------------------------------------------------ search
    def _prepare(self) -> dict[str, torch.Tensor]:
        """Per-posting lucene weights as a term x position CSR matrix, cached until the next change."""
        if self._cache is not None:
            return self._cache
        dev = self.device
        n_mem = len(self._vocab)
        self._mem_docs.ensure(n_mem)
        self._mem_tokens.ensure(n_mem)
        n_terms = len(self._term_token)
        live = ~self._deleted.view
        row_memory = self._row_memory.view
        live_rows = torch.nonzero(live).flatten()
        # rows grouped by memory, row order kept inside each: position = rank among the memory's live rows
        order = torch.sort(row_memory[live_rows], stable=True).indices
        rows_by_memory = live_rows[order]
        mem_docs = self._mem_docs.view
        mem_start = torch.cumsum(mem_docs, 0) - mem_docs
        position = torch.full((self.num_rows,), -1, dtype=torch.long, device=dev)
        position[rows_by_memory] = (
            torch.arange(rows_by_memory.numel(), device=dev) - mem_start[row_memory[rows_by_memory]]
        )

        # live postings in term order (row order inside a term): the CSR layout
        post_row = self._post_row.view
        term = self._post_term.view
        keep = None
        if self._deleted.size and bool(self._deleted.view.any()):
            keep = torch.nonzero(live.index_select(0, post_row)).flatten()
            term = term.index_select(0, keep)
        term, order = torch.sort(term, stable=True)
        perm = order if keep is None else keep.index_select(0, order)
        row = post_row.index_select(0, perm)
        tf = self._post_tf.view.index_select(0, perm).double()
        term_ptr = torch.zeros(n_terms + 1, dtype=torch.long, device=dev)
        term_ptr[1:] = torch.cumsum(torch.bincount(term, minlength=n_terms), 0)

        # lucene factors per term (idf) and per row (length norm), then one gather each per posting;
        # avgdl > 0 whenever the memory has a posting, so the division is safe where it is used
        term_idf = self._idf_of_terms(self._df.view, self._term_memory.view)
        avgdl = self._mem_tokens.view.double() / mem_docs.clamp(min=1).double()
        row_norm = self.k1 * (1.0 - self.b + self.b * self._row_len.view.double() / avgdl.index_select(0, row_memory))
        weight = _on_grid((term_idf.index_select(0, term) * tf / (tf + row_norm.index_select(0, row))).float())
        col = position.index_select(0, row)

        # Frequent terms become dense rows [n_dense, widest memory]: adding one contiguous row beats
        # gathering and scattering _DENSE_FACTOR postings one by one. Each dense term has
        # df >= width / _DENSE_FACTOR, so the matrix holds at most _DENSE_FACTOR x the live postings.
        width = int(mem_docs.max()) if n_mem else 0
        term_df = term_ptr[1:] - term_ptr[:-1]
        is_dense = term_df * _DENSE_FACTOR >= max(width, 1)
        dense_terms = torch.nonzero(is_dense).flatten()
        dense_slot = torch.full((n_terms,), -1, dtype=torch.long, device=dev)
        dense_slot[dense_terms] = torch.arange(dense_terms.numel(), device=dev)
        # float64 (the posting weights, exactly): the product with the query counts is the accumulator's
        dense_weight = torch.zeros((dense_terms.numel(), width), dtype=torch.float64, device=dev)
        in_dense = torch.nonzero(is_dense.index_select(0, term)).flatten()
        dense_weight.index_put_(
            (dense_slot.index_select(0, term.index_select(0, in_dense)), col.index_select(0, in_dense)),
            weight.index_select(0, in_dense).double(),
        )
        self._cache = {
            "term_ptr": term_ptr,
            # int32 columns: the scatter's index traffic is the CPU hot spot (doc positions fit easily)
            "post_col": col.to(torch.int32 if self.num_rows < 2**31 - 1 else torch.long),
            "post_weight": weight,
            "dense_slot": dense_slot,
            "dense_weight": dense_weight,
            "rows_by_memory": rows_by_memory,
            "mem_start": mem_start,
            "mem_docs": mem_docs.clone(),
        }
        return self._cache

    def _encode_queries(self, queries: list[list[str]], mems: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(query index, term id) per query token the query's memory knows; repeats kept (each counts)."""
        vocab = self._vocab
        n_vocab = len(vocab)
        empty: dict[str, int] = {}
        flat_terms = [
            term
            for toks, m in zip(queries, mems, strict=True)
            for term in map((vocab[m] if m < n_vocab else empty).get, toks, itertools.repeat(-1))
        ]
        lengths = torch.tensor([len(t) for t in queries], dtype=torch.long)
        pair_query = torch.repeat_interleave(torch.arange(len(queries)), lengths)
        pair_term = torch.tensor(flat_terms, dtype=torch.long)
        known = pair_term >= 0
        return pair_query[known].to(self.device), pair_term[known].to(self.device)

    def _score_block(
        self, cache: dict[str, torch.Tensor], pair_query: torch.Tensor, pair_term: torch.Tensor, n_queries: int, width: int
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
        segmented_scatter_add(acc.view(-1), pair_query * width, pair_term, cache["term_ptr"], cache["post_col"],
                              cache["post_weight"])
        return acc.float()

    @staticmethod
    def _query_memory(cache: dict[str, torch.Tensor], mem_t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(live docs, first slot in rows_by_memory) of each query's memory; 0 docs for unseen memories."""
        n_mem = cache["mem_docs"].numel()
        seen = mem_t < n_mem
        safe = torch.where(seen, mem_t, 0)
        if n_mem == 0:
            zero = torch.zeros_like(mem_t)
            return zero, zero
        return torch.where(seen, cache["mem_docs"][safe], 0), torch.where(seen, cache["mem_start"][safe], 0)

    @staticmethod
    def _rows_at(
        cache: dict[str, torch.Tensor], q_docs: torch.Tensor, q_start: torch.Tensor, cols: torch.Tensor
    ) -> torch.Tensor:
        """Row id at each (query, column); -1 where the column is past the query's memory's docs."""
        valid = cols < q_docs[:, None]
        flat = torch.where(valid, q_start[:, None] + cols, 0)
        if cache["rows_by_memory"].numel() == 0:
            return torch.full_like(cols, -1)
        return torch.where(valid, cache["rows_by_memory"][flat], -1)

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
        mem_docs, mem_start = self._query_memory(cache, memories)
        width = int(mem_docs.max())
        pair_query, pair_term = self._encode_queries(queries, mems)
        out = self._score_block(cache, pair_query, pair_term, len(queries), width)
        cols = torch.arange(width, device=self.device).expand(memories.numel(), width)
        return out, self._rows_at(cache, mem_docs, mem_start, cols).index_select(0, which)

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
        return self._search_pairs(pair_query, pair_term, mems, k, kernels)

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
        check_pairs(pair_query, pair_term, len(mems), len(self._term_token))
        if pair_query.numel():
            mem_t = torch.tensor(mems, dtype=torch.long, device=self.device)
            if bool((self._term_memory.view[pair_term] != mem_t[pair_query]).any()):
                raise ValueError("BM25 search_encoded: a term id belongs to another memory than its query")
        return self._search_pairs(pair_query, pair_term, mems, k, kernels)

    def _search_pairs(
        self, pair_query: torch.Tensor, pair_term: torch.Tensor, mems: list[int], k: int, kernels: str = "torch"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n_queries = len(mems)
        dev = self.device
        top_scores = torch.zeros((n_queries, k), dtype=torch.float32, device=dev)
        top_rows = torch.full((n_queries, k), -1, dtype=torch.long, device=dev)
        if n_queries == 0:
            return top_scores, top_rows
        _check_query_pairs(pair_query, n_queries)
        cache = self._prepare()
        q_docs, q_start = self._query_memory(cache, torch.tensor(mems, dtype=torch.long, device=dev))
        width = int(q_docs.max())
        if width == 0:
            return top_scores, top_rows
        if kernels == "triton":
            return self._search_ragged(cache, pair_query, pair_term, q_docs, q_start, k)
        kk = min(k, width)
        chunk = max(1, _CHUNK_ELEMENTS // width)
        bounds = torch.searchsorted(pair_query, torch.arange(0, n_queries + chunk, chunk, device=dev)).tolist()
        for i, q0 in enumerate(range(0, n_queries, chunk)):
            q1 = min(q0 + chunk, n_queries)
            lo, hi = bounds[i], bounds[i + 1]
            block = self._score_block(cache, pair_query[lo:hi] - q0, pair_term[lo:hi], q1 - q0, width)
            vals, cols = padded_topk(block, kk)
            rows = self._rows_at(cache, q_docs[q0:q1], q_start[q0:q1], cols)
            hit = vals > 0
            top_scores[q0:q1, :kk] = torch.where(hit, vals, 0.0)
            top_rows[q0:q1, :kk] = torch.where(hit, rows, -1)
        return top_scores, top_rows

    def _search_ragged(
        self, cache: dict[str, torch.Tensor], pair_query: torch.Tensor, pair_term: torch.Tensor, q_docs: torch.Tensor,
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
            segmented_scatter_add_triton(acc, seg_ptr.index_select(0, pair_query[lo:hi] - q0), pair_term[lo:hi],
                                         cache["term_ptr"], cache["post_col"], cache["post_weight"])
            parts.append(segment_topk_triton(acc, seg_ptr, q_start[q0:q1], cache["rows_by_memory"], k))
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

    # ------------------------------------------------------------------ persistence
    def state_dict(self) -> dict[str, Any]:
        """Tensors (CPU) + vocabulary; `load_state_dict` of it scores identically."""
        return {
            "version": _STATE_VERSION,
            "k1": self.k1,
            "b": self.b,
            "num_memories": len(self._vocab),
            "terms": list(self._term_token),
            "term_memory": self._term_memory.view.cpu().clone(),
            "post_term": self._post_term.view.cpu().clone(),
            "post_tf": self._post_tf.view.cpu().clone(),
            "row_memory": self._row_memory.view.cpu().clone(),
            "row_len": self._row_len.view.cpu().clone(),
            "row_post_start": self._row_post_start.view.cpu().clone(),
            "deleted": self._deleted.view.cpu().clone(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        version = state.get("version")
        if version != _STATE_VERSION:
            raise ValueError(f"BM25Index state: version {version!r} is not {_STATE_VERSION}")
        terms: list[str] = list(state["terms"])
        term_memory = state["term_memory"].long().cpu()
        if len(terms) != term_memory.numel():
            raise ValueError(f"BM25Index state: {len(terms)} terms but {term_memory.numel()} term_memory entries")
        fresh = BM25Index(k1=state["k1"], b=state["b"], device=self.device)
        fresh._vocab = [{} for _ in range(int(state["num_memories"]))]
        for term_id, (token, mem) in enumerate(zip(terms, term_memory.tolist(), strict=True)):
            fresh._vocab[mem][token] = term_id
        fresh._term_token = terms
        fresh._term_memory.extend(term_memory)
        post_term = state["post_term"].long()
        row_post_start = state["row_post_start"].long()
        n_rows = row_post_start.numel()
        fresh._post_term.extend(post_term)
        fresh._post_tf.extend(state["post_tf"].int())
        ends = torch.cat([row_post_start[1:], torch.tensor([post_term.numel()])])
        fresh._post_row.extend(torch.repeat_interleave(torch.arange(n_rows), ends - row_post_start))
        fresh._row_memory.extend(state["row_memory"].long())
        fresh._row_len.extend(state["row_len"].long())
        fresh._row_post_start.extend(row_post_start)
        fresh._deleted.extend(state["deleted"].bool())
        # live statistics are integers, recomputed exactly from the live rows and postings
        dev = self.device
        live = ~fresh._deleted.view
        live_terms = fresh._post_term.view[live[fresh._post_row.view]]
        fresh._df.ensure(len(terms))
        fresh._df.view.index_add_(0, live_terms, torch.ones_like(live_terms, device=dev))
        fresh._mem_docs.ensure(len(fresh._vocab))
        fresh._mem_tokens.ensure(len(fresh._vocab))
        live_mem = fresh._row_memory.view[live]
        fresh._mem_docs.view.index_add_(0, live_mem, torch.ones_like(live_mem))
        fresh._mem_tokens.view.index_add_(0, live_mem, fresh._row_len.view[live])
        self.__dict__.update(fresh.__dict__)

    def to(self, device: str | torch.device) -> BM25Index:
        """Move every tensor to ``device`` (in place; returns self)."""
        self.device = torch.device(device)
        for buf in (
            self._post_term, self._post_row, self._post_tf, self._row_memory, self._row_len,
            self._row_post_start, self._deleted, self._term_memory, self._df, self._mem_docs, self._mem_tokens,
        ):
            buf.to(self.device)
        self._cache = None
        return self
