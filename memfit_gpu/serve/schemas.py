"""The request bodies of `memfit serve` (REST, serve/app.py) and the argument types of its MCP tools
(serve/mcp.py): pydantic models whose every string is valid Unicode (a JSON `\\ud800` escape is refused
naming its field) and whose `k` is a JSON integer (not "5", true, 2.0 or NaN)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictInt

__all__ = ["AddIn", "AnswerIn", "ConsolidateIn", "DeleteIn", "ImageIn", "SearchIn", "StrictInt", "Text", "TurnIn", "turn_dicts"]

from memfit_gpu.data.schema import encoding_problem


def _valid_unicode(text: str) -> str:
    problem = encoding_problem(text)
    if problem is not None:
        raise ValueError(problem)
    return text


# every string of a body is valid Unicode (a JSON `\ud800` escape is not): refused naming its field
Text = Annotated[str, AfterValidator(_valid_unicode)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=False)


class ImageIn(_Body):
    caption: Text
    image_id: Text | None = None
    path: Text | None = None


class TurnIn(_Body):
    speaker: Text = Field(min_length=1, description="who said it")
    text: Text = Field(min_length=1, description="what was said, stored verbatim")
    timestamp: Text | None = Field(None, description="ISO 8601 local time, e.g. 2023-05-08T13:56:00")
    turn_id: Text | None = Field(None, description="unique within the user (default t1, t2, ...); re-adding the "
                                                  "same id with the same words stores nothing new")
    session_id: Text | None = Field(None, description="default: the timestamp's day")
    date_text: Text | None = Field(None, description="how the episode text writes the date (default from timestamp)")
    images: list[ImageIn] = Field(default_factory=list)


class AddIn(_Body):
    turns: list[TurnIn] = Field(min_length=1)


class SearchIn(_Body):
    queries: list[Text] = Field(min_length=1)
    k: StrictInt = Field(10, ge=1, description="hits per query (a JSON integer)")


class AnswerIn(_Body):
    questions: list[Text] = Field(min_length=1)
    k: StrictInt = Field(10, ge=1, description="hits returned with each answer (the reader reads the method's pack)")
    question_date: Text | None = Field(None, description="when the questions are asked, e.g. 2023-05-08 (the "
                                                        "prompt's current date)")


class DeleteIn(_Body):
    turn_ids: list[Text] = Field(min_length=1)


class ConsolidateIn(_Body):
    user_ids: list[Text] | None = None



def turn_dicts(turns: Sequence[TurnIn]) -> list[dict[str, Any]]:
    """Validated turns as Memory.add takes them (unset fields left out)."""
    out = [t.model_dump(exclude_none=True) for t in turns]
    for turn in out:
        if not turn.get("images"):
            turn.pop("images", None)
    return out
