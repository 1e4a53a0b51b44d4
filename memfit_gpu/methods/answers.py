"""The answer call of a question on its pack: one builder for a run's answers, the growth analysis and the
live memory, so every path bounds its prompt the same way (the reader's context less the tokens the answer
may take) and speaks the benchmark's protocol (reader.protocol).

`answer_requests(cfg, bench, reader, prompts)` returns `make(question, pack row, role, key) -> (Request, cut)`: the
request (the same bytes on every resume: its cache key) with its owner (the question's memory), and what
the prompt bound cut from it ({"prompt_chars_cut": n} or {}).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from memfit_gpu.config import MemFitConfig
from memfit_gpu.data import Benchmark, Question
from memfit_gpu.data.schema import DataError
from memfit_gpu.readers.prompts import BenchmarkPrompts, bounded_answer_messages
from memfit_gpu.readers.reader import Reader
from memfit_gpu.readers.types import PromptTokenLimit, Request


class MissingImageError(DataError):
    """An image an answer call must send is not on disk (reader.images)."""


def images_for(cfg: MemFitConfig, bench: Benchmark, question: Question, pack_row: dict[str, Any],
                turn_images: dict[tuple[str, str], list[str]]) -> tuple[list[str], bool]:
    """Image files sent with one answer call (reader.images), the question's own first."""
    if cfg.reader.images == "none":
        return [], False
    base = Path(bench.source)
    base = base if base.is_dir() else base.parent
    paths: list[str] = []
    has_question_image = question.image is not None and bool(question.image.path)
    if has_question_image:
        paths.append(question.image.path)
    if cfg.reader.images == "retrieved":
        for episode in pack_row["pack"]["episodes"]:
            paths.extend(turn_images.get((question.memory_id, episode["turn_id"]), []))
    resolved = []
    for rel in dict.fromkeys(paths):
        if rel.startswith(("http://", "https://")):
            resolved.append(rel)
            continue
        full = (base / rel).resolve()
        if not full.is_file():
            raise MissingImageError(str(bench.source), question.question_id, "image", f"{rel} not found at {full} "
                           f"(reader.images={cfg.reader.images}; fetch the benchmark images or set reader.images=none)")
        resolved.append(str(full))
    return resolved, has_question_image


def answer_token_limit(reader: Reader, cfg: MemFitConfig) -> PromptTokenLimit | None:
    """The prompt tokens an answer call may use, and the reader's token counter: its context less the
    reader.max_new_tokens the answer may take (a prompt cut to the whole context leaves the answer no
    room); None where the reader does not know its context (a server)."""
    context = reader.prompt_token_limit()
    return None if context is None else (context[0] - cfg.reader.max_new_tokens, context[1])


AnswerRequest = Callable[..., tuple[Request, dict[str, int]]]


def answer_requests(cfg: MemFitConfig, bench: Benchmark, reader: Reader, prompts: BenchmarkPrompts) -> AnswerRequest:
    """`make(question, pack row, role="answer", key=question id)`: the answer request (the same bytes on every
    resume: its cache key) and what the prompt bound cut from it ({"prompt_chars_cut": n} or {}); `prompts`:
    the protocol and prompt files as the run resolved them (RunInputs.prompts)."""
    turn_images = {(m.memory_id, t.turn_id): [i.path for i in t.images if i.path]
                   for m in bench.memories for t in m.turns() if t.images}
    token_limit = answer_token_limit(reader, cfg)

    def make(q: Question, pack: dict[str, Any], role: str = "answer", key: str | None = None
             ) -> tuple[Request, dict[str, int]]:
        images, question_image = images_for(cfg, bench, q, pack, turn_images)
        messages, prompt_cut = bounded_answer_messages(
            q.question, pack["excerpts"], q.question_date, q.category, prompts.protocol, images,
            question_image=question_image, memgallery_dir=prompts.memgallery_dir, prompt=cfg.reader.prompt,
            beam_prompts=prompts.beam, max_prompt_chars=cfg.reader.max_prompt_chars, token_limit=token_limit,
        )
        return (Request(messages, role=role, images=images, key=key or q.question_id, owner=q.memory_id),
                {"prompt_chars_cut": prompt_cut} if prompt_cut else {})

    return make
