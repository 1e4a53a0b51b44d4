"""Dense episode index on FAISS: inner product over L2-normalised rows (= cosine), one index per memory.

Rows are global integers in add order across all memories (the store's episode or summary rows).
Each memory owns its own FAISS index, so a query can only ever see its own memory's rows: isolation
by construction, not by filtering. A batch of queries is grouped by memory and each group is one
FAISS call.

Deletion is a tombstone mask, identical for every factory (HNSW and GPU indexes cannot remove ids);
a search over-fetches by the memory's tombstone count so k live results still come back.

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
    """One memory's FAISS index; FAISS labels are local positions 0..n-1 mapped to global rows."""

    index: faiss.Index
    kind: str  # the factory actually built: the configured one, or "Flat" when too few vectors to train
    rows: GrowableArray = field(default_factory=lambda: GrowableArray(np.int64))
    vectors: list[np.ndarray] = field(default_factory=list)  # kept so a Flat fallback can be retrained
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
    """

    def __init__(self, dim: int, factory: str = "Flat", device: str = "auto", nprobe: int = 16,
                 gpu_id: int = 0):
        self.dim = int(dim)
        self.factory = factory
        self.nprobe = int(nprobe)
        self.device = device
        self.gpu_id = int(gpu_id)
        self.use_gpu, self.placement = faiss_placement(device, self.gpu_id)
        self._gpu_resources = faiss.StandardGpuResources() if self.use_gpu else None
        self._parts: dict[int, _MemoryPart] = {}
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
        part = self._parts[memory_idx]
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
        # One FAISS add per memory present in the batch, rows in input order within it.
        for memory in np.unique(memories):
            mask = memories == memory
            chunk = vectors[mask]
            part = self._parts.get(int(memory))
            start = 0 if part is None else part.size
            local[mask] = np.arange(start, start + len(chunk))
            if part is None:
                index, kind = self._build_part(chunk)
                part = _MemoryPart(index=index, kind=kind)
                self._parts[int(memory)] = part
            elif part.kind != self.factory and self._needs_training and part.size + len(chunk) >= self._min_train:
                # The memory has grown enough to train the configured factory: rebuild from stored vectors.
                all_vectors = np.concatenate([self._stacked(int(memory)), chunk])
                part.index, part.kind = self._build_part(all_vectors)
                log.debug("DenseIndex: memory %d reached %d vectors, now %s", memory, len(all_vectors), part.kind)
            else:
                part.index.add(chunk)
            part.rows.extend(rows[mask])
            part.vectors.append(chunk.copy())
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
        for memory in np.unique(memories):
            part = self._parts.get(int(memory))
            if part is None or part.size == part.deleted:
                continue
            query_ids = np.flatnonzero(memories == memory)
            # GPU FAISS answers at most 2048 neighbours per query
            most = part.size if not self._on_gpu(part) else min(part.size, _GPU_MAX_K)
            fetch = min(most, k + part.deleted + _TIE_MARGIN)
            while True:
                distances, labels = part.index.search(queries[query_ids], fetch)
                rows, scores, live = self._live(distances, labels, part, deleted, min_score)
                # Fetch again, wider, only when the cut at k could split a run of equal scores (or when
                # fewer than k live rows came back although the last fetched one was still live).
                if fetch >= most or not self._cut_may_split_ties(scores, labels, live, k, min_score):
                    break
                fetch = min(most, 2 * fetch)
            if self._in_final_order(scores, live):
                rows, scores, live = rows[:, :k], scores[:, :k], live[:, :k]
            else:
                order = np.lexsort((np.where(live, rows, np.iinfo(np.int64).max), np.where(live, -scores, np.inf)),
                                   axis=-1)[:, :k]
                live = np.take_along_axis(live, order, axis=1)
                rows = np.take_along_axis(rows, order, axis=1)
                scores = np.take_along_axis(scores, order, axis=1)
            width = rows.shape[1]
            rows_out[query_ids, :width] = np.where(live, rows, -1)
            scores_out[query_ids, :width] = np.where(live, scores, 0.0)
        return torch.from_numpy(scores_out), torch.from_numpy(rows_out)

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
        """Vectors of every row (.npy), row -> memory, tombstones, and each trained FAISS index."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        vectors = self.vectors(np.arange(self.size)) if self.size else np.empty((0, self.dim), np.float32)
        np.save(directory / "vectors.npy", vectors)
        np.save(directory / "row_memory.npy", self.row_memory)
        np.save(directory / "deleted.npy", self.deleted)
        trained = {}
        for memory, part in self._parts.items():
            if part.kind != "Flat":  # a trained index is saved as is; Flat is rebuilt exactly from vectors
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
    def load(cls, directory: str | Path, device: str = "auto", gpu_id: int = 0) -> DenseIndex:
        directory = Path(directory)
        meta_path = directory / "dense.json"
        if not meta_path.exists():
            raise FileNotFoundError(f"DenseIndex.load: {meta_path} not found")
        meta = json.loads(meta_path.read_text())
        index = cls(meta["dim"], meta["factory"], device=device, nprobe=meta["nprobe"], gpu_id=gpu_id)
        vectors = np.load(directory / "vectors.npy")
        row_memory = np.load(directory / "row_memory.npy")
        deleted = np.load(directory / "deleted.npy")
        if not (len(vectors) == len(row_memory) == len(deleted) == meta["rows"]):
            raise ValueError(
                f"DenseIndex.load: {directory}: vectors ({len(vectors)}), row_memory ({len(row_memory)}), "
                f"deleted ({len(deleted)}) and dense.json rows ({meta['rows']}) disagree"
            )
        trained = meta["trained"]
        rows = np.arange(len(vectors), dtype=np.int64)
        local = np.empty(len(vectors), dtype=np.int64)
        for memory in np.unique(row_memory):
            mask = row_memory == memory
            chunk = np.ascontiguousarray(vectors[mask])
            local[mask] = np.arange(len(chunk))
            saved = trained.get(str(int(memory)))
            if saved is None:
                faiss_index = index._to_device(index._new_faiss("Flat"))
                faiss_index.add(chunk)
                kind = "Flat"
            else:
                faiss_index = faiss.read_index(str(directory / saved["file"]))
                index._set_nprobe(faiss_index)
                faiss_index = index._to_device(faiss_index)
                kind = saved["kind"]
                if faiss_index.ntotal != len(chunk):
                    raise ValueError(
                        f"DenseIndex.load: {directory / saved['file']} holds {faiss_index.ntotal} vectors, "
                        f"memory {int(memory)} has {len(chunk)}"
                    )
            part = _MemoryPart(index=faiss_index, kind=kind)
            part.rows.extend(rows[mask])
            part.vectors.append(chunk)
            part.deleted = int(deleted[mask].sum())
            index._parts[int(memory)] = part
        index._row_memory.extend(row_memory.astype(np.int64))
        index._row_local.extend(local)
        index._deleted.extend(deleted.astype(np.bool_))
        return index
