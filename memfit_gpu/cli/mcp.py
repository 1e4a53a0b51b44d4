"""`memfit mcp`: one user's live memory as an MCP server over stdio, for a desktop agent (serve/mcp.py).

    memfit mcp --store DIR --config C --user U [key=value ...]
"""

from __future__ import annotations

import argparse

MCP_DESCRIPTION = """\
Serve the live memory in DIR (created when missing) to one user over the Model Context Protocol on stdin
and stdout: the agent that starts this process talks to it (e.g. a desktop agent's mcpServers entry:
{"command": "memfit", "args": ["mcp", "--store", DIR, "--config", C, "--user", U]}). Tools: add_turns,
search, answer, list_turns, delete_turns, delete_user, export_user, each refused for any user but U.
The same tools over HTTP, behind API keys: `memfit serve` at /mcp. Logs go to stderr; the process ends
when stdin closes (the memory is snapshotted and closed)."""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("mcp", help="one user's live memory as an MCP server over stdio",
                                   description=MCP_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store", required=True, metavar="DIR", help="the memory's folder (created when missing)")
    parser.add_argument("--config", help="YAML config (default: the built-in defaults, i.e. configs/memfit.yaml)")
    parser.add_argument("--user", required=True, help="the one user id this server serves")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides (reader.backend=...)")
    parser.set_defaults(func=mcp_command, user_errors=busy_errors)


def busy_errors() -> tuple[type[BaseException], ...]:
    from memfit_gpu.locks import DirectoryBusyError

    return (DirectoryBusyError,)


def mcp_command(args: argparse.Namespace) -> int:
    from memfit_gpu.config import ConfigError, load_config
    from memfit_gpu.names import user_id_problem
    from memfit_gpu.serve.server import serve_mcp_stdio

    problem = user_id_problem(args.user)
    if problem is not None:
        raise ConfigError(f"--user: {problem}")
    serve_mcp_stdio(args.store, load_config(args.config, args.overrides), args.user)
    return 0
