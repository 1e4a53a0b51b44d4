"""The live memory over the Model Context Protocol, with the official `mcp` SDK (MCPServer), on the same
ServedMemory as the REST routes (serve/engine.py): the same batchers, limits and refusals.

Two transports:
- `memfit serve` answers MCP over streamable HTTP at /mcp (stateless, JSON responses), behind the same
  bearer keys as REST: the Guard (serve/app.py) refuses a request without a known key before anything is
  read (401), and every tool checks that the key is bound to the `user_id` it is asked for before the
  tool runs, as a REST route does (a refused call is an MCP tool error naming the key and the user).
- `memfit mcp --store DIR --config C --user U` serves one user over stdio for a desktop agent: no key
  (the agent's own process), every tool refused for any other user.

Tools (each with a JSON schema from its typed arguments and a description an agent can read): add_turns,
search, answer, list_turns, delete_turns, delete_user, export_user. Their arguments are the REST bodies'
types (serve/schemas.py), so a tool refuses what the route refuses (an empty list of turns, queries,
questions or turn ids; k below 1), and an argument error is `refused (422): FIELD: why`, as REST names the
field, never quoting the input (the SDK's own message quotes pydantic's `input_value`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError, UnexpectedToolError
from pydantic import ValidationError

from memfit_gpu.serve.engine import Refused, ServedMemory, checked_user
from memfit_gpu.serve.keys import ApiKey
from memfit_gpu.serve.schemas import K, Text, Texts, Turns, turn_dicts

MCP_PATH = "/mcp"
INSTRUCTIONS = """\
A long-term conversational memory (MemFit): store every turn of a conversation verbatim with add_turns,
find what was said with search (ranked excerpts with their turn ids and scores), or get an answer written
from the memory with answer. Each call names the user whose memory it reads or writes; the server refuses
users your key is not bound to. Turns are durable when add_turns returns."""


class _Server(MCPServer):
    """The SDK's server, whose argument errors name the field and why, as REST's 422 does: the SDK's message is
    pydantic's whole text, which quotes the input (`input_value=...`), the caller's own data."""

    async def call_tool(self, name: str, arguments: dict[str, Any], context: Context | None = None) -> Any:
        try:
            return await super().call_tool(name, arguments, context)
        except ToolError as exc:
            cause = exc.__cause__
            if isinstance(exc, UnexpectedToolError) or not isinstance(cause, ValidationError):
                raise
            first = cause.errors(include_url=False, include_context=False, include_input=False)[0]
            field = ".".join(str(part) for part in first["loc"])
            more = f" (and {cause.error_count() - 1} more)" if cause.error_count() > 1 else ""
            raise ToolError(f"Error executing tool {name}: refused (422): {field}: {first['msg']}{more}") from None


def make_mcp(served: ServedMemory, key_of: Callable[[dict[str, Any]], ApiKey | None] | None = None,
             only_user: str | None = None) -> MCPServer:
    """The MCP server over `served`. key_of: the bearer key of an HTTP request's ASGI scope (the Guard
    put it there); only_user: the one user a stdio server serves (then no key is asked for)."""
    mcp = _Server("memfit", instructions=INSTRUCTIONS, version="1")

    def authorized(ctx: Context, user_id: str) -> str:
        """`user_id` once the caller may touch it (refused before the tool runs otherwise)."""
        try:
            checked_user(user_id)
        except Refused as exc:
            raise ToolError(f"refused (422): {exc.message}") from None
        if only_user is not None:
            if user_id != only_user:
                raise ToolError(f"refused (403): this memory server serves user {only_user!r} only, not {user_id!r}")
            return user_id
        request = ctx.request_context.request
        key = key_of(request.scope) if key_of is not None and request is not None else None
        if key is None or not key.may(user_id):
            raise ToolError(f"refused (403): key {getattr(key, 'name', None)!r} is not bound to user {user_id!r}")
        return user_id

    def client(ctx: Context) -> str | None:
        """The caller's key hash: whose share of the batches its request takes (None on a stdio server)."""
        request = ctx.request_context.request
        key = key_of(request.scope) if key_of is not None and request is not None else None
        return None if key is None else key.sha256

    async def run(call: Any) -> Any:
        try:
            return await call
        except Refused as exc:
            raise ToolError(f"refused ({exc.status}): {exc.message}") from None

    @mcp.tool(description="Store turns of a user's conversation, verbatim and durably (when the call returns). "
                          "A turn: speaker, text; optional timestamp (ISO 8601 local time), turn_id (re-adding "
                          "the same id with the same words stores nothing new), session_id, date_text, images.")
    async def add_turns(user_id: Text, turns: Turns, ctx: Context) -> dict[str, Any]:
        added = await run(served.add(authorized(ctx, user_id), turn_dicts(turns), client(ctx)))
        return {"added": [a.to_json() for a in added]}

    @mcp.tool(description="Search a user's memory: for each query, the k best excerpts (episode turns or "
                          "segment summaries) with their text, turn ids, final score and stage scores.")
    async def search(user_id: Text, queries: Texts, ctx: Context, k: K = 10) -> dict[str, Any]:
        found = await run(served.search(authorized(ctx, user_id), queries, k, client(ctx)))
        return {"results": [[h.to_json() for h in hits] for hits in found]}

    @mcp.tool(description="Answer questions from a user's memory: one reader call per question on the excerpts "
                          "retrieved for it; each answer with the reader's raw output and the hits it read. "
                          "question_date: when the questions are asked (e.g. 2024-05-01).")
    async def answer(user_id: Text, questions: Texts, ctx: Context, k: K = 10,
                     question_date: Text | None = None) -> dict[str, Any]:
        found = await run(served.answer(authorized(ctx, user_id), questions, k, question_date, client(ctx)))
        return {"answers": [a.to_json() for a in found]}

    @mcp.tool(description="List a user's stored turns in conversation order (turn_id, speaker, text, "
                          "timestamp, session_id).")
    async def list_turns(user_id: Text, ctx: Context) -> dict[str, Any]:
        return {"user_id": user_id, "turns": await run(served.turns(authorized(ctx, user_id), client(ctx)))}

    @mcp.tool(description="Delete turns of a user by turn id: gone from every search at once (their text leaves "
                          "the disk when the memory is compacted).")
    async def delete_turns(user_id: Text, turn_ids: Texts, ctx: Context) -> dict[str, Any]:
        return {"deleted": await run(served.delete(authorized(ctx, user_id), turn_ids))}

    @mcp.tool(description="Delete every turn of a user (and the summaries over them).")
    async def delete_user(user_id: Text, ctx: Context) -> dict[str, Any]:
        return {"deleted": await run(served.delete_user(authorized(ctx, user_id)))}

    @mcp.tool(description="A user's memory as one line of memfit's own-data jsonl format (turns, sessions, "
                          "timestamps; with summaries=true its segment summaries and the turns they cover).")
    async def export_user(user_id: Text, ctx: Context, summaries: bool = False) -> dict[str, Any]:
        return await run(served.export(authorized(ctx, user_id), summaries, client(ctx)))

    return mcp
