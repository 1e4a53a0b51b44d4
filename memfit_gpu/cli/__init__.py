"""`memfit`: one entry point, one subcommand per module of this package.

Each subcommand module has `register(subparsers)` and imports nothing but the standard library at its
top: the package's modules (and torch, transformers, ...) are imported inside the command's function,
so `memfit --help` answers at once. This package is the only place where memfit_gpu imports its own
modules inside functions (tests/test_architecture.py holds it to that), and `main` is the only place
where exceptions become exit codes and error lines (errors.py).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from memfit_gpu.cli import (
    aggregate,
    compare,
    data,
    efficiency,
    judge_audit,
    keys,
    mcp,
    plan,
    profile,
    report,
    retrieve,
    run,
    serve,
    store,
    sweep,
    tables,
)
from memfit_gpu.cli.errors import (
    EXIT_INTERRUPTED,
    EXIT_UNFINISHED,
    EXIT_USER_ERROR,
    Interrupted,
    one_line,
    storage_line,
    unfinished_errors,
    user_errors,
    where,
)

# name -> module with register(subparsers), in `memfit --help` order.
SUBCOMMANDS: dict[str, str] = {
    "data": data.__name__,
    "run": run.__name__,
    "plan": plan.__name__,
    "profile": profile.__name__,
    "retrieve": retrieve.__name__,
    "compare": compare.__name__,
    "judge-audit": judge_audit.__name__,
    "efficiency": efficiency.__name__,
    "report": report.__name__,
    "tables": tables.__name__,
    "sweep": sweep.__name__,
    "aggregate": aggregate.__name__,
    "store": store.__name__,
    "serve": serve.__name__,
    "keys": keys.__name__,
    "mcp": mcp.__name__,
}
_MODULES = (data, run, plan, profile, retrieve, compare, judge_audit, efficiency, report, tables, sweep, aggregate, store,
            serve, keys, mcp)

__all__ = ["SUBCOMMANDS", "build_parser", "main", "one_line"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="memfit",
        description=(
            "MemFit on GPUs: verbatim episode memory, LLM-free batched hybrid retrieval, "
            "one reader call per question. Every subcommand has its own --help."
        ),
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for module in _MODULES:
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one `memfit` command; returns its exit code (errors.py says which code means what)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    try:
        from memfit_gpu.plugins import load_plugins

        load_plugins()  # $MEMFIT_PLUGINS: registered methods, backends and benchmarks of the user's own modules
        return int(args.func(args) or 0)
    except Interrupted as exc:
        print(f"memfit {args.command}: {exc}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:
        # Work saved but left undone (a server that did not answer some questions): one line, exit code 1.
        if isinstance(exc, unfinished_errors(args)):
            print(f"{where(args, exc)}: {one_line(exc)}", file=sys.stderr)
            return EXIT_UNFINISHED
        # What the user must change (a setting, a file, weights to download, a full disk): one line, exit
        # code 2. Anything else is a bug and keeps its traceback.
        storage = storage_line(exc)
        if storage is None and not isinstance(exc, user_errors(args)):
            raise
        print(f"{where(args, exc)}: error: {storage or one_line(exc)}", file=sys.stderr)
        return EXIT_USER_ERROR

