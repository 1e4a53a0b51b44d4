"""Session-wide fixtures: real data from ../shared/data, real packaged models loaded once."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Tests never reach a model hub: packaged weights only, and a clear error otherwise.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("MEMFIT_SHARED_DATA", REPO.parent / "shared" / "data"))


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.exists():
        raise RuntimeError(f"benchmark data not found at {SHARED_DATA}: CI needs ../shared beside the checkout")
    return SHARED_DATA


@pytest.fixture(scope="session")
def locomo_path(shared_data: Path) -> Path:
    return shared_data / "locomo" / "locomo10.json"


@pytest.fixture(scope="session")
def bi_encoder():
    """The real all-MiniLM-L6-v2 bi-encoder (packaged weights), loaded once per test session, on CPU."""
    from memfit_gpu.index.encoders import BiEncoder

    return BiEncoder.from_pretrained("sentence-transformers/all-MiniLM-L6-v2", device="cpu")


@pytest.fixture(scope="session")
def minilm_path() -> Path:
    """Folder of the real all-MiniLM-L6-v2 weights, as `models.resolve` finds them (packaged offline)."""
    from memfit_gpu.models import resolve

    return Path(resolve("encoder", "sentence-transformers/all-MiniLM-L6-v2").path)


@pytest.fixture(scope="session")
def minilm(bi_encoder):
    """The loaded BiEncoder (same object as `bi_encoder`: one load per session)."""
    return bi_encoder


def lead_summaries(prompts: list[str]) -> list[str]:
    """Extractive summaries without an LLM: the first two excerpt bullets of each summary prompt.

    Real conversation text, deterministic; for tests of retrieval over a summary layer (not of summary
    quality, which needs a reader)."""
    out = []
    for prompt in prompts:
        bullets = [line[2:] for line in prompt.splitlines() if line.startswith("- ")]
        out.append(" ".join(bullets[:2]))
    return out


@pytest.fixture(scope="session")
def locomo2_summary_store(locomo_path: Path, bi_encoder):
    """In-memory EpisodeStore of the first two LoCoMo conversations (788 turns, one encoder pass) with
    extractive summaries (`lead_summaries`). Read-only: tests must not append to or delete from it."""
    from memfit_gpu.config import MemFitConfig
    from memfit_gpu.data import load_benchmark, select_questions
    from memfit_gpu.store import EpisodeStore

    benchmark = select_questions(load_benchmark("locomo", locomo_path), exclude_categories=["5"], limit_memories=2)
    store = EpisodeStore(None, MemFitConfig(), bi_encoder)
    store.add_memories(benchmark.memories, progress=False)
    store.build_summaries(lead_summaries, progress=False)
    return benchmark, store
