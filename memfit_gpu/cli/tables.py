"""`memfit tables`: the MemFit paper's tables (Markdown + CSV) from finished run and sweep directories."""

from __future__ import annotations

import argparse
import json

from memfit_gpu.cli.errors import UsageError

DESCRIPTION = """\
Build the MemFit paper's tables, and with --lightmem the LightMem-SLM paper's (Markdown + CSV), from finished run or sweep directories
(memfit_gpu/evaluate/paper_tables.py says where every number is read from). Each table option takes DIR or
LABEL=DIR arguments; a sweep directory (holding sweep.json) stands for all its points, labelled by point
id. Each table goes to OUT/<table>.md and OUT/<table>.csv, OUT/tables.md holds them all and is printed;
the last line printed is a JSON object naming the files. Under each table of several runs, the lines
`memfit compare` prints where their provenance.json differ (warning: data, category names, weights, judge,
prompts; note: code, packages, devices). experiments/README.md says which command makes which table."""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("tables", help="the paper's tables from finished runs and sweeps",
                              description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="tables", help="folder for <table>.md, <table>.csv and tables.md")
    p.add_argument("--locomo-main", nargs="+", metavar="RUN", help="Table 1: one LoCoMo run per reader")
    p.add_argument("--plain-vs-memfit", nargs="+", metavar="SWEEP",
                   help="Table 6: sweeps with the full system's and the plain_retrieval points, one per reader")
    p.add_argument("--ablation", nargs="+", metavar="RUN", help="Tables 3/7: ablation sweep (or runs)")
    p.add_argument("--ablation-baseline", default=None, help="label of the full system's run (default: full)")
    p.add_argument("--diagnostics", nargs="+", metavar="RUN", help="Tables 8/9: retrieval diagnostics")
    p.add_argument("--sensitivity", nargs="+", metavar="RUN", help="Table 10: sensitivity sweep (or runs)")
    p.add_argument("--sensitivity-baseline", default=None, help="label of the default run (default: default)")
    p.add_argument("--memgallery", nargs="+", metavar="RUN",
                   help="Table 11: MemGallery runs, first = reference of the judge differences (text-only)")
    p.add_argument("--longmemeval", nargs="+", metavar="RUN", help="Table 2: LongMemEval runs")
    p.add_argument("--efficiency", nargs="+", metavar="RUN",
                   help="Figure 3 / Tables 13-14 and the efficiency table by method: any runs, any method")
    p.add_argument("--variant", default=None, help="F1/BLEU-1 variant (paper | locomo | memgallery); "
                                                   "default: the runs' eval.table_metric")
    p.add_argument("--permutations", type=int, default=10_000, help="sign flips per paired test")
    p.add_argument("--permutation-method", choices=("monte_carlo", "exact"), default="monte_carlo")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--price-model", default="gpt-4.1-mini", help="hosted model whose list price costs the tokens")
    p.add_argument("--prices", default=None, help="price table (default configs/prices.yaml)")
    # the LightMem-SLM paper's tables (memfit_gpu/evaluate/lightmem_tables.py)
    p.add_argument("--lightmem", nargs="+", metavar="RUN",
                   help="the LightMem-SLM paper's Tables 2, 3, 5, 6, 7, 8 and 10 from these runs or sweeps, rows by "
                        "point label (memfit_gpu/evaluate/lightmem_tables.py)")
    p.add_argument("--lightmem-seeds", nargs="+", metavar="RUN",
                   help="LightMem Table 8 from these runs or sweeps instead (labels NAME and NAME-seedN)")
    p.add_argument("--lightmem-seed-baseline", default=None,
                   help="LightMem Table 8: the label of the baseline's seed runs (default: naive_rag)")
    p.set_defaults(func=command, user_errors=user_errors)


def user_errors() -> tuple[type[Exception], ...]:
    from memfit_gpu.evaluate.paper_tables import TablesError  # a run or sweep the tables cannot use

    return (TablesError,)


def command(args: argparse.Namespace) -> int:
    from memfit_gpu.evaluate import lightmem_tables
    from memfit_gpu.evaluate.paper_tables import (
        ABLATION_BASELINE,
        SENSITIVITY_BASELINE,
        build_tables,
        write_tables,
    )

    args.ablation_baseline = args.ablation_baseline or ABLATION_BASELINE
    args.sensitivity_baseline = args.sensitivity_baseline or SENSITIVITY_BASELINE
    args.lightmem_seed_baseline = args.lightmem_seed_baseline or lightmem_tables.SEED_BASELINE
    tables = build_tables(args) + lightmem_tables.build_tables(args)
    if not tables:
        raise UsageError("name at least one table option (see --help)")
    files = write_tables(tables, args.out)
    print("\n".join(t.markdown() for t in tables))
    print(json.dumps({"tables": [t.key for t in tables], "files": files}))
    return 0
