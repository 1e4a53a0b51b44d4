"""`memfit compare`: is run B better than run A, question by question?"""

from __future__ import annotations

import argparse
import json
import sys

DESCRIPTION = """\
Compare two finished runs on the questions they share. Each run is a run directory (its
predictions.jsonl is read) or a predictions.jsonl file. Questions are paired by question_id;
questions present in only one run are counted and listed, not tested. Runs whose stored gold answer
or question text differs under one question_id (other data) are refused (exit 2), naming the first
such question and the field. Rows with "evaluated": false
(LoCoMo category 5) are left out.

For every category, overall, and the average of category means, prints mean A, mean B, their
difference (B - A) with its 95 % interval (percentile bootstrap over questions, --bootstrap or RUN_A's
eval.bootstrap_samples resamples, seeded; within each category for the average of categories), the
two-sided p-value of a paired sign-flip permutation test (seeded, with the +1 correction, so
p >= 1/(permutations+1)), and how many questions B gained (A wrong -> B right; for F1: B higher) and
lost.

--metric judge uses the judge verdicts (default when every paired question has one in both runs);
--metric f1 uses token F1 under --variant (the stored score, or scored from prediction and gold
when the run did not store that variant). A malformed line is an error naming the file and line.

Below the table, one line per provenance section that differs between the two runs' provenance.json
(`warning:` for the data files, category names, weights, judge and prompts, whose change makes the
numbers incomparable; `note:` for the code version, python, packages and devices).

--seeds: DIR_A and DIR_B are glob patterns, each naming one system's runs over repeated seeds (quote
them: 'runs/s/points/method=naive_rag,*'). Printed per category, overall and for the average of
categories, as the LightMem-SLM paper's Table 8: each system's F1 mean ± std over its seeds, the
difference B - A, its 95 % interval (percentile bootstrap over questions of each question's F1
averaged over the seeds; --bootstrap resamples) and the p-value of the paired sign-flip permutation
test on the same values (--permutations and --seed as for two runs, from the first A run's config;
--exact is for two runs only)."""


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
    parser.add_argument("--seeds", action="store_true",
                        help="DIR_A and DIR_B are quoted glob patterns of seed runs: F1 mean ± std over seeds, the "
                             "difference with its 95 %% CI and p-value (Table 8 of the LightMem-SLM paper)")
    parser.add_argument("--bootstrap", type=int, default=None,
                        help="bootstrap resamples of each difference's interval (default: RUN_A's "
                             "eval.bootstrap_samples, 1000 unless set; --seeds: 10000)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.set_defaults(func=run, user_errors=user_errors)


def user_errors() -> tuple[type[Exception], ...]:
    # PredictionsError (file:line named) or a bad option value (e.g. --exact over too many questions)
    return (ValueError,)


def _expand(pattern: str) -> list[str]:
    import glob

    from memfit_gpu.cli.errors import UsageError

    found = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
    if not found:
        raise UsageError(f"--seeds: no run matches {pattern!r}")
    return found


def run(args: argparse.Namespace) -> int:
    from memfit_gpu.evaluate.compare import (
        compare_runs,
        compare_seeds,
        format_comparison,
        format_seed_comparison,
    )

    if args.seeds:
        if args.exact:
            from memfit_gpu.cli.errors import UsageError

            raise UsageError("--exact tests two runs; --seeds samples its sign flips (--permutations)")
        result = compare_seeds(_expand(args.run_a), _expand(args.run_b), variant=args.variant,
                               n_permutations=args.permutations, seed=args.seed,
                               n_boot=10_000 if args.bootstrap is None else args.bootstrap)
        print(json.dumps(result) if args.json else format_seed_comparison(result), end="" if not args.json else "\n")
        return 0

    result = compare_runs(
        args.run_a, args.run_b, metric=args.metric, variant=args.variant,
        n_permutations=args.permutations, seed=args.seed,
        method="exact" if args.exact else "monte_carlo", n_boot=args.bootstrap,
    )  # fmt: skip
    if args.json:
        print(json.dumps(result))
    else:
        sys.stdout.write(format_comparison(result))
    return 0
