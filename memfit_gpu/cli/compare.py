"""`memfit compare`: is run B better than run A, question by question?"""

from __future__ import annotations

import argparse
import json
import sys

DESCRIPTION = """\
Compare two finished runs on the questions they share. Each run is a run directory (its
predictions.jsonl is read) or a predictions.jsonl file. Questions are paired by question_id;
questions present in only one run are counted and listed, not tested. Rows with "evaluated": false
(LoCoMo category 5) are left out.

For every category, overall, and the average of category means, prints mean A, mean B, their
difference (B - A), the two-sided p-value of a paired sign-flip permutation test (seeded, with the
+1 correction, so p >= 1/(permutations+1)), and how many questions B gained (A wrong -> B right;
for F1: B higher) and lost.

--metric judge uses the judge verdicts (default when every paired question has one in both runs);
--metric f1 uses token F1 under --variant (the stored score, or scored from prediction and gold
when the run did not store that variant). A malformed line is an error naming the file and line.

Below the table, one line per provenance section that differs between the two runs' provenance.json
(`warning:` for the data files, category names, weights, judge and prompts, whose change makes the
numbers incomparable; `note:` for the code version, python, packages and devices)."""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "compare",
        help="paired permutation test of two runs (per category and overall)",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("run_a", metavar="DIR_A", help="baseline run directory or predictions.jsonl")
    parser.add_argument("run_b", metavar="DIR_B", help="candidate run directory or predictions.jsonl")
    parser.add_argument(
        "--metric", choices=("judge", "f1"), default=None,
        help="per-question value to test (default: judge when both runs have verdicts, else f1)",
    )  # fmt: skip
    parser.add_argument(
        "--variant", choices=("paper", "locomo", "memgallery"), default="paper",
        help="F1 variant for --metric f1 (default: paper)",
    )  # fmt: skip
    parser.add_argument("--permutations", type=int, default=None,
                        help="random sign flips (default: RUN_A's eval.permutation_samples, 10000 unless set)")
    parser.add_argument("--seed", type=int, default=None,
                        help="random seed of the sign flips (default: RUN_A's eval.seed, 0 unless set)")
    parser.add_argument(
        "--exact", action="store_true",
        help="enumerate every sign vector instead of sampling (at most 24 discordant questions per test)",
    )  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.set_defaults(func=run, user_errors=user_errors)


def user_errors() -> tuple[type[Exception], ...]:
    # PredictionsError (file:line named) or a bad option value (e.g. --exact over too many questions)
    return (ValueError,)


def run(args: argparse.Namespace) -> int:
    from memfit_gpu.evaluate.compare import compare_runs, format_comparison

    result = compare_runs(
        args.run_a, args.run_b, metric=args.metric, variant=args.variant,
        n_permutations=args.permutations, seed=args.seed,
        method="exact" if args.exact else "monte_carlo",
    )  # fmt: skip
    if args.json:
        print(json.dumps(result))
    else:
        sys.stdout.write(format_comparison(result))
    return 0
