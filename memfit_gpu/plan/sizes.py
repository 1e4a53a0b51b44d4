"""Bytes per unit of every part the plan counts, with where each number comes from, and the known models."""

from __future__ import annotations

from typing import Any

import torch

GIB = 2**30


MIB = 2**20


# BM25Index (index/bm25.py, state format 2): its state_dict tensors, what a snapshot holds.
BM25_STATE_BYTES_PER_POSTING = 4 + 4  # post_term int32 + post_tf int32


BM25_STATE_BYTES_PER_ROW = 8 + 8 + 8 + 1  # row_memory, row_len, row_post_start int64 + deleted bool


BM25_STATE_BYTES_PER_TERM = 4 + 8  # term_token int32 + term_memory int64


# The live index keeps no per-posting row column; it adds df and the term's place among its memory's
# terms (term slots, `_prepare`), int64 each per term, to the state's tensors ...
BM25_LIVE_BYTES_PER_POSTING = BM25_STATE_BYTES_PER_POSTING


BM25_LIVE_BYTES_PER_TERM = BM25_STATE_BYTES_PER_TERM + 8 + 8


# ... in GrowableTensor buffers whose capacity runs ahead of their size: one big append (today's one-batch
# write) leaves none, growth by doubling up to 2x; 1.25 is branch scale's growth step for large buffers.
BM25_GROWTH_SLACK = 1.25


# The search cache `_prepare` builds on the first search: post_col int32 + post_weight float32 per posting,
# term_ptr + slot + dense_slot int64 per term, rows_by_memory int64 per row, and a float64 [dense terms x
# widest memory] matrix of the terms in at least 1/8 of the widest memory's rows (bm25_postings.py _DENSE_FACTOR).
BM25_CACHE_BYTES_PER_POSTING = 4 + 4


BM25_CACHE_BYTES_PER_TERM = 8 + 8 + 8


BM25_CACHE_BYTES_PER_ROW = 8


BM25_DENSE_FACTOR = 8


# Transient peak of `_prepare` above the index and its cache: sorted terms and their sort order, gathered
# rows, float64 tf / idf / norm / weight intermediates. Measured: RSS peak over RSS before `_prepare` on a
# 5.3M-posting synthetic index on the CPU was 77.7 B per posting, of which 19 B the cache it keeps.
BM25_PREPARE_PEAK_BYTES_PER_POSTING = 60


# ... and since state format 2 `_prepare` works in slices of this many postings (bm25_postings.py PREPARE_SLICE),
# so the transient is bounded by a slice, whatever the index's size.
BM25_PREPARE_SLICE_POSTINGS = 1 << 22


# Host side of BM25, always: the vocabulary (a dict per memory + the term -> token list). Measured with
# tracemalloc on LoCoMo: 64 B per term of dict and list entries, plus the token's own str (49 B header +
# ~6 characters); and per token (fewer than terms, so counted per term as a bound) the PRF term order's
# rank and length (int64 each) and its place in the sorted token list (a reference).
BM25_HOST_BYTES_PER_TERM = 120 + 24


# DenseIndex (index/dense.py): float32 rows (IndexFlatIP) ...
VECTOR_BYTES_PER_DIM = 4


# ... of which the host keeps one copy per memory (_MemoryPart.vectors, for a Flat fallback) wherever
# FAISS runs; a CPU FAISS index holds a second; row -> memory, row -> local int64 and a tombstone bool.
DENSE_HOST_BYTES_PER_ROW = 8 + 8 + 1


# FAISS StandardGpuResources: a temporary-memory stack per resources object and device, 1.5 GiB on GPUs
# above 8 GiB, 1 GiB up to 8 GiB, 512 MiB up to 4 GiB (faiss/gpu/StandardGpuResources.cpp,
# getDefaultTempMemForGPU), and 256 MiB of pinned host memory (kDefaultPinnedMemoryAllocation).
FAISS_PINNED_HOST_BYTES = 256 * MIB


# CUDA context of one process on one GPU (CUDA runtime, cuBLAS handles, torch's lazily loaded kernels).
# Not measured here (no GPU on this machine): torch 2.x with lazy module loading typically shows
# 300-600 MiB per process and GPU in nvidia-smi; the larger figure is taken.
CUDA_CONTEXT_BYTES = 600 * MIB


# Encoders (bi-encoder and cross-encoder, index/encoders/): activations of one batch, per token of the
# batch: the hidden state, its residual and Q, K, V, the attention output (6 x hidden) and the FFN's
# intermediate and its activation (2 x intermediate), in the compute dtype. Counted from the BERT layer,
# not measured (no GPU here); batches are length-sorted and packed, so real use is at or below this.
ENCODER_LIVE_HIDDEN = 6


ENCODER_LIVE_INTERMEDIATE = 2


# Host side of the data and the store. Measured with tracemalloc on LoCoMo: the loaded benchmark holds
# 965 B per turn of which 124 B are its text; the store's columns hold an episode's text (as stored,
# UTF-8) plus ~1 kB of metadata (2,559 B per episode resident with its 1,536 B vector copy).
BENCHMARK_BYTES_PER_TURN = 850


STORE_BYTES_PER_EPISODE = 1000


# The write path (store.add_memories) holds every new episode at once today: its record (~600 B,
# tracemalloc: 1,250 B per episode above resident at LoCoMo's 37.5 tokens per episode, with its tokens),
# its BM25 tokens as Python str (58 B each, tracemalloc), its vector (float32), and the encoder's input
# ids: 1.4 word pieces per BM25 token on LoCoMo (MiniLM's tokenizer, measured), at most max_length per
# text, 360 B per word piece (ru_maxrss growth over BiEncoder._tokenize of 8 x LoCoMo's texts, 2.4M word
# pieces: the Python id lists are 49 B of it, tracemalloc; the rest the tokenizer's own allocations).
WRITE_RECORD_BYTES_PER_EPISODE = 600


PY_TOKEN_BYTES = 58


WORDPIECES_PER_TOKEN = 1.4


ENCODER_INPUT_BYTES_PER_WORDPIECE = 360


# memfit's own process: interpreter, torch, transformers, faiss (RSS after imports on the CPU ~1 GiB;
# the CUDA libraries add about as much once CUDA is initialised).
PROCESS_HOST_BYTES = 2 * GIB


# vLLM engine (readers/vllm.py + vllm_worker.py): beyond weights and KV cache an engine needs its
# activation profile run, sampler and CUDA graphs (not measured here: vLLM logs ~1-3 GiB of
# "non-KV" memory for 7-30B models), and each engine is a Python process holding torch and vLLM in host
# memory (rough: ~4 GiB RSS per GPU worker). Weights are read through mmap (page cache, not counted).
VLLM_RUNTIME_BYTES = 3 * GIB


VLLM_HOST_BYTES_PER_GPU = 4 * GIB


VLLM_CPU_KV_DEFAULT_GIB = 2  # readers/vllm.py: VLLM_CPU_KVCACHE_SPACE unless set


# Summaries (store/summaries.py): at most summary.max_summaries per memory, one per segment of at least
# summary.min_segment episodes; a summary is two sentences (~40 distinct terms, ~300 characters).
SUMMARY_TERMS = 40


SUMMARY_TEXT_BYTES = 300


# Workload sampling: whole memories, seeded order, until this many episodes are tokenised.
SAMPLE_EPISODES = 20_000


# Published shapes when the benchmark file is not here: each benchmark's spec (data/spec.py PublishedShape,
# in its loader module); data/synth.py LIKES gives the synthetic sessions and turns that stand in for it.
# Distinct terms grow slower than tokens: distinct ~ tokens^0.69 per episode (LoCoMo 37.5 -> 34.0,
# LongMemEval oracle sample 208 -> 111, measured here); synthetic turns are scaled to published lengths by it.
HEAPS_EXPONENT = 0.69


# Readers and encoders when no weights are on disk: parameters, bytes of the published checkpoint and its
# dtype, and the shapes that size KV cache and activations (each model's config.json on the hub).
KNOWN_MODELS: dict[str, dict[str, Any]] = {
    "sentence-transformers/all-MiniLM-L6-v2": {"weight_bytes": 90_868_376, "dtype": "float32", "hidden_size": 384,
                                               "intermediate_size": 1536, "num_hidden_layers": 6,
                                               "num_attention_heads": 12, "max_position_embeddings": 512},
    "cross-encoder/ms-marco-MiniLM-L-6-v2": {"weight_bytes": 90_866_412, "dtype": "float32", "hidden_size": 384,
                                             "intermediate_size": 1536, "num_hidden_layers": 6,
                                             "num_attention_heads": 12, "max_position_embeddings": 512},
    "HuggingFaceTB/SmolLM2-135M-Instruct": {"weight_bytes": 269_060_552, "dtype": "bfloat16", "hidden_size": 576,
                                            "num_hidden_layers": 30, "num_attention_heads": 9,
                                            "num_key_value_heads": 3, "head_dim": 64, "max_position_embeddings": 8192},
    "Qwen/Qwen3-8B": {"weight_bytes": 16_381_470_720, "dtype": "bfloat16", "hidden_size": 4096,
                      "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                      "max_position_embeddings": 40960},
    "google/gemma-3-27b-it": {"weight_bytes": 54_867_000_000, "dtype": "bfloat16", "hidden_size": 5376,
                              "num_hidden_layers": 62, "num_attention_heads": 32, "num_key_value_heads": 16,
                              "head_dim": 128, "max_position_embeddings": 131072},
    "Qwen/Qwen2.5-VL-7B-Instruct": {"weight_bytes": 16_584_333_312, "dtype": "bfloat16", "hidden_size": 3584,
                                    "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
                                    "head_dim": 128, "max_position_embeddings": 128000},
    # MXFP4 experts: the checkpoint's bytes are what the GPU holds (quantised: no dtype scaling)
    "openai/gpt-oss-20b": {"weight_bytes": 13_761_264_768, "dtype": "mxfp4", "hidden_size": 2880,
                           "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8,
                           "head_dim": 64, "max_position_embeddings": 131072},
}


_DTYPE_BYTES = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2, torch.float64: 8}


def bm25_bytes(postings: int, rows: int, terms: int, dense_terms: int = 0, width: int = 0) -> dict[str, int]:
    """Predicted bytes of one BM25Index: `state` (its state_dict tensors), `live` (its tensors, with growth
    slack), `cache` (the search cache), `peak` (the first search's preparation, above live + cache) and
    `host` (the vocabulary, in Python wherever the tensors are)."""
    return {
        "state": postings * BM25_STATE_BYTES_PER_POSTING + rows * BM25_STATE_BYTES_PER_ROW
        + terms * BM25_STATE_BYTES_PER_TERM,
        "live": int((postings * BM25_LIVE_BYTES_PER_POSTING + rows * BM25_STATE_BYTES_PER_ROW
                     + terms * BM25_LIVE_BYTES_PER_TERM) * BM25_GROWTH_SLACK),
        "cache": postings * BM25_CACHE_BYTES_PER_POSTING + terms * BM25_CACHE_BYTES_PER_TERM
        + rows * BM25_CACHE_BYTES_PER_ROW + dense_terms * width * 8,
        "peak": min(postings, BM25_PREPARE_SLICE_POSTINGS) * BM25_PREPARE_PEAK_BYTES_PER_POSTING,
        "host": terms * BM25_HOST_BYTES_PER_TERM,
    }


def vector_bytes(rows: int, dim: int) -> int:
    """One copy of a dense index's vectors (float32 rows)."""
    return rows * dim * VECTOR_BYTES_PER_DIM


def _dtype_bytes(dtype: torch.dtype) -> int:
    return _DTYPE_BYTES.get(dtype, 4)


def _faiss_temp_bytes(total: int) -> int:
    if total <= 4 * GIB:
        return 512 * MIB
    if total <= 8 * GIB:
        return GIB
    return 1536 * MIB
