"""Which implementation encodes: `index.encoder_backend: packed | sentence-transformers`.

    load_bi_encoder(cfg.index)                           -> TextEncoder (the store's and the questions')
    load_cross_encoder(model, device, max_length, dtype, backend, workers) -> PairScorer (rerank.load_reranker)

packed (the default) runs the batched, length-sorted modules of this package; sentence-transformers runs
the library's SentenceTransformer / CrossEncoder on the same weights, devices and dtype (reference.py),
as sentence-transformers itself offers `backend=`. The setting covers both encoders.
"""

from __future__ import annotations

from enum import Enum

from memfit_gpu.config import ConfigError, IndexConfig
from memfit_gpu.index.encoders.bi_encoder import BiEncoder
from memfit_gpu.index.encoders.cross_encoder import CrossEncoderModule
from memfit_gpu.index.encoders.protocols import PairScorer, TextEncoder
from memfit_gpu.index.encoders.reference import ReferenceBiEncoder, ReferenceCrossEncoder

__all__ = ["EncoderBackend", "load_bi_encoder", "load_cross_encoder"]


class EncoderBackend(str, Enum):
    PACKED = "packed"
    SENTENCE_TRANSFORMERS = "sentence-transformers"

    @classmethod
    def parse(cls, value: str | EncoderBackend, setting: str = "index.encoder_backend") -> EncoderBackend:
        try:
            return cls(value)
        except ValueError:
            raise ConfigError(f"{setting}={value!r} is not one of {', '.join(b.value for b in cls)}") from None


def load_bi_encoder(cfg: IndexConfig, device: str | None = None) -> TextEncoder:
    """The bi-encoder `cfg` names: index.encoder on index.device in index.dtype, by index.encoder_backend.

    Args:
        device: overrides cfg.device (a benchmark's --device).
    Raises models.MissingWeightsError when the weights are not available."""
    where = cfg.device if device is None else device
    if EncoderBackend.parse(cfg.encoder_backend) is EncoderBackend.SENTENCE_TRANSFORMERS:
        if not cfg.normalize:
            raise ValueError("index.normalize=false needs index.encoder_backend=packed: sentence-transformers "
                             "applies the model's own Normalize module whatever encode is told")
        return ReferenceBiEncoder.from_pretrained(cfg.encoder, device=where, dtype=cfg.dtype, setting="index.dtype")
    return BiEncoder.from_pretrained(cfg.encoder, device=where, dtype=cfg.dtype, normalize=cfg.normalize,
                                     setting="index.dtype", batch_tokens=cfg.encode_batch_tokens,
                                     workers=cfg.encoder_workers)


def load_cross_encoder(model: str, device: str = "auto", max_length: int = 384, dtype: str = "auto",
                       backend: str | EncoderBackend = EncoderBackend.PACKED, workers: str = "auto") -> PairScorer:
    """The cross-encoder `model` (hub id or folder) on `device` in `dtype` (rerank.dtype), by `backend`;
    `workers` (index.encoder_workers) feeds replicas on several devices (packed only).

    Raises models.MissingWeightsError when the weights are not available."""
    if EncoderBackend.parse(backend) is EncoderBackend.SENTENCE_TRANSFORMERS:
        return ReferenceCrossEncoder.from_pretrained(model, device=device, max_length=max_length, dtype=dtype,
                                                     setting="rerank.dtype")
    return CrossEncoderModule.from_pretrained(model, device=device, max_length=max_length, dtype=dtype,
                                              setting="rerank.dtype", workers=workers)
