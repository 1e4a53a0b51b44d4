"""Prompt files (memfit_gpu/prompts/*.txt, package data) and the chat messages built from them.

`load_prompt` is the one reader of the package's prompt files (answer, judge and summary prompts alike).

Templates name their slots `{excerpts}`, `{question}`, ... and only those names are filled, so braces in
excerpts or in a JSON example stay as they are. A line whose only content was a slot left empty
(e.g. `Question date: {question_date}` for LoCoMo, which has none) is dropped.

MemGallery's official system prompt, AR/CD/VS instructions and graded judge are not copied into this
repository: they are read at run time from the benchmark's `prompt/` folder. BEAM's likewise: its rubric
judge, its answer prompt and the event-ordering matcher's messages are read at run time from the BEAM
repository's src/prompts.py and src/evaluation/compute_metrics.py (`BeamPrompts`), parsed with `ast` as
text, never imported or run.
"""

from __future__ import annotations

import ast
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

from memfit_gpu.config import ConfigError
from memfit_gpu.data import cache_dir
from memfit_gpu.data.beam import NAME as BEAM
from memfit_gpu.data.beam import prompt_roots
from memfit_gpu.data.memgallery import benchmark_folder
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
# BEAM's two source files that hold its prompts (paths inside the repository, and under a data folder's beam/),
# and what memfit reads from each
BEAM_FILES = {"prompts": "src/prompts.py", "metrics": "src/evaluation/compute_metrics.py"}
BEAM_JUDGE_PROMPT = "unified_llm_judge_base_prompt"  # src/prompts.py: the judge of every rubric item
BEAM_ANSWER_PROMPT = "answer_generation_for_rag"  # src/prompts.py: what BEAM's retrieval baselines ask a reader
BEAM_EQUIVALENCE = "llm_equivalence"  # compute_metrics.py: event ordering's item matcher (its two messages)


class PromptError(FileNotFoundError):
    """A prompt file that does not exist, a template slot that was not given, or a prompt that cannot be
    cut to reader.max_prompt_chars."""


class QuestionTooLongError(PromptError):
    """An answer prompt still too long without any excerpt because of its question (or question date): the
    asker's input, not the setup, whose prompt without them fits (memfit serve answers 422)."""


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


@dataclass(frozen=True)
class BeamPrompts:
    """BEAM's prompts as its repository writes them (src/prompts.py, src/evaluation/compute_metrics.py).

    judge: `unified_llm_judge_base_prompt`, slots `<question>`, `<rubric_item>`, `<llm_response>`; answer:
    `answer_generation_for_rag`, slots `<context>`, `<question>`; equivalence_system and equivalence_user:
    `llm_equivalence`'s system message and its user f-string, the latter as literal pieces between which the
    two snippets go (`first_paragraph`, then `second_paragraph`, as the f-string places them)."""

    judge: str
    answer: str
    equivalence_system: str
    equivalence_user: tuple[tuple[str, str], ...]  # (literal text, slot after it: "first" | "second" | "")
    folder: str  # the folder holding src/

    @classmethod
    def find(cls, source: str | Path) -> BeamPrompts:
        """From the first of `prompt_candidates(source)` that holds both files; PromptError naming where it
        looked and the command that fetches them otherwise."""
        candidates = prompt_candidates(source)
        for root in candidates:
            if all((root / f).is_file() for f in BEAM_FILES.values()):
                return cls.load(root)
        places = ", ".join(str(root / BEAM_FILES["prompts"]) for root in candidates)
        raise PromptError(f"BEAM's judge and answer prompts ({BEAM_FILES['prompts']} and {BEAM_FILES['metrics']} of "
                          f"mohammadtavakoli78/BEAM) are not at {places}: run `memfit data fetch beam` (it brings them "
                          "at the pinned commit, checksum-verified), or choose reader.protocol=paper and "
                          "eval.judge.prompt=paper")

    @classmethod
    def load(cls, root: str | Path) -> BeamPrompts:
        """Parse the two files under `root` (the folder holding src/); parsed once per process while neither
        file changes (their size and mtime are part of the memo's key)."""
        folder = Path(root).resolve()
        stamps = tuple((s.st_size, s.st_mtime_ns) for s in ((folder / f).stat() for f in BEAM_FILES.values()
                                                           if (folder / f).is_file()))
        return _beam_prompts(str(folder), stamps)

    def judge_text(self, question: str | None, rubric_item: str, response: str) -> str:
        """One rubric item's judge prompt: the slots filled in one pass (a value that holds `<rubric_item>`
        stays as written); question None leaves `<question>` in, as compute_metrics.py sends it."""
        values = {"rubric_item": rubric_item, "llm_response": response}
        if question is not None:
            values["question"] = question
        pattern = "|".join(re.escape(f"<{slot}>") for slot in values)
        return re.sub(pattern, lambda m: values[m.group(0)[1:-1]], self.judge)

    def answer_text(self, context: str, question: str) -> str:
        values = {"context": context, "question": question}
        return re.sub(r"<(context|question)>", lambda m: values[m.group(1)], self.answer)

    def equivalence_messages(self, first: str, second: str) -> list[dict[str, str]]:
        """llm_equivalence's two messages for one (reference item, response line) pair."""
        values = {"first": first, "second": second, "": ""}
        user = "".join(text + values[slot] for text, slot in self.equivalence_user)
        return [{"role": "system", "content": self.equivalence_system}, {"role": "user", "content": user}]


def prompt_candidates(source: str | Path) -> list[Path]:
    """Where BEAM's src/ is looked for, first hit wins: beside the loaded data (its conversation, split and
    beam/ folders), $MEMFIT_DATA_DIR/beam, the fetch cache's beam/ (where `memfit data fetch beam` puts it)."""
    roots = prompt_roots(source)
    if os.environ.get("MEMFIT_DATA_DIR"):
        roots.append(Path(os.environ["MEMFIT_DATA_DIR"]).expanduser() / BEAM)
    roots.append(cache_dir() / BEAM)
    return list(dict.fromkeys(roots))


def _constant_text(node: ast.AST | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _module_string(path: Path, name: str) -> str:
    """The string a module-level `name = "..."` assigns in `path` (parsed, never run)."""
    for node in ast.parse(path.read_text(encoding="utf-8"), filename=str(path)).body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            text = _constant_text(node.value)
            if text is None:
                raise PromptError(f"{path}: {name} is not a string literal")
            return text
    raise PromptError(f"{path}: no module-level {name} = \"...\" (not the BEAM file memfit reads)")


def _message_content(function: ast.FunctionDef, variable: str, path: Path) -> ast.AST:
    """The `content` value of the dict literal `variable = {"role": ..., "content": ...}` in `function`."""
    for node in ast.walk(function):
        if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == variable for t in node.targets)
                and isinstance(node.value, ast.Dict)):
            for key, value in zip(node.value.keys, node.value.values, strict=True):
                if _constant_text(key) == "content":
                    return value
    raise PromptError(f"{path}: {function.name} has no {variable} = {{..., \"content\": ...}}")


def _equivalence(path: Path) -> tuple[str, tuple[tuple[str, str], ...]]:
    """llm_equivalence's system text and its user f-string as (literal, slot) pieces."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    function = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == BEAM_EQUIVALENCE), None)
    if function is None:
        raise PromptError(f"{path}: no function {BEAM_EQUIVALENCE} (not the BEAM file memfit reads)")
    system = _constant_text(_message_content(function, "system_msg", path))
    if system is None:
        raise PromptError(f"{path}: {BEAM_EQUIVALENCE}'s system message is not a string literal")
    user = _message_content(function, "user_msg", path)
    arguments = [a.arg for a in function.args.args]
    slots = {arguments[0]: "first", arguments[1]: "second"} if len(arguments) >= 2 else {}
    parts = user.values if isinstance(user, ast.JoinedStr) else [user]
    pieces: list[tuple[str, str]] = []
    text = ""
    for part in parts:
        literal = _constant_text(part)
        if literal is not None:
            text += literal
        elif (isinstance(part, ast.FormattedValue) and isinstance(part.value, ast.Name) and part.value.id in slots
              and part.conversion == -1 and part.format_spec is None):
            pieces.append((text, slots[part.value.id]))
            text = ""
        else:
            raise PromptError(f"{path}: {BEAM_EQUIVALENCE}'s user message holds {ast.unparse(part)!r}: memfit reads "
                              f"only literal text and the {' and '.join(slots) or 'two snippet'} parameters")
    pieces.append((text, ""))
    if sorted(slot for _, slot in pieces if slot) != ["first", "second"]:
        raise PromptError(f"{path}: {BEAM_EQUIVALENCE}'s user message must place each snippet once")
    return system, tuple(pieces)


@lru_cache(maxsize=8)
def _beam_prompts(root: str, stamps: tuple[tuple[int, int], ...]) -> BeamPrompts:
    folder = Path(root)
    prompts_file, metrics_file = folder / BEAM_FILES["prompts"], folder / BEAM_FILES["metrics"]
    try:
        judge = _module_string(prompts_file, BEAM_JUDGE_PROMPT)
        answer = _module_string(prompts_file, BEAM_ANSWER_PROMPT)
        system, user = _equivalence(metrics_file)
    except SyntaxError as exc:
        raise PromptError(f"{exc.filename}: not Python source memfit can parse (line {exc.lineno}: {exc.msg})") from None
    except UnicodeDecodeError as exc:
        raise PromptError(f"{prompts_file} or {metrics_file}: not UTF-8 text ({exc})") from None
    for name, text, slots in ((BEAM_JUDGE_PROMPT, judge, ("<rubric_item>", "<llm_response>")),
                              (BEAM_ANSWER_PROMPT, answer, ("<context>", "<question>"))):
        missing = [slot for slot in slots if slot not in text]
        if missing:
            raise PromptError(f"{prompts_file}: {name} lacks {', '.join(missing)}")
    return BeamPrompts(judge, answer, system, user, str(folder))


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


@dataclass(frozen=True)
class BenchmarkPrompts:
    """What the answers and the judge speak, and the benchmark's own prompt files they read, found once
    (`find`): a run resolves them into RunInputs.prompts, which its answers, judge, preflight and provenance
    read; a method gets them as MethodRun.prompts, the live memory's answers as Memory's own."""

    protocol: str  # paper | memgallery | beam: reader.protocol resolved for the benchmark (resolve_protocol)
    judge_kind: str | None = None  # eval.judge.prompt resolved for the benchmark (judge_kind); None: no judge
    memgallery_dir: Path | None = None  # MemGallery's folder holding prompt/, when the answers or the judge read it
    beam: BeamPrompts | None = None  # BEAM's src/ prompts, when the answers or the judge read them

    @classmethod
    def find(cls, protocol: str, benchmark: str, source: str | Path,
             judge_prompt: str | None = None) -> BenchmarkPrompts:
        """`protocol` (reader.protocol) and `judge_prompt` (eval.judge.prompt; None: no judge) resolved for
        `benchmark`, and the prompt files they read, found from the benchmark's `source` (a loaded benchmark's
        source or its first file).

        Raises:
            ConfigError: a setting that names no protocol or judge, or BEAM's judge for another benchmark.
            PromptError: BEAM's prompt files are needed and not there (it says where it looked).
        """
        resolved = resolve_protocol(protocol, benchmark)
        kind = judge_kind(benchmark, judge_prompt) if judge_prompt is not None else None
        if kind == "beam" and benchmark != BEAM:
            raise ConfigError(f"eval.judge.prompt=beam scores BEAM's rubric items, which data.benchmark="
                              f"{benchmark} does not have: use data.benchmark=beam or another judge")
        read = {resolved, kind}
        return cls(resolved, kind, benchmark_folder(source) if "memgallery" in read else None,
                   BeamPrompts.find(source) if "beam" in read else None)


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
                          prompt: str = "answer.txt", beam_prompts: BeamPrompts | None = None) -> list[dict[str, str]]:
    """Chat messages for one answer call. `images` are the paths sent with the request, in order; with
    `question_image` the first of them is the question's own image. The protocol must be resolved
    (`resolve_protocol`) first: paper | memgallery | beam (BEAM's answer_generation_for_rag, as BEAM's
    retrieval baselines send it: one message, the excerpts as its <context>)."""
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
    if protocol == "beam":
        if beam_prompts is None:
            raise PromptError("protocol 'beam' needs BEAM's prompts (BeamPrompts: `memfit data fetch beam`)")
        context = excerpts_text if not note else f"{note}\n{excerpts_text}"
        return [{"role": "user", "content": beam_prompts.answer_text(context, question)}]
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
        # the asker's input (question, date) or the setup (a template or a reader too small for any question)
        bare = build_answer_messages("", "", *((None, *args[1:]) if args else ()),
                                     **({**kwargs, "question_date": None} if "question_date" in kwargs else kwargs))
        setup = prompt_chars(bare) > max_prompt_chars or (token_limit is not None and token_limit[1](bare) > token_limit[0])
        return (PromptError if setup else QuestionTooLongError)(f"question {question[:60]!r}: the answer prompt without its excerpts is still too long "
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
