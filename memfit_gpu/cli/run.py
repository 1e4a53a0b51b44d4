"""`memfit run`: build -> retrieve -> answer -> score one configuration into a run directory (pipeline.py)."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "run",
        help="build -> retrieve -> answer -> score one configuration (resumable)",
        description=(
            "Run MemFit end to end on a benchmark: store every turn (one encoder pass), build segment summaries, "
            "retrieve for every question in one batched pass, make one reader call per question, and score. "
            "Writes DIR/config.yaml, provenance.json (before the first answer: code, packages, devices, data files, "
            "models, categories, judge and prompts, with hashes), predictions.jsonl, metrics.json, ledger.json, "
            "results.md and DONE. "
            "Killed at any point, the same command resumes: no lost or duplicated predictions, no repeated LLM calls, "
            "and a ledger that counts every paid call once. Questions a server gave no answer for after its retries "
            "fail alone: the others are answered, the command exits 1 counting them, and a rerun asks only those. "
            "A full disk or a damaged cache.sqlite is one line naming the file (exit 2)."
        ),
    )
    parser.add_argument("--config", required=True, help="YAML config (configs/memfit.yaml, configs/demo.yaml, ...)")
    parser.add_argument("--out", required=True, help="run directory (created; reused to resume)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="dot-list overrides, e.g. retrieve.scan_top_k=30 rerank.backend=none")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    parser.add_argument("--allow-provenance-change", action="store_true",
                        help="resume even though the code, packages, data files, weights, judge or prompts differ "
                             "from the run's provenance.json (the change is recorded there); without it such a "
                             "resume is refused, naming the field and its file")
    parser.set_defaults(func=command, user_errors=user_errors, unfinished=unfinished)


def user_errors() -> tuple[type[Exception], ...]:
    from memfit_gpu.run.directory import RunError  # a directory that cannot be resumed as asked

    return (RunError,)


def unfinished() -> tuple[type[Exception], ...]:
    """Exit code 1, one line: questions a server did not answer, a reader that failed; the rest is saved."""
    from memfit_gpu.readers.types import ReaderError
    from memfit_gpu.run.answer import UnansweredError

    return (UnansweredError, ReaderError)


def command(args: argparse.Namespace) -> int:
    from memfit_gpu.config import load_config
    from memfit_gpu.run.pipeline import run

    cfg = load_config(args.config, args.overrides)
    run(cfg, args.out, progress=not args.quiet, allow_provenance_change=args.allow_provenance_change)
    print((Path(args.out) / "results.md").read_text())
    return 0
