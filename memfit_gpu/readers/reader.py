"""The caching reader: a backend behind the run's SQLite response cache and cost ledger.

`make_reader` builds the configured backend (registry.py) and wraps it, so every caller (summaries,
answers, judge) gets caching, resumability and accounting for free. The backend's model (weights, vLLM
engines) loads with the first request the cache cannot serve: a rerun the cache serves entirely loads
none. Each group of responses the backend returns (a server's: each response as it arrives) is committed
to the cache together with the ledger entries that account for it, before anything else happens to it;
`load_ledger` rebuilds a resumed run's ledger from those entries.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from memfit_gpu import faults
from memfit_gpu.readers.cache import ResponseCache, request_key
from memfit_gpu.readers.ledger import Ledger, read_ledger
from memfit_gpu.readers.registry import make_backend
from memfit_gpu.readers.types import Backend, PromptTokenLimit, ReaderError, Request, Response

if TYPE_CHECKING:
    from memfit_gpu.config import ReaderConfig


_calls = threading.local()  # this thread's calls are background work (background_calls)


@contextlib.contextmanager
def background_calls() -> Iterator[None]:
    """Reader calls made on this thread meanwhile are background work (a live memory's consolidation, mem0's
    extraction behind the peers' endpoint): they go a backend chunk at a time (`Backend.chunk_size`), and
    before each chunk any call waiting that is not background goes first, so one user's consolidation never
    holds the reader that every user's answers wait for. Nests; a batch run makes no background calls."""
    before = calls_are_background()
    _calls.background = True
    try:
        yield
    finally:
        _calls.background = before


def calls_are_background() -> bool:
    """Whether reader calls made on this thread now are background work (background_calls)."""
    return getattr(_calls, "background", False)


def _served_again(response: Response) -> Response:
    """A response as a cache hit (no new call: zero latency, counted as cached in the ledger)."""
    return Response(response.text, response.input_tokens, response.output_tokens, 0.0, True, response.model,
                    response.tokens_estimated, dict(response.notes), response.error, response.answered)


def _in_batches(ready: list[tuple[int, Response]], step: int) -> Iterator[list[tuple[int, Response]]]:
    ready = sorted(ready, key=lambda item: item[0])
    for b in range(0, len(ready), step):
        yield ready[b:b + step]


class Reader:
    """A backend behind the run's response cache and ledger. `generate` answers a whole batch."""

    def __init__(self, backend: Backend, cache: ResponseCache | None, ledger: Ledger,
                 default_max_new_tokens: int, default_temperature: float, progress: bool = True,
                 per_owner: bool = False) -> None:
        self.backend = backend
        # the request's owner in its cache key (a live memory): users never share a cached reply, so one
        # cannot time whether another asked the same, and erasing a user's responses erases all of them
        self.per_owner = per_owner
        self.cache = cache
        self.ledger = ledger
        self.default_max_new_tokens = default_max_new_tokens
        self.default_temperature = default_temperature
        self.progress = progress
        # calls from several threads take turns (a live memory answers beside its consolidation); a call that
        # is not background work goes before background work waiting (background_calls)
        self._turns = threading.Condition()
        self._in_use = False
        self._waiting = 0  # calls waiting that are not background work
        self._loading = threading.Lock()  # the backend's model is loaded once, by the first call that needs it
        self._loaded = False

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
                            self.default_temperature if r.temperature is None else r.temperature, r.key, r.owner,
                            r.response_format)
            out.append(r)
        return out

    def generate(self, requests: Sequence[Request], partial: bool = False) -> list[Response]:
        """One response per request, in order: cached ones from the cache, the rest from the backend (a
        request repeated within the batch is generated once). Every response is in the ledger.

        A request that got no answer (`Response.answered` False: a server failed it after its retries) is
        a ReaderError once every other request is answered and committed, unless `partial`, which hands
        such responses back for the caller to count."""
        out: list[Response | None] = [None] * len(requests)
        step = max(1, int(self.backend.chunk_size))
        background = calls_are_background()
        show = self.progress and len(requests) > step and not background
        # background work a chunk per turn; other calls whole (a server keeps all their requests in flight)
        for first in range(0, len(requests), step) if background else [0]:
            part = requests[first:first + step] if background else requests
            with self._turn(background):
                for batch in self.generate_batches(part, step, progress=show):
                    for position, response in batch:
                        out[first + position] = response
        failed = [r for r in out if r is not None and not r.answered]
        if failed and not partial:
            raise ReaderError(f"{len(failed)} of {len(out)} {requests[0].role} calls to {self.backend.name} got no "
                              f"answer (first: {failed[0].error}); the others are committed to the response cache: "
                              "rerun the same command to ask these again")
        return out  # type: ignore[return-value]

    @contextlib.contextmanager
    def _turn(self, background: bool) -> Iterator[None]:
        """The reader to this thread alone meanwhile; background work waits while another call waits."""
        with self._turns:
            self._waiting += not background
            try:
                self._turns.wait_for(lambda: not self._in_use and not (background and self._waiting))
            finally:
                self._waiting -= not background
            self._in_use = True
        try:
            yield
        finally:
            with self._turns:
                self._in_use = False
                self._turns.notify_all()

    def generate_batches(self, requests: Sequence[Request], batch_size: int,
                         progress: bool = False) -> Iterator[list[tuple[int, Response]]]:
        """Responses in batches of at least `batch_size` (the last may be smaller) as they finish, each
        batch a list of (position in `requests`, response) sorted by position.

        Cached responses come first. Every uncached request is offered to the backend at once
        (`Backend.generate_stream`): a server keeps as many in flight as it allows, whatever the batch
        size. Each group the backend returns is committed at once, the responses to the cache and their
        ledger entries with them, in one transaction (a failed request's entry without its response: a
        rerun asks again); only then is it applied to the in-memory ledger and, batch by batch, handed
        out. A kill, a reader failure or a full disk after that loses no paid call."""
        requests = self._filled(requests)
        start = time.perf_counter()
        role = requests[0].role if requests else "answer"
        keys = [request_key(self.backend.name, self.backend.model, r, self.backend.template_kwargs,
                            self.backend.cfg.seed, r.owner if self.per_owner else None) for r in requests]
        found = self.cache.get_many(keys) if self.cache is not None else {}
        positions: dict[str, list[int]] = {}
        for i, key in enumerate(keys):
            positions.setdefault(key, []).append(i)
        step = max(1, int(batch_size))
        try:
            served = [(i, _served_again(found[key])) for i, key in enumerate(keys) if key in found]
            self._commit(requests, [], served, None)
            yield from _in_batches(served, step)
            # Identical requests are generated once: the others are served that response as cached.
            todo = [key for key in positions if key not in found]
            if todo:  # the model loads only for a request the cache cannot serve, and its load is no role's time
                start += self._load_backend()
            bar = tqdm(total=len(todo), desc=f"{self.backend.name} {role}", unit="call", disable=not progress)
            ready: list[tuple[int, Response]] = []  # committed, not yet handed out
            committed: dict[int, list[tuple[int, Response]]] = {}  # per stream position, once committed
            clock = [time.perf_counter()]

            def received(group: list[tuple[int, Response]]) -> None:
                # On the backend's receiving thread for a server (as each response arrives), else here.
                made: list[tuple[str, int, Response]] = []  # (cache key, position, response) generated
                handed: dict[int, list[tuple[int, Response]]] = {}
                for j, response in group:
                    first, *repeats = positions[todo[j]]
                    made.append((todo[j], first, response))
                    handed[j] = [(first, response)] + [(i, _served_again(response)) for i in repeats]
                clock[0] = self._commit(requests, made, [h for j in handed for h in handed[j]], clock[0])
                committed.update(handed)

            for group in self.backend.generate_stream([requests[positions[key][0]] for key in todo], step, received):
                for j, _ in group:
                    ready.extend(committed.pop(j))
                bar.update(len(group))
                if len(ready) >= step:
                    yield from _in_batches(ready, step)
                    ready = []
            if ready:
                yield from _in_batches(ready, step)
            bar.close()
        finally:
            self.ledger.add_wall(role, time.perf_counter() - start)

    def _load_backend(self) -> float:
        """Load the backend's model unless it is loaded (`Backend.load`); the seconds that took."""
        with self._loading:
            if self._loaded:
                return 0.0
            began = time.perf_counter()
            faults.point("reader.load")
            self.backend.load()
            self._loaded = True
            return time.perf_counter() - began

    def _commit(self, requests: Sequence[Request], made: Sequence[tuple[str, int, Response]],
                handed: Sequence[tuple[int, Response]], since: float | None) -> float:
        """Cache what was generated (`made`) and commit the ledger entries of everything `handed` out in
        the same transaction, then apply them; the GPU-seconds the backend held since `since` are shared
        by the generated responses. Returns now."""
        now = time.perf_counter()
        if not handed:
            return now
        generated = sum(1 for _, response in handed if not response.cached)
        share = (now - since) * self.backend.gpus / generated if since is not None and generated else 0.0
        entries = [self.ledger.entry(requests[i].role, requests[i].key, response, self.backend.name,
                                     0.0 if response.cached else share, owner=requests[i].owner)
                   for i, response in sorted(handed, key=lambda item: item[0])]
        self._commit_entries(self.backend.name, entries, [(key, requests[i].role, r) for key, i, r in made],
                             [requests[i].owner for _, i, _ in made])
        return now

    def _commit_entries(self, backend: str, entries: list[dict[str, Any]],
                        responses: Sequence[tuple[str, str, Response]] = (),
                        owners: Sequence[str | None] | None = None) -> None:
        """The one commit: `responses` (cache key, role, response) and the ledger `entries` that account for
        them into cache.sqlite in one transaction (kill point reader.commit), then the entries applied to the
        ledger in memory."""
        if self.cache is not None:
            self.cache.commit(backend, responses, entries, owners=owners)
            faults.point("reader.commit")
        self.ledger.apply(entries)

    def record_call(self, role: str, key: str, response: Response, backend: str, owner: str | None = None) -> None:
        """Account a call this reader's backend did not make (the run's encoder serving a peer system's
        embeddings, methods/peers/endpoint.py): its ledger entry is committed to the cache like a generated
        response's, so a resumed run's ledger has it, then applied."""
        self._commit_entries(backend, [self.ledger.entry(role, key, response, backend, owner=owner)])

    def forget(self, owners: Sequence[str], responses_of: Sequence[str] = ()) -> dict[str, int]:
        """`ResponseCache.forget` while no call of this reader commits (a live memory compacting beside an
        answer being generated): the rows dropped."""
        with self._turn(background=False):
            return self.cache.forget(owners, responses_of) if self.cache is not None else {"responses": 0, "calls": 0}

    def close(self) -> None:
        self.backend.close()
        if self.cache is not None:
            self.cache.close()

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def load_ledger(run_dir: str | Path) -> Ledger:
    """The ledger of a run directory, rebuilt from the entries its cache.sqlite committed with the
    responses (every paid call, exactly once, whatever killed the run when).

    ledger.json, the report the last save left, gives the wall time per role; its counts are the base
    only while the cache holds no entries (a directory an older memfit wrote, or one whose damaged cache
    was deleted), and are then kept in the cache. Raises DataError naming ledger.json and the field when it
    is not a ledger (not UTF-8 JSON, not an object, roles or counts of another shape: readers/ledger.py
    check_ledger)."""
    run_dir = Path(run_dir)
    report_path = run_dir / "ledger.json"
    report = read_ledger(report_path) if report_path.exists() else None
    cache = ResponseCache(run_dir / "cache.sqlite")
    try:
        base = cache.ledger_base()
        entries = cache.entries()
        if base is None and not entries and report is not None:
            base = {name: report[name] for name in ("roles", "models", "answer_keys") if name in report}
            cache.set_ledger_base(base)
        wall_s = {role: stats.get("wall_s", 0.0) for role, stats in (report or {}).get("roles", {}).items()}
        return Ledger.rebuilt(entries, base, wall_s)
    finally:
        cache.close()


def make_reader(cfg: ReaderConfig, run_dir: str | Path | None, *, ledger: Ledger | None = None,
                cache: bool = True, progress: bool = True, per_owner: bool = False,
                **backend_options: Any) -> Reader:
    """The configured backend behind `run_dir/cache.sqlite` and a ledger (shared when passed in).

    Args:
        run_dir: the run directory; None means no cache (nothing is persisted).
        ledger: the run's ledger, shared by its readers (answer and judge); a new one when None.
        cache: False = no response cache even with a run_dir.
        per_owner: each request's owner in its cache key (Reader.per_owner; a live memory's reader).
        backend_options: go to the backend's constructor (e.g. `backoff_base_s` for openai).
    """
    backend = make_backend(cfg, run_dir, **backend_options)
    response_cache = None
    if cache and run_dir is not None:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        response_cache = ResponseCache(Path(run_dir) / "cache.sqlite")
    return Reader(backend, response_cache, ledger if ledger is not None else Ledger(),
                  cfg.max_new_tokens, cfg.temperature, progress=progress, per_owner=per_owner)
