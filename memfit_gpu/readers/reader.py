"""The caching reader: a backend behind the run's SQLite response cache and cost ledger.

`make_reader` builds the configured backend (registry.py) and wraps it, so every caller (summaries,
answers, judge) gets caching, resumability and accounting for free.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from memfit_gpu.readers.cache import ResponseCache, request_key
from memfit_gpu.readers.ledger import Ledger
from memfit_gpu.readers.registry import make_backend
from memfit_gpu.readers.types import Backend, PromptTokenLimit, Request, Response

if TYPE_CHECKING:
    from memfit_gpu.config import ReaderConfig


def _served_again(response: Response) -> Response:
    """A response as a cache hit (no new call: zero latency, counted as cached in the ledger)."""
    return Response(response.text, response.input_tokens, response.output_tokens, 0.0, True, response.model,
                    response.tokens_estimated, dict(response.notes), response.error)


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
        out: list[Response | None] = [None] * len(requests)
        show = self.progress and len(requests) > self.backend.chunk_size
        for batch in self.generate_batches(requests, self.backend.chunk_size, progress=show):
            for position, response in batch:
                out[position] = response
        return out  # type: ignore[return-value]

    def generate_batches(self, requests: Sequence[Request], batch_size: int,
                         progress: bool = False) -> Iterator[list[tuple[int, Response]]]:
        """Responses in batches of at least `batch_size` (the last may be smaller) as they finish, each
        batch a list of (position in `requests`, response) sorted by position.

        Cached responses come first. Every uncached request is offered to the backend at once
        (`Backend.generate_stream`): a server keeps as many in flight as it allows, whatever the batch
        size. Before a batch is yielded its calls are in the response cache and in the ledger, so a
        caller that saves the ledger and then writes the batch loses nothing to a kill (a failed
        request is recorded but not cached: a rerun asks again)."""
        requests = self._filled(requests)
        start = time.perf_counter()
        role = requests[0].role if requests else "answer"
        keys = [request_key(self.backend.name, self.backend.model, r, self.backend.template_kwargs,
                            self.backend.cfg.seed) for r in requests]
        found = self.cache.get_many(keys) if self.cache is not None else {}
        positions: dict[str, list[int]] = {}
        for i, key in enumerate(keys):
            positions.setdefault(key, []).append(i)
        step = max(1, int(batch_size))
        try:
            served = [(i, _served_again(found[key])) for i, key in enumerate(keys) if key in found]
            yield from self._recorded_batches(requests, served, step)
            # Identical requests are generated once: the others are served that response as cached.
            todo = [key for key in positions if key not in found]
            bar = tqdm(total=len(todo), desc=f"{self.backend.name} {role}", unit="call", disable=not progress)
            ready: list[tuple[int, Response]] = []
            made: list[tuple[str, str, Response]] = []  # (key, role, response) generated since the last commit
            clock = time.perf_counter()
            stream = self.backend.generate_stream([requests[positions[key][0]] for key in todo], step)
            try:
                for group in stream:
                    for j, response in group:
                        first, *repeats = positions[todo[j]]
                        ready.append((first, response))
                        ready.extend((i, _served_again(response)) for i in repeats)
                        made.append((todo[j], requests[first].role, response))
                    bar.update(len(group))
                    if len(ready) >= step:
                        clock = self._commit(made, role, clock)
                        yield from self._recorded_batches(requests, ready, step)
                        ready, made = [], []
            except Exception:
                # the backend failed after answering some: keep those (a rerun is served them)
                self._commit(made, role, clock)
                self._recorded(requests, ready)
                raise
            if ready:
                self._commit(made, role, clock)
                yield from self._recorded_batches(requests, ready, step)
            bar.close()
        finally:
            self.ledger.add_wall(role, time.perf_counter() - start)

    def _commit(self, made: Sequence[tuple[str, str, Response]], role: str, since: float) -> float:
        """Cache what was generated (a failed request is not cached: a rerun asks again) and bill the GPUs
        the backend held since `since`; returns now."""
        if self.cache is not None:
            self.cache.put_many(self.backend.name, [(key, r, resp) for key, r, resp in made if resp.error is None])
        now = time.perf_counter()
        self.ledger.add_gpu_seconds(role, (now - since) * self.backend.gpus)
        return now

    def _recorded_batches(self, requests: Sequence[Request], ready: list[tuple[int, Response]],
                          step: int) -> Iterator[list[tuple[int, Response]]]:
        """All of `ready` recorded in the ledger at once (as the cache holds them: a ledger saved after the
        first batch accounts for every call made, so a rerun re-served the rest counts none twice), then
        handed out in position order, `step` at a time."""
        ready = self._recorded(requests, ready)
        for b in range(0, len(ready), step):
            yield ready[b:b + step]

    def _recorded(self, requests: Sequence[Request], batch: list[tuple[int, Response]]) -> list[tuple[int, Response]]:
        batch = sorted(batch, key=lambda item: item[0])
        for i, response in batch:
            self.ledger.record(requests[i].role, requests[i].key, response, backend=self.backend.name)
        return batch

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
