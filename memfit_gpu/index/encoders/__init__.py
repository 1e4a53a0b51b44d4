"""Transformer encoders: a bi-encoder (embeddings) and a cross-encoder (pair scores).

    protocols.py      TextEncoder / PairScorer: the interface every backend offers; the input checks
    batching.py       the packed modules' plan: length sort, token budgets, replicas, OOM halving
    packed_bert.py    BERT forward without work on padding ([CLS]-only last block for the cross-encoder)
    onednn.py         the private oneDNN ops, fenced behind a probe, with F.linear as the public fallback
    layout.py         pooling / normalisation / activation as sentence-transformers reads a model folder
    bi_encoder.py     BiEncoder: SentenceTransformer.encode(normalize_embeddings=True), batched
    cross_encoder.py  CrossEncoderModule: CrossEncoder.predict, batched; random_cross_encoder (tests, benchmarks)
"""

from __future__ import annotations

from memfit_gpu.index.encoders.bi_encoder import BiEncoder
from memfit_gpu.index.encoders.cross_encoder import CrossEncoderModule, random_cross_encoder
from memfit_gpu.index.encoders.protocols import PairScorer, TextEncoder

__all__ = ["BiEncoder", "CrossEncoderModule", "PairScorer", "TextEncoder", "random_cross_encoder"]
