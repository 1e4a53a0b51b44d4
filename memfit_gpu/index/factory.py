"""The one place that builds a lexical or a dense index from the configuration.

    lexical_index(cfg.index)              -> BM25Index (index.bm25_backend=torch) | ReferenceBM25 (reference)
    dense_index(cfg.index, dim)           -> DenseIndex (index.dense_factory, dense_device, nprobe, batched rows)
    dense_gpu_id(cfg.index)               -> the GPU that GPU FAISS uses

Every path that indexes (the store, ReadView.from_memories, the methods, profile's scaling sweep, the
benchmarks) asks here, so a setting of `index.*` reaches all of them or none. The bi-encoder and the
cross-encoder have their factories beside their backends (index/encoders/backends.py: load_bi_encoder,
load_cross_encoder).

Placement rules, once: the lexical index lives on index.device's first device (devices.first_device:
"gpu" or "cuda:0,cuda:1" put it on the first GPU); GPU FAISS sits on that same GPU, else GPU 0.
"""

from __future__ import annotations

import torch

from memfit_gpu.config import IndexConfig
from memfit_gpu.devices import first_device
from memfit_gpu.index.bm25 import BM25Index
from memfit_gpu.index.bm25_reference import ReferenceBM25
from memfit_gpu.index.dense import DenseIndex
from memfit_gpu.index.protocols import LexicalIndex

__all__ = ["dense_gpu_id", "dense_index", "lexical_device", "lexical_index"]


def lexical_device(cfg: IndexConfig, device: str | torch.device | None = None) -> torch.device:
    """Where the lexical index lives: `device` when given, else index.device's first device."""
    return torch.device(device) if device is not None else first_device(cfg.device)


def lexical_index(cfg: IndexConfig, device: str | torch.device | None = None) -> LexicalIndex:
    """An empty lexical index of index.bm25_backend with index.bm25_k1 and index.bm25_b.

    Args:
        device: overrides the placement rule (profile's scaling sweep on a given device)."""
    kind: type[BM25Index] | type[ReferenceBM25] = BM25Index if cfg.bm25_backend == "torch" else ReferenceBM25
    return kind(k1=cfg.bm25_k1, b=cfg.bm25_b, device=lexical_device(cfg, device))


def dense_gpu_id(cfg: IndexConfig) -> int:
    """The GPU of GPU FAISS: the lexical index's GPU (the retrieval device the plan chose), else GPU 0."""
    device = lexical_device(cfg)
    return (device.index or 0) if device.type == "cuda" else 0


def dense_index(cfg: IndexConfig, dim: int, factory: str | None = None) -> DenseIndex:
    """An empty dense index of `dim`-d vectors with index.dense_factory (or `factory`, for a method whose
    design fixes one), index.dense_device, index.dense_nprobe and index.dense_batched_max_rows."""
    return DenseIndex(int(dim), factory=cfg.dense_factory if factory is None else factory, device=cfg.dense_device,
                      nprobe=cfg.dense_nprobe, gpu_id=dense_gpu_id(cfg), batched_max_rows=cfg.dense_batched_max_rows)
