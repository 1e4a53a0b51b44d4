"""Readers: `make_reader(cfg, run_dir).generate(requests) -> responses`, over transformers | vllm | openai.

Heavy libraries (torch, transformers, vllm, httpx) are imported only when a backend is built.
"""

from __future__ import annotations

from memfit_gpu.readers.base import (
    BACKENDS,
    ROLE_PHASES,
    ROLES,
    Backend,
    MissingBackendError,
    Reader,
    ReaderError,
    Request,
    Response,
    make_backend,
    make_reader,
    reader_config_for_judge,
)
from memfit_gpu.readers.clean import NOT_FOUND, CleanAnswer, clean_answer, clean_answers
from memfit_gpu.readers.ledger import Ledger, LedgerCheckError

__all__ = [
    "BACKENDS", "ROLE_PHASES", "ROLES", "Backend", "MissingBackendError", "Reader", "ReaderError", "Request",
    "Response", "make_backend", "make_reader", "reader_config_for_judge", "NOT_FOUND", "CleanAnswer", "clean_answer",
    "clean_answers", "Ledger", "LedgerCheckError",
]
