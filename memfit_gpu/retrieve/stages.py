"""The read path's stage clock keys (diagnostics.json `retrieve_stage_seconds`).

Written by `retrieve.batched` / `retrieve.hybrid` and read back by `memfit profile`: one set of names,
so a misspelt key is an AttributeError instead of a silent 0.0 in the profile.
"""

from __future__ import annotations

import time

import torch

from memfit_gpu.devices import synchronize


class StageKey:
    """Seconds per read-path stage (numbers are SPEC's read-path steps)."""

    QUERIES = "stage_0_queries"  # question embeddings, tokens, constraints
    EPISODES = "stage_1_2_episodes"  # episode hybrid search + boosts
    BM25 = "bm25"  # inside EPISODES (and, with PRF_PREFIX, inside PRF)
    DENSE = "dense"
    FUSE = "fuse"
    BOOST = "boost"  # the torch path's boosts (the Triton path counts them under FUSE)
    SUMMARIES = "stage_3_summaries"
    POOL = "stage_4_5_pool"  # round-robin pool and summary expansion
    PRF = "stage_6_prf"
    PRF_PREFIX = "prf_"  # PRF's own bm25/dense/fuse parts
    PRF_TERMS = "prf_terms"
    PRF_EMBED = "prf_embed"
    PRF_EXPANSION = "prf_expansion"
    RERANK = "stage_7_rerank"
    ADDED = "stage_7_added"  # the stages of retrieve.stages (retrieve/registry.py), when there are any
    PACK = "stage_8_9_pack"


def tick(timings: dict[str, float], key: str, since: float, device: torch.device | None = None) -> float:
    """Add the seconds since `since` to `timings[key]` and return the new clock reading, read after
    `device` has finished its queued work (CUDA launches return early: an unsynchronised clock bills
    one stage's kernels to the next one)."""
    synchronize(device)
    now = time.perf_counter()
    timings[key] = timings.get(key, 0.0) + now - since
    return now
