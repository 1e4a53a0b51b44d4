"""`memfit report`: one self-contained HTML file of finished runs, with a per-question viewer."""

from __future__ import annotations

import argparse

DESCRIPTION = """\
Write one HTML file (no network, no server: open it from disk) of one or more finished run directories:
  - each run's provenance, configuration (the keys the runs differ in), ledger cost and stage times;
  - the results table per category with 95 % bootstrap intervals, and for two runs or more each run
    against the first as `memfit compare` tests it (gained / lost questions, p-value);
  - the failure attribution per category: each question answered correctly, evidence not retrieved
    (no evidence turn in the first --top-n of the method's ranking), retrieved but cut from the pack,
    in the pack but the reader missed it, or no evidence annotated; correct = the judge's verdict
    where the run judged the question, else F1 >= 0.5 (memfit_gpu/evaluate/attribution.py);
  - a per-question viewer (filters by category, outcome and run): gold answer, each run's prediction,
    score, verdict and judge reply, the pack as the reader saw it with the evidence turns marked and
    their rank;
  - figures: scores per category, accuracy against tokens, cost and latency (the frontier), accuracy
    and prompt tokens against the pack depth (runs with eval.pack_cutoffs), and the latency
    percentiles of an experiments/bench_online.py JSON (--online).
The file keeps under --max-mb: when the pack texts would pass it, excerpts are trimmed (evidence last),
each with a note; packs.jsonl keeps every text."""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "report", help="self-contained HTML report of runs: results, comparison, failure attribution, per-question viewer",
        description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="finished run directories (the first is the baseline)")
    parser.add_argument("--out", required=True, help="the HTML file to write")
    parser.add_argument("--online", metavar="JSON", help="experiments/bench_online.py's JSON: latency percentiles")
    parser.add_argument("--top-n", type=int, default=30,
                        help="an evidence turn this far down the method's ranking counts as retrieved (default 30)")
    parser.add_argument("--max-mb", type=float, default=20.0, help="the file's size limit in MB (default 20)")
    parser.add_argument("--price-model", default="gpt-4.1-mini",
                        help="hosted model whose list price estimates the cost (configs/prices.yaml)")
    parser.add_argument("--prices", help="price table (default configs/prices.yaml)")
    parser.add_argument("--title", help="the page's title (default: the runs' names)")
    parser.set_defaults(func=run, user_errors=user_errors)


def user_errors() -> tuple[type[Exception], ...]:
    from memfit_gpu.report import ReportError

    # a directory that is not a scored run, a malformed file (named), a report that cannot keep its size limit
    return (ReportError,)


def run(args: argparse.Namespace) -> int:
    from memfit_gpu.report import build_report

    report = build_report(args.runs, args.out, online=args.online, top_n=args.top_n,
                          max_bytes=int(args.max_mb * 1024 * 1024), price_model=args.price_model,
                          prices_path=args.prices, title=args.title)
    trimmed = (f"; {report.trimmed} of {report.excerpts} excerpts trimmed to {report.cap} characters"
               if report.trimmed else f"; {report.excerpts} excerpts, all whole")
    print(f"memfit report: {report.path} ({report.bytes / 1024 / 1024:.2f} MB of the {args.max_mb:g} MB limit"
          f"{trimmed})")
    return 0
