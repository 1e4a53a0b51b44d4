"""The `method` key and the settings of the memory systems other than MemFit (config sections
`naive_rag`, `full_context`, `lightmem`).

A leaf module (standard library only): memfit_gpu.config builds MemFitConfig from these dataclasses and
merges CHOICES and RANGES into its checks, so a bad value is refused before any work like every other key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

# memfit: the paper's system; plain: the same store and hybrid + rerank with every MemFit addition off
# (configs/ablations/plain_retrieval.yaml as a method); naive_rag: fixed-size chunks, dense top-k;
# full_context: the whole history in the prompt; lightmem_slm: LightMem driven by small models.
METHODS: tuple[str, ...] = ("memfit", "plain", "naive_rag", "full_context", "lightmem_slm")


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
    mtm_max_new_tokens: int = 80
    consolidate_max_new_tokens: int = 128
    rewrite_max_new_tokens: int = 64
    rerank_max_new_tokens: int = 32
    prompt_dir: str = "lightmem"  # folder under memfit_gpu/prompts/ (or a path) holding the four SLM prompts


CHOICES: dict[str, tuple[Any, ...]] = {
    "method": METHODS,
    "lightmem.routing": ("slm", "mtm", "ltm"),
}

# keyword arguments of config._Range per numeric key
RANGES: dict[str, dict[str, Any]] = {
    "naive_rag.chunk_tokens": {"low": 1},
    "naive_rag.overlap_tokens": {"low": 0},
    "naive_rag.top_k": {"low": 1},
    "full_context.context_tokens": {"low": 1, "optional": True},
    "lightmem.stm_turns": {"low": 0},
    "lightmem.mtm_window_turns": {"low": 1},
    "lightmem.consolidate_every": {"low": 1},
    "lightmem.top_k": {"low": 1},
    "lightmem.max_hqs": {"low": 1},
    "lightmem.coarse_factor": {"low": 1},
    "lightmem.turn_chars": {"low": 1},
    "lightmem.temperature": {"low": 0},
    "lightmem.mtm_max_new_tokens": {"low": 1},
    "lightmem.consolidate_max_new_tokens": {"low": 1},
    "lightmem.rewrite_max_new_tokens": {"low": 1},
    "lightmem.rerank_max_new_tokens": {"low": 1},
}


def check_together(cfg: Any, source: str) -> str | None:
    """Why method settings that are only wrong together are wrong (None: they fit)."""
    if cfg.naive_rag.overlap_tokens >= cfg.naive_rag.chunk_tokens:
        return (f"{source}: naive_rag.overlap_tokens={cfg.naive_rag.overlap_tokens} must be smaller than "
                f"naive_rag.chunk_tokens={cfg.naive_rag.chunk_tokens} (each chunk must move the window on)")
    return None
