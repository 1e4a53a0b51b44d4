"""`memfit efficiency`: the efficiency table of finished runs, any method."""

from __future__ import annotations

import argparse

DESCRIPTION = """\
One row per finished run directory (any method: memfit, plain, naive_rag, full_context, lightmem_slm, mem0),
from what the run wrote (memfit_gpu/evaluate/efficiency.py says where each number comes from):
  method, reader            config.yaml (`method` absent = memfit)
  write_* / read_*          LLM calls (generated + cached) and tokens (generated calls only) of the
                            ledger's write phase (summary, mtm_summary, consolidate, mem0_write) and
                            read phase (answer, rewrite, rerank_slm, mem0_read); the judge is evaluation
                            and left out
  cached                    requests served from the response cache (their tokens are not counted)
  build_s                   timings.json build + summaries
  latency_s_per_question    (timings.json retrieve + the answer role's wall time in ledger.json) /
                            questions: a mean over one batched pass, not a single question's latency
  gpu_seconds, ledger_usd   the ledger's (local backends cost 0 there); ledger_usd is n/a (empty in the
                            CSV) when a hosted model has no price in the price table
  unpriced_models           those models
  est_usd                   write and read tokens at --price-model's list price (configs/prices.yaml)
The same rows are the paper tables' `efficiency_methods` (experiments/paper_tables.py --efficiency)."""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "efficiency", help="efficiency table of finished runs: LLM calls and tokens (write / read), time, cost",
        description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="finished run directories (any method)")
    parser.add_argument("--price-model", default="gpt-4.1-mini",
                        help="hosted model whose list price estimates the cost (configs/prices.yaml)")
    parser.add_argument("--prices", help="price table (default configs/prices.yaml)")
    parser.add_argument("--csv", help="also write the table as CSV to this file")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from memfit_gpu.evaluate.efficiency import COLUMNS, efficiency_table
    from memfit_gpu.files import write_output
    from memfit_gpu.render import csv_text, markdown_table

    rows = efficiency_table(args.runs, args.price_model, args.prices)
    # an unknown ledger cost says so: an empty cell beside a priced run's would read as nothing paid
    cells = [["n/a" if c == "ledger_usd" and row["unpriced_models"] else "" if row[c] is None else str(row[c])
              for c in COLUMNS] for row in rows]
    print(markdown_table(COLUMNS, cells, align=["left"] * 3 + ["right"] * (len(COLUMNS) - 3)), end="")
    if args.csv:
        write_output(args.csv, csv_text(COLUMNS, [[row[c] for c in COLUMNS] for row in rows]))
    return 0
