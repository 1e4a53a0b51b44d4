"""Which implementation encodes: `index.encoder_backend: packed | sentence-transformers`.

    load_bi_encoder(cfg.index)                  -> TextEncoder (the store's, the questions', every method's)
    load_cross_encoder(cfg.rerank, cfg.index)   -> PairScorer (rerank.load_reranker)

These are the only builders of an encoder from the configuration: every path (the store, the methods,
profile, the benchmarks) calls them, so index.encoder_backend, index.dtype, index.normalize, the token
budget and the workers reach every encoder a run loads. Each `info()` names its `encoder_backend`, which
the outputs record.

packed (the default) runs the batched, length-sorted modules of this package; sentence-transformers runs
the library's SentenceTransformer / CrossEncoder on the same weights, devices and dtype (reference.py),
as sentence-transformers itself offers `backend=`. The setting covers both encoders.
"""

from __future__ import annotations

from enum import Enum

from memfit_gpu.config import ConfigError, IndexConfig, RerankConfig
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


def load_cross_encoder(rerank: RerankConfig, index: IndexConfig, device: str | None = None) -> PairScorer:
    """The cross-encoder rerank.model on index.device (the bi-encoder's devices) in rerank.dtype, by
    index.encoder_backend, fed by index.encoder_workers (packed only).

    Args:
        device: overrides index.device (where the plan placed retrieval, a benchmark's --device).
    Raises models.MissingWeightsError when the weights are not available."""
    where = index.device if device is None else device
    if EncoderBackend.parse(index.encoder_backend) is EncoderBackend.SENTENCE_TRANSFORMERS:
        return ReferenceCrossEncoder.from_pretrained(rerank.model, device=where, max_length=rerank.max_length,
                                                     dtype=rerank.dtype, setting="rerank.dtype")
    return CrossEncoderModule.from_pretrained(rerank.model, device=where, max_length=rerank.max_length,
                                              dtype=rerank.dtype, setting="rerank.dtype", workers=index.encoder_workers)
