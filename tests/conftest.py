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
