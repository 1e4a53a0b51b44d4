"""The request bodies of `memfit serve` (REST, serve/app.py) and the argument types of its MCP tools
(serve/mcp.py): pydantic models whose every string is valid Unicode (a JSON `\\ud800` escape is refused
naming its field) and whose `k` is a JSON integer (not "5", true, 2.0 or NaN). The lists and `k` are
the same annotated types in both (`Turns`, `Texts`, `K`), so MCP refuses what REST refuses (an empty
list of turns, queries, questions or turn ids; k below 1)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictInt

from memfit_gpu.data.schema import encoding_problem
from memfit_gpu.names import user_id_problem

__all__ = ["K", "AddIn", "AnswerIn", "ConsolidateIn", "DeleteIn", "ImageIn", "SearchIn", "StrictInt", "Text", "Texts",
           "TurnIn", "Turns", "UserId", "turn_dicts"]


def _valid_unicode(text: str) -> str:
    problem = encoding_problem(text)
    if problem is not None:
        raise ValueError(problem)
    return text


def _valid_user_id(user_id: str) -> str:
    problem = user_id_problem(user_id)
    if problem is not None:
        raise ValueError(problem)
    return user_id


# every string of a body is valid Unicode (a JSON `\ud800` escape is not): refused naming its field
Text = Annotated[str, AfterValidator(_valid_unicode)]
# a user id in a body (names.USER_ID_RULE), refused naming its field (body.user_ids.1)
UserId = Annotated[Text, AfterValidator(_valid_user_id)]
# at least one text (queries, questions, turn ids) and a k of at least 1: REST bodies and MCP tools alike
Texts = Annotated[list[Text], Field(min_length=1)]
K = Annotated[StrictInt, Field(ge=1)]


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


Turns = Annotated[list[TurnIn], Field(min_length=1)]


class AddIn(_Body):
    turns: Turns


class SearchIn(_Body):
    queries: Texts
    k: K = Field(10, description="hits per query (a JSON integer)")


class AnswerIn(_Body):
    questions: Texts
    k: K = Field(10, description="hits returned with each answer (the reader reads the method's pack)")
    question_date: Text | None = Field(None, description="when the questions are asked, e.g. 2023-05-08 (the "
                                                        "prompt's current date)")


class DeleteIn(_Body):
    turn_ids: Texts


class ConsolidateIn(_Body):
    user_ids: list[UserId] | None = Field(None, description="these users only (each bound to the key); default: "
                                                            "every user with turns waiting")


def turn_dicts(turns: Sequence[TurnIn]) -> list[dict[str, Any]]:
    """Validated turns as Memory.add takes them (unset fields left out)."""
    out = [t.model_dump(exclude_none=True) for t in turns]
    for turn in out:
        if not turn.get("images"):
            turn.pop("images", None)
    return out
