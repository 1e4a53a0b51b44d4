"""What every reader backend speaks: `Request`s in, `Response`s out in the same order, and the `Backend` ABC.

This module imports no backend and nothing heavy: backends import it, `registry.py` finds them by name,
and `reader.py` puts one behind the run's response cache and ledger.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from memfit_gpu.config import ReaderConfig

Role = Literal["summary", "answer", "judge", "mtm_summary", "consolidate", "rewrite", "rerank_slm", "growth_answer",
               "depth_answer", "mem0_write", "mem0_read", "mem0_embed_write", "mem0_embed_read"]
# (tokens a model reads at most, a function counting the prompt tokens of a chat message list)
PromptTokenLimit = tuple[int, Callable[[list[dict[str, Any]]], int]]
# Called with each group of (position, response) before it is yielded (the caching reader commits it).
Received = Callable[[list[tuple[int, "Response"]]], None]
# Each role's phase, which the ledger totals: write = building memory (MemFit's summaries,
# LightMem's MTM notes and LTM consolidation), read = answering a question (the answer call, LightMem's
# query rewrite and re-rank), eval = scoring (the judge; the growth analysis's answers; the answers at
# the other pack depths of eval.pack_cutoffs, which the run's own read phase and its efficiency row leave out).
# A peer system run from its own package (methods/peers/) has a role per phase for its chat calls, and roles
# for the embeddings the run's encoder serves it (methods/peers/endpoint.py) in phase embed: they are no LLM
# calls (MemFit's own encodings are not requests at all), so the write and read phases count LLM calls only.
ROLE_PHASES: dict[str, str] = {"summary": "write", "answer": "read", "judge": "eval", "mtm_summary": "write",
                               "consolidate": "write", "rewrite": "read", "rerank_slm": "read",
                               "growth_answer": "eval", "depth_answer": "eval",
                               "mem0_write": "write", "mem0_read": "read",
                               "mem0_embed_write": "embed", "mem0_embed_read": "embed"}
ROLES: tuple[str, ...] = tuple(ROLE_PHASES)  # the built-in roles; ledger.json lists each, used or not
PHASES: tuple[str, ...] = ("write", "read", "eval", "embed")  # ROLE_PHASES' values


def register_role(role: str, phase: str) -> None:
    """Let requests take `role`, accounted in `phase`: what a method's registry entry does for the roles it
    declares (MethodEntry.roles), so a method of your own has LLM roles without editing this file."""
    if phase not in PHASES:
        raise ValueError(f"role {role!r}: phase {phase!r} is not one of {', '.join(PHASES)}")
    if ROLE_PHASES.get(role, phase) != phase:
        raise ValueError(f"role {role!r} is already registered in phase {ROLE_PHASES[role]!r}, not {phase!r}")
    ROLE_PHASES[role] = phase
RESPONSE_FORMATS: tuple[str | None, ...] = (None, "json_object")


class OwnedText(str):
    """A prompt text that names the user whose data it carries (`owner`, a memory id): a string to
    everything that takes one (store/summaries.py hands summary prompts out as these), so a generate
    function can put the owner on its Request without another argument."""

    owner: str | None

    def __new__(cls, text: str, owner: str | None) -> OwnedText:
        made = super().__new__(cls, text)
        made.owner = owner
        return made


def owner_of(text: str) -> str | None:
    """The owner an OwnedText names (None for a plain string)."""
    return getattr(text, "owner", None)


@dataclass
class Request:
    messages: list[dict[str, Any]]  # OpenAI-style chat messages; content is a string
    role: str = "answer"  # a key of ROLE_PHASES: the ledger accounts per role (and per phase)
    images: list[str] = field(default_factory=list)  # local paths or URLs, in the order the prompt names them
    max_new_tokens: int | None = None  # None = the reader's configured default (reader.max_new_tokens)
    temperature: float | None = None  # None = the reader's configured default (0 = greedy)
    key: str = ""  # what the call is for (question id, segment id); the ledger checks answer keys
    # the user (memory id) whose data the prompt carries: cache.sqlite keeps it beside the response and the
    # call record, so erasing the user drops both (a live memory's delete_user + compact); not in the key
    owner: str | None = None
    # "json_object": the reply must be one JSON object (OpenAI's JSON mode). A backend whose `json_mode` is
    # True constrains its decoding to it; the others generate freely (a peer's endpoint records that).
    response_format: str | None = None

    def __post_init__(self) -> None:
        if self.response_format not in RESPONSE_FORMATS:
            raise ValueError(f"Request(key={self.key!r}): response_format {self.response_format!r} is not one of "
                             f"{RESPONSE_FORMATS}")
        if self.role not in ROLE_PHASES:
            raise ValueError(f"Request(key={self.key!r}): role {self.role!r} is not one of {tuple(ROLE_PHASES)} "
                             "(a method declares its own roles in its registry entry)")
        if not isinstance(self.messages, list) or not self.messages:
            raise ValueError(f"Request(key={self.key!r}): messages must be a non-empty list of chat messages")
        for i, message in enumerate(self.messages):
            if not isinstance(message, dict) or "role" not in message or "content" not in message:
                raise ValueError(f"Request(key={self.key!r}): messages[{i}] lacks 'role' or 'content'")


@dataclass
class Response:
    # as the model wrote it, nothing stripped: the parsers (readers/clean.py, evaluate/judge.py) tell the
    # reply's own lines from echoed, indented ones by where each line starts
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
    # False: no answer came back at all (a server's timeouts, malformed or empty replies after its retries):
    # the caller must not use `text`; a rerun asks again. True with an error: answered empty for good
    # (vLLM refused the request), scored as such.
    answered: bool = True


class MissingBackendError(ImportError):
    """A reader backend whose Python package is not installed."""


class ReaderError(RuntimeError):
    """A backend failed to answer (after retries, or a worker process died)."""


class Backend(ABC):
    """One batch in, responses out in the same order, no caching (the `Reader` caches).

    A backend is built from the reader's `ReaderConfig` (`from_config`, which the registry calls) without
    loading its model, which `load` does when a request needs it; a request that leaves `max_new_tokens` or
    `temperature` unset gets the config's (`sampling`).
    """

    name: str = ""  # the reader.backend value that selects it
    model: str = ""  # the name recorded in cache keys and the ledger
    gpus: int = 0  # GPUs this backend keeps busy while generating (GPU-seconds = wall x gpus)
    chunk_size: int = 64  # requests per call between cache commits
    template_kwargs: dict[str, Any] = {}  # reader.chat_template_kwargs, applied to every chat template
    json_mode: bool = False  # decoding is constrained to one JSON object when a request asks (response_format)

    def __init__(self, cfg: ReaderConfig) -> None:
        self.cfg = cfg
        self.model = cfg.model
        self.template_kwargs = dict(cfg.chat_template_kwargs)

    @classmethod
    def from_config(cls, cfg: ReaderConfig, run_dir: str | Path | None = None, **options: Any) -> Backend:
        """The backend for `cfg`; `run_dir` is where a backend may keep logs, `options` go to the constructor."""
        return cls(cfg, **options)

    def sampling(self, request: Request) -> tuple[int, float]:
        """(max_new_tokens, temperature) for `request`: its own, else reader.max_new_tokens / temperature."""
        max_new_tokens = self.cfg.max_new_tokens if request.max_new_tokens is None else request.max_new_tokens
        temperature = self.cfg.temperature if request.temperature is None else request.temperature
        return int(max_new_tokens), float(temperature)

    @abstractmethod
    def generate(self, requests: Sequence[Request]) -> list[Response]:
        """One response per request, in the same order."""

    def generate_stream(self, requests: Sequence[Request], group_size: int | None = None,
                        received: Received | None = None) -> Iterator[list[tuple[int, Response]]]:
        """Responses as they finish, in groups of (position in `requests`, response).

        The default answers `group_size` requests (at most `chunk_size`; the caller's commit size, so a
        kill loses no more than that) per `generate` call, in order. A backend that can keep more
        requests in flight than one group (an HTTP server) overrides it, so that how often the caller
        commits results does not bound how much work the backend is offered.

        `received` (the caching reader's commit) gets each group before it is yielded; a backend with
        requests in flight calls it as each response arrives, while its caller may still be busy with
        an earlier group, so that a kill loses nothing that was received."""
        size = self.chunk_size if group_size is None else max(1, min(self.chunk_size, int(group_size)))
        for start in range(0, len(requests), size):
            chunk = list(requests[start:start + size])
            answers = self.generate(chunk)
            if len(answers) != len(chunk):
                raise ReaderError(f"{self.name} returned {len(answers)} responses for {len(chunk)} requests")
            group = [(start + i, answer) for i, answer in enumerate(answers)]
            if received is not None:
                received(group)
            yield group

    def load(self) -> None:  # noqa: B027 - optional: a server's client has nothing to load
        """Load what only generation needs (weights, engines), once; later calls return at once.

        The constructor does the cheap part (what the cache key, `chunk_size` and `prompt_token_limit` need),
        and the caching reader calls this before the first request its response cache cannot serve, so a
        rerun the cache serves entirely never loads the model. A backend with something to load calls it
        from `generate` too, for callers without the reader."""

    def prompt_token_limit(self) -> PromptTokenLimit | None:
        """The model's context in tokens and a prompt-token counter, where the backend knows both (None
        for a server, whose context the client cannot see); it must not need `load`."""
        return None

    def close(self) -> None:  # noqa: B027 - optional: most backends hold nothing to free
        """Free what the backend holds (engines, GPU memory); the default holds nothing."""
