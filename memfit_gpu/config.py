"""Typed configuration: one dataclass per stage, every default is SPEC.md's (the paper's).

A run's configuration is `MemFitConfig`, loaded from YAML in `configs/` and refined by dot-list
overrides (`retrieve.scan_top_k=30`). OmegaConf validates both against these dataclasses, so an
unknown key or a wrongly typed value is an error that names the key; then every choice, every numeric
range (`_RANGES`) and settings that only fail together are checked, so a bad value is refused with the
key, the value and what is allowed before any work starts (and before a run saves its config.yaml).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import MISSING as MISSING_FACTORY
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml
from omegaconf import MISSING, OmegaConf  # noqa: F401  (MISSING re-exported for configs)
from omegaconf.errors import OmegaConfBaseException

# config.py imports nothing of memfit_gpu: every module may import it (tests/test_architecture.py).

# A turn longer than this is reported as a data quirk by the loaders (data.schema re-exports it; the
# longest real turn: LoCoMo 454 characters, MemGallery 1,692, the LongMemEval oracle files 4,015). It is
# pack.max_excerpt_chars's default, so every turn whose excerpt would be cut is listed in Benchmark.problems.
HUGE_TURN_CHARS = 100_000

log = logging.getLogger(__name__)


@dataclass
class DataConfig:
    benchmark: str = "locomo"  # locomo | longmemeval | memgallery | beam | jsonl (your own data file): picks the loader
    path: Optional[str] = None  # file or folder; None = $MEMFIT_DATA_DIR or the fetch cache
    # when path is a folder holding several: LongMemEval s | m | oracle; BEAM 100K | 500K | 1M | 10M
    split: Optional[str] = None
    limit_memories: Optional[int] = None  # first N memories only: smoke runs and demos
    limit_questions: Optional[int] = None  # first N questions per memory: smoke runs and demos
    include_categories: Optional[list[str]] = None  # None = the benchmark's evaluated set
    # None = the benchmark's evaluated set (LoCoMo: not category 5, adversarial; SPEC Evaluation); a list: every
    # other category, each scored ([] scores LoCoMo's category 5 against its adversarial answer)
    exclude_categories: Optional[list[str]] = None


@dataclass
class StoreConfig:
    path: Optional[str] = None  # None = inside the run directory; persistent append-only log + snapshots
    fsync: bool = False  # fsync after every append batch: a live agent wants it, a benchmark build does not
    # add_memories works in chunks whose texts, records, token ids and vectors take about this many MB,
    # so writing LongMemEval-M holds one chunk at a time, never the whole benchmark (results are identical)
    write_budget_mb: int = 1024


@dataclass
class IndexConfig:
    encoder: str = "sentence-transformers/all-MiniLM-L6-v2"  # SPEC write path 1: the bi-encoder
    normalize: bool = True  # L2-normalised rows make inner product = cosine (SPEC); false: raw pooled vectors (packed only)
    encode_batch_size: int = 1024  # rows per forward at most, per device; the token budget binds first; halved on OOM
    encode_batch_tokens: int = 0  # padded tokens (rows x width) per forward; 0 = auto: 2,048 on a CPU (cache-sized), 65,536 on a GPU (fills it)
    encoder_workers: str = "auto"  # replicas on several devices: threads (one process) | processes (one per device) | auto (processes for 2+ GPUs)
    device: str = "auto"  # auto = every visible GPU, else cpu; or "cpu", "cuda:0", ...
    dtype: str = "auto"  # auto = float32 everywhere: the paper's fp32 packs (bf16: several times the rate on an AMX CPU, hit rates held, top-10 order not: docs/benchmarks/history.md) | float32 | bf16 | fp16
    encoder_backend: str = "packed"  # packed (batched, no work on padding) | sentence-transformers (the reference); both encoders
    bm25_k1: float = 1.5  # SPEC write path 2
    bm25_b: float = 0.75  # SPEC write path 2
    bm25_backend: str = "torch"  # torch (sparse, batched) | reference (readable, slow)
    dense_factory: str = "Flat"  # FAISS factory string with inner product; Flat = exact (IndexFlatIP)
    dense_device: str = "auto"  # auto = GPU FAISS when installed and a GPU is visible | cpu | gpu (required)
    dense_nprobe: int = 16  # for IVF factories only
    # a memory searched exactly with at most this many rows has no FAISS index: the batch's memories are
    # searched with one padded product per block (LongMemEval: ~500 small memories); 0 = FAISS everywhere
    dense_batched_max_rows: int = 65536


@dataclass
class SegmentConfig:
    min_window: int = 3  # SPEC write path 3: w = max(3, round(sqrt(n) * window_scale))
    window_scale: float = 0.5  # sqrt(n) / 2
    short_factor: int = 4  # n < 4w: the whole memory is one segment
    depth_std_factor: float = 0.5  # cut where depth > mean + std/2 and depth is a local maximum


@dataclass
class SummaryConfig:
    enabled: bool = True  # summaries index segments; off = a store with no LLM at all
    min_segment: int = 3  # segments of fewer episodes get no summary (SPEC write path 3)
    max_summaries: int = 60  # per memory, the largest segments win (SPEC write path 3)
    max_excerpts: int = 14  # evenly spaced member turns shown to the LLM (SPEC write path 4)
    excerpt_chars: int = 220  # each excerpt cut to this many characters (SPEC write path 4)
    excerpt_speaker: bool = False  # false: the whole `DATE... says:` prefix stripped (SPEC write path 4); true: `Speaker: text`
    temperature: float = 0.0  # deterministic summaries (SPEC write path 4)
    max_new_tokens: int = 200  # SPEC write path 4
    min_chars: int = 20  # shorter outputs are dropped (SPEC write path 4)
    prompt: str = "summary.txt"  # file in memfit_gpu/prompts/


@dataclass
class PRFConfig:
    enabled: bool = True  # SPEC read path 6
    docs: int = 2  # feedback from the top-2 episodes
    terms: int = 12  # keep 12 expansion terms
    min_token_chars: int = 4  # tokens longer than 3 characters
    weight: float = 0.5  # new episodes enter with 0.5 x their score
    term_order: str = "idf"  # idf (paper) | alphabetical (the released code's bug, as a switch)


@dataclass
class BoostConfig:
    speaker: float = 0.10  # SPEC read path 2
    month: float = 0.08  # SPEC read path 2: added when the question names the turn's month
    year: float = 0.05  # SPEC read path 2: added when the question names the turn's year
    min_speaker_chars: int = 3  # names longer than 2 characters, whole word
    speaker_match: str = "speaker"  # speaker = the speaker's own turns (paper, released code) | mention = any turn naming them
    # SPEC read path 3: summaries get the same hybrid (step 1), and the boosts (step 2) are the episodes'; true boosts a
    # summary too, by its members' speakers and its event time (what this package did before it followed SPEC here)
    summaries: bool = False


@dataclass
class RetrieveConfig:
    scan_top_k: int = 60  # top-N of BM25 and of dense each (SPEC read path 1; "wide scan")
    alpha: float = 0.7  # fused = alpha * dense + (1 - alpha) * bm25, min-max over the union
    dense_min_cosine: float = 0.0  # dense keeps only cosine > 0
    boosts: BoostConfig = field(default_factory=BoostConfig)
    boosts_enabled: bool = True  # SPEC read path 2; plain retrieval keeps them (they are no ablation switch)
    summaries: bool = True  # search the summary layer at all (SPEC read path 3)
    summary_top_k: int = 10  # hybrid over summaries, top 10
    pool_size: int = 50  # round-robin pool of episode and summary hits (SPEC read path 4)
    summary_expansion: bool = True  # SPEC read path 5
    summary_expansion_top: int = 5  # members of the top-5 summaries
    summary_expansion_weight: float = 0.5  # enter with 0.5 x the summary's score
    prf: PRFConfig = field(default_factory=PRFConfig)
    question_batch_size: int = 4096  # questions per batched pass; bounds peak memory
    kernels: str = "auto"  # torch | triton | auto (= Triton on CUDA, torch elsewhere): fused BM25 / hybrid kernels, same results
    # Added read-path stages (retrieve/registry.py), run in this order after the rerank (SPEC read path 7) and
    # before the pack; [] = SPEC's read path exactly. Each name is a registered stage (register_stage).
    stages: list[str] = field(default_factory=list)


@dataclass
class RerankConfig:
    backend: str = "cross-encoder"  # cross-encoder | none (keep the first-stage order)
    model: str = "cross-encoder/ms-marco-MiniLM-L-6-v2"  # SPEC read path 7
    max_length: int = 384  # SPEC read path 7
    dtype: str = "auto"  # auto = float32, as index.dtype (bf16 logits 1/32 apart tie and reorder top-10s; in bf16 the head runs in float32) | float32 | bf16 | fp16
    rerank_pool: int = 80  # pool[:80] plus every expansion is reranked
    batch_size: int = 256  # pairs per forward, length-sorted; halved on OOM
    zscore_min: int = 3  # fewer items of a kind: leave raw scores
    summary_suffix: str = " (as of {date})"  # a summary's passage = text + this


@dataclass
class PackConfig:
    k: int = 10  # top-k after rerank; summaries compete for slots (SPEC read path 8)
    context_window: int = 1  # +/- 1 neighbouring turns of the same session
    resolve_dates: bool = True  # relative dates resolved in parentheses (SPEC read path 9)
    # One excerpt's text is cut to this many characters (the cut is recorded in the pack row). Far above
    # the longest turn of LoCoMo (454), MemGallery (1,692) and the LongMemEval oracle files (4,015), so the
    # paper's packs never change; it only stops one huge stored turn from filling the prompt. Loaders list
    # every turn longer than this default as a data quirk.
    max_excerpt_chars: int = HUGE_TURN_CHARS


@dataclass
class ReaderConfig:
    backend: str = "transformers"  # transformers | vllm | openai (readers/registry.py)
    model: str = "HuggingFaceTB/SmolLM2-135M-Instruct"  # hub id; packaged weights used offline
    instances: int = 1  # vllm: engines spread over the visible GPUs
    tensor_parallel_size: int = 1  # vllm: GPUs per engine
    base_urls: list[str] = field(default_factory=list)  # openai: one or more servers
    api_key_env: str = "OPENAI_API_KEY"  # openai: read the key from this variable
    concurrency: int = 16  # openai: in-flight requests per URL
    timeout_s: float = 120.0  # openai: per request
    max_retries: int = 5  # openai: on timeout, 429, 5xx
    temperature: float = 0.0  # deterministic answers
    seed: int = 0  # sampling seed when temperature > 0 (vLLM, transformers, OpenAI `seed`); part of the cache key then
    max_new_tokens: int = 64  # answers are short (SPEC: shortest complete answer)
    batch_size: int = 16  # transformers: prompts per generate call
    # answers committed and appended per batch (what a killed run can lose); in-process backends generate
    # this many per call (raise it for vLLM engines), an OpenAI-compatible server gets every question at once
    flush_every: int = 64
    max_model_len: int = 8192  # vllm: context length
    # weights and compute dtype of an in-process reader: auto = bf16 where the device computes it natively
    # (GPU, or a CPU with AVX512-BF16/AMX: reads prompts ~2x faster than fp32), else fp16 (GPU) / float32
    # (CPU); vLLM on the CPU runs float32 (its bf16 CPU kernels garble answers). Or float32 | bf16 | fp16
    dtype: str = "auto"
    # transformers: None = the whole model on one device; auto = accelerate spreads its layers over the GPUs
    # (then the CPU), for a reader too large for one GPU
    device_map: Optional[str] = None
    images: str = "none"  # none | question | retrieved (multimodal reader input, SPEC step 9)
    max_images: int = 16  # vllm: images per prompt (the question's first); extras dropped and counted
    max_pixels: Optional[int] = None  # vllm: Qwen2.5-VL resizes images to at most this many pixels
    prompt: str = "answer.txt"  # file in memfit_gpu/prompts/
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # e.g. {enable_thinking: false} for Qwen3
    gpu_memory_utilization: float = 0.9  # vllm: share of each GPU an engine may claim (lower it to co-host a judge)
    # auto = the benchmark's official protocol (MemGallery: its system prompt + per-category instructions; BEAM:
    # its answer_generation_for_rag prompt) | paper (MemFit's answer.txt) | memgallery | beam
    protocol: str = "auto"
    # The excerpts of one answer prompt are cut so the prompt holds at most this many characters (about
    # 100k tokens; recorded per question when cut). A prompt this long already fails on most readers.
    max_prompt_chars: int = 400_000
    # transformers: a leading system message of at least this many tokens is read once and its keys and values
    # kept (the two latest such prefixes) for every request that starts with it, which is then generated alone
    # from that cache: mem0 sends its 8,530-token extraction prompt with every add. Whether a request takes this
    # path depends only on the request, so a resumed run computes what an uninterrupted one did. 0 = off
    prefix_cache_min_tokens: int = 1024


@dataclass
class JudgeConfig:
    enabled: bool = False  # an LLM judge costs calls; off unless asked
    backend: str = "transformers"  # as reader.backend: transformers | vllm | openai (the paper's judge is a server)
    model: str = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the packaged reader, so a judged demo runs offline
    base_urls: list[str] = field(default_factory=list)  # openai: the judge's servers (the paper configs: 127.0.0.1:8200)
    max_new_tokens: int = 128  # room for a verdict and its short reason
    prompt: str = "auto"  # auto = paper judge (LoCoMo), graded (MemGallery), per-type (LongMemEval), rubric (BEAM)


@dataclass
class BeamEvalConfig:
    # BEAM's judge (evaluate/beam.py) scores every rubric item with BEAM's unified_llm_judge_base_prompt, as
    # mohammadtavakoli78/BEAM src/evaluation/compute_metrics.py does; where that code departs from its own prompt
    # a switch names both. The prompt's QUESTION slot: "fill" gives the judge the probing question, as the prompt
    # asks; "released" leaves the `<question>` placeholder in, as compute_metrics.py sends it (it fills only the
    # rubric item and the response)
    question: str = "fill"
    # A rubric item graded 0.5 (the prompt's partial compliance): "keep" counts 0.5; "floor" counts 0, as
    # compute_metrics.py's int(score) does for every ability but event ordering
    partial: str = "keep"
    # The event-ordering score: "tau_f1" = (Kendall tau-b of the aligned order + 1) / 2 x F1 of the aligned items
    # (compute_metrics.py event_ordering_score's final_score); "tau" = the normalised tau-b alone, the column
    # src/evaluation/report_results.py tabulates; "rubric" = the mean rubric score, like the other abilities
    event_ordering: str = "tau_f1"
    # memfit's own convention, not BEAM's: a question counts as accepted (the verdict that `memfit compare`'s
    # permutation test and `memfit judge-audit` read) when its score reaches this
    accept_at: float = 0.5


# what hit@K and MRR rank over (eval.hit_list): config's choices and retrieve/diagnostics.py's check
HIT_LISTS = ("final", "episodes")


@dataclass
class EvalConfig:
    metrics: list[str] = field(default_factory=lambda: ["paper", "locomo", "memgallery"])  # F1/BLEU-1 variants
    table_metric: str = "paper"  # which variant results.md reports
    # hit@K and MRR over the final ranked list, summaries holding their ranks (SPEC Evaluation) | episodes:
    # over its episodes alone (what this package computed before it followed SPEC here)
    hit_list: str = "final"
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    bootstrap_samples: int = 1000  # 95 % intervals
    permutation_samples: int = 10000  # paired sign-flip test
    # the bootstrap, the permutation test and judge-audit's probes: the same numbers on a rerun
    seed: int = 0
    # ROUGE-L, ROUGE-2 (rouge-score), METEOR (nltk), SBERT (cosine of the run's bi-encoder
    # embeddings) per question and category (evaluate/text_metrics.py); [] = F1/BLEU-1 only, as the paper
    text_metrics: list[str] = field(default_factory=list)
    # MTM sizes (LightMem entries per memory) at which the growth analysis scores the questions
    # whose evidence lies before that point, with the memory as it stood then (run/growth.py); [] = none
    growth_points: list[int] = field(default_factory=list)
    # Pack depths k (increasing) at which, after the run, every question is answered again on the top k of the
    # same ranking (one answer call per question per depth, role depth_answer; the paper's Table 10 from one
    # retrieval, memfit_gpu/run/depths.py); [] = the run's pack.k only
    pack_cutoffs: list[int] = field(default_factory=list)
    beam: BeamEvalConfig = field(default_factory=BeamEvalConfig)  # BEAM's rubric and event-ordering scoring


@dataclass
class WandbConfig:
    enabled: bool = False  # W&B is opt-in: a run logs nothing outside its directory unless asked
    project: str = "memfit"  # the W&B project runs are logged to
    entity: Optional[str] = None  # the W&B team or user; None = the account's default
    group: Optional[str] = None  # a sweep sets this to its name
    mode: str = "offline"  # online | offline | disabled


@dataclass
class TrackingConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)


# ---- the memory systems other than MemFit (memfit_gpu/methods), each reads only its section
# memfit: the paper's system; plain: the same store and hybrid + rerank with every MemFit addition off
# (configs/ablations/plain_retrieval.yaml as a method); naive_rag: fixed-size chunks, dense top-k;
# full_context: the whole history in the prompt; lightmem_slm: LightMem driven by small models.
METHODS: tuple[str, ...] = ("memfit", "plain", "naive_rag", "full_context", "lightmem_slm", "mem0")
# The benchmarks (memfit_gpu/data: one loader module each, with its BenchmarkSpec) and the reader backends
# (memfit_gpu/readers/registry.py). These three lists are the built-in names of the three registries
# (config.py imports nothing of memfit_gpu, so the names are spelled here, once); a registry's register
# call adds a new name with `register_choice`, and tests/test_seams.py checks that both agree.
BENCHMARKS: tuple[str, ...] = ("locomo", "longmemeval", "memgallery", "jsonl", "beam")
READER_BACKENDS: tuple[str, ...] = ("transformers", "vllm", "openai")


@dataclass
class NaiveRAGConfig:
    # Whitespace tokens (words) of the history, which every reader and encoder sees the same way.
    # 128 words are about 160-190 MiniLM word pieces: inside the bi-encoder's 256-token window, so the
    # encoder embeds each chunk whole (a longer chunk would be silently cut before it is embedded).
    chunk_tokens: int = 128
    # 25 %: a fact cut by a chunk boundary is still whole in the neighbouring chunk.
    overlap_tokens: int = 32
    # 5 x 128 words is about the text MemFit's pack holds (k = 10 turns, +/- 1 neighbour, ~25 words a
    # turn), so both give the reader a context of the same size.
    top_k: int = 5


@dataclass
class FullContextConfig:
    # Tokens the prompt may hold; None = the reader's own limit (transformers: the model's context; vllm:
    # reader.max_model_len, counted with the model's tokenizer), always less reader.max_new_tokens. A server
    # (openai) tells its context to nobody: set this, or only reader.max_prompt_chars bounds the prompt.
    context_tokens: Optional[int] = None


@dataclass
class LightMemNoiseConfig:
    # Error injection (the paper's Tables 6 and 7; methods/lightmem_noise.py says how noise is made). Each
    # is the fraction of items replaced; 0 = none, bit for bit the run without noise.
    hq: float = 0.0  # SLM-1: hypothetical queries replaced by an HQ written for another question
    write: float = 0.0  # SLM-3: MTM notes replaced by unrelated notes when written (LTM consolidates them)
    mtm: float = 0.0  # MTM noise saturation: MTM notes replaced at read time only (log and LTM stay clean)
    seed: int = 0  # which items are replaced and by what


@dataclass
class LightMemConfig:
    # STM: the last turns of the user's conversation, shown to the reader as immediate context.
    stm_turns: int = 4
    # SLM-3 writes one MTM entry per window of this many turns of a session (a session's last window may
    # be shorter): an "interaction".
    mtm_window_turns: int = 6
    # LTM consolidation runs when this many new MTM entries have accumulated: 2 x 6 turns = every 12
    # turns, inside the paper's 10-15 (Table 10).
    consolidate_every: int = 2
    # Fixed final budget: MTM entries + LTM nodes given to the reader per question.
    top_k: int = 8
    # SLM-1 writes at most this many hypothetical queries (HQs) per question.
    max_hqs: int = 3
    # Coarse vector retrieval fetches this many times an HQ's budget, for SLM-2 to re-rank.
    coarse_factor: int = 3
    routing: str = "slm"  # slm (SLM-1's MTM/LTM marks) | mtm | ltm (the paper's MTM-only / LTM-only ablations)
    rerank: bool = True  # SLM-2 re-ranking; false = coarse order (the paper's "w/o SLM-2 reranking")
    turn_chars: int = 300  # each turn shown to SLM-3 is cut to this many characters
    temperature: float = 0.0  # every SLM call is greedy: resumable, cacheable
    mtm_max_new_tokens: int = 80  # SLM-3: one short MTM note per window
    consolidate_max_new_tokens: int = 128  # LTM consolidation: a few graph updates per call
    rewrite_max_new_tokens: int = 64  # SLM-1: the query rewrite, its HQs and routing marks
    rerank_max_new_tokens: int = 32  # SLM-2: a ranked list of item numbers
    prompt_dir: str = "lightmem"  # folder under memfit_gpu/prompts/ (or a path) holding the four SLM prompts
    # false = no offline consolidation at all: LTM stays empty (the paper's Table 10 "no update" variant)
    ltm_updates: bool = True
    noise: LightMemNoiseConfig = field(default_factory=LightMemNoiseConfig)  # stress tests


@dataclass
class Mem0Config:
    # method=mem0 (methods/peers/mem0.py): mem0's own package, fed as mem0's LoCoMo evaluation feeds it
    # (evaluation/src/memzero/add.py and search.py in mem0's repository).
    # Messages per `add` call: that script's batch_size (each call is one LLM extraction call).
    batch_size: int = 2
    # Memories `search` returns per speaker for a question: that script's top_k; both speakers are searched.
    top_k: int = 10
    # Tokens mem0's LLM may write per call: mem0's OpenAIConfig default (an extraction is a JSON list).
    max_tokens: int = 2000
    # mem0's LLM temperature (its evaluation sets 0.0 with the hosted client, 0.1 without).
    temperature: float = 0.0


# ---- the live memory (memfit_gpu.Memory) and its server (memfit serve)
@dataclass
class LiveConfig:
    # Off the query path, as the paper builds its summaries: "background" runs consolidate() on a worker
    # thread once a user has consolidate_after_turns new turns (MemFit: segment summaries; lightmem_slm:
    # MTM notes and LTM consolidation); "manual" only when Memory.consolidate() is called.
    consolidate: str = "background"
    consolidate_after_turns: int = 64  # new turns of a user before background consolidation runs
    # Appended turns are logged (fsynced) at once and indexed in memory; the index state is snapshotted
    # after this many turns (and on close), so a restart re-encodes at most this many.
    snapshot_after_turns: int = 1024
    # "on_add": each add encodes and indexes its own turns before it returns, keeping the MiniLM forward off
    # the query path; "deferred": an add returns once its turns are logged (fsynced) and in the metadata,
    # and the next read (search, answer, delete, snapshot, close) encodes every pending turn in one pass
    # first (no search misses an acknowledged turn, but that search pays the encoding: docs/benchmarks/history.md).
    indexing: str = "on_add"


@dataclass
class ServeConfig:
    host: str = "127.0.0.1"  # memfit serve --host
    port: int = 8765  # memfit serve --port
    keys_file: Optional[str] = None  # hashed API keys bound to user ids (memfit keys new); required to serve
    # Dynamic batching: concurrent searches (and answers, adds) that arrive within this window of the first,
    # or until max_batch are waiting, are answered by one batched call (max_batch 1 = one at a time).
    batch_window_ms: float = 5.0
    max_batch: int = 64  # requests per batched call at most: bounds a batch's memory and its latency
    # texts per batched call at most (search queries, answer questions, added turns: what its time grows with),
    # so that one client's queued large requests hold another's for one batch at most (a bigger request runs
    # alone); a batch takes the waiting requests round-robin between API keys
    max_batch_texts: int = 256
    max_body_bytes: int = 1_048_576  # larger request bodies get 413
    max_turns_per_request: int = 1024  # more get 422
    max_queries_per_request: int = 64  # more get 422
    max_k: int = 100  # search k above this gets 422
    # What one client may take of a server that every user shares (one worker thread runs every search and add):
    max_query_words_per_request: int = 4096  # words over a request's queries (or questions); more get 422
    # requests of one API key served at once, more get 429 (Retry-After): one batch's worth (max_batch), so one
    # key alone is never more than a batch ahead of the others
    max_in_flight_per_key: int = 64
    max_turns_per_user: int = 200_000  # turns a user holds (deleted ones until compaction); an add past it gets 507
    # the text those turns hold on disk (their episode texts, UTF-8; deleted ones until compaction), so that one
    # user cannot fill the disk every user writes to; an add past it gets 507
    max_text_mb_per_user: int = 256
    min_free_disk_mb: int = 1024  # adds get 507 below this much free disk, so deletes and compaction still work
    # /metrics counts every user's activity (turns added, requests per route): an admin key's unless opened
    # here for a scraper that sends none (on a network only the operator reaches)
    open_metrics: bool = False
    drain_timeout_s: float = 30.0  # SIGTERM: in-flight requests get this long to finish, then the store closes
    # A stalled client holds a connection: its request's headers, and then its body, must each arrive
    # within this many seconds (headers: the connection is closed; body: 408)
    read_timeout_s: float = 30.0
    # What the server holds once started (torch, transformers, the store: ~500k objects) is left out of Python's
    # cyclic GC, whose full pass over it stalled every request ~0.3 s (16 clients: P95 388 ms against P50 67)
    freeze_gc: bool = True


@dataclass
class MemFitConfig:
    name: str = "memfit"  # the run's label: metrics.json `name`, a W&B tag
    method: str = "memfit"  # the memory system under test (memfit_gpu/methods): one of METHODS
    data: DataConfig = field(default_factory=DataConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    index: IndexConfig = field(default_factory=IndexConfig)
    segment: SegmentConfig = field(default_factory=SegmentConfig)
    summary: SummaryConfig = field(default_factory=SummaryConfig)
    retrieve: RetrieveConfig = field(default_factory=RetrieveConfig)
    rerank: RerankConfig = field(default_factory=RerankConfig)
    pack: PackConfig = field(default_factory=PackConfig)
    reader: ReaderConfig = field(default_factory=ReaderConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    # settings of the other memory systems (memfit_gpu/methods); each method reads only its own
    naive_rag: NaiveRAGConfig = field(default_factory=NaiveRAGConfig)
    full_context: FullContextConfig = field(default_factory=FullContextConfig)
    lightmem: LightMemConfig = field(default_factory=LightMemConfig)
    mem0: Mem0Config = field(default_factory=Mem0Config)
    # memfit_gpu.Memory and memfit serve
    live: LiveConfig = field(default_factory=LiveConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    # The settings of extensions registered outside this file (a plugin method's or read-path stage's own
    # dataclass, register_section): `plugins.<name>.<field>=value`; after loading, an instance of its dataclass per section given
    # (config.section gives a section's defaults where the config sets none of it).
    plugins: dict[str, Any] = field(default_factory=dict)


class ConfigError(ValueError):
    """A configuration file or override that does not fit `MemFitConfig`."""


# Names a registry adds to at run time (register_choice); the judge takes any reader backend.
_REGISTERED: dict[str, list[str]] = {"method": list(METHODS), "data.benchmark": list(BENCHMARKS),
                                     "reader.backend": list(READER_BACKENDS), "retrieve.stages": []}
# Sections of `plugins` (register_section): name -> the dataclass whose defaults and types its keys take.
_SECTIONS: dict[str, type] = {}
_CHOICES: dict[str, Sequence[str | None]] = {
    "data.benchmark": _REGISTERED["data.benchmark"],
    "data.split": (None, "s", "m", "oracle", "100K", "500K", "1M", "10M"),  # each benchmark's spec.splits
    "index.bm25_backend": ("torch", "reference"),
    "index.encoder_backend": ("packed", "sentence-transformers"),
    "index.encoder_workers": ("auto", "threads", "processes"),
    "index.dense_device": ("auto", "cpu", "gpu"),
    "retrieve.prf.term_order": ("idf", "alphabetical"),
    "retrieve.boosts.speaker_match": ("speaker", "mention"),
    "retrieve.kernels": ("torch", "triton", "auto"),
    "rerank.backend": ("cross-encoder", "none"),
    "reader.backend": _REGISTERED["reader.backend"],
    "reader.device_map": (None, "auto"),
    "reader.images": ("none", "question", "retrieved"),
    "reader.protocol": ("auto", "paper", "memgallery", "beam"),
    "eval.judge.backend": _REGISTERED["reader.backend"],
    "eval.judge.prompt": ("auto", "paper", "memgallery", "longmemeval", "beam"),
    "eval.beam.question": ("fill", "released"),
    "eval.beam.partial": ("keep", "floor"),
    "eval.beam.event_ordering": ("tau_f1", "tau", "rubric"),
    "eval.table_metric": ("paper", "locomo", "memgallery"),
    "eval.hit_list": HIT_LISTS,
    "tracking.wandb.mode": ("online", "offline", "disabled"),
    "method": _REGISTERED["method"],
    "lightmem.routing": ("slm", "mtm", "ltm"),
    "live.consolidate": ("background", "manual"),
    "live.indexing": ("on_add", "deferred"),
}


_METRICS = ("paper", "locomo", "memgallery")
TEXT_METRICS: tuple[str, ...] = ("rouge_l", "rouge_2", "meteor", "sbert")  # evaluate/text_metrics.py


def choices(key: str) -> tuple[str, ...]:
    """The names a registry-backed key takes now: method, data.benchmark or reader.backend (the judge's
    backend is any reader backend)."""
    return tuple(_REGISTERED[key])


def register_choice(key: str, name: str) -> None:
    """Let `key` (method, data.benchmark, reader.backend, retrieve.stages) take `name`: what a registry's
    register call does after adding its entry, so that a new method, benchmark, backend or read-path stage is
    one module and one call."""
    if key not in _REGISTERED:
        raise KeyError(f"{key} is not a registry-backed key ({', '.join(_REGISTERED)})")
    if name not in _REGISTERED[key]:
        _REGISTERED[key].append(name)


def register_section(name: str, settings: type) -> None:
    """Give an extension its own settings without editing this file: `plugins.<name>.*` takes the fields of
    the dataclass `settings` (their defaults, types and checks in its __post_init__), and a loaded config's
    `plugins[name]` is an instance of it (section(cfg, name)). A registry's register call makes it, from the
    entry's `settings`."""
    if not hasattr(settings, "__dataclass_fields__"):
        raise TypeError(f"register_section({name!r}): {settings!r} is not a dataclass")
    if _SECTIONS.get(name, settings) is not settings:
        raise ValueError(f"register_section({name!r}): already registered with {_SECTIONS[name].__name__}")
    _SECTIONS[name] = settings


def section(cfg: MemFitConfig, name: str) -> Any:
    """The settings of the registered section `name`: the loaded config's, or its defaults when `cfg` was
    made in code (MemFitConfig()) rather than by load_config."""
    if name not in _SECTIONS:
        raise KeyError(f"no config section {name!r} is registered ({', '.join(_SECTIONS) or 'none'})")
    found = cfg.plugins.get(name)
    return found if isinstance(found, _SECTIONS[name]) else _SECTIONS[name]()


def _load_sections(cfg: MemFitConfig, source: str) -> None:
    """Each `plugins.<name>` the config gives, as an instance of its registered dataclass. A section it does not
    give stays out (section() returns its defaults): a config saved by a process that loaded a plugin then
    loads where the plugin is not, unless it sets the plugin's settings."""
    unknown = sorted(set(cfg.plugins) - set(_SECTIONS))
    if unknown:
        raise ConfigError(f"{source}: plugins.{unknown[0]} is not a registered section (registered: "
                          f"{', '.join(_SECTIONS) or 'none'}; an extension registers its settings, e.g. "
                          "MethodEntry(settings=...), and is loaded through MEMFIT_PLUGINS)")
    loaded: dict[str, Any] = {}
    for name, given in cfg.plugins.items():
        settings = _SECTIONS[name]
        try:
            loaded[name] = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(settings), given or {}))
        except OmegaConfBaseException as exc:
            key = getattr(exc, "full_key", None)
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise ConfigError(f"{source}: plugins.{name}{'.' + str(key) if key else ''}: {reason}") from None
        except (TypeError, ValueError) as exc:  # the section's own checks (its __post_init__)
            raise ConfigError(f"{source}: plugins.{name}: {exc}") from None
    cfg.plugins = loaded


@dataclass(frozen=True)
class _Range:
    """Allowed values of one numeric key: finite, low <= value (low < value when low_open) <= high;
    None only where `optional`."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    optional: bool = False

    def holds(self, value: Any) -> bool:
        if value is None:
            return self.optional
        if not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or value <= self.high

    def describe(self) -> str:
        low = "" if self.low is None else f"{self.low:g}"
        if self.high is not None:
            text = f"in {'(' if self.low_open else '['}{low}, {self.high:g}]"
        elif self.low is not None:
            text = f"{'>' if self.low_open else '>='} {low}"
        else:
            text = "a finite number"
        return text + (" or null" if self.optional else "")


_AT_LEAST_1 = _Range(1)
_AT_LEAST_0 = _Range(0)
_FRACTION = _Range(0, 1)
# Every numeric key. A value outside its range would crash late (after the store is built) or run to the
# end with silently different retrieval, so it is refused before any work and before config.yaml is saved.
_RANGES: dict[str, _Range] = {
    "reader.seed": _Range(),
    "data.limit_memories": _Range(1, optional=True),
    "data.limit_questions": _Range(1, optional=True),
    "index.encode_batch_size": _AT_LEAST_1,
    "index.encode_batch_tokens": _AT_LEAST_0,  # 0 = auto by device
    "index.bm25_k1": _AT_LEAST_0,
    "index.bm25_b": _FRACTION,
    "index.dense_nprobe": _AT_LEAST_1,
    "index.dense_batched_max_rows": _AT_LEAST_0,  # 0 = every memory keeps a FAISS index (the path before dense batching)
    "store.write_budget_mb": _Range(1),  # a chunk needs room for at least one turn's text and vector
    "segment.min_window": _AT_LEAST_1,
    "segment.window_scale": _AT_LEAST_0,
    "segment.short_factor": _AT_LEAST_0,
    "segment.depth_std_factor": _Range(),
    "summary.min_segment": _AT_LEAST_1,
    "summary.max_summaries": _AT_LEAST_0,
    "summary.max_excerpts": _AT_LEAST_1,
    "summary.excerpt_chars": _AT_LEAST_1,
    "summary.temperature": _AT_LEAST_0,
    "summary.max_new_tokens": _AT_LEAST_1,
    "summary.min_chars": _AT_LEAST_0,
    "retrieve.scan_top_k": _AT_LEAST_1,
    "retrieve.alpha": _FRACTION,
    "retrieve.dense_min_cosine": _Range(-1, 1),
    "retrieve.boosts.speaker": _AT_LEAST_0,
    "retrieve.boosts.month": _AT_LEAST_0,
    "retrieve.boosts.year": _AT_LEAST_0,
    "retrieve.boosts.min_speaker_chars": _AT_LEAST_1,
    "retrieve.summary_top_k": _AT_LEAST_1,
    "retrieve.pool_size": _AT_LEAST_1,
    "retrieve.summary_expansion_top": _AT_LEAST_1,
    "retrieve.summary_expansion_weight": _AT_LEAST_0,
    "retrieve.prf.docs": _AT_LEAST_1,
    "retrieve.prf.terms": _AT_LEAST_1,
    "retrieve.prf.min_token_chars": _AT_LEAST_1,
    "retrieve.prf.weight": _AT_LEAST_0,
    "retrieve.question_batch_size": _AT_LEAST_1,
    "rerank.max_length": _Range(4),  # [CLS] question [SEP] passage [SEP] needs room for more than the markers
    "rerank.rerank_pool": _AT_LEAST_1,
    "rerank.batch_size": _AT_LEAST_1,
    "rerank.zscore_min": _AT_LEAST_0,
    "mem0.batch_size": _AT_LEAST_1,
    "mem0.top_k": _AT_LEAST_1,
    "mem0.max_tokens": _AT_LEAST_1,
    "mem0.temperature": _AT_LEAST_0,
    "pack.k": _AT_LEAST_1,
    "pack.context_window": _AT_LEAST_0,
    "pack.max_excerpt_chars": _AT_LEAST_1,
    "reader.instances": _AT_LEAST_1,
    "reader.tensor_parallel_size": _AT_LEAST_1,
    "reader.concurrency": _AT_LEAST_1,
    "reader.timeout_s": _Range(0, low_open=True),
    "reader.max_retries": _AT_LEAST_0,
    "reader.temperature": _AT_LEAST_0,
    "reader.max_new_tokens": _AT_LEAST_1,
    "reader.batch_size": _AT_LEAST_1,
    "reader.flush_every": _AT_LEAST_1,
    "reader.max_model_len": _AT_LEAST_1,
    "reader.gpu_memory_utilization": _Range(0, 1, low_open=True),
    "reader.max_prompt_chars": _AT_LEAST_1,
    "reader.prefix_cache_min_tokens": _AT_LEAST_0,
    "reader.max_images": _AT_LEAST_0,
    "reader.max_pixels": _Range(1, optional=True),
    "eval.judge.max_new_tokens": _AT_LEAST_1,
    "eval.bootstrap_samples": _AT_LEAST_1,
    "eval.permutation_samples": _AT_LEAST_1,
    "eval.seed": _Range(),
    "eval.beam.accept_at": _FRACTION,
    "naive_rag.chunk_tokens": _AT_LEAST_1,
    "naive_rag.overlap_tokens": _AT_LEAST_0,
    "naive_rag.top_k": _AT_LEAST_1,
    "full_context.context_tokens": _Range(1, optional=True),
    "lightmem.stm_turns": _AT_LEAST_0,
    "lightmem.mtm_window_turns": _AT_LEAST_1,
    "lightmem.consolidate_every": _AT_LEAST_1,
    "lightmem.top_k": _AT_LEAST_1,
    "lightmem.max_hqs": _AT_LEAST_1,
    "lightmem.coarse_factor": _AT_LEAST_1,
    "lightmem.turn_chars": _AT_LEAST_1,
    "lightmem.temperature": _AT_LEAST_0,
    "lightmem.mtm_max_new_tokens": _AT_LEAST_1,
    "lightmem.consolidate_max_new_tokens": _AT_LEAST_1,
    "lightmem.rewrite_max_new_tokens": _AT_LEAST_1,
    "lightmem.rerank_max_new_tokens": _AT_LEAST_1,
    "live.consolidate_after_turns": _AT_LEAST_1,
    "live.snapshot_after_turns": _AT_LEAST_1,
    "serve.port": _Range(0, 65535),  # 0: any free port (tests)
    "serve.batch_window_ms": _AT_LEAST_0,
    "serve.max_batch": _AT_LEAST_1,
    "serve.max_batch_texts": _AT_LEAST_1,
    "serve.max_body_bytes": _AT_LEAST_1,
    "serve.max_turns_per_request": _AT_LEAST_1,
    "serve.max_queries_per_request": _AT_LEAST_1,
    "serve.max_k": _AT_LEAST_1,
    "serve.max_query_words_per_request": _AT_LEAST_1,
    "serve.max_in_flight_per_key": _AT_LEAST_1,
    "serve.max_turns_per_user": _AT_LEAST_1,
    "serve.max_text_mb_per_user": _AT_LEAST_1,
    "serve.min_free_disk_mb": _AT_LEAST_0,
    "serve.drain_timeout_s": _AT_LEAST_0,
    "serve.read_timeout_s": _Range(0, low_open=True),
    "lightmem.noise.hq": _FRACTION,
    "lightmem.noise.write": _FRACTION,
    "lightmem.noise.mtm": _FRACTION,
    "lightmem.noise.seed": _Range(),
}


def _value_at(cfg: MemFitConfig, dotted: str) -> Any:
    value: Any = cfg
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def _check_choices(cfg: MemFitConfig, source: str) -> None:
    for dotted, allowed in _CHOICES.items():
        value = _value_at(cfg, dotted)
        if value not in allowed:
            names = ", ".join("null" if a is None else a for a in allowed)
            raise ConfigError(f"{source}: {dotted}={value!r} is not one of {names}")
    for position, stage in enumerate(cfg.retrieve.stages):
        if stage not in _REGISTERED["retrieve.stages"]:
            known = ", ".join(_REGISTERED["retrieve.stages"]) or "none registered"
            raise ConfigError(f"{source}: retrieve.stages[{position}]={stage!r} is not a registered read-path stage "
                              f"({known}; a stage is registered by its module, loaded through MEMFIT_PLUGINS)")
    for position, metric in enumerate(cfg.eval.metrics):
        if metric not in _METRICS:
            raise ConfigError(f"{source}: eval.metrics[{position}]={metric!r} is not one of {', '.join(_METRICS)}")
    for position, metric in enumerate(cfg.eval.text_metrics):
        if metric not in TEXT_METRICS:
            raise ConfigError(f"{source}: eval.text_metrics[{position}]={metric!r} is not one of "
                              f"{', '.join(TEXT_METRICS)}")
    for position, point in enumerate(cfg.eval.growth_points):
        if point < 1 or (position and point <= cfg.eval.growth_points[position - 1]):
            raise ConfigError(f"{source}: eval.growth_points[{position}]={point} must be >= 1 and larger than the "
                              "point before it (MTM sizes in increasing order, e.g. [100,1000,5000,10000])")
    for position, depth in enumerate(cfg.eval.pack_cutoffs):
        if depth < 1 or (position and depth <= cfg.eval.pack_cutoffs[position - 1]):
            raise ConfigError(f"{source}: eval.pack_cutoffs[{position}]={depth} must be >= 1 and larger than the "
                              "depth before it (pack depths k in increasing order, e.g. [5,10,20,30])")


def _check_ranges(cfg: MemFitConfig, source: str) -> None:
    for dotted, allowed in _RANGES.items():
        value = _value_at(cfg, dotted)
        if not allowed.holds(value):
            raise ConfigError(f"{source}: {dotted}={value!r} is out of range: it must be {allowed.describe()}")


def _check_together(cfg: MemFitConfig, source: str) -> None:
    """Settings that are only wrong in combination."""
    if cfg.reader.backend == "openai" and not cfg.reader.base_urls:
        raise ConfigError(f"{source}: reader.backend=openai needs reader.base_urls "
                          "(e.g. reader.base_urls=[http://127.0.0.1:8000/v1])")
    judge = cfg.eval.judge
    if judge.enabled and judge.backend == "openai" and not (judge.base_urls or cfg.reader.base_urls):
        raise ConfigError(f"{source}: eval.judge.backend=openai needs eval.judge.base_urls (or reader.base_urls)")
    for key, urls in (("reader.base_urls", cfg.reader.base_urls), ("eval.judge.base_urls", judge.base_urls)):
        for position, url in enumerate(urls):
            if not str(url).startswith(("http://", "https://")):
                raise ConfigError(f"{source}: {key}[{position}]={url!r} is not an http:// or https:// URL")
    try:
        cfg.rerank.summary_suffix.format(date="2023-05-08")
    except (KeyError, IndexError, ValueError) as exc:
        raise ConfigError(f"{source}: rerank.summary_suffix={cfg.rerank.summary_suffix!r} is not a format string "
                          f"with only a {{date}} slot ({type(exc).__name__}: {exc})") from None
    if cfg.naive_rag.overlap_tokens >= cfg.naive_rag.chunk_tokens:
        raise ConfigError(f"{source}: naive_rag.overlap_tokens={cfg.naive_rag.overlap_tokens} must be smaller than "
                          f"naive_rag.chunk_tokens={cfg.naive_rag.chunk_tokens} (each chunk must move the window on)")


def _base_of(data: Any, path: Path, chain: tuple[Path, ...]) -> Any:
    """Resolve `defaults: other.yaml` (one base file, relative to this one) before merging."""
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"{path}: a config is a mapping of keys (reader:, pack:, ...), not a {type(data).__name__}")
    if not isinstance(data, dict) or "defaults" not in data:
        return OmegaConf.create(data or {})
    base_name = data.pop("defaults")
    if not isinstance(base_name, str):
        raise ConfigError(f"{path}: defaults must name one base file (e.g. defaults: memfit.yaml), not {base_name!r}")
    base_path = (path.parent / base_name).resolve()
    if not base_path.is_file():
        raise ConfigError(f"{path}: defaults points at {base_name}, which is not a file ({base_path})")
    if base_path in chain:
        raise ConfigError(f"{path}: defaults: {base_name} leads back to a file already read "
                          f"({' -> '.join(p.name for p in (*chain, base_path))})")
    return OmegaConf.merge(_load_yaml_tree(base_path, chain), OmegaConf.create(data))


# Top-level keys that older versions wrote into config.yaml but that never changed a result: dropped on
# load (so a run directory started before keeps resuming), with where the setting lives now.
_RETIRED_KEYS = {"seed": "reader.seed (sampling) and eval.seed (bootstrap); the top-level seed was read by nothing"}


class DuplicateKeyError(yaml.YAMLError):
    """A YAML mapping that writes one key twice (UniqueKeyLoader); the loader does not know the file, so its
    reader names it (a ConfigError here, a SweepError for a sweep file)."""

    def __init__(self, key: Any, first_line: int, line: int):
        super().__init__(f"key {key!r} is written twice in one mapping (lines {first_line} and {line}): YAML would "
                         "keep the second and drop the first silently; write it once")
        self.key, self.first_line, self.line = key, first_line, line


class UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load that refuses a key written twice in one mapping: PyYAML keeps the last and drops the
    first without a word, so a section written twice (two `reader:` blocks) lost every setting of the first.
    Every YAML file memfit reads as settings (configs, sweep files) goes through it."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                # a merge key (`<<: *base`) may be written again, and the keys it brings may be overridden
                if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
                    continue
                key = self.construct_object(key_node)
                line = key_node.start_mark.line + 1
                if key in seen:
                    raise DuplicateKeyError(key, seen[key], line)
                seen[key] = line
        return super().construct_mapping(node, deep=deep)


def _load_yaml_tree(path: Path, chain: tuple[Path, ...] = ()) -> Any:
    if path.is_dir():
        raise ConfigError(f"{path}: a folder, not a config file (e.g. configs/memfit.yaml)")
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=UniqueKeyLoader)  # a SafeLoader: no tags run code
    except DuplicateKeyError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start}): a config is a YAML file") from None
    if isinstance(data, dict):
        for key in _RETIRED_KEYS.keys() & data.keys():
            log.warning("%s: ignoring retired key %r: see %s", path, key, _RETIRED_KEYS[key])
            del data[key]
    return _base_of(data, path, (*chain, path.resolve()))


def _leaf_keys(cls: Any = MemFitConfig, prefix: str = "") -> list[str]:
    """Every dotted key of the config tree, e.g. retrieve.boosts.speaker_match."""
    keys = []
    for name, f in cls.__dataclass_fields__.items():
        nested = f.default_factory if f.default_factory is not MISSING_FACTORY else None
        value = nested() if nested is not None else None
        if value is not None and hasattr(value, "__dataclass_fields__"):
            keys.extend(_leaf_keys(type(value), f"{prefix}{name}."))
        else:
            keys.append(prefix + name)
    return keys


def _did_you_mean(overrides: Sequence[str]) -> str:
    """`; did you mean retrieve.boosts.speaker_match?` for an override key that is the tail of a real one."""
    known = _leaf_keys()
    for override in overrides:
        key = override.split("=", 1)[0].strip()
        if key in known:
            continue
        matches = [k for k in known if k.endswith("." + key)]
        if matches:
            return f"; did you mean {' or '.join(matches)}?"
    return ""


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> MemFitConfig:
    """Defaults <- YAML file (with optional `defaults:` base) <- dot-list overrides, validated."""
    schema = OmegaConf.structured(MemFitConfig)
    source = str(path) if path else "<defaults>"
    try:
        merged = schema
        if path is not None:
            path = Path(path)
            if not path.exists():
                raise ConfigError(f"config file not found: {path}")
            merged = OmegaConf.merge(merged, _load_yaml_tree(path))
        bad = [o for o in overrides if "=" not in o]
        if bad:
            raise ConfigError(f"override {bad[0]!r} is not key=value (e.g. retrieve.scan_top_k=30)")
        if overrides:
            source = f"{source} + overrides {list(overrides)}"
            try:
                dotlist = OmegaConf.from_dotlist(list(overrides))
            except yaml.YAMLError as exc:  # a value OmegaConf reads as YAML: `eval.metrics=[f1`
                raise ConfigError(f"{source}: a value is not valid YAML: {str(exc).splitlines()[0]}") from None
            merged = OmegaConf.merge(merged, dotlist)
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None)
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        hint = _did_you_mean(overrides)
        raise ConfigError(f"{source}: {'key ' + repr(key) + ': ' if key else ''}{reason}{hint}") from None
    assert isinstance(cfg, MemFitConfig)
    _load_sections(cfg, source)
    _check_choices(cfg, source)
    _check_ranges(cfg, source)
    _check_together(cfg, source)
    return cfg


def to_yaml(cfg: MemFitConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def to_dict(cfg: MemFitConfig) -> dict[str, Any]:
    out = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
    assert isinstance(out, dict)
    return out  # type: ignore[return-value]
