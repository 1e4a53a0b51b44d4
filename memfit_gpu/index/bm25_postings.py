"""BM25Index's postings as search reads them: the CSR layout over term slots x positions.

`lay_out` computes the lucene weight of every live posting of the memories that changed (element-wise,
so the same bits in any slicing) in slices of PREPARE_SLICE postings, placed by a counting sort on term
slot (pointers from live df), in a term-slot x position CSR matrix (position = rank of the row among its
memory's live rows). Slots order terms memory by memory, so each memory's postings are one block, and the
blocks of memories that did not change are copied from the previous layout as they were: a write to one
user of a live server costs the next read that user's postings, not the whole store's. Frequent terms
also become dense weight rows. A first build is the same code with every memory changed.

BM25Index (index/bm25.py) keeps the layout (`_cache`) and the memories changed since it was laid out
(`_dirty`) and passes its columns explicitly (`PostingColumns`); the readers of a row's postings from
those columns (`postings_of`, `posting_rows`) and of the layout (`query_memory`, `rows_at`) are here too.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

# A term whose live df reaches 1/_DENSE_FACTOR of the widest memory is scored as a dense row.
_DENSE_FACTOR = 8
# Exact, order-independent sums (why CPU and GPU rank identically, run after run). Every posting
# weight is a float32 on the grid 2^-_GRID_BITS (`_on_grid`); weights are < 2^5 (idf <= ln(1 + N / 1.5)
# < 21.1 for N < 2^31 and tf / (tf + norm) <= 1); a query sums at most bm25._MAX_QUERY_PAIRS of them. So
# every partial sum is a multiple of 2^-32 below 2^(16 + 5) = 2^(53 - 32): exactly representable in
# float64. Float64 accumulation is then exact in any order (index_add_, sparse.mm, GPU atomics), and
# the one rounding to float32 at the end gives the same bits everywhere. The grid changes no weight
# >= 2^-9 (their float32 spacing is already >= 2^-32); smaller ones (terms in nearly every document)
# move by < 2^-33, far below the float32 rounding of any score they join.
_GRID_BITS = 32
# Postings handled per slice by `lay_out` and `count_live_df` (bounds their temporaries).
PREPARE_SLICE = 1 << 22

Layout = dict[str, torch.Tensor]


@dataclass(frozen=True)
class PostingColumns:
    """The columns of a BM25Index that its layout is built from (views, on the index's device)."""

    post_term: torch.Tensor  # per posting: term id (int32), a row's postings contiguous, rows in order
    post_tf: torch.Tensor  # per posting: term frequency (int32)
    row_post_start: torch.Tensor  # per row: its first posting
    row_memory: torch.Tensor
    row_len: torch.Tensor  # per row: tokens
    deleted: torch.Tensor  # per row
    term_memory: torch.Tensor
    term_local: torch.Tensor  # per term: its place among its memory's terms
    df: torch.Tensor  # per term: live documents holding it
    mem_docs: torch.Tensor  # per memory (at least num_memories long): live documents
    mem_tokens: torch.Tensor  # per memory: tokens of its live documents
    mem_terms: torch.Tensor  # per memory: terms
    num_memories: int
    k1: float
    b: float


def _on_grid(weight: torch.Tensor) -> torch.Tensor:
    """float32 weights rounded (half to even) to multiples of 2^-_GRID_BITS; still float32, exactly:
    a weight below 2^-9 becomes m x 2^-32 with m < 2^23, and larger ones are unchanged."""
    scale = float(2**_GRID_BITS)
    return (weight.double() * scale).round_().div_(scale).float()


def lucene_idf(df: torch.Tensor, n_docs: torch.Tensor) -> torch.Tensor:
    """idf = ln(1 + (N - df + 0.5) / (df + 0.5)), in float64."""
    n_docs = n_docs.double()
    df = df.double()
    return torch.log1p((n_docs - df + 0.5) / (df + 0.5))


def _unchanged_runs(changed: torch.Tensor) -> list[tuple[int, int]]:
    """Maximal runs [a, b) of consecutive memories that did not change (their blocks move as one)."""
    same = torch.zeros(changed.numel() + 2, dtype=torch.int8)
    same[1:-1] = (~changed).to(torch.int8).cpu()
    step = torch.diff(same)
    return list(zip(torch.nonzero(step == 1).flatten().tolist(), torch.nonzero(step == -1).flatten().tolist(),
                    strict=True))


def _row_slices(rows: torch.Tensor, postings: torch.Tensor) -> list[torch.Tensor]:
    """`rows` cut into consecutive pieces of at most PREPARE_SLICE postings each (a row is never split;
    a row with more postings than that is a piece of its own)."""
    ends = torch.cumsum(postings, 0).cpu()
    pieces, start = [], 0
    while start < rows.numel():
        base = int(ends[start - 1]) if start else 0
        stop = max(start + 1, int(torch.searchsorted(ends, base + PREPARE_SLICE, right=True)))
        pieces.append(rows[start:stop])
        start = stop
    return pieces


# ---------------------------------------------------------------------- reading a row's postings
def post_end(row_post_start: torch.Tensor, n_postings: int) -> torch.Tensor:
    """Per row: one past its last posting."""
    tail = torch.tensor([n_postings], dtype=torch.long, device=row_post_start.device)
    return torch.cat([row_post_start[1:], tail])


def postings_of(row_post_start: torch.Tensor, n_postings: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(position in `rows`, posting index) of every posting of the given rows, row by row."""
    dev = row_post_start.device
    starts = row_post_start[rows]
    lengths = post_end(row_post_start, n_postings)[rows] - starts
    total = int(lengths.sum())
    first = torch.cumsum(lengths, 0) - lengths
    entry = torch.repeat_interleave(torch.arange(rows.numel(), device=dev), lengths, output_size=total)
    return entry, starts[entry] + torch.arange(total, device=dev) - first[entry]


def posting_rows(row_post_start: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """The row of each posting lo..hi-1 (a row's postings are contiguous, rows in order)."""
    at = torch.arange(lo, hi, dtype=torch.long, device=row_post_start.device)
    return torch.searchsorted(row_post_start, at, right=True) - 1


def count_live_df(df: torch.Tensor, post_term: torch.Tensor, row_post_start: torch.Tensor, live: torch.Tensor) -> None:
    """Add each live row's postings to their terms' df (a loaded index's), in slices of PREPARE_SLICE."""
    for lo in range(0, post_term.numel(), PREPARE_SLICE):
        hi = min(lo + PREPARE_SLICE, post_term.numel())
        terms = post_term[lo:hi].long()[live.index_select(0, posting_rows(row_post_start, lo, hi))]
        df.index_add_(0, terms, torch.ones_like(terms))


# ---------------------------------------------------------------------- the layout
def lay_out(old: Layout | None, dirty: set[int], cols: PostingColumns) -> Layout:
    """Per-posting lucene weights as a CSR matrix over term slots x positions, kept until the next
    change and then brought up to date for the memories that changed only: `old` is the previous layout
    (None: build it whole), `dirty` the memories changed since (their N, df or rows).

    A term's slot orders terms memory by memory (its memory's first slot + its place among that
    memory's terms, `term_local`), so each memory's postings are one block of the CSR. A change to a
    memory (an add, a delete) changes its N, df and avgdl, hence every weight of its block, and
    nothing of another memory's block: the blocks of unchanged memories are copied (one slice per
    run of consecutive unchanged memories) and only the changed memories' postings are weighted and
    laid out again. A first build is the same code with every memory changed.

    Laying out a block is a counting sort in slices of at most PREPARE_SLICE postings (whole rows):
    each live posting goes to its slot's next free place (rows are taken in row order, so a term's
    postings stay in row order), and its weight is computed element by element exactly as one
    full-size pass would: the layout and the bits do not depend on how it was reached."""
    dev = cols.row_memory.device
    n_mem = cols.num_memories
    n_terms = cols.term_memory.numel()
    n_rows = cols.row_len.numel()
    live = ~cols.deleted
    row_memory = cols.row_memory
    mem_docs = cols.mem_docs
    # the memories to lay out again (all of them on a first build or after a move): the dirty ones and
    # those the cache has not seen
    changed = torch.ones(n_mem, dtype=torch.bool, device=dev)
    if old is not None:
        changed[:old["mem_docs"].numel()] = False
        changed[torch.tensor(sorted(dirty), dtype=torch.long, device=dev)] = True
    runs = _unchanged_runs(changed) if old is not None else []

    # rows grouped by memory, row order kept inside each: position = rank among the memory's live rows
    mem_start = torch.cumsum(mem_docs, 0) - mem_docs
    rows_by_memory = torch.empty(int(mem_docs.sum()), dtype=torch.long, device=dev)
    for a, b in runs:
        at, span = int(old["mem_start"][a]), int(old["mem_start"][b - 1] + old["mem_docs"][b - 1] - old["mem_start"][a])
        to = int(mem_start[a])
        rows_by_memory[to:to + span] = old["rows_by_memory"][at:at + span]
    redo_rows = torch.nonzero(live & changed.index_select(0, row_memory)).flatten()
    redo_rows = redo_rows[torch.sort(row_memory[redo_rows], stable=True).indices]
    redo_mem = row_memory[redo_rows]
    per_memory = torch.bincount(redo_mem, minlength=n_mem)
    rank = torch.arange(redo_rows.numel(), device=dev) - (torch.cumsum(per_memory, 0) - per_memory)[redo_mem]
    rows_by_memory[mem_start[redo_mem] + rank] = redo_rows
    position = torch.full((n_rows,), -1, dtype=torch.long, device=dev)
    position[redo_rows] = rank

    # term slots, memory by memory; the CSR pointers come from the live df alone
    mem_terms = cols.mem_terms
    term_memory = cols.term_memory
    mem_first_slot = torch.cumsum(mem_terms, 0) - mem_terms
    slot_of_term = mem_first_slot.index_select(0, term_memory) + cols.term_local
    slot_df = torch.empty(n_terms, dtype=torch.long, device=dev)
    slot_df[slot_of_term] = cols.df
    term_ptr = torch.zeros(n_terms + 1, dtype=torch.long, device=dev)
    term_ptr[1:] = torch.cumsum(slot_df, 0)
    block_start = term_ptr.index_select(0, mem_first_slot)
    total = int(term_ptr[-1])
    col_dtype = torch.int32 if n_rows < 2**31 - 1 else torch.long
    post_col = torch.empty(total, dtype=col_dtype, device=dev)
    post_weight = torch.empty(total, dtype=torch.float32, device=dev)
    for a, b in runs:  # unchanged memories: their blocks as they were
        at = int(old["block_start"][a])
        span = int(old["block_end"][b - 1]) - at
        to = int(block_start[a])
        post_col[to:to + span] = old["post_col"][at:at + span]
        post_weight[to:to + span] = old["post_weight"][at:at + span]

    # lucene factors per term (idf) and per row (length norm); avgdl > 0 whenever the memory has a
    # posting, so the division is safe where it is used
    term_idf = lucene_idf(cols.df, mem_docs[term_memory])
    avgdl = cols.mem_tokens.double() / mem_docs.clamp(min=1).double()
    row_norm = cols.k1 * (1.0 - cols.b + cols.b * cols.row_len.double() / avgdl.index_select(0, row_memory))
    cursor = term_ptr[:-1].clone()
    for term, row, tf in _postings_to_lay_out(cols, redo_rows, changed, live):
        weight = _on_grid((term_idf.index_select(0, term) * tf / (tf + row_norm.index_select(0, row))).float())
        col = position.index_select(0, row)
        slot = slot_of_term.index_select(0, term)
        # each posting's place: its slot's cursor plus its rank among this slice's postings of the slot
        sorted_slot, by_slot = torch.sort(slot, stable=True)
        _, run = torch.unique_consecutive(sorted_slot, return_counts=True)
        run_start = torch.repeat_interleave(torch.cumsum(run, 0) - run, run)
        dest = cursor.index_select(0, sorted_slot) + torch.arange(sorted_slot.numel(), device=dev) - run_start
        post_col[dest] = col.index_select(0, by_slot).to(col_dtype)
        post_weight[dest] = weight.index_select(0, by_slot)
        cursor.index_add_(0, slot, torch.ones_like(slot))
    del cursor, position

    # Frequent terms become dense rows [n_dense, widest memory]: adding one contiguous row beats
    # gathering and scattering _DENSE_FACTOR postings one by one. Each dense term has
    # df >= width / _DENSE_FACTOR, so the matrix holds at most _DENSE_FACTOR x the live postings.
    width = int(mem_docs.max()) if n_mem else 0
    term_df = cols.df
    is_dense = term_df * _DENSE_FACTOR >= max(width, 1)
    dense_terms = torch.nonzero(is_dense).flatten()
    dense_slot = torch.full((n_terms,), -1, dtype=torch.long, device=dev)
    dense_slot[dense_terms] = torch.arange(dense_terms.numel(), device=dev)
    # float64 (the posting weights, exactly): the product with the query counts is the accumulator's
    dense_weight = torch.zeros((dense_terms.numel(), width), dtype=torch.float64, device=dev)
    if dense_terms.numel():
        counts = term_df.index_select(0, dense_terms)
        row_of = torch.repeat_interleave(torch.arange(dense_terms.numel(), device=dev), counts)
        first = term_ptr.index_select(0, slot_of_term.index_select(0, dense_terms))
        starts = torch.repeat_interleave(first - (torch.cumsum(counts, 0) - counts), counts)
        at = starts + torch.arange(row_of.numel(), device=dev)
        dense_weight.index_put_((row_of, post_col.index_select(0, at).long()), post_weight.index_select(0, at).double())
    return {
        "term_ptr": term_ptr,  # over slots: a term's postings are term_ptr[slot[t]] .. term_ptr[slot[t] + 1]
        "slot": slot_of_term,
        # int32 columns: the scatter's index traffic is the CPU hot spot (doc positions fit easily)
        "post_col": post_col,
        "post_weight": post_weight,
        "dense_slot": dense_slot,
        "dense_weight": dense_weight,
        "rows_by_memory": rows_by_memory,
        "mem_start": mem_start,
        "mem_docs": mem_docs.clone(),
        "block_start": block_start,
        "block_end": torch.cat([block_start[1:], term_ptr[-1:]]) if n_mem else block_start,
    }


def _postings_to_lay_out(cols: PostingColumns, rows: torch.Tensor, changed: torch.Tensor,
                         live: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(term, row, tf as float64) of the postings of `rows` (the live rows of the changed memories),
    in slices of at most PREPARE_SLICE postings, each memory's postings in row order.

    When they are most of the postings (a first build) the postings are read in storage order and
    filtered; otherwise each slice gathers its rows' postings, so an update reads no other memory."""
    if rows.numel() == 0:
        return
    n_postings = cols.post_term.numel()
    per_row = (post_end(cols.row_post_start, n_postings) - cols.row_post_start).index_select(0, rows)
    if 2 * int(per_row.sum()) < n_postings:
        for chunk in _row_slices(rows, per_row):
            entry, postings = postings_of(cols.row_post_start, n_postings, chunk)
            yield cols.post_term[postings].long(), chunk[entry], cols.post_tf[postings].double()
        return
    every = rows.numel() == cols.row_len.numel()
    for lo in range(0, n_postings, PREPARE_SLICE):
        hi = min(lo + PREPARE_SLICE, n_postings)
        term = cols.post_term[lo:hi].long()
        row = posting_rows(cols.row_post_start, lo, hi)
        tf = cols.post_tf[lo:hi].double()
        if not every:
            keep = live.index_select(0, row) & changed.index_select(0, cols.row_memory.index_select(0, row))
            term, row, tf = term[keep], row[keep], tf[keep]
        yield term, row, tf


# ---------------------------------------------------------------------- reading the layout
def query_memory(cache: Layout, mem_t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(live docs, first slot in rows_by_memory) of each query's memory; 0 docs for unseen memories."""
    n_mem = cache["mem_docs"].numel()
    seen = mem_t < n_mem
    safe = torch.where(seen, mem_t, 0)
    if n_mem == 0:
        zero = torch.zeros_like(mem_t)
        return zero, zero
    return torch.where(seen, cache["mem_docs"][safe], 0), torch.where(seen, cache["mem_start"][safe], 0)


def rows_at(
    cache: Layout, q_docs: torch.Tensor, q_start: torch.Tensor, cols: torch.Tensor
) -> torch.Tensor:
    """Row id at each (query, column); -1 where the column is past the query's memory's docs."""
    valid = cols < q_docs[:, None]
    flat = torch.where(valid, q_start[:, None] + cols, 0)
    if cache["rows_by_memory"].numel() == 0:
        return torch.full_like(cols, -1)
    return torch.where(valid, cache["rows_by_memory"][flat], -1)
