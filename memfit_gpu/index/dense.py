"""Dense episode index on FAISS: inner product over L2-normalised rows (= cosine), one index per memory.

Rows are global integers in add order across all memories (the store's episode or summary rows).
Each memory is searched on its own rows only: isolation by construction, not by filtering. Two ways:

- **Batched** (a memory searched exactly, with at most `batched_max_rows` rows, i.e. factory "Flat" or
  a trained factory still below its training minimum): no FAISS index at all. The memories of a batch
  of queries are laid out as padded blocks [memories, rows, dim] and scored with one batched product
  per block of `_BLOCK_ELEMENTS` (on the GPU when torch sees one and `device` is not "cpu"), in float64
  from the float32 vectors and rounded once to float32: each score is the correctly rounded inner
  product (but for float64 rounding, ~2^-29 relative, landing on a float32 tie), whatever the batch shape
  or machine. LongMemEval has one question per memory, ~500 memories: a handful of products instead
  of ~500 single-query FAISS calls, and the vectors are held once (no FAISS copy).
- **FAISS** (larger memories, or a trained/approximate factory): one FAISS index per memory, one call
  per memory present in the batch. FAISS computes in float32 with its own summation order, so its
  scores can differ from the batched ones in the last bit (rankings agree but for such near-ties).

Deletion is a tombstone mask, identical for every factory (HNSW and GPU indexes cannot remove ids).
The batched product scores every row and drops tombstones before the top-k. A FAISS search over-fetches
by the memory's tombstone count so k live results still come back; where GPU FAISS's cap on k
(`_GPU_MAX_K`) stops the over-fetch short, the memory is searched exactly over its stored vectors.

Ties are broken deterministically (score descending, then row ascending). FAISS itself does not
promise that order, so a search fetches until the k-th score is strictly above the last fetched one
(or the memory is exhausted) and sorts the result itself.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from memfit_gpu.buffers import GrowableArray

try:
    import faiss
except ImportError as _exc:  # faiss is an either/or extra: [cpu] (faiss-cpu) or [gpu] (faiss-gpu-cu12)
    raise ImportError(
        "DenseIndex needs FAISS: pip install 'memfit-gpu[cpu]' (faiss-cpu) or 'memfit-gpu[gpu]' "
        "(faiss-gpu-cu12), not both: they install the same `faiss` module"
    ) from _exc

log = logging.getLogger(__name__)

DEVICES = ("auto", "cpu", "gpu")

# Fetch this many extra neighbours beyond k + tombstones before checking for ties at the cut.
_TIE_MARGIN = 8
_GPU_MAX_K = 2048
# Memories with at most this many rows are searched by the batched product (index.dense_batched_max_rows).
BATCHED_MAX_ROWS = 65_536
# Elements of one padded block [memories, rows, dim + queries] of the batched product (128 MiB in float64).
_BLOCK_ELEMENTS = 1 << 24
_NPY_BLOCK_ROWS = 1 << 16  # rows per read/write of vectors.npy (snapshots stream, never hold a copy)


def _as_float32_matrix(vectors: np.ndarray | torch.Tensor, dim: int, what: str) -> np.ndarray:
    if isinstance(vectors, torch.Tensor):
        vectors = vectors.detach().to("cpu", torch.float32).numpy()
    array = np.ascontiguousarray(np.asarray(vectors, dtype=np.float32))
    if array.ndim != 2 or array.shape[1] != dim:
        raise ValueError(f"DenseIndex: {what} must be [n, {dim}] float32, got shape {array.shape}")
    return array


def _as_index_array(values: Sequence[int] | np.ndarray | torch.Tensor, n: int, what: str) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()
    array = np.asarray(values, dtype=np.int64).reshape(-1)
    if array.shape[0] != n:
        raise ValueError(f"DenseIndex: {what} has {array.shape[0]} entries, expected {n} (one per row)")
    return array


@dataclass
class _MemoryPart:
    """One memory's rows and vectors, and its FAISS index (None: searched by the batched product); FAISS
    labels and batched columns are local positions 0..n-1 mapped to global rows."""

    index: faiss.Index | None
    kind: str  # the factory in effect: the configured one, or "Flat" when too few vectors to train
    rows: GrowableArray = field(default_factory=lambda: GrowableArray(np.int64))
    vectors: list[np.ndarray] = field(default_factory=list)  # the stored vectors (batched search, retraining)
    deleted: int = 0  # tombstoned rows of this memory: the over-fetch margin

    @property
    def size(self) -> int:
        return self.rows.size


_LOGGED_PLACEMENTS: set[tuple[str, str]] = set()  # log each placement decision once per process


def faiss_placement(device: str, gpu_id: int = 0) -> tuple[bool, str]:
    """(use GPU FAISS?, a description of where the indexes live and why), logged at INFO once.

    Raises RuntimeError for device "gpu" when this FAISS build has no GPU support (faiss-cpu is the
    one installed) or no GPU is visible."""
    if device not in DEVICES:
        raise ValueError(f"DenseIndex: device {device!r} is not one of {', '.join(DEVICES)} (index.dense_device)")
    has_gpu_build = hasattr(faiss, "StandardGpuResources")
    gpus = faiss.get_num_gpus() if has_gpu_build else 0
    if device == "cpu":
        use, where = False, "CPU (index.dense_device=cpu)"
    elif has_gpu_build and gpus > gpu_id:
        use, where = True, f"GPU {gpu_id} (GPU FAISS, {gpus} GPU(s) visible)"
    elif device == "gpu":
        why = ("this FAISS build has no GPU support (faiss-cpu is installed: pip uninstall faiss-cpu, then "
               "pip install faiss-gpu-cu12)") if not has_gpu_build else f"FAISS sees {gpus} GPU(s), GPU {gpu_id} asked"
        raise RuntimeError(f"index.dense_device=gpu: {why}; or set index.dense_device=auto|cpu")
    else:
        why = "this FAISS build has no GPU support" if not has_gpu_build else "FAISS sees no GPU"
        use, where = False, f"CPU ({why}; index.dense_device=auto)"
    if (device, where) not in _LOGGED_PLACEMENTS:
        _LOGGED_PLACEMENTS.add((device, where))
        log.info("DenseIndex: FAISS indexes on %s", where)
    return use, where


class DenseIndex:
    """Inner-product FAISS index partitioned by memory.

    factory: a FAISS factory string ("Flat" = exact IndexFlatIP; "IVF1024,Flat", "HNSW32", ...).
    A factory that needs training is trained on the memory's own vectors the first time the memory
    holds enough of them; until then the memory uses an exact Flat index (logged at debug level).
    device: "auto" = GPU FAISS when this faiss build has GPU support and a GPU is visible, else the
    CPU; "gpu" = GPU FAISS or an error saying what is missing; "cpu". Where it went is logged at INFO
    (`placement` holds it). gpu_id: the GPU that holds the indexes.
    batched_max_rows: a memory searched exactly with at most this many rows has no FAISS index and is
    searched by the batched product (see the module doc); 0 = every memory has a FAISS index.
    """

    def __init__(self, dim: int, factory: str = "Flat", device: str = "auto", nprobe: int = 16,
                 gpu_id: int = 0, batched_max_rows: int = BATCHED_MAX_ROWS):
        if batched_max_rows < 0:
            raise ValueError(f"DenseIndex: batched_max_rows must be >= 0, got {batched_max_rows} "
                             f"(index.dense_batched_max_rows)")
        self.batched_max_rows = int(batched_max_rows)
        self.dim = int(dim)
        self.factory = factory
        self.nprobe = int(nprobe)
        self.device = device
        self.gpu_id = int(gpu_id)
        self.use_gpu, self.placement = faiss_placement(device, self.gpu_id)
        self._gpu_resources = faiss.StandardGpuResources() if self.use_gpu else None
        # where the batched product runs: the GPU when torch sees one, unless device is "cpu"
        self.product_device = torch.device(
            f"cuda:{self.gpu_id}" if device != "cpu" and torch.cuda.is_available() else "cpu")
        self._parts: dict[int, _MemoryPart] = {}
        self._buffers: dict[str, np.ndarray] = {}  # the batched product's host workspaces
        self._row_memory = GrowableArray(np.int64, -1)
        self._row_local = GrowableArray(np.int64, -1)
        self._deleted = GrowableArray(np.bool_, False)
        try:
            probe = faiss.index_factory(self.dim, factory, faiss.METRIC_INNER_PRODUCT)
        except RuntimeError as exc:
            raise ValueError(f"DenseIndex: FAISS cannot build factory {factory!r} (index.dense_factory): {exc}") from None
        self._needs_training = not probe.is_trained
        self._min_train = self._training_minimum(probe)
        log.debug("DenseIndex dim=%d factory=%s on %s (needs training: %s)",
                  self.dim, factory, self.placement, self._needs_training)

    # ------------------------------------------------------------------ construction
    @staticmethod
    def _training_minimum(index: faiss.Index) -> int:
        """Vectors needed to train: k-means needs at least one point per IVF list.

        Other trained parts (PQ codebooks) are caught when training raises; the memory then falls back too.
        """
        if index.is_trained:
            return 0
        try:
            return max(1, int(faiss.extract_index_ivf(index).nlist))
        except RuntimeError:
            return 1

    def _new_faiss(self, factory: str) -> faiss.Index:
        index = faiss.index_factory(self.dim, factory, faiss.METRIC_INNER_PRODUCT)
        return index

    def _to_device(self, index: faiss.Index) -> faiss.Index:
        if not self.use_gpu:
            return index
        try:
            return faiss.index_cpu_to_gpu(self._gpu_resources, self.gpu_id, index)
        except RuntimeError as exc:  # e.g. HNSW has no GPU implementation
            log.debug("DenseIndex: %s stays on CPU (%s)", type(index).__name__, exc)
            return index

    def _build_part(self, vectors: np.ndarray) -> tuple[faiss.Index, str]:
        """The memory's FAISS index over `vectors` (already added)."""
        if self._needs_training and len(vectors) < self._min_train:
            log.debug(
                "DenseIndex: memory has %d vectors, %s needs %d to train: using exact Flat",
                len(vectors), self.factory, self._min_train,
            )
            index, kind = self._new_faiss("Flat"), "Flat"
        else:
            index, kind = self._new_faiss(self.factory), self.factory
            if not index.is_trained:
                try:
                    index.train(vectors)
                except RuntimeError as exc:
                    log.debug("DenseIndex: training %s failed (%s): using exact Flat", self.factory, exc)
                    index, kind = self._new_faiss("Flat"), "Flat"
        self._set_nprobe(index)
        index = self._to_device(index)
        if len(vectors):
            index.add(vectors)
        return index, kind

    def _wanted_kind(self, size: int) -> str:
        """The factory a memory of `size` vectors uses: the configured one, or exact Flat below its
        training minimum."""
        return "Flat" if self._needs_training and size < self._min_train else self.factory

    def _place(self, part: _MemoryPart, chunk: np.ndarray | None) -> None:
        """Bring a memory's search structure up to date after `chunk` (None: everything) was stored:
        batched (no FAISS) while exact and small, else a FAISS index, built or rebuilt from the stored
        vectors when the memory changes kind, or appended to."""
        kind = self._wanted_kind(part.size)
        if kind == "Flat" and part.size <= self.batched_max_rows:
            if self._needs_training:
                log.debug("DenseIndex: memory has %d vectors, %s needs %d to train: using exact Flat",
                          part.size, self.factory, self._min_train)
            part.index, part.kind = None, "Flat"
        elif part.index is None or chunk is None or (kind != part.kind and self._needs_training):
            if part.index is not None and part.kind != kind:
                log.debug("DenseIndex: a memory reached %d vectors, now %s", part.size, kind)
            part.index, part.kind = self._build_part(self._stacked_part(part))
        else:
            part.index.add(chunk)

    def _set_nprobe(self, index: faiss.Index) -> None:
        try:
            faiss.extract_index_ivf(index).nprobe = self.nprobe
        except RuntimeError:
            pass

    # ------------------------------------------------------------------ properties
    @property
    def size(self) -> int:
        """Rows ever added (deleted rows keep their number)."""
        return self._row_memory.size

    @property
    def row_memory(self) -> np.ndarray:
        return self._row_memory.view

    @property
    def deleted(self) -> np.ndarray:
        return self._deleted.view

    def memory_size(self, memory_idx: int) -> int:
        """Live rows of one memory."""
        part = self._parts.get(int(memory_idx))
        return 0 if part is None else part.size - part.deleted

    def memory_kind(self, memory_idx: int) -> str | None:
        """Which factory this memory's index actually uses (None: no rows)."""
        part = self._parts.get(int(memory_idx))
        return None if part is None else part.kind

    def memory_search(self, memory_idx: int) -> str | None:
        """How this memory is searched: "batched" (the padded product), "faiss", or None (no rows)."""
        part = self._parts.get(int(memory_idx))
        return None if part is None else ("batched" if part.index is None else "faiss")

    def nbytes(self) -> dict[str, int]:
        """Bytes of the stored vectors and of the per-row maps (FAISS's own copies not counted)."""
        vectors = sum(v.nbytes for part in self._parts.values() for v in part.vectors)
        maps = self._row_memory.view.nbytes + self._row_local.view.nbytes + self._deleted.view.nbytes
        maps += sum(part.rows.view.nbytes for part in self._parts.values())
        return {"vectors": int(vectors), "row_maps": int(maps),
                "faiss_memories": sum(1 for part in self._parts.values() if part.index is not None)}

    def vectors(self, rows: Sequence[int] | np.ndarray) -> np.ndarray:
        """Stored vectors of the given rows, [len(rows), dim] float32."""
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        out = np.empty((len(rows), self.dim), dtype=np.float32)
        if len(rows) == 0:
            return out
        memories = self.row_memory[rows]
        locals_ = self._row_local.view[rows]
        for memory in np.unique(memories):
            mask = memories == memory
            stacked = self._stacked(int(memory))
            out[mask] = stacked[locals_[mask]]
        return out

    def _stacked(self, memory_idx: int) -> np.ndarray:
        return self._stacked_part(self._parts[memory_idx])

    def _stacked_part(self, part: _MemoryPart) -> np.ndarray:
        if len(part.vectors) > 1:
            part.vectors[:] = [np.concatenate(part.vectors)]
        return part.vectors[0] if part.vectors else np.empty((0, self.dim), np.float32)

    # ------------------------------------------------------------------ writes
    def add(
        self, vectors: np.ndarray | torch.Tensor, memory_idx: Sequence[int] | np.ndarray | torch.Tensor
    ) -> np.ndarray:
        """Append rows; returns their global row ids (consecutive, in input order)."""
        vectors = _as_float32_matrix(vectors, self.dim, "vectors")
        memories = _as_index_array(memory_idx, len(vectors), "memory_idx")
        first = self.size
        rows = np.arange(first, first + len(vectors), dtype=np.int64)
        local = np.empty(len(vectors), dtype=np.int64)
        # One FAISS add (or none: batched memories) per memory present in the batch, rows in input order.
        for memory in np.unique(memories):
            mask = memories == memory
            chunk = np.ascontiguousarray(vectors[mask]) if not mask.all() else vectors.copy()
            part = self._parts.get(int(memory))
            if part is None:
                part = self._parts[int(memory)] = _MemoryPart(index=None, kind=self._wanted_kind(0))
            local[mask] = np.arange(part.size, part.size + len(chunk))
            part.rows.extend(rows[mask])
            part.vectors.append(chunk)
            self._place(part, chunk)
        self._row_memory.extend(memories)
        self._row_local.extend(local)
        self._deleted.extend(np.zeros(len(vectors), dtype=np.bool_))
        return rows

    def delete(self, rows: Sequence[int] | np.ndarray | torch.Tensor) -> None:
        """Tombstone rows: they are never returned again. Unknown rows are an error; repeats are no-ops."""
        if isinstance(rows, torch.Tensor):
            rows = rows.detach().cpu().numpy()
        rows = np.unique(np.asarray(rows, dtype=np.int64).reshape(-1))
        bad = rows[(rows < 0) | (rows >= self.size)]
        if len(bad):
            raise IndexError(f"DenseIndex.delete: rows {bad.tolist()[:5]} do not exist (size {self.size})")
        deleted = self._deleted.view
        fresh = rows[~deleted[rows]]
        deleted[fresh] = True
        for memory, count in zip(*np.unique(self.row_memory[fresh], return_counts=True), strict=True):
            self._parts[int(memory)].deleted += int(count)

    # ------------------------------------------------------------------ reads
    def search(
        self,
        queries: np.ndarray | torch.Tensor,
        memory_idx: Sequence[int] | np.ndarray | torch.Tensor,
        k: int,
        min_score: float = 0.0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k rows of each query's own memory with score > min_score.

        Returns (scores [Q,k] float32, rows [Q,k] int64); missing entries are row -1 with score 0.
        """
        queries = _as_float32_matrix(queries, self.dim, "queries")
        memories = _as_index_array(memory_idx, len(queries), "memory_idx")
        n_queries = len(queries)
        scores_out = np.zeros((n_queries, k), dtype=np.float32)
        rows_out = np.full((n_queries, k), -1, dtype=np.int64)
        if k <= 0 or n_queries == 0:
            return torch.from_numpy(scores_out), torch.from_numpy(rows_out)
        deleted = self._deleted.view
        batched: list[tuple[_MemoryPart, np.ndarray]] = []
        for memory in np.unique(memories):
            part = self._parts.get(int(memory))
            if part is None or part.size == part.deleted:
                continue
            query_ids = np.flatnonzero(memories == memory)
            if part.index is None:
                batched.append((part, query_ids))
                continue
            found = self._search_faiss(part, queries[query_ids], k, min_score, deleted)
            if found is None:  # GPU FAISS's k cap stopped the over-fetch short: exact over the stored vectors
                batched.append((part, query_ids))
                continue
            rows, scores, live = found
            width = rows.shape[1]
            rows_out[query_ids, :width] = np.where(live, rows, -1)
            scores_out[query_ids, :width] = np.where(live, scores, 0.0)
        if batched:
            self._search_batched(batched, queries, k, min_score, scores_out, rows_out)
        return torch.from_numpy(scores_out), torch.from_numpy(rows_out)

    def _search_faiss(
        self, part: _MemoryPart, queries: np.ndarray, k: int, min_score: float, deleted: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """(rows, scores, live) [q, <=k] of one memory's FAISS index, in final order; None when GPU FAISS
        cannot fetch enough to be sure of the top k (the caller searches exactly instead)."""
        assert part.index is not None
        # GPU FAISS answers at most _GPU_MAX_K neighbours per query
        most = part.size if not self._on_gpu(part) else min(part.size, _GPU_MAX_K)
        fetch = min(most, k + part.deleted + _TIE_MARGIN)
        while True:
            distances, labels = part.index.search(queries, fetch)
            rows, scores, live = self._live(distances, labels, part, deleted, min_score)
            # Fetch again, wider, only when the cut at k could split a run of equal scores (or when
            # fewer than k live rows came back although the last fetched one was still live).
            if not self._cut_may_split_ties(scores, labels, live, k, min_score):
                break
            if fetch >= most:
                if most < part.size:  # capped, not exhausted: the answer may lie beyond the cap
                    return None
                break
            fetch = min(most, 2 * fetch)
        if self._in_final_order(scores, live):
            return rows[:, :k], scores[:, :k], live[:, :k]
        order = np.lexsort((np.where(live, rows, np.iinfo(np.int64).max), np.where(live, -scores, np.inf)),
                           axis=-1)[:, :k]
        return (np.take_along_axis(rows, order, axis=1), np.take_along_axis(scores, order, axis=1),
                np.take_along_axis(live, order, axis=1))

    def _workspace(self, name: str, shape: tuple[int, ...], dtype: type) -> np.ndarray:
        """A reusable host buffer viewed as `shape` (grown when too small; at most a block's worth)."""
        need = int(np.prod(shape))
        buffer = self._buffers.get(name)
        if buffer is None or buffer.dtype != dtype or buffer.size < need:
            buffer = self._buffers[name] = np.empty(need, dtype=dtype)
        return buffer[:need].reshape(shape)

    def _search_batched(self, groups: list[tuple[_MemoryPart, np.ndarray]], queries: np.ndarray, k: int,
                        min_score: float, scores_out: np.ndarray, rows_out: np.ndarray) -> None:
        """Exact top-k of each group's queries over its memory: padded blocks [memories, rows, dim] and
        [memories, queries, dim], one batched float64 product per block, rounded once to float32; then
        tombstones and scores <= min_score dropped, a stable sort by score (ties: lower local position =
        lower row) and the first k kept. Writes into scores_out / rows_out."""
        dev = self.product_device
        deleted = self._deleted.view
        # a memory asked by many queries is split so that its [queries, rows] scores fit a block too
        pieces: list[tuple[_MemoryPart, np.ndarray]] = []
        for part, ids in groups:
            step = max(1, _BLOCK_ELEMENTS // (2 * part.size))
            pieces.extend((part, ids[i : i + step]) for i in range(0, len(ids), step))
        groups = sorted(pieces, key=lambda g: g[0].size)  # similar sizes share a block: less padding
        start = 0
        while start < len(groups):
            stop, widest, most = start, 0, 0
            while stop < len(groups):
                wider, more = max(widest, groups[stop][0].size), max(most, len(groups[stop][1]))
                if stop > start and (stop - start + 1) * wider * (self.dim + more) > _BLOCK_ELEMENTS:
                    break
                widest, most, stop = wider, more, stop + 1
            block = groups[start:stop]
            start = stop
            n_q = most
            # Laid out on the host with numpy into a kept workspace (no per-memory torch op, and no fresh
            # pages to fault in on every search), in float64 on the CPU (the product's precision) or
            # float32 for the GPU (widened there); then one product.
            dtype = np.float64 if dev.type == "cpu" else np.float32
            vectors_np = self._workspace("vectors", (len(block), widest, self.dim), dtype)
            asked_np = self._workspace("asked", (len(block), n_q, self.dim), dtype)
            usable_np = np.zeros((len(block), widest), dtype=np.bool_)
            for b, (part, ids) in enumerate(block):
                vectors_np[b, : part.size] = self._stacked_part(part)
                vectors_np[b, part.size :] = 0.0
                asked_np[b, : len(ids)] = queries[ids]
                asked_np[b, len(ids) :] = 0.0
                usable_np[b, : part.size] = ~deleted[part.rows.view]
            vectors = torch.from_numpy(vectors_np).to(dev, torch.float64)
            asked = torch.from_numpy(asked_np).to(dev, torch.float64)
            usable = torch.from_numpy(usable_np).to(dev)
            scores = torch.bmm(asked, vectors.transpose(1, 2)).float()  # [memories, queries, rows]
            del vectors, asked
            scores = torch.where(usable[:, None, :] & (scores > min_score), scores, -torch.inf)
            kk = min(k, widest)
            top, local = torch.sort(scores, dim=2, descending=True, stable=True)
            top, local = top[:, :, :kk].cpu().numpy(), local[:, :, :kk].cpu().numpy()
            for b, (part, ids) in enumerate(block):
                hit = np.isfinite(top[b, : len(ids)])
                rows = part.rows.view[np.minimum(local[b, : len(ids)], part.size - 1)]
                rows_out[ids, :kk] = np.where(hit, rows, -1)
                scores_out[ids, :kk] = np.where(hit, top[b, : len(ids)], 0.0)

    @staticmethod
    def _in_final_order(scores: np.ndarray, live: np.ndarray) -> bool:
        """Whether FAISS's own order already is (score desc, row asc) with the live entries first:
        live entries form a prefix of each list, scores strictly fall along it (no tie to order)."""
        if scores.shape[1] < 2:
            return True
        prefix = not np.any(live[:, 1:] & ~live[:, :-1])
        return prefix and not np.any(live[:, 1:] & (scores[:, 1:] >= scores[:, :-1]))

    def _on_gpu(self, part: _MemoryPart) -> bool:
        return self.use_gpu and "Gpu" in type(part.index).__name__

    @staticmethod
    def _live(
        distances: np.ndarray, labels: np.ndarray, part: _MemoryPart, deleted: np.ndarray, min_score: float
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Global rows, scores and the mask of entries that count: a real, untombstoned row above min_score."""
        rows = np.where(labels >= 0, part.rows.view[np.maximum(labels, 0)], -1)
        live = (labels >= 0) & (distances > min_score)
        live &= ~deleted[np.maximum(rows, 0)]
        return rows, distances, live

    @staticmethod
    def _cut_may_split_ties(
        scores: np.ndarray, labels: np.ndarray, live: np.ndarray, k: int, min_score: float
    ) -> bool:
        """True when a wider fetch could change some query's top k.

        That is when fewer than k live rows came back although the last fetched entry still scored above
        min_score (the rest may lie beyond), or when the k-th live score is not strictly above the last
        fetched score (equal scores beyond the fetch may have lower rows).
        """
        last = scores[:, -1]
        last_real = (labels[:, -1] >= 0) & (last > min_score)
        short = live.sum(axis=1) < k
        if np.any(short & last_real):
            return True
        ranked = -np.sort(-np.where(live, scores, -np.inf), axis=1)
        kth = ranked[:, min(k, ranked.shape[1]) - 1]
        return bool(np.any(~short & (last >= kth)))

    # ------------------------------------------------------------------ persistence
    def save(self, directory: str | Path) -> None:
        """Vectors of every row (.npy, written block by block in row order: no full copy is made),
        row -> memory, tombstones, and each trained FAISS index."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        with open(directory / "vectors.npy", "wb") as handle:
            np.lib.format.write_array_header_1_0(
                handle, {"descr": np.lib.format.dtype_to_descr(np.dtype(np.float32)), "fortran_order": False,
                         "shape": (self.size, self.dim)})
            for lo in range(0, self.size, _NPY_BLOCK_ROWS):
                handle.write(self.vectors(np.arange(lo, min(lo + _NPY_BLOCK_ROWS, self.size))).tobytes())
        np.save(directory / "row_memory.npy", self.row_memory)
        np.save(directory / "deleted.npy", self.deleted)
        trained = {}
        for memory, part in self._parts.items():
            if part.index is not None and part.kind != "Flat":  # saved as is; Flat is rebuilt exactly from vectors
                index = part.index
                if self.use_gpu:
                    try:
                        index = faiss.index_gpu_to_cpu(part.index)
                    except RuntimeError:  # a CPU-only index type (HNSW) stayed on the CPU
                        pass
                name = f"memory_{memory}.faiss"
                faiss.write_index(index, str(directory / name))
                trained[str(memory)] = {"file": name, "kind": part.kind}
        meta = {"dim": self.dim, "factory": self.factory, "nprobe": self.nprobe, "rows": self.size, "trained": trained}
        (directory / "dense.json").write_text(json.dumps(meta, indent=1))

    @classmethod
    def load(cls, directory: str | Path, device: str = "auto", gpu_id: int = 0,
             batched_max_rows: int = BATCHED_MAX_ROWS) -> DenseIndex:
        """The index `save` wrote; vectors.npy is read block by block straight into each memory's store."""
        directory = Path(directory)
        meta_path = directory / "dense.json"
        if not meta_path.exists():
            raise FileNotFoundError(f"DenseIndex.load: {meta_path} not found")
        meta = json.loads(meta_path.read_text())
        index = cls(meta["dim"], meta["factory"], device=device, nprobe=meta["nprobe"], gpu_id=gpu_id,
                    batched_max_rows=batched_max_rows)
        row_memory = np.load(directory / "row_memory.npy").astype(np.int64)
        deleted = np.load(directory / "deleted.npy").astype(np.bool_)
        with open(directory / "vectors.npy", "rb") as handle:
            version = np.lib.format.read_magic(handle)
            read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, fortran, dtype = read_header(handle)
            if fortran or dtype != np.float32 or len(shape) != 2 or shape[1] != index.dim:
                raise ValueError(f"DenseIndex.load: {directory / 'vectors.npy'} holds {dtype} {shape}, "
                                 f"expected float32 [rows, {index.dim}]")
            if not (shape[0] == len(row_memory) == len(deleted) == meta["rows"]):
                raise ValueError(
                    f"DenseIndex.load: {directory}: vectors ({shape[0]}), row_memory ({len(row_memory)}), "
                    f"deleted ({len(deleted)}) and dense.json rows ({meta['rows']}) disagree"
                )
            rows = np.arange(len(row_memory), dtype=np.int64)
            local = np.empty(len(row_memory), dtype=np.int64)
            for lo in range(0, len(row_memory), _NPY_BLOCK_ROWS):
                hi = min(lo + _NPY_BLOCK_ROWS, len(row_memory))
                block = np.fromfile(handle, dtype=np.float32, count=(hi - lo) * index.dim).reshape(hi - lo, index.dim)
                if len(block) != hi - lo:
                    raise ValueError(f"DenseIndex.load: {directory / 'vectors.npy'} is cut short")
                memories = row_memory[lo:hi]
                for memory in np.unique(memories):
                    mask = memories == memory
                    part = index._parts.get(int(memory))
                    if part is None:
                        part = index._parts[int(memory)] = _MemoryPart(index=None, kind="Flat")
                    local[lo:hi][mask] = np.arange(part.size, part.size + int(mask.sum()))
                    part.rows.extend(rows[lo:hi][mask])
                    part.vectors.append(np.ascontiguousarray(block[mask]))
        trained = meta["trained"]
        for memory, part in index._parts.items():
            part.deleted = int(deleted[part.rows.view].sum())
            saved = trained.get(str(int(memory)))
            if saved is None:
                index._place(part, None)
                continue
            faiss_index = faiss.read_index(str(directory / saved["file"]))
            index._set_nprobe(faiss_index)
            part.index, part.kind = index._to_device(faiss_index), saved["kind"]
            if faiss_index.ntotal != part.size:
                raise ValueError(
                    f"DenseIndex.load: {directory / saved['file']} holds {faiss_index.ntotal} vectors, "
                    f"memory {int(memory)} has {part.size}"
                )
        index._row_memory.extend(row_memory)
        index._row_local.extend(local)
        index._deleted.extend(deleted)
        return index
