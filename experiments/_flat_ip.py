"""An exact numpy stand-in for the part of FAISS that `memfit_gpu.index.dense` uses with factory "Flat".

The GPU check installs it as `faiss` (`install()`) before it imports the package, on the CPU side and
the GPU side alike, so both search dense vectors with the same code and every difference the check
reports comes from torch or Triton. The GPU machine has no FAISS at all; this replaces it there.

What it implements is what dense.py calls for Flat: `index_factory(d, "Flat", METRIC_INNER_PRODUCT)`
(any other factory raises RuntimeError, as FAISS does for one it cannot build), `IndexFlatIP` with `d`,
`ntotal`, `is_trained`, `metric_type`, `add`, `search`; `extract_index_ivf` raising RuntimeError (a Flat
index has no IVF); `get_num_gpus() == 0` and no `StandardGpuResources` (a CPU build).

`search(x, k)` keeps FAISS's result contract: per query the k largest inner products, descending, as
float32 [n, k] with int64 labels [n, k]; when k exceeds ntotal the tail holds label -1 and distance
-FLT_MAX. Two things are stricter than FAISS, so results never depend on the batch or the machine's BLAS:
- each inner product is a float64 sum of the exact float32 x float32 products (numpy's einsum, no BLAS),
  rounded once to float32, computed query by query: the same bits for a query whatever else it is
  searched with, where FAISS's BLAS path depends on the batch shape;
- ties are broken by the lower label, where FAISS leaves their order unspecified (dense.py sorts ties
  itself, and over-fetches until a cut cannot split them).
"""

from __future__ import annotations

import sys
from types import ModuleType

import numpy as np

METRIC_INNER_PRODUCT = 0
METRIC_L2 = 1
_FLT_MAX = float(np.finfo(np.float32).max)


class Index:
    """Base type, for annotations (`faiss.Index`)."""


class IndexFlatIP(Index):
    """Exact inner-product search over every stored vector."""

    def __init__(self, d: int):
        self.d = int(d)
        self.metric_type = METRIC_INNER_PRODUCT
        self.is_trained = True
        self._blocks: list[np.ndarray] = []
        self._stacked = np.zeros((0, self.d), dtype=np.float32)

    @property
    def ntotal(self) -> int:
        return int(sum(len(b) for b in self._blocks))

    def _matrix(self, x: np.ndarray, what: str) -> np.ndarray:
        array = np.asarray(x)
        if array.dtype != np.float32 or array.ndim != 2 or array.shape[1] != self.d:
            raise ValueError(f"IndexFlatIP.{what}: expected float32 [n, {self.d}], got {array.dtype} {array.shape}")
        return np.ascontiguousarray(array)

    def add(self, x: np.ndarray) -> None:
        self._blocks.append(self._matrix(x, "add").copy())

    def _vectors(self) -> np.ndarray:
        if len(self._stacked) != self.ntotal:
            self._stacked = np.concatenate(self._blocks) if self._blocks else self._stacked
            self._blocks = [self._stacked]
        return self._stacked

    def inner_products(self, x: np.ndarray) -> np.ndarray:
        """[n, ntotal] float32: float64 sums of the exact products, rounded once; one query at a time, so
        the same loop computes a query's row whatever the batch (about as fast as one batched einsum)."""
        queries = self._matrix(x, "search").astype(np.float64)
        stored = self._vectors().astype(np.float64)
        out = np.empty((len(queries), len(stored)), dtype=np.float32)
        for i, query in enumerate(queries):
            out[i] = np.einsum("nd,d->n", stored, query)
        return out

    def search(self, x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        k = int(k)
        if k <= 0:
            raise AssertionError("k > 0")  # what FAISS's Python wrapper raises
        scores = self.inner_products(x)
        n, total = scores.shape
        distances = np.full((n, k), -_FLT_MAX, dtype=np.float32)
        labels = np.full((n, k), -1, dtype=np.int64)
        if total == 0 or n == 0:
            return distances, labels
        # a stable sort on the negated scores: descending, equal scores in label order
        order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
        width = order.shape[1]
        labels[:, :width] = order
        distances[:, :width] = np.take_along_axis(scores, order, axis=1)
        return distances, labels


def index_factory(d: int, description: str, metric: int = METRIC_L2) -> Index:
    if description != "Flat" or metric != METRIC_INNER_PRODUCT:
        raise RuntimeError(f"flat-ip stand-in: only index_factory(d, 'Flat', METRIC_INNER_PRODUCT), not "
                           f"({description!r}, metric {metric})")
    return IndexFlatIP(d)


def extract_index_ivf(index: Index) -> Index:
    raise RuntimeError("flat-ip stand-in: a Flat index has no IVF")


def get_num_gpus() -> int:
    return 0


def install() -> ModuleType:
    """Make `import faiss` return this module (call before memfit_gpu.index.dense is imported)."""
    module = sys.modules[__name__]
    already = sys.modules.get("faiss")
    if already is not None and already is not module and "memfit_gpu.index.dense" in sys.modules:
        raise RuntimeError("flat-ip stand-in: memfit_gpu.index.dense already imported the real faiss")
    sys.modules["faiss"] = module
    return module
