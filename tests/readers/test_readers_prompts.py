"""Prompt files, slot filling and the chat messages for answer and judge calls."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from memfit_gpu.config import ConfigError, MemFitConfig
from memfit_gpu.readers.prompts import (
    LONGMEMEVAL_JUDGE_FILES,
    PROMPT_DIR,
    MemGalleryPrompts,
    PromptError,
    QuestionTooLongError,
    bounded_answer_messages,
    build_answer_messages,
    build_judge_messages,
    fill,
    image_note,
    judge_kind,
    load_prompt,
    prompt_chars,
    resolve_protocol,
)
from memfit_gpu.store.summaries import SummaryJob, summary_prompt

EXCERPTS = ("EXCERPT 1 (recorded 8 May 2023):\nDATE: 1:56 pm on 8 May, 2023 | Speaker Caroline says: I went to a "
            "LGBTQ support group yesterday (7 May 2023). {not a slot}")


def test_fill_replaces_only_named_slots_and_drops_empty_lines() -> None:
    template = "A {x}\nDate: {d}\n{note}\n\nJSON: {\"verdict\": \"CORRECT\"}\nB {x}"
    assert fill(template, x="1", d=None, note="") == "A 1\n\nJSON: {\"verdict\": \"CORRECT\"}\nB 1\n"
    # A value holding braces is inserted as is, never filled again.
    assert fill("{x}|{y}", x="{y}", y="2") == "{y}|2\n"
    with pytest.raises(PromptError, match=r"\['y'\]"):
        fill("{x} {y}", x="1")


def test_load_prompt_names_the_folder_when_missing() -> None:
    with pytest.raises(PromptError, match="no_such_prompt.txt"):
        load_prompt("no_such_prompt.txt")
    assert "NOT_FOUND" in load_prompt("answer.txt")


def test_paper_answer_message() -> None:
    messages = build_answer_messages("When did Caroline go to the LGBTQ support group?", EXCERPTS, None, "2")
    assert len(messages) == 1 and messages[0]["role"] == "user"
    text = messages[0]["content"]
    assert EXCERPTS in text
    assert "Question: When did Caroline go to the LGBTQ support group?" in text
    assert "Question date" not in text  # LoCoMo questions have no date: the line is dropped
    assert "NOT_FOUND" in text and "{" not in text.replace("{not a slot}", "")
    dated = build_answer_messages("How many days ago?", EXCERPTS, "2023/05/30 (Tue) 23:40")[0]["content"]
    assert "Question date: 2023/05/30 (Tue) 23:40" in dated


def test_multimodal_answer_says_which_image_is_the_question_s() -> None:
    text = build_answer_messages("What breed is this dog?", EXCERPTS, None, "VR", "paper",
                                 ["q.jpg", "e1.jpg", "e2.jpg"], question_image=True)[0]["content"]
    assert ("Image 1 is the image attached to the question. Images 2 to 3 belong to the excerpts, in the order the "
            "excerpts mention them.") in text
    assert image_note(2, True) == "Image 1 is the image attached to the question. Image 2 belongs to the excerpts."
    assert image_note(2, False) == "Images 1 to 2 belong to the excerpts, in the order the excerpts mention them."
    assert image_note(0, True) == ""


def test_memgallery_protocol_reads_the_official_prompts(shared_data: Path) -> None:
    folder = shared_data / "memgallery"
    official = MemGalleryPrompts.load(folder)
    messages = build_answer_messages("Which image shows my cat?", EXCERPTS, None, "VS", "memgallery",
                                     memgallery_dir=folder)
    assert messages[0] == {"role": "system", "content": (folder / "prompt" / "sys_prompt.txt").read_text().strip()}
    assert messages[1]["content"].rstrip().endswith(official.instructions["VS"])
    assert "Question: Which image shows my cat?" in messages[1]["content"]
    # Categories without an official instruction (e.g. FR) get none.
    fr = build_answer_messages("Where?", EXCERPTS, None, "FR", "memgallery", memgallery_dir=folder)[1]["content"]
    assert not any(instr in fr for instr in official.instructions.values())


def test_memgallery_prompts_missing_is_a_clear_error(tmp_path: Path, shared_data: Path) -> None:
    (tmp_path / "prompt").mkdir()
    shutil.copy(shared_data / "memgallery" / "prompt" / "sys_prompt.txt", tmp_path / "prompt")
    with pytest.raises(PromptError, match=r"ar_prompt.txt, cd_prompt.txt, vs_prompt.txt, llm_judge.txt"):
        MemGalleryPrompts.load(tmp_path)
    with pytest.raises(PromptError, match="memgallery_dir"):
        build_answer_messages("q", EXCERPTS, None, "AR", "memgallery")


def test_resolve_protocol() -> None:
    assert resolve_protocol("auto", "memgallery") == "memgallery"
    assert resolve_protocol("auto", "locomo") == "paper"
    assert resolve_protocol("paper", "memgallery") == "paper"
    with pytest.raises(ConfigError, match="reader.protocol='official'"):
        resolve_protocol("official", "locomo")


def test_judge_messages() -> None:
    text = build_judge_messages("Where did she go?", "Paris", "She went to Paris, France.")[0]["content"]
    assert "Gold answer: Paris" in text and "Answer to grade: She went to Paris, France." in text
    assert '{"verdict": "CORRECT" or "WRONG"' in text
    temporal = build_judge_messages("How many days?", "18 days", "19 days", "temporal-reasoning",
                                    "longmemeval")[0]["content"]
    assert "off-by-one" in temporal
    update = build_judge_messages("q", "g", "p", "knowledge-update", "longmemeval")[0]["content"]
    assert "updated" in update
    pref = build_judge_messages("q", "rubric", "p", "single-session-preference", "longmemeval")[0]["content"]
    assert "Rubric for the desired personalised response: rubric" in pref
    abstain = build_judge_messages("q", "never said", "NOT_FOUND", "multi-session", "longmemeval",
                                   abstention=True)[0]["content"]
    assert "cannot be answered" in abstain and "Why it is unanswerable: never said" in abstain
    with pytest.raises(ValueError, match="question type 'trivia'"):
        build_judge_messages("q", "g", "p", "trivia", "longmemeval")
    assert set(LONGMEMEVAL_JUDGE_FILES.values()) <= {p.name for p in PROMPT_DIR.iterdir()}


def test_memgallery_judge_fills_its_double_brace_slots(shared_data: Path) -> None:
    text = build_judge_messages("What color?", "red", "It is red.", "FR", "memgallery",
                                memgallery_dir=shared_data / "memgallery")[0]["content"]
    assert "Question: What color?\nGround Truth: red\nAssistant Answer: It is red." in text
    assert "{{" not in text


def test_memgallery_judge_fills_each_slot_once(shared_data: Path, tmp_path: Path) -> None:
    """One filler for Mem-Gallery's judge template (evaluate/judge.py had a second): a question, gold or
    answer that itself holds a `{{...}}` slot name stays verbatim, and a template without its slots is a
    PromptError naming the file (exit code 2), not a prompt sent without the answer in it."""
    text = build_judge_messages("Is {{model_output}} a slot?", "a {{ground_truth}} gold", "a dog {{question}}", "FR",
                                "memgallery", memgallery_dir=shared_data / "memgallery")[0]["content"]
    assert ("Question: Is {{model_output}} a slot?\nGround Truth: a {{ground_truth}} gold\n"
            "Assistant Answer: a dog {{question}}") in text
    shutil.copytree(shared_data / "memgallery" / "prompt", tmp_path / "prompt")
    (tmp_path / "prompt" / "llm_judge.txt").write_text("Question: {{question}}\nAnswer: {{answer}}\n")
    with pytest.raises(PromptError, match=r"llm_judge.txt in .*: MemGallery judge template lacks "
                                          r"\{\{ground_truth\}\}, \{\{model_output\}\}"):
        build_judge_messages("q", "g", "p", "FR", "memgallery", memgallery_dir=tmp_path)


def test_judge_kind() -> None:
    assert [judge_kind(b) for b in ("locomo", "longmemeval", "memgallery")] == ["paper", "longmemeval", "memgallery"]
    assert judge_kind("memgallery", "paper") == "paper"
    with pytest.raises(ConfigError, match="eval.judge.prompt='graded'"):
        judge_kind("locomo", "graded")


def test_prompts_are_package_data_read_from_anywhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The package's prompts/ folder comes from importlib.resources, not from the working directory; a
    name that is a file path (absolute, or relative to the working directory) is read as that file."""
    monkeypatch.chdir(tmp_path)
    assert PROMPT_DIR.is_dir() and {"answer.txt", "judge.txt", "summary.txt"} <= {p.name for p in PROMPT_DIR.iterdir()}
    assert load_prompt("summary.txt") == PROMPT_DIR.joinpath("summary.txt").read_text(encoding="utf-8")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "summary.txt").write_text("Mine: {excerpts}\n")
    assert load_prompt("mine/summary.txt") == "Mine: {excerpts}\n"
    with pytest.raises(PromptError, match=r"'absent.txt' not found in .*prompts \(have: answer.txt, "):
        load_prompt("absent.txt")


def test_summary_prompts_come_through_the_same_loader(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """store/summaries.py reads summary.prompt with `load_prompt` (it had a loader of its own): a custom
    template given as a path is used, and one without `{excerpts}` is a PromptError naming the setting."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "short.txt").write_text("Summarise:\n{excerpts}\n")
    (tmp_path / "broken.txt").write_text("Summarise the conversation.\n")
    job = SummaryJob(memory_idx=0, members=np.array([0, 1]), speakers=["Ann", "Bob"],
                     bodies=["I adopted a cat.", "What is its  name?"],
                     event=np.datetime64("2023-05-08T13:56:00"), recorded=np.datetime64("2023-05-08T13:57:00"))
    cfg = MemFitConfig()
    cfg.summary.prompt = "short.txt"
    assert summary_prompt(job, cfg.summary) == "Summarise:\n- I adopted a cat.\n- What is its name?\n"
    cfg.summary.prompt = "broken.txt"
    with pytest.raises(PromptError, match=r"summary.prompt='broken.txt': a summary prompt must contain the "
                                          r"\{excerpts\} placeholder"):
        summary_prompt(job, cfg.summary)


def test_a_prompt_that_fits_is_left_alone() -> None:
    question = "When did Caroline go to the LGBTQ support group?"
    plain = build_answer_messages(question, EXCERPTS, None, "2")
    assert bounded_answer_messages(question, EXCERPTS, None, "2", max_prompt_chars=prompt_chars(plain)) == (plain, 0)


def test_a_long_prompt_loses_the_end_of_its_excerpts_and_says_so() -> None:
    question = "What did Caroline do?"
    excerpts = "\n".join(f"EXCERPT {i} (recorded 8 May 2023): Speaker Caroline says: " + "word " * 40
                         for i in range(1, 201))
    whole = build_answer_messages(question, excerpts, None, "2")
    limit = 5_000
    messages, cut = bounded_answer_messages(question, excerpts, None, "2", max_prompt_chars=limit)
    text = messages[0]["content"]
    assert prompt_chars(whole) == 52_515 and prompt_chars(messages) == limit and cut == 47_591
    note = f"\n[... {cut:,} more characters of excerpts cut: reader.max_prompt_chars=5,000]"
    assert cut > 0 and excerpts[: len(excerpts) - cut] + note in text
    # everything but the excerpts' tail is still there, the question and the instructions after it included
    assert whole[0]["content"].replace(excerpts, excerpts[: len(excerpts) - cut] + note) == text
    assert text.rstrip().endswith("Answer:") and f"Question: {question}" in text


def test_a_prompt_that_cannot_fit_is_an_error_that_says_whose() -> None:
    """Without any excerpt, a prompt too long because of its question (or question date) is the asker's input
    (QuestionTooLongError: memfit serve answers 422); one whose template alone does not fit is the setup's (a
    PromptError, not the asker's: it was answered 422 too)."""
    with pytest.raises(PromptError, match=r"without its excerpts is still too long \(\d+ characters; "
                                          r"reader.max_prompt_chars=200\)") as setup:
        bounded_answer_messages("q?", EXCERPTS * 10, None, "2", max_prompt_chars=200)
    assert not isinstance(setup.value, QuestionTooLongError)
    bare = prompt_chars(build_answer_messages("", "", None, "2"))
    for question, date in (("x" * 5_000, None), ("q?", "z" * 5_000)):
        with pytest.raises(QuestionTooLongError):
            bounded_answer_messages(question, EXCERPTS, date, "2", max_prompt_chars=bare + 100)


def test_a_token_limit_keeps_the_longest_prefix_that_fits() -> None:
    """With a reader's context (here a stand-in counter: one token per 4 characters) the excerpts are cut to the
    longest prefix whose prompt fits, and the note names the context."""
    def count(messages: list[dict]) -> int:
        return prompt_chars(messages) // 4

    excerpts = "\n".join(f"EXCERPT {i} (recorded 8 May 2023): Speaker Ann says: turn {i}" for i in range(1, 401))
    messages, cut = bounded_answer_messages("q?", excerpts, None, "1", max_prompt_chars=1_000_000,
                                            token_limit=(2_000, count))
    kept = len(excerpts) - cut
    note = (f"\n[... {cut:,} more characters of excerpts cut: the reader's context less reader.max_new_tokens "
            f"(2,000 prompt tokens)]")
    assert messages == build_answer_messages("q?", excerpts[:kept] + note, None, "1")
    assert count(messages) <= 2_000 < count(build_answer_messages("q?", excerpts[:kept + 1] + note, None, "1"))
    # a prompt within the context is left as it is
    assert bounded_answer_messages("q?", excerpts[:500], None, "1", max_prompt_chars=1_000_000,
                                   token_limit=(2_000, count)) == (build_answer_messages("q?", excerpts[:500], None,
                                                                                          "1"), 0)


def test_an_answer_prompt_leaves_room_for_max_new_tokens() -> None:
    """A prompt cut to the reader's whole context left no room for the answer. The answer's
    token budget is the context less reader.max_new_tokens."""
    from memfit_gpu.config import MemFitConfig, ReaderConfig
    from memfit_gpu.methods.answers import answer_token_limit
    from memfit_gpu.readers.ledger import Ledger
    from memfit_gpu.readers.reader import Reader
    from memfit_gpu.readers.types import Backend

    def count(messages: list[dict]) -> int:
        return prompt_chars(messages) // 4

    class Context(Backend):  # the context a local backend knows (transformers: max_position_embeddings)
        name = "context"

        def generate(self, requests):  # noqa: ANN001, ANN201
            raise AssertionError("not called")

        def prompt_token_limit(self):  # noqa: ANN201
            return 2_000, count

    cfg = MemFitConfig()
    cfg.reader.max_new_tokens = 300
    reader = Reader(Context(ReaderConfig()), None, Ledger(), 300, 0.0, progress=False)
    limit = answer_token_limit(reader, cfg)
    assert limit is not None and limit[0] == 1_700
    excerpts = "\n".join(f"EXCERPT {i} (recorded 8 May 2023): Speaker Ann says: turn {i}" for i in range(1, 401))
    messages, cut = bounded_answer_messages("q?", excerpts, None, "1", max_prompt_chars=1_000_000, token_limit=limit)
    assert cut > 0 and 1_600 < count(messages) <= 2_000 - 300
