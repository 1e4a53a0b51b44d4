"""The device plan: where each part of a run lives and how much host and GPU memory it takes, decided
from the configuration and a node description before anything loads (issue 14, part 2).

    node = describe_node()                                   # this machine: visible GPUs, their memory, host RAM
    node = described_node(gpus=4, gpu_mem_gib=96, host_mem_gib=512)
    plan = make_plan(cfg, node)       # workload from the benchmark file, else the benchmark's published shape
    print(render(plan)); plan.check() # ConfigError naming the key to change when the run cannot fit
    run_cfg = plan.placed(cfg)        # index.device as the plan placed retrieval (what `memfit run` builds with)

Placement, as `memfit run` does it:
- vLLM engines (reader.backend=vllm): reader.instances groups of reader.tensor_parallel_size GPUs, the
  first visible GPUs in order (readers/vllm.py gpu_groups); each engine claims
  reader.gpu_memory_utilization of every GPU of its group, and vLLM refuses to start when less is free.
  A vLLM judge (eval.judge.backend=vllm) starts its own engines on the same GPUs: a second claim.
- Retrieval (bi-encoder and cross-encoder replicas, both BM25 indexes) with index.device=auto: on the GPUs
  the engines do not use when there are any; else on GPU 0 alone (one CUDA context beside the engines
  instead of one on every GPU); without GPUs on the CPU. An explicit index.device is kept as written.
- Dense indexes (episodes, summaries): GPU FAISS on GPU 0 when index.dense_device is auto or gpu, FAISS
  has GPU support and the node has a GPU (EpisodeStore passes DenseIndex no gpu_id), else the CPU. Each
  index owns a StandardGpuResources with its own temporary pool.
- transformers readers (reader, judge): in memfit's process on the first GPU (else the CPU), or spread
  over every GPU by accelerate with reader.device_map=auto.
- OpenAI-compatible servers are not memfit's: their memory is not counted (a server on this node is
  outside the plan: keep it off the GPUs memfit sees, e.g. CUDA_VISIBLE_DEVICES).

Fit: on every GPU, memfit's resident parts + the largest transient peak of one part + one CUDA context
for memfit's process + the engines' claims <= the GPU's memory; on the host, the resident parts + the
largest transient <= RAM (the cgroup limit when lower). On a node without GPUs only the host is checked.

Sizes are bytes per unit (the constants below, each with where it comes from) times the workload: from
the benchmark file when it is there (episodes, questions and texts counted; distinct BM25 terms from a
seeded sample of whole memories tokenised with index.tokenize), else from the benchmark's published shape
(data/synth.py shapes, turn length scaled to the published history length). Model sizes come from the
weights on disk (models.find_local: never a download), else from a small table of known models, else
they are "unknown" and said so loudly.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from memfit_gpu.config import ConfigError, MemFitConfig, ReaderConfig
from memfit_gpu.data import DataNotFoundError, load_benchmark, resolve_data_path, select_from_config
from memfit_gpu.data.registry import benchmark_spec
from memfit_gpu.data.schema import Memory
from memfit_gpu.data.synth import LIKES, iter_memories
from memfit_gpu.devices import gpu_count, parse_dtype, reader_dtype, resolve_dtype, visible_devices
from memfit_gpu.evaluate.judge import reader_config_for_judge
from memfit_gpu.index.encoders.batching import Workers, default_batch_tokens
from memfit_gpu.index.tokenize import tokenize_many
from memfit_gpu.models import find_local
from memfit_gpu.readers.registry import backend_entry, engine_groups
from memfit_gpu.store.text import episode_text

try:  # faiss is an either/or extra; the plan only asks whether this build has GPU support
    import faiss
except ImportError:  # pragma: no cover - memfit's install always has one of them
    faiss = None

__all__ = ["GIB", "Gpu", "ModelSize", "Node", "Part", "Plan", "Problem", "Workload", "describe_node",
           "bm25_bytes", "described_node", "estimate_workload", "make_plan", "model_size", "render", "vector_bytes",
           "workload_of"]

log = logging.getLogger(__name__)

GIB = 2**30
MIB = 2**20

# ------------------------------------------------------------------------------------------------------
# Bytes per unit. "Measured" = on this repository's code, on the CPU, at the commit that set the number
# (LoCoMo = the released locomo10.json, 5,882 turns); the rest is counted from the code or taken from the
# library named, and says so. tests/test_plan.py checks the BM25 and vector numbers against real
# structures built from LoCoMo.

# BM25Index (index/bm25.py, state format 2): its state_dict tensors, what a snapshot holds.
BM25_STATE_BYTES_PER_POSTING = 4 + 4  # post_term int32 + post_tf int32
BM25_STATE_BYTES_PER_ROW = 8 + 8 + 8 + 1  # row_memory, row_len, row_post_start int64 + deleted bool
BM25_STATE_BYTES_PER_TERM = 4 + 8  # term_token int32 + term_memory int64
# The live index keeps no per-posting row column; it adds df (int64 per term) to the state's tensors ...
BM25_LIVE_BYTES_PER_POSTING = BM25_STATE_BYTES_PER_POSTING
BM25_LIVE_BYTES_PER_TERM = BM25_STATE_BYTES_PER_TERM + 8
# ... in GrowableTensor buffers whose capacity runs ahead of their size: one big append (today's one-batch
# write) leaves none, growth by doubling up to 2x; 1.25 is branch scale's growth step for large buffers.
BM25_GROWTH_SLACK = 1.25
# The search cache `_prepare` builds on the first search: post_col int32 + post_weight float32 per posting,
# term_ptr + dense_slot int64 per term, rows_by_memory int64 per row, and a float64 [dense terms x widest
# memory] matrix of the terms in at least 1/8 of the widest memory's rows (bm25.py _DENSE_FACTOR).
BM25_CACHE_BYTES_PER_POSTING = 4 + 4
BM25_CACHE_BYTES_PER_TERM = 8 + 8
BM25_CACHE_BYTES_PER_ROW = 8
BM25_DENSE_FACTOR = 8
# Transient peak of `_prepare` above the index and its cache: sorted terms and their sort order, gathered
# rows, float64 tf / idf / norm / weight intermediates. Measured: RSS peak over RSS before `_prepare` on a
# 5.3M-posting synthetic index on the CPU was 77.7 B per posting, of which 19 B the cache it keeps.
BM25_PREPARE_PEAK_BYTES_PER_POSTING = 60
# ... and since state format 2 `_prepare` works in slices of this many postings (bm25.py _PREPARE_SLICE),
# so the transient is bounded by a slice, whatever the index's size.
BM25_PREPARE_SLICE_POSTINGS = 1 << 22
# Host side of BM25, always: the vocabulary (a dict per memory + the term -> token list). Measured with
# tracemalloc on LoCoMo: 64 B per term of dict and list entries, plus the token's own str (49 B header +
# ~6 characters).
BM25_HOST_BYTES_PER_TERM = 120

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


# ------------------------------------------------------------------------------------------------------
# The node


@dataclass(frozen=True)
class Gpu:
    index: int  # torch's index: cuda:<index>
    name: str
    total_bytes: int


@dataclass(frozen=True)
class Node:
    gpus: tuple[Gpu, ...]
    host_bytes: int
    source: str  # "this machine" or the description given
    faiss_gpu: bool  # the FAISS build has GPU support

    def describe(self) -> str:
        if self.gpus:
            sizes = Counter(f"{g.name} {g.total_bytes / GIB:.1f} GiB" for g in self.gpus)
            gpus = ", ".join(f"{n} x {what}" for what, n in sizes.items())
        else:
            gpus = "no GPU"
        return f"{gpus}; host {self.host_bytes / GIB:.1f} GiB; FAISS {'GPU' if self.faiss_gpu else 'CPU'} ({self.source})"


def host_memory_bytes() -> int:
    """Physical RAM, or the cgroup's memory limit when lower (a SLURM job's --mem)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit_file).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return int(total)


def _faiss_has_gpu() -> bool:
    return faiss is not None and hasattr(faiss, "StandardGpuResources")


def describe_node() -> Node:
    """This machine: the GPUs torch sees (CUDA_VISIBLE_DEVICES applies), their memory, host RAM."""
    gpus = []
    for i in range(gpu_count()):
        props = torch.cuda.get_device_properties(i)
        gpus.append(Gpu(i, str(props.name), int(props.total_memory)))
    return Node(tuple(gpus), host_memory_bytes(), "this machine", _faiss_has_gpu())


def described_node(gpus: int | None = None, gpu_mem_gib: float | None = None, host_mem_gib: float | None = None,
                   faiss_gpu: bool | None = None) -> Node:
    """This machine with some of its description replaced (`memfit plan --gpus 4 --gpu-mem-gib 96`).

    A node described with --gpus is assumed to have the [gpu] install (GPU FAISS) unless told otherwise."""
    here = describe_node()
    words = []
    node_gpus = list(here.gpus)
    if gpus is not None:
        words.append(f"--gpus {gpus}")
        size = node_gpus[0].total_bytes if node_gpus else 0
        node_gpus = [Gpu(i, "GPU", size) for i in range(gpus)]
    if gpu_mem_gib is not None:
        words.append(f"--gpu-mem-gib {gpu_mem_gib:g}")
        node_gpus = [Gpu(g.index, g.name, int(gpu_mem_gib * GIB)) for g in node_gpus]
    if node_gpus and any(g.total_bytes <= 0 for g in node_gpus):
        raise ConfigError("memfit plan: --gpus without --gpu-mem-gib on a machine whose GPUs are unknown: "
                          "give --gpu-mem-gib")
    host = here.host_bytes
    if host_mem_gib is not None:
        words.append(f"--host-mem-gib {host_mem_gib:g}")
        host = int(host_mem_gib * GIB)
    if faiss_gpu is None:
        faiss_gpu = True if gpus is not None else here.faiss_gpu
    source = f"described: {' '.join(words)}" if words else "this machine"
    return Node(tuple(node_gpus), host, source, bool(faiss_gpu))


# ------------------------------------------------------------------------------------------------------
# The workload


@dataclass(frozen=True)
class Workload:
    benchmark: str
    source: str  # where the numbers come from, in words
    from_file: bool
    memories: int
    episodes: int
    questions: int
    widest: int  # episodes of the largest memory (BM25's padded width)
    turns_loaded: int  # turns of the whole loaded benchmark (the run keeps it in memory)
    text_bytes: int  # UTF-8 bytes of every stored episode text
    tokens: int  # BM25 tokens over all episodes
    postings: int  # distinct (episode, term) pairs
    terms: int  # distinct (memory, term) pairs
    dense_terms: int  # terms BM25 keeps as dense rows (df >= widest / 8)
    summaries: int  # at most this many summaries
    sampled: str  # what was tokenised
    unknown: bool = False  # no file and no published shape: every count is 0

    def describe(self) -> str:
        if self.unknown:
            return f"{self.benchmark}: UNKNOWN workload ({self.source}): data sizes are not counted"
        per = self.episodes or 1
        return (f"{self.benchmark}: {self.memories:,} memories, {self.episodes:,} episodes, {self.questions:,} questions; "
                f"{self.tokens / per:.0f} tokens and {self.postings / per:.0f} distinct terms per episode, "
                f"{self.terms:,} terms ({self.source}; {self.sampled})")


@dataclass
class _Sample:
    episodes: int = 0
    tokens: int = 0
    postings: int = 0
    terms: int = 0
    dense_terms: int = 0
    memories: int = 0

    def add(self, texts: Sequence[str], width: int) -> None:
        token_lists = tokenize_many(texts)
        df: Counter[str] = Counter()
        for tokens in token_lists:
            distinct = set(tokens)
            self.tokens += len(tokens)
            self.postings += len(distinct)
            df.update(distinct)
        self.episodes += len(texts)
        self.terms += len(df)
        self.dense_terms += sum(1 for count in df.values() if count * BM25_DENSE_FACTOR >= max(width, 1))
        self.memories += 1


def _summaries(cfg: MemFitConfig, sizes: Sequence[int]) -> int:
    if not cfg.summary.enabled:
        return 0
    return int(sum(min(cfg.summary.max_summaries, n // max(1, cfg.summary.min_segment)) for n in sizes))


def workload_of(cfg: MemFitConfig, memories: Sequence[Memory], questions: int, turns_loaded: int, source: str,
                sample_episodes: int = SAMPLE_EPISODES, seed: int = 0) -> Workload:
    """Counts of `memories` (what the run stores) and BM25 statistics from whole memories tokenised in a
    seeded order until `sample_episodes` episodes are seen (all of them when fewer)."""
    sizes = [sum(len(s.turns) for s in m.sessions) for m in memories]
    episodes = int(sum(sizes))
    widest = max(sizes, default=0)
    text_bytes = sum(len(episode_text(t).encode()) for m in memories for s in m.sessions for t in s.turns)
    sample = _Sample()
    for i in np.random.default_rng(seed).permutation(len(memories)).tolist():
        if sample.episodes >= sample_episodes:
            break
        sample.add([episode_text(t) for s in memories[i].sessions for t in s.turns], widest)
    scale = episodes / sample.episodes if sample.episodes else 0.0
    whole = sample.memories == len(memories)
    sampled = (f"all {episodes:,} episodes tokenised" if whole else
               f"{sample.episodes:,} episodes of {sample.memories} memories tokenised (seed {seed}), scaled x{scale:.2f}")
    return Workload(
        benchmark=cfg.data.benchmark, source=source, from_file=True, memories=len(memories), episodes=episodes,
        questions=questions, widest=widest, turns_loaded=turns_loaded, text_bytes=int(text_bytes),
        tokens=round(sample.tokens * scale), postings=round(sample.postings * scale), terms=round(sample.terms * scale),
        dense_terms=round(sample.dense_terms * scale), summaries=_summaries(cfg, sizes), sampled=sampled,
    )


def _workload_from_shape(cfg: MemFitConfig, why: str, seed: int = 0) -> Workload:
    published = benchmark_spec(cfg.data.benchmark).published_shape(cfg.data.split)
    if published is None:
        note = f"no published shape for {cfg.data.benchmark}"
        log.warning("plan: %s and %s: the data part of the plan is UNKNOWN (counted as 0)", why, note)
        return Workload(cfg.data.benchmark, f"{why}; {note}", False, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                        "nothing sampled", unknown=True)
    like, note = published.like, published.note
    shape = LIKES[like]
    memories = published.memories
    if cfg.data.limit_memories is not None:
        memories = min(memories, cfg.data.limit_memories)
    if published.episodes is not None:
        per_memory = published.episodes / published.memories
    else:
        per_memory = (sum(shape.sessions) / 2) * (sum(shape.turns) / 2)
    questions = published.questions
    if cfg.data.include_categories is None:
        questions -= sum(n for category, n in published.excluded.items() if category in cfg.data.exclude_categories)
    per_q = questions / published.memories
    if cfg.data.limit_questions is not None:
        per_q = min(per_q, cfg.data.limit_questions)
    episodes = round(memories * per_memory)
    # whole synthetic memories of the shape: BM25 statistics per episode, per memory and the widest memory
    sample = _Sample()
    synth = list(iter_memories(like, n_questions=published.sample_memories * shape.questions_per_memory, seed=seed))
    widest = max(sum(len(s.turns) for s in m.sessions) for m in synth)
    text_bytes = 0
    for m in synth:
        texts = [episode_text(t) for s in m.sessions for t in s.turns]
        text_bytes += sum(len(t.encode()) for t in texts)
        sample.add(texts, widest)
    per_episode = episodes / sample.episodes
    # synthetic turns are shorter than the published ones: scale tokens and text linearly, distinct terms
    # by HEAPS_EXPONENT (the dense-row count is left as sampled)
    length = published.tokens_per_episode / (sample.tokens / sample.episodes)
    distinct = length**HEAPS_EXPONENT
    return Workload(
        benchmark=cfg.data.benchmark, source=f"published shape {like} ({why}{'; ' + note if note else ''})",
        from_file=False, memories=memories, episodes=episodes, questions=round(memories * per_q), widest=widest,
        turns_loaded=episodes, text_bytes=round(text_bytes * per_episode * length),
        tokens=round(sample.tokens * per_episode * length), postings=round(sample.postings * per_episode * distinct),
        terms=round(sample.terms * per_episode * distinct), dense_terms=round(sample.dense_terms * per_episode),
        summaries=_summaries(cfg, [round(per_memory)] * memories),
        sampled=(f"{sample.memories} synthetic memories (data/synth.py, seed {seed}), turn length x{length:.2f} "
                 "to the published length"),
    )


def estimate_workload(cfg: MemFitConfig, sample_episodes: int = SAMPLE_EPISODES, seed: int = 0) -> Workload:
    """The run's workload: counted from the benchmark file when it is found (data.benchmark, data.path,
    data.split, $MEMFIT_DATA_DIR, the fetch cache), else the benchmark's published shape."""
    try:
        files = resolve_data_path(cfg.data.benchmark, cfg.data.path, cfg.data.split)
    except DataNotFoundError:
        return _workload_from_shape(cfg, "no benchmark file found", seed)
    bench = load_benchmark(cfg.data.benchmark, cfg.data.path, split=cfg.data.split)
    selected = select_from_config(bench, cfg.data)
    where = str(files[0]) if len(files) == 1 else f"{len(files)} files in {files[0].parent}"
    return workload_of(cfg, selected.memories, sum(len(m.questions) for m in selected.memories),
                       sum(len(s.turns) for m in bench.memories for s in m.sessions), f"benchmark file {where}",
                       sample_episodes, seed)


# ------------------------------------------------------------------------------------------------------
# Models


@dataclass(frozen=True)
class ModelSize:
    name: str
    weight_bytes: int | None  # in the dtype it runs in; None = unknown
    source: str  # "on disk (PATH)" | "from the known-model table ..." | "UNKNOWN ..."
    shape: dict[str, Any] = field(default_factory=dict)  # config.json fields (hidden_size, num_hidden_layers, ...)

    @property
    def known(self) -> bool:
        return self.weight_bytes is not None

    @property
    def origin(self) -> str:
        """Where the size came from, in a word: disk | table | UNKNOWN."""
        return "disk" if self.source.startswith("on disk") else "table" if self.known else "UNKNOWN"

    def get(self, key: str, default: int = 0) -> int:
        value = self.shape.get(key)
        return int(value) if isinstance(value, (int, float)) and value else default

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """K and V of every layer for one token (full attention; sliding windows would need less)."""
        heads = self.get("num_attention_heads", 1)
        head_dim = self.get("head_dim", self.get("hidden_size") // max(1, heads))
        return 2 * self.get("num_hidden_layers") * self.get("num_key_value_heads", heads) * head_dim * dtype_bytes


def _weights_on_disk(folder: Path) -> int:
    index = next(iter(sorted(folder.glob("*.safetensors.index.json"))), None)
    if index is not None:
        files = set(json.loads(index.read_text()).get("weight_map", {}).values())
        return sum((folder / f).stat().st_size for f in files if (folder / f).is_file())
    for pattern in ("*.safetensors", "pytorch_model*.bin", "model*.bin"):
        files = sorted(folder.glob(pattern))
        if files:
            return sum(f.stat().st_size for f in files)
    return 0


def _shape_of(config: dict[str, Any]) -> dict[str, Any]:
    """A config.json's sizing fields; a multimodal model's text model (text_config) first."""
    text = config.get("text_config") or config.get("llm_config") or {}
    merged = {**config, **text}
    merged["dtype"] = str(merged.get("torch_dtype") or merged.get("dtype") or "")
    if config.get("quantization_config") or text.get("quantization_config"):
        merged["dtype"] = "quantised"
    return merged


def _scaled(weight_bytes: int, stored: str, runtime: torch.dtype | None) -> int:
    """Weights stored in `stored` (config.json's dtype) as they sit in memory in `runtime`."""
    try:
        stored_dtype = parse_dtype(stored) if stored else None
    except ValueError:  # quantised or unnamed: what is stored is what is held
        return weight_bytes
    if stored_dtype is None or runtime is None or stored_dtype not in _DTYPE_BYTES or runtime not in _DTYPE_BYTES:
        return weight_bytes
    return weight_bytes * _DTYPE_BYTES[runtime] // _DTYPE_BYTES[stored_dtype]


def model_size(name: str, runtime: torch.dtype | None = None) -> ModelSize:
    """`name`'s weights in `runtime` (None: as stored): from the weights on disk when they are there,
    else the known-model table, else unknown (logged as a warning)."""
    folder = find_local(name)
    if folder is not None and folder.is_dir() and (folder / "config.json").is_file():
        shape = _shape_of(json.loads((folder / "config.json").read_text()))
        st_config = folder / "sentence_bert_config.json"  # sentence-transformers' own max_seq_length
        if st_config.is_file():
            shape["max_seq_length"] = json.loads(st_config.read_text()).get("max_seq_length")
        stored = _weights_on_disk(folder)
        if stored:
            return ModelSize(name, _scaled(stored, shape["dtype"], runtime), f"on disk ({folder})", shape)
    known = KNOWN_MODELS.get(name)
    if known is not None:
        return ModelSize(name, _scaled(int(known["weight_bytes"]), str(known["dtype"]), runtime),
                         "from the known-model table (no weights on disk)", dict(known))
    log.warning("plan: model %s: no weights on disk and not in the known-model table: its size is UNKNOWN and "
                "not counted", name)
    return ModelSize(name, None, "UNKNOWN (no weights on disk, not in the known-model table)", {})


# ------------------------------------------------------------------------------------------------------
# Parts and the plan


@dataclass
class Part:
    """One thing that takes memory: resident bytes on the host and per GPU, transient peaks above them
    (a write batch, an encoder batch, BM25's first-search preparation), and vLLM claims."""

    name: str
    where: str
    key: str  # the setting that moves or shrinks it
    host: int = 0
    host_peak: int = 0
    gpu: dict[int, int] = field(default_factory=dict)
    gpu_peak: dict[int, int] = field(default_factory=dict)
    claim: dict[int, int] = field(default_factory=dict)
    note: str = ""
    unknown: bool = False


@dataclass(frozen=True)
class Problem:
    message: str  # one line, naming the key(s) to change
    key: str
    rank: int = 1  # reported in rank order: 0 engines without GPUs, 1 a GPU, 2 an engine's own claim, 3 the host


@dataclass(frozen=True)
class GpuTotal:
    gpu: Gpu
    resident: int  # memfit's parts + memfit's CUDA context
    peak: int  # the largest transient of one part
    claims: int  # vLLM engines
    parts: tuple[str, ...]

    @property
    def total(self) -> int:
        return self.resident + self.peak + self.claims

    @property
    def fits(self) -> bool:
        return self.total <= self.gpu.total_bytes


@dataclass
class Plan:
    config: str
    node: Node
    workload: Workload
    parts: list[Part]
    retrieval_spec: str  # the index.device value the run builds with
    engine_gpus: dict[str, list[list[int]]]  # "reader" / "judge" -> GPU groups
    notes: list[str]
    problems: list[Problem] = field(default_factory=list)

    @property
    def gpu_checked(self) -> bool:
        return bool(self.node.gpus)

    def gpu_totals(self) -> list[GpuTotal]:
        out = []
        for gpu in self.node.gpus:
            resident = sum(p.gpu.get(gpu.index, 0) for p in self.parts)
            peak = max((p.gpu_peak.get(gpu.index, 0) for p in self.parts), default=0)
            claims = sum(p.claim.get(gpu.index, 0) for p in self.parts)
            names = tuple(p.name for p in self.parts if gpu.index in p.gpu or gpu.index in p.claim
                          or gpu.index in p.gpu_peak)
            out.append(GpuTotal(gpu, resident, peak, claims, names))
        return out

    def host_total(self) -> tuple[int, int]:
        """(resident, largest transient) host bytes."""
        return sum(p.host for p in self.parts), max((p.host_peak for p in self.parts), default=0)

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def unknown(self) -> list[str]:
        return [p.name for p in self.parts if p.unknown] + (["workload"] if self.workload.unknown else [])

    def check(self) -> None:
        """ConfigError (one line, the key to change) when the run cannot fit."""
        if self.problems:
            raise ConfigError(self.problems[0].message)

    def placed(self, cfg: MemFitConfig) -> MemFitConfig:
        """`cfg` with index.device where the plan put retrieval (the saved config.yaml keeps the user's)."""
        if cfg.index.device == self.retrieval_spec:
            return cfg
        return replace(cfg, index=replace(cfg.index, device=self.retrieval_spec))

    def to_dict(self) -> dict[str, Any]:
        resident, peak = self.host_total()
        return {
            "config": self.config, "node": self.node.describe(), "workload": self.workload.describe(),
            "workload_from_file": self.workload.from_file, "retrieval_device": self.retrieval_spec,
            "engine_gpus": self.engine_gpus,
            "parts": [{"name": p.name, "where": p.where, "host_gib": (p.host + p.host_peak) / GIB,
                       "gpu_gib": {f"cuda:{g}": (p.gpu.get(g, 0) + p.gpu_peak.get(g, 0) + p.claim.get(g, 0)) / GIB
                                   for g in sorted(p.gpu.keys() | p.gpu_peak.keys() | p.claim.keys())},
                       "key": p.key, "note": p.note, "unknown": p.unknown} for p in self.parts],
            "gpus": [{"gpu": f"cuda:{t.gpu.index}", "resident_gib": t.resident / GIB, "peak_gib": t.peak / GIB,
                      "claims_gib": t.claims / GIB, "total_gib": t.total / GIB, "capacity_gib": t.gpu.total_bytes / GIB,
                      "fits": t.fits} for t in self.gpu_totals()],
            "gpu_checked": self.gpu_checked,
            "host": {"resident_gib": resident / GIB, "peak_gib": peak / GIB, "capacity_gib": self.node.host_bytes / GIB},
            "fits": self.fits, "problems": [p.message for p in self.problems], "unknown": self.unknown,
            "notes": self.notes,
        }


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


def _encoder_dtype(setting: str) -> torch.dtype:
    """The encoders' compute dtype (devices.resolve_dtype: auto = float32), without asking a GPU."""
    return resolve_dtype(setting, (), "index.dtype")


def _reader_runtime_dtype(setting: str, on_gpu: bool, vllm: bool) -> torch.dtype | None:
    """An in-process reader's weights dtype (devices.reader_dtype, a planned GPU taken to run bf16); vLLM
    keeps the checkpoint's dtype on a GPU (None) and runs bfloat16 on the CPU (readers/vllm.py)."""
    if vllm and parse_dtype(setting, "reader.dtype") is None:
        return None if on_gpu else torch.bfloat16
    return reader_dtype(setting, "cuda" if on_gpu else "cpu", "reader.dtype", bf16=True)


def _parse_devices(spec: str, node: Node) -> list[str]:
    """index.device against the node (devices.visible_devices with the node's GPU count, not this
    machine's torch): "cpu", "cuda:N", ... ."""
    try:
        return [str(device) for device in visible_devices(spec, gpus=len(node.gpus))]
    except RuntimeError as exc:
        raise ConfigError(f"index.device={spec!r}: {exc} (index.device=auto or cpu)") from None


def _gpu_of(device: str) -> int | None:
    return int(device.split(":", 1)[1]) if device.startswith("cuda:") else None


def _span(gpus: Sequence[int]) -> str:
    return "cpu" if not gpus else ",".join(f"cuda:{g}" for g in gpus)


def _faiss_temp_bytes(total: int) -> int:
    if total <= 4 * GIB:
        return 512 * MIB
    if total <= 8 * GIB:
        return GIB
    return 1536 * MIB


class _Builder:
    """Collects the parts of one plan."""

    def __init__(self, cfg: MemFitConfig, node: Node, workload: Workload, readers: bool):
        self.cfg, self.node, self.w, self.readers = cfg, node, workload, readers
        self.parts: list[Part] = []
        self.notes: list[str] = []
        self.problems: list[Problem] = []
        self.engine_gpus: dict[str, list[list[int]]] = {}
        self.contexts: set[int] = set()  # GPUs where memfit's own process holds a CUDA context
        self.models: dict[str, ModelSize] = {}

    def add(self, part: Part) -> Part:
        self.parts.append(part)
        for device in list(part.gpu) + list(part.gpu_peak):
            self.contexts.add(device)
        return part

    # ---------------------------------------------------------------- readers
    def _engine_groups(self, role: str, reader: ReaderConfig) -> list[list[int]]:
        need = backend_entry(reader.backend).gpus(reader)
        tp = reader.tensor_parallel_size
        instances = reader.instances
        if need > len(self.node.gpus):
            fitting = max(1, len(self.node.gpus) // tp)
            self.problems.append(Problem(
                f"reader.instances={reader.instances} x reader.tensor_parallel_size={tp} "
                f"({role}) needs {need} GPUs but the node has {len(self.node.gpus)}: set reader.instances="
                f"{fitting}", "reader.instances", rank=0))
            instances = len(self.node.gpus) // tp
        return engine_groups([g.index for g in self.node.gpus], instances, tp)

    def reader_parts(self) -> None:
        if not self.readers:
            return
        roles: list[tuple[str, str, ReaderConfig]] = [("reader", "reader", self.cfg.reader)]
        if self.cfg.eval.judge.enabled:
            roles.append(("judge", "eval.judge", reader_config_for_judge(self.cfg.eval.judge, self.cfg.reader)))
        for role, key, reader in roles:
            how = backend_entry(reader.backend).plan  # the backend's registry entry says how it is planned
            if how == "server":
                self.notes.append(f"{role}: {reader.backend} server {', '.join(reader.base_urls)}, not counted (on "
                                  "this node: keep it on GPUs memfit does not see)")
            elif how == "engines":
                self._vllm(role, key, reader)
            elif how == "in_process":
                self._transformers(role, key, reader)
            else:
                self.notes.append(f"{role}: reader.backend={reader.backend} holds no model memory: not counted")

    def _model(self, name: str, runtime: torch.dtype | None) -> ModelSize:
        size = model_size(name, runtime)
        self.models[name] = size
        return size

    def _vllm(self, role: str, key: str, reader: ReaderConfig) -> None:
        gpus = self.node.gpus
        model = self._model(reader.model, _reader_runtime_dtype(reader.dtype, bool(gpus), vllm=True))
        label = f"vLLM {role} engines ({reader.model})"
        if not gpus:
            kv = float(os.environ.get("VLLM_CPU_KVCACHE_SPACE", VLLM_CPU_KV_DEFAULT_GIB)) * GIB
            self.add(Part(f"vLLM {role} engine, CPU ({reader.model})", "cpu", "reader.backend",
                          host=int((model.weight_bytes or 0) + kv + VLLM_HOST_BYTES_PER_GPU),
                          note=f"weights {_size(model)}; VLLM_CPU_KVCACHE_SPACE={kv / GIB:g} GiB",
                          unknown=not model.known))
            return
        groups = self._engine_groups(role, reader)
        self.engine_gpus[role] = groups
        claim = {g: int(reader.gpu_memory_utilization * gpus[g].total_bytes) for group in groups for g in group}
        self.add(Part(label, f"{len(groups)} x {reader.tensor_parallel_size} GPU: {_span(sorted(claim))}",
                      "reader.gpu_memory_utilization", host=VLLM_HOST_BYTES_PER_GPU * len(claim), claim=claim,
                      note=f"claims {reader.gpu_memory_utilization:g} of each GPU; weights {_size(model)}"))
        if not model.known:
            self.notes.append(f"{key}.model={reader.model}: size UNKNOWN, so whether its weights and KV cache fit the "
                              "engine's claim is not checked (the claim itself is counted)")
        if role == "judge" and self.cfg.reader.backend == "vllm":
            self.notes.append("eval.judge.backend=vllm starts a second set of engines on the reader's GPUs: two "
                              "claims of reader.gpu_memory_utilization each")
        if model.known and groups:
            tp = reader.tensor_parallel_size
            need = (model.weight_bytes or 0) / tp + model.kv_bytes_per_token() * reader.max_model_len / tp \
                + VLLM_RUNTIME_BYTES
            smallest = min(claim.values())
            if need > smallest:
                self.problems.append(Problem(
                    f"vLLM {role} engine ({reader.model}): weights {model.weight_bytes / tp / GIB:.1f} GiB per GPU + "
                    f"KV cache for one {reader.max_model_len}-token sequence "
                    f"{model.kv_bytes_per_token() * reader.max_model_len / tp / GIB:.1f} GiB + runtime "
                    f"{VLLM_RUNTIME_BYTES / GIB:.0f} GiB = {need / GIB:.1f} GiB > its claim of {smallest / GIB:.1f} GiB "
                    f"(reader.gpu_memory_utilization={reader.gpu_memory_utilization:g}): raise "
                    "reader.gpu_memory_utilization or reader.tensor_parallel_size, or lower reader.max_model_len",
                    "reader.gpu_memory_utilization", rank=2))

    def _transformers(self, role: str, key: str, reader: ReaderConfig) -> None:
        gpus = self.node.gpus
        model = self._model(reader.model, _reader_runtime_dtype(reader.dtype, bool(gpus), vllm=False))
        dtype_bytes = _dtype_bytes(_reader_runtime_dtype(reader.dtype, bool(gpus), vllm=False) or torch.bfloat16)
        context = model.get("max_position_embeddings", reader.max_model_len)
        kv = model.kv_bytes_per_token(dtype_bytes) * reader.batch_size * (context + reader.max_new_tokens)
        weights = model.weight_bytes or 0
        name = f"transformers {role} ({reader.model})"
        note = f"weights {_size(model)}; KV for {reader.batch_size} x {context} tokens"
        if not gpus:
            self.add(Part(name, "cpu", "reader.batch_size", host=weights, host_peak=kv, note=note,
                          unknown=not model.known))
        elif reader.device_map is not None:
            share = {g.index: weights // len(gpus) for g in gpus}
            peak = {g.index: kv // len(gpus) for g in gpus}
            self.add(Part(name, f"device_map=auto: {_span([g.index for g in gpus])}", "reader.batch_size",
                          gpu=share, gpu_peak=peak, note=note, unknown=not model.known))
        else:
            self.add(Part(name, "cuda:0", "reader.device_map", gpu={0: weights}, gpu_peak={0: kv}, note=note,
                          unknown=not model.known))

    # ---------------------------------------------------------------- retrieval
    def retrieval_devices(self) -> tuple[list[str], str]:
        """(devices of encoders and BM25, the index.device value the run uses)."""
        spec = self.cfg.index.device
        if spec.strip().lower() != "auto" or not self.node.gpus:
            return _parse_devices(spec, self.node), spec
        engines = {g for groups in self.engine_gpus.values() for group in groups for g in group}
        if not engines:
            return _parse_devices(spec, self.node), spec
        free = [g.index for g in self.node.gpus if g.index not in engines]
        chosen = free or [0]
        devices = [f"cuda:{g}" for g in chosen]
        why = ("a GPU the engines do not use" if free else
               "every GPU has an engine: GPU 0 alone, so the other engine GPUs hold no memfit context")
        self.notes.append(f"index.device=auto: retrieval on {','.join(devices)} ({why})")
        return devices, ",".join(devices)

    def retrieval_parts(self, devices: list[str]) -> None:
        cfg, w = self.cfg, self.w
        gpus = [g for g in (_gpu_of(d) for d in devices) if g is not None]
        on_cpu = not gpus
        # the loaded benchmark and the store's columns live on the host wherever the indexes are
        self.add(Part("benchmark + store columns", "cpu", "data.limit_memories",
                      host=w.turns_loaded * BENCHMARK_BYTES_PER_TURN + w.text_bytes
                      + w.episodes * STORE_BYTES_PER_EPISODE + w.summaries * (SUMMARY_TEXT_BYTES + STORE_BYTES_PER_EPISODE)
                      + PROCESS_HOST_BYTES,
                      note=f"incl. memfit's process {PROCESS_HOST_BYTES / GIB:.0f} GiB", unknown=w.unknown))
        # encoder and its write path
        encoder = self._model(cfg.index.encoder, _encoder_dtype(cfg.index.dtype))
        dim = encoder.get("hidden_size", 384)
        max_len = encoder.get("max_seq_length", encoder.get("max_position_embeddings", 512))
        torch_devices = [torch.device(d) for d in devices]
        tokens = min(cfg.index.encode_batch_size * max_len,
                     cfg.index.encode_batch_tokens or default_batch_tokens(torch_devices))
        act = self._activations(encoder, tokens, cfg.index.dtype)
        weights = encoder.weight_bytes or 0
        self.add(Part(f"bi-encoder x{len(devices)}", ",".join(devices), "index.encode_batch_tokens",
                      host=weights if on_cpu else 0, host_peak=act if on_cpu else 0,
                      gpu={g: weights for g in gpus}, gpu_peak={g: act for g in gpus},
                      note=f"{cfg.index.encoder}, weights {_size(encoder)}; activations of a batch of "
                      f"{tokens:,} tokens",
                      unknown=not encoder.known))
        if len(devices) > 1 and Workers.resolve(cfg.index.encoder_workers, torch_devices) is Workers.PROCESSES:
            # one worker process per device (index/encoders/workers.py): its own CUDA context and interpreter,
            # and the model's shared host copy; this process keeps its own replica on the first device
            self.add(Part(f"encoder worker processes x{len(devices)}", ",".join(devices), "index.encoder_workers=threads",
                          host=len(devices) * PROCESS_HOST_BYTES + weights,
                          gpu={g: CUDA_CONTEXT_BYTES + (weights if g == gpus[0] else 0) for g in gpus},
                          note=f"a CUDA context ({CUDA_CONTEXT_BYTES / MIB:.0f} MiB) and a process per device",
                          unknown=not encoder.known))
        wordpieces = min(w.tokens * WORDPIECES_PER_TOKEN, w.episodes * max_len)
        write = (w.episodes * (WRITE_RECORD_BYTES_PER_EPISODE + dim * VECTOR_BYTES_PER_DIM) + w.tokens * PY_TOKEN_BYTES
                 + wordpieces * ENCODER_INPUT_BYTES_PER_WORDPIECE)
        budget_mb = getattr(cfg.store, "write_budget_mb", None)
        write_note = "every episode in one batch (store.add_memories today)"
        if budget_mb:
            write = min(write, int(budget_mb) * MIB)
            write_note = f"chunks of store.write_budget_mb={budget_mb}"
        self.add(Part("write path (records, tokens, encoder inputs)", "cpu",
                      "store.write_budget_mb" if budget_mb else "data.limit_memories", host_peak=int(write),
                      note=write_note, unknown=w.unknown))
        # BM25, episodes and summaries
        bm25 = devices[0]
        for label, rows, postings, terms, dense_terms, width in (
            ("episodes", w.episodes, w.postings, w.terms, w.dense_terms, w.widest),
            ("summaries", w.summaries, w.summaries * SUMMARY_TERMS, w.summaries * SUMMARY_TERMS, 0,
             cfg.summary.max_summaries),
        ):
            if label == "summaries" and not rows:
                continue
            sizes = bm25_bytes(postings, rows, terms, dense_terms, width)
            live, cache, peak, vocab = sizes["live"], sizes["cache"], sizes["peak"], sizes["host"]
            g = _gpu_of(bm25)
            part = Part(f"BM25 {label}", bm25, "index.device=cpu" if g is not None else "index.device",
                        host=vocab + (int(live + cache) if g is None else 0), host_peak=int(peak) if g is None else 0,
                        note=f"{postings:,} postings, {terms:,} terms; search cache {cache / GIB:.2f} GiB",
                        unknown=w.unknown)
            if g is not None:
                part.gpu, part.gpu_peak = {g: int(live + cache)}, {g: int(peak)}
            self.add(part)
        # dense indexes
        dense_gpu = self.dense_gpu(devices)
        for label, rows in (("episodes", w.episodes), ("summaries", w.summaries)):
            if label == "summaries" and not rows:
                continue
            vectors = vector_bytes(rows, dim)
            part = Part(f"dense {label} (FAISS {cfg.index.dense_factory})", _span([] if dense_gpu is None else [dense_gpu]),
                        "index.dense_device=cpu" if dense_gpu is not None else "index.dense_device",
                        host=vectors + rows * DENSE_HOST_BYTES_PER_ROW, note=f"{rows:,} x {dim} float32",
                        unknown=w.unknown)
            if dense_gpu is None:
                part.host += vectors  # the CPU FAISS index's own copy
            else:
                temp = _faiss_temp_bytes(self.node.gpus[dense_gpu].total_bytes)
                part.gpu = {dense_gpu: vectors + temp}
                part.host += FAISS_PINNED_HOST_BYTES
                part.note += f" + FAISS temporary pool {temp / GIB:.1f} GiB"
            self.add(part)
        # cross-encoder
        if cfg.rerank.backend == "cross-encoder":
            ce = self._model(cfg.rerank.model, _encoder_dtype(cfg.rerank.dtype))
            tokens = min(cfg.rerank.batch_size * cfg.rerank.max_length, default_batch_tokens(torch_devices))
            act = self._activations(ce, tokens, cfg.rerank.dtype)
            weights = ce.weight_bytes or 0
            self.add(Part(f"cross-encoder x{len(devices)}", ",".join(devices), "rerank.batch_size",
                          host=weights if on_cpu else 0, host_peak=act if on_cpu else 0,
                          gpu={g: weights for g in gpus}, gpu_peak={g: act for g in gpus},
                          note=f"{cfg.rerank.model}, weights {_size(ce)}; activations of a batch of {tokens:,} tokens",
                          unknown=not ce.known))

    def _activations(self, model: ModelSize, tokens: int, dtype: str) -> int:
        """Activations of one batch of `tokens` padded tokens (batches are cut by rows and by tokens)."""
        hidden = model.get("hidden_size", 384)
        intermediate = model.get("intermediate_size", 4 * hidden)
        per_token = ENCODER_LIVE_HIDDEN * hidden + ENCODER_LIVE_INTERMEDIATE * intermediate
        return int(tokens * per_token * _dtype_bytes(_encoder_dtype(dtype)))

    def dense_gpu(self, devices: list[str]) -> int | None:
        """GPU FAISS sits on the GPU of the BM25 index (the first retrieval device; the store passes it as
        DenseIndex's gpu_id), GPU 0 when retrieval is on the CPU; None for CPU FAISS."""
        if self.cfg.index.dense_device == "cpu" or not self.node.gpus or not self.node.faiss_gpu:
            if self.cfg.index.dense_device == "gpu" and (not self.node.gpus or not self.node.faiss_gpu):
                self.problems.append(Problem("index.dense_device=gpu needs GPU FAISS and a GPU on the node: set "
                                             "index.dense_device=auto or cpu", "index.dense_device", rank=0))
            return None
        first = _gpu_of(devices[0]) if devices else None
        return 0 if first is None else first

    def contexts_part(self) -> None:
        if self.contexts:
            gpus = sorted(self.contexts)
            self.add(Part("CUDA context (memfit process)", _span(gpus), "index.device",
                          gpu={g: CUDA_CONTEXT_BYTES for g in gpus}, note=f"{CUDA_CONTEXT_BYTES / MIB:.0f} MiB per GPU"))

    # ---------------------------------------------------------------- fit
    def fit(self, plan: Plan) -> None:
        if plan.gpu_checked:
            for total in plan.gpu_totals():
                if not total.fits:
                    self.problems.append(self._gpu_problem(plan, total))
        resident, peak = plan.host_total()
        if resident + peak > self.node.host_bytes:
            big = max(plan.parts, key=lambda p: p.host + p.host_peak)
            self.problems.append(Problem(
                f"host memory: {resident / GIB:.1f} GiB resident + {peak / GIB:.1f} GiB peak = "
                f"{(resident + peak) / GIB:.1f} GiB > {self.node.host_bytes / GIB:.1f} GiB; the largest part is "
                f"{big.name} ({(big.host + big.host_peak) / GIB:.1f} GiB): change {big.key}", big.key, rank=3))
        plan.problems = sorted(self.problems, key=lambda p: p.rank)

    def _gpu_problem(self, plan: Plan, total: GpuTotal) -> Problem:
        g = total.gpu.index
        cap = total.gpu.total_bytes
        memfit = total.resident + total.peak
        claimers = [p for p in plan.parts if g in p.claim]
        holds = [p for p in plan.parts if g in p.gpu or g in p.gpu_peak]
        fixes: list[tuple[str, str]] = []  # (key, what to set), most direct first
        if claimers:
            # the largest utilisation that leaves room for memfit's parts, shared by every claim on this GPU
            room = math.floor((cap - memfit) / cap / len(claimers) * 100) / 100
            if room > 0:
                fixes.append(("reader.gpu_memory_utilization", f"reader.gpu_memory_utilization<={room:.2f}"))
            if len(claimers) > 1:
                fixes.append(("eval.judge.backend", "eval.judge.backend=openai (one set of engines)"))
        if any(p.name.startswith(("BM25", "bi-encoder", "cross-encoder")) for p in holds):
            fixes.append(("index.device", "index.device=cpu"))
        if any(p.name.startswith("dense") for p in holds):
            fixes.append(("index.dense_device", "index.dense_device=cpu"))
        if claimers and self.cfg.reader.backend == "vllm" and self.cfg.reader.instances > 1:
            fixes.append(("reader.instances", f"reader.instances={self.cfg.reader.instances - 1} (frees a GPU "
                                              "for retrieval)"))
        if any(p.name.startswith("transformers") for p in holds):
            fixes.append(("reader.device_map", "reader.device_map=auto") if len(self.node.gpus) > 1
                         else ("reader.model", "a smaller reader.model"))
        fixes = fixes or [("index.device", "index.device=cpu")]
        parts = ", ".join(f"{p.name.split(' (')[0]} {(p.gpu.get(g, 0) + p.gpu_peak.get(g, 0)) / GIB:.1f}" for p in holds)
        claims = "".join(f" + {p.name.split(' (')[0]} claim {p.claim[g] / GIB:.1f} GiB" for p in claimers)
        return Problem(
            f"GPU cuda:{g} ({cap / GIB:.1f} GiB) does not fit: memfit {memfit / GIB:.1f} GiB{f' ({parts})' if parts else ''}"
            f"{claims} = "
            f"{total.total / GIB:.1f} GiB; change {' or '.join(text for _, text in fixes)}", fixes[0][0])


def make_plan(cfg: MemFitConfig, node: Node | None = None, workload: Workload | None = None, readers: bool = True,
              config_name: str = "") -> Plan:
    """Where every part of `cfg`'s run lives on `node` (default: this machine) and what it takes; readers=False
    plans retrieval alone (`memfit retrieve`)."""
    node = node if node is not None else describe_node()
    workload = workload if workload is not None else estimate_workload(cfg)
    builder = _Builder(cfg, node, workload, readers)
    builder.reader_parts()
    devices, spec = builder.retrieval_devices()
    builder.retrieval_parts(devices)
    builder.contexts_part()
    if not node.gpus:
        builder.notes.append("no GPU on the node: only host memory is checked")
    plan = Plan(config_name, node, workload, builder.parts, spec, builder.engine_gpus, builder.notes)
    builder.fit(plan)
    for name in plan.unknown:
        log.warning("plan: %s has an UNKNOWN size and is not counted: the verdict may be wrong", name)
    return plan


def render(plan: Plan) -> str:
    """The plan as a table: a row per part (where, host GiB, GPU GiB per device), per-GPU totals against
    their memory, host total against RAM, and the verdict."""
    gpus = [g.index for g in plan.node.gpus]
    lines = [f"memfit plan{': ' + plan.config if plan.config else ''}",
             f"node:      {plan.node.describe()}",
             f"workload:  {plan.workload.describe()}"]
    for role, groups in plan.engine_gpus.items():
        lines.append(f"engines:   vLLM {role}: {len(groups)} engine(s) on {' | '.join(_span(g) for g in groups)}")
    lines.append(f"retrieval: index.device -> {plan.retrieval_spec}")
    lines.extend(f"note:      {n}" for n in plan.notes)
    lines.append("")
    width = max([len(p.name) for p in plan.parts] + [4])
    where_w = max([len(p.where) for p in plan.parts] + [5])
    head = f"{'part':<{width}}  {'where':<{where_w}}  {'host GiB':>8}" + "".join(f"  {'cuda:' + str(g):>8}" for g in gpus)
    lines += [head, "-" * len(head)]
    for p in plan.parts:
        row = f"{p.name:<{width}}  {p.where:<{where_w}}  {_gib(p.host + p.host_peak, p.unknown):>8}"
        for g in gpus:
            value = p.gpu.get(g, 0) + p.gpu_peak.get(g, 0) + p.claim.get(g, 0)
            row += f"  {(_gib(value, p.unknown) if g in p.gpu or g in p.gpu_peak or g in p.claim else '-'):>8}"
        lines.append(row + (f"   {p.note}" if p.note else ""))
    lines.append("")
    if plan.gpu_checked:
        for t in plan.gpu_totals():
            lines.append(f"cuda:{t.gpu.index}: memfit {t.resident / GIB:6.1f} + peak {t.peak / GIB:5.1f} + engine claims "
                         f"{t.claims / GIB:6.1f} = {t.total / GIB:6.1f} of {t.gpu.total_bytes / GIB:.1f} GiB  "
                         f"{'ok' if t.fits else 'DOES NOT FIT'}")
    else:
        lines.append("GPUs: none on the node: GPU check skipped")
    resident, peak = plan.host_total()
    total = resident + peak
    lines.append(f"host:   resident {resident / GIB:6.1f} + peak {peak / GIB:5.1f} = {total / GIB:6.1f} of "
                 f"{plan.node.host_bytes / GIB:.1f} GiB  {'ok' if total <= plan.node.host_bytes else 'DOES NOT FIT'}")
    if plan.unknown:
        lines.append(f"WARNING: UNKNOWN sizes, not counted: {', '.join(plan.unknown)}")
    if plan.fits:
        lines.append("verdict: fits")
    else:
        lines.append("verdict: DOES NOT FIT")
        lines.extend(f"  - {p.message}" for p in plan.problems)
    return "\n".join(lines)


def _size(model: ModelSize) -> str:
    if not model.known:
        return "UNKNOWN (not counted)"
    return f"{model.weight_bytes / GIB:.2f} GiB ({model.origin})"


def _gib(value: int, unknown: bool) -> str:
    return "?" if unknown and not value else f"{value / GIB:.2f}"
