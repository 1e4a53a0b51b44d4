"""The live memory over MCP, with the official SDK's own client: `memfit serve` at /mcp (streamable HTTP,
behind the REST keys) as a real process on 127.0.0.1, and `memfit mcp` over stdio as a real process, the
way the README's desktop-agent configuration starts it. A key (or the stdio server) bound to one user
lists the tools, adds turns, finds them, exports them, and is refused for any other user before the tool
runs; a request without a key reads nothing.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import httpx
import httpx2
import pytest
from mcp import Client
from mcp.client.stdio import StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from support.live_server import CHEAP, REPO, LiveServer

from memfit_gpu.serve.keys import new_key

pytestmark = pytest.mark.slow  # real server processes with real MiniLM weights

TOOLS = {"add_turns", "search", "answer", "list_turns", "delete_turns", "delete_user", "export_user"}
TURNS = [{"speaker": "Ann", "text": "My bicycle is painted teal and named Comet.", "turn_id": "c1"},
         {"speaker": "Bob", "text": "I repair old radios on weekends.", "turn_id": "c2"}]


def result_json(result: Any) -> dict[str, Any]:
    assert not result.is_error, result.content
    return json.loads(result.content[0].text)


def refusal(result: Any) -> str:
    """A tool's refusal, without the SDK's `Error executing tool NAME: ` lead."""
    assert result.is_error, result.content
    return re.sub(r"^Error executing tool \w+: ", "", result.content[0].text)


async def session_checks(client: Client, user: str, other: str) -> None:
    tools = (await client.list_tools()).tools
    assert {t.name for t in tools} == TOOLS
    for tool in tools:  # a schema and a description an agent can read
        assert tool.description and "user_id" in tool.input_schema["properties"], tool
    added = result_json(await client.call_tool("add_turns", {"user_id": user, "turns": TURNS}))
    assert [a["turn_id"] for a in added["added"]] == ["c1", "c2"]
    assert set(added["added"][0]) == {"user_id", "turn_id", "duplicate"}  # no store row: it counts others' turns
    found = result_json(await client.call_tool("search", {"user_id": user, "queries": ["what colour is the bike?"],
                                                          "k": 1}))
    assert found["results"][0][0]["turn_ids"] == ["c1"]
    listed = result_json(await client.call_tool("list_turns", {"user_id": user}))
    assert [t["text"] for t in listed["turns"]] == [t["text"] for t in TURNS]
    exported = result_json(await client.call_tool("export_user", {"user_id": user}))
    assert exported["user_id"] == user and len(exported["sessions"][0]["turns"]) == 2
    for tool, arguments in [("add_turns", {"turns": TURNS}), ("search", {"queries": ["bike"]}), ("list_turns", {}),
                            ("export_user", {}), ("delete_user", {}), ("delete_turns", {"turn_ids": ["c1"]}),
                            ("answer", {"questions": ["bike?"]})]:
        message = refusal(await client.call_tool(tool, {"user_id": other, **arguments}))
        assert message.startswith("refused (403): ") and repr(other) in message, message
    bad = refusal(await client.call_tool("search", {"user_id": "u%2531", "queries": ["bike"]}))
    assert bad.startswith("refused (422): ") and "is not valid" in bad


def test_an_mcp_client_over_http_uses_its_users_memory_and_no_other(tmp_path: Path) -> None:
    keys_file = tmp_path / "keys.jsonl"
    key = new_key(keys_file, ["agent-u1"], name="agent")
    other_key = new_key(keys_file, ["agent-u2"], name="other")
    server = LiveServer(tmp_path / "memory", keys_file, CHEAP).start()

    async def run() -> None:
        async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {key}"}) as http, \
                Client(streamable_http_client(f"{server.url}/mcp/", http_client=http)) as client:
            await session_checks(client, "agent-u1", "agent-u2")
            rng = random.Random(37)  # random ids and encodings, through every tool: only agent-u1 is served
            for _ in range(40):
                target = rng.choice(["agent-u1", "agent-u2", "agent-u1 ", "AGENT-U1", "agent%2Du1", "agent-u1/..",
                                     "agent-u\u0031", "agent-u1\u200b", "..", "agent-u2%00"])
                result = await client.call_tool("list_turns", {"user_id": target})
                assert result.is_error == (target != "agent-u1"), (target, result.content)
        async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {other_key}"}) as http, \
                Client(streamable_http_client(f"{server.url}/mcp/", http_client=http)) as client:
            assert refusal(await client.call_tool("list_turns", {"user_id": "agent-u1"})).startswith("refused (403)")
            listed = await client.call_tool("list_turns", {"user_id": "agent-u2"})
            assert refusal(listed).startswith("refused (404)")  # its own user, which has no turns yet

    try:
        asyncio.run(run())
        for headers in ({}, {"Authorization": "Bearer mfk_not-a-key"}):  # nothing is read without a key
            reply = httpx.post(f"{server.url}/mcp/", headers={**headers, "Content-Type": "application/json",
                                                               "Accept": "application/json, text/event-stream"},
                               json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"})
            assert reply.status_code == 401, reply.text
        # the event stream of streamable HTTP: a stateless server never sends on it, and it stayed open (counted
        # against the key's requests in flight); the transport lets a server refuse it
        for path in ("/mcp/", "/mcp"):
            reply = httpx.get(f"{server.url}{path}", headers={"Authorization": f"Bearer {key}",
                                                              "Accept": "text/event-stream"}, timeout=10)
            assert (reply.status_code, reply.headers.get("allow")) == (405, "POST"), reply.text
        assert server.stop() == 0
    finally:
        server.kill()


@pytest.fixture(scope="module")
def http_server(tmp_path_factory: pytest.TempPathFactory):
    """A server with one key bound to agent-u1, which holds the two TURNS."""
    root = tmp_path_factory.mktemp("mcp")
    key = new_key(root / "keys.jsonl", ["agent-u1"], name="agent")
    server = LiveServer(root / "memory", root / "keys.jsonl", CHEAP).start()
    try:
        added = httpx.post(f"{server.url}/v1/users/agent-u1/turns", json={"turns": TURNS},
                           headers={"Authorization": f"Bearer {key}"}, timeout=60)
        assert added.status_code == 200, added.text
        yield server, key
        assert server.stop() == 0
    finally:
        server.kill()


def jsonrpc(server: LiveServer, key: str, method: str, params: dict[str, Any] | None = None,
            **headers: str) -> httpx.Response:
    """One JSON-RPC request to /mcp/ as an agent's HTTP client sends it (stateless: no session to open)."""
    body: dict[str, Any] = {"jsonrpc": "2.0", "id": 1, "method": method, **({"params": params} if params else {})}
    return httpx.post(f"{server.url}/mcp/", json=body, timeout=60, headers={
        "Authorization": f"Bearer {key}", "Accept": "application/json, text/event-stream",
        "MCP-Protocol-Version": "2025-06-18", **headers})


@pytest.mark.parametrize("host", ["memory.example.com", "memory.example.com:443", "10.1.2.3:8765", "[fd00::7]:8765"])
def test_mcp_over_http_answers_a_host_that_is_not_localhost(http_server, host: str) -> None:
    """The SDK's DNS-rebinding protection, on by default for a localhost bind, allowed only Host headers naming
    localhost: behind a reverse proxy, at a hostname or on `--host 0.0.0.0`, every MCP call was 421 "Invalid
    Host header". The bearer key guards /mcp (a rebound page cannot send it), so the protection is off."""
    server, key = http_server
    listed = jsonrpc(server, key, "tools/list", host=host, origin=f"https://{host}")
    assert listed.status_code == 200, listed.text
    assert {t["name"] for t in listed.json()["result"]["tools"]} == TOOLS
    called = jsonrpc(server, key, "tools/call", {"name": "list_turns", "arguments": {"user_id": "agent-u1"}}, host=host)
    assert called.status_code == 200 and not called.json()["result"]["isError"], called.text
    assert [t["turn_id"] for t in called.json()["result"]["structuredContent"]["turns"]] == ["c1", "c2"]
    refused = httpx.post(f"{server.url}/mcp/", headers={"host": host, "Accept": "application/json, text/event-stream"},
                         json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"}, timeout=60)
    assert refused.status_code == 401  # still nothing without a key


# a REST body and the MCP tool call with the same arguments: REST refused each with 422, MCP took the empty lists
# (and k=0, answered by the memory's own check), and its argument errors quoted the input (pydantic's input_value)
REFUSED_ALIKE = [
    ("POST", "turns", "add_turns", {"turns": []}),
    ("POST", "search", "search", {"queries": []}),
    ("POST", "search", "search", {"queries": ["bike"], "k": 0}),
    ("POST", "answer", "answer", {"questions": []}),
    ("POST", "delete", "delete_turns", {"turn_ids": []}),
    ("POST", "turns", "add_turns", {"turns": [{"speaker": "Ann", "text": "my pin is 4471", "pin": "4471"}]}),
    ("POST", "search", "search", {"queries": ["my pin is 4471"], "k": "4471"}),
]


@pytest.mark.parametrize(("method", "route", "tool", "arguments"), REFUSED_ALIKE)
def test_an_mcp_tool_refuses_what_the_rest_route_refuses_naming_the_field_only(
        http_server, method: str, route: str, tool: str, arguments: dict[str, Any]) -> None:
    server, key = http_server
    rest = httpx.request(method, f"{server.url}/v1/users/agent-u1/{route}", json=arguments, timeout=60,
                         headers={"Authorization": f"Bearer {key}"})
    assert rest.status_code == 422, rest.text
    called = jsonrpc(server, key, "tools/call", {"name": tool, "arguments": {"user_id": "agent-u1", **arguments}})
    result = called.json()["result"]
    assert result["isError"], result
    text = result["content"][0]["text"]
    assert text == f"Error executing tool {tool}: refused (422): {rest.json()['detail'].removeprefix('body.')}", text
    assert "4471" not in text and "input_value" not in text
    listed = jsonrpc(server, key, "tools/call", {"name": "list_turns", "arguments": {"user_id": "agent-u1"}})
    assert [t["turn_id"] for t in listed.json()["result"]["structuredContent"]["turns"]] == ["c1", "c2"]


def readme_mcp_config() -> dict[str, Any]:
    text = (REPO / "README.md").read_text()
    match = re.search(r"```json\n(\{\s*\"mcpServers\".*?)```", text, re.S)
    assert match, "README.md has no ```json block with an mcpServers entry"
    return json.loads(match.group(1))


def test_the_readme_stdio_configuration_serves_one_user(tmp_path: Path) -> None:
    """The README's desktop-agent entry as written (run in a folder where its relative paths exist), with
    the test-only echo reader and the cheap settings added as trailing overrides."""
    entry = readme_mcp_config()["mcpServers"]["memfit"]
    assert entry["command"] == "memfit"
    args = list(entry["args"])
    user = args[args.index("--user") + 1]
    shutil.copytree(REPO / "configs", tmp_path / "configs")  # configs/demo.yaml, as in a checkout
    command = str(Path(sys.executable).with_name("memfit"))
    env = {**os.environ, "MEMFIT_PLUGINS": "seam_echo_backend", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), str(REPO), os.environ.get("PYTHONPATH", "")])}
    params = StdioServerParameters(command=command, args=[*args, *CHEAP], env=env, cwd=str(tmp_path))

    async def run() -> None:
        async with Client(params) as client:
            await session_checks(client, user, "someone-else")

    asyncio.run(run())
    store = tmp_path / args[args.index("--store") + 1]
    assert (store / "store" / "log.jsonl").is_file()  # the memory the agent wrote, closed and snapshotted
    assert any((store / "store" / "snapshots").iterdir())
