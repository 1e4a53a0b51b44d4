"""Prompt files (memfit_gpu/prompts/*.txt, package data) and the chat messages built from them.

`load_prompt` is the one reader of the package's prompt files (answer, judge and summary prompts alike).

Templates name their slots `{excerpts}`, `{question}`, ... and only those names are filled, so braces in
excerpts or in a JSON example stay as they are. A line whose only content was a slot left empty
(e.g. `Question date: {question_date}` for LoCoMo, which has none) is dropped.

MemGallery's official system prompt, AR/CD/VS instructions and graded judge are not copied into this
repository: they are read at run time from the benchmark's `prompt/` folder.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

from memfit_gpu.config import ConfigError
from memfit_gpu.data.registry import find_spec
from memfit_gpu.data.spec import JUDGE_KINDS, PROTOCOLS
from memfit_gpu.quoting import quote_lines

# Package data (importlib.resources), so an installed memfit finds its prompts wherever it runs from.
PROMPT_DIR = resources.files("memfit_gpu").joinpath("prompts")
# PROTOCOLS, JUDGE_KINDS (data/spec.py): the answer protocols and judge kinds a benchmark can name; evaluate/judge.py
# reads each kind's reply
LONGMEMEVAL_JUDGE_FILES = {
    "single-session-user": "judge_longmemeval_default.txt",
    "single-session-assistant": "judge_longmemeval_default.txt",
    "multi-session": "judge_longmemeval_default.txt",
    "temporal-reasoning": "judge_longmemeval_temporal.txt",
    "knowledge-update": "judge_longmemeval_knowledge_update.txt",
    "single-session-preference": "judge_longmemeval_preference.txt",
    "abstention": "judge_longmemeval_abstention.txt",
}
MEMGALLERY_FILES = {"system": "sys_prompt.txt", "AR": "ar_prompt.txt", "CD": "cd_prompt.txt",
                    "VS": "vs_prompt.txt", "judge": "llm_judge.txt"}


class PromptError(FileNotFoundError):
    """A prompt file that does not exist, a template slot that was not given, or a prompt that cannot be
    cut to reader.max_prompt_chars."""


@lru_cache(maxsize=64)
def load_prompt(name: str, prompt_dir: str | None = None) -> str:
    """A template from memfit_gpu/prompts/ (or `prompt_dir`); `name` may also be a path to a file.

    Raises:
        PromptError: no such file; the message lists the folder's prompts.
    """
    direct = Path(name)
    folder = Path(prompt_dir) if prompt_dir is not None else PROMPT_DIR
    source = direct if direct.is_file() else folder.joinpath(name)
    if not source.is_file():
        have = sorted(p.name for p in folder.iterdir() if p.name.endswith(".txt")) if folder.is_dir() else []
        raise PromptError(f"prompt file {name!r} not found in {folder} (have: {', '.join(have)})")
    return source.read_text(encoding="utf-8")


def fill(template: str, **values: Any) -> str:
    """Fill `{name}` slots; a line that held nothing but empty slots (and a label) is removed."""
    slots = set(re.findall(r"\{([a-z_]+)\}", template))
    missing = sorted(s for s in slots if s not in values)
    if missing:
        raise PromptError(f"template needs values for {missing}")
    lines = []
    for line in template.split("\n"):
        used = re.findall(r"\{([a-z_]+)\}", line)
        if used and all(values[s] in (None, "") for s in used):
            continue
        lines.append(re.sub(r"\{([a-z_]+)\}", lambda m: "" if values[m.group(1)] is None else str(values[m.group(1)]),
                            line))
    # A dropped paragraph leaves its blank lines behind: keep at most one blank line in a row.
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip() + "\n"


@dataclass(frozen=True)
class MemGalleryPrompts:
    system: str
    instructions: dict[str, str]  # category (AR, CD, VS) -> format instruction
    judge: str

    @classmethod
    def load(cls, data_dir: str | Path) -> MemGalleryPrompts:
        """From `<data_dir>/prompt/` (data_dir = the MemGallery benchmark folder holding dialog/ and prompt/)."""
        folder = Path(data_dir) / "prompt"
        if not folder.is_dir() and Path(data_dir).name == "prompt":
            folder = Path(data_dir)
        missing = [f for f in MEMGALLERY_FILES.values() if not (folder / f).is_file()]
        if missing:
            raise PromptError(
                f"MemGallery's official prompts are missing from {folder}: {', '.join(missing)}. They ship with "
                "the benchmark (Mem-Gallery benchmark/prompt/ and benchmark/memengine/evaluate/llm_judge.txt); "
                "pass the MemGallery data folder that has them, or use protocol 'paper'."
            )
        text = {k: (folder / f).read_text(encoding="utf-8").strip() for k, f in MEMGALLERY_FILES.items()}
        return cls(text["system"], {k: text[k] for k in ("AR", "CD", "VS")}, text["judge"])


def resolve_protocol(protocol: str, benchmark: str) -> str:
    """`auto` = the benchmark's official protocol (its BenchmarkSpec: MemGallery's own prompts for
    MemGallery), the paper's for a benchmark memfit does not know."""
    if protocol == "auto":
        spec = find_spec(benchmark)
        return spec.protocol if spec is not None else "paper"
    if protocol not in PROTOCOLS:
        raise ConfigError(f"reader.protocol={protocol!r} is not one of auto, {', '.join(PROTOCOLS)}")
    return protocol


def judge_kind(benchmark: str, prompt: str = "auto") -> str:
    """eval.judge.prompt -> judge kind. `auto` = the benchmark's own (its BenchmarkSpec): the paper judge for
    LoCoMo, the per-type judges for LongMemEval, MemGallery's graded judge for MemGallery."""
    if prompt == "auto":
        spec = find_spec(benchmark)
        return spec.judge if spec is not None else "paper"
    if prompt not in JUDGE_KINDS:
        raise ConfigError(f"eval.judge.prompt={prompt!r} is not one of auto, {', '.join(JUDGE_KINDS)}")
    return prompt


def image_note(n_images: int, question_image: bool) -> str:
    if n_images == 0:
        return ""
    if question_image:
        if n_images == 1:
            return "Image 1 is the image attached to the question."
        if n_images == 2:
            return "Image 1 is the image attached to the question. Image 2 belongs to the excerpts."
        return (f"Image 1 is the image attached to the question. Images 2 to {n_images} belong to the excerpts, "
                "in the order the excerpts mention them.")
    if n_images == 1:
        return "Image 1 belongs to the excerpts."
    return f"Images 1 to {n_images} belong to the excerpts, in the order the excerpts mention them."


def build_answer_messages(question: str, excerpts_text: str, question_date: str | None = None,
                          category: str | None = None, protocol: str = "paper", images: Sequence[str] = (),
                          *, question_image: bool = False, memgallery_dir: str | Path | None = None,
                          prompt: str = "answer.txt") -> list[dict[str, str]]:
    """Chat messages for one answer call. `images` are the paths sent with the request, in order; with
    `question_image` the first of them is the question's own image. The protocol must be resolved
    (`resolve_protocol`) first: paper | memgallery."""
    note = image_note(len(images), question_image)
    if protocol == "paper":
        template = load_prompt("answer_multimodal.txt" if images and prompt == "answer.txt" else prompt)
        text = fill(template, excerpts=excerpts_text, question=question, question_date=question_date,
                    image_note=note)
        return [{"role": "user", "content": text}]
    if protocol == "memgallery":
        if memgallery_dir is None:
            raise PromptError("protocol 'memgallery' needs memgallery_dir (the MemGallery data folder with prompt/)")
        official = MemGalleryPrompts.load(memgallery_dir)
        instruction = official.instructions.get(str(category or "").upper(), "")
        text = fill(load_prompt("answer_memgallery.txt"), excerpts=excerpts_text, question=question,
                    question_date=question_date, image_note=note, instruction=instruction)
        return [{"role": "system", "content": official.system}, {"role": "user", "content": text}]
    raise ValueError(f"answer protocol {protocol!r} is not one of {', '.join(PROTOCOLS)} (resolve 'auto' first)")


def prompt_chars(messages: Sequence[dict[str, Any]]) -> int:
    """Characters of every message's text: what reader.max_prompt_chars bounds."""
    return sum(len(m["content"]) for m in messages if isinstance(m.get("content"), str))


def bounded_answer_messages(question: str, excerpts_text: str, *args: Any, max_prompt_chars: int,
                            token_limit: tuple[int, Callable[[list[dict[str, Any]]], int]] | None = None,
                            **kwargs: Any) -> tuple[list[dict[str, str]], int]:
    """`build_answer_messages` with its prompt held to `max_prompt_chars` characters and, given
    `token_limit` (the prompt tokens the reader allows: its context, `Reader.prompt_token_limit()`, less
    the reader.max_new_tokens the answer needs; and a token counter), to that many tokens; and how many characters of the excerpts were cut for that (0 when the prompt
    fits, the usual case).

    The end of the excerpt block goes, with a note saying how much; the instructions, the question and
    the facts at the top stay. A prompt that does not fit even without excerpts is a PromptError."""
    why = f"reader.max_prompt_chars={max_prompt_chars:,}"

    def note(cut: int) -> str:
        return f"\n[... {cut:,} more characters of excerpts cut: {why}]" if cut else ""

    def with_kept(keep: int) -> list[dict[str, str]]:
        return build_answer_messages(question, excerpts_text[:keep] + note(len(excerpts_text) - keep), *args,
                                     **kwargs)

    def too_long(messages: list[dict[str, str]]) -> PromptError:
        return PromptError(f"question {question[:60]!r}: the answer prompt without its excerpts is still too long "
                           f"({prompt_chars(messages):,} characters; {why})")

    keep = len(excerpts_text)
    messages = with_kept(keep)
    excess = prompt_chars(messages) - max_prompt_chars
    while excess > 0:  # a longer note, or fill's blank-line folding, can need a second pass
        if keep == 0:
            raise too_long(messages)
        cut = len(excerpts_text) - keep
        keep = max(0, keep - excess - (len(note(cut + excess)) - len(note(cut))))
        messages = with_kept(keep)
        excess = prompt_chars(messages) - max_prompt_chars
    if token_limit is None:
        return messages, len(excerpts_text) - keep
    context, count = token_limit
    if count(messages) <= context:
        return messages, len(excerpts_text) - keep
    why = f"the reader's context less reader.max_new_tokens ({context:,} prompt tokens)"
    if count(with_kept(0)) > context:
        raise too_long(with_kept(0))
    low, high = 0, keep  # with_kept(low) fits, with_kept(high) does not: halve until they meet
    while high - low > 1:
        middle = (low + high) // 2
        if count(with_kept(middle)) <= context:
            low = middle
        else:
            high = middle
    return with_kept(low), len(excerpts_text) - low


def build_judge_messages(question: str, gold: str, prediction: str, category: str | None = None,
                         kind: str = "paper", *, memgallery_dir: str | Path | None = None,
                         abstention: bool = False) -> list[dict[str, str]]:
    """Chat messages for one judge call.

    kind: paper (CORRECT/WRONG JSON), longmemeval (per question type in `category`; `abstention=True` or
    category 'abstention' for `_abs` questions; same JSON verdict), memgallery (its graded 0-1 JSON score).
    The prediction is quoted like an excerpt (every line after its first indented, memfit_gpu/quoting.py):
    a prediction cannot write a line of the judge's prompt (`Gold answer: ...`).
    """
    prediction = quote_lines(str(prediction))
    if kind == "paper":
        text = fill(load_prompt("judge.txt"), question=question, gold=gold, prediction=prediction)
    elif kind == "longmemeval":
        qtype = "abstention" if abstention else str(category or "")
        if qtype not in LONGMEMEVAL_JUDGE_FILES:
            raise ValueError(f"LongMemEval judge: question type {qtype!r} is not one of "
                             f"{', '.join(sorted(LONGMEMEVAL_JUDGE_FILES))}")
        text = fill(load_prompt(LONGMEMEVAL_JUDGE_FILES[qtype]), question=question, gold=gold, prediction=prediction)
    elif kind == "memgallery":
        if memgallery_dir is None:
            raise PromptError("the MemGallery judge needs memgallery_dir (the MemGallery data folder with prompt/)")
        try:
            text = fill_memgallery_prompt(MemGalleryPrompts.load(memgallery_dir).judge, question, gold, prediction)
        except ValueError as exc:  # a template edited by hand: name the file, exit code 2 from the CLI
            raise PromptError(f"{MEMGALLERY_FILES['judge']} in {memgallery_dir}: {exc}") from None
    else:
        raise ValueError(f"judge kind {kind!r} is not one of {', '.join(JUDGE_KINDS)}")
    return [{"role": "user", "content": text}]


def fill_memgallery_prompt(template: str, question: str, gold: str, prediction: str) -> str:
    """Mem-Gallery's llm_judge.txt with its {{question}}, {{ground_truth}}, {{model_output}} filled."""
    missing = [
        slot for slot in ("{{question}}", "{{ground_truth}}", "{{model_output}}") if slot not in template
    ]
    if missing:
        raise ValueError(f"MemGallery judge template lacks {', '.join(missing)}")
    # One pass over the slots, so a value that itself contains "{{question}}" stays verbatim.
    values = {"question": str(question), "ground_truth": str(gold), "model_output": str(prediction)}
    return re.sub(r"\{\{(question|ground_truth|model_output)\}\}", lambda m: values[m.group(1)], template)
