"""Full context: the whole history in the answer prompt, the oldest turns dropped first when it does
not fit the reader.

Every turn of the question's memory becomes an excerpt exactly as MemFit's packs print a turn
("EXCERPT i (recorded 8 May 2023): Speaker X says: ...", relative dates resolved with
pack.resolve_dates, each cut at pack.max_excerpt_chars), in conversation order. Nothing is written and
nothing is retrieved.

The budget is the answer prompt itself: the method builds the answer call's text prompt (the run's
protocol and reader.prompt) around the excerpts and keeps it within reader.max_prompt_chars and, where
a token limit is known, within that many tokens less reader.max_new_tokens (room for the answer). The
token limit is full_context.context_tokens when set, else the reader's own: the transformers backend's
context (Reader.prompt_token_limit), or reader.max_model_len for vllm counted with the model's tokenizer
and chat template; a server (openai) has none (set full_context.context_tokens; it is counted at 4
characters a token). When the history does not fit, whole turns go from the start (the fewest that
make it fit, found by bisection), so the newest turns stay; the answer stage then has nothing left to
cut. Each pack row and prediction records `method_notes.truncation`: turns in the history, turns kept and
dropped, the excerpt characters of the dropped turns, the first turn kept and the bound that forced the
cut (turns_dropped 0 and bound null when everything fits).

Images (reader.images) are not counted in the fit: their tokens are the backend's, and the one line the
prompt adds for them can still be trimmed by the answer stage (recorded there as prompt_chars_cut).
In `memfit retrieve` there is no reader: only reader.max_prompt_chars and full_context.context_tokens
bound the history.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from memfit_gpu import models
from memfit_gpu.data.schema import Question
from memfit_gpu.methods.base import MethodRun
from memfit_gpu.methods.common import TurnTable, diagnostics_for, pack_json
from memfit_gpu.methods.packs import pack_row
from memfit_gpu.readers.prompts import BenchmarkPrompts, build_answer_messages, prompt_chars
from memfit_gpu.readers.registry import backend_entry
from memfit_gpu.retrieve.pack import excerpt_tail

TokenCount = Callable[[list[dict[str, Any]]], int]


def _tokenizer_count(model: str, template_kwargs: dict[str, Any]) -> TokenCount:
    """Prompt tokens of a chat message list with the model's own tokenizer and chat template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(models.resolve("reader", model).path)

    def count(messages: list[dict[str, Any]]) -> int:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **template_kwargs)
        return len(ids["input_ids"] if hasattr(ids, "keys") else ids)

    return count


def token_budget(run: MethodRun, reader: Any) -> tuple[int, TokenCount, str] | None:
    """(prompt tokens allowed, counter, why) or None when no token limit is known."""
    cfg = run.cfg
    known = reader.prompt_token_limit() if reader is not None else None
    # the backend's registry entry says where its context is known: vllm's is reader.max_model_len
    if known is None and reader is not None and backend_entry(cfg.reader.backend).context == "max_model_len":
        known = (cfg.reader.max_model_len, _tokenizer_count(cfg.reader.model, dict(cfg.reader.chat_template_kwargs)))
    if cfg.full_context.context_tokens is not None:
        count = known[1] if known is not None else (lambda messages: math.ceil(prompt_chars(messages) / 4))
        context, source = cfg.full_context.context_tokens, "full_context.context_tokens"
    elif known is not None:
        (context, count), source = known, "the reader's context"
    else:
        return None
    room = context - cfg.reader.max_new_tokens
    return room, count, f"{source} of {context:,} tokens less reader.max_new_tokens={cfg.reader.max_new_tokens}"


def fewest_dropped(n: int, fits: Callable[[int], bool]) -> int:
    """The smallest d in [0, n] with fits(d) (fits is monotone: dropping more never hurts); n when none."""
    if fits(0):
        return 0
    low, high = 0, n  # fits(low) is False; fits(high) is taken as True (nothing is left to drop)
    while high - low > 1:
        middle = (low + high) // 2
        if fits(middle):
            high = middle
        else:
            low = middle
    return high


class FullContext:
    name = "full_context"

    def __init__(self) -> None:
        self.table: TurnTable | None = None

    def write(self, run: MethodRun) -> None:
        self.table = TurnTable.from_memories(run.memories)

    def close(self) -> None:
        pass

    def read(self, run: MethodRun) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        assert self.table is not None, "FullContext.read before write"
        cfg, table = run.cfg, self.table
        reader = run.reader() if run.reader is not None else None
        budget = token_budget(run, reader)
        # `memfit retrieve` resolves no prompt files: it sizes the history as protocol paper
        prompts = run.prompts if run.prompts is not None else BenchmarkPrompts("paper")
        lines_of: dict[int, list[str]] = {}
        cuts_of: dict[int, list[int]] = {}
        for m_idx in range(len(table.memory_ids)):
            tails = [excerpt_tail(table, r, cfg.pack.resolve_dates, cfg.pack.max_excerpt_chars)
                     for r in table.memory_rows(m_idx)]
            lines_of[m_idx] = [tail for tail, _ in tails]
            cuts_of[m_idx] = [cut for _, cut in tails]

        def excerpts(tails: list[str]) -> str:
            return "\n".join(f"EXCERPT {i} {tail}" for i, tail in enumerate(tails, start=1))

        kept_rows, rows_out = [], []
        for q in run.questions:
            m_idx = table.memory_index(q.memory_id)
            tails = lines_of[m_idx]

            def messages(dropped: int, q: Question = q, tails: list[str] = tails) -> list[dict[str, Any]]:
                return build_answer_messages(q.question, excerpts(tails[dropped:]), q.question_date, q.category,
                                             prompts.protocol, memgallery_dir=prompts.memgallery_dir,
                                             prompt=cfg.reader.prompt, beam_prompts=prompts.beam)

            def fits(dropped: int) -> bool:
                built = messages(dropped)
                if prompt_chars(built) > cfg.reader.max_prompt_chars:
                    return False
                return budget is None or budget[1](built) <= budget[0]

            dropped = fewest_dropped(len(tails), fits)
            rows = table.memory_rows(m_idx)
            kept = rows[dropped:]
            kept_rows.append(kept)
            bound = None  # what forced the cut: one more turn would break the character bound, else the tokens
            if dropped and prompt_chars(messages(dropped - 1)) > cfg.reader.max_prompt_chars:
                bound = f"reader.max_prompt_chars={cfg.reader.max_prompt_chars:,}"
            elif dropped and budget is not None:
                bound = budget[2]
            truncation = {"turns": len(rows), "turns_kept": len(kept), "turns_dropped": dropped,
                          "chars_dropped": sum(len(t) for t in tails[:dropped]),
                          "first_kept_turn": table.ep_turn_id[kept[0]] if kept else None, "bound": bound}
            rows_out.append((q, excerpts(tails[dropped:]), kept, truncation, sum(cuts_of[m_idx][dropped:])))
        method = {"name": self.name, "token_limit": None if budget is None else budget[0],
                  "token_limit_source": None if budget is None else budget[2],
                  "max_prompt_chars": cfg.reader.max_prompt_chars,
                  "questions_truncated": sum(1 for *_, t, _ in rows_out if t["turns_dropped"])}
        diagnostics, records = diagnostics_for(table, run.questions, kept_rows, kept_rows, kept_rows, method)
        out = []
        for (q, text, kept, truncation, cut), record in zip(rows_out, records, strict=True):
            extra = {"excerpt_chars_cut": cut} if cut else {}
            out.append(pack_row(q, self.name, {"pack": pack_json(kept, kept, table.ep_turn_id), "excerpts": text,
                                               "retrieval": record, "method_notes": {"truncation": truncation},
                                               **extra}))
        return out, diagnostics
