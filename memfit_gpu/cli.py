"""`memfit`: one entry point, one subcommand per job.

Each subcommand lives in its own module with `register(subparsers)`; the module is imported only
to build its parser, and heavy libraries (torch, transformers) are imported inside the command's
function, so `memfit --help` answers at once.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

# name -> module with register(subparsers). Only commands that do real work are listed here.
SUBCOMMANDS: dict[str, str] = {
    "data": "memfit_gpu.data.cli",
    "run": "memfit_gpu.pipeline",
    "profile": "memfit_gpu.profile",
    "retrieve": "memfit_gpu.retrieve.cli",
    "compare": "memfit_gpu.evaluate.cli",
    "efficiency": "memfit_gpu.evaluate.efficiency",
    "sweep": "memfit_gpu.sweep.cli",
    "aggregate": "memfit_gpu.sweep.aggregate",
    "store": "memfit_gpu.store.cli",
}


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
    for module_name in SUBCOMMANDS.values():
        importlib.import_module(module_name).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    from memfit_gpu.config import ConfigError
    from memfit_gpu.data.schema import DataError
    from memfit_gpu.models import MissingWeightsError
    from memfit_gpu.readers.types import MissingBackendError

    try:
        return int(args.func(args) or 0)
    except (ConfigError, DataError, FileNotFoundError, MissingWeightsError, MissingBackendError) as exc:
        # What the user must change (a setting, a file, weights to download): one line, exit code 2.
        # Anything else is a bug and keeps its traceback.
        print(f"memfit {args.command}: error: {one_line(exc)}", file=sys.stderr)
        return 2


def one_line(exc: BaseException) -> str:
    """The message of `exc` on one line (a multi-line message, e.g. where weights were looked for, joined)."""
    return " ".join(line.strip() for line in str(exc).splitlines() if line.strip()) or type(exc).__name__


if __name__ == "__main__":
    sys.exit(main())
