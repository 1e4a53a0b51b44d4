"""`memfit judge-audit RUN_DIR`: how far a finished run's judge can be trusted (memfit_gpu/run/judge_audit.py)."""

from __future__ import annotations

import argparse
import sys

DESCRIPTION = """\
Ask the run's judge (eval.judge of RUN_DIR/config.yaml, through the run's response cache) about answers
whose truth is known, for every scored question of the run: the gold answer (should be accepted), a
wrong answer of the same type (another scored question's gold answer of the same category; the gold with
a date or number changed; the gold negated where that is simple) and "I don't know." (should be
rejected; accepted on an abstention question). Per category it reports the judge's accept rate on gold
(true-accept) and on each kind of wrong answer (false-accept), and how often its verdict on the run's
own predictions agrees with token F1 >= 0.5.

Writes RUN_DIR/judge_audit.json (every probe with its outcome) and RUN_DIR/judge_audit.md (the table,
also printed). Deterministic given the seed; every call is cached in RUN_DIR/cache.sqlite and counted in
RUN_DIR/ledger.json under role judge (phase eval), so a rerun makes no call twice.

eval.judge.* settings after RUN_DIR (options before it) audit another judge on the same questions (eval.judge.model=...,
eval.judge.backend=openai eval.judge.base_urls=[http://127.0.0.1:8200/v1]); the report says it is not
the judge the run was scored with. A tiny judge such as the demo's SmolLM2-135M measures the machinery,
not a judge worth trusting."""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "judge-audit", help="how far a finished run's judge can be trusted: true- and false-accept rates per category",
        description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a finished `memfit run` directory (has DONE)")
    parser.add_argument("--seed", type=int, default=None,
                        help="seed of the wrong answers drawn (default: the run's eval.seed)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    parser.add_argument("overrides", nargs="*", metavar="eval.judge.KEY=VALUE",
                        help="judge settings that replace the run's (another judge on the same questions)")
    parser.set_defaults(func=run, user_errors=user_errors)


def user_errors() -> tuple[type[Exception], ...]:
    from memfit_gpu.provenance import ProvenanceError
    from memfit_gpu.readers.prompts import PromptError
    from memfit_gpu.run.judge_audit import AuditError

    return (AuditError, ProvenanceError, PromptError)


def run(args: argparse.Namespace) -> int:
    from memfit_gpu.run.judge_audit import audit, render_markdown

    report = audit(args.run_dir, args.overrides, seed=args.seed, progress=not args.quiet)
    sys.stdout.write(render_markdown(report))
    return 0
