"""The caching reader: a backend behind the run's SQLite response cache and cost ledger.

`make_reader` builds the configured backend (registry.py) and wraps it, so every caller (summaries,
answers, judge) gets caching, resumability and accounting for free.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from memfit_gpu.readers.cache import ResponseCache, request_key
from memfit_gpu.readers.ledger import Ledger
from memfit_gpu.readers.registry import make_backend
from memfit_gpu.readers.types import Backend, PromptTokenLimit, ReaderError, Request, Response

if TYPE_CHECKING:
    from memfit_gpu.config import ReaderConfig


class Reader:
    """A backend behind the run's response cache and ledger. `generate` answers a whole batch."""

    def __init__(self, backend: Backend, cache: ResponseCache | None, ledger: Ledger,
                 default_max_new_tokens: int, default_temperature: float, progress: bool = True) -> None:
        self.backend = backend
        self.cache = cache
        self.ledger = ledger
        self.default_max_new_tokens = default_max_new_tokens
        self.default_temperature = default_temperature
        self.progress = progress

    @property
    def model(self) -> str:
        return self.backend.model

    def prompt_token_limit(self) -> PromptTokenLimit | None:
        return self.backend.prompt_token_limit()

    def _filled(self, requests: Sequence[Request]) -> list[Request]:
        # Filled before the cache key is made: a request that leaves them unset and one that spells out
        # the same values are the same call.
        out = []
        for r in requests:
            if r.max_new_tokens is None or r.temperature is None:
                r = Request(r.messages, r.role, list(r.images),
                            self.default_max_new_tokens if r.max_new_tokens is None else r.max_new_tokens,
                            self.default_temperature if r.temperature is None else r.temperature, r.key)
            out.append(r)
        return out

    def generate(self, requests: Sequence[Request]) -> list[Response]:
        """One response per request, in order: cached ones from the cache, the rest from the backend (a
        request repeated within the batch is generated once). Every response is recorded in the ledger."""
        requests = self._filled(requests)
        start = time.perf_counter()
        keys = [request_key(self.backend.name, self.backend.model, r, self.backend.template_kwargs) for r in requests]
        found = self.cache.get_many(keys) if self.cache is not None else {}
        # Identical requests in one batch are generated once: the second is a cache hit of the first.
        todo: dict[str, Request] = {}
        for k, r in zip(keys, requests, strict=True):
            if k not in found and k not in todo:
                todo[k] = r
        fresh: dict[str, Response] = {}
        todo_keys = list(todo)
        chunks = [todo_keys[i:i + self.backend.chunk_size] for i in range(0, len(todo_keys), self.backend.chunk_size)]
        bar = None
        if self.progress and len(chunks) > 1:
            bar = tqdm(total=len(todo_keys), desc=f"{self.backend.name} {requests[0].role}", unit="call")
        for chunk in chunks:
            chunk_start = time.perf_counter()
            answers = self.backend.generate([todo[k] for k in chunk])
            if len(answers) != len(chunk):
                raise ReaderError(f"{self.backend.name} returned {len(answers)} responses for {len(chunk)} requests")
            chunk_wall = time.perf_counter() - chunk_start
            for k, resp in zip(chunk, answers, strict=True):
                fresh[k] = resp
            # Committed per chunk: a killed run keeps every call that finished. A failed request is not
            # cached, so a rerun asks again.
            if self.cache is not None:
                self.cache.put_many(self.backend.name,
                                    [(k, todo[k].role, fresh[k]) for k in chunk if fresh[k].error is None])
            self.ledger.add_gpu_seconds(todo[chunk[0]].role, chunk_wall * self.backend.gpus)
            if bar is not None:
                bar.update(len(chunk))
        if bar is not None:
            bar.close()
        out: list[Response] = []
        made: set[str] = set()
        for k, r in zip(keys, requests, strict=True):
            if k in fresh and k not in made:
                made.add(k)
                resp = fresh[k]
            else:
                src = fresh[k] if k in fresh else found[k]
                resp = Response(src.text, src.input_tokens, src.output_tokens, 0.0, True, src.model,
                                src.tokens_estimated, dict(src.notes), src.error)
            out.append(resp)
            self.ledger.record(r.role, r.key, resp, backend=self.backend.name)
        self.ledger.add_wall(requests[0].role if requests else "answer", time.perf_counter() - start)
        return out

    def close(self) -> None:
        self.backend.close()
        if self.cache is not None:
            self.cache.close()

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def make_reader(cfg: ReaderConfig, run_dir: str | Path | None, *, ledger: Ledger | None = None,
                cache: bool = True, progress: bool = True, **backend_options: Any) -> Reader:
    """The configured backend behind `run_dir/cache.sqlite` and a ledger (shared when passed in).

    Args:
        run_dir: the run directory; None means no cache (nothing is persisted).
        ledger: the run's ledger, shared by its readers (answer and judge); a new one when None.
        cache: False = no response cache even with a run_dir.
        backend_options: go to the backend's constructor (e.g. `backoff_base_s` for openai).
    """
    backend = make_backend(cfg, run_dir, **backend_options)
    response_cache = None
    if cache and run_dir is not None:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        response_cache = ResponseCache(Path(run_dir) / "cache.sqlite")
    return Reader(backend, response_cache, ledger if ledger is not None else Ledger(),
                  cfg.max_new_tokens, cfg.temperature, progress=progress)
