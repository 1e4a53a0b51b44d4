"""Rerank (SPEC read path 7): which candidates, which backend, and the standardisation.

Candidates: pool[:rerank_pool] followed by every expansion (summary members, then PRF).
Backend "cross-encoder": the cross-encoder's `score` (index.encoder_backend: packed `CrossEncoderModule`
or sentence-transformers' CrossEncoder) over ALL (question, passage) pairs of the batch in
one call; a summary's passage is its text + summary_suffix; scores are z-scored (population std)
separately within the episodes and within the summaries of each question, a kind with fewer than
`zscore_min` items keeps its raw scores (and a kind whose scores are all equal gets 0); then all sort
together, ties keeping candidate order. Backend "none" keeps the first-stage order: the same stable
sort on the first-stage scores. There is no bi-encoder fallback: a missing cross-encoder is an error.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from memfit_gpu.config import IndexConfig, RerankConfig
from memfit_gpu.index.encoders import PairScorer, load_cross_encoder

log = logging.getLogger(__name__)


def load_reranker(cfg: RerankConfig, index: IndexConfig | None = None, device: str | None = None) -> PairScorer | None:
    """The cross-encoder for rerank.backend=cross-encoder (index/encoders/backends.load_cross_encoder), None
    for rerank.backend=none.

    Args:
        index: the run's index settings: the cross-encoder shares index.device, index.encoder_backend and
            index.encoder_workers with the bi-encoder (default: IndexConfig()).
        device: overrides index.device (where the plan placed retrieval).
    Raises models.MissingWeightsError (with how to get the weights, or to choose
    rerank.backend=none) when the weights are not available."""
    if cfg.backend == "none":
        return None
    if cfg.backend != "cross-encoder":
        raise ValueError(f"rerank.backend={cfg.backend!r} is not one of cross-encoder, none")
    return load_cross_encoder(cfg, index if index is not None else IndexConfig(), device)


def reranker_info(cfg: RerankConfig, module: PairScorer | None) -> dict[str, Any]:
    """What ranked the candidates, recorded in every output."""
    if module is None:
        return {"backend": "none", "order": "first-stage (fused + boosts, expansion scores)"}
    return {"backend": "cross-encoder", "model": cfg.model, "max_length": cfg.max_length, "weights": module.info()}


def zscore(scores: torch.Tensor, groups: torch.Tensor, min_items: int) -> torch.Tensor:
    """Standardise [Q, N] scores within each (question, group); group -1 = pad (left as is).

    Population std; groups with fewer than `min_items` members keep raw scores; zero std gives 0."""
    out = scores.clone()
    for g in groups.unique().tolist():
        if g < 0:
            continue
        mask = groups == g
        count = mask.sum(1, keepdim=True)
        vals = torch.where(mask, scores, 0.0)
        mean = vals.sum(1, keepdim=True) / count.clamp(min=1)
        var = (torch.where(mask, scores - mean, 0.0) ** 2).sum(1, keepdim=True) / count.clamp(min=1)
        std = var.sqrt()
        z = torch.where(std > 0, (scores - mean) / torch.where(std > 0, std, 1.0), 0.0)
        use = mask & (count >= min_items)
        out = torch.where(use, z, out)
    return out


def cross_encoder_scores(module: PairScorer, questions: Sequence[str], passages: Sequence[Sequence[str]],
                         batch_size: int, progress: bool = False) -> list[list[float]]:
    """Score every (question, passage) pair of the batch in one call; per-question lists back."""
    pairs = [(q, p) for q, ps in zip(questions, passages, strict=False) for p in ps]
    if not pairs:
        return [[] for _ in questions]
    flat = module.score(pairs, batch_size=batch_size, progress=progress).double().tolist()
    out, offset = [], 0
    for ps in passages:
        out.append(flat[offset: offset + len(ps)])
        offset += len(ps)
    return out


def final_order(scores: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Column order: score descending, ties in candidate order, pads last."""
    return torch.where(valid, scores, -torch.inf).argsort(dim=1, descending=True, stable=True)
