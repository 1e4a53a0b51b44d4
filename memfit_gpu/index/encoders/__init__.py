"""Transformer encoders: a bi-encoder (embeddings) and a cross-encoder (pair scores), two backends.

    protocols.py      TextEncoder / PairScorer: the interface every backend offers; the input checks
    backends.py       index.encoder_backend (packed | sentence-transformers); load_bi_encoder, load_cross_encoder
    batching.py       the packed modules' plan: length sort, token budgets, replicas, OOM halving
    tokens.py         Tokens: tokenised inputs as one flat id array with row offsets
    workers.py        one worker process per device (index.encoder_workers=processes)
    packed_bert.py    BERT forward without work on padding ([CLS]-only last block for the cross-encoder); its
                      linear layers through memfit_gpu.onednn (oneDNN with packed weights where it is available)
    layout.py         pooling / normalisation / activation as sentence-transformers reads a model folder
    bi_encoder.py     BiEncoder: SentenceTransformer.encode(normalize_embeddings=True), batched
    cross_encoder.py  CrossEncoderModule: CrossEncoder.predict, batched; random_cross_encoder (tests, benchmarks)
    reference.py      the sentence-transformers backend behind the same interface
"""

from __future__ import annotations

from memfit_gpu.index.encoders.backends import EncoderBackend, load_bi_encoder, load_cross_encoder
from memfit_gpu.index.encoders.bi_encoder import BiEncoder
from memfit_gpu.index.encoders.cross_encoder import CrossEncoderModule, random_cross_encoder
from memfit_gpu.index.encoders.protocols import PairScorer, TextEncoder
from memfit_gpu.index.encoders.reference import ReferenceBiEncoder, ReferenceCrossEncoder

__all__ = [
    "BiEncoder", "CrossEncoderModule", "EncoderBackend", "PairScorer", "ReferenceBiEncoder", "ReferenceCrossEncoder",
    "TextEncoder", "load_bi_encoder", "load_cross_encoder", "random_cross_encoder",
]
